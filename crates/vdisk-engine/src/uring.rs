//! The io_uring engine: one ring per queue thread. Everything the thread took
//! from the device's queue goes into the ring at once and is submitted with the
//! same `io_uring_enter` that waits for completions; completions are reaped as
//! a batch and delivered grouped by sink.
//!
//! The in-flight table (`ops`, `jobs`) owns every request, and with it every
//! buffer and iovec array the kernel may touch, until that operation's
//! completion has been reaped. All `unsafe` submission is in [`Ring::push`].
//!
//! FLUSH is an `IORING_OP_FSYNC` (datasync) of the written file, not ordered against other
//! operations in the ring: it must cover only writes *completed* before it was
//! submitted, and those are already in the page cache. The image's metadata is
//! synced after the files' fsyncs complete. FUA and sync-mode writes carry
//! `RWF_DSYNC` on their SQE and still run in parallel. Where the kernel may
//! drop that flag (a file on FUSE, see [`crate::sys::on_fuse`]), a durable write is
//! linked to an `IORING_OP_FSYNC` (datasync) of its file, and completes only
//! with that fsync.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use vdisk_image::{Error, Result};

use crate::plan::{Jobs, Planner, Run};
use crate::queue::{Job, Queue, Waker};
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
/// user_data of the cancel of that read at exit.
const CANCEL: u64 = u64::MAX - 1;

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

struct Ring {
    ring: IoUring,
    fixed_files: bool,
}

impl Ring {
    /// Queues one SQE, submitting first if the submission queue is full.
    ///
    /// # Safety
    /// Every buffer, iovec array and fd the entry refers to must stay valid and
    /// untouched by anyone else until its completion is reaped. The callers
    /// guarantee it by keeping the owner (the request and the `OpKind` holding
    /// the iovecs, or the eventfd buffer) in the in-flight table until then.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> std::io::Result<()> {
        // SAFETY: the caller's contract above is `submit::push`'s.
        unsafe { crate::submit::push(&mut self.ring, entry) }
    }
}

pub(crate) struct RingWorker {
    // The ring is dropped first, after the wake read has been cancelled and reaped.
    ring: Ring,
    planner: Planner,
    queue: Arc<Queue>,
    waker: Arc<Waker>,
    wake_buf: Box<u64>,
    jobs: Slab<JobSlot>,
    ops: Slab<OpKind>,
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
        Ok(RingWorker {
            ring: Ring { ring, fixed_files },
            planner,
            queue,
            waker,
            wake_buf: Box::new(0),
            jobs: Slab::new(),
            ops: Slab::new(),
            done: Vec::new(),
            owed: Vec::new(),
            batch: batch.max(1),
        })
    }

    pub fn run(mut self) {
        if let Err(e) = self.serve() {
            log::error!("io_uring queue of {} failed: {e}", self.planner.describe(0));
        }
    }

    fn serve(&mut self) -> std::io::Result<()> {
        self.arm_wake()?;
        let mut new = Vec::with_capacity(self.batch);
        loop {
            let mut open = self.queue.try_take(self.batch, &mut new);
            if !new.is_empty() {
                self.start(&mut new)?;
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
                open = self.queue.try_take(self.batch, &mut new);
                if new.is_empty() {
                    break;
                }
                self.start(&mut new)?;
                self.queue.deliver(&mut self.done);
            }
            // One call submits the whole batch and waits for the first completion.
            self.ring.ring.submit_and_wait(1)?;
            self.waker.idle.store(false, Ordering::SeqCst);
            self.reap()?;
        }
        // Take the wake read back before the ring and its buffer go.
        let cancel = opcode::AsyncCancel::new(WAKE).build().user_data(CANCEL);
        // SAFETY: the cancel entry refers to no memory.
        unsafe { self.ring.push(&cancel)? };
        let mut outstanding = 2;
        while outstanding > 0 {
            self.ring.ring.submit_and_wait(1)?;
            for cqe in self.ring.ring.completion() {
                if matches!(cqe.user_data(), WAKE | CANCEL) {
                    outstanding -= 1;
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
        // read's completion (or its cancellation) before dropping it.
        unsafe { self.ring.push(&read) }
    }

    /// Puts a batch of new requests into the ring (or completes them here when
    /// they need no I/O or failed to map).
    fn start(&mut self, new: &mut Vec<Job>) -> std::io::Result<()> {
        let runs = self.planner.plan(new.iter_mut().map(|(r, _, _)| r).enumerate());
        let keys: Vec<usize> = new.drain(..).map(|job| self.jobs.insert(JobSlot { job, pending: 0 })).collect();
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
            // in `jobs`; both stay until this op's completion is reaped.
            return unsafe { self.ring.push(&entry) };
        }
        // Both entries must be in one submission for the link to hold.
        let free = {
            let sq = self.ring.ring.submission();
            sq.capacity() - sq.len()
        };
        if free < 2 {
            self.ring.ring.submit()?;
        }
        // SAFETY: as above, for the write.
        unsafe { self.ring.push(&entry.flags(squeue::Flags::IO_LINK))? };
        let sync = self.ops.insert(OpKind::WriteSync { run: sync_run, jobs: link_jobs });
        let entry = on_file!(self, fd, direct, |f| opcode::Fsync::new(f).flags(types::FsyncFlags::DATASYNC).build())
            .user_data(sync as u64);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the engine stops.
        unsafe { self.ring.push(&entry) }
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
        if crate::plan::skips_data_sync() {
            // A test build told to break durability: no fsync, only the metadata round.
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
        unsafe { self.ring.push(&entry) }
    }

    fn reap(&mut self) -> std::io::Result<()> {
        let cqes: Vec<(u64, i32)> = self.ring.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in cqes {
            if ud == WAKE {
                self.arm_wake()?;
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

/// Whether this kernel can run the ring engine.
pub fn probe() -> Result<()> {
    IoUring::new(8).map(|_| ()).map_err(|e| Error::io(e, "io_uring is not available"))
}
