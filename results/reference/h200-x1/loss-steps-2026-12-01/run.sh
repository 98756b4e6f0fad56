#!/usr/bin/env bash
# The loss-scaling suite (LOSS-SCALE-7, the size of applied steps, first GPU run) on the lent
# 1xH200 kind, from the repository root, with the offline bundle in .whl/ (README,
# "Air-gapped nodes"). Everything lands in $OUT: a log and the results folder per part.
#   bash results/reference/h200-x1/loss-steps-2026-12-01/run.sh
set -uo pipefail
here=results/reference/h200-x1/loss-steps-2026-12-01
out=${OUT:-/tmp/dsconform-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci TORCH_CUDA_ARCH_LIST=9.0
pytest=(python3 -m pytest -p no:cacheprovider -rfEsx --profile "$here/h200-x1-ops.toml")
budget() { timeout -s INT -k 20 "$@"; }  # SIGINT: pytest still writes its results
part() {  # NAME BUDGET_S ARGS...: one pytest run, its log and results under $OUT/NAME
    local name=$1 secs=$2 t0; shift 2; t0=$(date +%s)
    budget "$secs" "${pytest[@]}" "$@" --results "$out/$name" > "$out/$name.log" 2>&1
    echo "== $name: exit $?, $(( $(date +%s) - t0 )) s"; tail -3 "$out/$name.log"
}
export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.8
source examples/offline-node.sh --deepspeed 0.19.8 .whl > "$out/setup-0.19.8.log" 2>&1 || exit 1
part accept-0.19.8 200 suites/test_loss_scaling.py -m gpu
part nightly-0.19.8 330 suites/test_loss_scaling.py -m gpu --nightly
export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.6
source examples/offline-node.sh --deepspeed 0.19.6 .whl > "$out/setup-0.19.6.log" 2>&1 || exit 1
part steps-0.19.6 150 suites/test_loss_scaling.py -m gpu --nightly -k applied_steps
