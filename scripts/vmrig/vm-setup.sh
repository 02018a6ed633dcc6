#!/bin/bash
# Vendored from the team's rig /work/shared/rigs/vm-setup.sh (../shared/rigs), so CI runs without ../shared.
# vm-setup.sh — prepare a self-contained VM test rig (QEMU + kernel + initramfs)
# for end-to-end tests of a vhost-user-blk server. Does NOT install QEMU system
# packages (on this Debian 12 image qemu-system-common 7.2 conflicts with the
# installed backports qemu-utils 10.x); it downloads .debs with `apt-get download`
# and unpacks them with `dpkg -x` into $VMRIG_DIR (default /tmp/vmrig).
# Nothing here boots on this machine; the kernel is only unpacked.
#
# Usage:  vm-setup.sh            (idempotent; re-run with FORCE=1 to rebuild)
# Env:    VMRIG_DIR=/tmp/vmrig   KERNEL_PKG=linux-image-cloud-amd64
#         VMLINUX=1 also extracts an ELF vmlinux (only for --accel kvm-pvh experiments)
# Result: $VMRIG_DIR/vmlinuz, $VMRIG_DIR/initramfs.cpio.gz, $VMRIG_DIR/qemu/…,
#         $VMRIG_DIR/env.sh (QEMU, QEMU_LD_LIBRARY_PATH, QEMU_FW_ARGS, QSD)
set -euo pipefail

VMRIG_DIR=${VMRIG_DIR:-/tmp/vmrig}
KERNEL_PKG=${KERNEL_PKG:-linux-image-cloud-amd64}
FORCE=${FORCE:-0}
DEBS=$VMRIG_DIR/debs
QROOT=$VMRIG_DIR/qemu
KROOT=$VMRIG_DIR/kpkg
IRD=$VMRIG_DIR/initramfs

log() { echo "[vm-setup] $*" >&2; }
mkdir -p "$DEBS" "$QROOT" "$KROOT"

dl() {  # apt-get download PKG... into $DEBS unless already present
  local need=() p
  for p in "$@"; do
    ls "$DEBS/${p}_"*.deb >/dev/null 2>&1 || need+=("$p")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  log "apt-get download ${need[*]}"
  local try
  for try in 1 2; do
    (cd "$DEBS" && apt-get download "${need[@]}" 2>&1 | grep -v 'unsandboxed' >&2) || true
    local ok=1; for p in "${need[@]}"; do ls "$DEBS/${p}_"*.deb >/dev/null 2>&1 || ok=0; done
    [ $ok = 1 ] && return 0
    [ $try = 1 ] && { log "download incomplete; apt-get update and retry"; apt-get update -qq >&2 || true; }
  done
  log "could not download: ${need[*]}"; exit 1
}
deb_of() { ls "$DEBS/${1}_"*.deb | head -n1; }

# ---------------------------------------------------------------- QEMU
# qemu-system-common holds the TCG accelerator module (accel-tcg-x86_64.so).
QEMU_PKGS=(qemu-system-x86 qemu-system-common qemu-system-data seabios ipxe-qemu
           libcapstone4 libfdt1 libslirp0 libvdeplug2 busybox-static)
dl "${QEMU_PKGS[@]}"
for p in "${QEMU_PKGS[@]}"; do   # stamp per package so re-runs are cheap
  if [ "$FORCE" = 1 ] || [ ! -e "$QROOT/.unpacked-$p" ]; then
    log "unpack $p"; dpkg -x "$(deb_of "$p")" "$QROOT"; touch "$QROOT/.unpacked-$p"
  fi
done
QEMU=$QROOT/usr/bin/qemu-system-x86_64
QLIB=$QROOT/usr/lib/x86_64-linux-gnu
missing=$(LD_LIBRARY_PATH=$QLIB ldd "$QEMU" | awk '/not found/{print $1}' || true)
[ -z "$missing" ] || { log "qemu still misses libs: $missing (apt-get download the owning pkgs)"; exit 1; }

# qemu-storage-daemon: prefer the host's (qemu-utils >= 8 ships it), else unpack
# bookworm's qemu-system-common (which has /usr/bin/qemu-storage-daemon 7.2).
QSD=$(command -v qemu-storage-daemon || true)
[ -n "$QSD" ] || QSD=$QROOT/usr/bin/qemu-storage-daemon
QMODDIR=$QROOT/usr/lib/x86_64-linux-gnu/qemu
miss=$(LD_LIBRARY_PATH=$QLIB ldd "$QMODDIR/accel-tcg-x86_64.so" | awk '/not found/{print $1}' || true)
[ -z "$miss" ] || { log "accel-tcg module misses libs: $miss"; exit 1; }

# ---------------------------------------------------------------- kernel
# Resolve the metapackage to the concrete linux-image-6.x-… package.
KIMG=$(apt-cache depends "$KERNEL_PKG" 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$KIMG" ] || KIMG=$KERNEL_PKG
dl "$KIMG"
if [ "$FORCE" = 1 ] || ! ls "$KROOT"/boot/vmlinuz-* >/dev/null 2>&1; then
  log "unpack $KIMG (not installed, not booted here)"; rm -rf "$KROOT"; mkdir -p "$KROOT"
  dpkg -x "$(deb_of "$KIMG")" "$KROOT"
fi
KVER=$(basename "$(ls -d "$KROOT"/lib/modules/* | head -n1)")
cp -f "$KROOT/boot/vmlinuz-$KVER" "$VMRIG_DIR/vmlinuz"
# Optional: uncompressed ELF vmlinux (has a PVH note) for `--accel kvm-pvh` experiments.
if [ "${VMLINUX:-0}" = 1 ] && [ ! -f "$VMRIG_DIR/vmlinux" ]; then
  python3 - "$VMRIG_DIR/vmlinuz" "$VMRIG_DIR/vmlinux" <<'PY'
import sys, subprocess
d = open(sys.argv[1], 'rb').read()
for magic, cmd in ((b'\x02\x21\x4c\x18', ['lz4', '-dc']), (b'\x28\xb5\x2f\xfd', ['zstd', '-dc']),
                   (b'\xfd7zXZ\x00', ['xz', '-dc']), (b'\x1f\x8b\x08', ['gzip', '-dc'])):
    i = d.find(magic)
    if i < 0: continue
    r = subprocess.run(cmd, input=d[i:], capture_output=True)
    if r.stdout[:4] == b'\x7fELF':
        open(sys.argv[2], 'wb').write(r.stdout); sys.exit(0)
sys.exit('could not extract vmlinux')
PY
fi

# ---------------------------------------------------------------- initramfs
log "build initramfs"
rm -rf "$IRD"; mkdir -p "$IRD"/{bin,sbin,dev,proc,sys,tmp,mnt,lib/modules,etc}
cp "$QROOT/bin/busybox" "$IRD/bin/busybox"
for a in $("$IRD/bin/busybox" --list); do
  [ "$a" = busybox ] || ln -sf busybox "$IRD/bin/$a"
done
# virtio modules (built as =m in Debian kernels); load order matters.
MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk"
for m in $MODS; do
  f=$(find "$KROOT/lib/modules/$KVER" -name "$m.ko*" | head -n1)
  [ -n "$f" ] && cp "$f" "$IRD/lib/modules/" || log "module $m not found (assume built-in)"
done
echo "$MODS" > "$IRD/etc/modules"
# Real mkfs.ext4 (journal, discard, flush/FUA traffic) copied from the host with its libs.
if MKE2FS=$(command -v mke2fs); then
  mkdir -p "$IRD/usr/sbin"
  cp -L "$MKE2FS" "$IRD/usr/sbin/mke2fs"
  for l in $(ldd "$MKE2FS" | awk '/=>/{print $3} /^\t\/lib/{print $1}'); do
    mkdir -p "$IRD$(dirname "$l")"; cp -L "$l" "$IRD$l"
  done
  # ldd prints ld-linux as an absolute path without '=>'
  ld=$(ldd "$MKE2FS" | awk '/ld-linux/{print $1}'); mkdir -p "$IRD$(dirname "$ld")"; cp -L "$ld" "$IRD$ld"
  [ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$IRD/etc/"
fi

cat > "$IRD/init" <<'INIT'
#!/bin/sh
# vmrig guest workload. Kernel cmdline knobs: vmrig.mb=N (raw I/O size, MiB; the
# pattern lives in the tmpfs rootfs, so keep N below ~40% of guest RAM),
# vmrig.fs=0|1 (filesystem phase), vmrig.files=N (small files).
export PATH=/bin:/sbin:/usr/sbin:/usr/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
mkdir -p /mnt /tmp
log()  { echo "VMRIG: $*"; }
up()   { cut -d' ' -f1 /proc/uptime; }
dt()   { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }
rate() { awk -v m="$1" -v a="$2" -v b="$3" 'BEGIN{d=b-a; if(d<=0)d=0.01; printf "%.1f", m/d}'; }
RC=0
finish() {
  log "total_guest_s=$(up)"
  echo "VMRIG-RESULT: rc=$RC"
  sync; poweroff -f; sleep 2; echo o > /proc/sysrq-trigger; sleep 5
}
fail() { log "FAIL: $*"; RC=1; finish; }
log "init start uptime=$(up) kernel=$(uname -r)"
MB=64; FS=1; FILES=200; LOOP=0; LOOP_MAX_S=300; STOP_MB=192; DURABLE=0
for a in $(cat /proc/cmdline); do case "$a" in
  vmrig.mb=*) MB=${a#*=};; vmrig.fs=*) FS=${a#*=};; vmrig.files=*) FILES=${a#*=};;
  vmrig.loop=*) LOOP=${a#*=};; vmrig.loop_max_s=*) LOOP_MAX_S=${a#*=};; vmrig.stop_mb=*) STOP_MB=${a#*=};;
  vmrig.durable=*) DURABLE=${a#*=};;
esac; done
for m in $(cat /etc/modules); do [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko 2>/dev/null; done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
[ -b /dev/vda ] || { ls /sys/block; fail "no /dev/vda"; }
SZ=$(blockdev --getsize64 /dev/vda); LBS=$(cat /sys/block/vda/queue/logical_block_size)
DMAX=$(cat /sys/block/vda/queue/discard_max_bytes 2>/dev/null || echo 0)
WC=$(cat /sys/block/vda/queue/write_cache 2>/dev/null); NQ=$(ls /sys/block/vda/mq 2>/dev/null | wc -l)
RO=$(cat /sys/block/vda/ro)
log "disk vda size=$SZ lbs=$LBS ro=$RO write_cache=$WC discard_max=$DMAX nr_hw_queues=$NQ"
[ "$SZ" -ge $(( (MB + 8) * 1048576 )) ] || fail "disk too small for vmrig.mb=$MB"

# --- durable mode (vmrig.durable=1), for power cuts: 4 KiB blocks 1, 2, 3, ...
# each written once with O_DIRECT and fsync'd (FLUSH); after the fsync returns
# the console says "VMRIG: durable b=N", and block N must survive any power cut
# from then on (its bytes: the line "vmrig durable b=N " repeated). Meanwhile a writer
# that never syncs keeps other data pending at 8 MiB. Runs until the host pulls
# the plug (or vmrig.loop_max_s).
if [ "$DURABLE" = 1 ]; then
  ( i=0; while :; do i=$((i+1)); yes "vmrig pending $i " | head -c 65536 > /tmp/p
      dd if=/tmp/p of=/dev/vda bs=65536 seek=$((128 + i % 32)) count=1 oflag=direct conv=notrunc 2>/dev/null || break
    done ) &
  b=0
  while awk -v u="$(up)" -v m="$LOOP_MAX_S" 'BEGIN{exit !(u < m)}'; do
    b=$((b+1)); yes "vmrig durable b=$b " | head -c 4096 > /tmp/d
    dd if=/tmp/d of=/dev/vda bs=4096 seek=$b count=1 oflag=direct conv=notrunc,fsync 2>/dev/null || fail "durable write b=$b"
    echo "VMRIG: durable b=$b"
  done
  finish
fi

# --- loop mode (vmrig.loop=1): write-and-verify rounds while the host restarts
# the backend under the guest. Each round writes 8 generation-tagged 64 KiB
# blocks with O_DIRECT, concurrently (every other one with an fsync, so FLUSH
# too), then reads them back with O_DIRECT and compares. Rounds go on until
# the host puts "VMRIG-STOP" in the sector at vmrig.stop_mb MiB (or
# vmrig.loop_max_s passes); then every block is verified once more against
# its last generation, and the kernel log is searched for I/O errors.
if [ "$LOOP" = 1 ]; then
  NB=128; STOPSEC=$((STOP_MB * 2048)); r=0; P=; mkdir -p /tmp/exp
  [ "$SZ" -ge $(( (STOP_MB + 1) * 1048576 )) ] || fail "disk too small for vmrig.stop_mb=$STOP_MB"
  log "loop start blocks=$NB stop_sector=$STOPSEC"
  # Meanwhile a stream keeps larger requests in flight: 4 MiB at 32 MiB, 1 MiB
  # O_DIRECT writes and an fsync, read back and compared, over and over.
  ( p=0; while [ ! -f /tmp/stream.stop ]; do
      p=$((p+1)); yes "vmrig stream pass=$p " | head -c 4194304 > /tmp/stream
      dd if=/tmp/stream of=/dev/vda bs=1M seek=32 count=4 oflag=direct conv=notrunc,fsync 2>/dev/null \
        || { echo "stream write pass=$p" > /tmp/stream.bad; break; }
      dd if=/dev/vda bs=1M skip=32 count=4 iflag=direct 2>/dev/null | cmp -s - /tmp/stream \
        || { echo "stream verify pass=$p" > /tmp/stream.bad; break; }
      echo $p > /tmp/stream.passes
    done ) &
  SPID=$!
  while :; do
    r=$((r+1)); rm -f /tmp/bad; j=0
    while [ $j -lt 8 ]; do
      b=$(( (j * 16 + r) % NB ))
      yes "vmrig g=$r b=$b " | head -c 65536 > /tmp/exp/$b
      if [ $((j % 2)) = 0 ]; then c=notrunc,fsync; else c=notrunc; fi
      (dd if=/tmp/exp/$b of=/dev/vda bs=65536 seek=$b count=1 oflag=direct conv=$c 2>/tmp/err.$b \
        || { echo "write r=$r b=$b: $(cat /tmp/err.$b)" >> /tmp/bad; }) &
      P="$P $!"; j=$((j+1))
    done
    wait $P; P=
    [ -f /tmp/bad ] && { cat /tmp/bad; fail "loop write"; }
    j=0
    while [ $j -lt 8 ]; do
      b=$(( (j * 16 + r) % NB ))
      (dd if=/dev/vda bs=65536 skip=$b count=1 iflag=direct 2>/dev/null | cmp -s - /tmp/exp/$b \
        || echo "verify r=$r b=$b" >> /tmp/bad) &
      P="$P $!"; j=$((j+1))
    done
    wait $P; P=
    [ -f /tmp/bad ] && { cat /tmp/bad; fail "loop verify"; }
    log "loop round=$r ok uptime=$(up)"
    dd if=/dev/vda bs=512 skip=$STOPSEC count=1 iflag=direct 2>/dev/null | grep -q VMRIG-STOP && break
    awk -v u="$(up)" -v m="$LOOP_MAX_S" 'BEGIN{exit !(u > m)}' && { log "loop stopped by vmrig.loop_max_s"; break; }
  done
  touch /tmp/stream.stop; wait $SPID
  [ -f /tmp/stream.bad ] && fail "$(cat /tmp/stream.bad)"
  log "stream ok passes=$(cat /tmp/stream.passes 2>/dev/null || echo 0)"
  n=0
  for f in /tmp/exp/*; do
    b=${f##*/}
    dd if=/dev/vda bs=65536 skip=$b count=1 iflag=direct 2>/dev/null | cmp -s - "$f" || fail "final verify b=$b"
    n=$((n+1))
  done
  log "loop_verify ok rounds=$r blocks=$n"
  E=$(dmesg | grep -ciE 'i/o error|blk_update_request|critical medium|buffer i/o')
  dmesg | grep -iE 'i/o error|blk_update_request|critical medium|buffer i/o' | head -5
  log "dmesg_io_errors=$E"
  [ "$E" = 0 ] || RC=1
  finish
fi

# --- raw phase: O_DIRECT write/read of an MB-MiB random pattern
t0=$(up); dd if=/dev/urandom of=/pat bs=1M count=$MB 2>/dev/null || fail "urandom"
P=$(md5sum /pat | cut -d' ' -f1); t1=$(up); log "pattern_gen s=$(dt $t0 $t1) (urandom+md5, not I/O)"
t0=$(up); dd if=/pat of=/dev/vda bs=1M oflag=direct conv=fsync 2>/dev/null || fail "raw write"; t1=$(up)
log "raw_write mb=$MB s=$(dt $t0 $t1) MBps=$(rate $MB $t0 $t1)"
echo 3 > /proc/sys/vm/drop_caches
t0=$(up); dd if=/dev/vda of=/dev/null bs=1M count=$MB iflag=direct 2>/dev/null || fail "raw read"; t1=$(up)
log "raw_read mb=$MB s=$(dt $t0 $t1) MBps=$(rate $MB $t0 $t1)"
R=$(dd if=/dev/vda bs=1M count=$MB iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)   # verify pass
[ "$P" = "$R" ] || fail "raw md5 mismatch wrote=$P read=$R"
log "raw_md5 ok $P"
# small unaligned-offset sector I/O (512 B .. 12 KiB at odd sector offsets)
t0=$(up); n=0
for s in 1 7 8 63 129 1000 4095 8191; do
  c=$(( (s % 24) + 1 ))
  dd if=/pat of=/dev/vda bs=512 skip=$((s*3)) seek=$s count=$c oflag=direct conv=notrunc 2>/dev/null || fail "small write s=$s"
  a=$(dd if=/pat bs=512 skip=$((s*3)) count=$c 2>/dev/null | md5sum); b=$(dd if=/dev/vda bs=512 skip=$s count=$c iflag=direct 2>/dev/null | md5sum)
  [ "$a" = "$b" ] || fail "small io mismatch sector=$s count=$c"; n=$((n+1))
done; t1=$(up); log "small_io ok n=$n s=$(dt $t0 $t1)"
if [ "$DMAX" -gt 0 ] 2>/dev/null; then
  blkdiscard -o 0 -l 1048576 /dev/vda && log "discard ok" || fail "discard"
else log "discard unsupported (skipped)"; fi

# --- filesystem phase
if [ "$FS" = 1 ]; then
  t0=$(up)
  if [ -x /usr/sbin/mke2fs ] && /usr/sbin/mke2fs -q -F -t ext4 /dev/vda >/tmp/mkfs.log 2>&1; then FST=ext4
  else cat /tmp/mkfs.log 2>/dev/null; busybox mke2fs -F /dev/vda >/dev/null 2>&1 || fail "mkfs"; FST=ext2; fi
  t1=$(up); log "mkfs type=$FST s=$(dt $t0 $t1)"
  mount -t $FST /dev/vda /mnt || fail "mount"
  t0=$(up); mkdir -p /mnt/d
  i=0; while [ $i -lt 16 ]; do dd if=/pat of=/mnt/big$i bs=1M skip=$i count=1 2>/dev/null || fail "write big$i"; i=$((i+1)); done
  i=0; while [ $i -lt $FILES ]; do dd if=/pat of=/mnt/d/f$i bs=1k skip=$((i*5)) count=$(( (i % 9) + 1 )) 2>/dev/null || fail "write f$i"; i=$((i+1)); done
  sync; t1=$(up); log "fs_write files=$((16+FILES)) s=$(dt $t0 $t1)"
  (cd /mnt && md5sum big* d/*) > /tmp/manifest || fail "md5sum"
  umount /mnt || fail "umount"; echo 3 > /proc/sys/vm/drop_caches
  mount -t $FST /dev/vda /mnt || fail "remount"
  t0=$(up); (cd /mnt && md5sum -c /tmp/manifest >/tmp/check.log 2>&1) || { tail -5 /tmp/check.log; fail "fs md5 mismatch"; }
  t1=$(up); log "fs_verify ok files=$(wc -l < /tmp/manifest) s=$(dt $t0 $t1)"
  rm -rf /mnt/d; sync; umount /mnt || fail "final umount"
fi
log "workload done"
finish
INIT
chmod 755 "$IRD/init"
(cd "$IRD" && find . | "$IRD/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 > "$VMRIG_DIR/initramfs.cpio.gz")

cat > "$VMRIG_DIR/env.sh" <<EOF
# generated by vm-setup.sh
QEMU=$QEMU
QEMU_LD_LIBRARY_PATH=$QLIB
QEMU_MODULE_DIR=$QMODDIR
QEMU_FW_ARGS="-L $QROOT/usr/share/qemu -L $QROOT/usr/share/seabios -L $QROOT/usr/lib/ipxe/qemu"
QSD=$QSD
VMRIG_KERNEL=$VMRIG_DIR/vmlinuz
VMRIG_INITRD=$VMRIG_DIR/initramfs.cpio.gz
VMRIG_VMLINUX=$VMRIG_DIR/vmlinux
EOF
log "ok: kernel=$KVER qemu=$(LD_LIBRARY_PATH=$QLIB "$QEMU" --version | head -n1)"
log "ok: qemu-storage-daemon=$QSD ($("$QSD" --version | head -n1))"
log "ok: initramfs=$VMRIG_DIR/initramfs.cpio.gz ($(du -h "$VMRIG_DIR/initramfs.cpio.gz" | cut -f1))"
