#!/usr/bin/env python3
"""Where the time goes: a CPU profile and a system-call count of the server on chosen fio rows.

    python3 bench/profile.py [--rows ROW,ROW] [--targets T,T] [--seconds S] [--vdisk PATH]

For every row and target, two runs on a fresh server over a 2 GiB tmpfs image:
1. `perf record -e cpu-clock -F 1999 -g -p PID` for S seconds after fio's 1 s ramp (cpu-clock
   sampling: this VM has no hardware counters), then `perf report` by DSO, by symbol, and
   the samples summed into kinds (copies, wake-ups and scheduling, socket, page cache, …);
2. `perf stat -e raw_syscalls:sys_enter,syscalls:sys_enter_NAME,... -p PID` (NAME: SYSCALLS)
   over the same window of a second run: system calls per request, by name (strace -c would
   slow the server ~10x and change its batching).
Rows are fio.JOBS ids over NBD (fio's nbd engine, unix socket), plus the loop-on-FUSE rows
`fuse-randread-4k-qd32` and `fuse-read-1m-qd8` (vdisk --fuse / --fuse-uring, a loop device
--direct-io=on on the file, fio libaio O_DIRECT). Targets: `vdisk-uring`, `vdisk-threads`,
`nbdkit` (its default 16 threads), `qemu-nbd` (`--aio=io_uring --shared=8`), and for the FUSE
rows `fuse` / `fuse-ring`. perf.data, reports and strace output go to bench/out/profile/;
the summary (markdown) is printed and written to bench/out/profile/summary.md.
"""

import argparse
import os
import re
import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True

from vbench.common import HAVE, IMAGE_SIZE, LOGS, OUT, RAW, ROOT, fill_image, log, on_cleanup, run_cleanups, sh  # noqa: E402
from vbench.fio import JOB, fio_job_args, run_fio  # noqa: E402
from vbench.loopdev import ENABLE_URING, umount  # noqa: E402
from vbench.servers import Bench  # noqa: E402

PROF = OUT / "profile"
TARGETS = {  # name: (label, kind, extra)
    "vdisk-uring": ("vdisk uring", "vdisk", ("--engine", "uring")),
    "vdisk-threads": ("vdisk threads", "vdisk", ("--engine", "threads")),
    "nbdkit": ("nbdkit", "nbdkit", ()),
    "qemu-nbd": ("qemu-nbd", "qemu-nbd", ()),
    "fuse": ("vdisk FUSE (classic)", "vdisk", ("--engine", "uring")),
    "fuse-ring": ("vdisk FUSE (ring)", "vdisk", ("--engine", "uring")),
}
FUSE_ROWS = {  # id: (title, fio options on the loop device)
    "fuse-randread-4k-qd32": ("loop on FUSE 4K randread QD32", dict(rw="randread", bs="4k", iodepth=32)),
    "fuse-read-1m-qd8": ("loop on FUSE 1M read QD8", dict(rw="read", bs="1M", iodepth=8)),
}
# Kernel and user symbols summed into kinds (first match wins), to say where a request's CPU goes.
KINDS = [
    ("copy", r"copy_(user|to_iter|from_iter|page_to_iter|page_from_iter)|rep_movs|memcpy|memmove|_copy_to_user|"
             r"copy_mc|__memcpy|skb_copy_datagram|simple_copy_to_iter"),
    ("wake-up / scheduler", r"try_to_wake_up|ttwu|schedule|finish_task_switch|futex|enqueue_task|dequeue_task|"
                            r"select_task_rq|update_curr|pick_next|__switch_to|wake_up|psi_|idle|"
                            r"native_sched_clock|update_load_avg|reweight|set_next_entity|autoremove_wake"),
    ("syscall entry/exit", r"entry_SYSCALL|syscall_exit|do_syscall|syscall_return|__x64_sys|exit_to_user|"
                           r"syscall_enter|restore_regs|fpregs|__entry_text"),
    ("socket / unix stream", r"unix_stream|sock_|skb|__kfree_skb|kmalloc_reserve|alloc_skb|consume_skb|"
                             r"sendmsg|recvmsg|unix_|scm_|____sys_"),
    ("page cache / tmpfs", r"filemap|shmem|xas_|find_get|folio|pagecache|generic_perform_write|"
                           r"generic_file|page_cache|mark_page|balance_dirty|iomap"),
    ("io_uring", r"io_uring|io_|__io_"),
    ("fuse / loop / block", r"fuse|lo_|loop_|blk_|bio|submit_bio|aio_|dio"),
    ("memory (alloc, faults)", r"malloc|free|kmem_cache|__alloc|page_fault|handle_mm|do_anonymous|"
                               r"clear_page|zap_|mmap|munmap|cfree|_int_"),
    ("locks / atomics", r"spin_lock|_raw_spin|mutex|rwsem|lock"),
]


def parse_report(text):
    """(percent, name) rows of a `perf report --stdio --no-children` flat listing."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(.*\S)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2)))
    return rows


def perf_summary(data):
    """Kernel/user split, top symbols and kinds from one perf.data."""
    def report(sort):
        r = sh(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", sort, "-g", "none",
                "--percent-limit", "0.2"], timeout=300, check=False)
        return r.stdout
    by_dso = report("dso")
    by_sym = report("dso,sym")
    Path(str(data) + ".dso.txt").write_text(by_dso)
    Path(str(data) + ".sym.txt").write_text(by_sym)
    kernel = sum(p for p, n in parse_report(by_dso) if "kernel" in n or "[k]" in n)
    syms = []
    for p, n in parse_report(by_sym):
        m = re.match(r"(\S+)\s+\[([k.])\]\s+(.*)", n)
        if m:
            syms.append((p, m.group(3).strip(), m.group(2) == "k", m.group(1)))
    kinds = {}
    for p, name, _k, _dso in syms:
        kind = next((k for k, rx in KINDS if re.search(rx, name)), "other")
        kinds[kind] = kinds.get(kind, 0) + p
    return {"kernel_pct": kernel, "top": syms[:12], "kinds": kinds}


# The system calls counted by name (the rest only in the total, as "other").
SYSCALLS = ["read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
            "recvfrom", "sendto", "recvmsg", "sendmsg", "futex", "epoll_wait", "epoll_pwait", "poll", "ppoll",
            "io_uring_enter", "sched_yield", "splice"]


def syscall_summary(path):
    """Calls by name from `perf stat -x, -e raw_syscalls:sys_enter,syscalls:sys_enter_NAME,...` output."""
    calls, total = {}, 0
    for line in Path(path).read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[0].strip().isdigit():
            if parts[2] == "raw_syscalls:sys_enter":
                total = int(parts[0])
            elif parts[2].startswith("syscalls:sys_enter_") and int(parts[0]):
                calls[parts[2][len("syscalls:sys_enter_"):]] = int(parts[0])
    if total > sum(calls.values()):
        calls["other"] = total - sum(calls.values())
    return calls


class FuseTarget:
    """vdisk --fuse[-uring] on a file, and a loop device (--direct-io=on) on that file."""

    def __init__(self, b, name):
        self.b, self.name = b, name
        self.dir = b.work_tmp / f"fuse-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / "disk"
        self.file.touch()
        label, kind, extra = TARGETS[name]
        extra = tuple(extra) + ("--fuse", str(self.file)) + (("--fuse-uring",) if name == "fuse-ring" else ())
        self.srv = b.server(label, kind, "tmpfs", extra)
        self.loop = None
        self.old_uring = None

    def start(self):
        if self.name == "fuse-ring":
            self.old_uring = ENABLE_URING.read_text().strip()
            ENABLE_URING.write_text("Y\n")
        self.srv.start()
        self.loop = sh(["losetup", "--direct-io=on", "-f", "--show", str(self.file)]).stdout.strip()
        return self

    def stop(self):
        if self.loop:
            sh(["losetup", "-d", self.loop], check=False)
            self.loop = None
        self.srv.stop()
        umount(self.file)
        if self.old_uring is not None:
            ENABLE_URING.write_text(self.old_uring + "\n")
            self.old_uring = None


def one(b, row, target, seconds, how):
    """One run of `row` against `target` with perf ("perf") or strace ("strace") on the server."""
    fuse = row in FUSE_ROWS
    if fuse:
        title, opts = FUSE_ROWS[row]
        t = FuseTarget(b, target).start()
        srv = t.srv
        fio_target = ["--ioengine=libaio", "--direct=1", f"--filename={t.loop}"]
    else:
        _, title, opts, _ = JOB[row]
        label, kind, extra = TARGETS[target]
        srv = b.server(label, kind, "tmpfs", extra).start()
        t = srv
        fio_target = ["--ioengine=nbd", f"--uri={b.uri('tmpfs', srv.sock)}"]
    name = f"prof-{row}-{target}-{how}"
    out = {}
    try:
        args = fio_job_args(opts, seconds, 1) + fio_target
        if how == "perf":
            path = PROF / f"{row}-{target}.perf.data"
            def rec():
                time.sleep(1)  # fio's ramp
                out["c0"] = srv.cpu_seconds()
                sh(["perf", "record", "-q", "-e", "cpu-clock", "-F", "1999", "-g", "-o", str(path), "-p",
                    str(srv.pid), "--", "sleep", str(seconds)], timeout=seconds + 60, check=False)
                out["c1"] = srv.cpu_seconds()
            th = threading.Thread(target=rec)
            th.start()
            r = run_fio(name, args, seconds + 90)
            th.join()
        else:
            # perf stat on the syscalls:sys_enter_NAME tracepoints of the calls that matter, plus
            # raw_syscalls:sys_enter for the total: counts by name at a fraction of strace's cost
            # (strace -c stops every thread at every call and cuts throughput ~10x).
            path = PROF / f"{row}-{target}.syscalls.txt"
            events = ["raw_syscalls:sys_enter"] + [f"syscalls:sys_enter_{n}" for n in SYSCALLS]
            def count():
                time.sleep(1)
                sh(["perf", "stat", "-x", ",", "-e", ",".join(events), "-o", str(path), "-p", str(srv.pid),
                    "--", "sleep", str(seconds)], timeout=seconds + 60, check=False)
            th = threading.Thread(target=count)
            th.start()
            r = run_fio(name, args, seconds + 90)
            th.join()
    finally:
        t.stop()
    metric = "mibs" if "1m" in row else "iops"
    res = {"title": title, "value": r[metric], "unit": "MiB/s" if metric == "mibs" else "IOPS",
           "requests": r["total_ios"], "p50_us": r["p50_us"]}
    if how == "perf":
        # perf covers `seconds` of the job after the ramp: CPU per request over the same window.
        if out.get("c0") is not None and out.get("c1") is not None:
            res["cpu_us_per_req"] = 1e6 * (out["c1"] - out["c0"]) / max(1, r["total_ios"])
        res.update(perf_summary(path))
    else:
        res["syscalls"] = syscall_summary(path)
    return res


def md(results):
    out = ["| row | server | throughput | CPU µs / request | kernel % | copy % | wake-up / sched % | syscall "
           "entry % | socket % | page cache % | syscalls / request (perf stat, top kinds) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (row, target), r in results.items():
        p, s = r.get("perf", {}), r.get("syscalls", {})
        if "error" in p or "error" in s:
            out.append(f"| {row} | {target} | failed: {p.get('error') or s.get('error')} | | | | | | | | |")
            continue
        k = p.get("kinds", {})
        calls = s.get("syscalls", {})
        req = max(1, s.get("requests", 1))
        tot = sum(calls.values()) / req
        top = sorted(calls.items(), key=lambda kv: -kv[1])[:5]
        sc = f"{tot:.2f}: " + ", ".join(f"{n} {c / req:.2f}" for n, c in top)
        cpu = p.get("cpu_us_per_req")
        out.append(f"| {p.get('title', row)} | {target} | {p.get('value', 0):,.0f} {p.get('unit', '')} | "
                   f"{'—' if cpu is None else f'{cpu:.1f}'} | {p.get('kernel_pct', 0):.0f} | "
                   f"{k.get('copy', 0):.0f} | {k.get('wake-up / scheduler', 0):.0f} | "
                   f"{k.get('syscall entry/exit', 0):.0f} | {k.get('socket / unix stream', 0):.0f} | "
                   f"{k.get('page cache / tmpfs', 0):.0f} | {sc} |")
    out.append("")
    for (row, target), r in results.items():
        p = r.get("perf", {})
        if p.get("top"):
            out.append(f"- {p.get('title', row)}, {target}: " + ", ".join(
                f"{name} {pct:.1f}%{' [k]' if k else ''}" for pct, name, k, _ in p["top"][:8]))
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="randread-4k-qd1,randread-4k-qd32,randwrite-4k-qd32,read-1m-qd8,write-1m-qd8")
    p.add_argument("--targets", default="vdisk-threads,vdisk-uring,nbdkit")
    p.add_argument("--seconds", type=int, default=4)
    p.add_argument("--vdisk", default=str(ROOT / "target" / "release" / "vdisk"))
    a = p.parse_args()
    if os.geteuid() != 0:
        p.error("run as root (perf, strace, loop devices)")
    args = types.SimpleNamespace(quick=True, runtime=a.seconds, repeat=1, tune_seconds=0, tmpfs_dir="/dev/shm",
                                 disk_dir="/var/tmp")
    b = Bench(args)
    b.vdisk = Path(a.vdisk).resolve()
    HAVE["setpriv"] = False
    for d in (RAW, LOGS, PROF):
        d.mkdir(parents=True, exist_ok=True)
    b.work_tmp.mkdir(parents=True)
    on_cleanup(f"rm -r {b.work_tmp}", lambda: sh(["rm", "-rf", str(b.work_tmp)], check=False))
    b.sockdir.mkdir()
    fill_image(b.images["tmpfs"], IMAGE_SIZE, False)
    results = {}
    try:
        for row in a.rows.split(","):
            targets = a.targets.split(",")
            if row in FUSE_ROWS:
                targets = [t for t in targets if t.startswith("fuse")] or ["fuse", "fuse-ring"]
            else:
                targets = [t for t in targets if not t.startswith("fuse")]
            for target in targets:
                r = results[(row, target)] = {}
                for how in ("perf", "syscalls"):
                    try:
                        r[how] = one(b, row, target, a.seconds, how)
                    except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
                        r[how] = {"error": str(e)[:150]}
                    log(f"{row} {target} {how}: " + str({k: v for k, v in r[how].items() if k != 'top'})[:300])
    finally:
        run_cleanups()
    text = md(results)
    (PROF / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
