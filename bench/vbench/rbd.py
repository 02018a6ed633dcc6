"""Section "rbd": an image on a throwaway single-node Ceph cluster (scripts/cephrig:
one monitor, one memstore OSD, so the OSD keeps data in RAM) and, side by side in one
run, vdisk serving it over NBD (fio's nbd engine, as in the matrix) and fio's own rbd
engine on the same image (librbd in fio's process: the no-server limit). qemu-nbd with
qemu's rbd driver needs qemu-block-extra matching the installed QEMU: where the system's
QEMU has no block-rbd.so (Debian 12 with a backported QEMU 10), bench/qemu72.sh unpacks
Debian 12's qemu-utils and qemu-block-extra 7.2 into bench/out/qemu72 and that qemu-nbd
runs with QEMU_MODULE_DIR set to its module directory; if that fails too, its rows say so. Jobs: 4K randread/randwrite QD32, 1M seq
read/write QD8. The image (1 GiB) is filled once with 1M writes before the first job.
"""

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .common import GiB, MiB, PIN, ROOT, done_cleanup, log, on_cleanup, slug
from .fio import JOB, FioError, fio_job_args, run_fio
from .servers import Server, StartError

RBD_JOBS = ["randread-4k-qd32", "randwrite-4k-qd32", "read-1m-qd8", "write-1m-qd8"]
RBD_TARGETS = ["vdisk", "qemu-nbd rbd", "fio rbd"]
RIG = ROOT / "scripts" / "cephrig" / "ceph-micro.sh"
IMAGE = "bench"
IMAGE_BYTES = 1 * GiB
QEMU72 = ROOT / "bench" / "qemu72.sh"
SYSTEM_MODULE_DIRS = ("/usr/lib/x86_64-linux-gnu/qemu", "/usr/lib/qemu")


def qemu_nbd_rbd():
    """The qemu-nbd that has an rbd driver and the environment it needs: the system's if its
    QEMU has block-rbd.so, else QEMU 7.2's unpacked by bench/qemu72.sh (run once, cached in
    bench/out/qemu72). Raises StartError saying why when there is none."""
    if any((Path(d) / "block-rbd.so").exists() for d in SYSTEM_MODULE_DIRS):
        return "qemu-nbd", {}
    r = subprocess.run(["bash", str(QEMU72)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    lines = r.stdout.split()
    if r.returncode != 0 or len(lines) != 2:
        raise StartError("this qemu-nbd has no rbd block driver and bench/qemu72.sh could not unpack QEMU 7.2's: "
                         + (r.stderr.strip().splitlines() or ["no output"])[-1])
    return lines[0], {"QEMU_MODULE_DIR": lines[1]}


class Cluster:
    """The cluster for this section: started in a temporary directory, stopped (and the
    directory removed) from the cleanup stack too."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="vdisk-bench-ceph-"))
        self.conf = str(self.dir / "ceph.conf")
        self.env = {**os.environ, "CEPH_CONF": self.conf, "CEPH_PORT": str(20000 + os.getpid() % 20000),
                    "CEPH_MEM_BYTES": str(2 * GiB)}
        self._cleanup = None

    def start(self):
        self._cleanup = on_cleanup(f"stop the Ceph cluster in {self.dir}", self.stop)
        r = subprocess.run(["bash", str(RIG), "start", str(self.dir)], env=self.env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        if r.returncode != 0:
            raise StartError(f"the Ceph rig did not start: {r.stdout.strip().splitlines()[-1:]}")
        os.environ["CEPH_CONF"] = self.conf  # fio's rbd engine (librados) finds the cluster through it

    def stop(self):
        subprocess.run(["bash", str(RIG), "stop", str(self.dir)], env=self.env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._cleanup:
            done_cleanup(self._cleanup)
            self._cleanup = None

    def rbd(self, *args):
        subprocess.run(["rbd", *args], env=self.env, check=True, stdout=subprocess.DEVNULL, timeout=300)


def rbd_engine_args(cl):
    return ["--ioengine=rbd", "--clientname=admin", "--pool=rbd", f"--rbdname={IMAGE}"]


def one(b, cl, target, jid):
    _, _title, opts, metric = JOB[jid]
    name = f"rbd-{jid}-{slug(target)}"
    args = fio_job_args(opts, b.runtime, b.ramp)
    timeout = b.runtime + b.ramp + 120
    if target == "fio rbd":
        r = run_fio(name, args + rbd_engine_args(cl), timeout)
        r["rss_mib"] = None
        return r
    sock = str(b.sockdir / f"rbd-{slug(target)}.sock")
    env = {"CEPH_CONF": cl.conf}
    if target == "vdisk":
        argv = [str(b.vdisk), "serve", f"rbd:rbd/{IMAGE}", "--socket", sock, "--ceph-conf", cl.conf]
    else:
        exe, more = qemu_nbd_rbd()
        env.update(more)
        argv = [exe, "-t", "-f", "raw", "--cache=writeback", "-k", sock, "-x", IMAGE, "--shared=8",
                f"rbd:rbd/{IMAGE}:conf={cl.conf}"]
    srv = Server(f"{target}", PIN["server"] + argv, sock, env=env)
    srv.start(timeout=40)
    try:
        c0, t0 = srv.cpu_seconds(), time.monotonic()
        r = run_fio(name, args + ["--ioengine=nbd", f"--uri=nbd+unix:///{IMAGE}?socket={sock}"], timeout)
        c1, t1 = srv.cpu_seconds(), time.monotonic()
    finally:
        srv.stop()
    r["rss_mib"] = srv.rss_mib
    r["cpu_pct"] = 100 * (c1 - c0) / (t1 - t0) if c0 is not None and c1 is not None else None
    r["server_cmd"] = "".join(f"{k}={v} " for k, v in env.items() if k != "CEPH_CONF") + shlex.join(argv)
    if target != "vdisk":
        ver = subprocess.run([argv[0], "--version"], stdout=subprocess.PIPE, text=True, timeout=30).stdout
        r["server_version"] = "qemu-nbd " + ver.splitlines()[0].split(" ", 1)[-1]
    return r


def section_rbd(b, res):
    res.update({"cells": {}, "jobs": RBD_JOBS, "targets": RBD_TARGETS})
    if not shutil.which("ceph-mon") or not RIG.exists():
        res["error"] = "Ceph is not installed (scripts/cephrig/ceph-micro.sh install)"
        log(f"rbd: {res['error']}")
        return res
    b.sockdir.mkdir(parents=True, exist_ok=True)
    cl = Cluster()
    try:
        log(f"rbd: starting a micro cluster in {cl.dir}")
        try:
            cl.start()
            cl.rbd("create", "--size", str(IMAGE_BYTES // MiB), f"rbd/{IMAGE}")
            log("rbd: filling the image with fio's rbd engine (1M writes)")
            run_fio("rbd-fill", ["--rw=write", "--bs=1m", "--iodepth=8", f"--size={IMAGE_BYTES}"]
                    + rbd_engine_args(cl), 600)
        except (StartError, FioError, subprocess.SubprocessError) as e:
            res["error"] = f"the cluster or its image could not be set up: {e}"
            log(f"rbd: {res['error']}")
            return res
        with open("/proc/loadavg") as f:
            res["loadavg_start"] = f.read().split()[:3]
        failed = {}
        for jid in RBD_JOBS:
            metric = JOB[jid][3]
            for target in RBD_TARGETS:
                key = f"{jid}|{target}"
                if target in failed:
                    res["cells"][key] = {"error": f"failed: {failed[target]}"}
                    continue
                try:
                    r = one(b, cl, target, jid)
                except (StartError, FioError) as e:
                    log(f"  {target} {jid}: {e}")
                    if isinstance(e, StartError):
                        failed[target] = str(e)
                    res["cells"][key] = {"error": f"failed: {e}"}
                    continue
                r["metric"] = metric
                res["cells"][key] = r
                v = r[metric]
                log(f"  {target:<14} {jid:<20} {v:>10.0f} {'IOPS' if metric == 'iops' else 'MiB/s'}  "
                    f"p50 {r['p50_us']:.0f} µs  p99 {r['p99_us']:.0f} µs")
        with open("/proc/loadavg") as f:
            res["loadavg_end"] = f.read().split()[:3]
    finally:
        cl.stop()
    return res
