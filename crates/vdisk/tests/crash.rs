//! Crash consistency, end to end: `vdisk soak` runs the real server, has four
//! connections write generation-tagged blocks with FLUSH, FUA, WRITE_ZEROES
//! and TRIM mixed in, kills it with SIGKILL 3-200 ms in, restarts it and
//! judges every 512-byte piece of the disk: each write acknowledged before a
//! completed FLUSH (or with FUA, or under --sync; on raw images every
//! acknowledged write) must be there, and nothing never written may appear.
//! 56 rounds cycle through {raw, COW overlay} x {uring, threads} x {normal,
//! --sync}; `vdisk soak --rounds N` runs thousands.

mod common;

use common::{json, text, vdisk_bin, TempDir};
use std::process::Command;
use std::time::Instant;

#[test]
fn sigkill_rounds_keep_every_flushed_write_and_invent_nothing() {
    const ROUNDS: u64 = 56;
    let dir = TempDir::new("crash");
    let started = Instant::now();
    let out = Command::new(vdisk_bin())
        .args(["soak", "--rounds", &ROUNDS.to_string(), "--seconds", "0", "--format", "raw,cow", "--json", "--dir"])
        .arg(&dir.0)
        .output()
        .expect("run vdisk soak");
    assert!(out.status.success(), "vdisk soak crash rounds failed:\n{}", text(&out));
    let report = json(&String::from_utf8_lossy(&out.stdout));
    let crash = &report["crash"];
    assert_eq!(crash["rounds"].as_u64(), Some(ROUNDS), "{report}");
    let acked = crash["writes_acked"].as_u64().unwrap();
    let flushes = crash["flushes"].as_u64().unwrap();
    let pinned = crash["pinned_blocks"].as_u64().unwrap();
    // Every round wrote and flushed something, and the verdicts had teeth:
    // many blocks had to hold one particular generation.
    assert!(acked > ROUNDS * 20 && flushes > ROUNDS && pinned > ROUNDS * 10, "too little happened: {report}");
    eprintln!(
        "{ROUNDS} crash rounds: {acked} writes acknowledged, {flushes} flushes, {pinned} pinned blocks, {:?}",
        started.elapsed()
    );
}
