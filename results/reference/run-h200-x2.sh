#!/usr/bin/env bash
# The reference runs behind results/reference/h200-x2/, on the lent 2xH200 node (no package
# registry), from the repository root, with the offline bundle carried in .whl/ (see README,
# "Air-gapped nodes": DeepSpeed 0.19.8 and 0.19.6 wheels, what the image lacks, the suite's own
# wheel for its pytest entry point, libaio .debs).
#   bash results/reference/run-h200-x2.sh ds198   # the whole acceptance tier, cold then warm
#   bash results/reference/run-h200-x2.sh ds196   # 1-bit optimizers and the acceptance tier
#   bash results/reference/run-h200-x2.sh pair    # the same selection on 0.19.8 then 0.19.6,
#                                                 # for the upgrade comparison
#   bash results/reference/run-h200-x2.sh cold    # the whole acceptance tier, cold op cache
#   bash results/reference/run-h200-x2.sh warm    # the same again (call right after `cold`: the
#                                                 # machine keeps its op cache while warm), then
#                                                 # xdist with one GPU per worker
#   bash results/reference/run-h200-x2.sh nightly # the nightly tier, timed (warm op cache)
#   bash results/reference/run-h200-x2.sh coldwarm # cold then warm in one call (a lent machine
#                                                  # goes back 30 s after a call), no xdist;
#                                                  # ALT_LANES=N adds a warm pass with N lanes,
#                                                  # NIGHTLY_BUDGET=S the nightly tier after
#                                                  # (stopped by SIGINT at S s; NIGHTLY_BUDGET=rest:T
#                                                  # gives it what is left of T s from the start)
#   PROFILE=auto runs the same parts on another node kind; NIGHTLY_SEL="suites/test_zero.py ..." narrows the nightly tier (default: every suite)
# Everything lands in $OUT: a log and a tarball of the results per part.
set -uo pipefail
start=$(date +%s)
profile=${PROFILE:-h200-x2}  # PROFILE=auto: another node kind (the 1xH200 kind, say)
part=${1:?usage: run-h200-x2.sh ds198|ds196|pair|cold|warm|coldwarm|nightly}
out=${OUT:-/tmp/dsconform-out}
mkdir -p "$out"
exec > >(tee "$out/$part.log") 2>&1
res=/tmp/dsconform-results/$part
mkdir -p "$res"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci TORCH_CUDA_ARCH_LIST=9.0
pytest=(python3 -m pytest -p no:cacheprovider -rfEsx)
budget() { timeout -s INT -k 20 "$@"; }  # SIGINT: pytest still writes its results
stamp() { echo "== $1: $(( $(date +%s) - $2 )) s"; }
setup() {  # DeepSpeed VERSION from the bundle, with a cold op cache of its own
    local t0; t0=$(date +%s)
    export DSCONFORM_CACHE=/tmp/dsconform-cache-$1
    source examples/offline-node.sh --deepspeed "$1" .whl || exit 1
    echo "== setup of DeepSpeed $1 took $(( $(date +%s) - t0 )) s"
}
if [ "$part" = pair ]; then
    # The suites that pin semantics and the 1-bit optimizers, once per DeepSpeed version, with
    # the identical command (a comparison lists tests present in one run only as not run).
    sel=(suites/test_profile.py suites/test_ops.py suites/test_collectives.py suites/test_zero.py
         suites/test_loss_scaling.py suites/test_onebit.py -m gpu --profile "$profile" --durations=15)
    setup 0.19.8
    echo "== auto with no usable GPU (CUDA_VISIBLE_DEVICES=): must fail naming 2 present, 0 usable"
    CUDA_VISIBLE_DEVICES= budget 60 "${pytest[@]}" suites -m gpu -x --results "$res/unusable"
    echo "exit status $? (expected 1)"
    for v in 0.19.8 0.19.6; do
        [ "$v" = 0.19.6 ] && setup 0.19.6
        t=$(date +%s)
        budget 250 "${pytest[@]}" "${sel[@]}" --results "$res/ds-$v"
        echo "exit status $?"; stamp "selection on DeepSpeed $v" "$t"
    done
    tar -C /tmp/dsconform-results -czf "$out/$part.tgz" "$part"
    exit 0
fi
if [ "$part" = coldwarm ]; then
    export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.8
    rm -rf "$DSCONFORM_CACHE"
    setup 0.19.8
    nvidia-smi > "$res/nvidia-smi.txt" 2>&1
    # ALT_LANES=N: a third pass, warm, with DSCONFORM_LANES=N (lane count compared on one machine)
    for pass in cold warm ${ALT_LANES:+warm-lanes$ALT_LANES}; do
        echo "== acceptance tier, $pass op cache"
        t=$(date +%s)
        [ "$pass" = cold ] && b=${COLD_BUDGET:-300} || b=${WARM_BUDGET:-200}
        lanes=auto; [ "${pass#warm-lanes}" != "$pass" ] && lanes=${pass#warm-lanes}
        DSCONFORM_LANES=$lanes budget "$b" "${pytest[@]}" suites -m gpu --profile "$profile" \
            --results "$res/$pass" --durations=40
        echo "exit status $?"; stamp "acceptance, $pass" "$t"
    done
    if [ -n "${NIGHTLY_BUDGET:-}" ]; then  # then the whole nightly tier, warm, within the budget
        nb=$NIGHTLY_BUDGET
        [ "${nb#rest:}" != "$nb" ] && nb=$(( ${nb#rest:} - $(date +%s) + start ))
        echo "== nightly tier (${NIGHTLY_SEL:-every suite}), warm op cache, budget $nb s"
        t=$(date +%s)
        # shellcheck disable=SC2086
        budget "$nb" "${pytest[@]}" ${NIGHTLY_SEL:-suites} -m gpu --nightly --profile "$profile" \
            --results "$res/nightly" --durations=20
        echo "exit status $?"; stamp "nightly" "$t"
    fi
    tar -C /tmp/dsconform-results -czf "$out/$part.tgz" "$part"
    exit 0
fi
if [ "$part" = cold ] || [ "$part" = warm ] || [ "$part" = nightly ]; then
    export DSCONFORM_CACHE=/tmp/dsconform-cache-0.19.8
    if [ "$part" = cold ]; then
        rm -rf "$DSCONFORM_CACHE"
        setup 0.19.8
        nvidia-smi > "$res/nvidia-smi.txt" 2>&1
    else
        # shellcheck source=/dev/null
        if ! source "${DSCONFORM_SITE:-/tmp/dsconform-site}/env.sh" 2>/dev/null; then
            # A fresh machine: set up, and warm the op cache with the ops suite alone.
            setup 0.19.8
            t=$(date +%s)
            budget 240 "${pytest[@]}" suites/test_ops.py -m gpu --profile "$profile" \
                --results "$res/ops-cold"
            echo "exit status $?"; stamp "ops suite, cold op cache" "$t"
        fi
    fi
    python3 -c "import deepspeed, sys; print('== deepspeed', deepspeed.__version__, sys.version)"
    t=$(date +%s)
    case $part in
    cold|warm)
        echo "== acceptance tier, $part op cache"
        budget "${BUDGET:-400}" "${pytest[@]}" suites -m gpu --profile "$profile" \
            --results "$res/accept" --durations=30
        echo "exit status $?"; stamp "acceptance, $part" "$t"
        if [ "$part" = warm ] && [ "${XDIST:-1}" = 1 ]; then
            echo "== xdist, one GPU per worker (-n 2): ZeRO and collectives"
            t=$(date +%s)
            budget 150 "${pytest[@]}" suites/test_zero.py suites/test_collectives.py -m gpu \
                --profile "$profile" -n 2 --results "$res/xdist-n2"
            echo "exit status $?"; stamp "xdist -n 2" "$t"
        fi ;;
    nightly)
        echo "== nightly tier (${NIGHTLY_SEL:-every suite})"
        # shellcheck disable=SC2086
        budget "${BUDGET:-480}" "${pytest[@]}" ${NIGHTLY_SEL:-suites} -m gpu --nightly \
            --profile "$profile" --results "$res/nightly" --durations=30
        echo "exit status $?"; stamp "nightly" "$t" ;;
    esac
    tar -C /tmp/dsconform-results -czf "$out/$part.tgz" "$part"
    exit 0
fi
version=${part#ds}; version="0.${version:0:2}.${version:2}"
setup "$version"

if [ "$part" = ds198 ]; then
    nvidia-smi > "$res/nvidia-smi.txt" 2>&1
    python3 -m dsconform.cli detect > "$res/detected.toml"
    echo "== acceptance tier, cold op cache"
    t=$(date +%s)
    budget 330 "${pytest[@]}" suites -m gpu --profile "$profile" --results "$res/accept-cold" \
        --durations=25
    echo "exit status $?"; stamp "acceptance, cold" "$t"
    echo "== acceptance tier, warm op cache"
    t=$(date +%s)
    budget 200 "${pytest[@]}" suites -m gpu --profile "$profile" --results "$res/accept-warm" \
        --durations=10
    echo "exit status $?"; stamp "acceptance, warm" "$t"
else
    echo "== acceptance tier on DeepSpeed $version (cold op cache), 1-bit optimizers included"
    t=$(date +%s)
    budget 420 "${pytest[@]}" suites -m gpu --profile "$profile" --results "$res/accept" \
        --durations=25
    echo "exit status $?"; stamp "acceptance $version" "$t"
fi
tar -C /tmp/dsconform-results -czf "$out/$part.tgz" "$part"
