#!/usr/bin/env bash
# A reference run on one GPU node: the acceptance tier, once per DeepSpeed version, written in
# the layout of results/reference/ (its README.md says what each folder holds).
#
#   examples/reference-run.sh OUT [VERSION...]
#
# For each DeepSpeed VERSION (default: the installed one, or the bundle's newest) it runs
#   python3 -m pytest suites -m gpu --profile "$DSCONFORM_PROFILE" --results WORK/KIND/ds-VERSION
# from the checkout that holds this script, and writes
#   OUT/KIND/ds-VERSION/summary.json, summary.txt   what passed, failed, skipped (and why)
#   OUT/KIND/ds-VERSION/benchmarks.json             every measurement and outcome, the input of
#                                                   `dsconform compare` (stored without indentation)
#   OUT/KIND/ds-VERSION/junit.xml                   where it is under 100 KiB
# and, given two versions or more, the upgrade comparison of the first against the last:
#   OUT/KIND/upgrade-FIRST-to-LAST/comparison.md, comparison.png    (`dsconform compare`)
# The whole of each run (junit.xml, records.jsonl, pytest's log) stays under WORK. KIND is the
# node type: DSCONFORM_KIND, default the GPU model and count (h200-x2 for 2x NVIDIA H200).
# To refresh the repository's references: OUT = results/reference, then update its README.md.
#
# Settings (environment):
#   DSCONFORM_PROFILE   the node type's hardware profile (default auto: a shipped profile that
#                       matches the hardware, else the detected one, which sets no floors)
#   DSCONFORM_BUNDLE    a `dsconform bundle` folder (a node without a package registry): each
#                       VERSION is installed from it into a site of its own
#                       (examples/offline-node.sh). Without it only the installed DeepSpeed runs.
#                       The bundle's dsconform wheel is the one that runs: rebuild the bundle
#                       (`dsconform bundle`) after changing the checkout
#   DSCONFORM_KIND      the node type's folder name under OUT (default: from the GPUs)
#   DSCONFORM_WORKDIR   node-local folder for the runs (default ${TMPDIR:-/tmp}/dsconform-reference)
#   DSCONFORM_CACHE     where JIT-built DeepSpeed ops are kept (default WORK/cache); each version
#                       gets DSCONFORM_CACHE/ds-VERSION, so versions never rebuild each other's
#   DSCONFORM_COLD=1    empty each version's op cache first (one this script made): the run then
#                       includes the op builds, as on a fresh node
#   DSCONFORM_TIME_S    bound of each pytest run (default 900 s): SIGINT at the bound, so pytest
#                       still writes its results; the summary then says what did not run
#   DSCONFORM_PACK      also write this .tgz of OUT/KIND (for a node that returns one file)
#   TORCH_CUDA_ARCH_LIST  default: the GPUs' compute capability (9.0 on H200). An
#                       architecture-specific suffix (9.0a, as some images set it) is dropped:
#                       DeepSpeed 0.19.6-0.19.8 fail every JIT op build on it
#                       (docs/findings.md#op-builds)
#   PYTHON              the interpreter that has torch (default python3)
# Exit status: 0 every run conformed; 1 a run failed a test; 2 a run or a step did not complete.
set -euo pipefail

usage="usage: reference-run.sh OUT [VERSION...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
suite=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
work=${DSCONFORM_WORKDIR:-${TMPDIR:-/tmp}/dsconform-reference}
mkdir -p "$work"
work=$(cd "$work" && pwd)
bundle=${DSCONFORM_BUNDLE:-}
[ -z "$bundle" ] || bundle=$(cd "$bundle" && pwd)
cache_root=${DSCONFORM_CACHE:-$work/cache}
limit=${DSCONFORM_TIME_S:-900}
cd "$suite"

# A single-node run must not look like one rank of a job (the harness would join it).
unset MASTER_ADDR MASTER_PORT
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
export DSCONFORM_HYPOTHESIS_DIR=$work/hypothesis  # hypothesis's database, not in the checkout

die() { echo "reference-run: $*" >&2; exit 2; }

# bounded SECONDS SITE CMD...: CMD in the environment of SITE (a folder offline-node.sh
# installed; empty: this shell's), stopped with SIGINT after SECONDS (SIGKILL 60 s later).
bounded() {
    local secs=$1 site=$2
    shift 2
    timeout -s INT -k 60 "$secs" bash -c \
        '[ -z "$1" ] || source "$1/env.sh"; shift; exec "$@"' bounded "$site" "$@"
}

# The node type and the GPUs' architecture, from torch (which is on the node before any install).
read -r gpu_kind gpu_arch < <(bounded 120 "" "$python" - <<'EOF'
import re
import torch

n = torch.cuda.device_count()
if n == 0:
    raise SystemExit("reference-run: torch sees no GPU (CUDA_VISIBLE_DEVICES, driver?)")
name = torch.cuda.get_device_name(0)
m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)  # "NVIDIA H200" -> H200
model = (m.group(1) if m else re.sub(r"\W+", "-", name)).lower()
print(f"{model}-x{n}", "%d.%d" % torch.cuda.get_device_capability(0))
EOF
) || die "could not read the GPUs with $python and torch"
kind=${DSCONFORM_KIND:-$gpu_kind}
if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9]+\.[0-9]+)[af]/\1/g' <<< "$TORCH_CUDA_ARCH_LIST")
else
    TORCH_CUDA_ARCH_LIST=$gpu_arch
fi
export TORCH_CUDA_ARCH_LIST

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    if [ -n "$bundle" ]; then
        versions=("$(ls "$bundle/deepspeed" | sort -V | tail -n 1)")
    else
        versions=("$(bounded 60 "" "$python" -c \
            'import importlib.metadata as m; print(m.version("deepspeed"))')") \
            || die "no DeepSpeed installed: install one, or give DSCONFORM_BUNDLE"
    fi
fi
echo "reference-run: node type $kind, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST," \
     "DeepSpeed ${versions[*]}, profile ${DSCONFORM_PROFILE:-auto}; results in $out/$kind"

worst=0
for v in "${versions[@]}"; do
    site=""
    if [ -n "$bundle" ]; then
        site=$work/site-$v
        echo "== DeepSpeed $v: installing from $bundle into $site"
        DSCONFORM_SITE=$site bounded 900 "" bash -c \
            'source "$1" --deepspeed "$2" "$3"' install "$suite/examples/offline-node.sh" \
            "$v" "$bundle" > "$work/setup-$v.log" 2>&1 \
            || { tail -n 20 "$work/setup-$v.log" >&2; die "DeepSpeed $v did not install"; }
    fi
    found=$(bounded 60 "$site" "$python" -c \
        'import importlib.metadata as m; print(m.version("deepspeed"))') || found=none
    [ "$found" = "$v" ] || die "DeepSpeed $v asked for, $found installed (DSCONFORM_BUNDLE" \
        "installs another version)"

    export DSCONFORM_CACHE=$cache_root/ds-$v
    if [ "${DSCONFORM_COLD:-0}" = 1 ] && [ -f "$DSCONFORM_CACHE/.dsconform-reference" ]; then
        rm -rf "$DSCONFORM_CACHE"
    fi
    mkdir -p "$DSCONFORM_CACHE" && touch "$DSCONFORM_CACHE/.dsconform-reference"

    res=$work/$kind/ds-$v
    rm -rf "$res" && mkdir -p "$res"
    echo "== DeepSpeed $v: the acceptance tier (bound $limit s), log in $res.log"
    t0=$(date +%s)
    status=0
    bounded "$limit" "$site" "$python" -m pytest suites -m gpu -p no:cacheprovider -rfEsx \
        --profile "${DSCONFORM_PROFILE:-auto}" --benchmark-storage "file://$work/benchmarks" \
        --results "$res" > "$res.log" 2>&1 || status=$?
    echo "   pytest exit $status after $(( $(date +%s) - t0 )) s: $(tail -n 1 "$res.log")"
    [ "$status" -le 1 ] || worst=2
    [ "$status" -ne 1 ] || [ "$worst" -eq 2 ] || worst=1

    dst=$out/$kind/ds-$v
    mkdir -p "$dst"
    for f in summary.json summary.txt benchmarks.json; do
        [ -f "$res/$f" ] || die "pytest wrote no $f (see $res.log)"
    done
    cp "$res/summary.json" "$res/summary.txt" "$dst/"
    bounded 120 "" "$python" -c 'import json, sys
json.dump(json.load(open(sys.argv[1])), open(sys.argv[2], "w"), separators=(",", ":"))' \
        "$res/benchmarks.json" "$dst/benchmarks.json"
    rm -f "$dst/junit.xml"
    if [ -f "$res/junit.xml" ] && [ "$(stat -c %s "$res/junit.xml")" -lt 102400 ]; then
        cp "$res/junit.xml" "$dst/"
    fi
done

if [ ${#versions[@]} -ge 2 ]; then
    first=${versions[0]} last=${versions[${#versions[@]}-1]}
    cmp=$out/$kind/upgrade-$first-to-$last
    mkdir -p "$cmp"
    plot=(--plot "$cmp/comparison.png")
    bounded 60 "" "$python" -c 'import matplotlib' 2>/dev/null \
        || { plot=(); echo "reference-run: no matplotlib here: comparison.png not drawn" >&2; }
    echo "== the upgrade comparison, DeepSpeed $first -> $last, in $cmp"
    status=0
    bounded 300 "" "$python" -m dsconform.cli compare "$out/$kind/ds-$first" \
        "$out/$kind/ds-$last" --markdown "$cmp/comparison.md" "${plot[@]}" \
        > "$work/$kind/compare.log" 2>&1 || status=$?
    # 1: something regressed between the versions, which is what the comparison is for.
    [ "$status" -le 1 ] || { cat "$work/$kind/compare.log" >&2; die "dsconform compare failed"; }
    sed -n 3p "$cmp/comparison.md"
fi

if [ -n "${DSCONFORM_PACK:-}" ]; then
    timeout -s INT -k 30 300 tar -C "$out" -czf "$DSCONFORM_PACK" "$kind"
    echo "reference-run: packed $out/$kind into $DSCONFORM_PACK"
fi
exit "$worst"
