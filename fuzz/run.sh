#!/usr/bin/env bash
# Builds the cargo-fuzz targets and runs each for a bounded time.
#
#   fuzz/run.sh [SECONDS] [TARGET...]     (default: 30 s each, every target)
#   fuzz/run.sh keep [TARGET...]           fold what runs found into the kept corpus
#
# Exits non-zero when a target crashes (panics, overflows, leaks past
# -rss_limit_mb, or times out on one input); libFuzzer's artifact is left in
# fuzz/artifacts/TARGET/. Reproduce one with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -a TARGET fuzz/artifacts/TARGET/crash-...
#
# Only a stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it accept the
# nightly-only flags cargo-fuzz passes (-Zsanitizer=address etc.). Needs
# `cargo install cargo-fuzz`.
#
# The committed seeds (fuzz/corpus/TARGET/) are read, never written: what the
# fuzzer finds goes to $FUZZ_WORK/corpus/TARGET (default fuzz/work, ignored by
# git), which a CI cache can keep between runs. `run.sh keep` merges into the
# seeds only the inputs that reach new coverage (libFuzzer -merge=1); commit those.
# The seeds come from make-seeds.py (qcow2_image: small images qemu-img makes;
# control_rpc: one request line per file), and, for cow_header, from uml_mkcow.
set -euo pipefail

secs=${1:-30}
shift || true
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(nbd_handshake nbd_requests meta_context cow_header virtio_blk qcow2_image control_rpc)
fi
work=${FUZZ_WORK:-$here/work}
export RUSTC_BOOTSTRAP=1

cargo fuzz build -a

if [ "$secs" = keep ]; then
    for t in "${targets[@]}"; do
        before=$(ls "$here/corpus/$t" | wc -l)
        cargo fuzz run -a "$t" -- -merge=1 "$here/corpus/$t" "$work/corpus/$t" 2>/dev/null
        echo "$t: kept corpus $before -> $(ls "$here/corpus/$t" | wc -l) inputs" >&2
    done
    exit 0
fi

failed=()
for t in "${targets[@]}"; do
    mkdir -p "$work/corpus/$t" "$here/artifacts/$t"
    echo "== $t: ${secs}s" >&2
    if ! cargo fuzz run -a "$t" "$work/corpus/$t" "$here/corpus/$t" -- \
        -max_total_time="$secs" -max_len=8192 -rss_limit_mb=2048 -timeout=10 \
        -artifact_prefix="$here/artifacts/$t/" -print_final_stats=1; then
        failed+=("$t")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz targets that crashed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
