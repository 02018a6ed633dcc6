//! `CowMap`: the overlay's bitmap in memory, one bit per sector, shared by
//! every thread of a device without a lock.
//!
//! Three views of it:
//! - `live`: what reads map by. A bit is set (atomically, per 64-bit word)
//!   once the sector's data is in the overlay file, never cleared.
//! - `persisted`: what the on-disk bitmap is known to hold durably, so a FUA
//!   write to sectors already allocated on disk needs no metadata write.
//! - `dirty`: which bitmap blocks ([`BLOCK`] bytes of the on-disk bitmap)
//!   have bits in `live` that may not be on disk yet.
//!
//! The on-disk order is bytes, bit n at byte n / 8, position n % 8 (least
//! significant first). A little-endian u64 of eight such bytes has bit n % 64
//! at position n % 64, so word w serialises as `to_le_bytes` at byte 8 * w.
//!
//! It owns no file and does no I/O: the image writes what [`CowMap::take_dirty`]
//! and [`CowMap::block_bytes`] hand it.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of on-disk bitmap per dirty mark (one page: 32768 sectors, 16 MiB of
/// disk at 512-byte sectors).
pub const BLOCK: u64 = 4096;
const WORDS_PER_BLOCK: usize = (BLOCK / 8) as usize;

pub struct CowMap {
    sectors: u64,
    /// On-disk bytes of bitmap (the last block may be short).
    len: u64,
    live: Vec<AtomicU64>,
    persisted: Vec<AtomicU64>,
    dirty: Vec<AtomicU64>,
}

fn words_of(bytes: &[u8], n: usize) -> Vec<AtomicU64> {
    (0..n)
        .map(|w| {
            let mut a = [0u8; 8];
            let start = (w * 8).min(bytes.len());
            let end = (w * 8 + 8).min(bytes.len());
            a[..end - start].copy_from_slice(&bytes[start..end]);
            AtomicU64::new(u64::from_le_bytes(a))
        })
        .collect()
}

/// The bits of word `w` that fall in sectors [start, end).
fn mask(w: u64, start: u64, end: u64) -> u64 {
    let lo = start.max(w * 64) - w * 64;
    let hi = end.min(w * 64 + 64) - w * 64;
    if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    }
}

impl CowMap {
    /// The map of `sectors` sectors from the on-disk bitmap `bytes` (exactly
    /// its length: `ceil(sectors / 8)`). Stray bits past the last sector are
    /// kept (and written back as they were) but never read.
    pub fn from_bytes(bytes: &[u8], sectors: u64) -> CowMap {
        let len = bytes.len() as u64;
        let n = len.div_ceil(8) as usize;
        let blocks = len.div_ceil(BLOCK) as usize;
        CowMap {
            sectors,
            len,
            live: words_of(bytes, n),
            persisted: words_of(bytes, n),
            dirty: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Whether sector `s` is in the overlay.
    pub fn get(&self, s: u64) -> bool {
        self.live[(s / 64) as usize].load(Ordering::Acquire) & (1 << (s % 64)) != 0
    }

    /// The state of sector `start` and where the run of sectors with that
    /// state ends (exclusive, at most `end`). Word at a time.
    pub fn run(&self, start: u64, end: u64) -> (bool, u64) {
        debug_assert!(start < end && end <= self.sectors);
        let set = self.get(start);
        let mut pos = start;
        while pos < end {
            let w = pos / 64;
            let word = self.live[w as usize].load(Ordering::Acquire);
            // Bits that differ from the run's state, from `pos` on.
            let differ = if set { !word } else { word } & (u64::MAX << (pos % 64));
            if differ != 0 {
                return (set, (w * 64 + differ.trailing_zeros() as u64).min(end));
            }
            pos = w * 64 + 64;
        }
        (set, end)
    }

    /// Sets sectors [start, end) and marks their blocks dirty; true when any
    /// bit was new.
    pub fn set(&self, start: u64, end: u64) -> bool {
        debug_assert!(start <= end && end <= self.sectors);
        let mut changed = false;
        if start >= end {
            return false;
        }
        for w in start / 64..=(end - 1) / 64 {
            let m = mask(w, start, end);
            let old = self.live[w as usize].fetch_or(m, Ordering::SeqCst);
            if old & m != m {
                changed = true;
                // After the bit: a flush that takes this mark sees the bit.
                let block = w as usize / WORDS_PER_BLOCK;
                self.dirty[block / 64].fetch_or(1 << (block % 64), Ordering::SeqCst);
            }
        }
        changed
    }

    /// Whether every sector of [start, end) is set in the durable bitmap.
    pub fn persisted(&self, start: u64, end: u64) -> bool {
        (start / 64..=(end.max(start + 1) - 1) / 64).all(|w| {
            let m = mask(w, start, end);
            self.persisted[w as usize].load(Ordering::Acquire) & m == m
        })
    }

    /// Sectors set in [start, end).
    pub fn count(&self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        (start / 64..=(end - 1) / 64)
            .map(|w| (self.live[w as usize].load(Ordering::Acquire) & mask(w, start, end)).count_ones() as u64)
            .sum()
    }

    /// Takes every dirty mark: the blocks to write, in order.
    pub fn take_dirty(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, d) in self.dirty.iter().enumerate() {
            let mut bits = d.swap(0, Ordering::SeqCst);
            while bits != 0 {
                out.push(i as u64 * 64 + bits.trailing_zeros() as u64);
                bits &= bits - 1;
            }
        }
        out
    }

    /// Puts a dirty mark back (its write failed).
    pub fn redirty(&self, block: u64) {
        self.dirty[(block / 64) as usize].fetch_or(1 << (block % 64), Ordering::SeqCst);
    }

    /// Where block `b` starts in the on-disk bitmap, and its bytes as they are now.
    pub fn block_bytes(&self, b: u64) -> (u64, Vec<u8>) {
        let start = b * BLOCK;
        let end = (start + BLOCK).min(self.len);
        let first = b as usize * WORDS_PER_BLOCK;
        let words = (end - start).div_ceil(8) as usize;
        let mut out = Vec::with_capacity(words * 8);
        for w in &self.live[first..first + words] {
            out.extend_from_slice(&w.load(Ordering::SeqCst).to_le_bytes());
        }
        out.truncate((end - start) as usize);
        (start, out)
    }

    /// Records that block `b` with `bytes` (from [`Self::block_bytes`]) is durable.
    pub fn mark_persisted(&self, b: u64, bytes: &[u8]) {
        let first = b as usize * WORDS_PER_BLOCK;
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut a = [0u8; 8];
            a[..chunk.len()].copy_from_slice(chunk);
            self.persisted[first + i].fetch_or(u64::from_le_bytes(a), Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(m: &CowMap, start: u64, end: u64) -> Vec<(bool, u64, u64)> {
        let mut out = Vec::new();
        let mut pos = start;
        while pos < end {
            let (set, e) = m.run(pos, end);
            out.push((set, pos, e));
            pos = e;
        }
        out
    }

    #[test]
    fn bit_order_is_bytes_lsb_first() {
        // Sector 0, 9 and 70 set, as UML's ubd_set_bit would.
        let mut bytes = vec![0u8; 10];
        bytes[0] = 0b0000_0001;
        bytes[1] = 0b0000_0010;
        bytes[8] = 0b0100_0000;
        let m = CowMap::from_bytes(&bytes, 80);
        let set: Vec<u64> = (0..80).filter(|&s| m.get(s)).collect();
        assert_eq!(set, [0, 9, 70]);
        assert_eq!(m.block_bytes(0), (0, bytes));
    }

    #[test]
    fn runs_cross_words_and_stop_at_the_end() {
        let m = CowMap::from_bytes(&[0u8; 40], 317);
        assert_eq!(runs(&m, 0, 317), [(false, 0, 317)]);
        assert!(m.set(5, 200));
        assert!(!m.set(5, 200), "nothing new");
        m.set(316, 317);
        assert_eq!(runs(&m, 0, 317), [(false, 0, 5), (true, 5, 200), (false, 200, 316), (true, 316, 317)]);
        assert_eq!(runs(&m, 64, 130), [(true, 64, 130)]);
        assert_eq!(runs(&m, 199, 201), [(true, 199, 200), (false, 200, 201)]);
        assert_eq!(m.count(0, 317), 196);
        assert_eq!(m.count(100, 101), 1);
        // Everything from 0 to 320 set, but only 317 sectors exist.
        m.set(0, 317);
        assert_eq!(runs(&m, 0, 317), [(true, 0, 317)]);
    }

    #[test]
    fn stray_bits_past_the_end_are_kept_but_not_read() {
        let m = CowMap::from_bytes(&[0b1110_0000], 5);
        assert_eq!(runs(&m, 0, 5), [(false, 0, 5)]);
        assert_eq!(m.count(0, 5), 0);
        m.set(0, 5);
        assert_eq!(m.block_bytes(0).1, [0xff]);
    }

    #[test]
    fn dirty_blocks_and_persistence() {
        let sectors = 3 * BLOCK * 8 + 100; // three full blocks and a short one
        let m = CowMap::from_bytes(&vec![0u8; sectors.div_ceil(8) as usize], sectors);
        assert!(m.take_dirty().is_empty());
        m.set(10, 20);
        m.set(BLOCK * 8 * 3 + 1, BLOCK * 8 * 3 + 2);
        assert_eq!(m.take_dirty(), [0, 3]);
        assert!(m.take_dirty().is_empty());
        assert!(!m.persisted(10, 20));
        let (at, bytes) = m.block_bytes(3);
        assert_eq!((at, bytes.len()), (3 * BLOCK, 13));
        assert_eq!(bytes[0], 0b10);
        let (_, b0) = m.block_bytes(0);
        m.mark_persisted(0, &b0);
        assert!(m.persisted(10, 20));
        assert!(!m.persisted(10, 21));
        m.redirty(2);
        assert_eq!(m.take_dirty(), [2]);
        // A write of bits already set marks nothing.
        m.set(12, 14);
        assert!(m.take_dirty().is_empty());
    }

    #[test]
    fn concurrent_sets_lose_nothing() {
        let m = std::sync::Arc::new(CowMap::from_bytes(&[0u8; 1024], 8192));
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for s in (t..8192).step_by(8) {
                        m.set(s, s + 1);
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(m.count(0, 8192), 8192);
    }
}
