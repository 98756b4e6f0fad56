# Shared by the reference run scripts (source it from the repository root on the GPU node, with
# the offline bundle in .whl/): sets up DeepSpeed from the bundle and defines `part`, which runs
# one bounded pytest into $res/NAME (SIGINT at its budget, so pytest still writes its results),
# and `pack`, which tars $res into one file under $OUT (the device returns a limited number of
# files). Usage: DS=0.19.8 source results/reference/lib.sh || exit 1
out=${OUT:-/tmp/dsconform-out}
res=${RES:-/tmp/dsconform-results}
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci TORCH_CUDA_ARCH_LIST=9.0
export DSCONFORM_CACHE=/tmp/dsconform-cache-${DS:-0.19.8}
source examples/offline-node.sh --deepspeed "${DS:-0.19.8}" .whl > "$out/setup.log" 2>&1 || {
    tail -20 "$out/setup.log"; return 1; }
part() {  # NAME BUDGET_S PYTEST_ARGS...
    local name=$1 secs=$2 t0; shift 2; t0=$(date +%s)
    timeout -s INT -k 20 "$secs" python3 -m pytest -p no:cacheprovider -rfEsx "$@" \
        --results "$res/$name" > "$res/$name.log" 2>&1
    echo "== $name: exit $?, $(( $(date +%s) - t0 )) s"; tail -2 "$res/$name.log"
}
pack() { tar -C "$res" -czf "$out/results.tgz" .; }
