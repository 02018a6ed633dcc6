//! A core worker's in-flight table and the operations it puts in its ring:
//! vectored reads and writes, FLUSH fsyncs, the fdatasync linked after a
//! durable write where the file system may drop RWF_DSYNC, and what each
//! completion does. Every operation and request is tagged with its device,
//! so one device's can be cancelled, counted or leaked without touching
//! another's. All `unsafe` submission goes through [`Ring::push`].

use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, squeue, types};

use crate::mailbox::{Attachment, Detached};
use crate::plan::{Jobs, Planner, Run};
use crate::queue::{Job, Queue};
use crate::ring::Ring;
use crate::slab::Slab;
use crate::Op;

/// A device as its core worker sees it.
pub(crate) struct DevState {
    pub planner: Planner,
    pub queue: Arc<Queue>,
    /// Where its queue marks it ready on this worker.
    pub attachment: Arc<Attachment>,
    pub detached: Arc<Detached>,
    /// Its requests in `Flight::jobs`.
    pub in_flight: usize,
    /// Finished, to be delivered.
    pub done: Vec<Job>,
    /// Positions in `done` of durable writes whose metadata is not yet durable.
    pub owed: Vec<usize>,
    /// Most requests taken from its queue per round.
    pub batch: usize,
    /// Its queue was found closed and drained.
    pub closed: bool,
    /// When it failed (its leftovers in the kernel are leaked after [`crate::health::ABANDON_WAIT`]).
    pub failed_at: Option<Instant>,
    /// Completions came for it in this reap.
    pub touched: bool,
}

impl DevState {
    pub fn failed(&self) -> bool {
        self.queue.health().is_failed()
    }
}

/// A request in flight, its device, and how many of its operations are still in the ring.
pub(crate) struct JobSlot {
    pub dev: u64,
    pub job: Job,
    pub pending: usize,
}

pub(crate) enum OpKind {
    /// A vectored read or write; `iov` is what the SQE points at, owned here
    /// (and never read again) until the completion is reaped.
    Data {
        dev: u64,
        run: Run,
        #[allow(dead_code)]
        iov: Vec<libc::iovec>,
        jobs: Jobs,
    },
    /// The fsync of one file for a FLUSH.
    Fsync { dev: u64, job: [usize; 1] },
    /// The fdatasync linked after a durable O_DIRECT write where RWF_DSYNC
    /// is not carried; each job of the write waits for it too.
    WriteSync { dev: u64, run: Run, jobs: Jobs },
    /// An operation of a failed device whose memory was leaked: the key stays
    /// taken until the kernel's completion comes, which is then ignored.
    Leaked,
}

impl OpKind {
    pub fn dev(&self) -> Option<u64> {
        match self {
            OpKind::Data { dev, .. } | OpKind::Fsync { dev, .. } | OpKind::WriteSync { dev, .. } => Some(*dev),
            OpKind::Leaked => None,
        }
    }

    pub fn jobs(&self) -> &[usize] {
        match self {
            OpKind::Data { jobs, .. } | OpKind::WriteSync { jobs, .. } => jobs,
            OpKind::Fsync { job, .. } => job,
            OpKind::Leaked => &[],
        }
    }
}

/// The ring and everything in it.
pub(crate) struct Flight {
    /// Never dropped once `leaked`.
    pub ring: ManuallyDrop<Ring>,
    pub leaked: bool,
    pub jobs: Slab<JobSlot>,
    pub ops: Slab<OpKind>,
    /// Completions taken from the ring; those before `seen` are handled.
    pub cqes: Vec<(u64, i32)>,
    pub seen: usize,
}

/// The fd of file `file` of the device (its O_DIRECT twin when `direct`).
fn fd(d: &DevState, file: usize, direct: bool) -> types::Fd {
    let image = &d.planner.image;
    let files = if direct { image.direct_files() } else { image.files() };
    types::Fd(files[file].as_raw_fd())
}

impl Flight {
    pub fn new(ring: Ring) -> Flight {
        Flight {
            ring: ManuallyDrop::new(ring),
            leaked: false,
            jobs: Slab::new(),
            ops: Slab::new(),
            cqes: Vec::new(),
            seen: 0,
        }
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

    /// Puts a batch of device `id`'s new requests into the ring (or completes
    /// them here when they need no I/O or failed to map).
    pub fn start(&mut self, d: &mut DevState, id: u64, new: &mut Vec<Job>) -> std::io::Result<()> {
        let runs = d.planner.plan(new.iter_mut().map(|(r, _, _)| r).enumerate());
        let keys: Vec<usize> =
            new.drain(..).map(|job| self.jobs.insert(JobSlot { dev: id, job, pending: 0 })).collect();
        d.in_flight += keys.len();
        for mut run in runs {
            for j in run.jobs.iter_mut() {
                *j = keys[*j];
            }
            self.start_run(d, id, run)?;
        }
        for &k in &keys {
            if self.jobs[k].job.0.op() == Op::Flush {
                self.start_flush(d, id, k)?;
            } else {
                d.planner.perform_other(&mut self.jobs[k].job.0);
            }
            if self.jobs[k].pending == 0 {
                self.finish(d, k);
            }
        }
        Ok(())
    }

    /// One vectored read or write; a durable write to a file on FUSE gets its
    /// linked fdatasync.
    fn start_run(&mut self, d: &DevState, id: u64, run: Run) -> std::io::Result<()> {
        let mut jobs = run.jobs.clone();
        jobs.dedup();
        let linked = run.write && run.dsync && d.planner.dsync_unreliable && !crate::plan::skips_data_sync();
        for &j in &jobs {
            self.jobs[j].pending += if linked { 2 } else { 1 };
        }
        let iov: Vec<libc::iovec> =
            run.segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect();
        let f = fd(d, run.file, run.direct);
        let (offset, write, dsync, n, ptr) = (run.offset, run.write, run.dsync, iov.len() as u32, iov.as_ptr());
        // The linked fdatasync keeps its own copy of the run's place, for error messages.
        let sync_run = Run { segs: Default::default(), jobs: Jobs::new(), ..run };
        let link_jobs = jobs.clone();
        let op = self.ops.insert(OpKind::Data { dev: id, run, iov, jobs });
        let entry = if write {
            let flags = if dsync { libc::RWF_DSYNC } else { 0 };
            opcode::Writev::new(f, ptr, n).offset(offset).rw_flags(flags).build()
        } else {
            opcode::Readv::new(f, ptr, n).offset(offset).build()
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
        let sync = self.ops.insert(OpKind::WriteSync { dev: id, run: sync_run, jobs: link_jobs });
        let entry = opcode::Fsync::new(f).flags(types::FsyncFlags::DATASYNC).build().user_data(sync as u64);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the device detaches.
        unsafe { self.push_op(sync, &entry) }
    }

    /// A FLUSH: an fsync of file 0 in the ring (its metadata round follows in
    /// `completed`), or an error now when an injected failure says so.
    fn start_flush(&mut self, d: &DevState, id: u64, k: usize) -> std::io::Result<()> {
        let slot = &mut self.jobs[k];
        if let Err(e) = d.planner.flush_begin() {
            // Failed before the fsync, like a failed fsync: no metadata round.
            slot.job.0.error = Some(e);
            return Ok(());
        }
        if crate::plan::skips_data_sync() || d.planner.image.files().is_empty() {
            // A test build told to break durability, or an image without files
            // (nothing to sync): no fsync, only the metadata round.
            if let Err(e) = d.planner.flush_end(Ok(())) {
                slot.job.0.error = Some(e);
            }
            return Ok(());
        }
        // File 0 is the only one writes reach.
        slot.pending += 1;
        let op = self.ops.insert(OpKind::Fsync { dev: id, job: [k] });
        let entry = opcode::Fsync::new(fd(d, 0, false)).flags(types::FsyncFlags::DATASYNC).build().user_data(op as u64);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the device detaches.
        unsafe { self.push_op(op, &entry) }
    }

    /// The completion (result `res`) of operation `kind` of device `d`, taken
    /// out of the table. A failed device's operations only release their requests.
    pub fn completed(&mut self, d: &mut DevState, kind: OpKind, res: i32) {
        if d.failed() {
            for &j in kind.jobs() {
                self.release(d, j);
            }
            return;
        }
        match kind {
            OpKind::Data { run, iov: _, jobs, .. } => {
                if res < 0 || res as usize != run.len() {
                    let slots = &mut self.jobs;
                    let fail = |job: usize, e| {
                        slots[job].job.0.error.get_or_insert(e);
                    };
                    // SAFETY: the run's requests are in `jobs` until this op is released,
                    // after this returns; the kernel is done with them (the CQE is reaped).
                    unsafe { d.planner.finish_run(&run, usize::try_from(res).ok(), fail) };
                }
                for j in jobs {
                    self.release(d, j);
                }
            }
            OpKind::Fsync { job: [job], .. } => {
                let synced = if res < 0 { Err(std::io::Error::from_raw_os_error(-res)) } else { Ok(()) };
                if let Err(e) = d.planner.flush_end(synced) {
                    self.jobs[job].job.0.error.get_or_insert(e);
                }
                self.release(d, job);
            }
            OpKind::WriteSync { run, jobs, .. } => {
                // ECANCELED: the write failed or was short, and `finish_run` finished
                // it with blocking calls, which sync it themselves (`dsync_unreliable`).
                if res < 0 && res != -libc::ECANCELED {
                    let e = d.planner.run_error(&run, std::io::Error::from_raw_os_error(-res));
                    for &j in &jobs {
                        self.jobs[j].job.0.error.get_or_insert(e.clone());
                    }
                }
                for j in jobs {
                    self.release(d, j);
                }
            }
            OpKind::Leaked => {}
        }
    }

    fn release(&mut self, d: &mut DevState, k: usize) {
        let Some(slot) = self.jobs.get_mut(k) else { return };
        slot.pending = slot.pending.saturating_sub(1);
        if slot.pending == 0 {
            if !d.failed() && d.planner.write_done(&mut slot.job.0) {
                d.owed.push(d.done.len());
            }
            self.finish(d, k);
        }
    }

    /// Request `k` is over: out of the table, into the device's `done`.
    pub fn finish(&mut self, d: &mut DevState, k: usize) {
        let slot = self.jobs.remove(k).expect("a live slab key");
        d.in_flight -= 1;
        d.done.push(slot.job);
    }

    /// The kernel still holds operations of failed device `id`: their memory
    /// (iovecs) and the data of its requests in flight are leaked, never
    /// freed; the keys stay taken until their completions come; the requests
    /// are answered with EIO.
    pub fn leak_device(&mut self, d: &mut DevState, id: u64) {
        let mut ops = 0;
        for (_, op) in self.ops.iter_mut() {
            if op.dev() == Some(id) {
                std::mem::forget(std::mem::replace(op, OpKind::Leaked));
                ops += 1;
            }
        }
        let keys: Vec<usize> = self.jobs.iter().filter(|(_, s)| s.dev == id).map(|(k, _)| k).collect();
        let mut held: Vec<Job> = keys.into_iter().filter_map(|k| self.jobs.remove(k)).map(|s| s.job).collect();
        d.in_flight -= held.len();
        if ops > 0 || !held.is_empty() {
            log::error!(
                "{}: {ops} operation(s) still in the kernel {:?} after the failure; their memory is leaked, never \
                 freed, and {} request(s) answered with EIO",
                d.planner.describe(0),
                crate::health::ABANDON_WAIT,
                held.len()
            );
        }
        d.queue.fail_leaked(&mut held);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if self.leaked {
            // The kernel may still write into memory the ring's requests point at.
            return;
        }
        // SAFETY: dropped here only, once; `self` is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
    }
}
