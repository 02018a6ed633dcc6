"""Section "ablations": vdisk's knobs (batching, workers, engine) on the tmpfs image for
4K randread and randwrite QD32 beside both peers, and system calls per request, counted
with `perf stat -e raw_syscalls:sys_enter` around the server or `strace -c -f -p PID`.
"""

import shutil
import signal
import subprocess
import time
from pathlib import Path

from .common import IMAGE_SIZE, RAW, fill_image, log, pdeathsig, slug
from .fio import JOB, FioError, cell, fio_job_args, run_fio
from .servers import StartError

# The --metrics row: the endpoint a scraper thread reads once a second while fio runs.
METRICS = "127.0.0.1:19199"

ABLATIONS = [  # label, kind, extra
    ("vdisk uring (default: --batch 64, 1 ring)", "vdisk", ("--engine", "uring")),
    ("vdisk uring --metrics (scraped every second)", "vdisk", ("--engine", "uring", "--metrics", METRICS)),
    ("vdisk uring --batch 1", "vdisk", ("--engine", "uring", "--batch", "1")),
    ("vdisk threads --workers 16 (default)", "vdisk", ("--engine", "threads", "--workers", "16")),
    ("vdisk threads --workers 1", "vdisk", ("--engine", "threads", "--workers", "1")),
    ("vdisk threads --batch 1", "vdisk", ("--engine", "threads", "--batch", "1")),
    ("qemu-nbd", "qemu-nbd", ()),
    ("nbdkit", "nbdkit", ()),
]
ABL_JOBS = ["randread-4k-qd32", "randwrite-4k-qd32"]


def count_syscalls(b, label, kind, extra, medium="tmpfs"):
    """Run the 4K randread QD32 job for ~3 s against a server whose every system
    call (all threads) is counted; return calls / requests fio completed."""
    opts = JOB["randread-4k-qd32"][2]
    secs = b.a.syscall_seconds
    name = f"syscalls-{slug(label)}"
    args = fio_job_args(opts, secs, 0)
    method = b.syscall_method
    if method is None:
        return {"error": "failed: neither perf (raw_syscalls tracepoint) nor strace works"}
    perf_out = RAW / f"{name}.perf.txt" if method == "perf" else None
    srv = b.server(label, kind, medium, extra, perf_out=perf_out)
    strace = None
    try:
        srv.start()
    except StartError as e:
        return {"error": f"failed: {e}"}
    try:
        if method == "strace":
            st_out = RAW / f"{name}.strace.txt"
            strace = subprocess.Popen(["strace", "-c", "-f", "-q", "-o", str(st_out), "-p", str(srv.pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      preexec_fn=pdeathsig)
            time.sleep(1.0)  # let it attach to every thread
        try:
            r = run_fio(name, args + ["--ioengine=nbd", f"--uri={b.uri(medium, srv.sock)}"], secs + 90)
        except FioError as e:
            return {"error": f"failed: {e}"}
        if strace:
            strace.send_signal(signal.SIGINT)
            strace.wait(timeout=30)
            strace = None
    finally:
        if strace:
            strace.kill()
            strace.wait()
        srv.stop()
    try:
        if method == "perf":
            calls = None
            for line in Path(perf_out).read_text().splitlines():
                if "raw_syscalls:sys_enter" in line:
                    calls = int(line.split(",")[0])
        else:
            calls = None
            for line in Path(st_out).read_text().splitlines():
                parts = line.split()
                if parts and parts[-1] == "total":
                    calls = int(parts[3])
        if calls is None:
            raise ValueError("no count in its output")
    except (OSError, ValueError, IndexError) as e:
        return {"error": f"failed: {method}: {e}"}
    per = calls / max(1, r["total_ios"])
    log(f"  {label:<44} {calls} syscalls / {r['total_ios']} requests = {per:.2f}")
    return {"syscalls": calls, "requests": r["total_ios"], "per_request": per, "method": method,
            "iops_while_counted": r["iops"]}


def section_ablations(b, res):
    res["rows"] = {}
    log(f"ablations on tmpfs: filling {b.images['tmpfs']}")
    fill_image(b.images["tmpfs"], IMAGE_SIZE, False)
    for label, kind, extra in ABLATIONS:
        row = {}
        for jid in ABL_JOBS:
            _, _, opts, metric = JOB[jid]
            row[jid] = cell(b, f"abl-{jid}-{slug(label)}", label, kind, "tmpfs", extra, opts, metric)
        row["syscalls"] = count_syscalls(b, label, kind, extra)
        res["rows"][label] = row
    return res


def check_syscall_method(pref):
    if pref in ("auto", "perf") and shutil.which("perf"):
        r = subprocess.run(["perf", "stat", "-e", "raw_syscalls:sys_enter", "-x", ",", "--", "true"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode == 0 and "raw_syscalls:sys_enter" in r.stderr and "not supported" not in r.stderr:
            return "perf"
    if pref in ("auto", "strace") and shutil.which("strace"):
        return "strace"
    return None
