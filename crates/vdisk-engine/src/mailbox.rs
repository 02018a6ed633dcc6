//! What a core worker shares with the devices it serves and with the core
//! that attaches them: its [`Inbox`] (commands and the ready list, under one
//! lock), its idle flag and eventfd ([`Shared`]), a device's [`Attachment`]
//! (the [`Server`] its queue tells of every push) and the [`Detached`] signal
//! a device's shutdown waits on. Plain data and the wake-up protocol; the
//! worker loop is `uring`, the attaching is `core`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use crate::plan::Planner;
use crate::queue::{Queue, Server};
use crate::wake::EventFd;

/// What a worker is asked to do besides serving ready devices.
pub(crate) enum Command {
    /// Serve a new device under `id`.
    Attach {
        id: u64,
        planner: Box<Planner>,
        queue: Arc<Queue>,
        attachment: Arc<Attachment>,
        detached: Arc<Detached>,
        batch: usize,
    },
    /// Stop: fail every device, cancel and reap (or leak) what is in the ring,
    /// then set `stopped` and answer EIO until the devices are shut down.
    Stop { stopped: Arc<Detached> },
}

/// What producers and the control path hand a worker, under one lock.
#[derive(Default)]
pub(crate) struct Inbox {
    pub commands: Vec<Command>,
    /// Devices with requests waiting (or newly closed), in arrival order: the
    /// worker serves them round-robin.
    pub ready: VecDeque<u64>,
}

/// A worker's side that devices see.
pub(crate) struct Shared {
    pub name: String,
    pub inbox: Mutex<Inbox>,
    /// Set by the worker just before it sleeps; a push that clears it owes one wake-up.
    pub idle: AtomicBool,
    pub efd: EventFd,
    /// Devices attached (the least loaded worker takes the next one).
    pub load: AtomicUsize,
    /// The worker's ring failed: every device on it is failed; it takes no new one.
    pub dead: AtomicBool,
    /// The worker's thread: a device dropped there (its last owner was a
    /// sink the worker just handed completions to) must not wait for it.
    pub thread: OnceLock<std::thread::ThreadId>,
}

impl Shared {
    /// True on this worker's own thread.
    pub fn is_current(&self) -> bool {
        self.thread.get() == Some(&std::thread::current().id())
    }
}

impl Shared {
    /// Device `id` has something for the worker (`flag` is the device's
    /// "already in the ready list" mark). Wakes the worker if it is idle.
    pub fn notify(&self, id: u64, flag: &AtomicBool) {
        if !flag.swap(true, Ordering::SeqCst) {
            self.inbox.lock().unwrap().ready.push_back(id);
        }
        self.wake_if_idle();
    }

    pub fn wake_if_idle(&self) {
        if self.idle.swap(false, Ordering::SeqCst) {
            self.efd.wake();
        }
    }

    pub fn command(&self, c: Command) {
        self.inbox.lock().unwrap().commands.push(c);
        self.idle.store(false, Ordering::SeqCst);
        self.efd.wake();
    }
}

/// Where a device's queue finds its worker.
pub(crate) struct Attachment {
    pub id: u64,
    pub worker: Arc<Shared>,
    /// The device is in the worker's ready list (or about to be).
    pub ready: AtomicBool,
}

impl Server for Attachment {
    fn notify(&self) {
        self.worker.notify(self.id, &self.ready);
    }
}

/// Set by the worker once it let go of a device (nothing of it in flight,
/// or what is left leaked), so its `shutdown` can return.
#[derive(Default)]
pub(crate) struct Detached {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Detached {
    pub fn set(&self) {
        *self.done.lock().unwrap() = true;
        self.cv.notify_all();
    }

    /// Waits until set (or `deadline`); true when set.
    pub fn wait(&self, deadline: Option<Instant>) -> bool {
        let mut done = self.done.lock().unwrap();
        while !*done {
            match deadline {
                None => done = self.cv.wait(done).unwrap(),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    done = self.cv.wait_timeout(done, left).unwrap().0;
                }
            }
        }
        true
    }
}
