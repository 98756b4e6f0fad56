#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9): the hardening changes on a GPU node, DeepSpeed 0.19.8.
#   accept:  the acceptance tier, cold op cache (ZeRO layout evidence on CUDA, known issues
#            matched by their failure patterns, DeepNVMe's after-write page-cache check)
#   nightly: the whole nightly tier warm (every cell a known issue covers on 1 GPU)
set -uo pipefail
DS=0.19.8 source results/reference/lib.sh || exit 1
part accept 270 suites -m gpu
part nightly 270 suites -m gpu --nightly
pack
