#!/usr/bin/env bash
# The session's last 1xH200 call (2026-12-01), from the repository root with the offline bundle
# in .whl/. Results land in $OUT as one tarball (the device returns a limited number of files).
#   ops:        the ops suite with fused_adam/cpu_adam/async_io/gds promised (the optimizer checks'
#               new gradients, which reach eps, on the GPU), cold op cache
#   gds-path:   NVME-GDS-1/2 with @scratch promised as a GDS path (expected: NVME-GDS-2 fails,
#               naming the file refusal and nvidia-fs); the GDS red test (expected: skipped)
#   accept:     the whole acceptance tier, auto profile, warm op cache
set -uo pipefail
here=results/reference/h200-x1/final-2026-12-01
out=${OUT:-/tmp/dsconform-out}
res=/tmp/dsconform-results
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci TORCH_CUDA_ARCH_LIST=9.0
export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.8
source examples/offline-node.sh --deepspeed 0.19.8 .whl > "$out/setup.log" 2>&1 || exit 1
budget() { timeout -s INT -k 20 "$@"; }  # SIGINT: pytest still writes its results
part() {  # NAME BUDGET_S ARGS...
    local name=$1 secs=$2 t0; shift 2; t0=$(date +%s)
    budget "$secs" python3 -m pytest -p no:cacheprovider -rfEsx "$@" --results "$res/$name" \
        > "$res/$name.log" 2>&1
    echo "== $name: exit $?, $(( $(date +%s) - t0 )) s"; tail -2 "$res/$name.log"
}
P="$here/h200-x1-gds-path.toml"
part ops 200 suites/test_ops.py -m gpu --profile "$P"
part gds-path 120 suites/test_deepnvme.py -m gpu --profile "$P" -k gds
part gds-red 60 tests/test_deepnvme_red.py -k gds
part accept 270 suites -m gpu
(lsmod 2>/dev/null | grep -c nvidia_fs; ls /proc/driver/nvidia-fs 2>&1) > "$res/nvidia-fs.txt"
tar -C "$res" -czf "$out/results.tgz" .
