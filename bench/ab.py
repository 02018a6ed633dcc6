#!/usr/bin/env python3
"""A/B: the same fio rows against several vdisk command lines, alternating, in one run.

    python3 bench/ab.py NAME=BINARY[:ARGS][@CPUS][%VAR=VALUE] ... [--rounds N] [--runtime S] [--rows R,R]

Each NAME is one configuration: a vdisk binary and extra `serve` arguments (comma-separated
after a colon), e.g. `before=/tmp/old/vdisk after=target/release/vdisk
metrics=target/release/vdisk:--metrics,127.0.0.1:19199` (scraped once a second); `@1` runs the
server under `taskset -c 1`, `%VAR=VALUE` sets an environment variable for it (repeatable,
after the rest). Every round runs every row
against every configuration in turn on a fresh server over a 2 GiB tmpfs image (so
drift in the machine's load hits all of them alike); the table gives each
configuration's median throughput and its ratio to the first, and the median server CPU
per request (user+system µs of the server from the end of fio's ramp to fio's exit over the
requests fio completed; lower is better), and the lowest and highest same-round ratio, which
with the same binary given twice (A/A) shows how far noise alone moves a ratio. For comparing builds (a refactor
that must not cost speed) or a switch (metrics on and off); the full suite is run.py.
"""

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True

from vbench.common import IMAGE_SIZE, LOGS, PIN, RAW, fill_image, run_cleanups  # noqa: E402
from vbench.fio import JOB, Scraper, fio_job_args, run_fio  # noqa: E402
from vbench.servers import Server  # noqa: E402

ROWS = ["randread-4k-qd32", "read-1m-qd8", "write-1m-qd8"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", help="NAME=BINARY[:ARG,ARG...]")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runtime", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help="fio rows (ids from vbench/fio.py JOBS)")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--fio-cpus", help="run fio under taskset -c FIO_CPUS (with @CPUS on the servers: a fixed placement)")
    a = p.parse_args()
    if a.fio_cpus:
        PIN["fio"] = ["taskset", "-c", a.fio_cpus]
    configs = []
    envs = {}
    for c in a.configs:
        name, _, rest = c.partition("=")
        rest, *env = rest.split("%")
        envs[name] = dict(e.split("=", 1) for e in env)
        rest, _, cpus = rest.partition("@")
        binary, _, args = rest.partition(":")
        pin = ["taskset", "-c", cpus] if cpus else []
        configs.append((name, pin + [str(Path(binary).resolve())], [x for x in args.split(",") if x]))
    work = Path(a.dir) / "vdisk-ab"
    work.mkdir(exist_ok=True)
    for d in (RAW, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    image, sock = work / "ab.img", work / "ab.sock"
    fill_image(image, IMAGE_SIZE, False)
    rows = a.rows.split(",")
    got = {(r, n): [] for r in rows for n, _, _ in configs}
    cpu = {(r, n): [] for r in rows for n, _, _ in configs}
    try:
        for rnd in range(a.rounds):
            for row in rows:
                _, title, opts, metric = JOB[row]
                for name, binary, extra in configs:
                    srv = Server(f"ab {name}", binary + ["serve", str(image), "--socket", str(sock)] + extra, str(sock),
                                 env=envs[name] or None)
                    srv.start()
                    if binary[0] == "taskset":
                        srv.pid = srv.proc.pid  # taskset execs the server: same pid
                    scraper = Scraper(extra)  # with --metrics: GET /metrics once a second, as Prometheus would
                    mark = {}
                    timer = threading.Timer(1, lambda: mark.update(c0=srv.cpu_seconds()))  # fio's 1 s ramp
                    try:
                        args = fio_job_args(opts, a.runtime, 1) + ["--ioengine=nbd", f"--uri=nbd+unix:///ab?socket={sock}"]
                        timer.start()
                        r = run_fio(f"ab-{row}-{name}-{rnd}", args, a.runtime + 60)
                        c1 = srv.cpu_seconds()
                    finally:
                        timer.cancel()
                        scraper.stop()
                        srv.stop()
                    us = None
                    if mark.get("c0") is not None and c1 is not None and r["total_ios"]:
                        us = 1e6 * (c1 - mark["c0"]) / r["total_ios"]
                        cpu[(row, name)].append(us)
                    got[(row, name)].append(r[metric])
                    print(f"round {rnd} {title:<20} {name:<10} {r[metric]:>10.0f}  "
                          f"{'—' if us is None else f'{us:.2f}'} µs/req  p50 {r['p50_us']:.0f} µs", flush=True)
                    time.sleep(0.2)
    finally:
        run_cleanups()
        shutil.rmtree(work, ignore_errors=True)
    first = configs[0][0]
    print("\n| row | " + " | ".join(n for n, _, _ in configs) + " |")
    print("| --- |" + " ---: |" * len(configs))
    for row in rows:
        base = statistics.median(got[(row, first)])
        cbase = statistics.median(cpu[(row, first)]) if cpu[(row, first)] else None
        unit = "IOPS" if JOB[row][3] == "iops" else "MiB/s"
        cells = []
        for n, _, _ in configs:
            v = statistics.median(got[(row, n)])
            c = statistics.median(cpu[(row, n)]) if cpu[(row, n)] else None
            cs = "" if c is None else f"; {c:.2f} µs/req" + (f" ({c / cbase:.2f}×)" if cbase else "")
            spread = ""
            if n != first:  # the same-round ratios: how far one round strays from the median
                per = sorted(a / b for a, b in zip(got[(row, n)], got[(row, first)]))
                spread = f", rounds {per[0]:.2f}–{per[-1]:.2f}×"
            cells.append(f"{v:,.0f} {unit} ({v / base:.2f}×{spread}){cs}")
        print(f"| {JOB[row][1]} | " + " | ".join(cells) + " |")
    print(f"\nmedians of {a.rounds} rounds of {a.runtime} s each, configurations alternating within each round; "
          "rounds = lowest and highest ratio to the first configuration within one round; "
          "µs/req = server CPU (user+system) per request. Give the first binary twice (A/A) to see the noise.")


if __name__ == "__main__":
    main()
