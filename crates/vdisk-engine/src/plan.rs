//! What both engines share: mapping a batch of requests through the image into
//! runs of file I/O (contiguous pieces merged into one vectored call), and the
//! operations that are not data transfers (trim, zero, cache, block status,
//! flush). The engines differ only in how they perform the runs.

use std::fs::File;
use std::sync::Arc;

use vdisk_image::{Error, Extent, Image, Result};

use smallvec::{smallvec, SmallVec};

use crate::sys::{self, Segment, Segments, IOV_MAX};
use crate::zero::ZeroLadder;
use crate::ALIGN;
use crate::{Command, Data, Op, Request};

/// One contiguous piece of a read or write, in one file.
struct Piece {
    write: bool,
    dsync: bool,
    direct: bool,
    file: usize,
    offset: u64,
    job: usize,
    seg: Segment,
}

/// A read or write being mapped: its caller's key and what of the request the mapping needs.
#[derive(Clone, Copy)]
struct Io {
    key: usize,
    offset: u64,
    len: u64,
    write: bool,
    fua: bool,
}

/// One vectored call: pieces contiguous in one file, all reads or all writes.
///
/// Its segments point into the buffers (or lent memory) of the requests it
/// was planned from: performing it is `unsafe`, and sound only while those
/// requests are alive and nothing else touches their data.
/// The jobs of a run's segments, in order (a job may repeat).
pub(crate) type Jobs = SmallVec<[usize; 2]>;

pub(crate) struct Run {
    pub write: bool,
    pub dsync: bool,
    /// Goes to the image's O_DIRECT file (everything about it is aligned).
    pub direct: bool,
    pub file: usize,
    pub offset: u64,
    pub segs: Segments,
    /// The job each segment belongs to.
    pub jobs: Jobs,
}

impl Run {
    pub fn len(&self) -> usize {
        self.segs.iter().map(|s| s.len).sum()
    }
}

#[derive(Clone)]
pub(crate) struct Planner {
    pub image: Arc<dyn Image>,
    pub sync: bool,
    pub coalesce: bool,
    /// Injected failures (tests only): `None` unless `VDISK_FAULTS` was set.
    pub faults: Option<Arc<crate::faults::Faults>>,
    /// The written file lives on FUSE, where `RWF_DSYNC` may never reach the
    /// file system (see [`sys::on_fuse`]): a durable write is followed by an
    /// explicit fdatasync.
    pub dsync_unreliable: bool,
    /// What each file refused of the zero ladder (shared by the device's planners).
    pub zeros: Arc<ZeroLadder>,
    /// The device's dirty maps, marked by every write completed here.
    pub observers: Arc<crate::Observers>,
    /// The device's image slot and the generation this planner serves (see `swap`).
    pub slot: Option<(Arc<crate::swap::Slot>, u64)>,
    extents: Vec<Extent>,
    /// Reads mapped by an image that pins them ([`Image::pins_reads`]), to
    /// be released with [`Planner::release_reads`] once performed.
    pinned: Vec<(u64, u64)>,
}

impl Planner {
    /// A planner with a zero ladder of its own (one that remembers nothing yet).
    pub fn new(image: Arc<dyn Image>, sync: bool, coalesce: bool) -> Self {
        let zeros = Arc::new(ZeroLadder::new(image.files().len()));
        Self::with_zeros(image, sync, coalesce, zeros)
    }

    /// A planner sharing a device's zero ladder.
    pub fn with_zeros(image: Arc<dyn Image>, sync: bool, coalesce: bool, zeros: Arc<ZeroLadder>) -> Self {
        Planner {
            image,
            sync,
            coalesce,
            faults: None,
            dsync_unreliable: false,
            zeros,
            observers: Arc::default(),
            slot: None,
            extents: Vec::new(),
            pinned: Vec::new(),
        }
    }

    /// A planner for what `slot` serves now, following it from then on.
    pub fn for_slot(slot: &Arc<crate::swap::Slot>, sync: bool, coalesce: bool) -> Self {
        let (cur, generation) = slot.get_with_generation();
        let mut planner = Self::with_zeros(cur.image.clone(), sync, coalesce, cur.zeros.clone());
        planner.dsync_unreliable = cur.dsync_unreliable;
        planner.slot = Some((slot.clone(), generation));
        planner
    }

    /// Takes up the device's new image if it was replaced. Workers call it
    /// each time they take requests: a replacement happens only while nothing
    /// of the device is in flight (`swap`), so none spans two images.
    #[inline]
    pub fn refresh(&mut self) {
        let Some((slot, generation)) = &mut self.slot else { return };
        if slot.generation() == *generation {
            return;
        }
        let (cur, now) = slot.get_with_generation();
        self.image = cur.image.clone();
        self.zeros = cur.zeros.clone();
        self.dsync_unreliable = cur.dsync_unreliable;
        *generation = now;
    }

    /// Maps the reads and writes among `jobs` (keyed by the caller's index) to
    /// runs of file I/O. Zero extents of reads are filled here; requests that
    /// cannot be mapped get their error. The runs point into the requests'
    /// buffers: the caller must keep those requests alive and untouched until
    /// every run is done.
    pub fn plan<'a>(&mut self, jobs: impl Iterator<Item = (usize, &'a mut Request)>) -> Vec<Run> {
        let mut pieces = Vec::with_capacity(jobs.size_hint().0);
        for (key, req) in jobs {
            let Request { cmd, offset, len, error, .. } = req;
            let (write, fua, data) = match cmd {
                Command::Read { data } => (false, false, data),
                Command::Write { data, fua } => (true, *fua, data),
                _ => continue,
            };
            let io = Io { key, offset: *offset, len: *len, write, fua };
            if let Err(e) = self.map_one(io, data, &mut pieces) {
                error.get_or_insert(e);
            }
        }
        self.merge(pieces)
    }

    fn map_one(&mut self, io: Io, data: &mut Data, pieces: &mut Vec<Piece>) -> Result<()> {
        let Io { key, offset, len, write, fua } = io;
        let op = if write { Op::Write { fua } } else { Op::Read };
        crate::validate::debug_assert_valid(op, offset, len, &*self.image);
        if let Some(e) = self.faults.as_ref().and_then(|f| f.check(write, offset, len)) {
            return Err(e);
        }
        match data {
            _ if data.len() as u64 == len => {}
            Data::Lent(_) => return Err(Error::invalid("lent memory does not match the request's length")),
            Data::Buf(_) if write => return Err(Error::invalid("write buffer does not match its length")),
            // The read fills every byte: a pooled buffer needs no zeroing.
            Data::Buf(buf) => *buf = crate::Buf::for_io(len as usize),
        }
        self.extents.clear();
        if write {
            self.image.prepare_write(offset, len)?;
            self.image.map_write(offset, len, &mut self.extents)?;
        } else {
            self.image.map_read(offset, len, &mut self.extents)?;
            if self.image.pins_reads() {
                self.pinned.push((offset, len));
            }
        }
        let dsync = write && (self.sync || fua);
        let can_direct = !self.image.direct_files().is_empty();
        let mut at = 0usize;
        for ext in &self.extents {
            let len = ext.len() as usize;
            let aligned = |v: usize| v.is_multiple_of(ALIGN);
            match *ext {
                Extent::Data { file, offset, .. } => {
                    let seg = data.segment(at, len);
                    pieces.push(Piece {
                        write,
                        dsync,
                        direct: can_direct && aligned(offset as usize) && aligned(len) && aligned(seg.ptr as usize),
                        file,
                        offset,
                        job: key,
                        seg,
                    })
                }
                Extent::Zero { .. } if !write => data.zero(at, len),
                Extent::Zero { .. } => {}
            }
            at += len;
        }
        Ok(())
    }

    fn merge(&self, mut pieces: Vec<Piece>) -> Vec<Run> {
        if self.coalesce {
            pieces.sort_by_key(|p| (p.write, p.dsync, p.direct, p.file, p.offset));
        }
        let mut runs: Vec<Run> = Vec::with_capacity(pieces.len());
        for p in pieces {
            if let Some(r) = runs.last_mut() {
                let next = r.offset + r.len() as u64;
                if self.coalesce
                    && (r.write, r.dsync, r.direct, r.file, next) == (p.write, p.dsync, p.direct, p.file, p.offset)
                    && r.segs.len() < IOV_MAX
                {
                    r.segs.push(p.seg);
                    r.jobs.push(p.job);
                    continue;
                }
            }
            runs.push(Run {
                write: p.write,
                dsync: p.dsync,
                direct: p.direct,
                file: p.file,
                offset: p.offset,
                segs: smallvec![p.seg],
                jobs: smallvec![p.job],
            });
        }
        runs
    }

    /// Performs a run with blocking vectored calls.
    ///
    /// # Safety
    /// The requests `run` was planned from are alive, and nothing else touches
    /// their data, until this returns (see [`Run`]).
    pub unsafe fn perform(&self, run: &Run) -> Result<()> {
        // SAFETY: the caller's contract above.
        unsafe { self.perform_segs(run, &run.segs, run.offset) }
    }

    /// Performs part of a run (segments starting at `offset`) with blocking calls.
    ///
    /// # Safety
    /// `segs` are (parts of) `run`'s, under [`Planner::perform`]'s contract.
    unsafe fn perform_segs(&self, run: &Run, segs: &[Segment], offset: u64) -> Result<()> {
        if let Some(target) = self.blocking_target(run.file) {
            // SAFETY: the caller's contract.
            return unsafe { perform_blocking(target, run, segs, offset) }.map_err(|e| self.run_error(run, e));
        }
        let file = self.file_of(run);
        let r = if run.write {
            // SAFETY: the segments point into data of live requests (the caller's contract).
            let r = unsafe { sys::pwritev_full(file, segs, offset, run.dsync) };
            if run.dsync && self.dsync_unreliable && !skips_data_sync() {
                r.and_then(|()| sys::fdatasync(file))
            } else {
                r
            }
        } else {
            // SAFETY: as above, and no two segments of a plan overlap.
            unsafe { sys::preadv_full(file, segs, offset) }
        };
        r.map_err(|e| self.run_error(run, e))
    }

    /// Finishes a run whose vectored call did not do it all: after a short
    /// transfer of `done` bytes, the rest with blocking calls; after a failure
    /// (or if that fails too), piece by piece, so that only the requests that
    /// really failed see an error (`fail(job, error)`).
    ///
    /// # Safety
    /// As for [`Planner::perform`].
    pub unsafe fn finish_run(&self, run: &Run, done: Option<usize>, mut fail: impl FnMut(usize, Error)) {
        if let Some(n) = done {
            let rest = sys::skip(&run.segs, n);
            // SAFETY: the rest of `run`'s segments, under the caller's contract.
            if unsafe { self.perform_segs(run, &rest, run.offset + n as u64) }.is_ok() {
                return;
            }
        }
        let mut at = run.offset;
        for (seg, &job) in run.segs.iter().zip(&run.jobs) {
            // SAFETY: one of `run`'s segments, under the caller's contract.
            if let Err(e) = unsafe { self.perform_segs(run, std::slice::from_ref(seg), at) } {
                fail(job, e);
            }
            at += seg.len as u64;
        }
    }

    /// Tries a read run from the page cache only. False when any of it would
    /// have to wait for the device (or the file system cannot tell).
    ///
    /// # Safety
    /// As for [`Planner::perform`].
    pub unsafe fn perform_cached(&self, run: &Run) -> std::io::Result<bool> {
        let file = self.file_of(run);
        // SAFETY: the run's segments point into data of live requests (the caller's contract).
        Ok(unsafe { sys::preadv_nowait(file, &run.segs, run.offset) }? == run.len())
    }

    /// Target `file`'s blocking calls, when it is not a file (an RBD image or
    /// an NBD export the device was switched onto: see [`Storage::blocking`]).
    ///
    /// [`Storage::blocking`]: vdisk_image::Storage::blocking
    pub fn blocking_target(&self, file: usize) -> Option<&dyn vdisk_image::BlockTarget> {
        if file < self.image.files().len() {
            return None;
        }
        self.image.target(file).and_then(|t| t.blocking())
    }

    /// The file a run goes to: the O_DIRECT twin for a direct run.
    pub fn file_of(&self, run: &Run) -> &File {
        if run.direct {
            &self.image.direct_files()[run.file]
        } else {
            &self.image.files()[run.file]
        }
    }

    pub fn run_error(&self, run: &Run, e: std::io::Error) -> Error {
        let what = if run.write { "write" } else { "read" };
        Error::io(e, format!("{what} of {} bytes at offset {} of {}", run.len(), run.offset, self.describe(run.file)))
            .op(what)
            .at(run.offset)
            .path(self.image.file_path(run.file))
    }

    pub fn describe(&self, file: usize) -> String {
        self.image.file_path(file).display().to_string()
    }

    /// Tells an image that pins its reads that the reads planned so far are
    /// performed (see [`Image::read_done`]); nothing for other images.
    pub fn release_reads(&mut self) {
        for (offset, len) in self.pinned.drain(..) {
            self.image.read_done(offset, len);
        }
    }

    /// Performs a request that is not a data transfer or a flush (those return
    /// `false`, untouched): trim, write zeroes, cache, block status.
    pub fn perform_other(&mut self, req: &mut Request) -> bool {
        crate::validate::debug_assert_valid(req.op(), req.offset, req.len, &*self.image);
        let r = match &mut req.cmd {
            Command::Read { .. } | Command::Write { .. } | Command::Flush => return false,
            Command::Trim { .. } | Command::WriteZeroes { .. } => {
                let r = self.deallocate(req);
                // Done or failed, its range may have changed (see `Observers`).
                self.observers.record(req.offset, req.len);
                r
            }
            Command::Cache => self.cache(req),
            Command::BlockStatus { max, runs } => self.image.allocation(req.offset, req.len, (*max).max(1), runs),
        };
        if let Err(e) = r {
            req.error.get_or_insert(e);
        }
        true
    }

    fn deallocate(&mut self, req: &Request) -> Result<()> {
        let (trim, no_hole) = match req.op() {
            Op::WriteZeroes { no_hole, .. } => (false, no_hole),
            _ => (true, false),
        };
        let rest = self.image.zero(req.offset, req.len, trim, no_hole)?;
        for (offset, len) in rest {
            self.zero_files(req, offset, len)?;
        }
        let durable = self.sync || req.op().fua();
        if durable {
            self.sync_files()?;
        }
        self.image.write_done(req.offset, req.len, durable)
    }

    /// Punches (TRIM) or zeroes (WRITE_ZEROES) the files under `len` bytes at `offset`.
    fn zero_files(&mut self, req: &Request, offset: u64, len: u64) -> Result<()> {
        self.image.prepare_write(offset, len)?;
        self.extents.clear();
        self.image.map_write(offset, len, &mut self.extents)?;
        for ext in &self.extents {
            let Extent::Data { file: f, offset, len } = *ext else { continue };
            let at = |e| {
                Error::io(e, format!("{} of {len} bytes at offset {offset} of {}", req.op().name(), self.describe(f)))
                    .op(req.op().name())
                    .at(offset)
                    .path(self.image.file_path(f))
            };
            if let Some(target) = self.blocking_target(f) {
                target.write_zeroes_at(offset, len).map_err(at)?;
                continue;
            }
            let file = &self.image.files()[f];
            match req.op() {
                Op::WriteZeroes { no_hole, fast_zero, .. } => self.zeros.zero(f, file, offset, len, no_hole, fast_zero),
                _ => self.zeros.trim(f, file, offset, len),
            }
            .map_err(at)?;
        }
        Ok(())
    }

    /// Tells the image a write reached its files (see [`Image::write_done`]);
    /// a failure there fails the request. Returns true when the write must be
    /// durable (FUA, sync mode): its data already is (`RWF_DSYNC`), and the
    /// caller makes the metadata durable once for the whole batch with
    /// [`Planner::settle_metadata`] before any reply goes out.
    pub fn write_done(&self, req: &mut Request) -> bool {
        let Command::Write { fua, .. } = req.cmd else {
            return false;
        };
        let durable = if req.error.is_some() {
            self.image.write_failed(req.offset, req.len);
            false
        } else if let Err(e) = self.image.write_done(req.offset, req.len, false) {
            req.error = Some(e);
            false
        } else {
            self.sync || fua
        };
        // Done or failed, its range may have changed; marked once the image
        // points at the new data, so a copy that reads after the mark sees it
        // (see `Observers`).
        self.observers.record(req.offset, req.len);
        durable
    }

    /// One metadata sync for the durable writes of a batch; if it fails, they fail.
    pub fn settle_metadata<'a>(&self, durable: impl Iterator<Item = &'a mut Request>) {
        let r = self.image.sync_metadata();
        if let Err(e) = r {
            for req in durable {
                req.error = Some(e.clone());
            }
        }
    }

    fn cache(&mut self, req: &Request) -> Result<()> {
        self.extents.clear();
        self.image.map_read(req.offset, req.len, &mut self.extents)?;
        for ext in &self.extents {
            if let Extent::Data { file, offset, len } = *ext {
                // A hint: only a file has a page cache to fill.
                if let Some(vdisk_image::Storage::File(f)) = self.image.target(file) {
                    sys::readahead(f, offset, len);
                }
            }
        }
        if self.image.pins_reads() {
            self.image.read_done(req.offset, req.len);
        }
        Ok(())
    }

    /// Syncs file 0, the only one writes reach (the others, such as a COW
    /// overlay's backing file, are read-only).
    fn sync_files(&self) -> Result<()> {
        self.sync_data().map_err(|e| self.flush_error(e))
    }

    /// The data sync of target 0 (a file's fdatasync, librbd's flush), unless
    /// a test build was told to break durability ([`vdisk_image::breakage`])
    /// or the image has no target (the fuzzing image, which holds no data):
    /// then nothing.
    fn sync_data(&self) -> std::io::Result<()> {
        match self.image.target(0) {
            _ if skips_data_sync() => Ok(()),
            Some(vdisk_image::Storage::File(file)) => sys::fdatasync(file),
            Some(target) => target.sync(),
            None => Ok(()),
        }
    }

    /// Syncs the image's written file, then its metadata: data before the
    /// metadata that points at it. The one flush path: the thread engine runs
    /// it as is; the ring engine runs [`Planner::flush_begin`], its own
    /// `IORING_OP_FSYNC` of file 0, then [`Planner::flush_end`].
    pub fn flush(&self) -> Result<()> {
        self.flush_begin()?;
        self.flush_end(self.sync_data())
    }

    /// What must pass before a flush syncs anything (an injected failure, in tests).
    pub fn flush_begin(&self) -> Result<()> {
        match self.faults.as_ref().and_then(|f| f.check_flush(&self.describe(0))) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The rest of a flush once file 0's data sync returned `synced`: its
    /// metadata, only if the data is durable.
    pub fn flush_end(&self, synced: std::io::Result<()>) -> Result<()> {
        synced.map_err(|e| self.flush_error(e))?;
        self.image.sync_metadata()
    }

    pub fn flush_error(&self, e: std::io::Error) -> Error {
        Error::io(e, format!("flush of {}", self.describe(0)))
    }
}

/// Performs `segs` of `run` at `offset` with `target`'s blocking calls, one
/// segment at a time; a durable write is followed by the target's sync.
///
/// # Safety
/// As for [`Planner::perform`]: the segments point into live requests' data
/// that nothing else touches until this returns, and no two overlap.
unsafe fn perform_blocking(
    target: &dyn vdisk_image::BlockTarget,
    run: &Run,
    segs: &[Segment],
    mut offset: u64,
) -> std::io::Result<()> {
    for seg in segs {
        if run.write {
            // SAFETY: the caller's contract: `seg` is readable memory of its length.
            let data = unsafe { std::slice::from_raw_parts(seg.ptr, seg.len) };
            target.write_at(data, offset)?;
        } else {
            // SAFETY: the caller's contract: `seg` is writable memory of its length, touched by nothing else.
            let data = unsafe { std::slice::from_raw_parts_mut(seg.ptr, seg.len) };
            target.read_at(data, offset)?;
        }
        offset += seg.len as u64;
    }
    if run.write && run.dsync && !skips_data_sync() {
        target.sync()?;
    }
    Ok(())
}

/// True only in a test build told to skip the data sync (VDISK_BREAK=skip-data-sync).
pub(crate) fn skips_data_sync() -> bool {
    vdisk_image::breakage::active(vdisk_image::breakage::Breakage::SkipDataSync)
}
