//! The io_uring engine: one ring per queue thread. Everything the thread took
//! from the device's queue goes into the ring at once and is submitted with the
//! same `io_uring_enter` that waits for completions; completions are reaped as
//! a batch and delivered grouped by sink.
//!
//! The in-flight table (`ops`, `jobs`) owns every request, and with it every
//! buffer and iovec array the kernel may touch, until that operation's
//! completion has been reaped. All `unsafe` submission is in [`Ring::push`].
//!
//! The contract on every way out of the worker — the queue closed and
//! drained (shutdown), an error from `io_uring_enter` that is not EINTR nor a
//! full completion queue (see [`crate::ring`]), a panic anywhere in the loop
//! (caught at the thread's edge): nothing the kernel may still read or write
//! is ever freed. On shutdown nothing is in flight but the wake read, which is
//! cancelled and reaped. After a failure the device is failed (its requests
//! get EIO), everything in the ring is cancelled (`IORING_OP_ASYNC_CANCEL`,
//! any) and reaped for up to [`ABANDON_WAIT`]; what was reaped is answered
//! with EIO and freed as usual. If something is still in the kernel then, the
//! ring, the operations' iovecs, the wake buffer and the requests' data are
//! leaked (`mem::forget`), never dropped, and the requests are answered with
//! EIO and an empty buffer. The worker then answers every later request of
//! the device with EIO until the device stops.
//!
//! FLUSH is an `IORING_OP_FSYNC` (datasync) of the written file, not ordered against other
//! operations in the ring: it must cover only writes *completed* before it was
//! submitted, and those are already in the page cache. The image's metadata is
//! synced after the files' fsyncs complete. FUA and sync-mode writes carry
//! `RWF_DSYNC` on their SQE and still run in parallel. Where the kernel may
//! drop that flag (a file on FUSE, see [`crate::sys::on_fuse`]), a durable write is
//! linked to an `IORING_OP_FSYNC` (datasync) of its file, and completes only
//! with that fsync.

use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use vdisk_image::{Error, Result};

use crate::health;
use crate::plan::{Jobs, Planner, Run};
use crate::queue::{Job, Queue, Waker};
use crate::ring::Ring;
use crate::slab::Slab;
use crate::wake::EventFd;
use crate::Op;

/// Builds an SQE on file number `$file` of the image (its O_DIRECT twin when
/// `$direct`): the registered index when files are registered, else the fd.
macro_rules! on_file {
    ($w:expr, $file:expr, $direct:expr, |$f:ident| $build:expr) => {
        if $w.ring.fixed_files {
            let twin = if $direct { $w.planner.image.files().len() } else { 0 };
            let $f = types::Fixed(($file + twin) as u32);
            $build
        } else {
            let files = if $direct { $w.planner.image.direct_files() } else { $w.planner.image.files() };
            let $f = types::Fd(files[$file].as_raw_fd());
            $build
        }
    };
}

/// user_data of the eventfd read that wakes an idle ring.
const WAKE: u64 = u64::MAX;
/// user_data of the cancel of that read at exit, and of the cancel of everything after a failure.
const CANCEL: u64 = u64::MAX - 1;
/// How long a failed worker waits for the kernel to give back what it holds
/// before it leaks it (requests pushed meanwhile are answered as it waits).
pub(crate) const ABANDON_WAIT: Duration = Duration::from_secs(2);

/// How rings are set up.
#[derive(Debug, Clone, Copy)]
pub struct RingConfig {
    pub entries: u32,
    pub sqpoll: bool,
}

/// A request in flight and how many of its operations are still in the ring.
struct JobSlot {
    job: Job,
    pending: usize,
}

enum OpKind {
    /// A vectored read or write; `iov` is what the SQE points at, owned here
    /// (and never read again) until the completion is reaped.
    Data {
        run: Run,
        #[allow(dead_code)]
        iov: Vec<libc::iovec>,
        jobs: Jobs,
    },
    /// The fsync of one file for a FLUSH.
    Fsync { job: usize },
    /// The fdatasync linked after a durable O_DIRECT write where RWF_DSYNC
    /// is not carried; each job of the write waits for it too.
    WriteSync { run: Run, jobs: Jobs },
}

pub(crate) struct RingWorker {
    /// Dropped first (in `Drop`), once nothing is in flight; never when `leaked`.
    ring: ManuallyDrop<Ring>,
    /// Set when the kernel may still hold memory of this worker: the ring is never dropped.
    leaked: bool,
    planner: Planner,
    queue: Arc<Queue>,
    waker: Arc<Waker>,
    wake_buf: Box<u64>,
    /// A read of the eventfd into `wake_buf` is in the ring.
    wake_armed: bool,
    /// Taken from the queue, not yet in the ring (a field, so a panic does not lose them).
    new: Vec<Job>,
    jobs: Slab<JobSlot>,
    ops: Slab<OpKind>,
    /// Completions taken from the ring; those before `seen` are handled.
    cqes: Vec<(u64, i32)>,
    seen: usize,
    done: Vec<Job>,
    /// Positions in `done` of durable writes whose metadata is not yet durable.
    owed: Vec<usize>,
    batch: usize,
}

impl RingWorker {
    /// Builds a ring for `planner.image` (files registered when the kernel allows)
    /// and registers its waker with the queue.
    pub fn new(planner: Planner, queue: Arc<Queue>, batch: usize, cfg: RingConfig) -> std::io::Result<Self> {
        let mut builder = IoUring::builder();
        if cfg.sqpoll {
            builder.setup_sqpoll(1000);
        }
        let ring = builder.setup_cqsize(cfg.entries * 4).build(cfg.entries)?;
        // Registered as the buffered files, then their O_DIRECT twins.
        let image = &planner.image;
        let fds: Vec<i32> = image.files().iter().chain(image.direct_files()).map(|f| f.as_raw_fd()).collect();
        let fixed_files = ring.submitter().register_files(&fds).is_ok();
        if planner.dsync_unreliable {
            log::info!(
                "{}: on FUSE, where RWF_DSYNC may not reach the file system; durable writes are followed by an \
                 fdatasync",
                planner.describe(0)
            );
        }
        let waker = Arc::new(Waker { efd: EventFd::new()?, idle: false.into() });
        queue.add_waker(waker.clone());
        let faults = planner.faults.clone();
        Ok(RingWorker {
            ring: ManuallyDrop::new(Ring::new(ring, fixed_files, faults)),
            leaked: false,
            planner,
            queue,
            waker,
            wake_buf: Box::new(0),
            wake_armed: false,
            new: Vec::with_capacity(batch.max(1)),
            jobs: Slab::new(),
            ops: Slab::new(),
            cqes: Vec::new(),
            seen: 0,
            done: Vec::new(),
            owed: Vec::new(),
            batch: batch.max(1),
        })
    }

    /// Serves until the queue is closed and drained. A failure (an error or
    /// a panic) fails the device; the worker gives back what it holds (see
    /// the module's notes) and answers the device's requests with EIO until it stops.
    pub fn run(mut self) {
        let cause = match catch_unwind(AssertUnwindSafe(|| self.serve())) {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("its io_uring queue failed: {e}"),
            Err(p) => format!("its io_uring queue stopped on a {}", health::panic_message(&*p)),
        };
        self.queue.health().fail(cause);
        if !catch_unwind(AssertUnwindSafe(|| self.abandon())).unwrap_or(false) {
            self.leak();
        }
        self.queue.serve_failed();
    }

    fn serve(&mut self) -> std::io::Result<()> {
        if !self.wake_armed {
            self.arm_wake()?;
        }
        loop {
            let mut open = self.queue.try_take(self.batch, &mut self.new);
            if !self.new.is_empty() {
                self.start()?;
            }
            self.queue.deliver(&mut self.done);
            if !open && self.jobs.is_empty() {
                break;
            }
            // About to sleep in the kernel: say so, then look once more so no
            // push is missed. While we sleep a push wakes us through the
            // eventfd, so new requests never wait behind slow ones in the ring.
            while open {
                // Set before each look: a push after a look that found nothing sees it.
                self.waker.idle.store(true, Ordering::SeqCst);
                open = self.queue.try_take(self.batch, &mut self.new);
                if self.new.is_empty() {
                    break;
                }
                self.start()?;
                self.queue.deliver(&mut self.done);
            }
            // One call submits the whole batch and waits for the first completion.
            self.ring.enter(true)?;
            self.waker.idle.store(false, Ordering::SeqCst);
            self.reap()?;
        }
        self.retire_wake()
    }

    /// Takes the wake read back (at a clean exit) before the ring and its buffer go.
    fn retire_wake(&mut self) -> std::io::Result<()> {
        let cancel = opcode::AsyncCancel::new(WAKE).build().user_data(CANCEL);
        // SAFETY: the cancel entry refers to no memory.
        unsafe { self.ring.push(&cancel)? };
        let mut cancelled = false;
        while self.wake_armed || !cancelled {
            self.ring.enter(true)?;
            self.ring.completions(&mut self.cqes);
            for (ud, _) in self.cqes.drain(..) {
                match ud {
                    WAKE => self.wake_armed = false,
                    CANCEL => cancelled = true,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn arm_wake(&mut self) -> std::io::Result<()> {
        let read = opcode::Read::new(types::Fd(self.waker.efd.fd()), (&mut *self.wake_buf as *mut u64).cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: wake_buf is a heap u64 owned by this worker, which waits for this
        // read's completion (or its cancellation) before dropping it, or leaks it.
        unsafe { self.ring.push(&read)? };
        self.wake_armed = true;
        Ok(())
    }

    /// Queues the SQE of operation `op`. If it cannot be queued, the kernel
    /// never saw it: the operation leaves the table.
    ///
    /// # Safety
    /// As for [`Ring::push`].
    unsafe fn push_op(&mut self, op: usize, entry: &squeue::Entry) -> std::io::Result<()> {
        // SAFETY: the caller's contract is `Ring::push`'s.
        let r = unsafe { self.ring.push(entry) };
        if r.is_err() {
            self.ops.remove(op);
        }
        r
    }

    /// After a failure: answers with EIO what the worker holds, cancels what
    /// is in the ring and reaps it for up to [`ABANDON_WAIT`], answering the
    /// device's new requests meanwhile. True when the kernel gave everything
    /// back (then the requests in flight are answered too); false when the
    /// worker must [`RingWorker::leak`].
    fn abandon(&mut self) -> bool {
        self.waker.idle.store(false, Ordering::SeqCst);
        self.owed.clear();
        let mut held: Vec<Job> = self.new.drain(..).collect();
        held.append(&mut self.done);
        self.queue.fail(&mut held);
        // Completions taken but not handled: those operations are over.
        let unseen: Vec<u64> = self.cqes[self.seen..].iter().map(|&(ud, _)| ud).collect();
        self.cqes.clear();
        self.seen = 0;
        unseen.into_iter().for_each(|ud| self.forget_op(ud));
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(CANCEL);
        // SAFETY: a cancel refers to no memory.
        let _ = unsafe { self.ring.push(&cancel) };
        if self.wake_armed {
            // The read completes even where the kernel knows no cancel-any (before 5.19).
            self.waker.wake();
        }
        let deadline = Instant::now() + ABANDON_WAIT;
        let mut none = Vec::new();
        while (!self.ops.is_empty() || self.wake_armed) && Instant::now() < deadline {
            // A failed device's queue answers what is waiting with EIO.
            self.queue.try_take(1, &mut none);
            if self.ring.wait_for(Duration::from_millis(20)).is_err() {
                // The ring cannot be entered: wait out the deadline, then leak.
                std::thread::sleep(Duration::from_millis(20));
            }
            self.ring.completions(&mut self.cqes);
            let reaped: Vec<u64> = self.cqes.drain(..).map(|(ud, _)| ud).collect();
            reaped.into_iter().for_each(|ud| self.forget_op(ud));
        }
        if !self.ops.is_empty() || self.wake_armed {
            return false;
        }
        let mut held: Vec<Job> = self.jobs.drain().map(|slot| slot.job).collect();
        self.queue.fail(&mut held);
        true
    }

    /// A completion after a failure: its operation is over and leaves the table.
    fn forget_op(&mut self, ud: u64) {
        match ud {
            WAKE => self.wake_armed = false,
            CANCEL => {}
            op => drop(self.ops.remove(op as usize)),
        }
    }

    /// The kernel still holds memory of this worker: the ring, the iovecs of
    /// the operations, the wake buffer and the data of every request in
    /// flight are leaked, never freed; the requests are answered with EIO.
    fn leak(&mut self) {
        self.leaked = true;
        let (ops, name) = (self.ops.len(), self.planner.describe(0));
        std::mem::forget(std::mem::take(&mut self.ops));
        std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        let mut held: Vec<Job> = self.jobs.drain().map(|slot| slot.job).collect();
        held.extend(self.new.drain(..).chain(self.done.drain(..)));
        log::error!(
            "{name}: {ops} operation(s) still in the kernel {ABANDON_WAIT:?} after the failure; their memory and \
             the ring are leaked, never freed, and {} request(s) answered with EIO",
            held.len()
        );
        self.queue.fail_leaked(&mut held);
    }

    /// Puts a batch of new requests into the ring (or completes them here when
    /// they need no I/O or failed to map).
    fn start(&mut self) -> std::io::Result<()> {
        let runs = self.planner.plan(self.new.iter_mut().map(|(r, _, _)| r).enumerate());
        let keys: Vec<usize> = self.new.drain(..).map(|job| self.jobs.insert(JobSlot { job, pending: 0 })).collect();
        for mut run in runs {
            for j in run.jobs.iter_mut() {
                *j = keys[*j];
            }
            self.start_run(run)?;
        }
        for &k in &keys {
            if self.jobs[k].job.0.op() == Op::Flush {
                self.start_flush(k)?;
            } else {
                self.planner.perform_other(&mut self.jobs[k].job.0);
            }
            if self.jobs[k].pending == 0 {
                self.finish(k);
            }
        }
        Ok(())
    }

    /// One vectored read or write; a durable write to a file on FUSE gets its
    /// linked fdatasync.
    fn start_run(&mut self, run: Run) -> std::io::Result<()> {
        let mut jobs = run.jobs.clone();
        jobs.dedup();
        let linked = run.write && run.dsync && self.planner.dsync_unreliable && !crate::plan::skips_data_sync();
        for &j in &jobs {
            self.jobs[j].pending += if linked { 2 } else { 1 };
        }
        let iov: Vec<libc::iovec> =
            run.segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect();
        let (fd, direct) = (run.file, run.direct);
        let (offset, write, dsync, n, ptr) = (run.offset, run.write, run.dsync, iov.len() as u32, iov.as_ptr());
        // The linked fdatasync keeps its own copy of the run's place, for error messages.
        let sync_run = Run { segs: Default::default(), jobs: Jobs::new(), ..run };
        let link_jobs = jobs.clone();
        let op = self.ops.insert(OpKind::Data { run, iov, jobs });
        let entry = if write {
            let flags = if dsync { libc::RWF_DSYNC } else { 0 };
            on_file!(self, fd, direct, |f| opcode::Writev::new(f, ptr, n).offset(offset).rw_flags(flags).build())
        } else {
            on_file!(self, fd, direct, |f| opcode::Readv::new(f, ptr, n).offset(offset).build())
        };
        let entry = entry.user_data(op as u64);
        if !linked {
            // SAFETY: the iovecs live in `ops[op]` and point into buffers of requests
            // in `jobs`; both stay until this op's completion is reaped (or are leaked).
            return unsafe { self.push_op(op, &entry) };
        }
        // Both entries must be in one submission for the link to hold.
        if self.ring.room() < 2 {
            self.ring.enter(false)?;
        }
        // SAFETY: as above, for the write.
        unsafe { self.push_op(op, &entry.flags(squeue::Flags::IO_LINK))? };
        let sync = self.ops.insert(OpKind::WriteSync { run: sync_run, jobs: link_jobs });
        let entry = on_file!(self, fd, direct, |f| opcode::Fsync::new(f).flags(types::FsyncFlags::DATASYNC).build())
            .user_data(sync as u64);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the engine stops.
        unsafe { self.push_op(sync, &entry) }
    }

    /// A FLUSH: an fsync of file 0 in the ring (its metadata round follows in
    /// `reap`), or an error now when an injected failure says so.
    fn start_flush(&mut self, k: usize) -> std::io::Result<()> {
        let slot = &mut self.jobs[k];
        if let Err(e) = self.planner.flush_begin() {
            // Failed before the fsync, like a failed fsync: no metadata round.
            slot.job.0.error = Some(e);
            return Ok(());
        }
        if crate::plan::skips_data_sync() || self.planner.image.files().is_empty() {
            // A test build told to break durability, or an image without files
            // (nothing to sync): no fsync, only the metadata round.
            if let Err(e) = self.planner.flush_end(Ok(())) {
                slot.job.0.error = Some(e);
            }
            return Ok(());
        }
        // File 0 is the only one writes reach.
        slot.pending += 1;
        let op = self.ops.insert(OpKind::Fsync { job: k });
        let entry = on_file!(self, 0, false, |f| opcode::Fsync::new(f).flags(types::FsyncFlags::DATASYNC).build())
            .user_data(op as u64);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the engine stops.
        unsafe { self.push_op(op, &entry) }
    }

    /// Handles every completion there is. `seen` moves past each before it
    /// is handled, so after a panic the rest are known to be over too.
    fn reap(&mut self) -> std::io::Result<()> {
        self.ring.completions(&mut self.cqes);
        while self.seen < self.cqes.len() {
            let (ud, res) = self.cqes[self.seen];
            self.seen += 1;
            if ud == WAKE {
                self.wake_armed = false;
                self.arm_wake()?;
                continue;
            }
            if ud == CANCEL {
                continue;
            }
            match self.ops.remove(ud as usize).expect("a live slab key") {
                OpKind::Data { run, iov: _, jobs } => {
                    self.data_done(&run, res);
                    for j in jobs {
                        self.release(j);
                    }
                }
                OpKind::Fsync { job } => {
                    let synced = if res < 0 { Err(std::io::Error::from_raw_os_error(-res)) } else { Ok(()) };
                    if let Err(e) = self.planner.flush_end(synced) {
                        self.jobs[job].job.0.error.get_or_insert(e);
                    }
                    self.release(job);
                }
                OpKind::WriteSync { run, jobs } => {
                    // ECANCELED: the write failed or was short, and `data_done` finished
                    // it with blocking calls, which sync it themselves (`dsync_unreliable`).
                    if res < 0 && res != -libc::ECANCELED {
                        let e = self.planner.run_error(&run, std::io::Error::from_raw_os_error(-res));
                        for &j in &jobs {
                            self.jobs[j].job.0.error.get_or_insert(e.clone());
                        }
                    }
                    for j in jobs {
                        self.release(j);
                    }
                }
            }
        }
        self.cqes.clear();
        self.seen = 0;
        if !self.owed.is_empty() {
            // One metadata sync for every durable write this reap finished.
            let owed = std::mem::take(&mut self.owed);
            let done = &mut self.done;
            self.planner
                .settle_metadata(done.iter_mut().enumerate().filter(|(i, _)| owed.contains(i)).map(|(_, j)| &mut j.0));
        }
        Ok(())
    }

    /// Checks a data completion; what it did not do is finished by
    /// [`Planner::finish_run`] (the same retry as the thread engine's).
    fn data_done(&mut self, run: &Run, res: i32) {
        if res >= 0 && res as usize == run.len() {
            return;
        }
        let jobs = &mut self.jobs;
        let fail = |job: usize, e| {
            jobs[job].job.0.error.get_or_insert(e);
        };
        // SAFETY: the run's requests are in `jobs` until this op is released,
        // after this returns; the kernel is done with them (the CQE is reaped).
        unsafe { self.planner.finish_run(run, usize::try_from(res).ok(), fail) };
    }

    fn release(&mut self, k: usize) {
        let slot = &mut self.jobs[k];
        slot.pending -= 1;
        if slot.pending == 0 {
            if self.planner.write_done(&mut slot.job.0) {
                self.owed.push(self.done.len());
            }
            self.finish(k);
        }
    }

    fn finish(&mut self, k: usize) {
        let slot = self.jobs.remove(k).expect("a live slab key");
        self.done.push(slot.job);
    }
}

impl Drop for RingWorker {
    fn drop(&mut self) {
        if self.leaked {
            // The kernel may still write into memory the ring's requests point at.
            return;
        }
        // SAFETY: dropped here only, once; `self` is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
    }
}

/// Whether this kernel can run the ring engine.
pub fn probe() -> Result<()> {
    IoUring::new(8).map(|_| ()).map_err(|e| Error::io(e, "io_uring is not available"))
}
