"""The report: docs/benchmarks.md (header with machine and command, one table per
section: fio matrix, loop device, ablations, overlays; peak RSS per server) and
docs/benchmarks.png (the tmpfs fio matrix normalised to the best peer), both from the
results dict alone so --render-only can redo them.
"""

import os
import platform
import re
import shlex
import sys
from pathlib import Path

from .ablations import ABL_JOBS, ABLATIONS
from .common import IMAGE_SIZE, MiB, last_line, log, sh
from .fio import JOB, JOBS, MATRIX_TARGETS, PEERS, peer_config_name
from .jobs import JOBS_ROWS, JOBS_SERVERS
from .loopdev import LOOP_PEERS, LOOP_TARGETS, RAW_FILE
from .overlay import OVERLAY_JOBS, OVERLAY_TARGETS
from .rbd import RBD_JOBS, RBD_TARGETS
from .vm import md_vm


def machine_info():
    mem = "?"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    u = platform.uname()

    def ver(cmd):
        try:
            return last_line(sh(cmd, check=False, timeout=10).stdout.splitlines()[0] if cmd else "")
        except Exception:  # noqa: BLE001
            return "?"
    return {
        "nproc": os.cpu_count(), "memory": mem, "kernel": f"{u.system} {u.release} ({u.version})",
        "uname_r": u.release, "cpu": cpu, "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "tools": {
            "fio": ver(["fio", "--version"]),
            "qemu-nbd": ver(["qemu-nbd", "--version"]),
            "nbdkit": ver(["nbdkit", "--version"]),
            "libnbd (nbdfuse)": ver(["nbdfuse", "--version"]),
            "dbench": "dbench " + (sh(["dpkg-query", "-W", "-f=${Version}", "dbench"], check=False).stdout.strip() or "?"),
        },
    }


def cell_err(c):
    """An error for a table cell: one line, no pipes, not too long."""
    e = str(c.get("error", "?")).replace("|", "/").replace("\n", " ")
    return e if len(e) <= 120 else e[:117] + "…"


def fmt_num(v):
    if v is None:
        return "—"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_mib(v):
    return "—" if v is None else f"{v:.1f}"


def fmt_pct(v):
    return "—" if v is None else f"{v:.0f}"


def fmt_ratio(v):
    return "—" if v is None else f"{v:.2f}×"


def measured(c, metric):
    """The measured columns of a fio row: value with unit, p50, p99, server CPU, CPU per request, peak RSS."""
    unit = "IOPS" if metric == "iops" else "MiB/s"
    star = "§" if c.get("serialized") else ""
    return (f"{fmt_num(c[metric])} {unit}{star} | {fmt_num(c['p50_us'])} | {fmt_num(c['p99_us'])} | "
            f"{fmt_pct(c.get('cpu_pct'))} | {fmt_num(c.get('cpu_us_per_req'))} | {fmt_mib(c.get('rss_mib'))}")


def best_peer(values):
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def ratio(a, b):
    return a / b if a is not None and b else None


def val(cell, metric):
    return None if (cell is None or "error" in cell) else cell.get(metric)


DISK_MODE = {
    "vdisk uring": "O_DIRECT (--direct)", "vdisk threads": "O_DIRECT (--direct)", "qemu-nbd": "O_DIRECT (--cache=none)",
    "nbdkit": "page cache‡", "direct": "O_DIRECT (--direct=1)",
}
TMPFS_MODE = {
    "vdisk uring": "page cache", "vdisk threads": "page cache", "qemu-nbd": "--cache=writeback",
    "nbdkit": "page cache", "direct": "--direct=0",
}


def vdisk_paged(medium, label, c):
    """A vdisk row on disk measured before the matrix ran vdisk with --direct (older results)."""
    cmd = c.get("server_cmd")
    return medium == "disk" and label.startswith("vdisk") and bool(cmd) and "--direct" not in shlex.split(cmd)


def vdisk_direct(results):
    """Whether any vdisk row of the disk matrix ran with --direct."""
    cells = results.get("fio", {}).get("cells", {})
    return any(k.startswith("disk|") and "--direct" in shlex.split(c.get("server_cmd", ""))
               for k, c in cells.items())


def md_fio(res, meta):
    out = []
    cells = res["cells"]
    for medium in res["media"]:
        title = "tmpfs (/dev/shm)" if medium == "tmpfs" else "disk (ext4 on virtio, /var/tmp)"
        out.append(f"### 1{'a' if medium == 'tmpfs' else 'b'}. fio over NBD — {title}\n")
        mode = TMPFS_MODE if medium == "tmpfs" else DISK_MODE
        paged = False  # a vdisk row through the page cache (results from before --direct)
        out.append("| job | server | I/O mode | IOPS / MiB/s | p50 µs | p99 µs | server CPU % | CPU µs / request | "
                   "peak RSS MiB | vs best peer | vs direct |")
        out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        serialized = False
        for jid, title_j, _opts, metric in JOBS:
            get = lambda lab: val(cells.get(f"{medium}|{jid}|{lab}"), metric)  # noqa: E731
            peer = best_peer([get(p) for p in PEERS])
            direct = get("direct")
            for label, _k, _e in MATRIX_TARGETS:
                c = cells.get(f"{medium}|{jid}|{label}", {"error": "not run"})
                m = "page cache†" if vdisk_paged(medium, label, c) else mode[label]
                if c.get("config"):
                    m += f"; `{c['config']}`"
                paged = paged or "page cache†" in m
                if "error" in c:
                    out.append(f"| {title_j} | {label} | {m} | {cell_err(c)} | | | | | | | |")
                    continue
                v = c[metric]
                serialized = serialized or bool(c.get("serialized"))
                r = ratio(v, peer)
                behind = " **behind**" if label.startswith("vdisk") and r is not None and r < 1 else ""
                out.append(f"| {title_j} | {label} | {m} | {measured(c, metric)} | {fmt_ratio(r)}{behind} | "
                           f"{fmt_ratio(ratio(v, direct)) if label != 'direct' else '1.00×'} |")
        out.append("")
        out.append("Each peer row ran in the configuration that was fastest on that row: every configuration in "
                   "`bench/vbench/fio.py` `PEER_CONFIGS` was tried first for a short run and the winner named in "
                   "the I/O mode column. CPU µs / request: the server's user+system time from the end of fio's "
                   "ramp to its exit, divided by the requests fio completed in that time.")
        out += md_tuning(cells, medium) + md_goals(cells, medium)
        if serialized:
            out.append("§ The server took fio's connections one at a time (qemu-nbd's default `--shared=1`), so "
                       "the jobs ran one after another; the figure is the I/O over the real wall time, not "
                       "fio's group figure (which counts every job's I/O against one job's runtime).")
        out.append("")
        if medium == "disk" and paged:  # results from before vdisk had --direct
            out.append("† vdisk has no O_DIRECT mode yet: on disk it serves through the host page cache, "
                       "so its numbers are not like-for-like with qemu-nbd's O_DIRECT ones (its writes land in "
                       "the page cache; its reads warm it during the job). "
                       "‡ nbdkit 1.32's file plugin has no O_DIRECT mode either (`cache=none` evicts pages with "
                       "fadvise, it does not bypass the cache), so it runs with its default. "
                       "The image is fsynced and its page cache dropped (`POSIX_FADV_DONTNEED`) before every job.\n")
        elif medium == "disk":
            out.append("vdisk runs with `--direct` (O_DIRECT for aligned requests, and every request here is "
                       "4K-aligned), like qemu-nbd `--cache=none` and direct fio `--direct=1`. "
                       "‡ nbdkit 1.32's file plugin has no O_DIRECT mode (`cache=none` evicts pages with "
                       "fadvise, it does not bypass the cache), so it runs with its default and serves through "
                       "the host page cache: its numbers are not like-for-like with the O_DIRECT rows (its writes "
                       "land in the page cache; its reads warm it during the job). "
                       "The image is fsynced and its page cache dropped (`POSIX_FADV_DONTNEED`) before every job.\n")
        else:
            out.append("tmpfs has no O_DIRECT: every server and direct fio go through the (shmem) page cache. "
                       "Server CPU % is the server's user+system time over the job's wall time (100 = one core; "
                       "fio has the rest of the 2). QD1 is bimodal on this 2-vCPU VM: a request handed to a thread "
                       "on the other vCPU costs a wake-up IPI (~50 µs), on the same vCPU ~7 µs, so QD1 rows move "
                       "by up to 7× with where the scheduler happens to put fio and the server; `--pin same|split` "
                       "fixes the placement.\n")
    return out


def md_tuning(cells, medium):
    """What every peer configuration did on each row in its short trial."""
    out = []
    for jid, title_j, _opts, metric in JOBS:
        tried = [(p, cells.get(f"{medium}|{jid}|{p}", {}).get("tuning")) for p in PEERS]
        parts = [f"{p}: " + ", ".join(f"`{cfg}` {fmt_num(v)}" for cfg, v in t.items()) for p, t in tried if t]
        if parts:
            out.append(f"- {title_j} ({'IOPS' if metric == 'iops' else 'MiB/s'}, short trials): " + "; ".join(parts))
    return (["", "Peer configurations tried:", ""] + out + [""]) if out else []


def md_goals(cells, medium):
    """The faster vdisk engine against the fastest peer on each row: throughput and CPU per request."""
    out = []
    for jid, title_j, _opts, metric in JOBS:
        def pick(labels):
            cs = [cells.get(f"{medium}|{jid}|{x}") for x in labels]
            cs = [c for c in cs if c and "error" not in c]
            return max(cs, key=lambda c: c[metric], default=None)
        v, peer = pick([t[0] for t in MATRIX_TARGETS if t[0].startswith("vdisk")]), pick(PEERS)
        if not v or not peer:
            continue
        cpu = ratio(v.get("cpu_us_per_req"), peer.get("cpu_us_per_req"))
        p50 = ratio(v.get("p50_us"), peer.get("p50_us"))
        out.append(f"| {title_j} | {fmt_ratio(ratio(v[metric], peer[metric]))} | {fmt_ratio(p50)} | {fmt_ratio(cpu)} |")
    if not out:
        return []
    head = ["", "Faster vdisk engine against the fastest peer, per row:", "",
            "| job | throughput | p50 latency | CPU µs / request |", "| --- | ---: | ---: | ---: |"]
    return head + out + [""]


def md_ablations(res, meta):
    out = ["### 3. Ablations (vdisk knobs, tmpfs image)\n"]
    rows = res["rows"]
    peer = {j: best_peer([val(rows.get(p, {}).get(j), "iops") for p in PEERS]) for j in ABL_JOBS}
    out.append("| config | randread 4K QD32 IOPS | p50 µs | p99 µs | CPU % | vs best peer | randwrite 4K QD32 IOPS | "
               "p50 µs | p99 µs | CPU % | vs best peer | syscalls / request | peak RSS MiB |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, _k, _e in ABLATIONS:
        row = rows.get(label)
        if row is None:
            continue
        cols = [label]
        rss = []
        for j in ABL_JOBS:
            c = row[j]
            if "error" in c:
                cols += [cell_err(c), "", "", "", ""]
                continue
            cols += [fmt_num(c["iops"]), fmt_num(c["p50_us"]), fmt_num(c["p99_us"]), fmt_pct(c.get("cpu_pct")),
                     fmt_ratio(ratio(c["iops"], peer[j]))]
            if c.get("rss_mib"):
                rss.append(c["rss_mib"])
        s = row["syscalls"]
        cols.append(cell_err(s) if "error" in s else f"{s['per_request']:.2f}")
        cols.append(fmt_mib(max(rss)) if rss else "—")
        out.append("| " + " | ".join(cols) + " |")
    methods = {r["syscalls"].get("method") for r in rows.values() if "method" in r["syscalls"]}
    how = ("`perf stat -e raw_syscalls:sys_enter` around the server (every thread, from start to stop)"
           if methods == {"perf"} else "`strace -c -f -p PID` attached to the server")
    out.append("")
    out.append(f"Syscalls / request: the 4K randread QD32 job run for {meta.get('syscall_seconds', 3)} s "
               f"(no ramp) with {how}; total system calls divided by the requests fio completed. "
               "Handshake and start-up calls are included (a few hundred, under 0.01 per request).\n")
    return out


def md_bitmaps(res, _meta):
    out = ["### 3b. Dirty bitmaps (tmpfs image, vdisk uring)\n",
           "| enabled bitmaps | randwrite 4K QD32 IOPS | p50 µs | p99 µs | CPU % | vs none (goal ≥ 0.90×) |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = res["rows"]
    none = val(rows.get("0"), "iops")
    for n, c in rows.items():
        if "error" in c:
            out.append(f"| {n} | {cell_err(c)} | | | | |")
            continue
        what = "0, during a backup (goal ≥ 0.70×)" if n == "backup" else n
        out.append(f"| {what} | {fmt_num(c['iops'])} | {fmt_num(c['p50_us'])} | {fmt_num(c['p99_us'])} | "
                   f"{fmt_pct(c.get('cpu_pct'))} | {fmt_ratio(ratio(c['iops'], none))} |")
    out.append("")
    out.append("Each bitmap has 64 KiB granules and is enabled, loaded from the image's sidecar at start "
               "(`vdisk ctl bitmap add` beforehand); every completed write ORs its granules into each. "
               "\"During a backup\": a backup view is open (`vdisk ctl backup begin`, nothing reading it), "
               "so the first write to each 64 KiB granule copies its old data to the scratch file first.\n")
    return out


LOOP_ROWS = [  # key, title, metric, unit, higher is better
    ("dd", "dd read whole disk, bs=1M", "mibs", "MiB/s", True),
    ("mkfs", "mkfs.ext4 -E lazy_itable_init=0,lazy_journal_init=0", "seconds", "s", False),
    ("mkfs_nodiscard", "same + nodiscard (zeroes by WRITE_ZEROES)", "seconds", "s", False),
    ("populate", "populate 2000 files in 100 dirs, + sync", "seconds", "s", False),
    ("find_cat", "find -type f -exec cat {} +, cold cache", "seconds", "s", False),
    ("dbench", "dbench 2 clients", "mbs", "MB/s", True),
    ("aio_read", "8K O_DIRECT seq read, 8 threads", "iops", "IOPS", True),
    ("aio_randread", "8K O_DIRECT rand read, 8 threads", "iops", "IOPS", True),
    ("aio_write", "8K O_DIRECT seq write, 8 threads", "iops", "IOPS", True),
    ("aio_randwrite", "8K O_DIRECT rand write, 8 threads", "iops", "IOPS", True),
    ("fio_randread_4k", "4K rand read QD32, libaio O_DIRECT", "iops", "IOPS", True),
    ("fio_randwrite_4k", "4K rand write QD32, libaio O_DIRECT", "iops", "IOPS", True),
    ("fio_read_1m", "1M seq read QD8, libaio O_DIRECT", "mibs", "MiB/s", True),
    ("fio_write_1m", "1M seq write QD8, libaio O_DIRECT", "mibs", "MiB/s", True),
]


def md_loop(res, meta):
    out = ["### 2. Through a loop device (a FUSE file → losetup --direct-io=on), tmpfs image\n"]
    servers = res["servers"]
    out.append("| experiment | server | result | p50 µs | p99 µs | peak RSS MiB | vs best peer | vs raw file |")
    out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, title, metric, unit, higher in LOOP_ROWS:
        def get(lab):
            s = servers.get(lab, {})
            return None if "error" in s else val(s.get(key), metric)
        peers = [get(p) for p in LOOP_PEERS if get(p) is not None]
        peer = (max(peers) if higher else min(peers)) if peers else None
        limit = get(RAW_FILE)
        for label, *_ in LOOP_TARGETS:
            s = servers.get(label, {"error": "not run"})
            c = s if "error" in s else s.get(key, {"error": "not run"})
            if "error" in c:
                out.append(f"| {title} | {label} | {cell_err(c)} | | | | | |")
                continue
            v = c[metric]
            r = ratio(v, peer) if higher else ratio(peer, v)
            lim = ratio(v, limit) if higher else ratio(limit, v)
            p50 = fmt_num(c.get("p50_us")) if "p50_us" in c else ""
            p99 = fmt_num(c.get("p99_us")) if "p99_us" in c else ""
            extra = f" (max lat {c['max_latency_ms']:.0f} ms)" if key == "dbench" else ""
            out.append(f"| {title} | {label} | {fmt_num(v)} {unit}{extra} | {p50} | {p99} | "
                       f"{fmt_mib(s.get('rss_mib'))} | {fmt_ratio(r)} | {fmt_ratio(lim)} |")
    out.append("")
    notes = []
    for label, s in servers.items():
        lp = s.get("_loop") if isinstance(s, dict) else None
        if lp and not lp["dio"] and label == "qemu-storage-daemon FUSE":
            notes.append(f"{label}: its loop device is buffered (`losetup --direct-io=off`). With direct I/O, "
                         "mkfs.ext4 through its FUSE export wrote a file system that does not mount "
                         "(\"group descriptors corrupted\"; QEMU 10.0, Linux 6.18), so every earlier run "
                         "lost its file-system rows.")
        elif lp and not lp["dio"]:
            notes.append(f"{label}: the loop device did not take direct I/O (dio=0).")
        pop = s.get("populate", {}) if isinstance(s, dict) else {}
        if "mount:" in pop.get("error", ""):
            notes.append(f"{label}: the ext4 that mkfs.ext4 made through it could not be mounted (ext4 reports a "
                         "corrupt journal inode), so the file-system rows are missing.")
    out.append("How the file is made: vdisk FUSE (classic) is `vdisk serve --fuse FILE` (requests read from "
               "/dev/fuse by several threads on cloned descriptors), vdisk FUSE (ring) the same with "
               "`--fuse-uring` (FUSE-over-io_uring, one ring per CPU queue); nbdfuse opens 4 NBD connections "
               "to vdisk, qemu-nbd or nbdkit (each advertises multi-conn); qemu-storage-daemon exports the "
               "image with `--export type=fuse`. vs best peer: > 1 means that row is faster than the best of "
               "qemu-storage-daemon FUSE, nbdfuse on qemu-nbd and nbdfuse on nbdkit (for times: best peer's "
               "time / this time). The image is refilled with data before each target. mkfs.ext4 writes "
               "little data: it discards the whole device (BLKDISCARD → FUSE fallocate punch → TRIM) and, with "
               "nodiscard, zeroes the inode tables and journal with `fallocate(FALLOC_FL_ZERO_RANGE)` "
               "(→ WRITE_ZEROES); both rows time those few large requests (the filesystem used afterwards "
               "is the nodiscard one). "
               "The 8K jobs use `fio --ioengine=psync --direct=1 --bs=8k --numjobs=8`, each thread on its own "
               "eighth of the device (aio-stress's four patterns); the 4K/1M jobs are one fio job with "
               "`--ioengine=libaio --direct=1` at the queue depth shown. " + " ".join(notes) + "\n")
    return out


OVERLAY_KIND = {"vdisk uring": "UML COW v3", "vdisk threads": "UML COW v3", "vdisk qcow2 uring": "qcow2",
                "vdisk qcow2 threads": "qcow2", "qemu-nbd": "qcow2", "nbdkit": "cow filter"}


def qemu_note(cells):
    """Which qemu-nbd served the rbd rows: the system's, or QEMU 7.2's from bench/qemu72.sh."""
    for k, c in cells.items():
        if k.endswith("|qemu-nbd rbd") and c.get("server_version"):
            how = (" with `QEMU_MODULE_DIR` set to the block modules unpacked beside it by bench/qemu72.sh "
                   "(Debian 12's qemu-utils and qemu-block-extra 7.2: the system's QEMU has no rbd driver)"
                   if "QEMU_MODULE_DIR=" in c.get("server_cmd", "") else "")
            return f", {c['server_version']}{how}"
    return ", when a qemu-nbd with an rbd block driver is found (the system's, or QEMU 7.2's from bench/qemu72.sh)"


def md_rbd(res, meta):
    out = ["### 6. Ceph RBD: one image on a single-node memstore cluster\n"]
    if "error" in res:
        return out + [f"Not run: {res['error']}.", ""]
    cells = res["cells"]
    out.append("| job | path | IOPS / MiB/s | p50 µs | p99 µs | server CPU % | CPU µs / request | peak RSS MiB | "
               "vs fio rbd |")
    out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for jid in res.get("jobs", RBD_JOBS):
        _, title_j, _opts, metric = JOB[jid]
        base = val(cells.get(f"{jid}|fio rbd"), metric)
        for target in res.get("targets", RBD_TARGETS):
            c = cells.get(f"{jid}|{target}", {"error": "not run"})
            if "error" in c:
                out.append(f"| {title_j} | {target} | {cell_err(c)} | | | | | | |")
                continue
            out.append(f"| {title_j} | {target} | {measured(c, metric)} | {fmt_ratio(ratio(c[metric], base))} |")
    out.append("")
    load = f"load average {' '.join(res.get('loadavg_start', ['?']))} at the start of the section, " \
           f"{' '.join(res.get('loadavg_end', ['?']))} at its end"
    out.append(
        "A 1 GiB image on `scripts/cephrig/ceph-micro.sh` (one monitor, one OSD on memstore, 2 GiB of RAM; "
        "the OSD, librbd, the server and fio share the machine's CPUs), filled with 1M writes first. "
        "**vdisk**: `vdisk serve rbd:rbd/bench` (the RBD engine: librbd AIO, completions on an eventfd), fio's "
        "nbd engine on its unix socket. **fio rbd**: `fio --ioengine=rbd` on the same image, librbd inside fio "
        "(no server, no NBD hop: the limit a server approaches). **qemu-nbd rbd**: `qemu-nbd -f raw "
        "rbd:rbd/bench:conf=... --shared=8`" + qemu_note(cells) + ". librbd's cache as the cluster sets it "
        f"(Pacific: on, writethrough until the first flush). {load}: other work on the machine moves these "
        "figures; compare rows of one run.")
    out.append("")
    return out


def md_scale(res, meta):
    """Section "scale": many exports on one server, vdisk beside qemu-storage-daemon."""
    out = ["### 7. Scale: many exports on one server\n"]
    def f(v, fmt="{:.1f}"):
        return "–" if v is None else fmt.format(v)
    idle = res.get("idle", {})
    if idle:
        out += ["| idle exports | vdisk RSS MiB | vdisk Pss MiB | vdisk threads | qsd RSS MiB | qsd Pss MiB | "
                "qsd threads | RSS vdisk / qsd |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n in sorted({int(k.split("|")[0]) for k in idle}):
            v, q = idle.get(f"{n}|vdisk", {}), idle.get(f"{n}|qsd", {})
            cells = []
            for c in (v, q):
                cells += ([cell_err(c), "", ""] if "error" in c else
                          [f(c.get("rss_mib")), f(c.get("pss_mib")), f(c.get("threads"), "{:d}")])
            out.append(f"| {n:,} | " + " | ".join(cells) + f" | {fmt_ratio(ratio(v.get('rss_mib'), q.get('rss_mib')))} |")
        out.append("")
    add = res.get("add", {})
    if add:
        p, c = add.get("pipelined", {}), add.get("ctl", {})
        out += ["| exports added through the control socket | wall s | RSS MiB | Pss MiB | threads | note |",
                "| ---: | ---: | ---: | ---: | ---: | --- |"]
        if "error" in p:
            out.append(f"| {add.get('count', 0):,} | {cell_err(p)} | | | | |")
        else:
            out.append(f"| {add.get('count', 0):,} (export_add pipelined on one connection) | {f(p.get('seconds'))} | "
                       f"{f(p.get('rss_mib'))} | {f(p.get('pss_mib'))} | {f(p.get('threads'), '{:d}')} | "
                       f"{p.get('error_note', '')} |")
        if "error" in c:
            out.append(f"| `vdisk ctl add` once per export | {cell_err(c)} | | | | |")
        elif c:
            out.append(f"| {c['n']} (`vdisk ctl add`, one process each) | {f(c['seconds'])} | | | | "
                       f"{c['ms_per_add']:.1f} ms per add |")
        out.append("")
    busy = res.get("busy", {})
    if busy:
        out += ["| 4 busy exports, 4K randread QD32 each | vdisk IOPS | qsd IOPS |", "| --- | ---: | ---: |"]
        for case, title in (("alone", "alone on the server"), ("beside", "beside 996 idle exports")):
            out.append(f"| {title} | " + " | ".join(
                cell_err(busy.get(f"{k}|{case}", {"error": "not run"})) if "error" in busy.get(f"{k}|{case}", {"error": 1})
                else fmt_num(busy[f"{k}|{case}"]["iops"]) for k in ("vdisk", "qsd")) + " |")
        out.append("| beside / alone | " + " | ".join(fmt_ratio(ratio(busy.get(f"{k}|beside", {}).get("iops"),
                                                                         busy.get(f"{k}|alone", {}).get("iops")))
                                                      for k in ("vdisk", "qsd")) + " |")
        out.append("")
    fair = res.get("fair", {})
    if fair:
        out += ["| server | 4K QD1 randread p99 alone µs | p99 beside 4K randwrite QD128 µs | ratio | "
                "QD1 IOPS alone / beside | the writer's IOPS |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for k, title in (("vdisk", "vdisk"), ("qsd", "qemu-storage-daemon, one iothread")):
            r = fair.get(k, {"error": "not run"})
            if "error" in r:
                out.append(f"| {title} | {cell_err(r)} | | | | |")
                continue
            a, w = r["alone"], r["with"]
            out.append(f"| {title} | {a['p99_us']:.0f} | {w['p99_us']:.0f} | {fmt_ratio(ratio(w['p99_us'], a['p99_us']))} | "
                       f"{fmt_num(a['iops'])} / {fmt_num(w['iops'])} | {fmt_num(r['noisy']['iops'])} |")
        out.append("")
    load = f"load average {' '.join(res.get('loadavg_start', ['?']))} at the start of the section, " \
           f"{' '.join(res.get('loadavg_end', ['?']))} at its end"
    out.append(
        "1 GiB sparse raw files in /dev/shm (the busy and fairness ones 256 MiB, filled with data). "
        "**vdisk**: `vdisk serve --control C --socket S" + (f" {res['io_threads']}" if res.get("io_threads") else "")
        + "`, every export added with `export_add` (docs/control.md), pipelined on one connection. "
        f"**qsd** ({res.get('qsd') or 'qemu-storage-daemon'}): `--blockdev driver=file,aio=io_uring` and `--export "
        "type=nbd` per file on one `--nbd-server` (the main loop; the fairness row puts both exports on one "
        "`--object iothread`). RSS = VmRSS, Pss from smaps_rollup, threads from /proc/PID/status, read once the "
        f"thread count stops moving after the last add. Descriptor limit {res.get('nofile', 0):,} for every server. "
        f"fio's nbd engine, one job per export, all at once, {res.get('runtime', '?')} s after a 1 s ramp; busy: "
        f"median of {res.get('repeat', 1)} round(s), alone and beside alternating, a fresh server each; fairness: "
        f"one server, the round of median ratio of {res.get('repeat', 1)}. {load}.")
    out.append("")
    return out


def md_jobs(res, _meta):
    """Section "jobs": the guest's 4K writes during a mirror and an active commit, vdisk beside qsd."""
    out = ["### 8. Live block jobs: the guest's writes during a mirror and an active commit\n",
           "| row | server | guest IOPS while the job ran | vs no job | IOPS over the window | p99 µs | "
           "job ready / done after | jobs started | copied in the window | job rate | server CPU % |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = res.get("rows", {})
    for key, title, image, job, _limit in JOBS_ROWS:
        alone = "alone-raw" if image == "raw" else "alone-qcow2"
        for kind, label in JOBS_SERVERS:
            c = rows.get(f"{key}|{kind}", {"error": "not run"})
            if "error" in c:
                out.append(f"| {title} | {label} | {cell_err(c)} | | | | | | | | |")
                continue
            base = val(rows.get(f"{alone}|{kind}"), "iops")
            if not job:
                out.append(f"| {title} | {label} | {fmt_num(c['iops'])} | 1.00× | {fmt_num(c['iops'])} | "
                           f"{fmt_num(c['p99_us'])} | | | | | {fmt_pct(c.get('cpu_pct'))} |")
                continue
            word = "ready" if job == "mirror" else "done"
            first = (f"{c['first_s']:.1f} s" if c.get("first_s") is not None
                     else f"not {word} in {c.get('job_window_s', 0):.1f} s")
            rate = c.get("job_rate")
            out.append(f"| {title} | {label} | {fmt_num(c.get('iops_job'))} | {fmt_ratio(ratio(c.get('iops_job'), base))} | "
                       f"{fmt_num(c['iops'])} | {fmt_num(c['p99_us'])} | {first} | {c.get('jobs_started', 0)} | "
                       f"{c.get('copied_bytes', 0) / MiB:,.0f} MiB | "
                       f"{'—' if rate is None else f'{rate / MiB:,.0f} MiB/s'} | {fmt_pct(c.get('cpu_pct'))} |")
    out.append("")
    for key, title, _image, job, _limit in JOBS_ROWS:
        for kind, label in JOBS_SERVERS:
            c = rows.get(f"{key}|{kind}", {})
            if c.get("cancel_note"):
                out.append(f"- {label}, {title}: the job, cancelled when fio ended, did not end "
                           f"({cell_err({'error': c['cancel_note']})}); the server was stopped.")
            elif c.get("cancel_s") is not None and c["cancel_s"] > 1:
                out.append(f"- {label}, {title}: the job took {c['cancel_s']:.1f} s to end once cancelled when fio ended.")
    if out[-1] != "":
        out.append("")
    limit = res.get("limit", 0) / MiB
    out.append(
        f"fio's nbd engine, 4K randwrite QD32, {res.get('runtime', '?')} s with no ramp, on a "
        f"{res.get('image_mib', '?')} MiB raw image filled with data (mirror rows) or a qcow2 overlay holding "
        f"{res.get('overlay_mib', '?')} MiB over it (commit rows); fresh copies of both files for every row, on tmpfs. "
        f"The job starts {res.get('start_delay_s', 0.1)} s after fio has connected. **vdisk**: `vdisk serve IMG "
        "--engine uring --control C`, the job by `export_mirror` to a new raw file on tmpfs or `export_commit` with "
        "`active` (it pivots to the base once ready), limited rows with `bps`. "
        f"**qsd** ({res.get('qsd') or 'qemu-storage-daemon'}): `--blockdev driver=file,aio=io_uring` (+ `raw`, or "
        "`qcow2` with `backing=` the raw base), `--export type=nbd` on a unix `--nbd-server` (main loop, no "
        "iothread), QMP on a unix `--chardev`: `blockdev-add` of the target file and `blockdev-mirror sync=full`, "
        "or `block-commit` of the top and `block-job-complete` once ready; limited rows with `speed`. "
        f"Limited: {limit:.0f} MiB/s. A mirror that gets ready within the window is cancelled (nothing pivots), "
        "its target removed and a new mirror started, so a bulk copy runs throughout (\"jobs started\"; \"ready "
        "after\" is the first one's). A commit runs once: \"while the job ran\" is fio's IOPS log (100 ms "
        "averages) over the job's life, the window's figure beside it; \"vs no job\" divides by the row without a "
        "job on the same image (raw or qcow2). Job states polled every "
        f"{res.get('poll_s', 0.1)} s. Copied = the jobs' bytes done within the window; rate = that over the time the "
        "jobs ran in it. Server CPU: user+system of the whole server (its job included) over the window. "
        f"Load average {' '.join(res.get('loadavg_start', ['?']))} at the start of the section, "
        f"{' '.join(res.get('loadavg_end', ['?']))} at its end.")
    out.append("")
    return out


def md_overlay(res, meta):
    out = ["### 4. Copy-on-write overlays over a 2 GiB base, tmpfs (/dev/shm)\n"]
    cells = res["cells"]
    out.append("| job | server | overlay | IOPS / MiB/s | p50 µs | p99 µs | server CPU % | CPU µs / request | "
               "peak RSS MiB | overlay MiB at end | vs best peer |")
    out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for jid in res.get("jobs", OVERLAY_JOBS):
        _, title_j, _opts, metric = JOB[jid]
        peer = best_peer([val(cells.get(f"{jid}|{p}"), metric) for p in PEERS])
        for label, _k, _e in OVERLAY_TARGETS:
            c = cells.get(f"{jid}|{label}", {"error": "not run"})
            kind = OVERLAY_KIND[label]
            if "error" in c:
                out.append(f"| {title_j} | {label} | {kind} | {cell_err(c)} | | | | | | | |")
                continue
            v = c[metric]
            out.append(f"| {title_j} | {label} | {kind} | {measured(c, metric)} | "
                       f"{fmt_mib(c.get('overlay_mib'))} | {fmt_ratio(ratio(v, peer))} |")
    out.append("")
    passes = []  # how many times over the 1M write job wrote the whole image (after its ramp)
    for label, _k, _e in OVERLAY_TARGETS:
        c = cells.get(f"write-1m-qd8|{label}", {})
        rt = re.search(r"--runtime=(\d+)", c.get("cmd", ""))
        if "error" not in c and rt and c.get("mibs"):
            passes.append(c["mibs"] * int(rt.group(1)) * MiB / IMAGE_SIZE)
    wrap = ""
    if passes and max(passes) >= 1.5:
        lo, hi = min(passes), max(passes)
        wrap = (f" The 1M write job goes over the whole 2 GiB {lo:.1f}–{hi:.1f} times after its ramp, so those "
                "rows mostly rewrite blocks the overlay already holds.")
    out.append(
        "Every job gets a fresh overlay over the same base (2 GiB raw, filled with data; base and overlays both "
        "in /dev/shm, so the transport and the overlay logic dominate), made just before its server starts and "
        "removed once it has stopped. "
        "**vdisk** serves a UML COW v3 overlay made by `vdisk create --backing BASE overlay.cow` (`vdisk serve "
        "overlay.cow --engine uring|threads`): a sparse file with one bitmap bit per 512-byte sector, kept in "
        "memory and written back on FLUSH and at shutdown, and every sector's data at its own offset, so a 4K "
        "write is one write to the overlay. "
        "**vdisk qcow2** serves the same kind of overlay qemu-nbd does, made by `vdisk create --format qcow2 "
        "--backing BASE overlay.qcow2` (64 KiB clusters; a 4K write into a new cluster copies the rest of it "
        "from the base, as qemu does): the like-for-like comparison with the qemu-nbd rows. "
        "**qemu-nbd** serves a qcow2 overlay made by `qemu-img create -f qcow2 -b BASE -F raw` (`qemu-nbd -t -f "
        "qcow2 --aio=io_uring --cache=writeback --shared=8`): 64 KiB clusters allocated on first write, so a 4K "
        "write into a new cluster also copies the rest of that cluster from the base. "
        "**nbdkit** runs `nbdkit --filter=cow file BASE`: the cow filter keeps its overlay in an unlinked "
        "temporary file in `$TMPDIR` (here a directory in /dev/shm; its default is /var/tmp) in 64 KiB blocks "
        "with an in-memory bitmap, a write of part of a block first reads the whole block, and the overlay is "
        "gone when nbdkit exits. "
        "The overlays are fresh, so every read falls through to the base for all of them (the read rows measure "
        "the lookup and the pass-through); the write rows include allocation (vdisk marks 512-byte sectors and "
        "stores only what was written; qemu-nbd and nbdkit fill whole 64 KiB clusters or blocks), which shows in "
        "overlay MiB at end: the overlay's allocated size (`st_blocks`) just before the server is stopped." + wrap + " vs best peer = this row / "
        "max(qemu-nbd, nbdkit) for the same job.\n")
    return out


def md_rss(results):
    """Section 4: the peak of each server over all its runs."""
    peak = {}

    def add(label, v):
        if v:
            peak[label] = max(peak.get(label, 0), v)
    if "fio" in results:
        for k, c in results["fio"]["cells"].items():
            medium, _j, label = k.split("|")
            if label != "direct":
                add(f"{label} ({medium})", c.get("rss_mib"))
    if "ablations" in results:
        for label, row in results["ablations"]["rows"].items():
            for j in ABL_JOBS:
                add(f"{label} (tmpfs)", row[j].get("rss_mib"))
    if "loop" in results:
        for label, s in results["loop"]["servers"].items():
            add(f"{label} (loop experiments)", s.get("rss_mib"))
    if "overlay" in results:
        for k, c in results["overlay"]["cells"].items():
            add(f"{k.split('|')[1]} (overlay)", c.get("rss_mib"))
    if not peak:
        return []
    out = ["### 6. Peak RSS per server (largest VmHWM over all its runs)\n",
           "| server | peak RSS MiB |", "| --- | ---: |"]
    for label, v in peak.items():
        out.append(f"| {label} | {fmt_mib(v)} |")
    out.append("\nEach server is started fresh for every job; VmHWM is read from /proc/PID/status just before "
               "it is sent SIGTERM.\n")
    return out


def peers_used(results):
    """The peer configurations the report's rows actually ran with (TUNING in the Servers line)."""
    cells = results.get("fio", {}).get("cells", {})
    out = []
    for p in PEERS:
        used = {}
        for k, c in cells.items():
            if k.endswith(f"|{p}") and "error" not in c:
                cfg = c.get("config") or peer_config_name(p, ())
                used[cfg] = used.get(cfg, 0) + 1
        if used:
            out.append(f"{p}: " + ", ".join(f"`{cfg}` ({n} row{'s' if n > 1 else ''})"
                                             for cfg, n in sorted(used.items(), key=lambda kv: -kv[1])))
    tuned = ("Fio matrix peers, tuned per row (each row names its configuration): " + "; ".join(out) + ". "
             if out else "")
    return (tuned + "Elsewhere (loop, ablations, overlay, rbd) qemu-nbd runs with `--shared=8` (and `--aio=io_uring` "
            "on image files) and "
            "nbdkit with its defaults (16 threads).")


def render(results, meta, md_path, png_path):
    m = meta["machine"]
    lines = [
        "# vdisk benchmarks",
        "",
        "Generated by `bench/run.py` — do not edit by hand; rerun it (see bench/README.md).",
        "",
        f"- **Command:** `{meta['command']}` ({meta['mode']}; {meta['runtime']} s per fio job after a 1 s ramp, "
        f"median of {meta['repeat']} run(s) per job; CPU placement: "
        f"{ {'none': 'scheduler', 'split': 'servers on CPU 1, fio on CPU 0', 'same': 'all on CPU 0'}[meta.get('pin', 'none')] })",
        f"- **Date:** {meta['date']} — took {meta['elapsed_min']:.1f} min",
        f"- **Machine:** {m['nproc']} CPUs ({m['cpu']}), {m['memory']} memory, kernel {m['kernel']}, "
        f"`uname -r` {m['uname_r']}; load average at start {' '.join(m['loadavg_start'])}",
        f"- **vdisk:** {meta['vdisk']}",
        "- **Peers:** " + "; ".join(f"{k}: {v}" for k, v in m["tools"].items()),
        "- **Images:** 2 GiB raw, filled with data first (no holes), tmpfs in /dev/shm and ext4 in /var/tmp; "
        "export name = file stem; every server on a unix socket, fio through its nbd engine (libnbd).",
        "- **Servers:** `vdisk serve IMG --engine uring|threads` "
        f"({'+ `--direct` on disk; ' if vdisk_direct(results) else ''}defaults otherwise); "
        "`qemu-nbd -t -f raw --cache=writeback|none TUNING`; `nbdkit -f TUNING file IMG`; "
        "direct = `fio --ioengine=io_uring` on the image file. " + peers_used(results),
        "",
        "vs best peer = this row / max(qemu-nbd, nbdkit) for the same job (so the best peer reads 1.00×); "
        "vs direct = this row / fio io_uring on the file. Two cores run both the server and fio, so "
        "everything here is CPU-bound: ratios carry over better than absolute numbers.",
        "",
    ]
    if png_path and png_path.exists() and "fio" in results:
        lines += [f"![fio matrix on tmpfs, normalised to the best peer]({png_path.name})", ""]
    for sec, fn in (("fio", md_fio), ("loop", md_loop), ("ablations", md_ablations), ("bitmaps", md_bitmaps),
                    ("overlay", md_overlay),
                    ("vm", md_vm), ("rbd", md_rbd), ("scale", md_scale), ("jobs", md_jobs)):
        if sec in results:
            r = results[sec]
            sm = r.get("_meta", {})
            lines += fn(r, sm)
            if sm.get("date") and sm.get("date") != meta["date"]:
                lines += [f"_This section is from an earlier run: `{sm.get('command')}` on {sm.get('date')}._", ""]
    if meta.get("interrupted"):
        lines[4:4] = ["- **Interrupted:** the run was stopped early; rows that say \"not run\" were not measured."]
    lines += md_rss(results)
    md_path.write_text("\n".join(lines).rstrip() + "\n")


def plot(results, png_path, meta):
    try:
        import matplotlib
    except ImportError:
        # A python3 first on PATH other than the system's (pyenv, a venv) does not see Debian's
        # python3-matplotlib: use the system's packages when they are for this Python version.
        dist = Path("/usr/lib/python3/dist-packages")
        if (dist / "matplotlib").is_dir() and any(dist.glob(f"*cpython-3{sys.version_info.minor}*")):
            sys.path.append(str(dist))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing (apt-get install python3-matplotlib): no PNG")
        return False
    cells = results["fio"]["cells"]
    labels = [t[0] for t in MATRIX_TARGETS]
    colors = {"vdisk uring": "#1f77b4", "vdisk threads": "#6baed6", "qemu-nbd": "#ff7f0e",
              "nbdkit": "#2ca02c", "direct": "#969696"}
    cap = 3.0
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    width = 0.16
    for i, label in enumerate(labels):
        xs, hs = [], []
        for x, (jid, _t, _o, metric) in enumerate(JOBS):
            peer = best_peer([val(cells.get(f"tmpfs|{jid}|{p}"), metric) for p in PEERS])
            v = val(cells.get(f"tmpfs|{jid}|{label}"), metric)
            r = ratio(v, peer)
            xpos = x + (i - (len(labels) - 1) / 2) * width
            if r is None:
                ax.text(xpos, 0.03, "✗", ha="center", va="bottom", fontsize=8, color="red")
                continue
            xs.append(xpos)
            hs.append(min(r, cap))
            if r > cap:
                ax.text(xpos, cap, f"{r:.1f}", ha="center", va="bottom", fontsize=7)
        ax.bar(xs, hs, width, label=label, color=colors[label])
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(JOBS)))
    ax.set_xticklabels([t[1] for t in JOBS], fontsize=8)
    ax.set_ylim(0, cap + 0.3)
    ax.set_ylabel("throughput / best of qemu-nbd, nbdkit")
    m = meta["machine"]
    fm = {**meta, **results["fio"].get("_meta", {})}  # the fio section may be from an earlier run (--only)
    ax.set_title(f"fio over NBD (unix socket), 2 GiB tmpfs image — {fm['mode']}, {m['nproc']} CPUs, "
                 f"{fm['date'][:10]}", fontsize=10)
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return True
