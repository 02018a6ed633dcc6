//! The process-wide I/O core: a fixed set of io_uring workers (threads, one
//! ring each) shared by every device of the uring engine, like SPDK's
//! reactors or QEMU's iothreads. A device is a queue, a planner and its
//! health; it is attached to one worker (the one serving the fewest devices)
//! for its whole life and costs that worker a table entry, not a thread.
//!
//! This module owns the workers (started lazily, picked by load) and the
//! attach protocol; what a worker shares with its devices — the inbox
//! producers and the control path write into, the idle flag and eventfd that
//! wake it — is `mailbox`. It never touches a request's data: the worker loop
//! (`uring`) does. A push marks its device ready on the worker
//! (once, until the worker takes it) and writes the eventfd only when the
//! worker said it was going idle: one wake-up per idle period, not per request.
//!
//! The binary sets the number of workers once ([`Core::configure`], `vdisk
//! serve --io-threads N`) before the first device starts; the default is one
//! per CPU. Workers start lazily, on the first device attached to them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::mailbox::{Attachment, Command, Detached, Inbox, Shared};
use crate::plan::Planner;
use crate::queue::Queue;
use crate::wake::EventFd;

/// Workers the core starts when [`Core::configure`] was not called: one per CPU.
fn default_workers() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

static CONFIGURED: AtomicUsize = AtomicUsize::new(0);
static CORE: OnceLock<Core> = OnceLock::new();
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Submission-queue entries of a core ring (its completion queue holds four times as many).
pub(crate) const CORE_RING_ENTRIES: u32 = 512;

/// The shared I/O core: its workers, started as devices need them.
pub struct Core {
    size: usize,
    /// Submission-queue entries of each ring (the completion queue holds four times as many).
    entries: u32,
    /// Started workers (their threads run for the life of the process).
    workers: Mutex<Vec<Arc<Shared>>>,
}

impl Core {
    /// Sets how many workers the process-wide core runs (0: one per CPU).
    /// Only the first call before the first device starts counts; returns
    /// false when the core is already running (with the size it has).
    /// The thread engine's shared pool gets 8 threads per core worker (0: its default).
    pub fn configure(io_threads: usize) -> bool {
        CONFIGURED.store(io_threads, Ordering::SeqCst);
        crate::pool::configure(io_threads * 8);
        CORE.get().is_none()
    }

    /// The process-wide core.
    pub fn global() -> &'static Core {
        CORE.get_or_init(|| {
            let n = CONFIGURED.load(Ordering::SeqCst);
            Core::new(if n == 0 { default_workers() } else { n })
        })
    }

    /// A core of its own with `workers` workers (tests; a device that must
    /// not share, e.g. one whose mapping may block).
    pub fn new(workers: usize) -> Core {
        Self::with_ring_entries(workers, CORE_RING_ENTRIES)
    }

    /// [`Core::new`] with rings of `entries` submission entries (tests: a tiny ring).
    pub fn with_ring_entries(workers: usize, entries: u32) -> Core {
        Core { size: workers.max(1), entries: entries.max(1), workers: Mutex::new(Vec::new()) }
    }

    /// How many workers this core runs (at most; they start as devices come).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Devices attached to each started worker.
    pub fn loads(&self) -> Vec<usize> {
        self.workers.lock().unwrap().iter().map(|s| s.load.load(Ordering::Relaxed)).collect()
    }

    /// Attaches a device to the least loaded live worker (starting one while
    /// fewer than `size` run). The worker serves it from its next loop on.
    pub(crate) fn attach(
        &self,
        planner: Planner,
        queue: &Arc<Queue>,
        batch: usize,
    ) -> std::io::Result<(Arc<Attachment>, Arc<Detached>)> {
        let worker = self.pick()?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let attachment = Arc::new(Attachment { id, worker: worker.clone(), ready: AtomicBool::new(false) });
        let detached = Arc::new(Detached::default());
        worker.load.fetch_add(1, Ordering::SeqCst);
        queue.attach(attachment.clone());
        worker.command(Command::Attach {
            id,
            planner: Box::new(planner),
            queue: queue.clone(),
            attachment: attachment.clone(),
            detached: detached.clone(),
            batch: batch.max(1),
        });
        Ok((attachment, detached))
    }

    /// Stops every started worker: each fails its devices (their requests
    /// answer EIO, naming the stop), cancels what is in its ring and reaps it
    /// (what the kernel has not given back within two seconds is leaked, never
    /// freed), then answers EIO until its devices are shut down. Returns once
    /// every worker has. A device started on this core afterwards gets a new worker.
    pub fn stop(&self) {
        let workers: Vec<Arc<Shared>> = self.workers.lock().unwrap().clone();
        let waits: Vec<Arc<Detached>> = workers
            .iter()
            .map(|w| {
                let stopped = Arc::new(Detached::default());
                w.command(Command::Stop { stopped: stopped.clone() });
                stopped
            })
            .collect();
        for w in waits {
            w.wait(None);
        }
    }

    fn pick(&self) -> std::io::Result<Arc<Shared>> {
        let mut workers = self.workers.lock().unwrap();
        let live = workers.iter().filter(|s| !s.dead.load(Ordering::SeqCst));
        let least = live.min_by_key(|s| s.load.load(Ordering::SeqCst)).cloned();
        let started = workers.len();
        match least {
            Some(s) if s.load.load(Ordering::SeqCst) == 0 || started >= self.size => Ok(s),
            _ => {
                let shared = Arc::new(Shared {
                    name: format!("vdisk-io{started}"),
                    inbox: Mutex::new(Inbox::default()),
                    idle: AtomicBool::new(false),
                    efd: EventFd::new()?,
                    load: AtomicUsize::new(0),
                    dead: AtomicBool::new(false),
                    thread: OnceLock::new(),
                });
                crate::uring::CoreWorker::spawn(shared.clone(), self.entries)?;
                workers.push(shared.clone());
                Ok(shared)
            }
        }
    }
}
