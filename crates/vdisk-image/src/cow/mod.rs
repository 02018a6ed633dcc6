//! Copy-on-write overlays in UML's COW v3 format (`uml_mkcow`, `uml_moo`):
//! a read-only backing file, and an overlay file holding a header, a bitmap
//! of the sectors written since, and their data.
//!
//! What it owns: the overlay's header, its bitmap (in memory, [`CowMap`]),
//! the copy-up of partly written pages, and the order in which bitmap
//! blocks reach the disk. What it must never do: write the backing file,
//! open a file the user did not ask for without saying which, or let a bit
//! reach the disk before the data it points at (see [`CowImage::sync_bitmap`]).
//!
//! Reads map to runs of extents, word by word through the bitmap: set runs to
//! the overlay's data area (file 0), unset runs to the backing file (file 1).
//! Writes, TRIM and WRITE_ZEROES all go to the overlay's data area and set
//! the bits once they are done, so a trimmed or zeroed range reads as zeros
//! there even where the backing file has data.
//!
//! Whole pages. The bitmap has a bit per sector, but the overlay is filled
//! in pages of the header's alignment (4 KiB: [`Header::page_sectors`]): a
//! write that covers only part of a page not yet whole in the overlay first
//! copies the page's missing sectors up from the backing file and sets the
//! whole page's bits (`prepare_write`). That is what the UML
//! kernel itself does (its page cache writes whole pages), and its ubd driver
//! misreads a request whose pages are only partly in the overlay: before,
//! 5000 bytes written at offset 1000 (bits 1-11) read under UML as if they
//! went on to offset 32768. Older vdisk wrote such sub-page bits; they still
//! read right here (reads go by sector), and the next partial write to such a
//! page completes it.

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
use crate::{Allocation, Error, Extent, Image, ImageBase, Result, Storage};

pub use bitmap::CowMap;
pub use header::{has_magic, parse_header, Header, Layout, HEADER_LEN, MAGIC, MAX_HEADER_LEN};
pub use merge::{inspect, Inspection};
pub(crate) use open::lock as lock_file;
pub use open::resolve_backing;

use open::read_full;

/// Stripes of the copy-up lock: concurrent partial writes to one page copy it once.
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

    /// Sectors per copy-up page (8: 4 KiB of 512-byte sectors).
    fn page(&self) -> u64 {
        self.header.page_sectors()
    }

    /// The sectors [first, end) of page `p` (the last page may be short).
    fn page_range(&self, p: u64) -> (u64, u64) {
        let k = self.page();
        (p * k, ((p + 1) * k).min(self.map.sectors()))
    }

    /// Whether every sector of page `p` is in the overlay.
    fn page_whole(&self, p: u64) -> bool {
        let (first, end) = self.page_range(p);
        self.map.count(first, end) == end - first
    }

    /// Makes page `p` whole in the overlay before a write that covers only
    /// part of it: copies each of its sectors whose bit is unset from the
    /// backing file (the overlay then holds what the backing file does, so
    /// readers see the same either way), then sets the whole page's bits.
    /// Sectors already set (an overlay from an older vdisk, with bits for
    /// parts of pages) keep their data. Under the page's stripe lock, so two
    /// partial writes to one page copy it once, and neither starts its data
    /// write before the copy is done and the bits are set: a later copy-up
    /// never overwrites the other's data.
    fn copy_up(&self, p: u64) -> Result<()> {
        let _guard = self.copy_locks[(p % STRIPES as u64) as usize].lock().unwrap_or_else(|e| e.into_inner());
        let (first, end) = self.page_range(p);
        let mut s = first;
        while s < end {
            let (set, stop) = self.map.run(s, end);
            if !set {
                let (start, until) = (s * self.sector, self.sector_end(stop - 1));
                let mut buf = vec![0u8; (until - start) as usize];
                self.read_backing(&mut buf, start).map_err(|e| {
                    Error::io(
                        e,
                        format!(
                            "copy-up read of {} bytes at {start} from backing file {}",
                            buf.len(),
                            self.backing.display()
                        ),
                    )
                })?;
                self.base.files[0].write_all_at(&buf, self.data_offset + start).map_err(|e| {
                    Error::io(
                        e,
                        format!(
                            "copy-up write of {} bytes at {} to overlay {}",
                            buf.len(),
                            self.data_offset + start,
                            self.base.path.display()
                        ),
                    )
                })?;
            }
            s = stop;
        }
        self.map.set(first, end);
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

    /// The overlay's file, then its backing: a file, or an RBD snapshot.
    fn target(&self, i: usize) -> Option<Storage<'_>> {
        match (i, &self.rbd_backing) {
            (1, Some(rbd)) => Some(Storage::Rbd(rbd)),
            _ => self.files().get(i).map(Storage::File),
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

    /// Copies up the first and last page of the range when the write covers
    /// only part of them and they are not whole in the overlay yet (the pages
    /// between are covered whole). See `copy_up`.
    fn prepare_write(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.sectors_of(offset, len);
        let (p0, p1) = (first / self.page(), (end - 1) / self.page());
        let covers = |p: u64| {
            let (a, b) = self.page_range(p);
            offset <= a * self.sector && offset + len >= self.sector_end(b - 1)
        };
        for p in [p0, p1] {
            if !covers(p) && !self.page_whole(p) {
                self.copy_up(p)?;
            }
            if p1 == p0 {
                break;
            }
        }
        Ok(())
    }

    /// Sets the written sectors' bits: with the copy-up of `prepare_write`,
    /// whole pages.
    fn write_done(&self, offset: u64, len: u64, durable: bool) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.sectors_of(offset, len);
        self.map.set(first, end);
        if crate::breakage::active(crate::breakage::Breakage::BitmapFirst) {
            self.write_bits_now(first, end);
        }
        // The pages' bits, with those copy-up set beside the write's own.
        let (pages, _) = self.page_range(first / self.page());
        let (_, pages_end) = self.page_range((end - 1) / self.page());
        if durable && !self.map.persisted(pages, pages_end) {
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
        // The backing's answer for the whole range, asked once (see crate::window).
        let mut window = crate::window::BackingWindow::default();
        let failed = |e, at| Error::io(e, format!("cannot map {} at {at}", self.file_path(1).display()));
        while pos < end && out.len() - start_len < max {
            let (set, run_end) = self.map.run(pos / self.sector, last);
            let stop = (run_end * self.sector).min(end);
            found.clear();
            let left = max - (out.len() - start_len);
            if set {
                seek_allocation(&self.base.files[0], self.data_offset + pos, stop - pos, left, &mut found)
                    .map_err(|e| Error::io(e, format!("cannot map {} at {pos}", self.file_path(0).display())))?;
            } else {
                window.take(
                    pos,
                    stop - pos,
                    end,
                    |at, l, m, runs| match &self.rbd_backing {
                        Some(rbd) => rbd.allocation(at, l, m, runs),
                        None => seek_allocation(&self.base.files[1], at, l, m, runs).map_err(|e| failed(e, at)),
                    },
                    &mut found,
                )?;
                if found.is_empty() {
                    return Ok(());
                }
            }
            for a in &found {
                // The overlay's own sectors are depth 1; the backing image's one deeper.
                let a = if set { Allocation { depth: 1, ..*a } } else { a.one_deeper() };
                let n = out.len() - start_len;
                match out.last_mut() {
                    Some(l) if n > 0 && (l.hole, l.zero, l.depth) == (a.hole, a.zero, a.depth) => l.len += a.len,
                    _ if n < max => out.push(a),
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
