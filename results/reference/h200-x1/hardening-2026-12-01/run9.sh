#!/usr/bin/env bash
# 1xH200 (2026-12-01, session 9): the profile suite with values after a space, run from /tmp
# (so the installed dsconform wheel from the bundle is what pytest loads), after rebuilding the
# bundle: call 8 ran it with a bundle built before session 8's last changes and failed there.
set -uo pipefail
DS=0.19.8 source results/reference/lib.sh || exit 1
mkdir -p /tmp/sp-scratch /tmp/sp-results
repo=$PWD
(cd /tmp && timeout -s INT 120 python3 -m pytest -p no:cacheprovider "$repo/suites/test_profile.py" \
    -m gpu --scratch /tmp/sp-scratch --results /tmp/sp-results > "$res/profile-space.log" 2>&1
 echo "== profile (values after a space, from /tmp): exit $?"; tail -1 "$res/profile-space.log"
 ls /tmp/sp-results > "$res/profile-space-results.txt")
pack
