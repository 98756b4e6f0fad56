#!/usr/bin/env bash
# Prepare a GPU node that has torch but no package registry, from carried files only.
# Source it (it exports the environment the suite runs in):
#
#   source BUNDLE/install.sh [VERSION]                    a folder built by `dsconform bundle`
#                                                         (this script is its install.sh)
#   source examples/offline-node.sh BUNDLE [VERSION]      the same, from a checkout
#   source examples/offline-node.sh --deepspeed VERSION BUNDLE    (the same)
#   source examples/offline-node.sh DEBS WHEELS [WHEELS...]   loose folders, the manual way:
#        DEBS: Debian's libaio1 and libaio-dev .debs; WHEELS: folders of wheels for the node's
#        Python (DeepSpeed and what the node lacks)
#
# VERSION picks one of the bundle's deepspeed/<version>/ wheels (default: the newest). Sourcing
# again with another version replaces the first install.
# What it does: pip installs the wheels with --no-index --no-deps into $DSCONFORM_SITE (default
# /tmp/dsconform-site; nothing is fetched, the node's own site-packages are not touched); unpacks
# libaio from the .debs into $DSCONFORM_LIBAIO (default /tmp/dsconform-libaio); exports
# PYTHONPATH, PATH, CPATH, LIBRARY_PATH and LD_LIBRARY_PATH and writes them to
# $DSCONFORM_SITE/env.sh for later shells; checks every requirement of dsconform, DeepSpeed and
# the carried wheels against the node plus the carried wheels: a missing package fails (exit 1),
# a version outside a requirement is a WARNING naming it (importable: the run can go on).
# The async_io JIT build ignores CFLAGS/LDFLAGS (they only feed ds_report's probe), so a libaio
# outside the system paths is given through CPATH and LIBRARY_PATH, and LD_LIBRARY_PATH at run
# time.
# Then, from a checkout (or from $DSCONFORM_SUITE, default /tmp/dsconform-suite, where a bundle's
# suite.tar.gz is unpacked when the current directory is not a checkout):
#   python3 -m pytest suites -m gpu --results DIR

_dsconform_offline() {
    local here site libaio debs="" bundle="" version="" lib deb
    local -a wheels=() args=()
    while [ $# -gt 0 ]; do
        case $1 in
            --deepspeed)
                [ $# -ge 2 ] || { echo "offline-node: --deepspeed needs a version" >&2; return 2; }
                version=$2; shift 2 ;;
            --deepspeed=*) version=${1#--deepspeed=}; shift ;;
            *) args+=("$1"); shift ;;
        esac
    done
    set -- "${args[@]}"
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    site=${DSCONFORM_SITE:-/tmp/dsconform-site}
    libaio=${DSCONFORM_LIBAIO:-/tmp/dsconform-libaio}
    if [ $# -ge 1 ] && [ -f "$1/MANIFEST.json" ]; then
        bundle=$(cd "$1" && pwd); version=${2:-$version}
    elif [ $# -le 1 ] && [ -f "$here/MANIFEST.json" ] && ! [ -d "${1:-/nonexistent}" ]; then
        bundle=$here; version=${1:-$version}
    fi
    if [ -n "$bundle" ]; then
        if [ -z "$version" ]; then
            version=$(ls "$bundle/deepspeed" | sort -V | tail -n 1)
        fi
        if ! [ -d "$bundle/deepspeed/$version" ]; then
            echo "offline-node: no DeepSpeed '$version' in $bundle/deepspeed (there:" \
                 "$(ls "$bundle/deepspeed" | tr '\n' ' '))" >&2
            return 2
        fi
        debs=$bundle/debs
        wheels=("$bundle"/wheels/*.whl "$bundle/deepspeed/$version"/*.whl)
    else
        if [ $# -lt 2 ]; then
            echo "usage: source install.sh [DEEPSPEED_VERSION] (in a bundle)," \
                 "source examples/offline-node.sh BUNDLE [VERSION]," \
                 "or source examples/offline-node.sh DEBS_DIR WHEELS_DIR [WHEELS_DIR...]" >&2
            return 2
        fi
        debs=$1
        shift
        for d in "$@"; do wheels+=("$d"/*.whl); done
    fi
    for w in "${wheels[@]}"; do
        [ -f "$w" ] || { echo "offline-node: no wheel matches $w" >&2; return 2; }
    done
    # A previous install (another DeepSpeed version) must not mix with this one. Only a folder
    # this script made is removed.
    if [ -f "$site/.dsconform-site" ]; then rm -rf "$site"; fi
    mkdir -p "$site" && touch "$site/.dsconform-site" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site" "${wheels[@]}" || return 1
    mkdir -p "$libaio"
    for deb in "$debs"/*.deb; do
        [ -f "$deb" ] || { echo "offline-node: no .deb in $debs" >&2; return 2; }
        dpkg -x "$deb" "$libaio" || return 1
    done
    lib=$(dirname "$(find "$libaio" -name 'libaio.so*' | head -n 1)")
    cat > "$site/env.sh" <<EOF
# Written by offline-node.sh: the environment the suite runs in (source it in a new shell).
export PYTHONPATH="$site\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$site/bin:\$PATH"
export CPATH="$libaio/usr/include\${CPATH:+:\$CPATH}"
export LIBRARY_PATH="$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
    # shellcheck source=/dev/null
    source "$site/env.sh"
    python3 - "$site" <<'EOF' || return 1
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

site, missing, other, found = sys.argv[1], [], [], {}
# dsconform and DeepSpeed, and every distribution carried into the site (pydantic needs its
# pydantic-core, and a typing-extensions the node may have too old a copy of).
tops = ["dsconform", "deepspeed"]
tops += sorted({d.metadata["Name"] for d in md.distributions(path=[site])} - set(tops))
for top in tops:
    try:
        dist = md.distribution(top)
    except md.PackageNotFoundError:
        if top == "deepspeed":
            missing.append("deepspeed: not installed")
        continue  # the manual way may carry no dsconform wheel: the checkout has it
    if top in ("dsconform", "deepspeed"):
        found[top] = f"{dist.version} ({dist.locate_file('')})"
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(f"{req} (for {top}): not installed on the node nor carried")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            other.append(f"{req} (for {top}): found {version}")
print("offline-node: " + "; ".join(f"{k} {v}" for k, v in found.items()))
hint = "build the bundle with --have listing what this node has, or --include REQUIREMENT"
if other:  # importable, so the run can go on; the combination is not the one specified
    print(f"offline-node: WARNING: versions outside the requirements ({hint}):\n  "
          + "\n  ".join(other), file=sys.stderr)
if missing:
    print(f"offline-node: requirements not met ({hint}):\n  " + "\n  ".join(missing),
          file=sys.stderr)
    sys.exit(1)
EOF
    echo "offline-node: libaio from $libaio; environment in $site/env.sh"
    if [ -f conftest.py ] && [ -d suites ]; then
        echo "offline-node: run the suite from here ($PWD): python3 -m pytest suites -m gpu"
    elif [ -n "$bundle" ] && [ -f "$bundle/suite.tar.gz" ]; then
        local suite=${DSCONFORM_SUITE:-/tmp/dsconform-suite}
        mkdir -p "$suite" && tar -xzf "$bundle/suite.tar.gz" -C "$suite" --strip-components=1 \
            || return 1
        echo "offline-node: the suite is in $suite: cd $suite && python3 -m pytest suites -m gpu"
    fi
}
_dsconform_offline "$@"
_dsconform_rc=$?
unset -f _dsconform_offline
# Sourced: return to the caller's shell; run as a script: exit (then source env.sh yourself).
return $_dsconform_rc 2>/dev/null || exit $_dsconform_rc
