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
# What it does: from a bundle, first checks every file against MANIFEST.json (size and sha256): a
# changed, missing or extra file stops it, naming the file, before anything is installed (the
# loose folders of the manual way are not checked: they have no manifest). Then pip installs the
# wheels with --no-index --no-deps into $DSCONFORM_SITE (default /tmp/dsconform-site; nothing is
# fetched, the node's own site-packages are not touched), from a bundle with --require-hashes
# from its requirements files, so pip too refuses a wheel that is not the one built; unpacks
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

# Every file of bundle $1 against its MANIFEST.json; the folders after it (where this script
# writes, when they lie inside the bundle) are left out.
_dsconform_verify() {
    python3 - "$@" <<'EOF'
import hashlib
import json
import os
import sys

bundle, writes = sys.argv[1], [os.path.realpath(p) for p in sys.argv[2:]]
try:
    with open(os.path.join(bundle, "MANIFEST.json")) as f:
        listed = {e["path"]: e for e in json.load(f)["files"]}
except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit(f"offline-node: {bundle}/MANIFEST.json: no list of files to check ({e!r}); "
             "rebuild the bundle with this suite's `dsconform bundle`")
found = set()
for root, dirs, files in os.walk(bundle):
    dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(root, d)) not in writes]
    found |= {os.path.relpath(os.path.join(root, f), bundle) for f in files}
found.discard("MANIFEST.json")
problems = [f"{p}: not in MANIFEST.json (added after the bundle was built)"
            for p in sorted(found - set(listed))]
problems += [f"{p}: missing" for p in sorted(set(listed) - found)]
for path in sorted(found & set(listed)):
    entry, full = listed[path], os.path.join(bundle, path)
    size = os.path.getsize(full)
    if size != entry["bytes"]:
        problems.append(f"{path}: {size} bytes, MANIFEST.json says {entry['bytes']}")
        continue
    with open(full, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != entry["sha256"]:
        problems.append(f"{path}: sha256 {digest}, MANIFEST.json says {entry['sha256']}")
if problems:
    sys.exit(f"offline-node: {bundle} is not the bundle that was built; nothing installed:\n  "
             + "\n  ".join(problems))
print(f"offline-node: {len(listed)} files match MANIFEST.json")
EOF
}

_dsconform_offline() {
    local here site libaio debs="" bundle="" version="" lib deb
    local -a wheels=() args=() pip_from=()
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
        _dsconform_verify "$bundle" "$site" "$libaio" "${DSCONFORM_SUITE:-/tmp/dsconform-suite}" \
            || return 1
        debs=$bundle/debs
        wheels=("$bundle"/wheels/*.whl "$bundle/deepspeed/$version"/*.whl)
        # Every wheel pinned to its sha256: pip refuses any other file, whatever its name.
        pip_from=(--require-hashes --find-links "$bundle/wheels"
                  --find-links "$bundle/deepspeed/$version" -r "$bundle/requirements.txt"
                  -r "$bundle/requirements-deepspeed-$version.txt")
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
        pip_from=("${wheels[@]}")
    fi
    for w in "${wheels[@]}"; do
        [ -f "$w" ] || { echo "offline-node: no wheel matches $w" >&2; return 2; }
    done
    # A previous install (another DeepSpeed version) must not mix with this one. Only a folder
    # this script made is removed.
    if [ -f "$site/.dsconform-site" ]; then rm -rf "$site"; fi
    mkdir -p "$site" && touch "$site/.dsconform-site" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site" "${pip_from[@]}" || return 1
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
unset -f _dsconform_offline _dsconform_verify
# Sourced: return to the caller's shell; run as a script: exit (then source env.sh yourself).
return $_dsconform_rc 2>/dev/null || exit $_dsconform_rc
