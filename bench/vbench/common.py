"""Shared ground for every section: where things go (bench/out/, docs/), logging and
shell helpers, the cleanup stack that signals and failures unwind, the parent-death
signal for children, CPU pinning prefixes (--pin), and the 2 GiB images (fill, evict).
"""

import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "bench" / "out"
RAW = OUT / "raw"
LOGS = OUT / "logs"
DEFAULT_MD = ROOT / "docs" / "benchmarks.md"
DEFAULT_PNG = ROOT / "docs" / "benchmarks.png"

GiB = 1 << 30
MiB = 1 << 20
IMAGE_SIZE = 2 * GiB
SECTIONS = ["fio", "ablations", "bitmaps", "loop", "overlay", "vm", "rbd", "scale", "jobs"]

PIN = {"fio": [], "server": []}  # taskset prefixes (--pin); filled in by run.py
HAVE = {"setpriv": False}  # filled in by run.py

# --------------------------------------------------------------------------- cleanup

_cleanups = []  # stack of [desc, fn]; run newest first


def on_cleanup(desc, fn):
    entry = [desc, fn]
    _cleanups.append(entry)
    return entry


def done_cleanup(entry):
    if entry in _cleanups:
        _cleanups.remove(entry)


def run_cleanups():
    while _cleanups:
        desc, fn = _cleanups.pop()
        try:
            fn()
        except Exception as e:  # keep cleaning
            log(f"cleanup {desc}: {e}")


class Interrupted(Exception):
    pass


def on_signal(signum, _frame):
    raise Interrupted(f"signal {signum}")


_libc = ctypes.CDLL(None, use_errno=True)


def pdeathsig():
    # The child gets SIGTERM if this script dies, however it dies.
    _libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


# --------------------------------------------------------------------------- helpers


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(cmd, timeout=120, check=True, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd) if isinstance(cmd, list) else cmd}: "
                           f"exit {r.returncode}: {last_line(r.stdout)}")
    return r


def last_line(text):
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def slug(s):
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


# --------------------------------------------------------------------------- images


def fill_image(path, size, disk):
    """Write data over the whole image so that reads are never of holes."""
    chunk = os.urandom(16 * MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            n = min(left, len(chunk))
            os.write(fd, chunk[:n])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    if disk:
        drop_file_cache(path)


def drop_file_cache(path):
    """Write back and evict one file's page cache (the disk image's, between jobs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
