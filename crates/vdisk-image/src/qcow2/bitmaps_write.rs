//! Writing a qcow2 image's bitmaps back (see `bitmaps.rs` for the format).
//!
//! A save writes the whole set anew, copy-on-write: new data clusters (an
//! all-zero cluster is no cluster, table entry 0), new tables and a new
//! directory, all appended; then a metadata round makes their refcounts
//! durable; then one write of the header's first bytes names the new
//! directory (the extension list rebuilt, autoclear bit 0 set, the backing
//! file name moved after the extensions); last, the old clusters are given
//! back (their refcounts drop in the next round). A crash at any point
//! leaves either the old set or the new one, and at worst leaked clusters.

use std::os::unix::fs::FileExt;

use super::bitmaps::{self, AUTOCLEAR_BITMAPS, FLAG_AUTO, FLAG_IN_USE, TYPE_DIRTY};
use super::header::{self, EXT_BITMAPS, EXT_END};
use super::Qcow2Image;
use crate::bitmap::StoredBitmap;
use crate::{Error, Result};

/// The bitmaps an open image keeps, and the host clusters they take on disk.
#[derive(Default)]
pub(super) struct BitmapState {
    pub set: Vec<StoredBitmap>,
    pub clusters: Vec<u64>,
}

impl Qcow2Image {
    fn bitmap_err(&self, e: std::io::Error, what: &str) -> Error {
        Error::io(e, format!("cannot {what} the bitmaps of {}", self.base.path.display()))
    }

    /// Called by a read-write open: loads the bitmaps and marks every one in
    /// use on disk before any write is served. A bitmaps extension that
    /// cannot be read is dropped (autoclear cleared), as qemu drops one it
    /// finds inconsistent, with a warning.
    pub(super) fn open_bitmaps(&mut self) -> Result<()> {
        let file_len = self.file_len.load(std::sync::atomic::Ordering::Acquire);
        let loaded = match bitmaps::load(&self.header, &self.base.files[0], file_len, &self.base.path) {
            Ok(l) => l,
            Err(e) if self.base.read_only => {
                log::warn!("{}: the bitmaps are ignored", e.report());
                return Ok(());
            }
            Err(e) => {
                log::warn!("{}: the bitmaps are dropped", e.report());
                return self.clear_autoclear();
            }
        };
        let unknown_autoclear = self.header.autoclear & !AUTOCLEAR_BITMAPS != 0;
        *self.bitmaps.get_mut().unwrap_or_else(|e| e.into_inner()) =
            BitmapState { set: loaded.bitmaps, clusters: loaded.clusters };
        if self.base.read_only {
            return Ok(());
        }
        if unknown_autoclear {
            // Other autoclear features are not kept up to date by vdisk.
            self.clear_autoclear()?;
        }
        let set = self.bitmaps();
        if !set.is_empty() {
            self.write_bitmaps(&set, false)?;
        }
        Ok(())
    }

    /// Clears autoclear bits vdisk does not keep (all but bitmaps, when it keeps them).
    fn clear_autoclear(&mut self) -> Result<()> {
        let keep = if self.bitmaps().is_empty() { 0 } else { self.header.autoclear & AUTOCLEAR_BITMAPS };
        if self.header.autoclear == keep {
            return Ok(());
        }
        self.base.files[0]
            .write_all_at(&keep.to_be_bytes(), header::AUTOCLEAR_AT)
            .and_then(|_| self.base.files[0].sync_data())
            .map_err(|e| self.bitmap_err(e, "clear the autoclear features of"))?;
        self.header.autoclear = keep;
        Ok(())
    }

    /// Writes `set` as the image's whole set of bitmaps. `close`: a clean
    /// close, consistent bitmaps are saved not in use; otherwise all stay
    /// in use (the image keeps being written).
    pub(super) fn write_bitmaps(&self, set: &[StoredBitmap], close: bool) -> Result<()> {
        let p = self.base.path.display();
        if self.base.read_only {
            return Err(Error::new(
                crate::ErrorKind::ReadOnly,
                format!("{p} is open read-only: its bitmaps cannot be saved"),
            ));
        }
        if self.header.version < 3 {
            return Err(Error::invalid(format!(
                "{p} is a qcow2 version 2 image, which cannot hold bitmaps: upgrade it with `qemu-img amend -o compat=1.1 {p}`"
            )));
        }
        for (i, b) in set.iter().enumerate() {
            crate::bitmap::store::check_name(&b.name)?;
            if b.map.size() != self.header.size {
                return Err(Error::invalid(format!("bitmap {:?} is not of this disk's size", b.name)));
            }
            if set[..i].iter().any(|o| o.name == b.name) {
                return Err(Error::invalid(format!("two bitmaps are named {:?}", b.name)));
            }
        }
        let mut state = self.bitmaps.lock().unwrap_or_else(|e| e.into_inner());
        let cs = self.cs();
        let file = &self.base.files[0];
        let mut fresh = Vec::new();
        let mut dir = Vec::new();
        let result = (|| {
            for b in set {
                let g = b.map.granularity();
                let n = bitmaps::table_entries(self.header.size, g, cs);
                let data_bytes = b.map.bits().div_ceil(8);
                let mut table = vec![0u8; (n * 8) as usize];
                let mut buf = vec![0u8; cs as usize];
                for k in 0..n {
                    buf.fill(0);
                    let len = (data_bytes - k * cs).min(cs) as usize;
                    b.map.export_bits(k * cs * 8, &mut buf[..len.div_ceil(8) * 8]);
                    if buf.iter().all(|&x| x == 0) {
                        continue;
                    }
                    let at = self.allocate_clusters(1, &mut fresh)?;
                    file.write_all_at(&buf, at).map_err(|e| self.bitmap_err(e, "write"))?;
                    table[k as usize * 8..k as usize * 8 + 8].copy_from_slice(&at.to_be_bytes());
                }
                let table_at = self.allocate_clusters((n * 8).div_ceil(cs), &mut fresh)?;
                file.write_all_at(&table, table_at).map_err(|e| self.bitmap_err(e, "write"))?;
                let in_use = !close || b.inconsistent;
                let flags = if in_use { FLAG_IN_USE } else { 0 } | if b.map.enabled() { FLAG_AUTO } else { 0 };
                dir.extend_from_slice(&table_at.to_be_bytes());
                dir.extend_from_slice(&(n as u32).to_be_bytes());
                dir.extend_from_slice(&flags.to_be_bytes());
                dir.push(TYPE_DIRTY);
                dir.push(g.trailing_zeros() as u8);
                dir.extend_from_slice(&(b.name.len() as u16).to_be_bytes());
                dir.extend_from_slice(&0u32.to_be_bytes());
                dir.extend_from_slice(b.name.as_bytes());
                dir.resize(dir.len().div_ceil(8) * 8, 0);
            }
            let dir_at = if set.is_empty() {
                0
            } else {
                let at = self.allocate_clusters((dir.len() as u64).div_ceil(cs), &mut fresh)?;
                file.write_all_at(&dir, at).map_err(|e| self.bitmap_err(e, "write"))?;
                at
            };
            // Data, tables and directory, then their refcounts, are durable
            // before the header names them.
            file.sync_data().map_err(|e| self.bitmap_err(e, "sync"))?;
            self.sync_round()?;
            self.write_bitmaps_header(set.len() as u32, dir.len() as u64, dir_at)
        })();
        if let Err(e) = result {
            // The new clusters are named by nothing: give them back.
            self.released.lock().unwrap_or_else(|e| e.into_inner()).extend(fresh);
            return Err(e);
        }
        let old = std::mem::replace(&mut state.clusters, fresh);
        state.set = set.to_vec();
        drop(state);
        self.released.lock().unwrap_or_else(|e| e.into_inner()).extend(old);
        // One round lowers the old clusters' refcounts in memory, the next writes them.
        self.sync_round()?;
        self.sync_round()?;
        Ok(())
    }

    /// `n` new contiguous clusters, counted, inside the file; noted in `fresh`.
    fn allocate_clusters(&self, n: u64, fresh: &mut Vec<u64>) -> Result<u64> {
        let cs = self.cs();
        let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
        let at = refs.allocate(&self.base.files[0], &self.base.path, n)?;
        let end = refs.next_free();
        drop(refs);
        fresh.extend((0..n).map(|k| at + k * cs));
        self.cover(end)?;
        Ok(at)
    }

    /// Rewrites the header's extension list with the bitmaps extension
    /// (`n` bitmaps, a directory of `size` bytes at `at`; none when `n` is
    /// 0) and autoclear bit 0 set to match. Holds the metadata rounds off
    /// meanwhile, and reads the header afresh: a round may have moved the
    /// refcount table.
    fn write_bitmaps_header(&self, n: u32, size: u64, at: u64) -> Result<()> {
        let _rounds = self.rounds_done.lock().unwrap_or_else(|e| e.into_inner());
        let cs = self.cs() as usize;
        let file = &self.base.files[0];
        let mut old = vec![0u8; cs];
        file.read_exact_at(&mut old, 0).map_err(|e| self.bitmap_err(e, "read the header for"))?;
        let hlen = u32::from_be_bytes(old[100..104].try_into().unwrap()) as usize;
        let name_at = u64::from_be_bytes(old[8..16].try_into().unwrap()) as usize;
        let name_len = u32::from_be_bytes(old[16..20].try_into().unwrap()) as usize;
        let mut b = old[..hlen].to_vec();
        let mut at_ext = hlen;
        while at_ext + 8 <= cs {
            let ty = u32::from_be_bytes(old[at_ext..at_ext + 4].try_into().unwrap());
            let len = u32::from_be_bytes(old[at_ext + 4..at_ext + 8].try_into().unwrap()) as usize;
            if ty == EXT_END || len > cs - at_ext - 8 {
                break;
            }
            if ty != EXT_BITMAPS {
                header::push_ext(&mut b, ty, &old[at_ext + 8..at_ext + 8 + len]);
            }
            at_ext += 8 + len.div_ceil(8) * 8;
        }
        if n > 0 {
            let mut ext = Vec::with_capacity(24);
            ext.extend_from_slice(&n.to_be_bytes());
            ext.extend_from_slice(&0u32.to_be_bytes());
            ext.extend_from_slice(&size.to_be_bytes());
            ext.extend_from_slice(&at.to_be_bytes());
            header::push_ext(&mut b, EXT_BITMAPS, &ext);
        }
        header::push_ext(&mut b, EXT_END, &[]);
        // Offset 0 (or size 0) is no backing file, whatever the other field holds.
        if name_at != 0 && name_len > 0 && name_at + name_len <= cs {
            let new_at = b.len() as u64;
            b.extend_from_slice(&old[name_at..name_at + name_len]);
            b[8..16].copy_from_slice(&new_at.to_be_bytes());
        }
        if b.len() > cs {
            return Err(Error::invalid(format!(
                "{}: the header, its extensions and the backing file name no longer fit in one cluster",
                self.base.path.display()
            )));
        }
        let autoclear = u64::from_be_bytes(old[88..96].try_into().unwrap());
        let autoclear = if n > 0 { autoclear | AUTOCLEAR_BITMAPS } else { autoclear & !AUTOCLEAR_BITMAPS };
        b[88..96].copy_from_slice(&autoclear.to_be_bytes());
        file.write_all_at(&b, 0)
            .and_then(|_| file.sync_data())
            .map_err(|e| self.bitmap_err(e, "write the header naming"))
    }
}
