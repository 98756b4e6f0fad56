#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9), fourth call: GPU-MATMUL-1 with the clock event reasons read
# under load, and GPU-MATMUL-2 (30 s sustained per dtype), nightly selection.
set -uo pipefail
DS=0.19.8 source results/reference/lib.sh || exit 1
part matmul 200 suites/test_collectives.py -m gpu --nightly -k matmul
nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER > "$res/nvidia-smi-after.txt" 2>&1
pack
