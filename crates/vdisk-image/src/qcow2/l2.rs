//! The L1/L2 mapping cache: where each guest cluster (or subcluster, with
//! extended L2 entries) of a qcow2 image lives, held in memory.
//!
//! What it owns: the L1 table and the L2 tables read so far, as atomic words
//! behind one lock per table (a lookup takes it shared: a write into an
//! allocated cluster costs an uncontended read lock and an atomic load more
//! than raw; there is no lock over all tables), the decoding of L2
//! descriptors, the validation of every entry when a table is read, which
//! tables changed since they were last written, and the cap: past it, clean
//! tables that no metadata round is writing are evicted and read again when
//! needed (by default every table fits, up to [`L2_CACHE_CAP`]).
//!
//! What it must never do: write a file (the write path decides when tables
//! reach the disk, see `write.rs`), hand out a host offset it has not
//! checked (aligned, inside the file, not one of the image's own metadata
//! clusters), evict a table whose changes are not on disk, or panic on
//! whatever a table holds.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use super::header::Header;
use crate::{Error, ErrorKind, Result};

/// Bits 9..=55 of an L1 entry or standard L2 descriptor: the host offset.
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
pub const COPIED: u64 = 1 << 63;
pub const COMPRESSED: u64 = 1 << 62;
pub const ZERO: u64 = 1;
/// Subclusters per cluster with extended L2 entries.
pub const SUBCLUSTERS: u64 = 32;
/// The subcluster bitmap of a fully allocated cluster.
pub const ALL_ALLOCATED: u64 = 0xffff_ffff;

/// A changed L2 table to write: L1 index, host offset, contents.
pub type TableBytes = (usize, u64, Vec<u8>);

/// What one unit (a cluster, or a subcluster with extended L2) reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// In this image's file at this host offset (of the unit's start).
    Data(u64),
    /// Zeros, stored nowhere.
    Zero,
    /// Whatever the backing file holds there (zeros without one).
    Backing,
    /// A compressed cluster: `len` bytes at host offset `at`.
    Compressed { at: u64, len: u64 },
}

/// The raw L2 entry of one guest cluster: descriptor and subcluster bitmap
/// (0 without extended L2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    pub desc: u64,
    pub bitmap: u64,
}

impl Entry {
    pub fn host(&self) -> u64 {
        self.desc & OFFSET_MASK
    }

    pub fn compressed(&self) -> bool {
        self.desc & COMPRESSED != 0
    }
}

pub struct L2Cache {
    cluster_bits: u32,
    l2_entries: u64,
    extended: bool,
    zero_flag: bool,
    /// Bits of a compressed descriptor's host offset.
    compressed_bits: u32,
    l1: Box<[AtomicU64]>,
    /// The L2 tables in memory, one lock each (never one for all): lookups
    /// take it shared; only loading and evicting a table take it alone.
    tables: Box<[RwLock<Option<Table>>]>,
    dirty: Box<[AtomicBool]>,
    /// Taken by a metadata round and not yet on disk: never evicted.
    pinned: Box<[AtomicBool]>,
    /// Bytes of L2 tables in memory, and the most there may be.
    cached: AtomicU64,
    cap: u64,
    /// Where eviction looks next (a clock hand over the L1 indices).
    hand: Mutex<usize>,
    dirty_list: Mutex<Vec<usize>>,
    l1_dirty: AtomicBool,
    /// The file's length (as opened, then as this process grew it): entries
    /// pointing past it are corrupt.
    file_len: AtomicU64,
    /// Host offsets of the metadata clusters at open (header, tables, blocks).
    metadata: HashSet<u64>,
}

type Table = Box<[AtomicU64]>;

/// The most memory the L2 tables of one image take by default; an image
/// whose tables all fit is cached whole (1 TiB with 64 KiB clusters: 128 MiB).
pub const L2_CACHE_CAP: u64 = 256 << 20;

fn corrupt(path: &Path, msg: String) -> Error {
    Error::new(
        ErrorKind::Corrupt,
        format!("{}: {msg}; the image is damaged (`qemu-img check {}` says more)", path.display(), path.display()),
    )
}

impl L2Cache {
    /// A cache over the L1 table `l1` (entries as on disk, already checked by
    /// [`L2Cache::check_l1`]).
    pub fn new(h: &Header, l1: Vec<u64>, file_len: u64, metadata: HashSet<u64>, cap: u64) -> Self {
        let n = l1.len();
        L2Cache {
            cluster_bits: h.cluster_bits,
            l2_entries: h.l2_entries(),
            extended: h.extended_l2(),
            zero_flag: h.has_zero_flag(),
            compressed_bits: 62 - (h.cluster_bits - 8),
            l1: l1.into_iter().map(AtomicU64::new).collect(),
            tables: (0..n).map(|_| RwLock::new(None)).collect(),
            dirty: (0..n).map(|_| AtomicBool::new(false)).collect(),
            pinned: (0..n).map(|_| AtomicBool::new(false)).collect(),
            cached: AtomicU64::new(0),
            cap: cap.max(1 << h.cluster_bits),
            hand: Mutex::new(0),
            dirty_list: Mutex::new(Vec::new()),
            l1_dirty: AtomicBool::new(false),
            file_len: AtomicU64::new(file_len),
            metadata,
        }
    }

    /// Checks every L1 entry: an aligned offset inside the file that is not
    /// the header or another table.
    pub fn check_l1(h: &Header, l1: &[u64], file_len: u64, path: &Path) -> Result<()> {
        for (i, &e) in l1.iter().enumerate() {
            let at = e & OFFSET_MASK;
            if at == 0 {
                continue;
            }
            if !at.is_multiple_of(h.cluster_size()) || at >= file_len {
                return Err(corrupt(path, format!("L1 entry {i} points at {at:#x}, not a cluster of the file")));
            }
            let l1_end = h.l1_table_offset + h.l1_size as u64 * 8;
            if at < h.cluster_size() || (at >= h.l1_table_offset && at < l1_end) {
                return Err(corrupt(path, format!("L1 entry {i} points into the header or the L1 table")));
            }
        }
        Ok(())
    }

    fn stride(&self) -> usize {
        if self.extended {
            2
        } else {
            1
        }
    }

    pub fn l1_len(&self) -> usize {
        self.l1.len()
    }

    /// L1 index `i` names an L2 table (flag bits alone name none).
    pub fn has_table(&self, i: usize) -> bool {
        self.l1_entry(i) & OFFSET_MASK != 0
    }

    pub fn l1_entry(&self, i: usize) -> u64 {
        self.l1[i].load(Ordering::Acquire)
    }

    /// The file grew to `len` (clusters allocated since it was opened).
    pub fn grown(&self, len: u64) {
        self.file_len.fetch_max(len, Ordering::AcqRel);
    }

    fn read(&self, i: usize) -> RwLockReadGuard<'_, Option<Table>> {
        self.tables[i].read().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the L2 table of L1 index `i` into memory if it is not there.
    /// False when the L1 entry names no table. The read happens under the
    /// table's own lock, so a copy read from disk never replaces a newer one.
    fn load(&self, file: &File, path: &Path, i: usize) -> Result<bool> {
        let at = self.l1_entry(i) & OFFSET_MASK;
        if at == 0 {
            return Ok(false);
        }
        {
            let mut g = self.tables[i].write().unwrap_or_else(|e| e.into_inner());
            if g.is_some() {
                return Ok(true);
            }
            let mut bytes = vec![0u8; 1 << self.cluster_bits];
            file.read_exact_at(&mut bytes, at)
                .map_err(|e| Error::io(e, format!("cannot read the L2 table at {at:#x} of {}", path.display())))?;
            let words: Vec<u64> =
                bytes.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes"))).collect();
            self.check_table(&words, path, at)?;
            *g = Some(words.into_iter().map(AtomicU64::new).collect());
            self.cached.fetch_add(1 << self.cluster_bits, Ordering::AcqRel);
        }
        self.evict(i);
        Ok(true)
    }

    /// Drops clean tables (not dirty, not being written) from memory while
    /// more than the cap is cached, clock-wise, never `keep`. Whoever finds
    /// another thread evicting leaves it to that one.
    fn evict(&self, keep: usize) {
        let cs = 1u64 << self.cluster_bits;
        if self.cached.load(Ordering::Acquire) <= self.cap {
            return;
        }
        let Ok(mut hand) = self.hand.try_lock() else { return };
        let n = self.tables.len();
        for _ in 0..n {
            if self.cached.load(Ordering::Acquire) + cs <= self.cap {
                break;
            }
            let i = *hand;
            *hand = (i + 1) % n;
            let busy = |i: usize| self.dirty[i].load(Ordering::Acquire) || self.pinned[i].load(Ordering::Acquire);
            if i == keep || busy(i) {
                continue;
            }
            if let Ok(mut g) = self.tables[i].try_write() {
                if g.is_some() && !busy(i) {
                    *g = None;
                    self.cached.fetch_sub(cs, Ordering::AcqRel);
                }
            }
        }
    }

    /// Runs `f` on the L2 table of L1 index `i`, read first if need be;
    /// None when the L1 entry names no table.
    fn with_table<R>(&self, file: &File, path: &Path, i: usize, f: impl Fn(&[AtomicU64]) -> R) -> Result<Option<R>> {
        loop {
            if let Some(t) = self.read(i).as_ref() {
                return Ok(Some(f(t)));
            }
            // Read it (again, if another load evicted it meanwhile).
            if !self.load(file, path, i)? {
                return Ok(None);
            }
        }
    }

    fn check_table(&self, words: &[u64], path: &Path, table_at: u64) -> Result<()> {
        let cs = 1u64 << self.cluster_bits;
        for (k, e) in words.iter().step_by(self.stride()).enumerate() {
            let bad = |why: &str| corrupt(path, format!("L2 table at {table_at:#x}, entry {k}: {why}"));
            if e & COMPRESSED != 0 {
                let at = e & ((1u64 << self.compressed_bits) - 1);
                if at >= self.file_len.load(Ordering::Acquire) || self.extended && words[k * 2 + 1] != 0 {
                    return Err(bad("a compressed cluster outside the file"));
                }
                continue;
            }
            let host = e & OFFSET_MASK;
            if host == 0 {
                continue;
            }
            if !host.is_multiple_of(cs) {
                return Err(bad("a data cluster offset that is not cluster-aligned"));
            }
            if host >= self.file_len.load(Ordering::Acquire) || self.metadata.contains(&host) {
                return Err(bad(&format!("a data cluster at {host:#x}, outside the file or on its metadata")));
            }
        }
        Ok(())
    }

    fn index(&self, cluster: u64) -> (usize, usize) {
        ((cluster / self.l2_entries) as usize, (cluster % self.l2_entries) as usize * self.stride())
    }

    /// The entry of guest cluster `cluster` (all zero when it has no table).
    pub fn entry(&self, file: &File, path: &Path, cluster: u64) -> Result<Entry> {
        let (i, k) = self.index(cluster);
        let extended = self.extended;
        let e = self.with_table(file, path, i, |t| Entry {
            desc: t[k].load(Ordering::Acquire),
            bitmap: if extended { t[k + 1].load(Ordering::Acquire) } else { 0 },
        })?;
        Ok(e.unwrap_or_default())
    }

    /// Units per cluster: 32 subclusters with extended L2, else 1.
    pub fn units(&self) -> u64 {
        if self.extended {
            SUBCLUSTERS
        } else {
            1
        }
    }

    /// What unit `u` of a cluster with entry `e` reads as.
    pub fn unit(&self, e: Entry, u: u64) -> Unit {
        if e.compressed() {
            let at = e.desc & ((1u64 << self.compressed_bits) - 1);
            let sectors = (e.desc & !COMPRESSED & !COPIED) >> self.compressed_bits;
            let len = (sectors + 1) * 512 - (at & 511);
            return Unit::Compressed { at, len };
        }
        let unit_size = (1u64 << self.cluster_bits) / self.units();
        if self.extended {
            if e.bitmap & (1 << u) != 0 {
                return Unit::Data(e.host() + u * unit_size);
            }
            if e.bitmap & (1 << (32 + u)) != 0 {
                return Unit::Zero;
            }
            return Unit::Backing;
        }
        if self.zero_flag && e.desc & ZERO != 0 {
            return Unit::Zero;
        }
        match e.host() {
            0 => Unit::Backing,
            h => Unit::Data(h),
        }
    }

    /// The host cluster a write may go to in place: allocated, not shared
    /// (COPIED), not compressed, every unit holding data.
    pub fn writable(&self, e: Entry) -> Option<u64> {
        let host = self.reusable(e)?;
        if self.extended {
            return (e.bitmap & ALL_ALLOCATED == ALL_ALLOCATED).then_some(host);
        }
        (e.desc & ZERO == 0 || !self.zero_flag).then_some(host)
    }

    /// The host cluster a write touching `units` (a bit per unit) may go to
    /// in place: owned alone, and every unit touched holds data there.
    pub fn in_place(&self, e: Entry, units: u64) -> Option<u64> {
        if self.extended {
            let host = self.reusable(e)?;
            return (e.bitmap & units == units).then_some(host);
        }
        self.writable(e)
    }

    /// Unit `u` of a cluster this image owns holds its data in place.
    pub fn unit_valid(&self, e: Entry, u: u64) -> bool {
        self.in_place(e, 1 << u).is_some()
    }

    /// A host cluster this entry owns alone (it may read as zeros or, with
    /// extended L2, partly from the backing file): a write may fill it in place.
    pub fn reusable(&self, e: Entry) -> Option<u64> {
        (e.desc & COPIED != 0 && !e.compressed() && e.host() != 0).then_some(e.host())
    }

    /// The host clusters entry `e` refers to (a compressed cluster may span two).
    pub fn held(&self, e: Entry) -> Vec<u64> {
        let cs = 1u64 << self.cluster_bits;
        match self.unit(e, 0) {
            Unit::Compressed { at, len } => {
                let first = at / cs * cs;
                (first..at + len.max(1)).step_by(cs as usize).collect()
            }
            _ if e.host() != 0 && !e.compressed() => vec![e.host()],
            _ => Vec::new(),
        }
    }

    /// Points guest cluster `cluster` at `e` (its table read first if it was
    /// evicted). The table is marked dirty before its lock is let go, so it
    /// cannot be evicted with the change.
    pub fn set(&self, file: &File, path: &Path, cluster: u64, e: Entry) -> Result<()> {
        let (i, k) = self.index(cluster);
        let extended = self.extended;
        let done = self.with_table(file, path, i, |t| {
            if extended {
                t[k + 1].store(e.bitmap, Ordering::Release);
            }
            t[k].store(e.desc, Ordering::Release);
            self.mark(i);
        })?;
        done.ok_or_else(|| Error::new(ErrorKind::Corrupt, format!("L1 entry {i} names no L2 table that could be read")))
    }

    fn mark(&self, i: usize) {
        if !self.dirty[i].swap(true, Ordering::AcqRel) {
            self.dirty_list.lock().unwrap_or_else(|e| e.into_inner()).push(i);
        }
    }

    /// Installs a new, empty L2 table for L1 index `i` at host offset `at`.
    pub fn install(&self, i: usize, at: u64) {
        let words = (1usize << self.cluster_bits) / 8;
        {
            let mut g = self.tables[i].write().unwrap_or_else(|e| e.into_inner());
            if g.is_none() {
                self.cached.fetch_add(1 << self.cluster_bits, Ordering::AcqRel);
            }
            *g = Some((0..words).map(|_| AtomicU64::new(0)).collect());
            // The L1 entry before the dirty mark: a round that takes the
            // table must find where it goes (with the mark first, a round in
            // between wrote the new table at offset 0, over the header).
            self.l1[i].store(at | COPIED, Ordering::Release);
            self.l1_dirty.store(true, Ordering::Release);
            self.mark(i);
        }
        self.evict(i);
    }

    /// Takes the changed tables as bytes (host offset, contents) and, when
    /// the L1 table changed, its bytes. Changes made after a table's dirty
    /// mark is taken mark it again (it goes out once more next time).
    pub fn take_dirty(&self) -> (Option<Vec<u8>>, Vec<TableBytes>) {
        let l1 = self.l1_dirty.swap(false, Ordering::AcqRel).then(|| self.l1_bytes());
        let list = std::mem::take(&mut *self.dirty_list.lock().unwrap_or_else(|e| e.into_inner()));
        let mut out = Vec::with_capacity(list.len());
        for i in list {
            // Pinned before it is clean: evicted only once it is on disk (`written`).
            self.pinned[i].store(true, Ordering::Release);
            self.dirty[i].store(false, Ordering::Release);
            let g = self.read(i);
            let Some(t) = g.as_ref() else {
                log::error!("L2 table {i} was dirty but not in memory");
                continue;
            };
            let at = self.l1_entry(i) & OFFSET_MASK;
            if at == 0 {
                // Never written over the header; `install` names the table before
                // marking it. Marked again, so a later round still writes it.
                log::error!("L2 table {i} was dirty but has no place in the image yet");
                self.mark(i);
                continue;
            }
            let bytes = t.iter().flat_map(|w| w.load(Ordering::Acquire).to_be_bytes()).collect();
            out.push((i, at, bytes));
        }
        (l1, out)
    }

    /// The tables a round took are on disk (or marked dirty again): they may
    /// be evicted once clean.
    pub fn written(&self, tables: impl Iterator<Item = usize>) {
        tables.for_each(|i| self.pinned[i].store(false, Ordering::Release));
    }

    /// Marks tables (and the L1 table) changed again after a failed write.
    pub fn redirty(&self, l1: bool, tables: impl Iterator<Item = usize>) {
        if l1 {
            self.l1_dirty.store(true, Ordering::Release);
        }
        tables.for_each(|i| self.mark(i));
    }

    pub fn l1_bytes(&self) -> Vec<u8> {
        self.l1.iter().flat_map(|w| w.load(Ordering::Acquire).to_be_bytes()).collect()
    }
}
