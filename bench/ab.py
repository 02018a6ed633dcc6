#!/usr/bin/env python3
"""A/B: the same fio rows against several vdisk command lines, alternating, in one run.

    python3 bench/ab.py NAME=BINARY[:ARGS] NAME=BINARY[:ARGS] ... [--rounds N] [--runtime S]

Each NAME is one configuration: a vdisk binary and extra `serve` arguments (comma-separated
after a colon), e.g. `before=/tmp/old/vdisk after=target/release/vdisk
metrics=target/release/vdisk:--metrics,127.0.0.1:19199` (scraped once a second). Every round runs every row
against every configuration in turn on a fresh server over a 2 GiB tmpfs image (so
drift in the machine's load hits all of them alike); the table gives each
configuration's median and its ratio to the first. For comparing builds (a refactor
that must not cost speed) or a switch (metrics on and off); the full suite is run.py.
"""

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True

from vbench.common import IMAGE_SIZE, LOGS, RAW, fill_image, run_cleanups  # noqa: E402
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
    a = p.parse_args()
    configs = []
    for c in a.configs:
        name, _, rest = c.partition("=")
        binary, _, args = rest.partition(":")
        configs.append((name, str(Path(binary).resolve()), [x for x in args.split(",") if x]))
    work = Path(a.dir) / "vdisk-ab"
    work.mkdir(exist_ok=True)
    for d in (RAW, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    image, sock = work / "ab.img", work / "ab.sock"
    fill_image(image, IMAGE_SIZE, False)
    rows = a.rows.split(",")
    got = {(r, n): [] for r in rows for n, _, _ in configs}
    try:
        for rnd in range(a.rounds):
            for row in rows:
                _, title, opts, metric = JOB[row]
                for name, binary, extra in configs:
                    srv = Server(f"ab {name}", [binary, "serve", str(image), "--socket", str(sock)] + extra, str(sock))
                    srv.start()
                    scraper = Scraper(extra)  # with --metrics: GET /metrics once a second, as Prometheus would
                    try:
                        args = fio_job_args(opts, a.runtime, 1) + ["--ioengine=nbd", f"--uri=nbd+unix:///ab?socket={sock}"]
                        r = run_fio(f"ab-{row}-{name}-{rnd}", args, a.runtime + 60)
                    finally:
                        scraper.stop()
                        srv.stop()
                    got[(row, name)].append(r[metric])
                    print(f"round {rnd} {title:<20} {name:<10} {r[metric]:>10.0f}", flush=True)
    finally:
        run_cleanups()
        shutil.rmtree(work, ignore_errors=True)
    first = configs[0][0]
    print("\n| row | " + " | ".join(n for n, _, _ in configs) + " |")
    print("| --- |" + " ---: |" * len(configs))
    for row in rows:
        base = statistics.median(got[(row, first)])
        unit = "IOPS" if JOB[row][3] == "iops" else "MiB/s"
        cells = [f"{statistics.median(got[(row, n)]):,.0f} {unit} ({statistics.median(got[(row, n)]) / base:.2f}×)"
                 for n, _, _ in configs]
        print(f"| {JOB[row][1]} | " + " | ".join(cells) + " |")
    print(f"\nmedians of {a.rounds} rounds of {a.runtime} s each, configurations alternating within each round")


if __name__ == "__main__":
    main()
