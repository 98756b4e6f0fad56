#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9), last call, after the review mend of ClockEvents (NVML opened
# through detect.nvml_devices) and layout_problems: matmul under load and sustained, the
# profile suite (PROF-GPU-6 reads the same clock-event call), and the acceptance ZeRO cells;
# the profile suite also with values after a space from another directory.
set -uo pipefail
DS=0.19.8 source results/reference/lib.sh || exit 1
part matmul 150 suites/test_collectives.py -m gpu --nightly -k matmul
part zero 120 suites/test_zero.py -m gpu
mkdir -p /tmp/sp-scratch /tmp/sp-results
repo=$PWD
(cd /tmp && timeout -s INT 120 python3 -m pytest -p no:cacheprovider "$repo/suites/test_profile.py" \
    -m gpu --scratch /tmp/sp-scratch --results /tmp/sp-results > "$res/profile-space.log" 2>&1
 echo "== profile (values after a space, from /tmp): exit $?"; tail -1 "$res/profile-space.log"
 ls /tmp/sp-results > "$res/profile-space-results.txt")
pack
