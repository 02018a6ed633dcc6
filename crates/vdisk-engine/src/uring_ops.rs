//! The io_uring backend of the in-flight table (`flight`): how a core
//! worker's ring starts what the table asks — vectored reads and writes,
//! FLUSH fsyncs, the fdatasync linked after a durable write where the file
//! system may drop RWF_DSYNC — and what a device is to the worker
//! ([`DevState`]). It owns the ring; the table owns the requests and iovecs.
//! All `unsafe` submission goes through [`Ring::push`].
//!
//! Under the `faults` feature a `delay=MS` rule puts an `IORING_OP_TIMEOUT`
//! linked ahead of each read or write: the operation stays in the kernel
//! for that long, which is how the tests stop devices and the core with
//! requests really in flight.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, squeue, types};

use crate::flight::{Backend, Flight, Lane};
use crate::mailbox::{Attachment, Detached};
use crate::plan::{Planner, Run};
use crate::queue::{Job, Queue};
use crate::ring::Ring;

/// user_data of the eventfd read that wakes an idle ring.
pub(crate) const WAKE: u64 = u64::MAX;
/// user_data of cancels.
pub(crate) const CANCEL: u64 = u64::MAX - 1;
/// user_data of the timeouts a `delay` fault links ahead of an operation (tests only).
pub(crate) const DELAY: u64 = u64::MAX - 2;

/// Where a core worker sends the batches of a device whose image has a
/// target that is not a file (switched onto an RBD image or an NBD export:
/// [`crate::blocking_image`]): a thread of the device's own performs them
/// with the target's blocking calls and delivers them, so the worker (and
/// every other device on it) never waits for a remote server. The thread
/// ends when the device lets go of its worker (the sender is dropped).
pub(crate) struct Offload {
    tx: std::sync::mpsc::Sender<Vec<Job>>,
    /// Requests sent to the thread and not yet delivered: the worker lets
    /// go of the device only once none is left.
    pub away: Arc<std::sync::atomic::AtomicUsize>,
}

impl Offload {
    /// Starts the thread for the device `name` of `queue`, told apart on its worker by `attachment`.
    pub fn start(
        name: &str,
        queue: Arc<Queue>,
        planner: Planner,
        attachment: Arc<Attachment>,
    ) -> std::io::Result<Self> {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::sync::atomic::Ordering;
        let (tx, rx) = std::sync::mpsc::channel::<Vec<Job>>();
        let away = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let left = away.clone();
        std::thread::Builder::new().name(format!("{name}-blocking")).spawn(move || {
            let mut planner = planner;
            for mut jobs in rx {
                let n = jobs.len();
                let served = catch_unwind(AssertUnwindSafe(|| {
                    let mut p = planner.clone();
                    p.refresh();
                    let mut reqs: Vec<&mut crate::Request> = jobs.iter_mut().map(|(r, _, _)| r).collect();
                    let p = crate::threads::execute(p, &mut reqs);
                    queue.deliver(&mut jobs);
                    p
                }));
                match served {
                    Ok(p) => planner = p,
                    Err(p) => {
                        // A panic leaves the batch undelivered (a delivery checks before it hands over).
                        let cause = format!("its blocking calls hit a {}", crate::health::panic_message(&*p));
                        queue.health().fail(cause);
                        let _ = catch_unwind(AssertUnwindSafe(|| queue.fail(&mut jobs)));
                    }
                }
                left.fetch_sub(n, Ordering::SeqCst);
                // The worker looks at the device again (it may be waiting to let go of it).
                crate::queue::Server::notify(&*attachment);
            }
        })?;
        Ok(Offload { tx, away })
    }

    /// Hands `jobs` to the thread; Err gives them back if it is gone.
    pub fn send(&self, jobs: Vec<Job>) -> Result<(), Vec<Job>> {
        let n = jobs.len();
        self.away.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        self.tx.send(jobs).map_err(|e| {
            self.away.fetch_sub(n, std::sync::atomic::Ordering::SeqCst);
            e.0
        })
    }
}

/// A device as its core worker sees it.
pub(crate) struct DevState {
    /// Its planner and what of it is in the table or done.
    pub lane: Lane<Job>,
    pub queue: Arc<Queue>,
    /// Where its queue marks it ready on this worker.
    pub attachment: Arc<Attachment>,
    pub detached: Arc<Detached>,
    /// Most requests taken from its queue per round.
    pub batch: usize,
    /// Its queue was found closed and drained.
    pub closed: bool,
    /// When it failed (its leftovers in the kernel are leaked after [`crate::health::ABANDON_WAIT`]).
    pub failed_at: Option<Instant>,
    /// Completions came for it in this reap.
    pub touched: bool,
    /// Its blocking lane, once its image needed one.
    pub offload: Option<Offload>,
}

impl DevState {
    pub fn failed(&self) -> bool {
        self.queue.health().is_failed()
    }
}

/// A core worker's table.
pub(crate) type UringFlight = Flight<Job, Uring>;

/// The ring, as a backend.
pub(crate) struct Uring {
    /// Never dropped once `leaked`.
    pub ring: ManuallyDrop<Ring>,
    pub leaked: bool,
    /// The timespecs of `delay` faults (tests only), by milliseconds: they
    /// live as long as the ring, so an SQE may point at one until submitted.
    delays: HashMap<u64, Box<types::Timespec>>,
}

impl Uring {
    pub fn new(ring: Ring) -> Uring {
        Uring { ring: ManuallyDrop::new(ring), leaked: false, delays: HashMap::new() }
    }

    /// Makes room for `n` entries in one submission (a link must be).
    fn room_for(&mut self, n: usize) -> std::io::Result<()> {
        if self.ring.room() < n {
            self.ring.enter(false)?;
        }
        Ok(())
    }

    /// Queues the timeout a `delay` fault puts ahead of an operation (linked to it).
    fn push_delay(&mut self, ms: u64) -> std::io::Result<()> {
        let ts = self
            .delays
            .entry(ms)
            .or_insert_with(|| Box::new(types::Timespec::new().sec(ms / 1000).nsec(((ms % 1000) * 1_000_000) as u32)));
        let ts: *const types::Timespec = &**ts;
        let entry = opcode::Timeout::new(ts)
            .flags(types::TimeoutFlags::ETIME_SUCCESS)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(DELAY);
        // SAFETY: the timespec is boxed in `delays`, which lives as long as the ring.
        unsafe { self.ring.push(&entry) }
    }
}

/// The fd of file `file` of the image (its O_DIRECT twin when `direct`).
fn fd(planner: &Planner, file: usize, direct: bool) -> types::Fd {
    let image = &planner.image;
    let files = if direct { image.direct_files() } else { image.files() };
    types::Fd(files[file].as_raw_fd())
}

impl Backend for Uring {
    unsafe fn rw(
        &mut self,
        planner: &Planner,
        run: &Run,
        iov: &[libc::iovec],
        key: u64,
        sync: Option<u64>,
    ) -> std::io::Result<()> {
        let f = fd(planner, run.file, run.direct);
        let (ptr, n) = (iov.as_ptr(), iov.len() as u32);
        let entry = if run.write {
            let flags = if run.dsync { libc::RWF_DSYNC } else { 0 };
            opcode::Writev::new(f, ptr, n).offset(run.offset).rw_flags(flags).build()
        } else {
            opcode::Readv::new(f, ptr, n).offset(run.offset).build()
        };
        let entry = entry.user_data(key);
        let delay = planner.faults.as_ref().and_then(|f| f.delay());
        // A link's entries must all be in one submission.
        self.room_for(1 + usize::from(sync.is_some()) + usize::from(delay.is_some()))?;
        if let Some(ms) = delay {
            self.push_delay(ms)?;
        }
        let Some(sync) = sync else {
            // SAFETY: the caller's contract (`Backend::rw`) is `Ring::push`'s.
            return unsafe { self.ring.push(&entry) };
        };
        // SAFETY: as above, for the write.
        unsafe { self.ring.push(&entry.flags(squeue::Flags::IO_LINK))? };
        let entry = opcode::Fsync::new(f).flags(types::FsyncFlags::DATASYNC).build().user_data(sync);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the device detaches.
        unsafe { self.ring.push(&entry) }
    }

    fn sync(&mut self, planner: &Planner, key: u64) -> std::io::Result<bool> {
        if crate::plan::skips_data_sync() || planner.image.files().is_empty() {
            // A test build told to break durability, or an image without files.
            return Ok(false);
        }
        // File 0 is the only one writes reach.
        let entry = opcode::Fsync::new(fd(planner, 0, false)).flags(types::FsyncFlags::DATASYNC).build().user_data(key);
        // SAFETY: an fsync refers to no memory; the fd is the image's, open until the device detaches.
        unsafe { self.ring.push(&entry)? };
        Ok(true)
    }

    fn cancel(&mut self, key: u64) {
        let c = opcode::AsyncCancel::new(key).build().user_data(CANCEL);
        // SAFETY: a cancel refers to no memory. If it cannot be queued, the
        // operation completes in its own time (or is leaked).
        let _ = unsafe { self.ring.push(&c) };
    }

    fn reap(&mut self, out: &mut Vec<(u64, i64)>) {
        let mut cqes = Vec::new();
        self.ring.completions(&mut cqes);
        out.extend(cqes.into_iter().map(|(k, r)| (k, i64::from(r))));
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        if self.leaked {
            // The kernel may still write into memory the ring's requests point at.
            return;
        }
        // SAFETY: dropped here only, once; `self` is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
    }
}

/// Answers the requests `leak_device` took out of the table for device `d`, saying what was leaked.
pub(crate) fn leaked(d: &mut DevState, mut held: Vec<Job>, ops: usize) {
    if ops > 0 || !held.is_empty() {
        log::error!(
            "{}: {ops} operation(s) still in the kernel {:?} after the failure; their memory is leaked, never \
             freed, and {} request(s) answered with EIO",
            d.lane.planner.describe(0),
            crate::health::ABANDON_WAIT,
            held.len()
        );
    }
    d.queue.fail_leaked(&mut held);
}
