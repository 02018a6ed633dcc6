//! Crash safety of the live disk operations (issues 25 and 26), end to end:
//! `vdisk soak --jobs` runs the crash rounds' checked writers on the power-cut
//! storage (crates/vdisk-powercut) while it snapshots the export (qcow2
//! overlays), streams its top and commits its middle layer through the
//! control socket, jobs paced so that the cut often lands in one, with a
//! dirty bitmap on the top. After every cut: the chain from the newest top
//! whose header reads back opens in vdisk and in `qemu-img info
//! --backing-chain`, `qemu-img check` is clean on every qcow2 layer, every
//! flushed write is there (the soak's judge, per 512-byte piece), an
//! interrupted job runs again to its end with the disk reading the same, and
//! the bitmap is marked inconsistent or covers everything that changed.
//!
//! CI: 24 cuts ({raw, qcow2 over raw} x {uring, threads} x {normal, --sync,
//! --direct}, one dropping every unsynced write and one keeping a random part
//! each); and the same rounds with the commit's base sync skipped
//! (VDISK_BREAK=commit-link-first: the backing link rewritten before the
//! merged data is durable) must fail within a few cuts. The SIGKILL rounds
//! with jobs are in tests/crash.rs.
//!
//! And 24 cuts with mirrors (to a new raw or qcow2 file: pivoted, cancelled,
//! or cut while copying or ready; a cut after the pivot was asked is judged
//! on the target, else on the old chain) and backup views (the bitmap and a
//! new one, the view read over NBD, ended or cut) beside snapshots: every
//! flushed write is in the disk, the scratch directory (off the power-cut
//! storage) is empty, the bitmaps cover every change or are marked
//! inconsistent. The report says how many cuts landed mid-mirror and mid-backup.

mod common;

use common::crash_rounds;
use std::time::Instant;

#[test]
fn power_cuts_during_snapshot_stream_and_commit_keep_every_flushed_write() {
    const ROUNDS: u64 = 24;
    let started = Instant::now();
    let r = crash_rounds(
        "jobs-powerloss",
        ROUNDS,
        &["--format", "raw,qcow2", "--power-loss", "mixed", "--jobs", "snapshot,stream,commit,bitmaps"],
    );
    let live = &r.report["crash"]["live"];
    assert!(r.live("snapshots") > 0, "no snapshot was answered: {}", r.report);
    assert!(r.live("cuts_mid_job") > 0, "no cut landed in a job: {}", r.report);
    assert!(r.live("jobs_restarted") > 0, "no interrupted job was started again: {}", r.report);
    assert!(r.live("bitmaps_consistent") + r.live("bitmaps_inconsistent") > 0, "no bitmap was judged: {}", r.report);
    eprintln!(
        "{ROUNDS} power cuts with live jobs: {} writes acknowledged, {} flushes, {} pinned blocks; {live}; {:?}",
        r.acked,
        r.flushes,
        r.pinned,
        started.elapsed()
    );
}

#[test]
fn a_commit_that_rewrites_the_link_before_the_base_is_durable_is_caught() {
    // qcow2 over a raw base x threads x 3 modes, at most 8 cuts each: the
    // first round snapshots (three layers) and starts the commit of the
    // middle one; the commit finishes in that round or, started again, after
    // the restart; the next cut drops the base's unsynced writes under a
    // link that already names it. By hand it was caught in round 1 or 2 (2
    // seeds); beside other tests, in round 11 once (the commit had not
    // finished before the earlier cuts).
    let args = [
        "--rounds",
        "24",
        "--format",
        "qcow2",
        "--engine",
        "threads",
        "--power-loss",
        "drop",
        "--jobs",
        "snapshot,commit",
        "--seed",
        "21",
    ];
    let round = common::caught("commit-link-first", &args, "hold data never written there or older");
    assert!(round < 24);
}

#[test]
fn power_cuts_during_mirror_and_backup_keep_every_flushed_write() {
    const ROUNDS: u64 = 24;
    let started = Instant::now();
    let r = crash_rounds(
        "jobs-mirror-backup-powerloss",
        ROUNDS,
        &["--format", "raw,qcow2", "--power-loss", "mixed", "--jobs", "snapshot,mirror,backup,bitmaps"],
    );
    let live = &r.report["crash"]["live"];
    assert!(r.live("mirrors") > 0, "no mirror was started: {}", r.report);
    assert!(r.live("backups") > 0, "no backup view was begun: {}", r.report);
    assert!(
        r.live("cuts_mid_mirror") + r.live("cuts_mid_backup") > 0,
        "no cut landed in a mirror or a backup: {}",
        r.report
    );
    eprintln!(
        "{ROUNDS} power cuts with mirrors and backup views: {} mid-mirror, {} mid-backup; {} writes acknowledged, \
         {} flushes; {live}; {:?}",
        r.live("cuts_mid_mirror"),
        r.live("cuts_mid_backup"),
        r.acked,
        r.flushes,
        started.elapsed()
    );
}
