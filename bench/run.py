#!/usr/bin/env python3
"""vdisk benchmark suite: vdisk against qemu-nbd, nbdkit and direct fio, in one run.

    python3 bench/run.py [--quick] [--only SECTION[,SECTION]] [--repeat N] [--pin none|split|same] [--no-build]

Run as root from anywhere (it finds the workspace from its own path). Sections:

  fio        fio matrix over fio's nbd engine (unix socket) for vdisk (uring and
             threads engines, --direct on disk), qemu-nbd, nbdkit, plus fio
             io_uring on the image file itself ("direct"); on a 2 GiB tmpfs image
             and a 2 GiB ext4 image.
  ablations  vdisk knobs on tmpfs (workers, batching, engine) for 4K randread and
             randwrite QD32, and system calls per request (perf or strace) for
             every vdisk config and both peers.
  bitmaps    4K randwrite QD32 on tmpfs, vdisk uring with 0, 1 and 4 enabled dirty
             bitmaps and during a backup (a backup view open: copy-before-write),
             and the ratio of each to none (about 1 min in --quick).
  loop       the old experiments through a FUSE file + a loop device (--direct-io=on):
             the file from vdisk --fuse (classic /dev/fuse and FUSE-over-io_uring), nbdfuse
             on vdisk's, qemu-nbd's and nbdkit's NBD, and qemu-storage-daemon's FUSE export;
             dd read, mkfs.ext4, cold find+cat of 2000 files, dbench, 8K O_DIRECT
             read/randread/write/randwrite with 8 threads, and libaio O_DIRECT fio jobs
             (4K randread/randwrite QD32, 1M read/write QD8).
  overlay    copy-on-write overlays over a 2 GiB tmpfs base, a fresh one per job: vdisk
             (uring, threads) on a UML COW v3 overlay and on qcow2, qemu-nbd on qcow2,
             nbdkit's cow filter; 4K randread/randwrite QD32, 1M seq read/write QD8.
  vm         a QEMU guest (TCG, scripts/vmrig) on vdisk's vhost-user-blk socket and on
             qemu-storage-daemon's, 1 and 2 queues: the guest's own timings side by side; then
             kicks, calls and system calls per request (a guest fio run, the server under strace).
  rbd        a 1 GiB image on a throwaway single-node Ceph cluster (scripts/cephrig):
             vdisk over NBD, qemu-nbd with qemu's rbd driver (where it loads) and fio's own
             rbd engine (no server), side by side: 4K randread/randwrite QD32, 1M read/write QD8.
  scale      many exports on one server, vdisk beside qemu-storage-daemon: RSS and threads with
             0/200/1000 idle exports, 10,000 added through the control socket (time, RSS), 4 busy
             exports alone and beside 996 idle ones, a QD1 reader's p99 beside a QD128 writer.
  jobs       live block jobs, vdisk beside qemu-storage-daemon: fio 4K randwrite QD32 alone, during a
             mirror and during an active commit (each without and with the job's rate limit); the
             guest's IOPS and their ratio to the row without a job, the job's time and bytes copied.

Every server's peak RSS (VmHWM, read just before it is stopped) sits beside its rows.
Writes docs/benchmarks.md and docs/benchmarks.png, raw fio JSON and server logs under
bench/out/ (gitignored), and bench/out/results.json. With --only, the sections not run
are taken from the previous bench/out/results.json, each marked with its own date.

--quick: 2 s per fio job instead of 10 s (ramp 1 s either way), dbench 3 s instead
of 10 s; about 8 minutes for the fio to overlay sections (23 in a full run), plus about
10 for vm (its boots do not shorten) and 1 for rbd.
python3 bench/run.py --help lists every option; bench/README.md explains the numbers.

Needs: fio, qemu-nbd and qemu-img (qemu-utils), nbdkit, nbdfuse (libnbd-bin), dbench,
perf (linux-perf) or strace, losetup, mkfs.ext4; matplotlib for the PNG (apt-get install -y
python3-matplotlib); the vm section: strace and the rig (scripts/vmrig, set up by the section).
Every server, FUSE mount, loop device, socket and image it makes is removed again,
also on failure or Ctrl-C; a server that cannot start turns its rows into
"failed: reason".

This file only parses the options and runs the sections; the work is in bench/vbench/
(common, servers, fio, ablations, loopdev, overlay, vm, rbd, scale, jobs, report: see vbench/__init__.py).
"""


import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vbench/ beside this file, even with python3 -P
sys.dont_write_bytecode = True  # run as root: leave no root-owned __pycache__ in the tree

from vbench.ablations import check_syscall_method, section_ablations
from vbench.bitmaps import section_bitmaps
from vbench.common import (DEFAULT_MD, DEFAULT_PNG, HAVE, LOGS, OUT, PIN, RAW, SECTIONS, Interrupted, log, on_cleanup,
                           on_signal, run_cleanups)
from vbench.fio import section_fio
from vbench.jobs import section_jobs
from vbench.loopdev import section_loop
from vbench.overlay import section_overlay
from vbench.vm import section_vm
from vbench.rbd import section_rbd
from vbench.scale import section_scale
from vbench.report import machine_info, plot, render
from vbench.servers import Bench, build_vdisk


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Sections: " + ", ".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="2 s fio jobs, 3 s dbench (about 8 min + 11 for vm and rbd; full about 23 + 11)")
    p.add_argument("--only", action="append", default=[],
                   help="run only these sections (comma-separated or repeated): " + ", ".join(SECTIONS))
    p.add_argument("--repeat", type=int, default=1, help="run each fio job N times, report the median (default 1)")
    p.add_argument("--runtime", type=int, default=0, help="seconds per fio job (default 10, --quick 2)")
    p.add_argument("--tune-seconds", type=int, default=None,
                   help="fio matrix: try each peer configuration on each row for N s and keep the fastest "
                        "(default 2, --quick 1; 0 runs each peer as configured before)")
    p.add_argument("--syscall-seconds", type=int, default=3, help="length of the syscall-count job (default 3)")
    p.add_argument("--syscalls", choices=["auto", "perf", "strace"], default="auto",
                   help="how to count system calls (default: perf if it works, else strace)")
    p.add_argument("--pin", choices=["none", "split", "same"], default="none",
                   help="CPU placement: split = servers on CPU 1, fio on CPU 0; same = both on CPU 0; "
                        "none (default) = the scheduler's choice")
    p.add_argument("--scale-exports", type=int, default=10000,
                   help="section scale: exports added through the control socket in its add row (default 10000)")
    p.add_argument("--no-build", action="store_true", help="do not run cargo build --release first")
    p.add_argument("--vdisk", help="vdisk binary to measure (default target/release/vdisk)")
    p.add_argument("--tmpfs-dir", default="/dev/shm", help="tmpfs directory for the tmpfs image (default /dev/shm)")
    p.add_argument("--disk-dir", default="/var/tmp", help="disk directory for the disk image (default /var/tmp)")
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: rewrite the markdown and PNG from bench/out/results.json")
    p.add_argument("--md", default=str(DEFAULT_MD), help="markdown output (default docs/benchmarks.md)")
    p.add_argument("--png", default=str(DEFAULT_PNG), help="chart output (default docs/benchmarks.png)")
    args = p.parse_args()
    only = [s for o in args.only for s in o.split(",") if s]
    for s in only:
        if s not in SECTIONS:
            p.error(f"unknown section {s!r}; sections: {', '.join(SECTIONS)}")
    sections = [s for s in SECTIONS if not only or s in only]
    if args.render_only:
        saved = json.loads((OUT / "results.json").read_text())
        md_path, png_path = Path(args.md), Path(args.png)
        if "fio" in saved["results"] and not plot(saved["results"], png_path, saved["meta"]):
            png_path = None
        render(saved["results"], saved["meta"], md_path, png_path)
        log(f"rewrote {md_path} and {png_path} from {OUT / 'results.json'}")
        return
    if os.geteuid() != 0:
        p.error("run as root (loop devices, mounts, drop_caches, perf)")
    missing = [t for t in ("fio", "qemu-nbd", "qemu-img", "nbdkit", "nbdfuse", "dbench", "losetup", "mkfs.ext4")
               if not shutil.which(t)]
    if "fio" in missing:
        raise SystemExit("fio is required: apt-get install fio")
    if missing:
        log(f"missing {', '.join(missing)}: their rows will say so "
            "(apt-get install qemu-utils nbdkit libnbd-bin dbench)")

    if args.pin != "none":
        if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
            p.error("--pin needs taskset and 2 CPUs")
        PIN["fio"] = ["taskset", "-c", "0"]
        PIN["server"] = ["taskset", "-c", "1" if args.pin == "split" else "0"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    b = Bench(args)
    command = "python3 bench/run.py" + ("" if len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:]))
    for d in (RAW, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    try:
        old = json.loads(results_path.read_text()) if results_path.exists() else {}
    except ValueError:
        old = {}
    results = {k: v for k, v in old.get("results", {}).items() if k in SECTIONS and k not in sections} if only else {}
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    meta = {"command": command, "date": started, "mode": "quick" if args.quick else "full",
            "runtime": b.runtime, "repeat": b.repeat, "syscall_seconds": args.syscall_seconds, "pin": args.pin,
            "machine": machine_info(), "vdisk": "?"}
    try:
        b.work_tmp.mkdir(parents=True)
        on_cleanup(f"rm -r {b.work_tmp}", lambda: shutil.rmtree(b.work_tmp, ignore_errors=True))
        b.sockdir.mkdir()
        if "fio" in sections:
            b.work_disk.mkdir(parents=True)
            on_cleanup(f"rm -r {b.work_disk}", lambda: shutil.rmtree(b.work_disk, ignore_errors=True))
        meta["vdisk"] = build_vdisk(b, args)
        b.syscall_method = check_syscall_method(args.syscalls)
        HAVE["setpriv"] = bool(shutil.which("setpriv"))
        log(f"{command}: sections {', '.join(sections)}; vdisk {meta['vdisk']}")
        for sec in sections:
            ts = time.monotonic()
            log(f"== section {sec}")
            r = results[sec] = {"_meta": {"date": started, "command": command, "mode": meta["mode"],
                                          "syscall_seconds": args.syscall_seconds}}
            {"fio": section_fio, "ablations": section_ablations, "bitmaps": section_bitmaps, "loop": section_loop,
             "overlay": section_overlay, "vm": section_vm, "rbd": section_rbd, "scale": section_scale,
             "jobs": section_jobs}[sec](b, r)
            r["_meta"]["minutes"] = (time.monotonic() - ts) / 60
            log(f"== section {sec} took {(time.monotonic() - ts) / 60:.1f} min")
    except (KeyboardInterrupt, Interrupted) as e:
        log(f"interrupted ({e or 'Ctrl-C'}): cleaning up, writing what was measured")
        meta["interrupted"] = True
    finally:
        run_cleanups()
    meta["elapsed_min"] = (time.monotonic() - t0) / 60
    meta["machine"].setdefault("loadavg_end", Path("/proc/loadavg").read_text().split()[:3])
    results_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    md_path, png_path = Path(args.md), Path(args.png)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    if "fio" in results and not plot(results, png_path, meta):
        png_path = None
    render(results, meta, md_path, png_path)
    log(f"wrote {md_path}, {png_path}, {results_path}; took {meta['elapsed_min']:.1f} min")
    if meta.get("interrupted"):
        sys.exit(130)



if __name__ == "__main__":
    main()
