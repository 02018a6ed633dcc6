//! qcow2 images (qemu's format, versions 2 and 3), read-write, over an
//! optional backing image of any format vdisk serves (raw, qcow2, UML COW).
//!
//! What it owns: mapping a request to extents through the image's L1/L2
//! tables (in memory, [`l2`]), allocating clusters for writes ([`refcount`],
//! [`write`]), and the order in which metadata reaches the disk. The pieces:
//!
//! - `header.rs`: the header and its extensions (bytes in, checked struct out);
//! - `l2.rs`: the L1/L2 mapping cache (a lock per table, shared on lookups; a cap);
//! - `refcount.rs`: refcounts and append-only allocation;
//! - `write.rs`: claiming clusters for writes (copy-on-write from the
//!   backing image), zero clusters, and the flush ordering;
//! - `bitmaps.rs`, `bitmaps_write.rs`: persistent dirty bitmaps in qemu's format;
//! - `open.rs`: opening an image and its backing chain (`repair.rs`: the
//!   refcounts of a dirty one), `create.rs`: new images,
//!   `commit.rs`: merging it into its backing file or a new raw image.
//!
//! What it must never do: write the backing image, point an L2 entry at data
//! that is not durable, or an L2 entry at a cluster whose refcount is not
//! (see `write.rs`), or write anywhere but this image's own clusters.
//!
//! The image's files are its own (file 0, every write goes there), the
//! backing image's files, and last an in-memory file holding the inflated
//! copies of compressed clusters (`compressed.rs`), so a read through the
//! chain is one list of extents the engine performs like any other.

pub mod bitmaps;
#[cfg(test)]
mod bitmaps_tests;
mod bitmaps_write;
mod commit;
mod compressed;
mod create;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod header;
mod l2;
mod open;
mod refcount;
mod repair;
#[cfg(test)]
mod tests;
mod write;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::{Allocation, Extent, Image, ImageBase, Result};

pub use create::{CreateOptions, DEFAULT_CLUSTER_BITS};
pub use header::{has_magic, parse_header, Header};
pub use open::{inspect, resolve_backing, Inspection, Qcow2Options};

use l2::{L2Cache, Unit};
use refcount::Refcounts;

/// Stripes of the claim lock: concurrent writes to one new cluster claim it once.
const STRIPES: usize = 64;
/// Longest backing chain followed.
pub const MAX_CHAIN: usize = 16;

pub struct Qcow2Image {
    /// This image's path; files [this image, the backing image's files...,
    /// inflated clusters], and their twins for direct I/O when asked for (see
    /// `with_direct_io`).
    base: ImageBase,
    header: Header,
    inflated: compressed::Inflated,
    backing: Option<Box<dyn Image>>,
    /// The backing file opened (resolved) and its format, for messages and `info`.
    backing_path: Option<PathBuf>,
    backing_format: Option<&'static str>,
    l2: L2Cache,
    refs: Mutex<Refcounts>,
    /// Host clusters whose last reference in memory was replaced (a compressed
    /// or shared cluster rewritten): their refcounts drop once the tables that
    /// no longer name them are durable (see `write.rs`).
    released: Mutex<Vec<u64>>,
    /// Clusters claimed for writes in flight, not yet in their L2 table: cluster → host.
    pending: [Mutex<write::Pending>; STRIPES],
    /// The length of file 0 as far as this process made it (reads past it are zeros).
    file_len: AtomicU64,
    /// Metadata rounds, one at a time; holds the number of the last round done.
    rounds_done: Mutex<u64>,
    rounds_started: AtomicU64,
    /// The image's persistent bitmaps (`bitmaps.rs`).
    bitmaps: Mutex<bitmaps_write::BitmapState>,
}

impl Qcow2Image {
    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.base.path
    }

    /// The backing file opened, if any.
    pub fn backing_path(&self) -> Option<&Path> {
        self.backing_path.as_deref()
    }

    pub fn backing_format(&self) -> Option<&'static str> {
        self.backing_format
    }

    fn cs(&self) -> u64 {
        self.header.cluster_size()
    }

    fn entry(&self, cluster: u64) -> Result<l2::Entry> {
        self.l2.entry(&self.base.files[0], &self.base.path, cluster)
    }

    /// What the unit holding `pos` reads as, and where that unit ends.
    fn unit_at(&self, pos: u64) -> Result<(Unit, u64, u64)> {
        let cs = self.cs();
        let c = pos / cs;
        let e = self.entry(c)?;
        let unit_size = cs / self.l2.units();
        let u = (pos - c * cs) / unit_size;
        let start = c * cs + u * unit_size;
        Ok((self.l2.unit(e, u), start, (start + unit_size).min(self.header.size)))
    }

    /// Appends the extents of `len` bytes at `pos` of the backing image (zeros
    /// past its end, or without one), its file numbers moved past ours.
    fn map_backing(&self, pos: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let inside = match &self.backing {
            Some(b) if pos < b.size() => {
                let n = len.min(b.size() - pos);
                let mut tmp = Vec::new();
                b.map_read(pos, n, &mut tmp)?;
                for e in tmp {
                    push(out, shift(e));
                }
                n
            }
            _ => 0,
        };
        if inside < len {
            push(out, Extent::Zero { len: len - inside });
        }
        Ok(())
    }

    /// Data at `host` in file 0: the part past the file's end reads as zeros
    /// (a cluster this process allocated and has not written to the end).
    fn push_host(&self, out: &mut Vec<Extent>, host: u64, len: u64) {
        let flen = self.file_len.load(Ordering::Acquire);
        let data = flen.saturating_sub(host).min(len);
        if data > 0 {
            push(out, Extent::Data { file: 0, offset: host, len: data });
        }
        if data < len {
            push(out, Extent::Zero { len: len - data });
        }
    }

    /// The inflated copy of the compressed cluster holding `pos`: its offset
    /// in the last file.
    fn inflate(&self, pos: u64, at: u64, len: u64) -> Result<u64> {
        let cs = self.cs();
        let cache = self.base.files.len() - 1;
        let image = (&self.base.files[0], self.base.path.as_path(), self.file_len.load(Ordering::Acquire));
        let slot = self.inflated.get(image, &self.base.files[cache], pos / cs, at, len)?;
        Ok(slot + pos % cs)
    }
}

/// An extent of the backing image, as one of ours.
fn shift(e: Extent) -> Extent {
    match e {
        Extent::Data { file, offset, len } => Extent::Data { file: file + 1, offset, len },
        z => z,
    }
}

/// Appends `e`, merging it into the last extent when they are contiguous.
fn push(out: &mut Vec<Extent>, e: Extent) {
    if e.is_empty() {
        return;
    }
    match (out.last_mut(), e) {
        (Some(Extent::Zero { len }), Extent::Zero { len: n }) => *len += n,
        (Some(Extent::Data { file, offset, len }), Extent::Data { file: f, offset: o, len: n })
            if *file == f && *offset + *len == o =>
        {
            *len += n
        }
        _ => out.push(e),
    }
}

fn push_alloc(out: &mut Vec<Allocation>, base: usize, a: Allocation) -> bool {
    let n = out.len();
    match out.last_mut() {
        Some(l) if n > base && (l.hole, l.zero, l.depth) == (a.hole, a.zero, a.depth) => l.len += a.len,
        _ => out.push(a),
    }
    true
}

impl Image for Qcow2Image {
    fn bitmap_store(&self) -> Option<&dyn crate::bitmap::BitmapStore> {
        Some(self)
    }

    fn format(&self) -> &'static str {
        "qcow2"
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    fn file_path(&self, file: usize) -> &Path {
        match (&self.backing, file) {
            (Some(b), f) if f > 0 && f < self.base.files.len() - 1 => b.file_path(f - 1),
            _ => &self.base.path,
        }
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let end = offset + len;
        let mut pos = offset;
        // A run of units that read from the backing image, mapped in one call.
        let mut backing_from: Option<u64> = None;
        while pos < end {
            let (unit, start, unit_end) = self.unit_at(pos)?;
            let stop = unit_end.min(end);
            if unit == Unit::Backing {
                backing_from.get_or_insert(pos);
                pos = stop;
                continue;
            }
            if let Some(from) = backing_from.take() {
                self.map_backing(from, pos - from, out)?;
            }
            match unit {
                Unit::Data(host) => self.push_host(out, host + (pos - start), stop - pos),
                Unit::Zero => push(out, Extent::Zero { len: stop - pos }),
                Unit::Compressed { at, len } => {
                    let slot = self.inflate(pos, at, len)?;
                    push(out, Extent::Data { file: self.base.files.len() - 1, offset: slot, len: stop - pos });
                }
                Unit::Backing => unreachable!("handled above"),
            }
            pos = stop;
        }
        if let Some(from) = backing_from {
            self.map_backing(from, end - from, out)?;
        }
        Ok(())
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let cs = self.cs();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let c = pos / cs;
            let stop = ((c + 1) * cs).min(end);
            let host = self.claimed_host(c, pos, stop - pos)?;
            push(out, Extent::Data { file: 0, offset: host + (pos - c * cs), len: stop - pos });
            pos = stop;
        }
        Ok(())
    }

    fn prepare_write(&self, offset: u64, len: u64) -> Result<()> {
        self.claim_range(offset, len)
    }

    /// Nothing to undo: a claim's units were filled with the old data before
    /// the failed write was mapped, so the range reads as before or partly as
    /// the failed write's data, whichever write publishes the claim.
    fn write_failed(&self, _offset: u64, _len: u64) {}

    fn write_done(&self, offset: u64, len: u64, durable: bool) -> Result<()> {
        self.publish_range(offset, len)?;
        if durable {
            self.sync_metadata()?;
        }
        Ok(())
    }

    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        let base = out.len();
        let end = offset + len;
        let mut pos = offset;
        let mut window = crate::window::BackingWindow::default();
        let mut tmp = Vec::new();
        while pos < end && out.len() - base < max {
            let (unit, _, unit_end) = self.unit_at(pos)?;
            let stop = unit_end.min(end);
            let a = |hole, zero, depth| Allocation { len: stop - pos, hole, zero, depth };
            match unit {
                Unit::Data(_) | Unit::Compressed { .. } => push_alloc(out, base, a(false, false, 1)),
                Unit::Zero => push_alloc(out, base, a(true, true, 1)),
                Unit::Backing => match &self.backing {
                    Some(b) if pos < b.size() => {
                        let n = (stop - pos).min(b.size() - pos);
                        tmp.clear();
                        let limit = end.min(b.size());
                        let got =
                            window.take(pos, n, limit, |at, l, m, runs| b.allocation(at, l, m, runs), &mut tmp)?;
                        tmp.drain(..).for_each(|a| _ = push_alloc(out, base, a.one_deeper()));
                        if out.len() - base > max {
                            out.truncate(base + max);
                            return Ok(());
                        }
                        if got < n {
                            return Ok(());
                        }
                        if n < stop - pos {
                            // Zeros past a short backing image's end count as
                            // held by it, as qemu counts them.
                            push_alloc(out, base, Allocation { len: stop - pos - n, hole: true, zero: true, depth: 2 });
                        }
                        true
                    }
                    Some(_) => push_alloc(out, base, a(true, true, 2)),
                    None => push_alloc(out, base, a(true, true, 0)),
                },
            };
            pos = stop;
        }
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64, _trim: bool, no_hole: bool) -> Result<Vec<(u64, u64)>> {
        // A TRIM reads back as zeros too, as on raw images (the engine punches
        // what is left, the partial clusters).
        self.zero_clusters(offset, len, !no_hole)
    }

    fn sync_metadata(&self) -> Result<()> {
        // Refcounts dropped by a round reach the disk in the next one.
        if self.sync_round()? {
            self.sync_round()?;
        }
        Ok(())
    }
}
