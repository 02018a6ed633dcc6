#!/bin/bash
# Vendored from the team's rig /work/shared/rigs/vm-vhost-user-blk.sh (../shared/rigs), so CI runs without ../shared.
# vm-vhost-user-blk.sh — boot a throwaway QEMU guest whose only disk (/dev/vda)
# is a vhost-user-blk device served by ANY daemon on a unix socket, run a
# destructive block+ext4 workload in the guest, exit with the guest's result.
# Prerequisite: vm-setup.sh (builds $VMRIG_DIR, default /tmp/vmrig).
#
#   vm-vhost-user-blk.sh [opts] SOCKET        # disk = your daemon's vhost-user-blk socket
#   vm-vhost-user-blk.sh [opts] --qsd IMAGE   # self-test: serve IMAGE via qemu-storage-daemon
#   vm-vhost-user-blk.sh [opts] --raw IMAGE   # baseline: plain QEMU virtio-blk on a raw file
# opts: --accel tcg|kvm|kvm-pvh (default tcg; see NOTE)  --timeout S (300)
#       --mb N (raw-phase MiB, 64; <= ~40% of --mem)  --no-fs  --files N (200)  --smp N (1)
#       --num-queues N (1)  --mem 512M  --log FILE  --append 'kernel args'  -q (quiet)
#       --reconnect (QEMU reconnects to the socket every second after the backend dies)
#       --loop (the guest runs write-and-verify rounds until VMRIG-STOP appears at 192 MiB;
#               see vm-setup.sh; with --reconnect, for restarting the backend under the guest)
# Disk must be >= mb+8 MiB (256 MiB suggested). Its contents are destroyed.
# Exit: 0 guest PASS | 1 guest workload FAIL | 124 timeout | 125 no result marker
#       (qemu/boot failure; see log) | 2 usage/setup error.
# Prints "VMRIG: ..." lines from the guest and "HOST: boot_s=.. workload_s=.. total_s=..".
# NOTE: on the PVM host (kvm_pvm) --accel kvm hangs after the real-mode setup code
# and kvm-pvh (direct 64-bit ELF entry) crawls; use tcg (default) there.
# The backend must implement VHOST_USER_PROTOCOL_F_CONFIG (QEMU reads virtio-blk
# config via GET_CONFIG) and support >= --num-queues queues.
set -uo pipefail

VMRIG_DIR=${VMRIG_DIR:-/tmp/vmrig}
ACCEL=tcg TIMEOUT=300 MB=64 FS=1 FILES=200 SMP=1 NQ=1 MEM=512M LOG= APPEND= QUIET=0
MODE=vub TARGET= RECONNECT= LOOP=0
usage() { sed -n '3,24p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --accel) ACCEL=$2; shift;; --timeout) TIMEOUT=$2; shift;; --mb) MB=$2; shift;;
    --no-fs) FS=0;; --files) FILES=$2; shift;; --smp) SMP=$2; shift;;
    --num-queues) NQ=$2; shift;; --mem) MEM=$2; shift;; --log) LOG=$2; shift;;
    --append) APPEND=$2; shift;; -q) QUIET=1;;
    --reconnect) RECONNECT=,reconnect=1;; --loop) LOOP=1;;
    --qsd) MODE=qsd; TARGET=$2; shift;; --raw) MODE=raw; TARGET=$2; shift;;
    -h|--help) usage;; -*) echo "unknown option $1" >&2; usage;;
    *) TARGET=$1;;
  esac; shift
done
[ -n "$TARGET" ] || usage
[ -f "$VMRIG_DIR/env.sh" ] || { echo "run vm-setup.sh first ($VMRIG_DIR/env.sh missing)" >&2; exit 2; }
# shellcheck disable=SC1091
. "$VMRIG_DIR/env.sh"

WORK=$(mktemp -d /tmp/vmrig-run.XXXXXX)
[ -n "$LOG" ] || LOG=$WORK/serial.log
QPID= QSDPID=
cleanup() {   # end only what we started, by PID
  local p
  for p in $QPID $QSDPID; do
    kill -0 "$p" 2>/dev/null || continue
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
now() { date +%s.%N; }
sub() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }

SOCK=
case $MODE in
  vub) SOCK=$TARGET   # give a just-started daemon up to 10 s to create its socket
       for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
       [ -S "$SOCK" ] || { echo "not a unix socket: $SOCK" >&2; exit 2; };;
  qsd) [ -f "$TARGET" ] || { echo "no image $TARGET" >&2; exit 2; }
       SOCK=$WORK/vub.sock
       "$QSD" --blockdev "driver=file,node-name=f0,filename=$TARGET,cache.direct=on,aio=threads" \
              --blockdev driver=raw,node-name=d0,file=f0 \
              --export "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$SOCK,writable=on,num-queues=$NQ" \
              >"$WORK/qsd.log" 2>&1 &
       QSDPID=$!
       for _ in $(seq 100); do [ -S "$SOCK" ] && break; kill -0 $QSDPID 2>/dev/null || break; sleep 0.05; done
       [ -S "$SOCK" ] || { cat "$WORK/qsd.log" >&2; echo "qemu-storage-daemon failed" >&2; exit 2; };;
  raw) [ -f "$TARGET" ] || { echo "no image $TARGET" >&2; exit 2; };;
esac

KERNEL=$VMRIG_KERNEL
case $ACCEL in
  tcg)     ACCEL_ARGS=(-accel tcg) ;;
  kvm)     ACCEL_ARGS=(-accel kvm -cpu host,-arch-capabilities) ;;  # plain -cpu host aborts: MSR 0x10a
  kvm-pvh) ACCEL_ARGS=(-accel kvm -cpu host,-arch-capabilities); KERNEL=$VMRIG_DIR/vmlinux
           [ -f "$KERNEL" ] || { echo "kvm-pvh needs $KERNEL (vm-setup.sh VMLINUX=1)" >&2; exit 2; } ;;
  *) echo "bad --accel $ACCEL" >&2; exit 2;;
esac
if [ $MODE = raw ]; then
  DISK_ARGS=(-drive "file=$TARGET,if=virtio,format=raw,cache=none,aio=threads")
else
  DISK_ARGS=(-chardev "socket,id=vub0,path=$SOCK$RECONNECT" -device "vhost-user-blk-pci,chardev=vub0,num-queues=$NQ")
fi
CMDLINE="console=ttyS0 loglevel=4 panic=-1 rdinit=/init vmrig.mb=$MB vmrig.fs=$FS vmrig.files=$FILES vmrig.loop=$LOOP $APPEND"

T0=$(now)
# shellcheck disable=SC2086
LD_LIBRARY_PATH=$QEMU_LD_LIBRARY_PATH QEMU_MODULE_DIR=$QEMU_MODULE_DIR "$QEMU" $QEMU_FW_ARGS "${ACCEL_ARGS[@]}" \
  -m "$MEM" -smp "$SMP" -object "memory-backend-memfd,id=mem,size=$MEM,share=on" -numa node,memdev=mem \
  "${DISK_ARGS[@]}" -kernel "$KERNEL" -initrd "$VMRIG_INITRD" -append "$CMDLINE" \
  -display none -nodefaults -no-user-config -serial stdio -no-reboot </dev/null >"$LOG" 2>&1 &
QPID=$!

TB= RC=
DEADLINE=$(awk -v t="$T0" -v d="$TIMEOUT" 'BEGIN{printf "%.0f", t+d}')
while kill -0 $QPID 2>/dev/null; do
  [ -z "$TB" ] && grep -q '^VMRIG: init start' "$LOG" && TB=$(now)
  grep -q '^VMRIG-RESULT: rc=' "$LOG" && break     # guest is powering off
  [ "$(date +%s)" -ge "$DEADLINE" ] && { RC=124; break; }
  sleep 0.1
done
# give qemu a moment to finish poweroff on its own
[ -n "$RC" ] || for _ in $(seq 50); do kill -0 $QPID 2>/dev/null || break; sleep 0.1; done
T1=$(now)
[ -z "$TB" ] && grep -q '^VMRIG: init start' "$LOG" && TB=$T1
QEXIT=
if ! kill -0 $QPID 2>/dev/null; then wait $QPID; QEXIT=$?; QPID=; fi

GRC=$(sed -n 's/^VMRIG-RESULT: rc=\([0-9]*\).*/\1/p' "$LOG" | tail -n1)
if [ -z "$RC" ]; then RC=${GRC:-125}; fi
[ $QUIET = 1 ] || grep -a '^VMRIG' "$LOG" | tr -d '\r'
if [ "$RC" != 0 ]; then
  echo "---- last 40 non-VMRIG lines of serial/qemu log ($LOG) ----"; grep -av '^VMRIG' "$LOG" | tail -n 40 | tr -d '\r'
  [ -n "$QSDPID" ] && { echo "---- qemu-storage-daemon log ----"; tail -n 20 "$WORK/qsd.log"; }
fi
echo "HOST: mode=$MODE accel=$ACCEL rc=$RC qemu_exit=${QEXIT:-killed}" \
     "boot_s=$( [ -n "$TB" ] && sub "$T0" "$TB" || echo NA)" \
     "workload_s=$( [ -n "$TB" ] && sub "$TB" "$T1" || echo NA)" "total_s=$(sub "$T0" "$T1")"
# keep the log if the caller asked for it via --log; otherwise copy on failure
if [ "$RC" != 0 ] && [ "$LOG" = "$WORK/serial.log" ]; then
  cp "$LOG" "/tmp/vmrig-failed-$$.log" && echo "log kept: /tmp/vmrig-failed-$$.log"
fi
exit "$RC"
