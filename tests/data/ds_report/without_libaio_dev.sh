#!/bin/sh
# Run a command on this machine as if Debian's libaio-dev were not installed: libaio.h, libaio.so
# and libaio.a are hidden by overlayfs whiteouts and libaio-dev is dropped from dpkg's status
# file, all inside a private mount namespace (needs root and CAP_SYS_ADMIN; nothing outside the
# namespace changes). The runtime library libaio.so.1 stays, as on a node with libaio1 only.
#
#   without_libaio_dev.sh CMD [ARGS...]
#
# With LIBAIO_PREFIX=DIR set, it first copies libaio.h to DIR/include and libaio.so* to DIR/lib:
# libaio "installed outside the system paths", the case where CFLAGS/LDFLAGS satisfy DeepSpeed's
# compatibility probe but not its JIT build.
set -eu
# Look up the system copies only: CPATH/LIBRARY_PATH may already point at a LIBAIO_PREFIX.
lookup="env -u CPATH -u C_INCLUDE_PATH -u LIBRARY_PATH -u CFLAGS -u LDFLAGS"
header=$(echo '#include <libaio.h>' | $lookup cc -M -x c - | tr ' \\' '\n\n' | grep '/libaio\.h$' | head -1)
so=$($lookup cc -print-file-name=libaio.so)
[ -f "$header" ] && [ -e "$so" ] || { echo "libaio-dev is not installed here; nothing to hide" >&2; exit 3; }
libdir=$(dirname "$so")
incdir=$(dirname "$header")
if [ -n "${LIBAIO_PREFIX:-}" ]; then
    mkdir -p "$LIBAIO_PREFIX/include" "$LIBAIO_PREFIX/lib"
    cp -p "$header" "$LIBAIO_PREFIX/include/"  # -p: an unchanged header must not trigger a rebuild
    cp -pP "$libdir"/libaio.so* "$LIBAIO_PREFIX/lib/"
fi
work=$(mktemp -d /tmp/without_libaio_dev.XXXXXX)
mkdir -p "$work/inc_up" "$work/inc_work" "$work/lib_up" "$work/lib_work"
mknod "$work/inc_up/libaio.h" c 0 0
mknod "$work/lib_up/libaio.so" c 0 0
mknod "$work/lib_up/libaio.a" c 0 0
# dpkg status without the libaio-dev stanza, so DeepSpeed's "please install" hint sees it missing.
awk 'BEGIN{RS=""; ORS="\n\n"} !/^Package: libaio-dev\n/' /var/lib/dpkg/status > "$work/status"
export WLD_INC="$incdir" WLD_LIB="$libdir" WLD_WORK="$work"
unshare -m --propagation private sh -eu -c '
mount -t overlay overlay -o "lowerdir=$WLD_INC,upperdir=$WLD_WORK/inc_up,workdir=$WLD_WORK/inc_work" "$WLD_INC"
mount -t overlay overlay -o "lowerdir=$WLD_LIB,upperdir=$WLD_WORK/lib_up,workdir=$WLD_WORK/lib_work" "$WLD_LIB"
mount --bind "$WLD_WORK/status" /var/lib/dpkg/status
unset WLD_INC WLD_LIB WLD_WORK
exec "$@"' sh "$@" && rc=0 || rc=$?
rm -rf "$work"
exit $rc
