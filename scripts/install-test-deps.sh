#!/usr/bin/env bash
# Installs the real clients the integration tests drive. Idempotent; needs root (CI runs as root).
set -euo pipefail
# libssl-dev and pkg-config: the openssl crate builds against the system OpenSSL (TLS-PSK).
pkgs=(qemu-utils libnbd-bin python3-libnbd nbdkit fio uml-utilities mount libssl-dev pkg-config)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
for tool in qemu-img qemu-io nbdinfo nbdcopy nbdsh fio uml_mkcow uml_moo mount umount; do
    command -v "$tool" >/dev/null || { echo "missing $tool after install" >&2; exit 1; }
done
# The fuzz targets (fuzz/run.sh) are built by cargo-fuzz; a stable toolchain is enough.
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing: cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi
