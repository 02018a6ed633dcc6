//! Refcounts and cluster allocation of a qcow2 image.
//!
//! What it owns: the refcount table and the refcount blocks read so far (in
//! memory, any refcount width from 1 to 64 bits), which of them changed, and
//! where the next free host cluster is. Allocation only ever appends: new
//! clusters come from the end of the file, so a cluster is never reused
//! while something on disk may still point at it (a crash can only leak,
//! never double-use); refcounts drop only where `write.rs` says.
//!
//! What it must never do: write a file (the write path does, in the order
//! `write.rs` documents), allocate a cluster without counting it first, or
//! trust a refcount table entry it has not checked.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::header::{Header, MAX_HOST_OFFSET};
use crate::{Error, ErrorKind, Result};

/// A changed refcount block to write: block index, host offset, contents.
pub type BlockBytes = (u64, u64, Vec<u8>);

/// Bits 9..=63 of a refcount table entry.
const TABLE_MASK: u64 = !0x1ff;

pub struct Refcounts {
    cluster_bits: u32,
    bits: u32,
    table: Vec<u64>,
    blocks: HashMap<u64, Vec<u8>>,
    dirty: BTreeSet<u64>,
    table_dirty: bool,
    /// Where the table lives (or will, once the header names it).
    pub table_at: u64,
    /// Where the header on disk says the table is: (offset, clusters).
    pub on_disk: (u64, u32),
    /// The table moved: (offset, clusters) for the header, until it is written there.
    pub moved: Option<(u64, u32)>,
    /// The move a metadata round took and may be writing into the header
    /// now (set by the round, cleared once it is done): such a table may be
    /// named on disk, so its refcounts must not drop.
    pub header_pending: Option<(u64, u32)>,
    /// Where the next allocation goes: past everything in the file.
    next_free: u64,
}

/// Refcount `i` of a block with `bits`-wide entries.
pub fn get(block: &[u8], bits: u32, i: u64) -> u64 {
    match bits {
        1 | 2 | 4 => {
            let per = 8 / bits as u64;
            let byte = block[(i / per) as usize];
            let shift = (i % per) as u32 * bits;
            ((byte >> shift) & ((1u16 << bits) - 1) as u8) as u64
        }
        _ => {
            let n = bits as usize / 8;
            let at = i as usize * n;
            block[at..at + n].iter().fold(0u64, |v, &b| (v << 8) | b as u64)
        }
    }
}

/// Sets refcount `i` of a block with `bits`-wide entries (v fits in `bits`).
pub fn set(block: &mut [u8], bits: u32, i: u64, v: u64) {
    match bits {
        1 | 2 | 4 => {
            let per = 8 / bits as u64;
            let shift = (i % per) as u32 * bits;
            let mask = (((1u16 << bits) - 1) as u8) << shift;
            let byte = &mut block[(i / per) as usize];
            *byte = (*byte & !mask) | (((v as u8) << shift) & mask);
        }
        _ => {
            let n = bits as usize / 8;
            let at = i as usize * n;
            for (k, b) in block[at..at + n].iter_mut().enumerate() {
                *b = (v >> (8 * (n - 1 - k))) as u8;
            }
        }
    }
}

fn corrupt(path: &Path, msg: String) -> Error {
    Error::new(
        ErrorKind::Corrupt,
        format!(
            "{}: {msg}; the image is damaged (`qemu-img check -r all {}` may repair it)",
            path.display(),
            path.display()
        ),
    )
}

impl Refcounts {
    /// Reads and checks the refcount table; blocks are read when first needed.
    pub fn open(h: &Header, file: &File, path: &Path, file_len: u64) -> Result<Self> {
        let cs = h.cluster_size();
        let mut bytes = vec![0u8; (h.refcount_table_clusters as u64 * cs) as usize];
        file.read_exact_at(&mut bytes, h.refcount_table_offset)
            .map_err(|e| Error::io(e, format!("cannot read the refcount table of {}", path.display())))?;
        let table: Vec<u64> =
            bytes.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")) & TABLE_MASK).collect();
        for (i, &at) in table.iter().enumerate() {
            if at != 0 && (at % cs != 0 || at >= file_len) {
                return Err(corrupt(
                    path,
                    format!("refcount table entry {i} points at {at:#x}, not a cluster of the file"),
                ));
            }
        }
        Ok(Refcounts {
            cluster_bits: h.cluster_bits,
            bits: h.refcount_bits(),
            table,
            blocks: HashMap::new(),
            dirty: BTreeSet::new(),
            table_dirty: false,
            table_at: h.refcount_table_offset,
            on_disk: (h.refcount_table_offset, h.refcount_table_clusters),
            moved: None,
            header_pending: None,
            next_free: file_len.div_ceil(cs) * cs,
        })
    }

    pub fn table_entries(&self) -> impl Iterator<Item = u64> + '_ {
        self.table.iter().copied().filter(|&a| a != 0)
    }

    fn per_block(&self) -> u64 {
        (8u64 << self.cluster_bits) / self.bits as u64
    }

    pub fn next_free(&self) -> u64 {
        self.next_free
    }

    fn block(&mut self, file: &File, path: &Path, idx: u64) -> Result<Option<&mut Vec<u8>>> {
        let at = match self.table.get(idx as usize) {
            Some(&a) if a != 0 => a,
            _ => return Ok(None),
        };
        if !self.blocks.contains_key(&idx) {
            let mut b = vec![0u8; 1 << self.cluster_bits];
            file.read_exact_at(&mut b, at).map_err(|e| {
                Error::io(e, format!("cannot read the refcount block at {at:#x} of {}", path.display()))
            })?;
            self.blocks.insert(idx, b);
        }
        Ok(self.blocks.get_mut(&idx))
    }

    /// The refcount of the host cluster at `at`.
    pub fn get(&mut self, file: &File, path: &Path, at: u64) -> Result<u64> {
        let c = at >> self.cluster_bits;
        let (idx, i, bits) = (c / self.per_block(), c % self.per_block(), self.bits);
        Ok(self.block(file, path, idx)?.map_or(0, |b| get(b, bits, i)))
    }

    /// Drops one reference to the host cluster at `at` (its L2 entry on disk
    /// no longer names it). The cluster is never reused: allocation appends.
    pub fn release(&mut self, file: &File, path: &Path, at: u64) -> Result<()> {
        let v = self.get(file, path, at)?;
        if v > 0 {
            self.set_one(file, path, at, v - 1)?;
        }
        Ok(())
    }

    /// Takes `n` contiguous clusters from the end of the file and counts them
    /// (refcount 1), making new refcount blocks and a larger table as needed.
    pub fn allocate(&mut self, file: &File, path: &Path, n: u64) -> Result<u64> {
        let cs = 1u64 << self.cluster_bits;
        // A cluster past the file's end that a (damaged) table counts is skipped.
        while self.get(file, path, self.next_free)? != 0 {
            self.next_free += cs;
        }
        let at = self.next_free;
        if at + n * cs > MAX_HOST_OFFSET {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("{}: the image reached qcow2's size limit", path.display()),
            ));
        }
        self.next_free += n * cs;
        for k in 0..n {
            self.set_one(file, path, at + k * cs, 1)?;
        }
        Ok(at)
    }

    /// Sets the refcount of the host cluster at `at`.
    pub fn set_one(&mut self, file: &File, path: &Path, at: u64, v: u64) -> Result<()> {
        let c = at >> self.cluster_bits;
        let (idx, i, bits) = (c / self.per_block(), c % self.per_block(), self.bits);
        if idx as usize >= self.table.len() {
            self.grow_table(file, path, idx)?;
        }
        if self.table[idx as usize] == 0 {
            let cs = 1u64 << self.cluster_bits;
            let block_at = self.next_free;
            self.next_free += cs;
            self.table[idx as usize] = block_at;
            self.table_dirty = true;
            self.blocks.insert(idx, vec![0u8; cs as usize]);
            self.dirty.insert(idx);
            // The new block counts itself (it may fall in another block's range).
            self.set_one(file, path, block_at, 1)?;
        }
        let block = self.block(file, path, idx)?.expect("the block was just made");
        set(block, bits, i, v);
        self.dirty.insert(idx);
        Ok(())
    }

    /// Moves the table to the end of the file, large enough for block `idx`
    /// and for the clusters the move itself takes.
    fn grow_table(&mut self, file: &File, path: &Path, idx: u64) -> Result<()> {
        let cs = 1u64 << self.cluster_bits;
        let mut entries = (idx + 1).max(self.table.len() as u64) * 2;
        let clusters = (entries * 8).div_ceil(cs);
        entries = clusters * cs / 8;
        if clusters * cs > super::header::MAX_REFTABLE_BYTES {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("{}: the refcount table cannot grow further", path.display()),
            ));
        }
        let at = self.next_free;
        self.next_free += clusters * cs;
        // The table the header names is freed once the header names this one
        // (`write.rs`). One made since and replaced before any header named
        // it (grown twice between rounds) is named by nothing on disk: it is
        // freed now, its refcounts written with the new table's. Not if a
        // round in progress may be writing it into the header: that round
        // leaves it in `on_disk`, and the next one frees it.
        let intermediate = self.moved.filter(|&m| Some(m) != self.header_pending && m.0 != self.on_disk.0);
        self.table.resize(entries as usize, 0);
        self.table_dirty = true;
        self.table_at = at;
        self.moved = Some((at, clusters as u32));
        for k in 0..clusters {
            self.set_one(file, path, at + k * cs, 1)?;
        }
        if let Some((old, n)) = intermediate {
            for k in 0..n as u64 {
                self.set_one(file, path, old + k * cs, 0)?;
            }
        }
        Ok(())
    }

    /// The changed blocks (host offset, bytes) and, if it changed, the table's bytes.
    pub fn take_dirty(&mut self) -> (Vec<BlockBytes>, Option<Vec<u8>>) {
        let blocks = std::mem::take(&mut self.dirty)
            .into_iter()
            .map(|idx| (idx, self.table[idx as usize], self.blocks[&idx].clone()))
            .collect();
        let table = std::mem::take(&mut self.table_dirty).then(|| self.table_bytes());
        (blocks, table)
    }

    /// Marks blocks (and the table) changed again after a failed write.
    pub fn redirty(&mut self, blocks: impl Iterator<Item = u64>, table: bool) {
        self.dirty.extend(blocks);
        self.table_dirty |= table;
    }

    fn table_bytes(&self) -> Vec<u8> {
        let cs = 1usize << self.cluster_bits;
        let mut b: Vec<u8> = self.table.iter().flat_map(|w| w.to_be_bytes()).collect();
        b.resize(b.len().div_ceil(cs) * cs, 0);
        b
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn refcounts_of_every_width_round_trip_without_touching_neighbours() {
        for bits in [1u32, 2, 4, 8, 16, 32, 64] {
            let mut block = vec![0u8; 512];
            let entries = 512 * 8 / bits as u64;
            let max = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
            for i in (0..entries).step_by(3) {
                super::set(&mut block, bits, i, max - (i % 2));
            }
            for i in 0..entries {
                let want = if i % 3 == 0 { max - (i % 2) } else { 0 };
                assert_eq!(super::get(&block, bits, i), want, "{bits}-bit refcount {i}");
            }
        }
    }
}
