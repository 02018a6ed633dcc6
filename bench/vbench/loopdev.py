"""Section "loop": the old experiments through a real block device. Each target exposes
the refilled tmpfs image as one file, `losetup --direct-io=on` makes it a loop device
(buffered for qemu-storage-daemon's FUSE export, whose direct-I/O loop device corrupts ext4);
then dd, mkfs.ext4 (with and without discard), a cold find|cat of 2000 files, dbench,
aio-stress's four 8K O_DIRECT patterns and four libaio O_DIRECT fio jobs (4K random
QD32, 1M sequential QD8). Every mount and loop device is torn down again.

How the file comes about (the targets): vdisk's own FUSE export over /dev/fuse
(`--fuse`) and over FUSE-over-io_uring (`--fuse-uring`, with
/sys/module/fuse/parameters/enable_uring turned on for it and restored), nbdfuse on the
NBD export of vdisk, qemu-nbd and nbdkit, and qemu-storage-daemon's FUSE export.
"""

import os
import random
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from .common import (IMAGE_SIZE, LOGS, PIN, MiB, Interrupted, done_cleanup, fill_image, last_line, log, on_cleanup,
                     pdeathsig, sh, slug)
from .fio import fio_job_args, run_fio
from .servers import StartError


def timed(cmd, timeout, shell=False):
    t = time.monotonic()
    r = subprocess.run(cmd, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    dt = time.monotonic() - t
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {last_line(r.stdout)}")
    return dt, r.stdout


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def populate(root, nfiles=2000, ndirs=20, seed=1):
    rnd = random.Random(seed)
    blob = os.urandom(64 * 1024)
    total = 0
    for i in range(nfiles):
        d = root / f"d{i % ndirs:02d}" / f"s{(i // ndirs) % 5}"
        d.mkdir(parents=True, exist_ok=True)
        n = rnd.choice([512, 1024, 2048, 4096, 4096, 8192, 16384, 32768])
        (d / f"f{i:05d}.dat").write_bytes(blob[:n])
        total += n
    return total


RAW_FILE = "loop on the image file (limit)"
# label, server kind, server args, how the file is made: "nbdfuse" (nbdfuse on the server's
# NBD socket), "fuse" / "fuse-ring" (vdisk --fuse / --fuse-uring), "qsd" (the server's own FUSE export).
LOOP_TARGETS = [
    ("vdisk FUSE (classic)", "vdisk", ("--engine", "uring"), "fuse"),
    ("vdisk FUSE (ring)", "vdisk", ("--engine", "uring"), "fuse-ring"),
    ("nbdfuse on vdisk NBD", "vdisk", ("--engine", "uring"), "nbdfuse"),
    ("qemu-storage-daemon FUSE", "qsd", (), "qsd"),
    ("nbdfuse on qemu-nbd", "qemu-nbd", (), "nbdfuse"),
    ("nbdfuse on nbdkit", "nbdkit", (), "nbdfuse"),
    # The kernel-only limit: the loop device straight on the image file, no userspace server.
    (RAW_FILE, "none", (), "raw"),
]
# What "vs best peer" compares with: the other projects' ways to the same loop device.
LOOP_PEERS = ["qemu-storage-daemon FUSE", "nbdfuse on qemu-nbd", "nbdfuse on nbdkit"]
ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
AIO_PATTERNS = ["read", "randread", "write", "randwrite"]
# key, rw, block size, queue depth: libaio O_DIRECT on the loop device, one job.
FIO_LOOP_JOBS = [
    ("fio_randread_4k", "randread", "4k", 32),
    ("fio_randwrite_4k", "randwrite", "4k", 32),
    ("fio_read_1m", "read", "1M", 8),
    ("fio_write_1m", "write", "1M", 8),
]


def umount(path):
    if os.path.ismount(path):
        if sh(["umount", str(path)], check=False, timeout=60).returncode != 0:
            sh(["umount", "-l", str(path)], check=False, timeout=60)


def qsd_server(b, label, medium, disk):
    """qemu-storage-daemon with a FUSE export of the image on `disk`. Its NBD server on a
    unix socket (no exports) comes after the FUSE export on the command line, so the
    socket appearing means the file is mounted."""
    from .servers import Server
    sock = b.sock("qsd", medium)
    argv = PIN["server"] + [
        "qemu-storage-daemon",
        "--blockdev", f"driver=file,node-name=file0,filename={b.images[medium]},aio=threads",
        "--blockdev", "driver=raw,node-name=disk0,file=file0,discard=unmap",
        "--export", f"type=fuse,id=fuse0,node-name=disk0,mountpoint={disk},writable=on",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
    ]
    return Server(f"{label} {medium}", argv, sock)


class NoServer:
    """The raw-file target's stand-in for a server: nothing runs, nothing to measure."""
    rss_mib = None

    def start(self):
        return self

    def stop(self):
        pass


def loop_one(b, label, kind, extra, how):
    medium = "tmpfs"
    rows = {}
    fill_image(b.images[medium], IMAGE_SIZE, False)  # every server starts from the same data
    fuse_dir = b.work_tmp / f"fuse-{slug(label)}"
    fs_dir = b.work_tmp / f"fs-{slug(label)}"
    fuse_dir.mkdir(parents=True, exist_ok=True)
    fs_dir.mkdir(parents=True, exist_ok=True)
    disk = fuse_dir / "disk"
    entries = []
    if how == "fuse-ring":
        try:
            old = ENABLE_URING.read_text().strip()
            ENABLE_URING.write_text("Y\n")
        except OSError as e:
            return {"error": f"failed: {ENABLE_URING}: {e} (kernel without FUSE-over-io_uring?)"}
        entries.append(on_cleanup(f"restore {ENABLE_URING}", lambda: ENABLE_URING.write_text(old + "\n")))
    if how in ("fuse", "fuse-ring"):
        disk.touch()
        extra = tuple(extra) + ("--fuse", str(disk)) + (("--fuse-uring",) if how == "fuse-ring" else ())
        srv = b.server(label, kind, medium, extra)
    elif how == "qsd":
        disk.touch()
        srv = qsd_server(b, label, medium, disk)
    elif how == "raw":
        srv = NoServer()
        disk = b.images[medium]
    else:
        srv = b.server(label, kind, medium, extra)
    # A FUSE file left mounted by a server that did not stop is unmounted (after the server's own try).
    entries.append(on_cleanup(f"umount {disk}", lambda: umount(disk)))
    try:
        srv.start()
    except StartError as e:
        for ent in reversed(entries):
            done_cleanup(ent)
            ent[1]()
        return {"error": f"failed: {e}"}
    nbdfuse = loopdev = None
    try:
        if how == "nbdfuse":
            # nbdfuse: a single file MOUNT/disk backed by the export
            if not shutil.which("nbdfuse"):
                raise StartError("nbdfuse not installed")
            pidfile = b.work_tmp / f"nbdfuse-{slug(label)}.pid"
            nlog = open(LOGS / f"nbdfuse-{slug(label)}.log", "ab")
            nbdfuse = subprocess.Popen(["nbdfuse", "-P", str(pidfile), str(disk), b.uri(medium, srv.sock)],
                                       stdout=nlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       preexec_fn=pdeathsig)
            nlog.close()

            def stop_fuse(p=nbdfuse):
                umount(fuse_dir)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.terminate()
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            entries.append(on_cleanup("nbdfuse", stop_fuse))
            deadline = time.monotonic() + 20
            while not (pidfile.exists() and pidfile.stat().st_size):
                if nbdfuse.poll() is not None:
                    raise StartError(f"nbdfuse exited {nbdfuse.returncode}")
                if time.monotonic() > deadline:
                    raise StartError("nbdfuse not ready after 20 s")
                time.sleep(0.05)
        # qemu-storage-daemon's FUSE export (QEMU 10.0, Linux 6.18) under a loop device with
        # direct I/O takes mkfs.ext4's writes and yet the ext4 does not mount ("group descriptors
        # corrupted"); buffered, it mounts. So its loop device is buffered: its working configuration.
        dio = "off" if how == "qsd" else "on"
        loopdev = sh(["losetup", f"--direct-io={dio}", "-f", "--show", str(disk)]).stdout.strip()
        entries.append(on_cleanup(f"losetup -d {loopdev}", lambda d=loopdev: sh(["losetup", "-d", d], check=False)))
        dio = Path(f"/sys/block/{Path(loopdev).name}/loop/dio").read_text().strip()
        devsize = int(sh(["blockdev", "--getsize64", loopdev]).stdout.strip())
        rows["_loop"] = {"device": loopdev, "dio": dio == "1", "size": devsize}
    except (StartError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        for ent in reversed(entries):
            done_cleanup(ent)
            ent[1]()
        srv.stop()
        return {"error": f"failed: {e}"}

    def step(key, fn):
        try:
            rows[key] = fn()
            log(f"  {label:<12} {key:<16} {rows[key]}")
        except Exception as e:  # noqa: BLE001 (a step that fails is a table cell)
            if isinstance(e, Interrupted):
                raise
            rows[key] = {"error": f"failed: {str(e)[:160]}"}
            log(f"  {label:<12} {key:<16} {rows[key]['error']}")

    try:
        def dd():
            dt, _ = timed(["dd", f"if={loopdev}", "of=/dev/null", "bs=1M"], 600)
            return {"mibs": devsize / MiB / dt, "seconds": dt}
        step("dd", dd)

        def mkfs():
            dt, _ = timed(["mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", loopdev], 600)
            return {"seconds": dt}
        step("mkfs", mkfs)

        def mkfs_nodiscard():
            dt, _ = timed(["mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
                           loopdev], 600)
            return {"seconds": dt}
        step("mkfs_nodiscard", mkfs_nodiscard)

        mounted = False
        try:
            sh(["mount", loopdev, str(fs_dir)], timeout=60)
            mounted = True
            entries.append(on_cleanup(f"umount {fs_dir}", lambda: umount(fs_dir)))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            for k in ("populate", "find_cat", "dbench"):
                rows[k] = {"error": f"failed: mount: {e}"}
        if mounted:
            def pop():
                t = time.monotonic()
                nbytes = populate(fs_dir / "tree")
                os.sync()
                return {"seconds": time.monotonic() - t, "files": 2000, "bytes": nbytes}
            step("populate", pop)

            def find_cat():
                drop_caches()
                dt, _ = timed(f"find {shlex.quote(str(fs_dir / 'tree'))} -type f -exec cat {{}} + > /dev/null",
                              600, shell=True)
                return {"seconds": dt}
            step("find_cat", find_cat)

            def dbench():
                secs = 3 if b.quick else 10
                cmd = ["dbench", "-D", str(fs_dir), "-t", str(secs), "2"]
                if Path("/usr/share/dbench/client.txt").exists():
                    cmd[1:1] = ["-c", "/usr/share/dbench/client.txt"]
                _, out = timed(cmd, secs + 300)
                m = re.search(r"Throughput ([\d.]+) MB/sec.*?max_latency=([\d.]+) ms", out)
                if not m:
                    raise RuntimeError(f"no throughput in dbench output: {last_line(out)}")
                return {"mbs": float(m.group(1)), "max_latency_ms": float(m.group(2)), "seconds": secs}
            step("dbench", dbench)
            umount(fs_dir)
            done_cleanup(entries.pop())

        for rw in AIO_PATTERNS:
            def aio(rw=rw):
                per = devsize // 8 // MiB * MiB
                args = [f"--filename={loopdev}", "--ioengine=psync", "--direct=1", "--bs=8k", "--numjobs=8",
                        "--thread", f"--rw={rw}", f"--size={per}", f"--offset_increment={per}"]
                args += fio_job_args({}, b.runtime, b.ramp)[1:]  # drop --numjobs=1
                r = run_fio(f"loop-{rw}-8k-{slug(label)}", args, b.runtime + b.ramp + 120)
                return {k: r[k] for k in ("iops", "mibs", "p50_us", "p99_us", "raw", "cmd")}
            step(f"aio_{rw}", aio)

        for key, rw, bs, qd in FIO_LOOP_JOBS:
            def job(key=key, rw=rw, bs=bs, qd=qd):
                args = [f"--filename={loopdev}", "--ioengine=libaio", "--direct=1", f"--bs={bs}",
                        f"--iodepth={qd}", f"--rw={rw}"] + fio_job_args({}, b.runtime, b.ramp)
                r = run_fio(f"loop-{key}-{slug(label)}", args, b.runtime + b.ramp + 120)
                return {k: r[k] for k in ("iops", "mibs", "p50_us", "p99_us", "raw", "cmd")}
            step(key, job)
    finally:
        # Loop device, file system and nbdfuse go first; then the server (which unmounts
        # its own FUSE file); then anything it left mounted, and the uring switch.
        late = [e for e in entries if e[0].startswith(("umount " + str(disk), "restore "))]
        for ent in reversed([e for e in entries if e not in late]):
            done_cleanup(ent)
            try:
                ent[1]()
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {e}")
        srv.stop()
        for ent in reversed(late):
            done_cleanup(ent)
            try:
                ent[1]()
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {e}")
        if how != "raw":
            try:
                disk.unlink()
            except OSError:
                pass
        for d in (fuse_dir, fs_dir):
            try:
                d.rmdir()
            except OSError:
                pass
    rows["rss_mib"] = srv.rss_mib
    return rows


def section_loop(b, res):
    res.update({"servers": {}, "medium": "tmpfs"})
    for label, kind, extra, how in LOOP_TARGETS:
        log(f"loop experiments: {label}")
        res["servers"][label] = loop_one(b, label, kind, extra, how)
    return res
