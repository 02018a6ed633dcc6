"""The NBD servers under test: starting vdisk, qemu-nbd and nbdkit on a unix socket
(optionally under `perf stat`), waiting for them to listen, their CPU time and peak
RSS (VmHWM), stopping them (SIGTERM, SIGKILL after 10 s) with a cleanup entry so none
outlives the run; `Bench` (the run's settings and each server's command line) and the
private copy of the vdisk binary that is measured.
"""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .common import (HAVE, LOGS, OUT, PIN, ROOT, done_cleanup, drop_file_cache, last_line, log, on_cleanup,
                     pdeathsig, sh, slug)


class StartError(Exception):
    pass


def wait_socket(path, proc, timeout, logpath, log_from=0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(logpath, "rb") as f:
                f.seek(log_from)
                said = f.read().decode(errors="replace")
            raise StartError(f"exited with {proc.returncode}: {last_line(said)}")
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)
    raise StartError(f"not listening on its socket after {timeout:.0f} s")


def children_of(pid):
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def pid_alive(pid):
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        return st.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    """One NBD server process on a unix socket. `perf_out`: run it under `perf stat`
    counting every system call of every thread into that file. `env`: variables added
    to its environment. `extra`: what a subclass measured, merged into the row."""

    def __init__(self, label, argv, sock, perf_out=None, env=None):
        self.label, self.argv, self.sock, self.perf_out, self.env = label, argv, sock, perf_out, env
        self.proc = None
        self.pid = None
        self.rss_mib = None
        self.extra = {}
        self.logpath = LOGS / f"{slug(label)}.log"

    def start(self, timeout=20):
        for p in (self.sock,) + ((self.perf_out,) if self.perf_out else ()):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        argv = list(self.argv)
        if self.perf_out:
            pre = ["perf", "stat", "-e", "raw_syscalls:sys_enter", "-x", ",", "-o", str(self.perf_out), "--"]
            if HAVE["setpriv"]:
                pre += ["setpriv", "--pdeathsig", "TERM"]
            argv = pre + argv
        prog = self.argv[3] if self.argv[0] == "taskset" else self.argv[0]
        for exe in {argv[0], prog}:
            if not shutil.which(exe):
                raise StartError(f"{exe} not installed")
        self.logf = open(self.logpath, "ab")
        envs = "".join(f"{k}={shlex.quote(v)} " for k, v in (self.env or {}).items())
        self.logf.write(f"\n### {time.strftime('%F %T')} {envs}{shlex.join(argv)}\n".encode())
        self.logf.flush()
        log_from = self.logf.tell()
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=pdeathsig,
                                     env={**os.environ, **self.env} if self.env else None)
        self._cleanup = on_cleanup(f"stop {self.label}", self.stop)
        try:
            wait_socket(self.sock, self.proc, timeout, self.logpath, log_from)
            self.pid = self.proc.pid
            if self.perf_out:
                kids = children_of(self.proc.pid)
                if not kids:
                    raise StartError("server under perf not found")
                self.pid = kids[0]
        except BaseException:
            self.stop()
            raise
        return self

    def cpu_seconds(self):
        """utime + stime of every thread of the server so far."""
        try:
            f = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, TypeError, IndexError, ValueError):
            return None

    def peak_rss_mib(self):
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except (OSError, TypeError):
            pass
        return None

    def stop(self):
        if self.proc is None:
            return
        if self.pid and self.rss_mib is None:
            self.rss_mib = self.peak_rss_mib()
        targets = [p for p in {self.pid, self.proc.pid} if p]
        if self.perf_out and self.pid == self.proc.pid:
            targets += children_of(self.proc.pid)
        # SIGTERM the server itself (under perf: perf exits once its child has).
        victim = self.pid if self.pid else self.proc.pid
        try:
            os.kill(victim, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log(f"{self.label}: no exit 10 s after SIGTERM; SIGKILL")
            for p in targets:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=10)
        for p in targets:  # a server under perf may outlive perf for a moment
            for _ in range(100):
                if not pid_alive(p):
                    break
                time.sleep(0.05)
            else:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass
        self.logf.close()
        self.proc = None
        done_cleanup(self._cleanup)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# --------------------------------------------------------------------------- the run


class Bench:
    """The run's settings, its working directories and images, and how each server is started."""

    def __init__(self, args):
        self.a = args
        self.quick = args.quick
        self.runtime = args.runtime or (2 if args.quick else 10)
        self.ramp = 1
        self.repeat = max(1, args.repeat)
        # Seconds each peer configuration is tried for on each fio row (0: no tuning).
        self.tune_seconds = args.tune_seconds if args.tune_seconds is not None else (1 if args.quick else 2)
        self.work_tmp = Path(args.tmpfs_dir) / f"vdisk-bench-{os.getpid()}"
        self.work_disk = Path(args.disk_dir) / f"vdisk-bench-{os.getpid()}"
        self.images = {"tmpfs": self.work_tmp / "tmpfs.img", "disk": self.work_disk / "disk.img"}
        self.sockdir = self.work_tmp / "sock"
        self.vdisk = None
        self.syscall_method = None
        self.failed_start = {}  # (label, medium, extra) -> reason: don't retry a server that cannot start

    def server_argv(self, kind, medium, extra=()):
        img, name, sock = str(self.images[medium]), medium, self.sock(kind, medium, extra)
        if kind == "vdisk":
            # On disk vdisk bypasses the page cache like qemu-nbd --cache=none and fio --direct=1;
            # tmpfs has no O_DIRECT (vdisk refuses --direct there).
            direct = ["--direct"] if medium == "disk" else []
            return [str(self.vdisk), "serve", img, "--socket", sock] + list(extra) + direct
        # A peer's `extra` is its tuning (fio.PEER_CONFIGS); without one it runs as it always did here.
        if kind == "qemu-nbd":
            cache = "none" if medium == "disk" else "writeback"  # tmpfs has no O_DIRECT
            tuning = list(extra) or ["--aio=io_uring", "--shared=8"]
            return ["qemu-nbd", "-t", "-f", "raw", f"--cache={cache}", "-k", sock, "-x", name] + tuning + [img]
        if kind == "nbdkit":
            return ["nbdkit", "-f", "--exit-with-parent", "-U", sock, "--exportname", name] + list(extra) + ["file", img]
        raise ValueError(kind)

    def sock(self, kind, medium, extra=()):
        return str(self.sockdir / f"{slug(kind + '-' + '-'.join(extra))[:40]}-{medium}.sock")

    def uri(self, medium, sock):
        return f"nbd+unix:///{medium}?socket={sock}"

    def server(self, label, kind, medium, extra=(), perf_out=None):
        argv = PIN["server"] + self.server_argv(kind, medium, extra)
        return Server(f"{label} {medium}", argv, self.sock(kind, medium, extra), perf_out)

    def prep(self, medium):
        if medium == "disk":
            drop_file_cache(self.images["disk"])


def build_vdisk(b, args):
    src = ROOT / "target" / "release" / "vdisk"
    note = ""
    if not args.no_build:
        log("cargo build --release")
        r = subprocess.run(["cargo", "build", "--release", "-q"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            note = f" (cargo build failed: {last_line(r.stdout)}; used the existing binary)"
            log(f"cargo build failed; using {src} as it is")
    if args.vdisk:
        src = Path(args.vdisk)
    if not src.exists():
        raise SystemExit(f"no vdisk binary at {src}: cargo build --release first")
    # A private copy: others rebuilding target/ mid-run must not change what is measured.
    b.vdisk = OUT / "vdisk"
    shutil.copy2(src, b.vdisk)
    ver = sh([str(b.vdisk), "--version"], check=False).stdout.strip()
    rev = sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=False).stdout.strip()
    dirty = sh(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], check=False).stdout.strip()
    return f"{ver}, commit {rev}{' + uncommitted changes' if dirty else ''}, `{src.relative_to(ROOT) if src.is_relative_to(ROOT) else src}`{note}"
