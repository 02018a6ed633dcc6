"""Section "scale": many exports on one server (issue 23), vdisk beside qemu-storage-daemon
(qsd) in one run. Rows:

- idle: 0, 200 and 1,000 exports of 1 GiB sparse raw files in tmpfs; the server's VmRSS,
  Pss (smaps_rollup) and thread count once every export is served. vdisk gets them through
  its control socket (`serve --control`, export_add pipelined on one connection), qsd on its
  command line (`--blockdev driver=file,aio=io_uring` + `--export type=nbd` per file).
- add: N exports (default 10,000; --scale-exports) added to a running vdisk through the
  control socket, pipelined on one connection as a script would: wall time, RSS, threads;
  plus the per-add time of `vdisk ctl add` run once per export (a shell loop) for 100 of them.
- busy: 4 exports read 4K random at QD32 each (fio's nbd engine, all four at once) on a server
  that serves only them, then on one that also serves 996 idle exports: total IOPS and ratio.
- fairness: a 4K randread QD1 export's p99 alone, then while a second export of the same
  server takes 4K randwrite QD128; vdisk, and qsd with both exports on one iothread.

The busy and fairness images are 256 MiB, filled with data first. Every server is started
fresh per row with a parent-death signal and stopped (SIGTERM) after it; every file is
removed at the end. A vdisk that lists `--io-threads` in `serve --help` is run with
`--io-threads 2` (the machine's default is shown in the table either way).
"""

import json
import os
import resource
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .common import GiB, MiB, RAW, log, sh
from .fio import percentiles_us
from .servers import Server, StartError

IDLE_COUNTS = [0, 200, 1000]
BUSY = 4
BUSY_BESIDE = 1000  # busy exports plus idle ones on the "beside" server
FILLED = 256 * MiB
NOFILE = 1 << 20  # a server of thousands of exports needs more descriptors than the shell's default


def raise_nofile():
    """The descriptor limit a service with thousands of disks would set (LimitNOFILE=), for this
    process and so for every server it starts."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (NOFILE, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_figures(pid):
    """VmRSS and Pss in MiB and the thread count of a process."""
    out = {"rss_mib": None, "pss_mib": None, "threads": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def settle(pid, seconds=1.0):
    """Waits until the thread count stops moving (exports start their threads after the answer)."""
    last, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(seconds)
        f = proc_figures(pid)
        if f["threads"] == last:
            return f
        last = f["threads"]
    return proc_figures(pid)


def ctl_pipelined(path, requests, window=128):
    """Sends JSON-RPC requests on one connection, up to `window` ahead of the answers (the
    protocol answers in order); returns the number that succeeded and the first error."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(120)
    f = s.makefile("rwb")
    sent = got = ok = 0
    first_err = None
    try:
        while got < len(requests):
            while sent < len(requests) and sent - got < window:
                f.write((json.dumps({"jsonrpc": "2.0", "id": sent, **requests[sent]}) + "\n").encode())
                sent += 1
            f.flush()
            line = f.readline()
            if not line:
                first_err = first_err or "the server closed the control connection"
                break
            got += 1
            r = json.loads(line)
            if "error" in r:
                first_err = first_err or r["error"].get("message")
            else:
                ok += 1
    finally:
        f.close()
        s.close()
    return ok, first_err


def add_requests(files):
    return [{"method": "export_add", "params": {"image": str(p), "name": p.stem}} for p in files]


def sparse_files(d, prefix, n, size=GiB):
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = d / f"{prefix}{i}.img"
        with open(p, "wb") as f:
            f.truncate(size)
        out.append(p)
    return out


def filled_files(d, names, size=FILLED):
    d.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(16 * MiB)
    out = []
    for n in names:
        p = d / f"{n}.img"
        if not p.exists():
            with open(p, "wb") as f:
                for _ in range(size // len(chunk)):
                    f.write(chunk)
        out.append(p)
    return out


class Scale:
    def __init__(self, b):
        self.b = b
        self.dir = b.work_tmp / "scale"
        self.sock = str(b.sockdir / "scale-nbd.sock")
        self.ctl = str(b.sockdir / "scale-ctl.sock")
        self.io_threads = []
        helptext = sh([str(b.vdisk), "serve", "--help"], check=False).stdout
        if "--io-threads" in helptext:
            self.io_threads = ["--io-threads", "2"]

    # ---- servers

    def vdisk(self, label, files, pipelined=True):
        """vdisk serve --control with `files` added through the control socket; (server, add seconds, error)."""
        argv = [str(self.b.vdisk), "serve", "--control", self.ctl, "--socket", self.sock] + self.io_threads
        for p in (self.ctl,):
            if os.path.exists(p):
                os.unlink(p)
        srv = Server(label, argv, self.sock)
        srv.start(timeout=60)
        t0 = time.monotonic()
        ok, err = ctl_pipelined(self.ctl, add_requests(files)) if files else (0, None)
        secs = time.monotonic() - t0
        if ok != len(files):
            err = f"{ok} of {len(files)} added; first error: {err}"
        return srv, secs, err

    def qsd(self, label, files, iothread=False):
        argv = ["qemu-storage-daemon"]
        if iothread:
            argv += ["--object", "iothread,id=io0"]
        for i, p in enumerate(files):
            argv += ["--blockdev", f"driver=file,node-name=f{i},filename={p},aio=io_uring"]
        argv += ["--nbd-server", f"addr.type=unix,addr.path={self.sock}"]
        for i, p in enumerate(files):
            argv += ["--export", f"type=nbd,id=e{i},node-name=f{i},name={p.stem},writable=on"
                     + (",iothread=io0" if iothread else "")]
        srv = Server(label, argv, self.sock)
        srv.start(timeout=120)
        return srv

    # ---- fio

    def fio(self, name, jobs, runtime):
        """One fio run with several jobs (name -> (export, options)); per job: IOPS, p50, p99."""
        lines = ["[global]", "ioengine=nbd", "time_based", f"runtime={runtime}", "ramp_time=1", "norandommap",
                 "randrepeat=0", f"size={FILLED}"]
        for j, (export, opts) in jobs.items():
            lines += [f"[{j}]", f"uri=nbd+unix:///{export}?socket={self.sock}"] + [f"{k}={v}" for k, v in opts.items()]
        jobfile = RAW / f"{name}.fio"
        out = RAW / f"{name}.json"
        jobfile.write_text("\n".join(lines) + "\n")
        r = subprocess.run(["fio", "--output-format=json+", f"--output={out}", str(jobfile)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=runtime + 120, stdin=subprocess.DEVNULL)
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            raise RuntimeError(f"fio {name}: exit {r.returncode}: {r.stdout.strip()[-300:]}")
        res = {}
        for job in data["jobs"]:
            if job.get("error"):
                raise RuntimeError(f"fio {name} job {job['jobname']}: error {job['error']}")
            p50, p99 = percentiles_us(job)
            res[job["jobname"]] = {"iops": job["read"]["iops"] + job["write"]["iops"], "p50_us": p50, "p99_us": p99}
        return res


def timed(res, key, fn):
    try:
        res[key] = fn()
    except (StartError, RuntimeError, OSError, subprocess.SubprocessError, ValueError) as e:
        log(f"scale {key}: {e}")
        res[key] = {"error": f"failed: {e}"}


def row_idle(s, res):
    files = sparse_files(s.dir / "idle", "idle", max(IDLE_COUNTS))
    rows = {}
    for n in IDLE_COUNTS:
        for kind in ("vdisk", "qsd"):
            def one():
                if kind == "vdisk":
                    srv, secs, err = s.vdisk(f"scale vdisk idle {n}", files[:n])
                else:
                    srv, secs, err = s.qsd(f"scale qsd idle {n}", files[:n]), None, None
                try:
                    f = settle(srv.pid)
                finally:
                    srv.stop()
                if err:
                    f["error_note"] = err
                f["add_s"] = secs
                return f
            timed(rows, f"{n}|{kind}", one)
            r = rows[f"{n}|{kind}"]
            log(f"  idle {n:>5} {kind:<5} RSS {r.get('rss_mib') or 0:7.1f} MiB  Pss {r.get('pss_mib') or 0:7.1f} MiB  "
                f"threads {r.get('threads')}{'  ' + r.get('error', r.get('error_note', '')) if 'error' in r or 'error_note' in r else ''}")
    res["idle"] = rows


def row_add(s, res, count):
    d = s.dir / "add"
    files = sparse_files(d, "x", count)
    out = {"count": count}

    def pipelined():
        srv, secs, err = s.vdisk("scale vdisk add", files)
        try:
            f = settle(srv.pid)
            f["seconds"] = secs
            if err:
                f["error_note"] = err
        finally:
            srv.stop()
        return f
    timed(out, "pipelined", pipelined)
    log(f"  add {count} pipelined: {out['pipelined']}")

    def ctl_loop(n=100):
        srv, _, _ = s.vdisk("scale vdisk ctl add", [])
        try:
            t0 = time.monotonic()
            for p in files[:n]:
                sh([str(s.b.vdisk), "ctl", "--control", s.ctl, "add", str(p)], timeout=60)
            secs = time.monotonic() - t0
        finally:
            srv.stop()
        return {"n": n, "seconds": secs, "ms_per_add": 1000 * secs / n}
    timed(out, "ctl", ctl_loop)
    log(f"  `vdisk ctl add` x100: {out['ctl']}")
    shutil.rmtree(d, ignore_errors=True)
    res["add"] = out


BUSY_OPTS = {"rw": "randread", "bs": "4k", "iodepth": 32}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def row_busy(s, res, runtime, repeat):
    """Alone and beside alternate, `repeat` rounds, a fresh server each; medians."""
    busy = filled_files(s.dir / "busy", [f"b{i}" for i in range(BUSY)])
    idle = sorted((s.dir / "idle").glob("idle*.img"), key=lambda p: int(p.stem[4:]))[:BUSY_BESIDE - BUSY]
    jobs = {f"j{i}": (f"b{i}", BUSY_OPTS) for i in range(BUSY)}
    out = {}
    for kind in ("vdisk", "qsd"):
        runs = {"alone": [], "beside": []}
        for rnd in range(repeat):
            for case, files in (("alone", busy), ("beside", busy + idle)):
                def one():
                    srv = (s.vdisk(f"scale vdisk busy {case}", files)[0] if kind == "vdisk"
                           else s.qsd(f"scale qsd busy {case}", files))
                    try:
                        r = s.fio(f"scale-busy-{kind}-{case}.{rnd}", jobs, runtime)
                    finally:
                        srv.stop()
                    return {"iops": sum(j["iops"] for j in r.values()), "per_export": [j["iops"] for j in r.values()]}
                got = {}
                timed(got, "r", one)
                log(f"  busy {kind:<5} {case:<6} round {rnd + 1}: {got['r'].get('iops', 0):10.0f} IOPS "
                    f"{got['r'].get('error', '')}")
                if "error" in got["r"]:
                    out[f"{kind}|{case}"] = got["r"]
                else:
                    runs[case].append(got["r"]["iops"])
        for case, xs in runs.items():
            if xs and f"{kind}|{case}" not in out:
                out[f"{kind}|{case}"] = {"iops": median(xs), "runs": xs}
    res["busy"] = out


QUIET = {"rw": "randread", "bs": "4k", "iodepth": 1}
NOISY = {"rw": "randwrite", "bs": "4k", "iodepth": 128}


def row_fair(s, res, runtime, repeat):
    """One server per kind; alone and beside the writer alternate, `repeat` rounds; the round of
    median ratio is reported, every round's p99s kept."""
    files = filled_files(s.dir / "busy", ["quiet", "noisy"])
    out = {}
    for kind in ("vdisk", "qsd"):
        def one():
            srv = (s.vdisk("scale vdisk fair", files)[0] if kind == "vdisk"
                   else s.qsd("scale qsd fair", files, iothread=True))
            rounds = []
            try:
                for rnd in range(repeat):
                    alone = s.fio(f"scale-fair-{kind}-alone.{rnd}", {"quiet": ("quiet", QUIET)}, runtime)["quiet"]
                    both = s.fio(f"scale-fair-{kind}-both.{rnd}",
                                 {"quiet": ("quiet", QUIET), "noisy": ("noisy", NOISY)}, runtime)
                    rounds.append({"alone": alone, "with": both["quiet"], "noisy": both["noisy"]})
            finally:
                srv.stop()
            rounds.sort(key=lambda r: r["with"]["p99_us"] / r["alone"]["p99_us"])
            mid = dict(rounds[len(rounds) // 2])
            mid["rounds"] = [(r["alone"]["p99_us"], r["with"]["p99_us"]) for r in rounds]
            return mid
        timed(out, kind, one)
        r = out[kind]
        if "error" not in r:
            log(f"  fair {kind:<5} quiet p99 alone {r['alone']['p99_us']:.0f} µs, beside QD128 writes "
                f"{r['with']['p99_us']:.0f} µs ({r['with']['p99_us'] / r['alone']['p99_us']:.2f}×); "
                f"noisy {r['noisy']['iops']:.0f} IOPS")
    res["fair"] = out


def section_scale(b, res):
    b.sockdir.mkdir(parents=True, exist_ok=True)
    nofile = raise_nofile()
    if nofile < NOFILE:
        log(f"scale: the descriptor limit is {nofile} (its hard limit; raising it needs CAP_SYS_RESOURCE)")
    s = Scale(b)
    count = getattr(b.a, "scale_exports", 10000)
    res.update({"repeat": b.repeat, "runtime": b.runtime, "io_threads": " ".join(s.io_threads),
                "cpus": os.cpu_count(), "nofile": nofile,
                "qsd": sh(["qemu-storage-daemon", "--version"], check=False).stdout.splitlines()[0]
                if shutil.which("qemu-storage-daemon") else None})
    with open("/proc/loadavg") as f:
        res["loadavg_start"] = f.read().split()[:3]
    try:
        log("scale: idle exports (0, 200, 1000), vdisk and qemu-storage-daemon")
        row_idle(s, res)
        log(f"scale: {count} exports added through the control socket")
        row_add(s, res, count)
        log(f"scale: {BUSY} busy exports alone and beside {BUSY_BESIDE - BUSY} idle ones")
        row_busy(s, res, b.runtime, b.repeat)
        log("scale: fairness, 4K QD1 reads beside 4K QD128 writes")
        row_fair(s, res, b.runtime, b.repeat)
    finally:
        shutil.rmtree(s.dir, ignore_errors=True)
    with open("/proc/loadavg") as f:
        res["loadavg_end"] = f.read().split()[:3]
    return res
