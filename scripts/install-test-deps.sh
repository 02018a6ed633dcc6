#!/usr/bin/env bash
# Installs the real clients the integration tests drive. Idempotent; needs root (CI runs as root).
set -euo pipefail
pkgs=(qemu-utils libnbd-bin python3-libnbd nbdkit fio uml-utilities e2fsprogs)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio uml_mkcow uml_moo; do
    command -v "$tool" >/dev/null || { echo "missing $tool after install" >&2; exit 1; }
done
# The VM rig for the vhost-user-blk tests: QEMU, a kernel and an initramfs
# unpacked from downloaded .debs into /tmp/vmrig (not installed; idempotent).
bash "$(dirname "$0")/vmrig/vm-setup.sh"
