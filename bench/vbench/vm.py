"""Section "vm": a guest's view. The team's VM rig (scripts/vmrig) boots a QEMU guest
(TCG: no usable KVM here) whose only disk is a vhost-user-blk device, and times its
workload from inside the guest: O_DIRECT 1 MiB writes and reads of a --mb pattern,
mkfs.ext4, writing 16 x 1 MiB + FILES small files, and verifying them after a remount.
Servers, each over a fresh sparse 512 MiB raw image on disk (--disk-dir):
vdisk (`serve IMG --vhost-user-blk SOCK --num-queues N`, page cache), vdisk --direct
(O_DIRECT, like the peer) and qemu-storage-daemon (the rig's --qsd mode:
cache.direct=on, aio=threads). Once with one queue and one vCPU, once with two of each;
three boots of each (round-robin), medians reported.
"""

import re
import statistics
import shutil
import subprocess
import time
from pathlib import Path

from .common import LOGS, ROOT, done_cleanup, log, on_cleanup, sh
from .servers import Server, StartError

RIG = ROOT / "scripts" / "vmrig"
VM_MB = 128
VM_FILES = 100
VM_IMAGE = "512M"
VM_RUNS = 3  # boots per server and queue count (--repeat N overrides); the table shows medians
VM_TARGETS = [  # label, kind, extra vdisk args
    ("vdisk", "vdisk", ()),
    ("vdisk --direct", "vdisk", ("--direct",)),
    ("qemu-storage-daemon", "qsd", ()),
]
VM_QUEUES = [1, 2]
# (key in the guest's VMRIG lines, title); all are seconds (lower is better)
VM_STEPS = [("raw_write", f"O_DIRECT write {VM_MB} MiB"), ("raw_read", f"O_DIRECT read {VM_MB} MiB"),
            ("mkfs", "mkfs.ext4"), ("fs_write", f"write {16 + VM_FILES} files + sync"),
            ("fs_verify", "remount + md5 of every file"), ("workload", "whole workload (host clock)")]


def parse_rig(text):
    """Seconds per step from the rig's output ("VMRIG: raw_write mb=.. s=0.12 ..", "HOST: .. workload_s=..")."""
    out = {}
    for key, _ in VM_STEPS[:-1]:
        m = re.search(rf"^VMRIG: {key}\b.*?\bs=([0-9.]+)", text, re.M)
        if m:
            out[key] = float(m.group(1))
    m = re.search(r"^HOST: .*workload_s=([0-9.]+)", text, re.M)
    if m:
        out["workload"] = float(m.group(1))
    m = re.search(r"^HOST: .*boot_s=([0-9.]+)", text, re.M)
    if m:
        out["boot"] = float(m.group(1))
    return out


def boot(target, queues):
    """Runs the rig against `target` (a socket, or ["--qsd", IMAGE]); returns (cell, output)."""
    argv = ["bash", str(RIG / "vm-vhost-user-blk.sh"), "--timeout", "600", "--mb", str(VM_MB), "--files",
            str(VM_FILES), "--smp", str(queues), "--num-queues", str(queues)] + target
    p = subprocess.run(argv, capture_output=True, text=True, timeout=700)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        tail = [line for line in text.splitlines() if "FAIL" in line or line.startswith("HOST:")]
        return {"error": f"guest rc {p.returncode}: {' / '.join(tail)[:200]}"}, text
    return parse_rig(text), text


def section_vm(b, r):
    cells = r["cells"] = {}
    try:
        sh(["bash", str(RIG / "vm-setup.sh")], timeout=900)
    except RuntimeError as e:
        for q in VM_QUEUES:
            for label, _, _ in VM_TARGETS:
                cells[f"{q}|{label}"] = {"error": f"rig setup failed: {str(e)[:150]}"}
        return
    work = Path(b.a.disk_dir) / f"vdisk-bench-vm-{time.time_ns()}"
    work.mkdir(parents=True)
    c_work = on_cleanup(f"rm -r {work}", lambda: shutil.rmtree(work, ignore_errors=True))
    image = work / "vm.img"
    runs = b.repeat if b.repeat > 1 else VM_RUNS
    samples = {}
    # Round-robin over the servers, so load from elsewhere spreads over all of them.
    for rep in range(runs):
        for q in VM_QUEUES:
            for label, kind, extra in VM_TARGETS:
                key = f"{q}|{label}"
                image.unlink(missing_ok=True)
                sh([str(b.vdisk), "create", "-q", str(image), "--size", VM_IMAGE])
                log(f"vm: {label}, {q} queue(s), run {rep + 1}/{runs}")
                text = ""
                if kind == "qsd":
                    cell, text = boot(["--qsd", str(image)], q)
                else:
                    sock = str(b.sockdir / f"vub-{q}-{len(extra)}.sock")
                    argv = [str(b.vdisk), "serve", str(image), "--vhost-user-blk", sock, "--num-queues", str(q)]
                    srv = Server(f"{label} vm q{q}", argv + list(extra), sock)
                    try:
                        srv.start()
                    except StartError as e:
                        cell = {"error": str(e)}
                    else:
                        try:
                            cell, text = boot([sock], q)
                            cell["rss_mib"] = srv.peak_rss_mib()
                        finally:
                            srv.stop()
                (LOGS / f"vm-{q}-{len(extra)}-{kind}-{rep}.log").write_text(text)
                log(f"vm: {label}, {q} queue(s): {cell}")
                samples.setdefault(key, []).append(cell)
    for key, cs in samples.items():
        bad = [c for c in cs if "error" in c]
        if bad:
            cells[key] = bad[0]
            continue
        cells[key] = {m: statistics.median(c[m] for c in cs) for m in cs[0] if all(m in c for c in cs)}
        cells[key]["runs"] = len(cs)
    image.unlink(missing_ok=True)
    done_cleanup(c_work)
    shutil.rmtree(work, ignore_errors=True)


def md_vm(res, meta):
    runs = max((c.get("runs", 1) for c in res["cells"].values()), default=1)
    out = [f"### 5. A QEMU guest on vhost-user-blk (TCG), {VM_MB} MiB raw phase, guest-side seconds "
           f"(median of {runs} boots)\n"]
    cells = res["cells"]
    out.append("| step | queues | " + " | ".join(lab for lab, _, _ in VM_TARGETS) + " | vdisk vs qsd | "
               "vdisk --direct vs qsd |")
    out.append("| --- | ---: |" + " ---: |" * (len(VM_TARGETS) + 2))
    for key, title in VM_STEPS:
        for q in VM_QUEUES:
            vals = [cells.get(f"{q}|{lab}", {"error": "not run"}) for lab, _, _ in VM_TARGETS]
            shown = [("failed" if "error" in c else f"{c[key]:.2f}" if key in c else "") for c in vals]
            qsd = vals[-1].get(key)

            def ratio(c):
                v = c.get(key)
                return f"{qsd / v:.2f}×" if v and qsd else ""
            out.append(f"| {title} | {q} | " + " | ".join(shown) + f" | {ratio(vals[0])} | {ratio(vals[1])} |")
    out.append("")
    errors = [f"{k}: {c['error']}" for k, c in cells.items() if "error" in c]
    out.append(
        "Times are measured inside the guest (`/proc/uptime` around each step) except the last row (host "
        "clock from the rig). vs qsd = qemu-storage-daemon's time / this time: > 1 means vdisk is faster. "
        "The guest runs under TCG, so its own CPU work (dd, md5sum, ext4) weighs heavily and the numbers are "
        "small; they compare the two backends on the same rig, image and guest, not absolute speed. "
        "qemu-storage-daemon: `--blockdev driver=file,cache.direct=on,aio=threads` + raw, "
        "`--export type=vhost-user-blk,num-queues=N`. " + " ".join(errors) + "\n")
    return out
