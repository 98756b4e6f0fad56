#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9), third call: the ZeRO nightly matrix with the per-tensor gain
# (Tol.tensor_gain), to measure it on a GPU (zero.tensor_gain_dev per cell).
set -uo pipefail
DS=0.19.8 source results/reference/lib.sh || exit 1
part zero 280 suites/test_zero.py -m gpu --nightly
pack
