#!/usr/bin/env bash
# The profile suite (PROF-GPU-6/7, PROF-CPU-1, PROF-MEM-1 with the run's own limits) on the lent
# 1xH200 kind, and what the probe read; one tarball in $OUT.
set -uo pipefail
out=${OUT:-/tmp/dsconform-out}
res=/tmp/dsconform-results
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
source examples/offline-node.sh --deepspeed 0.19.8 .whl > "$res/setup.log" 2>&1 || exit 1
python3 -c "from dsconform import detect; print('at start (NVML, before CUDA):', detect.gpu_memory_in_use())" > "$res/facts.txt" 2>&1
timeout -s INT -k 20 120 python3 -m pytest -p no:cacheprovider -rfEsx suites/test_profile.py \
    -m gpu --results "$res/profile" > "$res/profile.log" 2>&1
echo "== profile: exit $?"; tail -2 "$res/profile.log"
python3 -c "import json; print(json.load(open('$res/profile/summary.json'))['node']['gpu_memory_at_start'])" >> "$res/facts.txt" 2>&1
cat "$res/facts.txt"
tar -C "$res" -czf "$out/results.tgz" .
