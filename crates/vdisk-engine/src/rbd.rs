//! The librbd backend, and the loop that drives it: one per device whose
//! image has a target on Ceph RBD ([`uses_librbd`]). Everything the loop takes
//! from the device's queue goes through the engine's one in-flight table and
//! completion path (`flight`), planned like any batch (the same [`Planner`]:
//! mapping, merging of contiguous pieces); [`Librbd`] only starts what the
//! table asks and collects completions. librbd signals finished operations
//! on an eventfd and the loop collects them in batches with
//! `rbd_poll_io_events`, then hands the requests back through the same
//! `deliver` path as the other engines.
//!
//! An extent maps to a target, whatever it is: a run on an RBD target is
//! `rbd_aio_readv`/`rbd_aio_writev`; a run on a file target (a COW overlay's
//! own file, whose backing is an RBD snapshot) is a blocking call in the
//! loop, its result handed back at the next reap like the thread engine's.
//!
//! Durability on RBD: a write completes once librbd has it (in librbd's
//! cache when the cluster enables it, as Pacific does by default: the part
//! the page cache plays for files). FLUSH is `rbd_aio_flush`, which covers
//! every write completed before it was submitted; FUA and sync-mode writes
//! (no RWF_DSYNC on RBD) are the write, then a flush, before the reply.
//! WRITE_ZEROES is `rbd_aio_write_zeroes`, or with NO_HOLE written zeros;
//! TRIM is `rbd_aio_discard`.
//!
//! Ways out: at shutdown the loop ends once nothing is in flight; a panic
//! (caught at the thread's edge) fails the device, and the loop collects
//! what librbd still holds for up to [`ABANDON_WAIT`] (librbd AIO cannot be
//! cancelled: it waits for the completions) and answers it with EIO; what is
//! not back by then is leaked (its data and iovecs forgotten, the requests
//! answered with EIO and an empty buffer). The loop's one sleep, `poll`,
//! retries EINTR; reading the eventfds never blocks. One loop per image,
//! because librbd delivers an image's completions to one eventfd; librbd's
//! own threads do the work, so one loop keeps many operations in flight.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use vdisk_image::{Image, RbdImage, Storage};

use crate::flight::{Backend, Flight, Lane};
use crate::health;
use crate::health::ABANDON_WAIT;
use crate::plan::{Planner, Run};
use crate::queue::{Job, Queue, Waker};
use crate::wake::EventFd;
use crate::Op;

/// Zeros for WRITE_ZEROES with NO_HOLE: static, so valid for any operation's life.
static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

/// True when the image has a target on RBD, which the engine must drive with librbd.
pub(crate) fn uses_librbd(image: &dyn Image) -> bool {
    (0..).map_while(|i| image.target(i)).any(|t| matches!(t, Storage::Rbd(_)))
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

fn errno_of(e: &std::io::Error) -> i64 {
    -i64::from(e.raw_os_error().unwrap_or(libc::EIO))
}

/// librbd's AIO as a backend (and blocking calls for file targets beside it).
pub(crate) struct Librbd {
    /// The device's image (an RBD device's image is never swapped: see `swap`).
    image: Arc<dyn Image>,
    /// Results known at once (a refused submission, a blocking call), handed back at the next reap.
    ready: Vec<(u64, i64)>,
}

impl Librbd {
    /// The RBD image target `i` is, if it is one.
    fn rbd(&self, i: usize) -> Option<&RbdImage> {
        match self.image.target(i) {
            Some(Storage::Rbd(r)) => Some(r),
            _ => None,
        }
    }
}

impl Backend for Librbd {
    unsafe fn rw(
        &mut self,
        planner: &Planner,
        run: &Run,
        iov: &[libc::iovec],
        key: u64,
        sync: Option<u64>,
    ) -> std::io::Result<()> {
        let Some(rbd) = self.rbd(run.file) else {
            // A file target beside the RBD one: blocking, as the thread engine does it.
            // SAFETY: the run points into requests the table holds, alive and untouched
            // by anyone else until this blocking call returns (the caller's contract).
            let r = unsafe { planner.perform(run) };
            let res = match &r {
                Ok(()) => run.len() as i64,
                Err(e) => -i64::from(if e.errno() > 0 { e.errno() } else { libc::EIO }),
            };
            self.ready.push((key, res));
            if let Some(s) = sync {
                self.ready.push((s, if r.is_ok() { 0 } else { -i64::from(libc::ECANCELED) }));
            }
            return Ok(());
        };
        let r = if run.write {
            // SAFETY: the iovecs and the request buffers they point into are owned by the
            // table until this op's completion is collected (the caller's contract).
            unsafe { rbd.aio_writev(iov, run.offset, key) }
        } else {
            // SAFETY: as above; no two segments of a plan overlap.
            unsafe { rbd.aio_readv(iov, run.offset, key) }
        };
        if let Err(e) = r {
            self.ready.push((key, errno_of(&e)));
        }
        if let Some(s) = sync {
            // Never asked for an RBD target (`sync_after_durable_write` covers it).
            self.ready.push((s, 0));
        }
        Ok(())
    }

    fn sync(&mut self, planner: &Planner, key: u64) -> std::io::Result<bool> {
        match planner.image.target(0) {
            Some(Storage::Rbd(rbd)) => {
                if let Err(e) = rbd.aio_flush(key) {
                    self.ready.push((key, errno_of(&e)));
                }
            }
            Some(Storage::File(_)) if !crate::plan::skips_data_sync() => {
                let res = match planner.image.target(0).expect("present").sync() {
                    Ok(()) => 0,
                    Err(e) => errno_of(&e),
                };
                self.ready.push((key, res));
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn counts_bytes(&self, _planner: &Planner, file: usize) -> bool {
        self.rbd(file).is_none()
    }

    fn sync_after_durable_write(&self, _planner: &Planner, file: usize) -> bool {
        self.rbd(file).is_some()
    }

    fn zeroes_itself(&self, _planner: &Planner) -> bool {
        self.rbd(0).is_some()
    }

    fn zero(&mut self, _planner: &Planner, op: Op, offset: u64, len: u64, key: u64) -> std::io::Result<()> {
        let rbd = self.rbd(0).expect("asked only when target 0 is on RBD");
        let r = match op {
            Op::Trim { .. } => rbd.aio_discard(offset, len, key),
            Op::WriteZeroes { no_hole: true, .. } => {
                let chunk = ZEROS.len() as u64;
                let mut iov = Vec::with_capacity(len.div_ceil(chunk) as usize);
                let mut left = len;
                while left > 0 {
                    let n = left.min(chunk);
                    iov.push(libc::iovec { iov_base: ZEROS.as_ptr() as *mut _, iov_len: n as usize });
                    left -= n;
                }
                // SAFETY: the iovecs point at static zeros, valid for ever and only read
                // by a write; librbd copies the iovec array during the call.
                unsafe { rbd.aio_writev(&iov, offset, key) }
            }
            _ => rbd.aio_write_zeroes(offset, len, key),
        };
        if let Err(e) = r {
            self.ready.push((key, errno_of(&e)));
        }
        Ok(())
    }

    /// librbd's AIO cannot be cancelled: its completions are waited for.
    fn cancel(&mut self, _key: u64) {}

    fn reap(&mut self, out: &mut Vec<(u64, i64)>) {
        out.append(&mut self.ready);
        for i in 0.. {
            let Some(target) = self.image.target(i) else { break };
            let Storage::Rbd(rbd) = target else { continue };
            while rbd.poll_completions(64, out) > 0 {}
        }
    }
}

pub(crate) struct RbdWorker {
    lane: Lane<Job>,
    queue: Arc<Queue>,
    waker: Arc<Waker>,
    /// The eventfd librbd signals when operations of the image finish.
    events: OwnedFd,
    /// Taken from the queue, not yet started (a field, so a panic does not lose them).
    new: Vec<Job>,
    f: Flight<Job, Librbd>,
    batch: usize,
    reaped: Vec<(u64, i64)>,
}

impl RbdWorker {
    pub fn new(planner: Planner, queue: Arc<Queue>, batch: usize) -> std::io::Result<Self> {
        let events = eventfd()?;
        let image = planner.image.clone();
        for target in (0..).map_while(|i| image.target(i)) {
            if let Storage::Rbd(r) = target {
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
            lane: Lane::new(planner, Some(queue.clone())),
            queue,
            waker,
            events,
            new: Vec::with_capacity(batch.max(1)),
            f: Flight::new(Librbd { image, ready: Vec::new() }),
            batch: batch.max(1),
            reaped: Vec::new(),
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
            self.lane.settle();
            self.queue.deliver(&mut self.lane.done);
            if !open && self.f.jobs.is_empty() {
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

    fn start(&mut self) {
        self.f.start(&mut self.lane, 0, &mut self.new).expect("librbd submissions fail per operation, not here");
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

    /// Collects every finished operation into the table. True when there were any.
    fn collect(&mut self) -> bool {
        drain(self.events.as_raw_fd());
        let mut reaped = std::mem::take(&mut self.reaped);
        self.f.backend.reap(&mut reaped);
        let any = !reaped.is_empty();
        for (key, res) in reaped.drain(..) {
            if self.f.device_of(key).is_some() {
                self.f.completed(&mut self.lane, key, res);
            }
        }
        self.reaped = reaped;
        any
    }

    /// After a panic: answers with EIO what the loop holds and collects what
    /// librbd still has for up to [`ABANDON_WAIT`], answering the device's new
    /// requests meanwhile. True when everything came back (then the requests
    /// in flight are answered too); false when the loop must [`RbdWorker::leak`].
    fn abandon(&mut self) -> bool {
        self.waker.idle.store(false, Ordering::SeqCst);
        let mut held: Vec<Job> = self.new.drain(..).collect();
        held.append(&mut self.lane.done);
        self.lane.owed.clear();
        self.queue.fail(&mut held);
        // Requests waiting for no operation are finished now (EIO, the device being failed).
        self.f.cancel_device(&mut self.lane, 0);
        self.queue.deliver(&mut self.lane.done);
        let deadline = Instant::now() + ABANDON_WAIT;
        let mut none = Vec::new();
        while !self.f.ops.is_empty() && Instant::now() < deadline {
            self.queue.try_take(1, &mut none);
            self.sleep(20);
            drain(self.waker.efd.fd());
            self.collect();
            self.queue.deliver(&mut self.lane.done);
        }
        self.f.ops.is_empty()
    }

    /// librbd still holds operations of this loop: their iovecs and the data
    /// of every request in flight are leaked, never freed; the requests are
    /// answered with EIO.
    fn leak(&mut self) {
        let name = self.lane.planner.describe(0);
        let (mut held, ops) = self.f.leak_device(&mut self.lane, 0);
        held.extend(self.new.drain(..).chain(self.lane.done.drain(..)));
        log::error!(
            "{name}: {ops} librbd operation(s) still out {ABANDON_WAIT:?} after the failure; their memory is \
             leaked, never freed, and {} request(s) answered with EIO",
            held.len()
        );
        self.queue.fail_leaked(&mut held);
    }
}
