//! The engine moves a device's bytes. Each device has its own queue, stats,
//! QoS and health. Uring devices share the process-wide [`Core`]: a fixed set
//! of io_uring workers (one per CPU by default) serving their ready devices
//! round-robin, a batch each, so a thousand devices cost table entries, not
//! threads, and a flooding device cannot starve a quiet one on its ring.
//! Thread-engine devices share the process-wide pool of blocking workers
//! (`pool`: round-robin too, at most `--workers` threads per device), RBD
//! devices keep a loop each.
//! Exports submit requests in batches; workers take them in batches, map them
//! through the image, merge what is contiguous into single vectored calls,
//! and hand completions back in batches.
//!
//! The engine knows nothing of wire protocols: a request is a [`Command`] (an [`Op`]
//! with the data it owns), a range and an opaque tag.
//!
//! Durability: a write completes once it is in the host page cache, unless it
//! carries FUA or the device is in sync mode (then `RWF_DSYNC`, still in
//! parallel, plus an fdatasync when the image is on FUSE, where the kernel may
//! drop that flag). A FLUSH syncs every file of the image and then its metadata, so
//! every write completed before the FLUSH was submitted, on any connection, is
//! durable when the FLUSH completes.
//!
//! Never hang, never free what the kernel owns: every blocking call of a
//! worker retries EINTR (a stopped and continued process gets it); a worker
//! that panics or meets an unrecoverable error is caught at its thread's edge,
//! gives back what it held (cancelled and reaped, or leaked where the kernel
//! or librbd may still touch it: the one in-flight table of every backend,
//! `flight`, and its owners `uring`, `threads` and `rbd`) and fails the device
//! ([`Device::failure`]): its requests, then and later, complete with EIO,
//! while every other device goes on. Stopping can be bounded
//! ([`Device::shutdown_within`]).

mod buf;
mod core;
mod errlog;
#[cfg(feature = "faults")]
mod faults;
/// Without the `faults` feature nothing is ever injected: a device holds `None`.
#[cfg(not(feature = "faults"))]
mod faults {
    use std::sync::Arc;

    use vdisk_image::Error;

    pub enum Faults {}

    impl Faults {
        pub fn from_env(device: &str) -> Option<Arc<Faults>> {
            if std::env::var_os("VDISK_FAULTS").is_some() {
                log::warn!("{device}: VDISK_FAULTS is set but this build has no fault injection (feature `faults`)");
            }
            None
        }

        pub fn check(&self, _write: bool, _offset: u64, _len: u64) -> Option<Error> {
            match *self {}
        }

        pub fn check_flush(&self, _what: &str) -> Option<Error> {
            match *self {}
        }

        pub fn check_delivery(&self) {
            match *self {}
        }

        pub fn check_enter(&self) -> Option<EnterFault> {
            match *self {}
        }

        pub fn delay(&self) -> Option<u64> {
            match *self {}
        }

        pub fn lend(&self, _iov: &[libc::iovec]) {
            match *self {}
        }

        pub fn returned(&self, _iov: &[libc::iovec]) {
            match *self {}
        }
    }

    /// Nothing is lent to a backend under watch in this build.
    #[inline]
    pub fn freeing(_ptr: *const u8, _len: usize) {}

    /// Never made: only a [`Faults`] (which this build cannot have) makes one.
    #[allow(dead_code)]
    pub enum EnterFault {
        Fail(i32),
        Interrupt,
    }
}
mod flight;
mod gate;
mod health;
pub mod inflight;
mod lent;
mod mailbox;
mod observe;
mod plan;
mod pool;
pub mod qos;
mod queue;
mod rbd;
mod request;
mod ring;
pub mod slab;
pub mod stats;
pub mod submit;
mod swap;
mod sys;
mod threads;
mod uring;
mod uring_ops;
mod validate;
pub mod wake;
mod zero;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vdisk_image::{Image, Result};

pub use crate::core::Core;
pub use buf::{Buf, ALIGN};
pub use errlog::{ErrorLog, ERROR_LOG_INTERVAL};
pub use gate::{answer, Held, WriteGate};
pub use lent::Lent;
pub use observe::Observers;
pub use qos::Limits;
pub use request::{Command, Data, Op, Request, Sink};
pub use stats::{Snapshot, Stats};
pub use swap::Quiesced;
pub use validate::{validate, Bounds, Refusal};

use queue::Queue;

/// Which engine moves a device's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// A pool of worker threads doing blocking `preadv`/`pwritev2`.
    Threads,
    /// io_uring: whole batches per `io_uring_enter`, on the rings of the
    /// process-wide [`Core`] shared by every device.
    Uring,
    /// librbd's AIO, for images on Ceph RBD (chosen for them whatever was asked).
    Rbd,
}

/// How a device's engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// Most threads of the shared pool serving one device at once (thread
    /// engine; bounded by half the pool, so a stalled device cannot hold them all).
    pub workers: usize,
    /// Unused since the uring engine runs on the shared [`Core`] (one core
    /// worker serves a device; `--io-threads` sets how many there are). Kept
    /// so configurations that set it still load.
    pub rings: usize,
    /// Unused: the [`Core`]'s rings have a fixed size.
    pub ring_entries: u32,
    /// Unused: the [`Core`]'s rings are not set up with SQPOLL.
    pub sqpoll: bool,
    /// Every write durable before it completes.
    pub sync: bool,
    /// Most requests a worker takes from the queue at once (on a core
    /// worker: per device and round, the fairness quantum).
    pub batch: usize,
    /// Merge contiguous reads or writes of a batch into one vectored call.
    pub coalesce: bool,
    /// Let [`Device::submit_inline`] finish in the caller's thread what needs no
    /// device: everything on an in-memory file, page-cache hits elsewhere.
    pub inline: bool,
}

/// The defaults of `vdisk serve`: the ring engine (falling back to threads
/// where the kernel has no io_uring), 16 workers, 1 ring, batches of 64.
impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kind: EngineKind::Uring,
            workers: 16,
            rings: 1,
            ring_entries: 256,
            sqpoll: false,
            sync: false,
            batch: 64,
            coalesce: true,
            inline: true,
        }
    }
}

/// The largest read or write [`Device::submit_inline`] performs in the caller's thread.
const INLINE_MAX: u64 = 128 << 10;

/// What [`Device::submit_inline`] may finish in the caller's thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inline {
    Never,
    /// The files are in memory: nothing ever waits for a device.
    All,
    /// Reads whose data is all in the page cache (`RWF_NOWAIT`).
    CachedReads,
}

/// One virtual disk: its image, queue, stats, QoS and health, served by a
/// core worker (uring) or workers of its own (threads, rbd).
pub struct Device {
    name: String,
    kind: EngineKind,
    /// The configuration lets the inline path run (what it may do depends on the image: `swap::Current`).
    inline_allowed: bool,
    /// Cleared the first time the file system refuses RWF_NOWAIT.
    nowait_works: AtomicBool,
    sync: bool,
    coalesce: bool,
    /// The image served now, replaced under a quiesce (see `swap`).
    slot: Arc<swap::Slot>,
    /// Injected failures (tests only; see `faults`).
    faults: Option<Arc<faults::Faults>>,
    queue: Arc<Queue>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// The core worker serving a uring device, and its "let go" signal.
    attached: Option<(Arc<mailbox::Attachment>, Arc<mailbox::Detached>)>,
    /// The thread engine's pool entry of a thread-engine device.
    pooled: Option<Arc<pool::Entry>>,
    /// Shared with the queue, which counts completions.
    stats: Arc<Stats>,
    qos: qos::Qos,
    /// Where the exports report the requests that failed (rate-limited).
    errors: Arc<ErrorLog>,
    /// The dirty maps every completed write marks (bitmaps, copy jobs).
    observers: Arc<Observers>,
}

impl Device {
    /// Starts the engine of a device over `image`. A uring engine the kernel
    /// cannot run falls back to threads, with a log line that says why.
    /// The uring engine runs on the process-wide [`Core::global`].
    pub fn start(name: &str, image: Arc<dyn Image>, config: &EngineConfig) -> std::io::Result<Device> {
        Self::start_on(Core::global(), name, image, config)
    }

    /// [`Device::start`] on the workers of `core` (for the uring engine).
    pub fn start_on(core: &Core, name: &str, image: Arc<dyn Image>, config: &EngineConfig) -> std::io::Result<Device> {
        if rbd::uses_librbd(&*image) {
            return Self::spawn(core, name, &image, config, EngineKind::Rbd);
        }
        // Blocking calls to a target that is not a file are the thread engine's.
        if blocking_image(&*image) {
            return Self::spawn(core, name, &image, config, EngineKind::Threads);
        }
        // An image that pins its reads until they are performed needs them
        // mapped and performed in one thread (see `Image::pins_reads`).
        if config.kind == EngineKind::Uring && !image.pins_reads() {
            match uring::probe()
                .map_err(|e| std::io::Error::other(e.report().to_string()))
                .and_then(|()| Self::spawn(core, name, &image, config, EngineKind::Uring))
            {
                Ok(dev) => return Ok(dev),
                Err(e) => log::warn!("{name}: io_uring unavailable ({e}); using the thread engine instead"),
            }
        }
        Self::spawn(core, name, &image, config, EngineKind::Threads)
    }

    fn spawn(
        core: &Core,
        name: &str,
        image: &Arc<dyn Image>,
        config: &EngineConfig,
        kind: EngineKind,
    ) -> std::io::Result<Device> {
        let consumers = match kind {
            EngineKind::Uring => 1,
            // Threads of the shared pool serving it at once (half the pool at most).
            EngineKind::Threads => config.workers.clamp(1, (pool::global().size() / 2).max(1)),
            // One loop per image: librbd signals all of an image's completions on one eventfd.
            EngineKind::Rbd => 1,
        }
        .max(1);
        let stats = Arc::new(Stats::default());
        let faults = faults::Faults::from_env(name);
        let queue = Arc::new(Queue::new(consumers, stats.clone(), name, faults.clone()));
        let current = swap::Current::new(image.clone(), kind, config.inline);
        let dsync_unreliable = current.dsync_unreliable;
        let mut dev = Device {
            name: name.to_owned(),
            kind,
            inline_allowed: config.inline,
            nowait_works: AtomicBool::new(true),
            sync: config.sync,
            coalesce: config.coalesce,
            slot: Arc::new(swap::Slot::new(current)),
            faults,
            queue,
            workers: Mutex::new(Vec::new()),
            attached: None,
            pooled: None,
            stats,
            qos: qos::Qos::default(),
            errors: Arc::new(ErrorLog::new(name)),
            observers: Arc::default(),
        };
        if kind == EngineKind::Uring {
            if dsync_unreliable {
                log::info!(
                    "{name}: on FUSE, where RWF_DSYNC may not reach the file system; durable writes are followed by \
                     an fdatasync"
                );
            }
            dev.attached = Some(core.attach(dev.planner(), &dev.queue, config.batch)?);
            return Ok(dev);
        }
        if kind == EngineKind::Threads {
            dev.pooled = Some(pool::global().attach(dev.planner(), &dev.queue, config.batch, consumers)?);
            return Ok(dev);
        }
        for _ in 0..consumers {
            let (planner, queue) = (dev.planner(), dev.queue.clone());
            let batch = if config.batch > 1 { config.batch * 4 } else { 1 };
            let handle = match kind {
                EngineKind::Rbd => {
                    spawn_built(format!("{name}-rbd"), move || rbd::RbdWorker::new(planner, queue, batch), |w| w.run())?
                }
                EngineKind::Uring | EngineKind::Threads => unreachable!("attached to the core or the pool above"),
            };
            dev.workers.lock().unwrap().push(handle);
        }
        Ok(dev)
    }

    /// A planner for this device's requests.
    fn planner(&self) -> plan::Planner {
        let mut planner = plan::Planner::for_slot(&self.slot, self.sync, self.coalesce);
        planner.faults = self.faults.clone();
        planner.observers = self.observers.clone();
        planner
    }

    /// Runs `batch` on the current image in the caller's thread (under a
    /// quiesce: see `swap`); its writes mark the dirty maps if `observed`.
    fn execute_now(&self, batch: &mut [Request], observed: bool) {
        let mut reqs: Vec<&mut Request> = batch.iter_mut().collect();
        let mut planner = self.planner();
        if !observed {
            planner.observers = Arc::default();
        }
        threads::execute(planner, &mut reqs);
    }

    /// The dirty maps this device marks with every write, TRIM and
    /// WRITE_ZEROES it completes (see [`Observers`]): add a map before the
    /// copy or backup that reads it starts, remove it when done.
    pub fn write_observers(&self) -> &Arc<Observers> {
        &self.observers
    }

    /// Puts `gate` on the device's completed requests (or takes it off with
    /// None): what it holds back it answers itself (see [`WriteGate`]). The
    /// gate replaced is opened; the device opens its gate when it stops.
    pub fn set_write_gate(&self, gate: Option<Arc<dyn WriteGate>>) {
        self.queue.gate.set(gate);
    }

    /// How many threads the thread engine's shared pool runs at most.
    pub fn thread_pool_size() -> usize {
        pool::global().size()
    }

    /// Most threads of the shared pool serving this device at once (thread engine only).
    pub fn pool_share(&self) -> Option<usize> {
        self.pooled.as_ref().map(|e| e.cap())
    }

    /// The engine actually running (after any fallback).
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.slot.get().image.size()
    }

    pub fn read_only(&self) -> bool {
        self.slot.get().image.read_only()
    }

    /// What [`validate`] judges this device's requests against: its size and
    /// read-only state, with no limits of an export (an export adds its own).
    pub fn bounds(&self) -> Bounds {
        Bounds::new(self.size(), self.read_only())
    }

    /// The image served now (a swap may replace it: see [`Device::quiesce`]).
    pub fn image(&self) -> Arc<dyn Image> {
        self.slot.get().image.clone()
    }

    /// Why the device failed (naming it and the error), or None while it serves.
    /// A failed device answers every request with EIO until it is shut down.
    pub fn failure(&self) -> Option<String> {
        self.queue.health().failure()
    }

    /// Where the exports report the requests the engine failed: the first is
    /// logged, then at most one line per [`ERROR_LOG_INTERVAL`] with the count.
    pub fn errors(&self) -> &Arc<ErrorLog> {
        &self.errors
    }

    /// What this device has done so far (every export's requests together).
    pub fn stats(&self) -> Snapshot {
        self.stats.snapshot()
    }

    pub fn limits(&self) -> Limits {
        self.qos.limits()
    }

    /// Changes the device's QoS limits, live (0 lifts one).
    pub fn set_limits(&self, limits: Limits) {
        self.qos.set(limits);
    }

    /// Queues a batch; each request comes back through `sink` once done. Over
    /// the device's QoS limits, this waits first (not on a failed device, whose
    /// requests are answered with EIO at once).
    pub fn submit(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>) {
        self.admit(&batch);
        self.queue.push(batch, sink, std::time::Instant::now());
    }

    /// Finishes in the caller's thread what needs no device and puts it in
    /// `done` (the caller answers those); queues the rest, which comes back
    /// through `sink`. On an in-memory file everything finishes inline; on
    /// others, reads the page cache can serve in full.
    pub fn submit_inline(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>, done: &mut Vec<Request>) {
        self.admit(&batch);
        let (started, first) = (std::time::Instant::now(), done.len());
        self.stats.submitted(batch.len());
        self.submit_inline_counted(batch, sink, done, started);
        let Some(gate) = self.queue.gate.get() else {
            return self.stats.completed(done[first..].iter(), started);
        };
        let held = |request| Held::new(request, sink.clone(), started, self.stats.clone());
        let mut passed: Vec<Held> = done.drain(first..).map(held).collect();
        gate.hold(&mut passed);
        // Counted complete as they pass; what the gate holds, once answered.
        self.stats.completed(passed.iter().map(|h| &h.request), started);
        done.extend(passed.into_iter().map(|h| h.request));
    }

    /// Waits for QoS tokens, unless the device failed.
    fn admit(&self, batch: &[Request]) {
        if !self.queue.health().is_failed() {
            self.qos.admit(batch);
        }
    }

    /// [`Device::submit_inline`] once QoS admitted the batch and it was counted in.
    fn submit_inline_counted(
        &self,
        batch: Vec<Request>,
        sink: &Arc<dyn Sink>,
        done: &mut Vec<Request>,
        started: std::time::Instant,
    ) {
        let submit = |batch: Vec<Request>| self.queue.push_counted(batch, sink, started);
        if self.queue.health().is_failed() {
            // Answered with EIO by a worker, like every request of a failed device.
            return submit(batch);
        }
        // Quiesced: held in the queue like every other request (see `swap`).
        let Some(_turn) = self.queue.enter_inline() else { return submit(batch) };
        let inline = self.slot.get().inline;
        self.run_inline(inline, self.planner(), batch, &submit, done);
    }

    /// What [`Device::submit_inline`] does once it may run inline.
    fn run_inline(
        &self,
        inline: Inline,
        mut planner: plan::Planner,
        batch: Vec<Request>,
        submit: &dyn Fn(Vec<Request>),
        done: &mut Vec<Request>,
    ) {
        match inline {
            Inline::Never => submit(batch),
            Inline::All => {
                // Large transfers go to the engine: copying them inline would stall
                // the caller (a connection's reader) while it could be receiving.
                let first = done.len();
                done.reserve(batch.len());
                let mut large = Vec::new();
                for r in batch {
                    if !r.op().is_data() || r.len <= INLINE_MAX {
                        done.push(r);
                    } else {
                        large.push(r);
                    }
                }
                let mut reqs: Vec<&mut Request> = done[first..].iter_mut().collect();
                threads::execute(planner, &mut reqs);
                submit(large);
            }
            Inline::CachedReads if !self.nowait_works.load(Ordering::Relaxed) => submit(batch),
            Inline::CachedReads => {
                let (mut reads, mut rest): (Vec<Request>, Vec<Request>) =
                    batch.into_iter().partition(|r| r.op() == Op::Read && r.len <= INLINE_MAX);
                let runs = planner.plan(reads.iter_mut().enumerate());
                let mut missed = vec![false; reads.len()];
                for run in &runs {
                    // SAFETY: the runs point into `reads`, alive and untouched until after the loop.
                    let hit = match unsafe { planner.perform_cached(run) } {
                        Ok(hit) => hit,
                        Err(e) => {
                            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                                self.nowait_works.store(false, Ordering::Relaxed);
                            }
                            false
                        }
                    };
                    if !hit {
                        run.jobs.iter().for_each(|&j| missed[j] = true);
                    }
                }
                // A missed read is mapped again by the worker that performs it.
                planner.release_reads();
                for (req, missed) in reads.into_iter().zip(missed) {
                    if missed && req.error.is_none() {
                        rest.push(req);
                    } else {
                        done.push(req);
                    }
                }
                submit(rest);
            }
        }
    }

    /// Finishes what is queued, stops the workers and makes every write durable.
    /// Submitting after this is a bug: those requests would never complete.
    /// A failed device stops at once (what it holds is answered with EIO),
    /// is flushed as far as it can be, and returns an error naming its failure.
    pub fn shutdown(&self) -> Result<()> {
        self.stop(None)
    }

    /// [`Device::shutdown`], giving up after `limit`: workers that have not
    /// finished by then, or a flush that has not, are left running (detached)
    /// and the error names them.
    pub fn shutdown_within(&self, limit: Duration) -> Result<()> {
        self.stop(Some(Instant::now() + limit))
    }

    fn stop(&self, deadline: Option<Instant>) -> Result<()> {
        let left = self.stop_workers(deadline);
        if !left.is_empty() {
            let e = std::io::Error::from_raw_os_error(libc::ETIMEDOUT);
            let what = format!(
                "device {:?}: {} did not finish in time and {} left running; its last writes may not be durable",
                self.name,
                left.join(", "),
                if left.len() == 1 { "is" } else { "are" }
            );
            return Err(vdisk_image::Error::io(e, what));
        }
        let image = self.image();
        let flushed = bounded(deadline, move || {
            let r = plan::Planner::new(image.clone(), false, false).flush();
            // Its targets let go now, not whenever the last reference goes: an RBD
            // image's exclusive lock would otherwise keep another client waiting.
            (0..).map_while(|i| image.target(i)).for_each(|t| t.release());
            r
        });
        let flushed = flushed.unwrap_or_else(|why| {
            let what = format!("the final flush of device {:?} {why}; its last writes may not be durable", self.name);
            Err(vdisk_image::Error::io(std::io::Error::from_raw_os_error(libc::EIO), what))
        });
        match self.failure() {
            None => flushed,
            Some(cause) => {
                let flush = match flushed {
                    Ok(()) => "what it had acknowledged was flushed".to_owned(),
                    Err(e) => format!("and {}", e.report()),
                };
                Err(vdisk_image::Error::new(vdisk_image::ErrorKind::Io, format!("{cause}; {flush}")))
            }
        }
    }

    /// Closes the queue and joins the workers (until `deadline`, if any).
    /// Returns the names of those still running then, now detached.
    fn stop_workers(&self, deadline: Option<Instant>) -> Vec<String> {
        self.queue.close();
        // What a gate holds is answered now; what completes from here on passes.
        self.queue.gate.set(None);
        let mut left = Vec::new();
        if let Some((att, detached)) = &self.attached {
            // The core worker lets go of the device once its requests are all answered;
            // on that worker's own thread (a sink dropped the last owner) it cannot be
            // waited for: it lets go after this returns.
            if att.worker.is_current() {
                left.push(format!("its requests on core worker {} (stopped from that worker)", att.worker.name));
            } else if !detached.wait(deadline) {
                left.push(format!("its requests on core worker {}", att.worker.name));
            }
        }
        if let Some(entry) = &self.pooled {
            // As on the core: from the pool thread serving its batch it cannot be waited for.
            if pool::serving(entry) {
                left.push(
                    "its requests on the thread engine's pool (stopped from a pool thread serving it)".to_owned(),
                );
            } else if !entry.detached.wait(deadline) {
                left.push(format!("its requests on the thread engine's pool (up to {} threads)", entry.cap()));
            }
        }
        let workers = std::mem::take(&mut *self.workers.lock().unwrap());
        for w in workers {
            if let Some(d) = deadline {
                while !w.is_finished() && Instant::now() < d {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if !w.is_finished() {
                    left.push(w.thread().name().unwrap_or("a worker").to_owned());
                    continue;
                }
            }
            let _ = w.join();
        }
        left
    }
}

/// Syncs every file of `image`, then its metadata (what a FLUSH does).
fn flush_image(image: &Arc<dyn Image>) -> Result<()> {
    plan::Planner::new(image.clone(), false, false).flush()
}

/// The image has a target that is not a file (an RBD image, an NBD export):
/// the file engines perform its I/O with the target's blocking calls.
pub(crate) fn blocking_image(image: &dyn Image) -> bool {
    image.target(image.files().len()).is_some()
}

/// Runs `f` (which must not panic the caller: a panic is its error), on a
/// thread of its own when there is a deadline, which is then left running if
/// it misses it.
fn bounded<T: Send + 'static>(
    deadline: Option<Instant>,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> std::result::Result<Result<T>, String> {
    let caught = |f: Box<dyn FnOnce() -> Result<T> + Send>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|p| format!("failed ({})", health::panic_message(&*p)))
    };
    let Some(deadline) = deadline else { return caught(Box::new(f)) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("vdisk-stop".into())
        .spawn(move || {
            let _ = tx.send(caught(Box::new(f)));
        })
        .map_err(|e| format!("could not start ({e})"))?;
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(r) => r,
        Err(_) => Err("did not finish in time (left running, detached)".to_owned()),
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.stop_workers(None);
    }
}

/// Starts a consumer whose state is built on its own thread (a ring or an RBD
/// loop holds raw pointers into that state while it runs), once it is built.
fn spawn_built<W: 'static>(
    thread: String,
    build: impl FnOnce() -> std::io::Result<W> + Send + 'static,
    run: fn(W),
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let what = format!("{thread} thread died");
    let h = std::thread::Builder::new().name(thread).spawn(move || match build() {
        Ok(w) => {
            let _ = tx.send(Ok(()));
            run(w)
        }
        Err(e) => {
            let _ = tx.send(Err(e));
        }
    })?;
    rx.recv().unwrap_or_else(|_| Err(std::io::Error::other(what)))?;
    Ok(h)
}

#[cfg(test)]
mod tests;
