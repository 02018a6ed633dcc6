//! Many clients at once: `vdisk soak` serves four exports from one server to
//! 64 connections doing mixed reads, writes, flushes, trims and zeroes, each
//! in a region of its own; every read is checked as it arrives and every
//! region again after a restart. CI runs 6 s per engine; `vdisk soak` runs
//! a minute (or `--seconds N`) and prints the latency percentiles.

mod common;

use common::{json, text, vdisk_bin, TempDir};
use std::process::Command;

#[test]
fn sixty_four_connections_over_four_exports_lose_nothing() {
    let dir = TempDir::new("load");
    let out = Command::new(vdisk_bin())
        .args(["soak", "--rounds", "0", "--seconds", "6", "--connections", "64", "--exports", "4"])
        .args(["--export-size", "32M", "--engine", "uring,threads", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .expect("run vdisk soak");
    assert!(out.status.success(), "vdisk soak load failed:\n{}", text(&out));
    let report = json(&String::from_utf8_lossy(&out.stdout));
    let runs = report["load"].as_array().expect("a load report");
    assert_eq!(runs.len(), 2, "{report}");
    for run in runs {
        assert_eq!(run["errors"].as_u64(), Some(0), "{run}");
        // Every block of every export was read back after the restart.
        assert_eq!(run["verified_blocks"].as_u64(), Some(4 * (32 << 20) / 4096), "{run}");
        for cmd in ["read", "write", "flush", "trim", "zero"] {
            let l = &run["latency_us"][cmd];
            assert!(l["count"].as_u64().unwrap() > 0, "no {cmd} requests: {run}");
            assert!(l["p50"].as_u64() <= l["p99"].as_u64() && l["p99"].as_u64() <= l["max"].as_u64(), "{run}");
        }
        eprintln!("load ({}): {} requests, latency {}", run["engine"], run["requests"], run["latency_us"]);
    }
}
