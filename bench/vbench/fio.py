"""fio: the job matrix (JOBS), one fio run with json+ output parsed into throughput and
p50/p99 latency, one table cell (a server started fresh, fio against it, repeated
--repeat times, median kept), and section "fio": every job against every server and
direct fio, on the tmpfs image and on the disk image.
"""

import json
import os
import shlex
import subprocess
import threading
import time
import urllib.request

from .common import IMAGE_SIZE, MiB, PIN, RAW, ROOT, fill_image, last_line, log, slug
from .servers import StartError


class FioError(Exception):
    pass


def percentiles_us(job):
    """p50/p99 completion latency over reads and writes together, from json+ bins."""
    bins = {}
    for d in ("read", "write"):
        if job[d]["total_ios"] > 0:
            for k, v in job[d]["clat_ns"].get("bins", {}).items():
                bins[int(k)] = bins.get(int(k), 0) + v
    total = sum(bins.values())
    if total:
        out, acc, want = [], 0, [0.50 * total, 0.99 * total]
        for ns in sorted(bins):
            acc += bins[ns]
            while want and acc >= want[0]:
                out.append(ns / 1000)
                want.pop(0)
        return out[0], out[1]
    for d in ("read", "write"):  # no bins: fio's own percentiles of the busier side
        if job[d]["total_ios"] > 0:
            p = job[d]["clat_ns"].get("percentile", {})
            return p.get("50.000000", 0) / 1000, p.get("99.000000", 0) / 1000
    return None, None


def run_fio(name, args, timeout):
    path = RAW / f"{name}.json"
    cmd = PIN["fio"] + ["fio", "--output-format=json+", f"--output={path}", f"--name={name}"] + args
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        wall = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        raise FioError(f"fio timed out after {timeout:.0f} s")
    try:
        data = json.loads(path.read_text())
        job = data["jobs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        raise FioError(f"fio exit {r.returncode}: {last_line(r.stdout)}")
    if r.returncode != 0 or job.get("error"):
        raise FioError(f"fio error {job.get('error')}: {last_line(r.stdout)}")
    rd, wr = job["read"], job["write"]
    p50, p99 = percentiles_us(job)
    # fio's group figures divide by one job's runtime. A server that takes its connections one
    # at a time (qemu-nbd's default --shared=1) makes the jobs run one after another, and then
    # those figures count every job's I/O against one job's time: scale them to the real wall time.
    planned = expected_seconds(args)
    scale = planned / wall if planned and wall > 1.5 * planned + 1 else 1.0
    return {
        "iops": (rd["iops"] + wr["iops"]) * scale,
        "mibs": (rd["bw_bytes"] + wr["bw_bytes"]) / MiB * scale,
        "serialized": scale < 1.0,
        "wall_s": wall,
        "p50_us": p50,
        "p99_us": p99,
        "total_ios": rd["total_ios"] + wr["total_ios"],
        "raw": str(path.relative_to(ROOT)),
        "cmd": "fio " + shlex.join(cmd[len(PIN["fio"]) + 3:]),
    }


def expected_seconds(args):
    """How long a time-based fio run with these options should take when its jobs run at once."""
    opt = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    if "runtime" not in opt:
        return None
    return int(opt["runtime"]) + int(opt.get("ramp_time", 0))


# fio matrix jobs: (id, title, fio options, metric)
JOBS = [
    ("randread-4k-qd1", "4K randread QD1", dict(rw="randread", bs="4k", iodepth=1), "iops"),
    ("randread-4k-qd32", "4K randread QD32", dict(rw="randread", bs="4k", iodepth=32), "iops"),
    ("randread-4k-qd32x4", "4K randread QD32 ×4 conns", dict(rw="randread", bs="4k", iodepth=32, numjobs=4), "iops"),
    ("randwrite-4k-qd32", "4K randwrite QD32", dict(rw="randwrite", bs="4k", iodepth=32), "iops"),
    ("randrw-4k-qd16", "4K randrw 70/30 QD16", dict(rw="randrw", rwmixread=70, bs="4k", iodepth=16), "iops"),
    ("read-1m-qd8", "1M seq read QD8", dict(rw="read", bs="1m", iodepth=8), "mibs"),
    ("write-1m-qd8", "1M seq write QD8", dict(rw="write", bs="1m", iodepth=8), "mibs"),
]
JOB = {j[0]: j for j in JOBS}


def fio_job_args(opts, runtime, ramp):
    a = [f"--{k}={v}" for k, v in opts.items()]
    if "numjobs" not in opts:
        a.append("--numjobs=1")
    a += ["--group_reporting", "--time_based", f"--runtime={runtime}", "--norandommap", "--randrepeat=0"]
    if ramp:
        a.append(f"--ramp_time={ramp}")
    return a


class Scraper:
    """For a server started with --metrics HOST:PORT: GET /metrics once a second, as
    Prometheus would, until stop(). Does nothing for other servers."""

    def __init__(self, extra):
        self.done = threading.Event()
        self.thread = None
        if "--metrics" in extra:
            url = f"http://{extra[list(extra).index('--metrics') + 1]}/metrics"
            self.thread = threading.Thread(target=self.run, args=(url,), daemon=True)
            self.thread.start()

    def run(self, url):
        while not self.done.wait(1.0):
            try:
                urllib.request.urlopen(url, timeout=2).read()
            except OSError:
                pass

    def stop(self):
        self.done.set()
        if self.thread:
            self.thread.join()


def cell(b, name, label, kind, medium, extra, opts, metric, runtime=None, ramp=None, make_server=None, repeat=None):
    """One fio cell, repeated, median by throughput. `make_server(label, kind, medium, extra)`
    replaces `b.server` (section overlay: a server that makes its own fresh overlay)."""
    runtime = runtime or b.runtime
    ramp = b.ramp if ramp is None else ramp
    repeat = repeat or b.repeat
    key = (label, medium, tuple(extra))
    if key in b.failed_start:
        return {"error": f"failed: {b.failed_start[key]}"}
    runs = []
    for i in range(repeat):
        rname = f"{name}.{i}" if repeat > 1 else name
        b.prep(medium)
        args = fio_job_args(opts, runtime, ramp)
        timeout = runtime + ramp + 90
        try:
            if kind == "direct":
                direct = 1 if medium == "disk" else 0
                r = run_fio(rname, args + ["--ioengine=io_uring", f"--filename={b.images[medium]}",
                                           f"--direct={direct}"], timeout)
                r["rss_mib"] = None
            else:
                srv = (make_server or b.server)(label, kind, medium, extra)
                try:
                    srv.start()
                except StartError as e:
                    b.failed_start[key] = str(e)
                    log(f"  {label} ({medium}) failed to start: {e}")
                    return {"error": f"failed: {e}"}
                scraper = Scraper(extra)
                try:
                    # fio counts requests only after its ramp: so does the server's CPU time.
                    mark = {}
                    timer = threading.Timer(ramp, lambda: mark.update(c0=srv.cpu_seconds(), t0=time.monotonic()))
                    timer.start()
                    try:
                        r = run_fio(rname, args + ["--ioengine=nbd", f"--uri={b.uri(medium, srv.sock)}"], timeout)
                    finally:
                        timer.cancel()
                    c1, t1 = srv.cpu_seconds(), time.monotonic()
                finally:
                    scraper.stop()
                    srv.stop()
                r.update(srv.extra)
                r["rss_mib"] = srv.rss_mib
                c0, t0 = mark.get("c0"), mark.get("t0")
                ok = c0 is not None and c1 is not None and t1 > t0
                r["cpu_pct"] = 100 * (c1 - c0) / (t1 - t0) if ok else None
                r["cpu_us_per_req"] = 1e6 * (c1 - c0) / r["total_ios"] if ok and r["total_ios"] else None
                r["server_cmd"] = shlex.join(srv.argv)
        except FioError as e:
            log(f"  {name}: {e}")
            return {"error": f"failed: {e}"}
        runs.append(r)
    runs.sort(key=lambda r: r[metric])
    best = dict(runs[len(runs) // 2])
    best["repeats"] = [r[metric] for r in runs]
    best["rss_mib"] = max((r["rss_mib"] for r in runs if r.get("rss_mib")), default=None)
    v = best[metric]
    log(f"  {label:<28} {medium:<5} {name.split('.')[0]:<40} "
        f"{v:>10.0f} {'IOPS' if metric == 'iops' else 'MiB/s'}  p50 {best['p50_us']:.0f} µs  p99 {best['p99_us']:.0f} µs")
    return best


MATRIX_TARGETS = [  # label, kind, extra args (on disk, vdisk also gets --direct: Bench.server_argv)
    ("vdisk uring", "vdisk", ("--engine", "uring")),
    ("vdisk threads", "vdisk", ("--engine", "threads")),
    ("qemu-nbd", "qemu-nbd", ()),
    ("nbdkit", "nbdkit", ()),
    ("direct", "direct", ()),
]
PEERS = ("qemu-nbd", "nbdkit")

# The configurations each peer is tried in, per medium; every row keeps the fastest (section_fio).
# The cache mode is fixed per medium so every server keeps the same durability and caching:
# page cache on tmpfs (which has no O_DIRECT), O_DIRECT on disk (vdisk --direct, fio --direct=1).
# qemu-nbd's own defaults are --shared=1 (one connection at a time) and --aio=threads; `()` is
# the configuration this bench used before tuning (--aio=io_uring --shared=8).
PEER_CONFIGS = {
    ("qemu-nbd", "tmpfs"): [(), ("--shared=1", "--aio=threads"), ("--shared=8", "--aio=threads")],
    ("qemu-nbd", "disk"): [(), ("--shared=8", "--aio=threads"), ("--shared=8", "--aio=native")],
    ("nbdkit", "tmpfs"): [(), ("--threads=4",), ("--threads=64",)],
    ("nbdkit", "disk"): [(), ("--threads=4",), ("--threads=64",)],
}


def peer_config_name(kind, extra):
    if not extra:
        return "--aio=io_uring --shared=8" if kind == "qemu-nbd" else "defaults (16 threads)"
    return " ".join(extra)


def tune_peer(b, label, kind, medium, jid, opts, metric):
    """Try every configuration of a peer on one row for b.tune_seconds each; the fastest's extra
    arguments and every configuration's figure."""
    tried = {}
    for extra in PEER_CONFIGS[(kind, medium)]:
        name = f"tune-{medium}-{jid}-{slug(label + '-' + '-'.join(extra))}"
        r = cell(b, name, label, kind, medium, extra, opts, metric, runtime=b.tune_seconds, ramp=1, repeat=1)
        tried[extra] = None if "error" in r else r[metric]
    best = max((e for e in tried if tried[e] is not None), key=lambda e: tried[e], default=())
    return best, {peer_config_name(kind, e): v for e, v in tried.items()}


def section_fio(b, res):
    res.update({"cells": {}, "media": ["tmpfs", "disk"]})
    for medium in res["media"]:
        log(f"fio matrix on {medium}: filling {b.images[medium]}")
        fill_image(b.images[medium], IMAGE_SIZE, medium == "disk")
        for jid, _title, opts, metric in JOBS:
            for label, kind, extra in MATRIX_TARGETS:
                tried = None
                if kind in PEERS and b.tune_seconds:
                    extra, tried = tune_peer(b, label, kind, medium, jid, opts, metric)
                name = f"fio-{medium}-{jid}-{slug(label)}"
                r = cell(b, name, label, kind, medium, extra, opts, metric)
                r["metric"] = metric
                if kind in PEERS:
                    r["config"] = peer_config_name(kind, extra)
                    r["tuning"] = tried
                res["cells"][f"{medium}|{jid}|{label}"] = r
    return res
