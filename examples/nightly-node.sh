#!/usr/bin/env bash
# One node's part of the nightly acceptance run (examples/nightly-slurm.sbatch and
# examples/nightly-pdsh.sh call it on every node; you rarely call it by hand):
#
#   nightly-node.sh single RESULTS [PYTEST ARGS...]
#       stage 1: the single-node suite on this node, into RESULTS/<node>
#       (default PYTEST ARGS: suites -m gpu)
#   nightly-node.sh rank RESULTS [PYTEST ARGS...]
#       stage 2: this process is one rank of the multi-node tier, started by srun or torchrun
#       (--no-python); into RESULTS/<node>-rank<RANK> (default PYTEST ARGS: suites -m multinode)
#   nightly-node.sh build-ops RESULTS [OP...]
#       before stage 1, once: `dsconform build-ops` builds the ops the run needs (default: the
#       profile's and those the suites load) into the op cache, DSCONFORM_CACHE, which the
#       nodes share: stage 1 then starts warm on every node. Its output: RESULTS/build-ops.log
#
# <node> is Slurm's node name ($SLURMD_NODENAME) where there is one, else `hostname -s`: the name
# `dsconform aggregate` prints drain commands for. Settings (environment):
#   DSCONFORM_PROFILE   the node type's hardware profile (default auto; CHANGE for your fleet)
#   DSCONFORM_CACHE     the op cache (default ~/.cache/dsconform): a folder every node mounts to
#                       build the ops once (stage build-ops) for all of them
#   DSCONFORM_BUNDLE    an air-gapped node: the `dsconform bundle` folder to install from first
#   DSCONFORM_DEEPSPEED the bundle's DeepSpeed version to install (default: its newest)
#   DSCONFORM_TIME_S    stop pytest (SIGINT: it still writes its results) after this many seconds
#                       (default 3600); the summary then says how many tests did not run, and
#                       `dsconform aggregate` fails the node ("interrupted")
#   DSCONFORM_WORKDIR   node-local folder for what pytest would write into the checkout
#                       (pytest-benchmark's storage, hypothesis's example database; default
#                       ${TMPDIR:-/tmp}/dsconform-nightly-<node>-<stage><rank>): the shared checkout
#                       may be read-only, and nodes never write to it at once
#   PYTHON              the interpreter that has torch (default python3)
# pytest runs in the checkout: PYTEST ARGS and relative paths (RESULTS, a profile file) are taken
# relative to it, as before.
set -uo pipefail
stage=${1:?usage: nightly-node.sh single|rank|build-ops RESULTS [PYTEST ARGS...]}
results=${2:?usage: nightly-node.sh single|rank|build-ops RESULTS [PYTEST ARGS...]}
shift 2
suite=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
node=${SLURMD_NODENAME:-$(hostname -s)}
python=${PYTHON:-python3}
cd "$suite" || exit 2

case $stage in
    single)
        # A single-node run must not look like one rank of a job: run_ranks would join it.
        unset MASTER_ADDR MASTER_PORT
        out=$results/$node
        [ $# -gt 0 ] || set -- suites -m gpu ;;
    rank)
        rank=${RANK:-${SLURM_PROCID:?stage rank runs under srun or torchrun (RANK/SLURM_PROCID)}}
        out=$results/$node-rank$rank
        [ $# -gt 0 ] || set -- suites -m multinode ;;
    build-ops)
        unset MASTER_ADDR MASTER_PORT
        out=$results ;;
    *)
        echo "nightly-node.sh: unknown stage '$stage' (single, rank or build-ops)" >&2
        exit 2 ;;
esac

if [ -n "${DSCONFORM_BUNDLE:-}" ]; then
    # Each rank of a node installs into its own site, so that ranks do not race. build-ops
    # installs where stage single does: the op cache is keyed by where DeepSpeed is installed.
    slot=${stage/build-ops/single}-${LOCAL_RANK:-${SLURM_LOCALID:-0}}
    export DSCONFORM_SITE=${DSCONFORM_SITE:-/tmp/dsconform-site-$slot}
    export DSCONFORM_LIBAIO=${DSCONFORM_LIBAIO:-/tmp/dsconform-libaio-$slot}
    # shellcheck source=/dev/null
    source "$DSCONFORM_BUNDLE/install.sh" ${DSCONFORM_DEEPSPEED:-} > /dev/null || exit 2
fi

if [ "$stage" = build-ops ]; then
    mkdir -p "$out" || exit 2
    # Exit 0 all built, 1 a build failed (its diagnosis in the log), 2 bad input.
    "$python" -m dsconform.cli build-ops --profile "${DSCONFORM_PROFILE:-auto}" "$@" \
        > "$out/build-ops.log" 2>&1
    status=$?
    echo "nightly-node.sh: build-ops on $node: exit $status, log in $out/build-ops.log"
    exit $status
fi

work=${DSCONFORM_WORKDIR:-${TMPDIR:-/tmp}/dsconform-nightly-$node-$stage${rank:-}}
mkdir -p "$out" "$work" || exit 2
export DSCONFORM_HYPOTHESIS_DIR=$work/hypothesis  # hypothesis's database, not in the checkout
limit=${DSCONFORM_TIME_S:-3600}
timeout -s INT -k 120 "$limit" \
    "$python" -m pytest "$@" -p no:cacheprovider --profile "${DSCONFORM_PROFILE:-auto}" \
    --benchmark-storage "file://$work/benchmarks" --results "$out" > "$out/pytest.log" 2>&1
status=$?
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "nightly-node.sh: $stage on $node: stopped at the time limit (DSCONFORM_TIME_S=$limit s;" \
         "exit $status), the results so far in $out" >&2
else
    echo "nightly-node.sh: $stage on $node: pytest exit $status, results in $out"
fi
exit $status
