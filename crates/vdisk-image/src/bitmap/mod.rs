//! Dirty bitmaps: which parts of a disk were written since a point in time.
//!
//! What it owns: [`DirtyBitmap`], one bit per `granularity` bytes of the disk,
//! kept in atomic 64-bit words so that marking a write is a few `fetch_or`s
//! and never takes a lock (the engine marks every enabled bitmap of a device
//! on each write); clearing, merging, counting, and walking dirty and clean
//! runs (what NBD block status and a backup read). The same type is the dirty
//! map of a copy job (mirror, active commit): [`DirtyBitmap::take_next`]
//! takes and clears the next dirty run, so a pass copies what was dirty and a
//! write that lands meanwhile dirties its range again for the next pass.
//!
//! Where bitmaps persist is elsewhere: qcow2 images keep them in qemu's
//! format (`qcow2::bitmaps`), other images in a sidecar file ([`sidecar`]);
//! [`store`] is the one interface over both. This module does no I/O.
//!
//! What it must never do: lose a bit set before a `take_next`/`clear` began
//! that the caller did not get back (a clear of a word is one atomic
//! `fetch_and`, so a concurrent set either lands before it and is returned,
//! or after it and stays).

pub mod sidecar;
pub mod store;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{Error, Result};

pub use store::{BitmapStore, StoredBitmap};

/// The granularity of a bitmap nobody chose one for.
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;
/// Granularities accepted: powers of two in this range (qemu's limits).
pub const MIN_GRANULARITY: u64 = 512;
pub const MAX_GRANULARITY: u64 = 1 << 31;

/// One bit per `granularity` bytes of a disk of `size` bytes.
pub struct DirtyBitmap {
    size: u64,
    shift: u32,
    words: Box<[AtomicU64]>,
    enabled: AtomicBool,
}

impl std::fmt::Debug for DirtyBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyBitmap")
            .field("size", &self.size)
            .field("granularity", &self.granularity())
            .field("enabled", &self.enabled())
            .field("dirty", &self.count())
            .finish()
    }
}

/// Checks a granularity given by a user or read from a file.
pub fn check_granularity(g: u64) -> Result<()> {
    if !g.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) {
        return Err(Error::invalid(format!(
            "bitmap granularity {g} is not a power of two between {MIN_GRANULARITY} and {MAX_GRANULARITY} bytes \
             (64K, the default, suits most uses)"
        )));
    }
    Ok(())
}

impl DirtyBitmap {
    /// An empty, enabled bitmap of a disk of `size` bytes.
    pub fn new(size: u64, granularity: u64) -> Result<Self> {
        check_granularity(granularity)?;
        let shift = granularity.trailing_zeros();
        let bits = size.div_ceil(granularity);
        let zeros: Box<[u64]> = vec![0u64; bits.div_ceil(64) as usize].into_boxed_slice();
        // SAFETY: AtomicU64 has the same size and alignment as u64 (its
        // documented guarantee) and every bit pattern is valid for both; the
        // box's memory moves over whole. (A zeroed Vec is calloc'ed: the
        // pages of a large bitmap are only touched once written.)
        let words = unsafe { Box::from_raw(Box::into_raw(zeros) as *mut [AtomicU64]) };
        Ok(DirtyBitmap { size, shift, words, enabled: AtomicBool::new(true) })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    /// The number of bits (granules) the bitmap has.
    pub fn bits(&self) -> u64 {
        self.size.div_ceil(self.granularity())
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// A disabled bitmap keeps its bits but [`DirtyBitmap::record_write`] leaves it alone.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Release)
    }

    /// The granules `offset..offset+len` touches (clipped at the disk's end).
    fn granules(&self, offset: u64, len: u64) -> (u64, u64) {
        let end = offset.saturating_add(len).min(self.size);
        if len == 0 || offset >= end {
            return (0, 0);
        }
        (offset >> self.shift, (end - 1) >> self.shift)
    }

    /// The write path's call: marks `len` bytes at `offset` dirty if the
    /// bitmap is enabled. Lock-free: one `fetch_or` per 64 granules touched
    /// (one, for a request smaller than 64 granules that does not cross a
    /// word; none when they are dirty already).
    ///
    /// Call it once the write (or TRIM, WRITE_ZEROES; a failed one too) has
    /// reached the image and before it is acknowledged: then a copy job's
    /// [`DirtyBitmap::take_next`] either runs after the mark, and its read
    /// sees the new data, or before it, and the range stays dirty for the
    /// next pass. (Marked before the data landed, a take in between would
    /// clear the bit, copy the old data, and lose the write.)
    #[inline]
    pub fn record_write(&self, offset: u64, len: u64) {
        if self.enabled.load(Ordering::Relaxed) {
            self.set(offset, len);
        }
    }

    /// Marks the granules that `len` bytes at `offset` touch dirty, enabled or not.
    pub fn set(&self, offset: u64, len: u64) {
        let (first, last) = self.granules(offset, len);
        if len == 0 || offset >= self.size {
            return;
        }
        self.update_bits(first, last, true);
    }

    /// Marks the granules wholly inside `len` bytes at `offset` clean (a
    /// granule only partly covered stays as it is; the disk's last, short
    /// granule counts as whole when the range reaches the disk's end).
    pub fn clear(&self, offset: u64, len: u64) {
        let g = self.granularity();
        let end = offset.saturating_add(len).min(self.size);
        let first = offset.div_ceil(g);
        let stop = if end == self.size { self.bits() } else { end / g };
        if first < stop {
            self.update_bits(first, stop - 1, false);
        }
    }

    /// Marks every granule clean.
    pub fn clear_all(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::Release);
        }
    }

    /// Sets (`on`) or clears bits `first..=last`, a word at a time.
    fn update_bits(&self, first: u64, last: u64, on: bool) {
        let (fw, lw) = ((first / 64) as usize, (last / 64) as usize);
        for w in fw..=lw {
            let lo = if w == fw { first % 64 } else { 0 };
            let hi = if w == lw { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            if on {
                // Already dirty (a hot region): no read-modify-write, so
                // writers to one region do not bounce its cache line.
                if self.words[w].load(Ordering::Acquire) & mask != mask {
                    self.words[w].fetch_or(mask, Ordering::AcqRel);
                }
            } else {
                self.words[w].fetch_and(!mask, Ordering::AcqRel);
            }
        }
    }

    /// True when granule `bit` is dirty.
    pub fn get_bit(&self, bit: u64) -> bool {
        bit < self.bits() && self.words[(bit / 64) as usize].load(Ordering::Acquire) & (1 << (bit % 64)) != 0
    }

    /// True when the granule holding byte `offset` is dirty.
    pub fn is_dirty(&self, offset: u64) -> bool {
        offset < self.size && self.get_bit(offset >> self.shift)
    }

    /// The number of dirty granules.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.load(Ordering::Acquire).count_ones() as u64).sum()
    }

    /// The bytes the dirty granules cover (the last, short granule counts its real length).
    pub fn dirty_bytes(&self) -> u64 {
        let mut n = self.count() << self.shift;
        let last = self.bits().saturating_sub(1);
        if self.get_bit(last) {
            n -= (self.bits() << self.shift) - self.size;
        }
        n
    }

    /// Adds every dirty range of `other` (same disk size, any granularity).
    pub fn merge(&self, other: &DirtyBitmap) -> Result<()> {
        if other.size != self.size {
            return Err(Error::invalid(format!(
                "cannot merge a bitmap of a {}-byte disk into one of a {}-byte disk",
                other.size, self.size
            )));
        }
        if other.shift == self.shift {
            for (a, b) in self.words.iter().zip(other.words.iter()) {
                a.fetch_or(b.load(Ordering::Acquire), Ordering::AcqRel);
            }
            return Ok(());
        }
        let mut at = 0;
        while let Some((start, len)) = other.next_run(at, self.size - at, true) {
            self.set(start, len);
            at = start + len;
        }
        Ok(())
    }

    /// The first granule at or after `bit` (below `limit`) whose state is
    /// `dirty`; `limit` when there is none.
    fn find(&self, bit: u64, limit: u64, dirty: bool) -> u64 {
        let mut b = bit;
        while b < limit {
            let w = self.words[(b / 64) as usize].load(Ordering::Acquire);
            let w = if dirty { w } else { !w } >> (b % 64);
            if w != 0 {
                return (b + w.trailing_zeros() as u64).min(limit);
            }
            b = (b / 64 + 1) * 64;
        }
        limit
    }

    /// The first run of granules in state `dirty` that meets `len` bytes at
    /// `offset`, as a byte range clipped to that window; None if there is none.
    pub fn next_run(&self, offset: u64, len: u64, dirty: bool) -> Option<(u64, u64)> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return None;
        }
        let limit = self.bits();
        let start_bit = self.find(offset >> self.shift, limit, dirty);
        if start_bit >= limit {
            return None;
        }
        let start = (start_bit << self.shift).max(offset);
        if start >= end {
            return None;
        }
        let stop_bit = self.find(start_bit, limit, !dirty);
        let stop = (stop_bit << self.shift).min(end);
        Some((start, stop - start))
    }

    /// The runs of `len` bytes at `offset`, in order, as (length, dirty), at
    /// most `max` of them (the last may then end early: ask again from there).
    /// What a block-status reply of the `qemu:dirty-bitmap:` context carries.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Vec<(u64, bool)> {
        let end = offset.saturating_add(len).min(self.size);
        let mut out = Vec::new();
        let mut at = offset;
        while at < end && out.len() < max {
            let dirty = self.is_dirty(at);
            let stop = self.next_run(at, end - at, !dirty).map_or(end, |(s, _)| s);
            out.push((stop - at, dirty));
            at = stop;
        }
        out
    }

    /// Takes the next dirty run at or after `from`, at most `max` bytes,
    /// and marks it clean; None when nothing from `from` on is dirty. The
    /// run starts and ends on granule boundaries (the end clipped at the
    /// disk's end). A copy job's pass: take, copy, repeat; writes that land
    /// after the take dirty their granules again for the next pass.
    pub fn take_next(&self, from: u64, max: u64) -> Option<(u64, u64)> {
        self.take_within(from, self.size.saturating_sub(from), max)
    }

    /// [`DirtyBitmap::take_next`] within the granules that meet `len` bytes
    /// at `offset`: None when none of them is dirty. What a synchronous
    /// mirror takes to copy one write's range.
    pub fn take_within(&self, offset: u64, len: u64, max: u64) -> Option<(u64, u64)> {
        let g = self.granularity();
        let start = offset / g * g;
        let end = offset.saturating_add(len).min(self.size).div_ceil(g).saturating_mul(g);
        let (start, len) = self.next_run(start, end.saturating_sub(start), true)?;
        let len = len.min((max / g).max(1) * g);
        self.clear(start, len);
        Some((start, len))
    }

    /// The bits `first..first + 8 * out.len()` into `out`, bit `k` in byte
    /// `k / 8` at bit `k % 8` (qemu's on-disk order); bits past the end are 0.
    pub fn export_bits(&self, first: u64, out: &mut [u8]) {
        debug_assert!(first.is_multiple_of(64));
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let w = (first / 64) as usize + i;
            let v = self.words.get(w).map_or(0, |x| x.load(Ordering::Acquire));
            chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
        }
    }

    /// Sets the bits `first..first + 8 * bytes.len()` from `bytes` (the order
    /// of [`DirtyBitmap::export_bits`]); bits past the end are ignored.
    pub fn import_bits(&self, first: u64, bytes: &[u8]) {
        debug_assert!(first.is_multiple_of(64));
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let w = (first / 64) as usize + i;
            let Some(word) = self.words.get(w) else { break };
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            let mut v = u64::from_le_bytes(b);
            if w == self.words.len() - 1 && !self.bits().is_multiple_of(64) {
                v &= (1u64 << (self.bits() % 64)) - 1;
            }
            word.fetch_or(v, Ordering::AcqRel);
        }
    }

    /// Sets every bit `first..first + n` (an all-ones cluster of a stored bitmap).
    pub fn set_bits(&self, first: u64, n: u64) {
        let last = (first + n).min(self.bits());
        if first < last {
            self.update_bits(first, last - 1, true);
        }
    }

    /// A new bitmap with the same size, granularity, state and bits.
    pub fn duplicate(&self) -> DirtyBitmap {
        let copy = DirtyBitmap::new(self.size, self.granularity()).expect("a checked granularity");
        copy.merge(self).expect("same size");
        copy.set_enabled(self.enabled());
        copy
    }
}
