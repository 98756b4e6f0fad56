#!/usr/bin/env bash
# GDS file I/O (NVME-GDS-2, first run) and the project's GDS red test on the lent 1xH200 kind,
# from the repository root, with the offline bundle in .whl/. Logs and results land in $OUT
# (results as one tarball: the device returns a limited number of files).
#   bash results/reference/h200-x1/gds-io-2026-12-01/run.sh
set -uo pipefail
here=results/reference/h200-x1/gds-io-2026-12-01
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
        > "$out/$name.log" 2>&1
    echo "== $name: exit $?, $(( $(date +%s) - t0 )) s"; tail -3 "$out/$name.log"
}
part gds-suite 300 suites/test_profile.py suites/test_ops.py suites/test_deepnvme.py -m gpu \
    --profile "$here/h200-x1-gds.toml" -k "profile or gds or async_io or test_ops"
part gds-red 200 tests/test_deepnvme_red.py -k gds
ls /tmp/dsconform-out 2>/dev/null | head -0
cat /usr/local/cuda/gds/cufile.json 2>/dev/null | grep -n "allow_compat_mode" | head -3 > "$out/cufile-compat.txt"
(lsmod 2>/dev/null | grep -i nvidia_fs; df -T /tmp | tail -1) > "$out/node-facts.txt" 2>&1
tar -C "$res" -czf "$out/results.tgz" .
