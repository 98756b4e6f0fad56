#!/usr/bin/env bash
# Prepare a GPU node that has torch but no package registry, from carried files:
#   DEBS:   Debian's libaio1 and libaio-dev .debs (async_io needs the header and the library)
#   WHEELS: one or more folders of wheels for the node's Python: DeepSpeed and what the node
#           lacks (pydantic, pydantic-core, annotated-types, typing-inspection, hjson)
# Source it:  source examples/offline-node.sh DEBS WHEELS [WHEELS...]
# Then run the suite as usual:  python3 -m pytest suites -m gpu --results DIR
# The async_io JIT build ignores CFLAGS/LDFLAGS (they only feed ds_report's probe), so a libaio
# outside the system paths is given through CPATH and LIBRARY_PATH, and LD_LIBRARY_PATH at run time.
debs=${1:?usage: source examples/offline-node.sh DEBS_DIR WHEELS_DIR [WHEELS_DIR...]}
shift
[ $# -ge 1 ] || { echo "usage: source examples/offline-node.sh DEBS_DIR WHEELS_DIR..." >&2; return 2; }
wheels=()
for d in "$@"; do wheels+=("$d"/*.whl); done
site=${DSCONFORM_SITE:-/tmp/dsconform-site}
libaio=${DSCONFORM_LIBAIO:-/tmp/dsconform-libaio}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}" || return 1
mkdir -p "$libaio"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$libaio"; done
lib="$libaio/usr/lib/x86_64-linux-gnu"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
export CPATH="$libaio/usr/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "offline-node: deepspeed $(python3 -c 'import importlib.metadata as m; print(m.version("deepspeed"))') from $site; libaio from $libaio"
