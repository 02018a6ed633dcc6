//! The RBD engine: one event loop per device whose image has an RBD target.
//! Everything the loop takes from the device's queue is planned like any
//! batch (the same [`Planner`]: mapping, merging of contiguous pieces) and
//! becomes a batch of librbd AIO submissions; librbd signals finished
//! operations on an eventfd and the loop collects them in batches with
//! `rbd_poll_io_events`, then hands the requests back through the same
//! `deliver` path as the other engines.
//!
//! Pieces on an ordinary file (a COW overlay's own file, whose backing is an
//! RBD snapshot) are done with the planner's blocking calls in the loop.
//!
//! Durability on RBD: a write completes once librbd has it (in librbd's
//! cache when the cluster enables it, as Pacific does by default: the part
//! the page cache plays for files). FLUSH is
//! `rbd_aio_flush`, which covers every write completed before it was
//! submitted; FUA and sync-mode writes are emulated as the write, then a
//! flush, before the reply. WRITE_ZEROES is `rbd_aio_write_zeroes`, or with
//! NO_HOLE written zeros; TRIM is `rbd_aio_discard`.
//!
//! The in-flight table (`ops`, `jobs`) owns every request, and with it every
//! buffer librbd may touch, until that operation's completion is collected.
//! On every way out of the loop that table is given back, never dropped: at
//! shutdown nothing is in flight; a panic (caught at the thread's edge) fails
//! the device, and the loop collects what librbd still holds for up to
//! [`ABANDON_WAIT`] (librbd AIO cannot be cancelled) and answers it with EIO;
//! what is not back by then is leaked (its data and iovecs forgotten, the
//! requests answered with EIO and an empty buffer). The loop's one sleep,
//! `poll`, retries EINTR; reading the eventfds never blocks.
//! One loop per image, because librbd delivers an image's completions to one
//! eventfd; librbd's own threads do the work, so one loop keeps many
//! operations in flight.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use vdisk_image::{Extent, RbdImage};

use crate::health;
use crate::health::ABANDON_WAIT;
use crate::plan::{Jobs, Planner, Run};
use crate::queue::{Job, Queue, Waker};
use crate::slab::Slab;
use crate::wake::EventFd;
use crate::Op;

/// A request in flight, how many of its operations are outstanding, and
/// whether it still owes a flush before its reply (FUA on RBD).
struct JobSlot {
    job: Job,
    pending: usize,
    flush_after: bool,
}

enum OpKind {
    /// A vectored read or write; `iov` (read by librbd during submission) and
    /// the requests in `jobs` (whose buffers it points at) stay until collected.
    Data { run: Run, _iov: Vec<libc::iovec>, jobs: Jobs },
    /// A flush for a FLUSH request or after a FUA write.
    Flush { job: usize },
    /// A discard, zeroing or zero write of part of a request.
    Other { job: usize, offset: u64, len: u64 },
}

/// Zeros for WRITE_ZEROES with NO_HOLE: static, so valid for any operation's life.
static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

pub(crate) struct RbdWorker {
    planner: Planner,
    queue: Arc<Queue>,
    waker: Arc<Waker>,
    /// The eventfd librbd signals when operations of the image finish.
    events: OwnedFd,
    /// Taken from the queue, not yet started (a field, so a panic does not lose them).
    new: Vec<Job>,
    jobs: Slab<JobSlot>,
    ops: Slab<OpKind>,
    done: Vec<Job>,
    batch: usize,
    polled: Vec<(u64, i64)>,
}

fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd that nobody else owns, or -1 (checked).
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh, valid fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Empties an eventfd (non-blocking; nothing to read is fine).
fn drain(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd this worker owns.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// True when the image has an RBD target the engine must drive with librbd.
pub(crate) fn uses_rbd(image: &dyn vdisk_image::Image) -> bool {
    image.rbd(0).is_some() || image.rbd(1).is_some()
}

impl RbdWorker {
    pub fn new(planner: Planner, queue: Arc<Queue>, batch: usize) -> std::io::Result<Self> {
        let events = eventfd()?;
        for file in 0..2 {
            if let Some(r) = planner.image.rbd(file) {
                r.notify_completions(events.as_raw_fd()).map_err(|e| std::io::Error::other(e.report().to_string()))?;
            }
        }
        let waker = Arc::new(Waker { efd: EventFd::new()?, idle: false.into() });
        // The loop empties it after every sleep, readable or not: it must not block.
        // SAFETY: fcntl on a descriptor this worker owns, with integer arguments only.
        if unsafe { libc::fcntl(waker.efd.fd(), libc::F_SETFL, libc::O_NONBLOCK) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        queue.add_waker(waker.clone());
        Ok(RbdWorker {
            planner,
            queue,
            waker,
            events,
            new: Vec::with_capacity(batch.max(1)),
            jobs: Slab::new(),
            ops: Slab::new(),
            done: Vec::new(),
            batch: batch.max(1),
            polled: Vec::new(),
        })
    }

    /// Serves until the queue is closed and drained; a panic fails the
    /// device (see the module's notes) and the loop then answers the
    /// device's requests with EIO until it stops.
    pub fn run(mut self) {
        let Err(p) = catch_unwind(AssertUnwindSafe(|| self.serve())) else { return };
        self.queue.health().fail(format!("its librbd loop stopped on a {}", health::panic_message(&*p)));
        if !catch_unwind(AssertUnwindSafe(|| self.abandon())).unwrap_or(false) {
            self.leak();
        }
        self.queue.serve_failed();
    }

    fn serve(&mut self) {
        loop {
            let open = self.queue.try_take(self.batch, &mut self.new);
            let took = !self.new.is_empty();
            if took {
                self.start();
            }
            let collected = self.collect();
            self.queue.deliver(&mut self.done);
            if !open && self.jobs.is_empty() {
                break;
            }
            if took || collected {
                continue;
            }
            // About to sleep: say so, then look once more so no push is missed.
            self.waker.idle.store(true, Ordering::SeqCst);
            self.queue.try_take(self.batch, &mut self.new);
            if self.new.is_empty() {
                self.sleep(-1);
            }
            self.waker.idle.store(false, Ordering::SeqCst);
            drain(self.waker.efd.fd());
            if !self.new.is_empty() {
                self.start();
            }
        }
    }

    /// Waits until a request is pushed or an operation finishes (or, with a
    /// timeout in milliseconds, until it runs out). EINTR is waited out.
    fn sleep(&self, timeout_ms: i32) {
        let mut fds = [
            libc::pollfd { fd: self.waker.efd.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.events.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfd entries on fds this worker owns.
        while unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) } < 0 && timeout_ms < 0 {
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
    }

    /// After a panic: answers with EIO what the loop holds and collects what
    /// librbd still has for up to [`ABANDON_WAIT`], answering the device's new
    /// requests meanwhile. True when everything came back (then the requests
    /// in flight are answered too); false when the loop must [`RbdWorker::leak`].
    fn abandon(&mut self) -> bool {
        self.waker.idle.store(false, Ordering::SeqCst);
        let mut held: Vec<Job> = self.new.drain(..).collect();
        held.append(&mut self.done);
        self.queue.fail(&mut held);
        let deadline = Instant::now() + ABANDON_WAIT;
        let mut none = Vec::new();
        while !self.ops.is_empty() && Instant::now() < deadline {
            self.queue.try_take(1, &mut none);
            self.sleep(20);
            drain(self.events.as_raw_fd());
            drain(self.waker.efd.fd());
            for file in 0..2 {
                if let Some(r) = self.planner.image.rbd(file) {
                    r.poll_completions(64, &mut self.polled);
                }
            }
            for (key, _) in self.polled.drain(..) {
                self.ops.remove(key as usize);
            }
        }
        if !self.ops.is_empty() {
            return false;
        }
        let mut held: Vec<Job> = self.jobs.drain().map(|slot| slot.job).collect();
        self.queue.fail(&mut held);
        true
    }

    /// librbd still holds operations of this loop: their iovecs and the data
    /// of every request in flight are leaked, never freed; the requests are
    /// answered with EIO.
    fn leak(&mut self) {
        let (ops, name) = (self.ops.len(), self.planner.describe(0));
        std::mem::forget(std::mem::take(&mut self.ops));
        let mut held: Vec<Job> = self.jobs.drain().map(|slot| slot.job).collect();
        held.extend(self.new.drain(..).chain(self.done.drain(..)));
        log::error!(
            "{name}: {ops} librbd operation(s) still out {ABANDON_WAIT:?} after the failure; their memory is \
             leaked, never freed, and {} request(s) answered with EIO",
            held.len()
        );
        self.queue.fail_leaked(&mut held);
    }

    fn rbd(&self, file: usize) -> &RbdImage {
        self.planner.image.rbd(file).expect("an RBD target")
    }

    /// Submits a batch of new requests (or completes here what needs no I/O or failed to map).
    fn start(&mut self) {
        let runs = self.planner.plan(self.new.iter_mut().map(|(r, _, _)| r).enumerate());
        // Each job starts with one pending count of its own, dropped once everything it
        // needs is submitted: an operation that fails (or finishes) at once can then not
        // finish the job while more of it is still to be submitted.
        let keys: Vec<usize> =
            self.new.drain(..).map(|job| self.jobs.insert(JobSlot { job, pending: 1, flush_after: false })).collect();
        for mut run in runs {
            for j in run.jobs.iter_mut() {
                *j = keys[*j];
            }
            let mut jobs = run.jobs.clone();
            jobs.dedup();
            if self.planner.image.rbd(run.file).is_none() {
                // An ordinary file beside the RBD target: blocking, as the thread engine does it.
                // SAFETY: the run points into requests held in `self.jobs`, alive and
                // untouched by anyone else until this blocking call returns.
                if let Err(e) = unsafe { self.planner.perform(&run) } {
                    for &j in &jobs {
                        self.jobs[j].job.0.error.get_or_insert(e.clone());
                    }
                }
                continue;
            }
            for &j in &jobs {
                let slot = &mut self.jobs[j];
                slot.pending += 1;
                slot.flush_after |= run.dsync;
            }
            let iov: Vec<libc::iovec> =
                run.segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect();
            let (file, write, offset) = (run.file, run.write, run.offset);
            let op = self.ops.insert(OpKind::Data { run, _iov: iov, jobs });
            let OpKind::Data { _iov: iov, .. } = &self.ops[op] else { unreachable!("just inserted") };
            let rbd = self.planner.image.rbd(file).expect("an RBD target");
            let r = if write {
                // SAFETY: the iovecs and the request buffers they point into are owned by
                // `ops[op]` and `jobs` until this op's completion is collected.
                unsafe { rbd.aio_writev(iov, offset, op as u64) }
            } else {
                // SAFETY: as above; no two segments of a plan overlap.
                unsafe { rbd.aio_readv(iov, offset, op as u64) }
            };
            if let Err(e) = r {
                self.op_done(op, -(e.raw_os_error().unwrap_or(libc::EIO) as i64));
            }
        }
        for &k in &keys {
            self.start_other(k);
            self.release(k);
        }
    }

    /// Starts what a request needs besides data runs: a flush, a discard, zeroes.
    fn start_other(&mut self, k: usize) {
        let req = &self.jobs[k].job.0;
        let (op, offset, len) = (req.op(), req.offset, req.len);
        let on_rbd = self.planner.image.rbd(0).is_some();
        match op {
            Op::Read | Op::Write { .. } => {}
            Op::Flush if on_rbd => self.submit(k, OpKind::Flush { job: k }),
            Op::Flush => {
                let r = self.planner.flush();
                if let Err(e) = r {
                    self.jobs[k].job.0.error = Some(e);
                }
            }
            Op::Trim { .. } | Op::WriteZeroes { .. } if on_rbd => {
                crate::validate::debug_assert_valid(op, offset, len, &*self.planner.image);
                let mut extents = Vec::new();
                if let Err(e) = self.planner.image.map_write(offset, len, &mut extents) {
                    self.jobs[k].job.0.error = Some(e);
                    return;
                }
                self.jobs[k].flush_after = self.planner.sync || op.fua();
                for ext in extents {
                    if let Extent::Data { offset, len, .. } = ext {
                        self.submit(k, OpKind::Other { job: k, offset, len });
                    }
                }
            }
            // A hint; librbd has no prefetch call.
            Op::Cache if on_rbd => {}
            _ => {
                let slot = &mut self.jobs[k];
                self.planner.perform_other(&mut slot.job.0);
            }
        }
    }

    /// Submits one operation for job `k`.
    fn submit(&mut self, k: usize, kind: OpKind) {
        self.jobs[k].pending += 1;
        let op_code = self.jobs[k].job.0.op();
        let r = match &kind {
            OpKind::Flush { .. } => {
                let op = self.ops.insert(kind);
                (op, self.rbd(0).aio_flush(op as u64))
            }
            &OpKind::Other { offset, len, .. } => {
                let op = self.ops.insert(kind);
                let rbd = self.rbd(0);
                let r = match op_code {
                    Op::Trim { .. } => rbd.aio_discard(offset, len, op as u64),
                    Op::WriteZeroes { no_hole: true, .. } => {
                        let chunk = ZEROS.len() as u64;
                        let mut iov = Vec::with_capacity(len.div_ceil(chunk) as usize);
                        let mut left = len;
                        while left > 0 {
                            let n = left.min(chunk);
                            iov.push(libc::iovec { iov_base: ZEROS.as_ptr() as *mut _, iov_len: n as usize });
                            left -= n;
                        }
                        // SAFETY: the iovecs point at static zeros, valid for ever and
                        // only read by a write.
                        unsafe { rbd.aio_writev(&iov, offset, op as u64) }
                    }
                    _ => rbd.aio_write_zeroes(offset, len, op as u64),
                };
                (op, r)
            }
            OpKind::Data { .. } => unreachable!("data runs are submitted by start"),
        };
        if let (op, Err(e)) = r {
            self.op_done(op, -(e.raw_os_error().unwrap_or(libc::EIO) as i64));
        }
    }

    /// Collects every finished operation. True when there were any.
    fn collect(&mut self) -> bool {
        let mut any = false;
        loop {
            drain(self.events.as_raw_fd());
            let mut polled = std::mem::take(&mut self.polled);
            let mut n = 0;
            for file in 0..2 {
                if let Some(r) = self.planner.image.rbd(file) {
                    n += r.poll_completions(64, &mut polled);
                }
            }
            for (key, res) in polled.drain(..) {
                self.op_done(key as usize, res);
            }
            self.polled = polled;
            if n == 0 {
                return any;
            }
            any = true;
        }
    }

    /// One operation finished with `res` (bytes or 0, or a negative errno).
    fn op_done(&mut self, op: usize, res: i64) {
        match self.ops.remove(op).expect("a live operation key") {
            OpKind::Data { run, _iov, jobs } => {
                if res < 0 {
                    for &j in &jobs {
                        let e = self.planner.run_error(&run, std::io::Error::from_raw_os_error((-res) as i32));
                        self.jobs[j].job.0.error.get_or_insert(e);
                    }
                }
                for j in jobs {
                    self.release(j);
                }
            }
            OpKind::Flush { job } => {
                if res < 0 {
                    let e = self.rbd(0).error("flush", 0, 0, res);
                    self.jobs[job].job.0.error.get_or_insert(e);
                }
                self.release(job);
            }
            OpKind::Other { job, offset, len } => {
                if res < 0 {
                    let what =
                        if matches!(self.jobs[job].job.0.op(), Op::Trim { .. }) { "trim" } else { "write zeroes" };
                    let e = self.rbd(0).error(what, offset, len, res);
                    self.jobs[job].job.0.error.get_or_insert(e);
                }
                self.release(job);
            }
        }
    }

    fn release(&mut self, k: usize) {
        let slot = &mut self.jobs[k];
        slot.pending -= 1;
        if slot.pending == 0 {
            self.settle(k);
        }
    }

    /// A request whose operations are all done: it owes a flush (FUA), or its
    /// image hears of the write, and it is finished.
    fn settle(&mut self, k: usize) {
        let slot = &mut self.jobs[k];
        if slot.flush_after && slot.job.0.error.is_none() {
            slot.flush_after = false;
            self.submit(k, OpKind::Flush { job: k });
            return;
        }
        let durable = self.planner.write_done(&mut slot.job.0);
        if durable && slot.job.0.error.is_none() {
            // A COW overlay's bitmap, for a FUA write that went to its file.
            self.planner.settle_metadata(std::iter::once(&mut slot.job.0));
        }
        let slot = self.jobs.remove(k).expect("a live job key");
        self.done.push(slot.job);
    }
}
