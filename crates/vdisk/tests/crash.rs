//! Crash consistency, end to end: `vdisk soak` runs the real server, has four
//! connections write generation-tagged blocks with FLUSH, FUA, WRITE_ZEROES
//! and TRIM mixed in, kills it with SIGKILL 3-200 ms in, restarts it and
//! judges every 512-byte piece of the disk: each write acknowledged before a
//! completed FLUSH (or with FUA, or under --sync; on raw images every
//! acknowledged write) must be there, and nothing never written may appear.
//! 56 rounds cycle through {raw, COW overlay} x {uring, threads} x {normal,
//! --sync}; `vdisk soak --rounds N` runs thousands.

mod common;

use common::crash_rounds;
use std::time::Instant;

#[test]
fn sigkill_rounds_keep_every_flushed_write_and_invent_nothing() {
    const ROUNDS: u64 = 56;
    let started = Instant::now();
    let r = crash_rounds("crash", ROUNDS, &["--format", "raw,cow"]);
    eprintln!(
        "{ROUNDS} crash rounds: {} writes acknowledged, {} flushes, {} pinned blocks, {:?}",
        r.acked,
        r.flushes,
        r.pinned,
        started.elapsed()
    );
}
