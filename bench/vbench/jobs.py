"""Section "jobs": what a live block job costs the guest (issue 25), vdisk beside
qemu-storage-daemon (qsd) doing the same job. fio's nbd engine writes 4K random at QD32
for a fixed time (no ramp) while the server runs, START_DELAY after fio has connected,
either nothing or one of:

- mirror: a full copy of the live disk to a new raw file on tmpfs (vdisk: `export_mirror`
  on its control socket; qsd over QMP: the target `blockdev-add`ed, `blockdev-mirror
  sync=full`), without and with the job's own rate limit (vdisk `bps`, qsd `speed`);
- commit: an active commit of the qcow2 overlay into its raw base (vdisk: `export_commit`
  with `active`, which pivots to the base by itself once ready; qsd: `block-commit` of the
  top, then `block-job-complete` as soon as `query-block-jobs` says it is ready, so both end
  the same way), without and with the limit.

Images: a 1 GiB raw base filled with data, and for the commit rows a qcow2 overlay on it
(qemu-img, 64 KiB clusters) holding JOBS_OVERLAY_DATA written by qemu-io. Both servers get
fresh copies of the same two files for every row, on tmpfs, and serve them from the page
cache (vdisk `--engine uring`; qsd `aio=io_uring`, its fastest setting in the other rows).

A mirror that gets ready before fio ends is cancelled (its target complete, nothing
pivoted), the target removed and a new mirror started, so that a bulk copy runs for the
whole window: the table gives the first mirror's time to ready and the number started. A
commit cannot be redone (its data is in the base once it pivots): it runs once, and the
guest's IOPS "during the job" are taken over the job's own life from fio's IOPS log (100 ms
intervals), beside the whole window's figure. Job states are polled every 0.1 s, so job
times are good to about that. Every row's guest IOPS is also given over the row without a
job on the same kind of image (raw for the mirror, the qcow2 chain for the commit).
"""

import json
import os
import shutil
import socket
import subprocess
import threading
import time

from .common import GiB, MiB, PIN, RAW, fill_image, log, sh, slug
from .fio import FioError, fio_job_args, run_fio
from .servers import Server, StartError, wait_socket

JOBS_IMAGE = 1 * GiB
JOBS_OVERLAY_DATA = 512 * MiB
JOBS_LIMIT = 32 * MiB  # bytes/s for the limited rows: 1 GiB then takes 32 s, longer than a full run's window
JOBS_FIO = dict(rw="randwrite", bs="4k", iodepth=32)
EXPORT = "jobs"
POLL = 0.1
CANCEL_WAIT = 30  # seconds a job may take to end once cancelled at the end of the window
START_DELAY = 0.1  # after fio has connected to the server, before the job is started

# key, title, image ("raw" or "qcow2"), job ("mirror", "commit" or None), rate limit (0: none)
JOBS_ROWS = [
    ("alone-raw", "raw image, no job", "raw", None, 0),
    ("mirror", "during a mirror", "raw", "mirror", 0),
    ("mirror-limited", "during a mirror, limited", "raw", "mirror", JOBS_LIMIT),
    ("alone-qcow2", "qcow2 over raw, no job", "qcow2", None, 0),
    ("commit", "during an active commit", "qcow2", "commit", 0),
    ("commit-limited", "during an active commit, limited", "qcow2", "commit", JOBS_LIMIT),
]
JOBS_SERVERS = [("vdisk", "vdisk uring"), ("qsd", "qemu-storage-daemon")]


class JobError(Exception):
    pass


# --------------------------------------------------------------------------- control clients


class LineClient:
    """One JSON object per line over a unix socket, with a deadline on every read."""

    def __init__(self, path, timeout=60):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(str(path))
        self.f = self.s.makefile("rwb")

    def send(self, obj):
        self.f.write((json.dumps(obj) + "\n").encode())
        self.f.flush()

    def recv(self):
        line = self.f.readline()
        if not line:
            raise JobError("the server closed its control connection")
        return json.loads(line)

    def close(self):
        try:
            self.f.close()
        finally:
            self.s.close()


class VdiskCtl(LineClient):
    """vdisk's JSON-RPC control socket (docs/control.md): export_mirror, export_commit,
    job_list, job_cancel."""

    def __init__(self, path):
        super().__init__(path)
        self.n = 0

    def call(self, method, **params):
        self.n += 1
        self.send({"jsonrpc": "2.0", "id": self.n, "method": method, "params": params})
        r = self.recv()
        if "error" in r:
            raise JobError(f"{method}: {r['error'].get('message')}")
        return r["result"]

    def start(self, kind, target, limit):
        if kind == "mirror":
            r = self.call("export_mirror", name=EXPORT, to=str(target), bps=limit)
        else:
            r = self.call("export_commit", name=EXPORT, active=True, bps=limit)
        return r["job"]

    def status(self, job):
        """(state, bytes done): state is running, ready, done, failed or cancelled."""
        for j in self.call("job_list"):
            if j["id"] == job:
                if j["state"] == "failed":
                    raise JobError(f"job {job} failed: {j.get('error')}")
                return j["state"], j["done"]
        raise JobError(f"job {job} is not in job_list")

    def cancel(self, job):
        self.call("job_cancel", id=job)

    def finish(self, job):
        """A ready active commit pivots by itself: nothing to ask."""


class Qmp(LineClient):
    """qemu-storage-daemon's QMP monitor: capabilities negotiated, events kept aside."""

    def __init__(self, path):
        super().__init__(path)
        self.events = []
        self.n = 0
        if "QMP" not in self.recv():
            raise JobError("no QMP greeting")
        self.call("qmp_capabilities")

    def call(self, cmd, **args):
        self.n += 1
        self.send({"execute": cmd, "arguments": args, "id": self.n} if args else {"execute": cmd, "id": self.n})
        while True:
            r = self.recv()
            if "event" in r:
                self.events.append(r)
                continue
            if "error" in r:
                raise JobError(f"{cmd}: {r['error'].get('desc')}")
            return r.get("return")


class QsdJobs:
    """The same job interface as VdiskCtl, over QMP: a mirror's target is made as a sparse file,
    `blockdev-add`ed (file + raw nodes) and removed again with `blockdev-del` once its job ended."""

    def __init__(self, path, size):
        self.q = Qmp(path)
        self.size = size
        self.n = 0
        self.targets = {}  # job id -> (target path, its node names)
        self.last = {}  # job id -> bytes done last seen

    def start(self, kind, target, limit):
        self.n += 1
        speed = {"speed": limit} if limit else {}
        if kind == "mirror":
            job, fnode, node = f"m{self.n}", f"t{self.n}-file", f"t{self.n}"
            with open(target, "wb") as f:
                f.truncate(self.size)
            self.q.call("blockdev-add", driver="file", **{"node-name": fnode}, filename=str(target), aio="io_uring")
            self.q.call("blockdev-add", driver="raw", **{"node-name": node}, file=fnode)
            self.targets[job] = (target, [node, fnode])
            self.q.call("blockdev-mirror", **{"job-id": job}, device="fmt0", target=node, sync="full", **speed)
        else:
            job = f"c{self.n}"
            self.q.call("block-commit", **{"job-id": job}, device="fmt0", **speed)
        self.last[job] = 0
        return job

    def status(self, job):
        for j in self.q.call("query-block-jobs"):
            if j["device"] == job:
                self.last[job] = j["offset"]
                if j["status"] in ("aborting", "concluded") and j.get("error"):
                    raise JobError(f"job {job} failed: {j['error']}")
                return ("ready" if j.get("ready") and j["status"] == "ready" else "running"), j["offset"]
        for e in self.q.events:  # auto-dismissed: how it ended is in its last event
            d = e.get("data", {})
            if d.get("device") == job and e["event"] in ("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED"):
                if d.get("error"):
                    raise JobError(f"job {job} failed: {d['error']}")
                self.last[job] = d.get("offset", self.last[job])
                return ("done" if e["event"] == "BLOCK_JOB_COMPLETED" else "cancelled"), self.last[job]
        return "done", self.last[job]  # gone, and no event yet: it has ended

    def cancel(self, job):
        # A ready mirror cancelled completes without pivoting; force: at once, even if not ready.
        self.q.call("block-job-cancel", device=job, force=True)

    def finish(self, job):
        self.q.call("block-job-complete", device=job)

    def ended(self, job):
        """After its job ended: the mirror's target nodes deleted (the file is removed by the caller)."""
        _target, nodes = self.targets.pop(job, (None, []))
        for node in nodes:
            self.q.call("blockdev-del", **{"node-name": node})

    def close(self):
        self.q.close()


# --------------------------------------------------------------------------- one row


def connected(sock):
    """Whether a client is connected to the unix socket `sock` (an accepted socket is listed in
    /proc/net/unix with the listener's path, in state 03)."""
    try:
        with open("/proc/net/unix") as f:
            return any(len(x) >= 8 and x[7] == sock and x[5] == "03" for x in (ln.split() for ln in f))
    except OSError:
        return False


def iops_between(log_path, a_ms, b_ms):
    """Mean IOPS over [a_ms, b_ms] of fio's run (ms since its I/O began) from its averaged
    IOPS log: each line's value covers the interval since the line before it."""
    if b_ms <= a_ms:
        return None
    prev, ios = 0, 0.0
    try:
        lines = log_path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) < 2:
            continue
        t, v = int(f[0]), float(f[1])
        lo, hi = max(prev, a_ms), min(t, b_ms)
        if hi > lo:
            ios += v * (hi - lo) / 1000
        prev = t
    covered = min(prev, b_ms) - a_ms
    return ios / (covered / 1000) if covered > 0 else None


class Row:
    """One row: fresh image copies in `d`, a server started on them, fio for the window and the
    job driven beside it; the result dict."""

    def __init__(self, b, s, key, kind, image, job, limit):
        self.b, self.s, self.key, self.kind, self.image, self.job, self.limit = b, s, key, kind, image, job, limit
        self.d = s.dir / "row"
        self.sock = str(b.sockdir / "jobs-nbd.sock")
        self.ctl = str(b.sockdir / "jobs-ctl.sock")
        self.target = self.d / "target.img"

    def files(self):
        shutil.rmtree(self.d, ignore_errors=True)
        self.d.mkdir(parents=True)
        if self.image == "raw":
            shutil.copyfile(self.s.base, self.d / f"{EXPORT}.img")
            return self.d / f"{EXPORT}.img"
        shutil.copyfile(self.s.base, self.d / "base.img")  # the name the overlay's header gives
        shutil.copyfile(self.s.top, self.d / f"{EXPORT}.qcow2")
        return self.d / f"{EXPORT}.qcow2"

    def server(self, img):
        if os.path.exists(self.ctl):
            os.unlink(self.ctl)
        if self.kind == "vdisk":
            argv = PIN["server"] + [str(self.b.vdisk), "serve", str(img), "--socket", self.sock, "--control", self.ctl,
                                    "--engine", "uring"]
        else:
            argv = PIN["server"] + ["qemu-storage-daemon", "--chardev", f"socket,id=qmp0,path={self.ctl},server=on,wait=off",
                                    "--monitor", "chardev=qmp0"]
            if self.image == "raw":
                argv += ["--blockdev", f"driver=file,node-name=file0,filename={img},aio=io_uring",
                         "--blockdev", "driver=raw,node-name=fmt0,file=file0"]
            else:
                argv += ["--blockdev", f"driver=file,node-name=base-file,filename={self.d / 'base.img'},aio=io_uring",
                         "--blockdev", "driver=raw,node-name=base,file=base-file",
                         "--blockdev", f"driver=file,node-name=file0,filename={img},aio=io_uring",
                         "--blockdev", "driver=qcow2,node-name=fmt0,file=file0,backing=base"]
            argv += ["--nbd-server", f"addr.type=unix,addr.path={self.sock}",
                     "--export", f"type=nbd,id=exp0,node-name=fmt0,name={EXPORT},writable=on"]
        return Server(f"jobs {self.kind} {self.key}", argv, self.sock)

    def run(self):
        img = self.files()
        name = f"jobs-{self.key}-{self.kind}"
        iops_log = RAW / f"{name}_iops.1.log"
        for p in RAW.glob(f"{name}_iops*.log"):
            p.unlink()
        args = fio_job_args(JOBS_FIO, self.b.runtime, 0) + [
            "--ioengine=nbd", f"--uri=nbd+unix:///{EXPORT}?socket={self.sock}",
            f"--write_iops_log={RAW / name}", "--log_avg_msec=100"]
        srv = self.server(img)
        srv.start(timeout=60)
        ctl = th = None
        try:
            wait_socket(self.ctl, srv.proc, 30, srv.logpath)
            if self.job:
                ctl = VdiskCtl(self.ctl) if self.kind == "vdisk" else QsdJobs(self.ctl, JOBS_IMAGE)
            got = {}

            def fio():
                try:
                    got["r"] = run_fio(name, args, self.b.runtime + 90)
                except FioError as e:
                    got["e"] = e
            c0, t0 = srv.cpu_seconds(), time.monotonic()
            th = threading.Thread(target=fio, daemon=True)
            th.start()
            jobs = self.drive(ctl, th) if self.job else []
            th.join()
            c1, t1 = srv.cpu_seconds(), time.monotonic()
            if ctl:
                self.wind_down(ctl, jobs)
        finally:
            if ctl:
                ctl.close()
            srv.stop()
            if th:
                th.join(timeout=self.b.runtime + 100)  # fio fails soon once its server is gone
        if "e" in got:
            raise got["e"]
        r = got["r"]
        r["rss_mib"] = srv.rss_mib
        r["cpu_pct"] = 100 * (c1 - c0) / (t1 - t0) if c0 is not None and c1 is not None and t1 > t0 else None
        r["server_cmd"] = " ".join(srv.argv)
        r["limit"] = self.limit
        if self.job:
            self.summarise(r, jobs, name, iops_log)
        return r

    def drive(self, ctl, fio_thread):
        """Starts the job START_DELAY after fio has connected, polls it until fio ends, restarts a mirror that got
        ready; the job records (epoch start, epoch end or None, seconds to ready, bytes, state)."""
        deadline = time.monotonic() + 30
        while not connected(self.sock) and fio_thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(START_DELAY)
        jobs = []
        while fio_thread.is_alive():
            if not jobs or jobs[-1]["end"] is not None:
                if self.job == "commit" and jobs:
                    time.sleep(POLL)  # a commit is not redone: wait for fio
                    continue
                if self.job == "mirror" and os.path.exists(self.target):
                    os.unlink(self.target)
                jobs.append({"start": time.time(), "end": None, "ready_s": None, "bytes": 0, "state": "running"})
                jobs[-1]["id"] = ctl.start(self.job, self.target, self.limit)
            j = jobs[-1]
            state, done = ctl.status(j["id"])
            j["bytes"], j["state"] = done, state
            now = time.time()
            if state == "ready" and j["ready_s"] is None:
                j["ready_s"] = now - j["start"]
                if self.job == "mirror":
                    ctl.cancel(j["id"])
                    self.wait_end(ctl, j)
                else:
                    ctl.finish(j["id"])  # qsd: pivot now, as vdisk does by itself
            elif state in ("done", "cancelled"):
                j["end"] = now
            time.sleep(POLL)
        return jobs

    def wait_end(self, ctl, j, limit=60):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            state, done = ctl.status(j["id"])
            if state in ("done", "cancelled"):
                j["end"], j["state"] = time.time(), state
                j["bytes"] = max(j["bytes"], done)
                if isinstance(ctl, QsdJobs):
                    ctl.ended(j["id"])
                return
            time.sleep(POLL / 2)
        raise JobError(f"job {j['id']} did not end {limit} s after it was cancelled")

    def wind_down(self, ctl, jobs):
        """fio has ended: the bytes of a job still running are taken now, then it is cancelled."""
        if not jobs or jobs[-1]["end"] is not None:
            return
        j = jobs[-1]
        state, done = ctl.status(j["id"])
        j["bytes"], j["state"], j["window_end"] = done, state, time.time()
        if state in ("running", "ready"):
            t = time.monotonic()
            ctl.cancel(j["id"])
            try:
                self.wait_end(ctl, dict(j), CANCEL_WAIT)
                j["cancel_s"] = time.monotonic() - t
            except JobError as e:  # the row still stands; the server is stopped next (SIGKILL if need be)
                log(f"  jobs {self.key} {self.kind}: {e}")
                j["cancel_note"] = str(e)

    def summarise(self, r, jobs, name, iops_log):
        """Bytes and times of the jobs within fio's window, and the guest's IOPS while they ran."""
        data = json.loads((RAW / f"{name}.json").read_text())
        fj = data["jobs"][0]
        runtime_ms = fj["job_runtime"]
        fio_t0 = data["timestamp_ms"] / 1000 - runtime_ms / 1000  # epoch seconds fio's I/O began
        a = (jobs[0]["start"] - fio_t0) * 1000 if jobs else 0
        last = jobs[-1] if jobs else None
        b = runtime_ms if last is None or last["end"] is None else min(runtime_ms, (last["end"] - fio_t0) * 1000)
        r["iops_job"] = iops_between(iops_log, max(a, 0), b)
        r["job_window_s"] = max(0.0, (b - a) / 1000)
        r["jobs_started"] = len(jobs)
        r["cancel_s"] = last.get("cancel_s") if last else None  # the cancel at the window's end, if any
        r["cancel_note"] = last.get("cancel_note") if last else None
        # A mirror's figure is its time to ready (then it is restarted), a commit's its time to done
        # (pivoted: vdisk by itself, qsd on block-job-complete as soon as it was ready).
        first = jobs[0] if jobs else {}
        if self.job == "mirror":
            r["first_s"] = first.get("ready_s")
        else:
            r["first_s"] = first["end"] - first["start"] if first.get("end") and first["state"] == "done" else None
        r["copied_bytes"] = sum(j["bytes"] for j in jobs)
        r["job_rate"] = r["copied_bytes"] / r["job_window_s"] if r["job_window_s"] else None
        r["jobs"] = [{k: v for k, v in j.items() if k != "id"} for j in jobs]
        r["iops_log"] = str(iops_log.name)


# --------------------------------------------------------------------------- the section


class Setup:
    def __init__(self, b):
        self.b = b
        self.dir = b.work_tmp / "jobs"
        self.base = self.dir / "master" / "base.img"
        self.top = self.dir / "master" / f"{EXPORT}.qcow2"

    def make(self):
        """The master files every row copies: the filled raw base and the qcow2 overlay with data."""
        (self.dir / "master").mkdir(parents=True, exist_ok=True)
        fill_image(self.base, JOBS_IMAGE, False)
        # The overlay names its base relatively: every row's copy finds its own base.img beside it.
        sh(["qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.img", "-F", "raw", self.top.name],
           cwd=self.dir / "master")
        sh(["qemu-io", "-f", "qcow2", "-c", f"write -P 0xa5 0 {JOBS_OVERLAY_DATA}", str(self.top)], timeout=300)


def section_jobs(b, res):
    b.sockdir.mkdir(parents=True, exist_ok=True)
    s = Setup(b)
    res.update({"rows": {}, "runtime": b.runtime, "image_mib": JOBS_IMAGE // MiB,
                "overlay_mib": JOBS_OVERLAY_DATA // MiB, "limit": JOBS_LIMIT, "poll_s": POLL,
                "start_delay_s": START_DELAY,
                "qsd": sh(["qemu-storage-daemon", "--version"], check=False).stdout.splitlines()[0]
                if shutil.which("qemu-storage-daemon") else None})
    with open("/proc/loadavg") as f:
        res["loadavg_start"] = f.read().split()[:3]
    try:
        log(f"jobs: making a {JOBS_IMAGE // MiB} MiB raw base and a qcow2 overlay with "
            f"{JOBS_OVERLAY_DATA // MiB} MiB in {s.dir}")
        try:
            s.make()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # qemu-img or qemu-io missing or failing
            log(f"jobs: making the images: {e}")
            res["rows"] = {f"{key}|{kind}": {"error": f"failed: making the images: {e}"}
                           for key, *_ in JOBS_ROWS for kind, _ in JOBS_SERVERS}
            return res
        for key, title, image, job, limit in JOBS_ROWS:
            for kind, label in JOBS_SERVERS:
                rk = f"{key}|{kind}"
                try:
                    r = Row(b, s, key, kind, image, job, limit).run()
                except (StartError, JobError, FioError, OSError, RuntimeError, ValueError, KeyError,
                        subprocess.SubprocessError) as e:
                    log(f"  jobs {slug(key)} {kind}: {e}")
                    res["rows"][rk] = {"error": f"failed: {e}"}
                    continue
                res["rows"][rk] = r
                extra = ""
                if job:
                    first = f"{r['first_s']:.1f} s" if r.get("first_s") is not None else "not within the window"
                    extra = (f"; during the job {r['iops_job'] or 0:.0f} IOPS; {job} "
                             f"{'ready' if job == 'mirror' else 'done'}: {first}, {r['jobs_started']} started, "
                             f"{r['copied_bytes'] / MiB:.0f} MiB copied")
                log(f"  {label:<20} {title:<34} {r['iops']:>9.0f} IOPS  p99 {r['p99_us']:.0f} µs{extra}")
    finally:
        shutil.rmtree(s.dir, ignore_errors=True)
    with open("/proc/loadavg") as f:
        res["loadavg_end"] = f.read().split()[:3]
    return res
