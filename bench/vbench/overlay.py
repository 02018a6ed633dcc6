"""Section "overlay": copy-on-write overlays over a 2 GiB base image filled with data, on
tmpfs, so that the transport and the overlay logic dominate. For each server and job a
fresh overlay: vdisk (uring, threads) serving a UML COW v3 overlay (`vdisk create
--backing`) and a qcow2 overlay (`vdisk create --format qcow2 --backing`), qemu-nbd a qcow2 overlay (`qemu-img create -b BASE -F raw`), nbdkit its cow
filter over the file plugin (overlay in a temporary file under TMPDIR). Jobs: 4K
randread/randwrite QD32, 1M seq read/write QD8, through fio's nbd engine as in the matrix.
Reads of a fresh overlay all go to the base. Every overlay is removed after its job.
"""

import os
import shlex
import shutil
from pathlib import Path

from .common import IMAGE_SIZE, MiB, PIN, done_cleanup, fill_image, log, on_cleanup, sh, slug
from .fio import JOB, cell
from .servers import Server, StartError

OVERLAY_JOBS = ["randread-4k-qd32", "randwrite-4k-qd32", "read-1m-qd8", "write-1m-qd8"]
OVERLAY_TARGETS = [  # label, kind, extra args
    ("vdisk uring", "vdisk", ("--engine", "uring")),
    ("vdisk threads", "vdisk", ("--engine", "threads")),
    ("vdisk qcow2 uring", "vdisk", ("--engine", "uring")),
    ("vdisk qcow2 threads", "vdisk", ("--engine", "threads")),
    ("qemu-nbd", "qemu-nbd", ()),
    ("nbdkit", "nbdkit", ()),
]
EXPORT = "overlay"  # the export name (= the "medium" cell() puts in fio's URI): vdisk's is the file stem


class OverlayServer(Server):
    """A server on a fresh overlay over `base`: the overlay is made just before the server
    starts and removed once it has stopped (also on failure and from the cleanup stack).
    Records in `extra` how the overlay was made and how much of it was allocated at the
    end of the job (read just before SIGTERM)."""

    def __init__(self, b, label, kind, extra, base, workdir):
        self.b, self.kind, self.base, self.workdir = b, kind, Path(base), Path(workdir)
        sock = b.sock(kind, "overlay", extra)
        env = None
        if kind == "vdisk" and "qcow2" in label:
            # The same kind of overlay qemu-nbd serves: qcow2, 64 KiB clusters, over the raw base.
            self.path = self.workdir / f"{EXPORT}.qcow2"
            self.create = [str(b.vdisk), "create", "-q", "--format", "qcow2", "--backing", str(self.base),
                           str(self.path)]
            argv = [str(b.vdisk), "serve", str(self.path), "--socket", sock] + list(extra)
        elif kind == "vdisk":
            self.path = self.workdir / f"{EXPORT}.cow"
            self.create = [str(b.vdisk), "create", "-q", "--backing", str(self.base), str(self.path)]
            argv = [str(b.vdisk), "serve", str(self.path), "--socket", sock] + list(extra)
        elif kind == "qemu-nbd":
            self.path = self.workdir / f"{EXPORT}.qcow2"
            self.create = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(self.base), "-F", "raw",
                           str(self.path)]
            argv = ["qemu-nbd", "-t", "-f", "qcow2", "--aio=io_uring", "--cache=writeback", "-k", sock,
                    "-x", EXPORT, "--shared=8", str(self.path)]
        elif kind == "nbdkit":
            # The cow filter keeps its overlay in an unlinked temporary file in $TMPDIR
            # (default /var/tmp): point it at tmpfs, a directory of its own per job.
            self.path = self.workdir / "nbdkit-tmpdir"
            self.create = None
            env = {"TMPDIR": str(self.path)}
            argv = ["nbdkit", "-f", "--exit-with-parent", "-U", sock, "--exportname", EXPORT, "--filter=cow",
                    "file", str(self.base)]
        else:
            raise ValueError(kind)
        super().__init__(f"{label} overlay", PIN["server"] + argv, sock, env=env)
        self._ovl_cleanup = None

    def make_overlay(self):
        self.remove_overlay()
        self._ovl_cleanup = on_cleanup(f"rm {self.path}", self.remove_overlay)
        if self.create is None:
            self.path.mkdir(parents=True)
            self.extra["overlay_cmd"] = f"TMPDIR={shlex.quote(str(self.path))} (cow filter's temporary file)"
            return
        if not shutil.which(self.create[0]):
            raise StartError(f"{self.create[0]} not installed")
        try:
            sh(self.create, timeout=60)
        except RuntimeError as e:
            raise StartError(f"creating the overlay: {e}")
        self.extra["overlay_cmd"] = shlex.join(self.create)

    def remove_overlay(self):
        if self.path.is_dir():
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._ovl_cleanup:
            done_cleanup(self._ovl_cleanup)
            self._ovl_cleanup = None

    def overlay_bytes(self):
        """Bytes allocated to the overlay now: the file's blocks, or for nbdkit its
        (already unlinked) temporary file, found among the server's open files."""
        try:
            if self.create is not None:
                return os.stat(self.path).st_blocks * 512
            fd_dir = Path(f"/proc/{self.pid}/fd")
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd).startswith(str(self.path) + "/"):
                        return os.stat(fd).st_blocks * 512
                except OSError:
                    continue
        except (OSError, TypeError):
            pass
        return None

    def start(self, timeout=20):
        try:
            self.make_overlay()
            return super().start(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        try:
            if self.proc is not None and self.pid:
                n = self.overlay_bytes()
                self.extra["overlay_mib"] = None if n is None else n / MiB
            super().stop()
        finally:
            self.remove_overlay()


def section_overlay(b, res):
    base = b.work_tmp / "base.img"
    workdir = b.work_tmp / "overlays"
    res.update({"cells": {}, "jobs": OVERLAY_JOBS, "base": str(base)})
    log(f"overlays on tmpfs: filling the base {base}")
    entry = on_cleanup(f"rm {base}", lambda: base.unlink(missing_ok=True))
    try:
        fill_image(base, IMAGE_SIZE, False)
        workdir.mkdir(parents=True, exist_ok=True)

        def make_server(label, kind, _medium, extra):
            return OverlayServer(b, label, kind, extra, base, workdir)

        for jid in OVERLAY_JOBS:
            _, _title, opts, metric = JOB[jid]
            for label, kind, extra in OVERLAY_TARGETS:
                r = cell(b, f"overlay-{jid}-{slug(label)}", label, kind, EXPORT, extra, opts, metric,
                         make_server=make_server)
                r["metric"] = metric
                res["cells"][f"{jid}|{label}"] = r
        left = sorted(p.name for p in workdir.iterdir())
        if left:
            log(f"overlays left behind (removing): {', '.join(left)}")
        res["left_behind"] = left
        shutil.rmtree(workdir, ignore_errors=True)
    finally:
        base.unlink(missing_ok=True)
        done_cleanup(entry)
    return res
