#!/bin/bash
# Instructions per request, counted by callgrind (user space of the server
# only; the kernel's work is not in it), for 4K random reads and 1M writes
# from fio's nbd engine against a tmpfs image. Each build runs twice per row,
# with N and 2N requests, and the difference over N is the figure: start-up,
# handshake and shutdown cancel out. Needs valgrind and fio; run as root or
# with /dev/shm writable.
#
#   bench/work_per_request.sh OLD/vdisk target/release/vdisk
#
# The thread engine is used: valgrind 3.19 deadlocks on the ring engine's
# blocking io_uring_enter (it holds its big lock through the call). On tmpfs
# the 4K reads finish inline in the connection's thread either way; the 1M
# writes go to the workers. `callgrind_annotate bench/out/wpr/*/cg.out`
# shows where the instructions go.
set -eu
READS=${READS:-4000}
WRITES=${WRITES:-100}
OUT=${OUT:-bench/out/wpr}
mkdir -p "$OUT"

run() { # BIN TAG KIND N -> prints total Ir
    local bin=$1 tag=$2 kind=$3 n=$4
    local d="$OUT/$tag-$kind-$n" img="/dev/shm/wpr-$tag.img"
    rm -rf "$d"; mkdir -p "$d"
    rm -f "$img"; truncate -s 1G "$img"
    dd if=/dev/urandom of="$img" bs=1M count=256 conv=notrunc status=none
    valgrind --tool=callgrind --callgrind-out-file="$d/cg.out" \
        "$bin" serve "$img" --socket "$d/sock" --engine threads -q >"$d/server.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do [ -S "$d/sock" ] && break; sleep 0.2; done
    local uri="nbd+unix:///wpr-$tag?socket=$d/sock"
    if [ "$kind" = read4k ]; then
        fio --name=r --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=32 --size=256M \
            --number_ios="$n" --norandommap --randseed=1 --output="$d/fio.txt"
    else
        fio --name=w --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size=1G \
            --number_ios="$n" --output="$d/fio.txt"
    fi
    kill -TERM "$pid"; wait "$pid" || true
    rm -f "$img"
    sed -n 's/^summary: //p' "$d/cg.out"
}

i=0
for bin in "$@"; do
    i=$((i + 1))
    tag="b$i"
    for row in "read4k $READS" "write1m $WRITES"; do
        set -- $row
        a=$(run "$bin" "$tag" "$1" "$2")
        b=$(run "$bin" "$tag" "$1" $(($2 * 2)))
        echo "$bin $1: $(((b - a) / $2)) instructions per request"
    done
done
