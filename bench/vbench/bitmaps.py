"""Section "bitmaps": what enabled dirty bitmaps cost the guest's writes. 4K randwrite
QD32 on the tmpfs image, vdisk uring, with 0, 1 and 4 enabled bitmaps (64 KiB granules,
kept in the raw image's sidecar IMAGE.bitmaps: made beforehand with `vdisk ctl bitmap
add` on a short-lived server, so the measured server loads them at start), and each
row's IOPS over the row without (goal: >= 0.9x, issue 26). Row "backup": the same job
with no bitmap while a backup view of the export is open (`vdisk ctl backup begin`, begun
once the server is up, nothing reading the view): every first write to a 64 KiB granule
first copies its old data to the scratch file (copy-before-write; goal: >= 0.7x).
"""

import os
import subprocess
import time

from .common import IMAGE_SIZE, PIN, fill_image, log
from .fio import JOB, cell
from .servers import Server, StartError, wait_socket

BITMAP_COUNTS = [0, 1, 4]
BITMAP_JOB = "randwrite-4k-qd32"


def make_bitmaps(b, image, n):
    """Leaves exactly `n` enabled, clean bitmaps in `image`'s sidecar."""
    sidecar = f"{image}.bitmaps"
    if os.path.exists(sidecar):
        os.unlink(sidecar)
    if n == 0:
        return
    sock, ctl = b.sockdir / "bitmaps-nbd.sock", b.sockdir / "bitmaps-ctl.sock"
    logpath = b.sockdir / "bitmaps-setup.log"
    with open(logpath, "wb") as logf:
        proc = subprocess.Popen([str(b.vdisk), "serve", str(image), "--socket", str(sock), "--control", str(ctl)],
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_socket(str(ctl), proc, 30, logpath)
        name = os.path.splitext(os.path.basename(image))[0]
        for i in range(n):
            subprocess.run([str(b.vdisk), "ctl", "--control", str(ctl), "bitmap", "add", name, f"b{i}"],
                           check=True, stdout=subprocess.DEVNULL, timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if not os.path.exists(sidecar):
        raise StartError(f"no {sidecar} after adding {n} bitmaps")


class BackupServer(Server):
    """A vdisk server with a control socket whose export has a backup view open from
    its start: `vdisk ctl backup begin EXPORT --name backup-view`, scratch in `scratch`."""

    def __init__(self, b, label, argv, sock, ctl, export, scratch):
        super().__init__(label, argv, sock)
        self.vdisk, self.ctl, self.export, self.scratch = b.vdisk, ctl, export, scratch

    def start(self, timeout=20):
        try:
            os.unlink(self.ctl)
        except FileNotFoundError:
            pass
        super().start(timeout)
        try:
            wait_socket(str(self.ctl), self.proc, timeout, self.logpath)
            subprocess.run([str(self.vdisk), "ctl", "--control", str(self.ctl), "backup", "begin", self.export,
                            "--name", "backup-view", "--scratch", str(self.scratch)],
                           check=True, stdout=subprocess.DEVNULL, timeout=30)
        except BaseException:
            self.stop()
            raise
        return self


def backup_server(b, image):
    """`make_server` for fio.cell: the usual vdisk server plus --control and a backup begun."""
    ctl = b.sockdir / "backup-ctl.sock"
    scratch = os.path.dirname(os.path.abspath(image))

    def make(label, kind, medium, extra):
        argv = PIN["server"] + b.server_argv(kind, medium, extra) + ["--control", str(ctl)]
        return BackupServer(b, f"{label} {medium}", argv, b.sock(kind, medium, extra), ctl, medium, scratch)
    return make


def section_bitmaps(b, res):
    res["rows"] = {}
    image = b.images["tmpfs"]
    log(f"bitmaps on tmpfs: filling {image}")
    fill_image(image, IMAGE_SIZE, False)
    _, _, opts, metric = JOB[BITMAP_JOB]
    try:
        for n in BITMAP_COUNTS:
            label = f"vdisk uring, {n} enabled bitmap{'s' if n != 1 else ''}"
            try:
                make_bitmaps(b, image, n)
            except (StartError, subprocess.SubprocessError, OSError) as e:
                res["rows"][str(n)] = {"error": f"failed: {e}"}
                continue
            time.sleep(0.2)
            res["rows"][str(n)] = cell(b, f"bitmaps-{n}", label, "vdisk", "tmpfs", ("--engine", "uring"), opts,
                                       metric)
        make_bitmaps(b, image, 0)
        time.sleep(0.2)
        res["rows"]["backup"] = cell(b, "bitmaps-backup", "vdisk uring, during a backup", "vdisk", "tmpfs",
                                     ("--engine", "uring"), opts, metric, make_server=backup_server(b, image))
    finally:
        make_bitmaps(b, image, 0)
    return res
