//! The one in-flight table and completion path of the engine, whatever moves
//! the bytes. A [`Backend`] (a core worker's io_uring, the thread engine's
//! blocking calls) only starts operations and hands back `(key, result)`
//! pairs; everything else is here, once:
//! - [`Flight`] owns every request it was given ([`Slot`]), and every iovec
//!   array an operation points at ([`OpKind`]), from the moment it is planned
//!   until the backend has returned the last operation that touches it;
//! - [`Flight::completed`] is the one completion path: a short or failed
//!   transfer is finished piece by piece, a FLUSH's metadata round follows its
//!   data sync, a write tells its image and its observers, and a request
//!   whose operations are all back moves to its lane's `done`, for the owner
//!   to settle ([`Lane::settle`]) and deliver;
//! - the ways out: [`Flight::cancel_device`] answers what needs no backend
//!   and asks the backend to give back the rest early, and
//!   [`Flight::leak_device`] forgets (never frees) what the backend would not
//!   give back in time.
//!
//! It must never drop a request, or an iovec array, while an operation of
//! the backend may still touch it: that is the whole reason it exists. Under
//! the `faults` feature every iovec range handed out is registered
//! (`faults::lend`) until its completion is reaped, and a buffer freed inside
//! a registered range is counted as a violation, which the tests check.
//!
//! A table serves one or many devices (a core worker's serves all of its
//! devices): slots and operations carry their device's id, so one device's
//! can be cancelled, counted or leaked without touching another's.

use std::sync::Arc;

use crate::plan::{Jobs, Planner, Run};
use crate::queue::{Job, Queue};
use crate::slab::Slab;
use crate::{Op, Request};

/// What a slot holds: a queued job, or (inline) a request the caller lends.
pub(crate) trait Held {
    fn req(&mut self) -> &mut Request;
}

impl Held for Job {
    fn req(&mut self) -> &mut Request {
        &mut self.0
    }
}

impl Held for &mut Request {
    fn req(&mut self) -> &mut Request {
        self
    }
}

/// What moves the bytes. It starts what the table asks and gives back each
/// operation's result under the key it was started with, exactly once
/// (`reap`); it owns no request and frees nothing of one.
pub(crate) trait Backend {
    /// Starts the vectored read or write `run` of `planner`'s image; with
    /// `sync`, a data sync of the same file follows it, linked, and completes
    /// under that key.
    ///
    /// # Safety
    /// `iov` and the memory it names stay valid, and untouched by anyone
    /// else, until the completion carrying `key` has been reaped (the table
    /// keeps them in its `ops` and `jobs` until then, or leaks them).
    unsafe fn rw(
        &mut self,
        planner: &Planner,
        run: &Run,
        iov: &[libc::iovec],
        key: u64,
        sync: Option<u64>,
    ) -> std::io::Result<()>;

    /// Whether [`Backend::rw`] reads its `iov` (false: it performs the run's
    /// segments itself, and the table builds no array unless the `faults`
    /// bookkeeping needs one).
    fn takes_iovecs(&self) -> bool {
        true
    }

    /// Starts the data sync of the image's written target (0) for a FLUSH,
    /// or after a durable write to a target that ignores RWF_DSYNC.
    /// Ok(false): nothing to sync (no target, or a test build told to skip
    /// it); no completion comes then.
    fn sync(&mut self, planner: &Planner, key: u64) -> std::io::Result<bool>;

    /// Whether a durable write to target `file` must be followed by a sync of
    /// it before its reply, having no RWF_DSYNC (an RBD image).
    fn sync_after_durable_write(&self, _planner: &Planner, _file: usize) -> bool {
        false
    }

    /// Whether the result of a read or write of target `file` counts its
    /// bytes, so that a short one is finished with blocking calls and a
    /// failed one retried piece by piece (a file); when not (librbd), any
    /// result not an error means the whole run was done, and an error fails
    /// each of the run's requests.
    fn counts_bytes(&self, _planner: &Planner, _file: usize) -> bool {
        true
    }

    /// Whether this backend does the TRIM and WRITE_ZEROES of `planner`'s
    /// image itself ([`Backend::zero`], one extent at a time; CACHE is then
    /// a hint it ignores), rather than the planner's blocking calls on files.
    fn zeroes_itself(&self, _planner: &Planner) -> bool {
        false
    }

    /// Starts a TRIM (`op`) or WRITE_ZEROES of `len` bytes at `offset` of
    /// target 0 (only asked when [`Backend::zeroes_itself`]).
    fn zero(&mut self, _planner: &Planner, _op: Op, _offset: u64, _len: u64, _key: u64) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }

    /// Asks for operation `key` back early (best effort: it still completes, maybe with ECANCELED).
    fn cancel(&mut self, key: u64);

    /// Appends every completion there is, as (key, bytes or 0, or -errno).
    fn reap(&mut self, out: &mut Vec<(u64, i64)>);
}

/// A request in flight, its device, and how many of its operations are still out.
pub(crate) struct Slot<J> {
    pub dev: u64,
    pub job: J,
    pub pending: usize,
    /// A durable write to a target without RWF_DSYNC: a sync follows once its data is there.
    pub sync_after: bool,
}

/// An operation the backend holds.
pub(crate) enum OpKind {
    /// A vectored read or write; `iov` is what the backend points at, owned
    /// here (and never read again) until the completion is reaped.
    Data {
        dev: u64,
        run: Run,
        #[allow(dead_code)]
        iov: Vec<libc::iovec>,
        jobs: Jobs,
    },
    /// The data sync of a FLUSH (`request`), or the one after a durable write
    /// to a target without RWF_DSYNC.
    Flush { dev: u64, job: [usize; 1], request: bool },
    /// A TRIM or WRITE_ZEROES of one extent, done by the backend.
    Zero { dev: u64, job: [usize; 1], offset: u64, len: u64 },
    /// The data sync linked after a durable write where the file system may
    /// drop RWF_DSYNC; each job of the write waits for it too.
    WriteSync { dev: u64, run: Run, jobs: Jobs },
    /// An operation of a failed device whose memory was leaked: the key stays
    /// taken until the backend's completion comes, which is then ignored.
    Leaked,
}

impl OpKind {
    pub fn dev(&self) -> Option<u64> {
        match self {
            OpKind::Data { dev, .. }
            | OpKind::Flush { dev, .. }
            | OpKind::WriteSync { dev, .. }
            | OpKind::Zero { dev, .. } => Some(*dev),
            OpKind::Leaked => None,
        }
    }

    pub fn jobs(&self) -> &[usize] {
        match self {
            OpKind::Data { jobs, .. } | OpKind::WriteSync { jobs, .. } => jobs,
            OpKind::Flush { job, .. } | OpKind::Zero { job, .. } => job,
            OpKind::Leaked => &[],
        }
    }
}

/// One device as a table sees it: its planner, and what is over but not yet delivered.
pub(crate) struct Lane<J> {
    pub planner: Planner,
    /// Its health (None inline: the caller's own requests).
    pub queue: Option<Arc<Queue>>,
    /// Its requests in the table.
    pub in_flight: usize,
    /// Finished, to be settled and delivered.
    pub done: Vec<J>,
    /// Positions in `done` of durable writes whose metadata is not yet durable.
    pub owed: Vec<usize>,
    /// The metadata round of a FLUSH whose data sync came back in this reap:
    /// another FLUSH back in the same reap needs no round of its own (every
    /// write it covers was done before that round), so a batch's FLUSHes
    /// cost one metadata sync, as one data sync on the thread engine.
    pub flushed: Option<vdisk_image::Result<()>>,
}

impl<J: Held> Lane<J> {
    pub fn new(planner: Planner, queue: Option<Arc<Queue>>) -> Self {
        Lane { planner, queue, in_flight: 0, done: Vec::new(), owed: Vec::new(), flushed: None }
    }

    pub fn failed(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| q.health().is_failed())
    }

    /// One metadata sync for every durable write finished since the last
    /// settle (before any of them is answered).
    pub fn settle(&mut self) {
        self.flushed = None;
        if self.owed.is_empty() {
            return;
        }
        let owed = std::mem::take(&mut self.owed);
        let done = &mut self.done;
        self.planner
            .settle_metadata(done.iter_mut().enumerate().filter(|(i, _)| owed.contains(i)).map(|(_, j)| j.req()));
    }
}

/// The in-flight table over backend `B`.
pub(crate) struct Flight<J, B> {
    pub backend: B,
    pub jobs: Slab<Slot<J>>,
    pub ops: Slab<OpKind>,
}

impl<J: Held, B: Backend> Flight<J, B> {
    pub fn new(backend: B) -> Self {
        Flight { backend, jobs: Slab::new(), ops: Slab::new() }
    }

    /// Takes in a batch of device `id`'s new requests: plans them, starts
    /// their operations, and finishes here what needs none (or failed to map).
    /// An error is the backend's own failure (its ring): what was started
    /// stays in the table, for the caller's way out.
    pub fn start(&mut self, d: &mut Lane<J>, id: u64, new: &mut Vec<J>) -> std::io::Result<()> {
        let runs = d.planner.plan(new.iter_mut().map(|j| j.req()).enumerate());
        // Each request holds one count of its own until everything it needs is
        // started: an operation that completes at once cannot finish it early.
        let keys: smallvec::SmallVec<[usize; 16]> =
            new.drain(..).map(|job| self.jobs.insert(Slot { dev: id, job, pending: 1, sync_after: false })).collect();
        d.in_flight += keys.len();
        for mut run in runs {
            for j in run.jobs.iter_mut() {
                *j = keys[*j];
            }
            self.start_run(d, id, run)?;
        }
        for &k in &keys {
            match self.jobs[k].job.req().op() {
                Op::Flush => self.start_flush(d, id, k)?,
                Op::Trim { .. } | Op::WriteZeroes { .. } if self.backend.zeroes_itself(&d.planner) => {
                    self.start_zero(d, id, k)?
                }
                // A hint, for a backend that does its own zeroing (librbd has no prefetch).
                Op::Cache if self.backend.zeroes_itself(&d.planner) => {}
                _ => {
                    d.planner.perform_other(self.jobs[k].job.req());
                }
            }
            self.release(d, k);
        }
        Ok(())
    }

    /// A TRIM or WRITE_ZEROES the backend does itself: one operation per
    /// extent it maps to; a durable one is followed by a sync.
    fn start_zero(&mut self, d: &Lane<J>, id: u64, k: usize) -> std::io::Result<()> {
        let req = self.jobs[k].job.req();
        let (op, offset, len) = (req.op(), req.offset, req.len);
        crate::validate::debug_assert_valid(op, offset, len, &*d.planner.image);
        let mut extents = Vec::new();
        if let Err(e) = d.planner.image.map_write(offset, len, &mut extents) {
            req.error = Some(e);
            return Ok(());
        }
        self.jobs[k].sync_after = d.planner.sync || op.fua();
        for ext in extents {
            let vdisk_image::Extent::Data { offset, len, .. } = ext else { continue };
            let key = self.ops.insert(OpKind::Zero { dev: id, job: [k], offset, len });
            self.jobs[k].pending += 1;
            if let Err(e) = self.backend.zero(&d.planner, op, offset, len, key as u64) {
                self.ops.remove(key);
                self.jobs[k].pending -= 1;
                return Err(e);
            }
        }
        Ok(())
    }

    /// One vectored read or write (and its linked data sync where RWF_DSYNC may be dropped).
    fn start_run(&mut self, d: &Lane<J>, id: u64, run: Run) -> std::io::Result<()> {
        let mut jobs = run.jobs.clone();
        jobs.dedup();
        let linked = run.write && run.dsync && d.planner.dsync_unreliable && !crate::plan::skips_data_sync();
        let sync_after = run.write && run.dsync && self.backend.sync_after_durable_write(&d.planner, run.file);
        for &j in &jobs {
            self.jobs[j].pending += if linked { 2 } else { 1 };
            self.jobs[j].sync_after |= sync_after;
        }
        // On the heap, never inline in the table: the slab may move its entries
        // while the backend still reads the array.
        let iov: Vec<libc::iovec> = if self.backend.takes_iovecs() || d.planner.faults.is_some() {
            run.segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect()
        } else {
            Vec::new()
        };
        if let Some(f) = &d.planner.faults {
            f.lend(&iov);
        }
        // The linked data sync keeps its own copy of the run's place, for error messages.
        let sync = if linked {
            let place = Run { segs: Default::default(), jobs: Jobs::new(), ..run };
            Some(self.ops.insert(OpKind::WriteSync { dev: id, run: place, jobs: jobs.clone() }))
        } else {
            None
        };
        let op = self.ops.insert(OpKind::Data { dev: id, run, iov, jobs });
        let OpKind::Data { run, iov, .. } = &self.ops[op] else { unreachable!("just inserted") };
        // SAFETY: the iovecs live in `ops[op]` and point into buffers of requests in
        // `jobs`; both stay there until this op's completion is reaped (or are leaked).
        let r = unsafe { self.backend.rw(&d.planner, run, iov, op as u64, sync.map(|s| s as u64)) };
        if r.is_err() {
            // The backend never took them.
            self.unlend(d, op);
            if let Some(s) = sync {
                self.ops.remove(s);
            }
        }
        r
    }

    /// A FLUSH: the data sync of the written file (its metadata round follows
    /// in `completed`), or an error now when an injected failure says so.
    fn start_flush(&mut self, d: &Lane<J>, id: u64, k: usize) -> std::io::Result<()> {
        if let Err(e) = d.planner.flush_begin() {
            // Failed before the sync, like a failed sync: no metadata round.
            self.jobs[k].job.req().error = Some(e);
            return Ok(());
        }
        let op = self.ops.insert(OpKind::Flush { dev: id, job: [k], request: true });
        match self.backend.sync(&d.planner, op as u64) {
            Ok(true) => {
                self.jobs[k].pending += 1;
                Ok(())
            }
            Ok(false) => {
                // Nothing to sync: only the metadata round.
                self.ops.remove(op);
                if let Err(e) = d.planner.flush_end(Ok(())) {
                    self.jobs[k].job.req().error = Some(e);
                }
                Ok(())
            }
            Err(e) => {
                self.ops.remove(op);
                Err(e)
            }
        }
    }

    /// Removes a data operation the backend never took, or whose completion was reaped.
    fn unlend(&mut self, d: &Lane<J>, op: usize) -> Option<OpKind> {
        let kind = self.ops.remove(op)?;
        if let (OpKind::Data { iov, .. }, Some(f)) = (&kind, &d.planner.faults) {
            f.returned(iov);
        }
        Some(kind)
    }

    /// After a panic unwound through a backend that holds nothing once its
    /// caller unwinds (blocking calls): the operations' memory is no longer
    /// lent (for the `faults` bookkeeping), and the table is emptied.
    pub fn forget_ops(&mut self, d: &Lane<J>) {
        for op in self.ops.drain() {
            if let (OpKind::Data { iov, .. }, Some(f)) = (&op, &d.planner.faults) {
                f.returned(iov);
            }
        }
    }

    /// The device a completion under `key` is for, if any (None: not an
    /// operation of this table, or one whose memory was leaked: then it is
    /// removed here, its key free again).
    pub fn device_of(&mut self, key: u64) -> Option<u64> {
        let k = key as usize;
        let dev = self.ops.get_mut(k)?.dev();
        if dev.is_none() {
            self.ops.remove(k);
        }
        dev
    }

    /// The completion (result `res`) of operation `key` of device `d`.
    /// A failed device's operations only release their requests.
    pub fn completed(&mut self, d: &mut Lane<J>, key: u64, res: i64) {
        let Some(kind) = self.unlend(d, key as usize) else { return };
        if d.failed() {
            for &j in kind.jobs() {
                self.release(d, j);
            }
            return;
        }
        match kind {
            OpKind::Data { run, iov: _, jobs, .. } if !self.backend.counts_bytes(&d.planner, run.file) => {
                if res < 0 {
                    let e = d.planner.run_error(&run, std::io::Error::from_raw_os_error(-res as i32));
                    for &j in &jobs {
                        self.jobs[j].job.req().error.get_or_insert(e.clone());
                    }
                }
                for j in jobs {
                    self.release(d, j);
                }
            }
            OpKind::Data { run, iov: _, jobs, .. } => {
                if res < 0 || res as usize != run.len() {
                    let slots = &mut self.jobs;
                    let fail = |job: usize, e| {
                        slots[job].job.req().error.get_or_insert(e);
                    };
                    // SAFETY: the run's requests are in `jobs` until they are released,
                    // after this; the backend is done with them (the completion is reaped).
                    unsafe { d.planner.finish_run(&run, usize::try_from(res).ok(), fail) };
                }
                for j in jobs {
                    self.release(d, j);
                }
            }
            OpKind::Flush { job: [job], request: true, .. } => {
                let r = match &d.flushed {
                    Some(round) if res >= 0 => round.clone(),
                    _ if res < 0 => d.planner.flush_end(Err(std::io::Error::from_raw_os_error(-res as i32))),
                    _ => d.flushed.insert(d.planner.flush_end(Ok(()))).clone(),
                };
                if let Err(e) = r {
                    self.jobs[job].job.req().error.get_or_insert(e);
                }
                self.release(d, job);
            }
            OpKind::Flush { job: [job], request: false, .. } => {
                if res < 0 {
                    let e = d.planner.flush_error(std::io::Error::from_raw_os_error(-res as i32));
                    self.jobs[job].job.req().error.get_or_insert(e);
                }
                self.release(d, job);
            }
            OpKind::Zero { job: [job], offset, len, .. } => {
                let req = self.jobs[job].job.req();
                if res < 0 {
                    let e = std::io::Error::from_raw_os_error(-res as i32);
                    let what = req.op().name();
                    let e = vdisk_image::Error::io(
                        e,
                        format!("{what} of {len} bytes at offset {offset} of {}", d.planner.describe(0)),
                    )
                    .op(what)
                    .at(offset);
                    req.error.get_or_insert(e);
                }
                // Done or failed, its range may have changed (see `Observers`).
                d.planner.observers.record(offset, len);
                self.release(d, job);
            }
            OpKind::WriteSync { run, jobs, .. } => {
                // ECANCELED: the write failed or was short, and `finish_run` finished
                // it with blocking calls, which sync it themselves (`dsync_unreliable`).
                if res < 0 && res != -(libc::ECANCELED as i64) {
                    let e = d.planner.run_error(&run, std::io::Error::from_raw_os_error(-res as i32));
                    for &j in &jobs {
                        self.jobs[j].job.req().error.get_or_insert(e.clone());
                    }
                }
                for j in jobs {
                    self.release(d, j);
                }
            }
            OpKind::Leaked => {}
        }
    }

    /// One operation of request `k` is back (or it started all it needs).
    fn release(&mut self, d: &mut Lane<J>, k: usize) {
        let Some(slot) = self.jobs.get_mut(k) else { return };
        slot.pending = slot.pending.saturating_sub(1);
        if slot.pending == 0 && slot.sync_after && slot.job.req().error.is_none() && !d.failed() {
            // A durable write (or zeroing) on a target without RWF_DSYNC: its sync, then its reply.
            slot.sync_after = false;
            let op = self.ops.insert(OpKind::Flush { dev: slot.dev, job: [k], request: false });
            match self.backend.sync(&d.planner, op as u64) {
                Ok(true) => {
                    self.jobs[k].pending += 1;
                    return;
                }
                Ok(false) => {
                    self.ops.remove(op);
                }
                Err(e) => {
                    self.ops.remove(op);
                    let e = d.planner.flush_error(e);
                    self.jobs[k].job.req().error.get_or_insert(e);
                }
            }
        }
        let slot = &mut self.jobs[k];
        if slot.pending == 0 {
            if !d.failed() && d.planner.write_done(slot.job.req()) {
                d.owed.push(d.done.len());
            }
            self.finish(d, k);
        }
    }

    /// Request `k` is over: out of the table, into its lane's `done`.
    fn finish(&mut self, d: &mut Lane<J>, k: usize) {
        let slot = self.jobs.remove(k).expect("a live slab key");
        d.in_flight -= 1;
        d.done.push(slot.job);
    }

    /// A way out for device `id` (it failed, or it stops): finishes now every
    /// request of it that waits for no operation (with its error or EIO, as
    /// the caller answers `done`), and asks the backend to give back early
    /// every operation of it still out. Those come back through `completed`
    /// (which only releases a failed device's requests) or are leaked.
    /// Returns how many operations are still out.
    pub fn cancel_device(&mut self, d: &mut Lane<J>, id: u64) -> usize {
        // Recount what each of its requests waits for: a panic may have come
        // between an operation's start and its count.
        let mut refs: std::collections::HashMap<usize, usize> = Default::default();
        let mut cancel = Vec::new();
        for (key, op) in self.ops.iter() {
            if op.dev() == Some(id) {
                cancel.push(key);
                for &j in op.jobs() {
                    *refs.entry(j).or_default() += 1;
                }
            }
        }
        let mut orphans = Vec::new();
        for (k, slot) in self.jobs.iter_mut() {
            if slot.dev == id {
                slot.pending = refs.get(&k).copied().unwrap_or(0);
                if slot.pending == 0 {
                    orphans.push(k);
                }
            }
        }
        for k in orphans {
            self.finish(d, k);
        }
        for &key in &cancel {
            self.backend.cancel(key as u64);
        }
        cancel.len()
    }

    /// The backend still holds operations of device `id`: their memory
    /// (iovecs) and the data of its requests in flight are forgotten, never
    /// freed; the keys stay taken until their completions come. Returns the
    /// requests (their data taken out and forgotten by the caller's
    /// `fail_leaked`) and how many operations were leaked.
    pub fn leak_device(&mut self, d: &mut Lane<J>, id: u64) -> (Vec<J>, usize) {
        let mut ops = 0;
        for (_, op) in self.ops.iter_mut() {
            if op.dev() == Some(id) {
                std::mem::forget(std::mem::replace(op, OpKind::Leaked));
                ops += 1;
            }
        }
        let keys: Vec<usize> = self.jobs.iter().filter(|(_, s)| s.dev == id).map(|(k, _)| k).collect();
        let held: Vec<J> = keys.into_iter().filter_map(|k| self.jobs.remove(k)).map(|s| s.job).collect();
        d.in_flight -= held.len();
        (held, ops)
    }
}
