#!/usr/bin/env bash
# Installs the real clients the integration tests drive. Idempotent; needs root (CI runs as root).
set -euo pipefail
# libssl-dev and pkg-config: the openssl crate builds against the system OpenSSL (TLS-PSK).
# openssl: tests/tls.rs makes RSA keys of odd sizes with it. strace: tests/chaos.rs attaches
# and detaches it under load (as a debugger would). (The power-loss storage, fuser, mounts
# with mount(2) as root and needs no fusermount.) user-mode-linux: the UML kernel (`linux`), which
# tests/uml.rs boots to read an overlay vdisk wrote.
pkgs=(qemu-utils libnbd-bin python3-libnbd nbdkit fio uml-utilities util-linux mount e2fsprogs libssl-dev pkg-config
    openssl python3-prometheus-client strace user-mode-linux)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio uml_mkcow uml_moo mount umount losetup fallocate mkfs.ext4 \
    fsck.ext4 qemu-storage-daemon nbdfuse openssl strace linux; do
    command -v "$tool" >/dev/null || { echo "missing $tool after install" >&2; exit 1; }
done
# systemd-analyze and systemd-socket-activate (crates/vdisk/tests/service.rs) come with
# Debian's systemd package. Only the package, never systemd-sysv, which would
# replace the container's init: install without recommends, and refuse if apt plans
# to install it (upgrading one already there is harmless).
if ! command -v systemd-socket-activate >/dev/null || ! command -v systemd-analyze >/dev/null; then
    apt-get update -qq
    if apt-get install -s --no-install-recommends systemd | grep -q '^Inst systemd-sysv ('; then
        echo "installing systemd would replace init (systemd-sysv); install systemd-analyze by hand" >&2
        exit 1
    fi
    echo "installing: systemd (without systemd-sysv)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
for tool in systemd-analyze systemd-socket-activate; do
    command -v "$tool" >/dev/null || { echo "missing $tool after install" >&2; exit 1; }
done
# The FUSE tests (crates/vdisk/tests/fuse.rs, fuse_reliability.rs) and the power-loss tests
# (powerloss.rs, whose storage is a FUSE file system) need the fuse module (/dev/fuse) and loop devices.
[ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
[ -e /dev/loop-control ] || modprobe loop 2>/dev/null || true
# The fuzz targets (fuzz/run.sh) are built by cargo-fuzz; a stable toolchain is enough.
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing: cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi
# The Ceph rig for the RBD tests (crates/vdisk/tests/rbd.rs): ceph-mon, ceph-osd,
# the rbd tool and librbd, which vdisk loads at run time (each test run starts
# its own throwaway cluster with scripts/cephrig/ceph-micro.sh).
bash "$(dirname "$0")/cephrig/ceph-micro.sh" install
for tool in ceph-mon ceph-osd rbd; do
    command -v "$tool" >/dev/null || { echo "missing $tool after the Ceph install" >&2; exit 1; }
done
# The VM rig for the vhost-user-blk tests: QEMU, a kernel and an initramfs
# unpacked from downloaded .debs into /tmp/vmrig (not installed; idempotent).
bash "$(dirname "$0")/vmrig/vm-setup.sh"
