//! Copy-on-write overlays in UML's COW v3 format (`uml_mkcow`, `uml_moo`):
//! a read-only backing file, and an overlay file holding a header, a bitmap
//! of the sectors written since, and their data.
//!
//! What it owns: the overlay's header, its bitmap (in memory, [`CowMap`]),
//! the copy-up of partly written sectors, and the order in which bitmap
//! blocks reach the disk. What it must never do: write the backing file,
//! open a file the user did not ask for without saying which, or let a bit
//! reach the disk before the data it points at (see [`CowImage::sync_bitmap`]).
//!
//! Reads map to runs of extents, word by word through the bitmap: set runs to
//! the overlay's data area (file 0), unset runs to the backing file (file 1).
//! Writes, TRIM and WRITE_ZEROES all go to the overlay's data area and set
//! the bits once they are done, so a trimmed or zeroed range reads as zeros
//! there even where the backing file has data.

mod bitmap;
mod header;
mod merge;
mod open;
#[cfg(test)]
mod tests;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::raw::seek_allocation;
use crate::rbd::{ConnectOptions, RbdImage};
use crate::{Allocation, Error, Extent, Image, ImageBase, Result};

pub use bitmap::CowMap;
pub use header::{has_magic, parse_header, Header, Layout, HEADER_LEN, MAGIC, MAX_HEADER_LEN};
pub use merge::{inspect, Inspection};
pub(crate) use open::lock as lock_file;
pub use open::resolve_backing;

use open::read_full;

/// Stripes of the copy-up lock: concurrent partial writes to one sector copy it once.
const STRIPES: usize = 64;

/// How to open an overlay.
#[derive(Debug, Clone, Default)]
pub struct OverlayOptions {
    pub read_only: bool,
    /// Use this backing file instead of the one the header names.
    pub backing: Option<PathBuf>,
    /// Accept a backing file whose mtime differs from the header's.
    pub ignore_mtime: bool,
    /// Open the backing file for writing, locked exclusively (for a commit).
    pub backing_writable: bool,
    /// How to reach the cluster when the backing is an RBD snapshot.
    pub ceph: ConnectOptions,
}

pub struct CowImage {
    /// The overlay's path; files [overlay, backing], or [overlay] when the
    /// backing is an RBD snapshot.
    base: ImageBase,
    backing: PathBuf,
    header: Header,
    /// The backing when it is an RBD snapshot (file number 1 to the engine).
    rbd_backing: Option<RbdImage>,
    /// The backing file is open for writing (a commit in place).
    backing_writable: bool,
    map: CowMap,
    data_offset: u64,
    sector: u64,
    copy_locks: [Mutex<()>; STRIPES],
    /// Bitmap writes, one round at a time; holds the number of the last round done.
    rounds_done: Mutex<u64>,
    rounds_started: AtomicU64,
}

impl CowImage {
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The backing file actually opened.
    pub fn backing_path(&self) -> &Path {
        &self.backing
    }

    pub fn overlay_path(&self) -> &Path {
        &self.base.path
    }

    /// Sectors whose data is in the overlay.
    pub fn allocated_sectors(&self) -> u64 {
        self.map.count(0, self.map.sectors())
    }

    fn sector_end(&self, s: u64) -> u64 {
        ((s + 1) * self.sector).min(self.header.size)
    }

    /// Makes sector `s` whole in the overlay before a partial write: copies it
    /// from the backing file and sets its bit (the overlay then holds what
    /// the backing file does, so readers see the same either way). Under the
    /// sector's stripe lock, so two partial writes copy it once.
    fn copy_up(&self, s: u64) -> Result<()> {
        let _guard = self.copy_locks[(s % STRIPES as u64) as usize].lock().unwrap_or_else(|e| e.into_inner());
        if self.map.get(s) {
            return Ok(());
        }
        let start = s * self.sector;
        let mut buf = vec![0u8; (self.sector_end(s) - start) as usize];
        self.read_backing(&mut buf, start).map_err(|e| {
            Error::io(e, format!("copy-up read of sector {s} from backing file {}", self.backing.display()))
        })?;
        self.base.files[0].write_all_at(&buf, self.data_offset + start).map_err(|e| {
            Error::io(e, format!("copy-up write of sector {s} to overlay {}", self.base.path.display()))
        })?;
        self.map.set(s, s + 1);
        Ok(())
    }

    /// Reads from the backing file or snapshot.
    fn read_backing(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        match &self.rbd_backing {
            Some(rbd) => rbd.read_at(buf, offset).map(|()| buf.len()),
            None => read_full(&self.base.files[1], buf, offset),
        }
    }

    /// Reads from file number `file` (0: overlay, 1: backing).
    pub(crate) fn read_file(&self, file: usize, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if file == 0 {
            read_full(&self.base.files[0], buf, offset)
        } else {
            self.read_backing(buf, offset)
        }
    }

    /// The sectors [first, end) that a byte range touches.
    fn sectors_of(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset / self.sector, (offset + len).div_ceil(self.sector))
    }

    /// Writes the bitmap blocks changed so far, in the order that keeps the
    /// durability rule (data durable before the bit that points at it):
    ///
    /// 1. take the dirty marks and copy those blocks as they are now: every
    ///    bit in them was set after its data reached the overlay file;
    /// 2. fdatasync the overlay: that data is now durable;
    /// 3. write the copied blocks and fdatasync again.
    ///
    /// Bits set after step 1 stay dirty for the next round. Rounds run one at
    /// a time; a caller whose bits were set before a round started waits for
    /// that round instead of running its own (group commit).
    fn sync_bitmap(&self) -> Result<()> {
        let need = self.rounds_started.load(Ordering::SeqCst) + 1;
        let mut done = self.rounds_done.lock().unwrap_or_else(|e| e.into_inner());
        if *done >= need {
            return Ok(());
        }
        let round = self.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
        let blocks = self.map.take_dirty();
        if !blocks.is_empty() {
            let copies: Vec<(u64, u64, Vec<u8>)> = blocks
                .iter()
                .map(|&b| {
                    let (at, bytes) = self.map.block_bytes(b);
                    (b, at, bytes)
                })
                .collect();
            let r = self.write_blocks(&copies);
            if let Err(e) = r {
                blocks.iter().for_each(|&b| self.map.redirty(b));
                return Err(e);
            }
            for (b, _, bytes) in &copies {
                self.map.mark_persisted(*b, bytes);
            }
        }
        *done = round;
        Ok(())
    }

    /// Broken on purpose (a test build with `VDISK_BREAK=bitmap-first`):
    /// writes the bitmap blocks of sectors [first, end) at once, before
    /// their data is durable.
    fn write_bits_now(&self, first: u64, end: u64) {
        for b in first / 8 / bitmap::BLOCK..=(end - 1) / 8 / bitmap::BLOCK {
            let (at, bytes) = self.map.block_bytes(b);
            let _ = self.base.files[0].write_all_at(&bytes, self.header.bitmap_offset() + at);
        }
    }

    fn write_blocks(&self, copies: &[(u64, u64, Vec<u8>)]) -> Result<()> {
        let overlay = &self.base.files[0];
        let sync = |what: &str| {
            overlay.sync_data().map_err(|e| Error::io(e, format!("{what} of overlay {}", self.base.path.display())))
        };
        if !crate::breakage::active(crate::breakage::Breakage::BitmapFirst) {
            sync("data sync")?;
        }
        let base = self.header.bitmap_offset();
        // Adjacent blocks go out in one write.
        let mut i = 0;
        while i < copies.len() {
            let mut j = i + 1;
            while j < copies.len() && copies[j].0 == copies[j - 1].0 + 1 {
                j += 1;
            }
            let bytes: Vec<u8> = copies[i..j].iter().flat_map(|c| c.2.iter().copied()).collect();
            overlay.write_all_at(&bytes, base + copies[i].1).map_err(|e| {
                Error::io(e, format!("bitmap write at {} of overlay {}", base + copies[i].1, self.base.path.display()))
            })?;
            i = j;
        }
        sync("bitmap sync")
    }
}

impl Image for CowImage {
    fn format(&self) -> &'static str {
        "cow"
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    fn rbd(&self, file: usize) -> Option<&RbdImage> {
        if file == 1 {
            self.rbd_backing.as_ref()
        } else {
            None
        }
    }

    fn file_path(&self, file: usize) -> &Path {
        if file == 0 {
            &self.base.path
        } else {
            &self.backing
        }
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let end = offset + len;
        let last = self.sectors_of(offset, len).1;
        let mut pos = offset;
        while pos < end {
            let (set, run_end) = self.map.run(pos / self.sector, last);
            let stop = (run_end * self.sector).min(end);
            let (file, at) = if set { (0, self.data_offset + pos) } else { (1, pos) };
            out.push(Extent::Data { file, offset: at, len: stop - pos });
            pos = stop;
        }
        Ok(())
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        out.push(Extent::Data { file: 0, offset: self.data_offset + offset, len });
        Ok(())
    }

    fn prepare_write(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.sectors_of(offset, len);
        let covers = |s: u64| offset <= s * self.sector && offset + len >= self.sector_end(s);
        for s in [first, end - 1] {
            if !covers(s) && !self.map.get(s) {
                self.copy_up(s)?;
            }
            if end - 1 == first {
                break;
            }
        }
        Ok(())
    }

    fn write_done(&self, offset: u64, len: u64, durable: bool) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.sectors_of(offset, len);
        self.map.set(first, end);
        if crate::breakage::active(crate::breakage::Breakage::BitmapFirst) {
            self.write_bits_now(first, end);
        }
        if durable && !self.map.persisted(first, end) {
            self.sync_bitmap()?;
        }
        Ok(())
    }

    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        let end = offset + len;
        let last = self.sectors_of(offset, len).1;
        let start_len = out.len();
        let mut pos = offset;
        let mut found = Vec::new();
        while pos < end && out.len() - start_len < max {
            let (set, run_end) = self.map.run(pos / self.sector, last);
            let stop = (run_end * self.sector).min(end);
            found.clear();
            let left = max - (out.len() - start_len);
            let r = if set {
                seek_allocation(&self.base.files[0], self.data_offset + pos, stop - pos, left, &mut found)
            } else if let Some(rbd) = &self.rbd_backing {
                rbd.allocation(pos, stop - pos, left, &mut found)?;
                Ok(())
            } else {
                seek_allocation(&self.base.files[1], pos, stop - pos, left, &mut found)
            };
            r.map_err(|e| Error::io(e, format!("cannot map {} at {pos}", self.file_path(!set as usize).display())))?;
            for a in &found {
                let n = out.len() - start_len;
                match out.last_mut() {
                    Some(l) if n > 0 && (l.hole, l.zero) == (a.hole, a.zero) => l.len += a.len,
                    _ if n < max => out.push(*a),
                    _ => return Ok(()),
                }
                pos += a.len;
            }
        }
        Ok(())
    }

    fn sync_metadata(&self) -> Result<()> {
        self.sync_bitmap()
    }
}
