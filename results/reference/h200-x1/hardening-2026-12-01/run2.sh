#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9), second call, after the DS-8393 pattern learned gain x scale:
#   nvme:    DeepNVMe with @scratch promised (h200-x1-nvme.toml): throughput floors with the
#            after-write page-cache check, the dd cross-check, ZeRO-Infinity (not GDS)
#   z0steps: the stage-0 LOSS-SCALE-7 cells of the nightly tier (the floor scaler's cell failed
#            call 1: gain 0.25 at scale 4, which the old pattern did not know)
set -uo pipefail
here=results/reference/h200-x1/hardening-2026-12-01
DS=0.19.8 source results/reference/lib.sh || exit 1
part nvme 280 suites/test_deepnvme.py -m gpu --profile "$here/h200-x1-nvme.toml" -k "not gds"
part z0steps 150 suites/test_loss_scaling.py -m gpu --nightly -k "applied_steps and z0"
pack
