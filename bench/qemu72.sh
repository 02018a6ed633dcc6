#!/bin/bash
# Unpacks Debian 12's QEMU 7.2 qemu-nbd (qemu-utils) and its block modules (qemu-block-extra:
# block-rbd.so) into a private prefix, never over the system's QEMU: this machine runs a
# backported QEMU 10, for which Debian has no qemu-block-extra, so qemu-nbd has no rbd driver.
# The bench's rbd section runs PREFIX/root/usr/bin/qemu-nbd with QEMU_MODULE_DIR pointing at
# PREFIX/root/usr/lib/x86_64-linux-gnu/qemu (how QEMU finds its modules elsewhere than at
# its built-in path).
#
#   bench/qemu72.sh [PREFIX]      default PREFIX: bench/out/qemu72
#
# Needs apt-get (bookworm's sources) and dpkg-deb; librbd1 for the module (the Ceph rig's).
# Prints the prefix's qemu-nbd and module directory. Running it again reuses what is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:-$here/out/qemu72}
root=$prefix/root
nbd=$root/usr/bin/qemu-nbd
mods=$root/usr/lib/x86_64-linux-gnu/qemu
if [ ! -x "$nbd" ] || [ ! -e "$mods/block-rbd.so" ]; then
    ver=$(apt-cache madison qemu-block-extra | awk -F'|' '$2 ~ /^ *1:7\.2/ {gsub(/ /, "", $2); print $2; exit}')
    if [ -z "$ver" ]; then
        echo "qemu72.sh: apt knows no qemu-block-extra 7.2 (bookworm's sources missing? apt-get update)" >&2
        exit 1
    fi
    mkdir -p "$prefix/debs" "$root"
    (cd "$prefix/debs" && apt-get download -q "qemu-utils=$ver" "qemu-block-extra=$ver" >&2)
    for d in "$prefix"/debs/qemu-utils_*.deb "$prefix"/debs/qemu-block-extra_*.deb; do
        dpkg-deb -x "$d" "$root"
    done
fi
missing=$(ldd "$nbd" "$mods/block-rbd.so" | awk '/not found/ {print $1}' | sort -u)
if [ -n "$missing" ]; then
    echo "qemu72.sh: $nbd or block-rbd.so needs libraries this machine lacks: $missing" >&2
    exit 1
fi
echo "$nbd"
echo "$mods"
