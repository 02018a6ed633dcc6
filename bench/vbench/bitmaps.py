"""Section "bitmaps": what enabled dirty bitmaps cost the guest's writes. 4K randwrite
QD32 on the tmpfs image, vdisk uring, with 0, 1 and 4 enabled bitmaps (64 KiB granules,
kept in the raw image's sidecar IMAGE.bitmaps: made beforehand with `vdisk ctl bitmap
add` on a short-lived server, so the measured server loads them at start), and each
row's IOPS over the row without (goal: >= 0.9x, issue 26).
"""

import os
import subprocess
import time

from .common import IMAGE_SIZE, fill_image, log
from .fio import JOB, cell
from .servers import StartError, wait_socket

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
    finally:
        make_bitmaps(b, image, 0)
    return res
