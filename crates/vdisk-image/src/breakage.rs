//! Durability broken on purpose, to prove the power-loss tests bite.
//!
//! Only a build with the `faults` cargo feature (test machinery, never in a
//! product build: the vdisk crate's tests turn it on) has it, and even there nothing changes unless the
//! environment variable `VDISK_BREAK` names what to break, comma-separated:
//! - `skip-data-sync`: a FLUSH (and a durable TRIM or WRITE_ZEROES) does not
//!   fdatasync the image's written file, nor does a durable write on FUSE
//!   (whose fdatasync would sync every earlier write of the file with it);
//! - `bitmap-first`: a COW overlay writes a bitmap block as soon as a bit in
//!   it is set, and its bitmap rounds write without first making the data
//!   durable: bits may reach the disk before the data they point at.
//! - `qcow2-l2-first`: a qcow2 image writes its changed metadata (refcount
//!   blocks, then L2 and L1 tables) as soon as a write is done, with no
//!   fdatasync, and its metadata rounds skip every fdatasync but the last:
//!   L2 entries may reach the disk before the data they point at (and
//!   before the refcounts of the clusters they use). What a FLUSH covers is
//!   still durable when it completes.
//! - `commit-link-first`: a live commit (vdisk-daemon's `commit`) does not
//!   sync the base it copied into before it rewrites the backing link of the
//!   layer above: the link may be durable before the data it now exposes
//!   (`vdisk soak --jobs` must catch it, tests/jobs_crash.rs).
//! - `bitmap-not-in-use`: the sidecar bitmap store (raw and COW images) does
//!   not mark its bitmaps in use when a session opens: after a crash they
//!   look cleanly saved, and short (`vdisk soak --jobs bitmaps` must catch
//!   it, tests/crash.rs).
//! - `cbw-into-disk`: a backup view's end (copy-before-write's
//!   `discard_scratch`) writes the old data it copied back into the disk's
//!   own files instead of only dropping it: the view's scratch data leaks
//!   into the disk over the guest's newer writes (`vdisk soak --jobs backup`
//!   must catch it, tests/crash.rs).
//!
//! Without the feature [`active`] is a constant `false`: the checks compile
//! away. The places that can break call [`active`]: the engine's flush (both
//! engines), the overlay's bitmap round and the qcow2 image's metadata round.

/// What `VDISK_BREAK` may break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breakage {
    SkipDataSync,
    BitmapFirst,
    Qcow2L2First,
    CommitLinkFirst,
    BitmapNotInUse,
    CbwIntoDisk,
}

pub const ENV: &str = "VDISK_BREAK";

/// Whether `b` is switched on in this process.
#[cfg(feature = "faults")]
pub fn active(b: Breakage) -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<Vec<Breakage>> = OnceLock::new();
    ON.get_or_init(|| {
        let Ok(spec) = std::env::var(ENV) else { return Vec::new() };
        let on: Vec<Breakage> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "skip-data-sync" => Breakage::SkipDataSync,
                "bitmap-first" => Breakage::BitmapFirst,
                "qcow2-l2-first" => Breakage::Qcow2L2First,
                "commit-link-first" => Breakage::CommitLinkFirst,
                "bitmap-not-in-use" => Breakage::BitmapNotInUse,
                "cbw-into-disk" => Breakage::CbwIntoDisk,
                _ => panic!(
                    "{ENV}={spec:?}: {s:?} is not skip-data-sync, bitmap-first, qcow2-l2-first, commit-link-first, \
                     bitmap-not-in-use or cbw-into-disk"
                ),
            })
            .collect();
        log::warn!("{ENV}={spec}: durability is broken on purpose (a test build)");
        on
    })
    .contains(&b)
}

/// Whether `b` is switched on: never, in a build without `faults`.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn active(_b: Breakage) -> bool {
    false
}
