"""Section "vm": a guest's view. The team's VM rig (scripts/vmrig) boots a QEMU guest
(TCG: no usable KVM here) whose only disk is a vhost-user-blk device, and times its
workload from inside the guest: O_DIRECT 1 MiB writes and reads of a --mb pattern,
mkfs.ext4, writing 16 x 1 MiB + FILES small files, and verifying them after a remount.
Servers, each over a fresh sparse 512 MiB raw image on disk (--disk-dir):
vdisk (`serve IMG --vhost-user-blk SOCK --num-queues N`, page cache), vdisk --direct
(O_DIRECT, like the peer) and qemu-storage-daemon (the rig's --qsd mode:
cache.direct=on, aio=threads). Once with one queue and one vCPU, once with two of each;
three boots of each (round-robin), medians reported.

Then one more boot per server and queue count, for counting: a guest of the bench's own
(the rig's kernel and QEMU, an initramfs with the host's fio in it) runs COUNT_JOBS with
fio on /dev/vda while the server runs under `strace -f -ttt -y -xx` from its start. Each
job's window (the guest prints markers; the host notes when they appear on the serial
log) gives system calls by name, kicks (reads of the eventfds the front end passed with
VHOST_USER_SET_VRING_KICK) and calls (writes to the eventfds of
VHOST_USER_SET_VRING_CALL), over the requests the guest's block layer completed in the
job (/sys/block/vda/stat: reads + writes + discards + flushes). strace slows every system
call, so throughput in that boot means nothing; the counts per request are what it is for.
"""

import os
import re
import statistics
import shutil
import subprocess
import time
from pathlib import Path

from .common import LOGS, RAW, ROOT, done_cleanup, log, on_cleanup, pdeathsig, sh
from .servers import Server, StartError, children_of

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
    counts = r["counts"] = {}
    try:
        rigdir = count_rig(work)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        rigdir = None
        log(f"vm counts: no counting guest ({e})")
        for q in VM_QUEUES:
            for label, _, _ in VM_TARGETS:
                counts[f"{q}|{label}"] = {"error": f"counting guest: {str(e)[:150]}"}
    if rigdir:
        for q in VM_QUEUES:
            for label, kind, extra in VM_TARGETS:
                image.unlink(missing_ok=True)
                sh([str(b.vdisk), "create", "-q", str(image), "--size", VM_IMAGE])
                log(f"vm counts: {label}, {q} queue(s)")
                counts[f"{q}|{label}"] = count_boot(b, rigdir, image, label, kind, extra, q)
                log(f"vm counts: {label}, {q} queue(s): {counts[f'{q}|{label}']}")
    image.unlink(missing_ok=True)
    done_cleanup(c_work)
    shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- counting boots

# Guest fio jobs of the counting boot: (id, title, fio options). Writes first, so that the
# reads after them read data, not holes; all within the first 64 MiB of the disk.
COUNT_JOBS = [
    ("randwrite-4k-qd32", "4K randwrite QD32", "--rw=randwrite --bs=4k --iodepth=32 --ioengine=libaio"),
    ("randread-4k-qd1", "4K randread QD1", "--rw=randread --bs=4k --iodepth=1 --ioengine=psync"),
    ("randread-4k-qd32", "4K randread QD32", "--rw=randread --bs=4k --iodepth=32 --ioengine=libaio"),
    ("read-1m-qd8", "1M read QD8", "--rw=read --bs=1M --iodepth=8 --ioengine=libaio"),
]
COUNT_SECONDS = 4
COUNT_MEM = "768M"  # the guest's RAM holds the initramfs with fio and its libraries (~85 MiB)

COUNT_INIT = r"""#!/bin/sh
# vdisk bench: the counting guest. fio jobs on /dev/vda between markers the host watches for.
export PATH=/bin:/sbin:/usr/sbin:/usr/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
mkdir -p /tmp
echo "VMRIG: init start"
for m in $(cat /etc/modules); do [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko 2>/dev/null; done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
RC=0
reqs() { awk '{print $1 + $5 + $12 + $16}' /sys/block/vda/stat; }
if [ ! -b /dev/vda ]; then echo "VMRIG: FAIL no /dev/vda"; RC=1; else
%JOBS%
fi
echo "VMRIG-RESULT: rc=$RC"
sync; poweroff -f; sleep 2; echo o > /proc/sysrq-trigger; sleep 5
"""

COUNT_JOB = r"""echo "VMCOUNT: start %ID%"; sleep 1; a=$(reqs)
out=$(fio --name=%ID% --filename=/dev/vda --direct=1 --thread --size=64M --time_based --runtime=%SECS% \
      --norandommap --randrepeat=0 --minimal %OPTS% 2>&1) || { echo "VMRIG: FAIL fio %ID%: $out"; RC=1; }
b=$(reqs); sleep 1
echo "VMCOUNT: end %ID% requests=$((b - a)) minimal=$(echo "$out" | tail -n 1)"
"""


def count_rig(work):
    """A rig directory of the bench's own: the rig's env.sh, with an initramfs whose init runs
    COUNT_JOBS (the rig's busybox and modules, plus the host's fio and its libraries)."""
    src = Path(os.environ.get("VMRIG_DIR", "/tmp/vmrig"))
    env = (src / "env.sh").read_text()
    fio = shutil.which("fio")
    if not fio:
        raise RuntimeError("fio not installed")
    rigdir = work / "countrig"
    ird = rigdir / "initramfs"
    shutil.copytree(src / "initramfs", ird, symlinks=True)
    libs = [fio]
    for line in sh(["ldd", fio]).stdout.splitlines():
        m = re.search(r"(/\S+)", line.split("=>")[-1])
        if m:
            libs.append(m.group(1))
    for f in libs:
        dst = ird / f.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(f), dst)
    jobs = "".join(COUNT_JOB.replace("%ID%", jid).replace("%OPTS%", opts).replace("%SECS%", str(COUNT_SECONDS))
                   for jid, _, opts in COUNT_JOBS)
    (ird / "init").write_text(COUNT_INIT.replace("%JOBS%", jobs))
    (ird / "init").chmod(0o755)
    initrd = rigdir / "initramfs.cpio.gz"
    sh(["sh", "-c", f"cd {ird} && find . | ./bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 > {initrd}"],
       timeout=300)
    env = re.sub(r"^VMRIG_INITRD=.*$", f"VMRIG_INITRD={initrd}", env, flags=re.M)
    (rigdir / "env.sh").write_text(env)
    shutil.rmtree(ird)
    return rigdir


def qsd_argv(image, sock, queues):
    """qemu-storage-daemon as the rig's --qsd mode starts it (started here, to run under strace)."""
    qsd = shutil.which("qemu-storage-daemon") or "qemu-storage-daemon"
    return [qsd, "--blockdev", f"driver=file,node-name=f0,filename={image},cache.direct=on,aio=threads",
            "--blockdev", "driver=raw,node-name=d0,file=f0",
            "--export", f"type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={sock},writable=on,"
                        f"num-queues={queues}"]


def count_boot(b, rigdir, image, label, kind, extra, queues):
    """One counting boot: the server under strace, the counting guest on it; per job its counts."""
    sock = str(b.sockdir / f"vubc-{queues}-{len(extra)}-{kind}.sock")
    trace = RAW / f"vm-count-{queues}-{len(extra)}-{kind}.strace"
    argv = (qsd_argv(image, sock, queues) if kind == "qsd" else
            [str(b.vdisk), "serve", str(image), "--vhost-user-blk", sock, "--num-queues", str(queues)] + list(extra))
    pre = ["strace", "-f", "-qq", "-ttt", "-y", "-xx", "-s", "16", "-o", str(trace), "--"]
    if not shutil.which("strace"):
        return {"error": "strace not installed"}
    srv = Server(f"{label} vm count q{queues}", pre + argv, sock)
    try:
        srv.start(timeout=60)
    except StartError as e:
        return {"error": str(e)}
    kids = children_of(srv.proc.pid)
    if kids:
        srv.pid = kids[0]  # the server itself, for its RSS
    serial = RAW / f"vm-count-{queues}-{len(extra)}-{kind}.serial"
    serial.unlink(missing_ok=True)
    marks = {}
    try:
        argv = ["bash", str(RIG / "vm-vhost-user-blk.sh"), "--timeout", "600", "--smp", str(queues),
                "--num-queues", str(queues), "--mem", COUNT_MEM, "--log", str(serial), sock]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "VMRIG_DIR": str(rigdir)}, preexec_fn=pdeathsig)
        seen = 0
        while p.poll() is None:
            time.sleep(0.05)
            seen = watch_marks(serial, seen, marks)
        out = p.stdout.read()
        watch_marks(serial, seen, marks)
        (LOGS / f"vm-count-{queues}-{len(extra)}-{kind}.log").write_text(out)
        if p.returncode != 0:
            tail = [ln for ln in out.splitlines() if "FAIL" in ln or ln.startswith("HOST:")]
            return {"error": f"guest rc {p.returncode}: {' / '.join(tail)[:200]}"}
    finally:
        srv.stop()
    try:
        return count_trace(trace, marks)
    except (OSError, ValueError) as e:
        return {"error": f"strace output: {e}"}


def watch_marks(serial, seen, marks):
    """Notes the host time each VMCOUNT line first appears on the serial log; returns bytes read."""
    try:
        with open(serial, "rb") as f:
            f.seek(seen)
            data = f.read()
    except FileNotFoundError:
        return seen
    end = data.rfind(b"\n") + 1
    now = time.time()
    for line in data[:end].decode(errors="replace").splitlines():
        m = re.match(r"VMCOUNT: (start|end) (\S+)(.*)", line.strip())
        if m:
            marks[(m.group(1), m.group(2))] = (now, m.group(3))
    return seen + end


TRACE_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\((.*))")
VU_KICK, VU_CALL = 12, 13  # VHOST_USER_SET_VRING_KICK / _CALL


def count_trace(trace, marks):
    """Per COUNT_JOBS job: requests, system calls by name, kicks and calls, within its window."""
    jobs = {}
    for jid, _, _ in COUNT_JOBS:
        s, e = marks.get(("start", jid)), marks.get(("end", jid))
        if not s or not e:
            continue
        m = re.search(r"requests=(\d+)", e[1])
        f = re.search(r"minimal=(\S+)", e[1])
        iops = None
        if f and f.group(1).count(";") > 50:
            t = f.group(1).split(";")
            iops = float(t[7]) + float(t[48])
        jobs[jid] = {"t0": s[0], "t1": e[0], "requests": int(m.group(1)) if m else 0, "guest_iops": iops,
                     "calls": {}, "kicks": 0, "signals": 0}
    if not jobs:
        raise ValueError("no job markers seen on the serial log")
    role = {}  # fd -> "kick" / "call", from the vhost-user messages that carried it
    with open(trace, errors="replace") as fh:
        for line in fh:
            m = TRACE_LINE.match(line)
            if not m or m.group(3):
                continue  # a resumed call was counted where it started
            t, name, rest = float(m.group(2)), m.group(4), m.group(5)
            if name == "recvmsg" and "SCM_RIGHTS" in rest:
                code = re.search(r'iov_base="((?:\\x[0-9a-f]{2}){4})', rest)
                fds = re.search(r"cmsg_data=\[(\d+)", rest)
                if code and fds:
                    c = int.from_bytes(bytes(int(x, 16) for x in code.group(1).split("\\x")[1:]), "little")
                    if c in (VU_KICK, VU_CALL):
                        role[int(fds.group(1))] = "kick" if c == VU_KICK else "call"
                continue
            fd = re.match(r"(\d+)<", rest)
            fd = int(fd.group(1)) if fd else None
            if name == "close" and fd is not None:
                role.pop(fd, None)
            for j in jobs.values():
                if j["t0"] <= t <= j["t1"]:
                    j["calls"][name] = j["calls"].get(name, 0) + 1
                    ok = re.search(r"\)\s+=\s+8\b", rest)
                    if fd is not None and ok and role.get(fd) == "kick" and name in ("read", "readv", "pread64"):
                        j["kicks"] += 1
                    if fd is not None and ok and role.get(fd) == "call" and name in ("write", "writev", "pwrite64"):
                        j["signals"] += 1
    out = {}
    for jid, j in jobs.items():
        req = j["requests"]
        total = sum(j["calls"].values())
        out[jid] = {"requests": req, "guest_iops": j["guest_iops"], "syscalls": total, "kicks": j["kicks"],
                    "call_writes": j["signals"], "by_name": j["calls"],
                    "syscalls_per_req": total / req if req else None,
                    "kicks_per_req": j["kicks"] / req if req else None,
                    "calls_per_req": j["signals"] / req if req else None}
    return out


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
    if res.get("counts"):
        out += md_vm_counts(res["counts"])
    return out


def md_vm_counts(counts):
    out = ["#### Notifications and system calls per request (vhost-user-blk)\n",
           "| guest job | queues | server | requests | syscalls / request | kicks / request | calls / request | "
           "syscalls / request by name |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    errors = [f"{k.split('|')[1]}, {k.split('|')[0]} queue(s): {c['error']}" for k, c in counts.items() if "error" in c]
    for jid, title, _ in COUNT_JOBS:
        for q in VM_QUEUES:
            for label, _, _ in VM_TARGETS:
                c = counts.get(f"{q}|{label}", {"error": "not run"})
                if "error" in c:
                    continue
                j = c.get(jid)
                if not j or not j["requests"]:
                    out.append(f"| {title} | {q} | {label} | — | | | | |")
                    continue
                top = sorted(j["by_name"].items(), key=lambda kv: -kv[1])[:5]
                names = ", ".join(f"{n} {v / j['requests']:.2f}" for n, v in top)
                out.append(f"| {title} | {q} | {label} | {j['requests']:,} | {j['syscalls_per_req']:.2f} | "
                           f"{j['kicks_per_req']:.2f} | {j['calls_per_req']:.2f} | {names} |")
    out.append("")
    out.append(
        f"One more boot per server and queue count: a guest of the bench's own (the rig's kernel, the host's fio "
        f"in its initramfs) runs each job for {COUNT_SECONDS} s on /dev/vda (O_DIRECT, first 64 MiB) while the "
        "server runs under `strace -f -ttt -y -xx` from its start. Requests: what the guest's block layer "
        "completed in the job (`/sys/block/vda/stat`). Kicks: successful 8-byte reads of an eventfd the front end "
        "passed with VHOST_USER_SET_VRING_KICK; calls: writes to one passed with VHOST_USER_SET_VRING_CALL "
        "(so the guest's interrupts). System calls within the job's window (1 s before and after it included), "
        "every thread. strace makes each call slow, so the guest's throughput in that boot is not comparable."
        + (" " + "; ".join(errors) if errors else "") + "\n")
    return out
