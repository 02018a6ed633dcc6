#!/usr/bin/env bash
# Does a fair-queueing scheduler (BFQ) idle between vdisk's workers?
#
#   sudo bench/bfq.sh [IMAGE_DIR] [ROUNDS]     (default /var/tmp, 2 rounds)
#
# io_uring's own workers share the submitter's I/O context (CLONE_IO), so BFQ
# sees one cooperating queue; a pool of pthreads (the thread engine) is one
# BFQ queue per worker, which BFQ may idle on (slice_idle) before serving
# another. This serves a 1 GiB random-data image on IMAGE_DIR's disk with
# --direct (O_DIRECT, so the disk is hit) through each engine under BFQ and
# under the disk's current scheduler, and prints fio's figures for 4K random
# reads (QD16) and 64K sequential reads (QD8). The scheduler is restored at exit.
set -euo pipefail
dir=${1:-/var/tmp}
rounds=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
vdisk=$here/target/release/vdisk
[ -x "$vdisk" ] || (cd "$here" && cargo build --release -q)
dev=$(lsblk -no PKNAME "$(df --output=source "$dir" | tail -1)" 2>/dev/null || true)
[ -n "$dev" ] || dev=$(basename "$(df --output=source "$dir" | tail -1)")
sched=/sys/block/$dev/queue/scheduler
[ -w "$sched" ] || { echo "bfq.sh: cannot set $sched (run as root, on a disk-backed IMAGE_DIR)" >&2; exit 2; }
grep -qw bfq "$sched" || modprobe bfq 2>/dev/null || true
grep -qw bfq "$sched" || { echo "bfq.sh: this kernel has no BFQ for $dev" >&2; exit 2; }
before=$(sed 's/.*\[\(.*\)\].*/\1/' "$sched")
work=$(mktemp -d "$dir/vdisk-bfq.XXXXXX")
img=$work/img.raw sock=$work/nbd.sock pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    echo "$before" > "$sched"
    rm -rf "$work"
}
trap cleanup EXIT
head -c 1G /dev/urandom > "$img"
sync

run() {  # SCHED ENGINE JOB
    echo "$1" > "$sched"
    rm -f "$sock"
    "$vdisk" serve "$img" --socket "$sock" --direct --engine "$2" -q >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    echo 3 > /proc/sys/vm/drop_caches
    local args
    case $3 in
        rand) args=(--rw=randread --bs=4k --iodepth=16) ;;
        seq) args=(--rw=read --bs=64k --iodepth=8) ;;
    esac
    fio --name=j --ioengine=nbd --uri="nbd+unix:///img?socket=$sock" --size=1G "${args[@]}" --runtime=8 \
        --time_based --output-format=json 2>/dev/null |
        python3 -c "import json,sys; t=sys.stdin.read(); r=json.loads(t[t.index('{'):])['jobs'][0]['read']; \
print(f'{\"$1\":12} {\"$2\":8} {\"$3\":5} {int(r[\"iops\"]):>8} IOPS {r[\"bw\"]/1024:8.1f} MiB/s')"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
}

echo "disk $dev (scheduler was $before), image $img"
for _ in $(seq "$rounds"); do
    for job in rand seq; do
        for s in "$before" bfq; do
            for e in threads uring; do
                run "$s" "$e" "$job"
            done
        done
    done
done
