#!/usr/bin/env bash
# The acceptance tier with the session's final code on the lent 1xH200 kind (auto profile),
# from the repository root with the offline bundle in .whl/; one tarball in $OUT.
set -uo pipefail
out=${OUT:-/tmp/dsconform-out}
res=/tmp/dsconform-results
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci TORCH_CUDA_ARCH_LIST=9.0
export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.8
source examples/offline-node.sh --deepspeed 0.19.8 .whl > "$res/setup.log" 2>&1 || exit 1
t0=$(date +%s)
timeout -s INT -k 20 300 python3 -m pytest -p no:cacheprovider -rfEsx suites -m gpu \
    --results "$res/accept" > "$res/accept.log" 2>&1
echo "== accept: exit $?, $(( $(date +%s) - t0 )) s"; tail -2 "$res/accept.log"
grep -E "test_no_gpu_slowdown|test_cpu_cores|test_host_memory" "$res/accept.log" | head
python3 -c "from dsconform import detect, gpu_health; print(detect.usable_cpu_cores(), detect.usable_memory_bytes(), gpu_health.read_clock_event_reasons())" > "$res/facts.txt" 2>&1
tar -C "$res" -czf "$out/results.tgz" .
