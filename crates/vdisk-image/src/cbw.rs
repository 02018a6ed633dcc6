//! Copy-before-write: the point-in-time view of a disk that a backup reads
//! while the guest keeps writing (qemu's "fleecing"; docs/block-jobs.md
//! "Incremental backup").
//!
//! [`Cbw::wrap`] puts a [`CbwImage`] over the image an export serves. Before
//! the guest changes a range (its `prepare_write`, and `zero` for what a
//! format records in metadata, like a qcow2 zero cluster), the old data of
//! each granule of the range not copied yet is read through the image and
//! written to a scratch file, at the granule's own offset (the scratch file is
//! sparse: only copied granules take space; a granule that read as zeros is
//! not written at all). The granule → copied map lives in memory: which
//! granules are being copied, and the view reads in flight, behind one lock;
//! per granule, a "copied" and a "settled" bit (copied, and no view read of
//! the live data left) are atomic too, so a write whose granules have all
//! settled goes on without taking the lock. A write to a granule being
//! copied waits for that copy.
//!
//! [`ViewImage`] is the frozen disk, read-only: a copied granule reads from
//! the scratch file, any other from the live image. A read of the live image
//! must not race a guest write that lands there after its copy: a view read
//! *pins* every granule it maps to the live image, from `map_read` until the
//! engine says the read is done (`read_done`; the image says it needs that
//! with `pins_reads`, and the engine then serves it on the thread engine,
//! where a read is mapped and performed by one thread in one go). A guest
//! write waits until its granules are copied *and* unpinned. A view read
//! never waits (the thread engine maps a batch of reads before performing
//! any: a read waiting for a copy, which waits for the pin of a read mapped
//! earlier in the same batch, would never end); the live data of a granule
//! being copied is unchanged until its writer goes on, so it may be read.
//! `read_done` names only the range, so the view keeps the granules each read
//! pinned, per range; as a granule once copied stays copied, a later read of
//! a range pins a subset of what an earlier one did, and `read_done` releases
//! the smallest set kept for its range (never too much: at worst, a pin is
//! kept until the last read of that range ends). That is qemu's rule too
//! (copy-before-write's snapshot-access reads lock their range against the
//! guest writes that would change it).
//!
//! The scratch file is unlinked from the start (`O_TMPFILE`, or created and
//! unlinked at once where the file system has none): it is never one of the
//! disk's own files, a crash leaves nothing behind, and dropping the last
//! holder of the [`Cbw`] frees its space.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::{bitmap, Allocation, Error, Extent, Image, ImageBase, Result, Storage};

/// The default copy unit: 64 KiB, qemu's cluster size and bitmap granularity.
pub const DEFAULT_GRANULE: u64 = 64 << 10;

/// What the lock guards: which granules are being copied, or pinned by view reads.
#[derive(Default)]
struct State {
    /// Zero-filled copied granules (no data in the scratch file): the view reports them as zeros.
    zeros: Vec<u64>,
    /// Granules a write is copying now.
    copying: HashSet<u64>,
    /// View reads of the live data in flight, per granule.
    pins: HashMap<u64, u32>,
    /// The granules each view read in flight pinned, by its range.
    reads: HashMap<(u64, u64), Vec<Vec<u64>>>,
    /// The backup ended: writes no longer copy (the wrapper is on its way out).
    detached: bool,
}

/// One bit per granule, read without the lock and set under it.
struct Bits(Vec<AtomicU64>);

impl Bits {
    fn new(granules: u64) -> Bits {
        Bits((0..granules.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }

    fn get(&self, g: u64) -> bool {
        self.0[(g / 64) as usize].load(Ordering::Acquire) & (1 << (g % 64)) != 0
    }

    fn set(&self, g: u64) {
        self.0[(g / 64) as usize].fetch_or(1 << (g % 64), Ordering::Release);
    }

    fn count(&self) -> u64 {
        self.0.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as u64).sum()
    }
}

fn bit(v: &[u64], g: u64) -> bool {
    v[(g / 64) as usize] & (1 << (g % 64)) != 0
}

fn set_bit(v: &mut [u64], g: u64) {
    v[(g / 64) as usize] |= 1 << (g % 64);
}

/// The copy-before-write state one backup shares between the wrapper (its
/// writer) and the view (its reader).
pub struct Cbw {
    inner: Arc<dyn Image>,
    granule: u64,
    scratch: File,
    /// Where the scratch file was made (it has no name of its own), for messages.
    scratch_dir: PathBuf,
    /// The granules whose old data is in the scratch file (or read as zeros): set under the lock, never cleared.
    copied: Bits,
    /// Copied, and no view read of their live data in flight: writes go on. Set under the lock, never cleared.
    settled: Bits,
    /// Set once the backup ended: writes go straight on.
    detached: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
}

impl Cbw {
    /// Wraps `inner` with a scratch file made in `scratch_dir`, copying
    /// `granule` bytes at a time (a power of two, at least 512). Returns the
    /// wrapper the export serves from now on and the frozen view.
    /// An image on RBD is refused (the copy reads files).
    pub fn wrap(inner: Arc<dyn Image>, scratch_dir: &Path, granule: u64) -> Result<(Arc<CbwImage>, Arc<ViewImage>)> {
        bitmap::check_granularity(granule)?;
        if (0..inner.files().len().max(1)).any(|i| matches!(inner.target(i), Some(Storage::Rbd(_)))) {
            return Err(Error::invalid(format!(
                "{}: an image on RBD cannot be given a copy-before-write backup view",
                inner.base().path.display()
            )));
        }
        let scratch = scratch_file(scratch_dir)?;
        let granules = inner.size().div_ceil(granule);
        let words = granules.div_ceil(64) as usize;
        let state = State { zeros: vec![0; words], ..Default::default() };
        let cbw = Arc::new(Cbw {
            inner: inner.clone(),
            granule,
            scratch,
            scratch_dir: scratch_dir.to_owned(),
            copied: Bits::new(granules),
            settled: Bits::new(granules),
            detached: AtomicBool::new(false),
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        let mut files = Vec::with_capacity(inner.files().len() + 1);
        for (i, f) in inner.files().iter().enumerate() {
            files.push(f.try_clone().map_err(|e| {
                Error::io(e, format!("cannot duplicate the descriptor of {}", inner.file_path(i).display()))
            })?);
        }
        files
            .push(cbw.scratch.try_clone().map_err(|e| Error::io(e, "cannot duplicate the scratch file's descriptor"))?);
        let view_base = ImageBase::new(inner.base().path.clone(), inner.size(), true, files);
        let view = Arc::new(ViewImage { cbw: cbw.clone(), base: view_base });
        Ok((Arc::new(CbwImage { cbw }), view))
    }

    /// The granules `len` bytes at `offset` touch.
    fn granules(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 {
            return 0..0;
        }
        offset / self.granule..(offset + len - 1) / self.granule + 1
    }

    /// Byte range of granule `g`, clamped to the disk.
    fn span(&self, g: u64) -> (u64, u64) {
        let start = g * self.granule;
        (start, self.granule.min(self.inner.size() - start))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(st).unwrap_or_else(|e| e.into_inner())
    }

    /// Copies the old data of every granule of the range not copied yet and
    /// returns once they all are and no view read of their live data is in flight.
    fn copy_before(&self, offset: u64, len: u64) -> Result<()> {
        let range = self.granules(offset, len);
        // The common case once a backup has run a while: nothing to copy, no lock.
        if self.detached.load(Ordering::Acquire) || range.clone().all(|g| self.settled.get(g)) {
            return Ok(());
        }
        let mut st = self.lock();
        loop {
            if st.detached {
                return Ok(());
            }
            // Claim what nobody copies yet; wait for other copies and for view reads.
            let mut mine = Vec::new();
            let mut waiting = false;
            for g in range.clone() {
                if self.copied.get(g) {
                    waiting |= st.pins.contains_key(&g);
                } else if st.copying.insert(g) {
                    mine.push(g);
                } else {
                    waiting = true;
                }
            }
            if mine.is_empty() {
                if !waiting {
                    return Ok(());
                }
                st = self.wait(st);
                continue;
            }
            drop(st);
            let mut done = Vec::with_capacity(mine.len());
            let mut failed = None;
            for &g in &mine {
                match self.copy_granule(g) {
                    Ok(zero) => done.push((g, zero)),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            st = self.lock();
            for &g in &mine {
                st.copying.remove(&g);
            }
            for (g, zero) in done {
                if zero {
                    set_bit(&mut st.zeros, g);
                }
                self.copied.set(g);
                if !st.pins.contains_key(&g) {
                    self.settled.set(g);
                }
            }
            self.changed.notify_all();
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }

    /// Reads granule `g` of the live image and writes it to the scratch file
    /// (unless it reads as zeros); returns whether it did read as zeros.
    fn copy_granule(&self, g: u64) -> Result<bool> {
        let (start, len) = self.span(g);
        let mut extents = Vec::new();
        self.inner.map_read(start, len, &mut extents)?;
        let mut buf = vec![0u8; len as usize];
        let mut at = 0usize;
        for ext in &extents {
            let n = ext.len() as usize;
            if let Extent::Data { file, offset, .. } = *ext {
                read_full(&self.inner.files()[file], &mut buf[at..at + n], offset).map_err(|e| {
                    Error::io(
                        e,
                        format!(
                            "copy-before-write: cannot read {n} bytes at offset {offset} of {}",
                            self.inner.file_path(file).display()
                        ),
                    )
                })?;
            }
            at += n;
        }
        if buf.iter().all(|&b| b == 0) {
            return Ok(true);
        }
        self.scratch.write_all_at(&buf, start).map_err(|e| {
            Error::io(
                e,
                format!(
                    "copy-before-write: cannot write {len} bytes to the scratch file in {} (is it full? give the \
                     backup a --scratch directory with room)",
                    self.scratch_dir.display()
                ),
            )
        })?;
        Ok(false)
    }

    /// Bytes of the disk copied to the scratch file so far (whole granules, zero ones too).
    pub fn copied_bytes(&self) -> u64 {
        self.copied.count() * self.granule
    }

    /// Ends copying: the writes that follow go straight to the image. Called
    /// before the wrapper is swapped out, under the device's quiesce.
    pub fn detach(&self) {
        self.lock().detached = true;
        self.detached.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// Frees the scratch file's space (at the end of a backup, once nothing
    /// reads the view and nothing copies any more).
    pub fn discard_scratch(&self) {
        if crate::breakage::active(crate::breakage::Breakage::CbwIntoDisk) {
            self.leak_into_disk();
        }
        if let Err(e) = self.scratch.set_len(0) {
            log::warn!("backup scratch file in {}: cannot free its space: {e}", self.scratch_dir.display());
        }
    }

    /// Broken on purpose (a test build with `VDISK_BREAK=cbw-into-disk`):
    /// writes the old data of every copied granule back where the live
    /// image maps it, over what the guest wrote since the backup began.
    fn leak_into_disk(&self) {
        let granules = self.inner.size().div_ceil(self.granule);
        for g in (0..granules).filter(|&g| self.copied.get(g)) {
            let (start, len) = self.span(g);
            let mut buf = vec![0u8; len as usize];
            if read_full(&self.scratch, &mut buf, start).is_err() {
                continue;
            }
            let mut extents = Vec::new();
            if self.inner.map_read(start, len, &mut extents).is_err() {
                continue;
            }
            let mut at = 0usize;
            for ext in &extents {
                let n = ext.len() as usize;
                if let Extent::Data { file, offset, .. } = *ext {
                    let _ = self.inner.files()[file].write_all_at(&buf[at..at + n], offset);
                }
                at += n;
            }
        }
    }

    /// The image under the wrapper.
    pub fn inner(&self) -> &Arc<dyn Image> {
        &self.inner
    }
}

/// Reads `buf.len()` bytes at `offset`; what lies past the end of the file reads as zeros.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A scratch file in `dir` with no name: `O_TMPFILE`, else made and unlinked at once.
fn scratch_file(dir: &Path) -> Result<File> {
    let md = std::fs::metadata(dir).map_err(|e| {
        Error::io(e, format!("scratch directory {}: cannot use it (give an existing directory)", dir.display()))
    })?;
    if !md.is_dir() {
        return Err(Error::invalid(format!("scratch directory {} is not a directory", dir.display())));
    }
    let tmp =
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC).open(dir);
    match tmp {
        Ok(f) => Ok(f),
        Err(_) => {
            let path = dir.join(format!(".vdisk-scratch-{}-{:x}", std::process::id(), rand_suffix()));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| Error::io(e, format!("cannot create a scratch file in {}", dir.display())))?;
            let _ = std::fs::remove_file(&path);
            Ok(f)
        }
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    h.finish()
}

/// The image an export serves during a backup: the plain image, whose writes
/// first copy the old data to the scratch file.
pub struct CbwImage {
    cbw: Arc<Cbw>,
}

impl CbwImage {
    pub fn cbw(&self) -> &Arc<Cbw> {
        &self.cbw
    }
}

impl Image for CbwImage {
    fn format(&self) -> &'static str {
        self.cbw.inner.format()
    }

    fn base(&self) -> &ImageBase {
        self.cbw.inner.base()
    }

    fn size(&self) -> u64 {
        self.cbw.inner.size()
    }

    fn read_only(&self) -> bool {
        self.cbw.inner.read_only()
    }

    fn files(&self) -> &[File] {
        self.cbw.inner.files()
    }

    fn direct_files(&self) -> &[File] {
        self.cbw.inner.direct_files()
    }

    fn target(&self, i: usize) -> Option<Storage<'_>> {
        self.cbw.inner.target(i)
    }

    fn file_path(&self, file: usize) -> &Path {
        self.cbw.inner.file_path(file)
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.cbw.inner.map_read(offset, len, out)
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.cbw.inner.map_write(offset, len, out)
    }

    fn prepare_write(&self, offset: u64, len: u64) -> Result<()> {
        self.cbw.copy_before(offset, len)?;
        self.cbw.inner.prepare_write(offset, len)
    }

    fn write_done(&self, offset: u64, len: u64, durable: bool) -> Result<()> {
        self.cbw.inner.write_done(offset, len, durable)
    }

    fn write_failed(&self, offset: u64, len: u64) {
        self.cbw.inner.write_failed(offset, len)
    }

    fn zero(&self, offset: u64, len: u64, trim: bool, no_hole: bool) -> Result<Vec<(u64, u64)>> {
        // A format may record the zeros in its metadata without a prepare_write: copy first.
        self.cbw.copy_before(offset, len)?;
        self.cbw.inner.zero(offset, len, trim, no_hole)
    }

    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        self.cbw.inner.allocation(offset, len, max, out)
    }

    fn sync_metadata(&self) -> Result<()> {
        self.cbw.inner.sync_metadata()
    }

    fn bitmap_store(&self) -> Option<&dyn bitmap::BitmapStore> {
        self.cbw.inner.bitmap_store()
    }
}

/// The disk as it was when the backup began, read-only. Its files are the
/// live image's (same numbers) and then the scratch file.
pub struct ViewImage {
    cbw: Arc<Cbw>,
    base: ImageBase,
}

impl ViewImage {
    fn scratch_index(&self) -> usize {
        self.base.files.len() - 1
    }

    /// Pins the granules of the range not copied yet (their data is read
    /// from the live image) and returns the lock. Never waits for a copy.
    fn pin(&self, offset: u64, len: u64) -> MutexGuard<'_, State> {
        let cbw = &self.cbw;
        let mut st = cbw.lock();
        let pinned: Vec<u64> = cbw.granules(offset, len).filter(|&g| !cbw.copied.get(g)).collect();
        for &g in &pinned {
            *st.pins.entry(g).or_insert(0) += 1;
        }
        st.reads.entry((offset, len)).or_default().push(pinned);
        st
    }

    /// Releases a read of the range: the smallest set of pins kept for it
    /// (the module doc: why that is never too much).
    fn unpin(&self, offset: u64, len: u64) {
        let cbw = &self.cbw;
        let mut st = cbw.lock();
        let Some(sets) = st.reads.get_mut(&(offset, len)) else {
            debug_assert!(false, "read_done of {len} bytes at {offset}, never mapped");
            return;
        };
        let smallest = (0..sets.len()).min_by_key(|&i| sets[i].len()).expect("a set per read");
        let pinned = sets.swap_remove(smallest);
        if sets.is_empty() {
            st.reads.remove(&(offset, len));
        }
        for g in pinned {
            match st.pins.get_mut(&g) {
                Some(1) | None => {
                    st.pins.remove(&g);
                    if cbw.copied.get(g) {
                        cbw.settled.set(g);
                    }
                }
                Some(n) => *n -= 1,
            }
        }
        drop(st);
        cbw.changed.notify_all();
    }

    /// Splits the range into runs of one state: (start, len, copied, zeros).
    fn runs(&self, st: &State, offset: u64, len: u64) -> Vec<(u64, u64, bool, bool)> {
        let cbw = &self.cbw;
        let mut out: Vec<(u64, u64, bool, bool)> = Vec::new();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let g = pos / cbw.granule;
            let stop = ((g + 1) * cbw.granule).min(end);
            let (c, z) = (cbw.copied.get(g), bit(&st.zeros, g));
            match out.last_mut() {
                Some(last) if last.2 == c && last.3 == z => last.1 += stop - pos,
                _ => out.push((pos, stop - pos, c, z)),
            }
            pos = stop;
        }
        out
    }
}

impl Image for ViewImage {
    fn format(&self) -> &'static str {
        "backup-view"
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    fn file_path(&self, file: usize) -> &Path {
        if file == self.scratch_index() {
            &self.cbw.scratch_dir
        } else {
            self.cbw.inner.file_path(file)
        }
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let st = self.pin(offset, len);
        let first = out.len();
        let mut mapped = Ok(());
        for (at, n, copied, zeros) in self.runs(&st, offset, len) {
            mapped = match (copied, zeros) {
                (true, true) => {
                    out.push(Extent::Zero { len: n });
                    Ok(())
                }
                (true, false) => {
                    out.push(Extent::Data { file: self.scratch_index(), offset: at, len: n });
                    Ok(())
                }
                (false, _) => self.cbw.inner.map_read(at, n, out),
            };
            if mapped.is_err() {
                break;
            }
        }
        drop(st);
        if mapped.is_err() {
            out.truncate(first);
            self.unpin(offset, len);
        }
        mapped
    }

    fn map_write(&self, offset: u64, _len: u64, _out: &mut Vec<Extent>) -> Result<()> {
        Err(Error::invalid(format!("a backup view is read-only (a write at offset {offset} was refused)")))
    }

    fn pins_reads(&self) -> bool {
        true
    }

    fn read_done(&self, offset: u64, len: u64) {
        self.unpin(offset, len);
    }

    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        let st = self.pin(offset, len);
        let runs = self.runs(&st, offset, len);
        drop(st);
        let r = (|| {
            let first = out.len();
            for (at, n, copied, zeros) in runs {
                if out.len() - first >= max {
                    break;
                }
                if copied {
                    out.push(Allocation { len: n, hole: zeros, zero: zeros, depth: 1 });
                    continue;
                }
                let before: u64 = out[first..].iter().map(|a| a.len).sum();
                self.cbw.inner.allocation(at, n, max - (out.len() - first), out)?;
                let got: u64 = out[first..].iter().map(|a| a.len).sum::<u64>() - before;
                if got < n {
                    break;
                }
            }
            Ok(())
        })();
        self.unpin(offset, len);
        r
    }
}

#[cfg(test)]
mod tests;
