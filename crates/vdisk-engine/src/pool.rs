//! The thread engine's process-wide pool: a fixed number of threads doing
//! blocking `preadv`/`pwritev2` for every thread-engine device, so a thousand
//! such devices cost table entries, not a thousand pools.
//!
//! This module owns the pool's threads, its ready list and each device's
//! [`Entry`] (its queue, spare planners, how many threads serve it now). A
//! push marks the device ready (once, until a thread takes it); threads take
//! ready devices round-robin, one batch each, and put a device with more
//! waiting at the back of the list. At most `cap` threads serve one device at
//! a time (`--workers`, bounded by half the pool), so a device whose storage
//! stalls holds at most `cap` threads in blocking calls and the others still
//! serve every other device.
//!
//! Failure stays per device: a panic while a thread performs or delivers one
//! device's batch is caught there (its blocking calls have returned, so the
//! requests' data is the thread's again); the batch is answered with EIO, the
//! device is failed, and the thread goes on serving the others.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::health;
use crate::mailbox::Detached;
use crate::plan::Planner;
use crate::queue::{Job, Queue, Server};
use crate::Request;

static CONFIGURED: AtomicUsize = AtomicUsize::new(0);
static POOL: OnceLock<Pool> = OnceLock::new();

thread_local! {
    /// On a pool thread, the entry whose batch it is serving (its address):
    /// that device, dropped or stopped there, must not wait for the thread.
    static SERVING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Threads the pool runs when [`configure`] was not called: 8 per CPU, at least 16.
fn default_size() -> usize {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cpus * 8).max(16)
}

/// Sets the pool's size (0: the default) before the first thread-engine device starts.
pub(crate) fn configure(threads: usize) {
    CONFIGURED.store(threads, Ordering::SeqCst);
}

/// True on a pool thread serving a batch of `entry` (its sink stopping or dropping the device).
pub(crate) fn serving(entry: &Arc<Entry>) -> bool {
    SERVING.with(|c| c.get()) == Arc::as_ptr(entry) as usize
}

/// The process-wide pool.
pub(crate) fn global() -> &'static Pool {
    POOL.get_or_init(|| {
        let n = CONFIGURED.load(Ordering::SeqCst);
        Pool::new(if n == 0 { default_size() } else { n })
    })
}

/// One device as the pool sees it.
pub(crate) struct Entry {
    queue: Arc<Queue>,
    /// Planners not in use (a thread takes one per batch, or makes one from `template`).
    planners: Mutex<Vec<Planner>>,
    template: Mutex<Planner>,
    batch: usize,
    /// Most threads serving this device at once.
    cap: usize,
    /// Set once the queue is closed and drained and no thread holds a batch of it.
    pub detached: Arc<Detached>,
}

impl Entry {
    /// Most threads that may serve this device at once.
    pub fn cap(&self) -> usize {
        self.cap
    }

    fn planner(&self) -> Planner {
        let spare = self.planners.lock().unwrap().pop();
        spare.unwrap_or_else(|| self.template.lock().unwrap().clone())
    }
}

/// An entry in the pool's table: how many threads serve it, whether it is listed as ready.
struct Slot {
    entry: Arc<Entry>,
    busy: usize,
    listed: bool,
}

struct State {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Devices with work, in the order threads take them.
    ready: VecDeque<usize>,
    started: usize,
    idle: usize,
}

pub(crate) struct Pool {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// Where a device's queue finds the pool.
pub(crate) struct Handle {
    slot: usize,
}

impl Server for Handle {
    /// The device has work (or was closed): list it as ready.
    fn notify(&self) {
        global().notify(self.slot);
    }
}

impl Pool {
    fn new(size: usize) -> Pool {
        let state = State { slots: Vec::new(), free: Vec::new(), ready: VecDeque::new(), started: 0, idle: 0 };
        Pool { size: size.max(2), state: Mutex::new(state), cv: Condvar::new() }
    }

    /// How many threads the pool runs at most.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Adds a device: served by at most `workers` threads (and half the pool) at once.
    pub fn attach(
        &'static self,
        planner: Planner,
        queue: &Arc<Queue>,
        batch: usize,
        workers: usize,
    ) -> std::io::Result<Arc<Entry>> {
        let cap = workers.clamp(1, (self.size / 2).max(1));
        let entry = Arc::new(Entry {
            queue: queue.clone(),
            planners: Mutex::new(Vec::new()),
            template: Mutex::new(planner),
            batch: batch.max(1),
            cap,
            detached: Arc::new(Detached::default()),
        });
        let mut st = self.state.lock().unwrap();
        if st.started == 0 {
            self.spawn(&mut st)?;
        }
        let slot = Slot { entry: entry.clone(), busy: 0, listed: false };
        let i = match st.free.pop() {
            Some(i) => {
                st.slots[i] = Some(slot);
                i
            }
            None => {
                st.slots.push(Some(slot));
                st.slots.len() - 1
            }
        };
        drop(st);
        queue.attach(Arc::new(Handle { slot: i }));
        Ok(entry)
    }

    fn spawn(&'static self, st: &mut State) -> std::io::Result<()> {
        let n = st.started;
        std::thread::Builder::new().name(format!("vdisk-pool{n}")).spawn(move || self.run())?;
        st.started += 1;
        st.idle += 1;
        Ok(())
    }

    /// Lists `slot` as ready unless it is already, or as many threads as it may have serve it.
    fn notify(&'static self, slot: usize) {
        let mut st = self.state.lock().unwrap();
        if let Some(s) = st.slots[slot].as_mut() {
            if !s.listed && s.busy < s.entry.cap {
                s.listed = true;
                st.ready.push_back(slot);
                self.wake(&mut st);
            }
        }
    }

    /// Wakes an idle thread, or starts one while fewer than `size` run.
    fn wake(&'static self, st: &mut State) {
        if st.idle == 0 && st.started < self.size {
            if let Err(e) = self.spawn(st) {
                log::warn!("the thread engine's pool cannot start a thread ({e}); {} serve", st.started);
            }
        }
        self.cv.notify_one();
    }

    fn run(&'static self) {
        let mut jobs: Vec<Job> = Vec::new();
        let mut st = self.state.lock().unwrap();
        loop {
            let Some(slot) = st.ready.pop_front() else {
                st = self.cv.wait(st).unwrap();
                continue;
            };
            st.idle -= 1;
            let s = st.slots[slot].as_mut().expect("a listed slot is in the table");
            s.listed = false;
            s.busy += 1;
            let entry = s.entry.clone();
            drop(st);
            SERVING.with(|c| c.set(Arc::as_ptr(&entry) as usize));
            self.serve(slot, &entry, &mut jobs);
            SERVING.with(|c| c.set(0));
            st = self.state.lock().unwrap();
            st.idle += 1;
            let s = st.slots[slot].as_mut().expect("a served slot is in the table");
            s.busy -= 1;
            let (busy, listed) = (s.busy, s.listed);
            if !listed && busy < entry.cap && entry.queue.has_jobs() {
                st.slots[slot].as_mut().unwrap().listed = true;
                st.ready.push_back(slot);
                self.cv.notify_one();
            } else if busy == 0 && !listed && entry.queue.is_drained() {
                // Closed, drained, no thread on it: the device is let go.
                st.slots[slot] = None;
                st.free.push(slot);
                entry.detached.set();
            }
        }
    }

    /// Takes one batch of the device and performs it; a device with more
    /// waiting is listed again first, for another thread.
    fn serve(&'static self, slot: usize, entry: &Entry, jobs: &mut Vec<Job>) {
        let served = catch_unwind(AssertUnwindSafe(|| {
            // A failed device's queue answers what it finds with EIO and hands out nothing.
            if !entry.queue.try_take(entry.batch, jobs) || jobs.is_empty() {
                return;
            }
            if entry.queue.has_jobs() {
                self.notify(slot);
            }
            let mut planner = entry.planner();
            // The image may have been swapped (a live snapshot) since this planner last ran.
            planner.refresh();
            let mut reqs: Vec<&mut Request> = jobs.iter_mut().map(|(r, _, _)| r).collect();
            let planner = crate::threads::execute(planner, &mut reqs);
            entry.planners.lock().unwrap().push(planner);
            entry.queue.deliver(jobs);
        }));
        if let Err(p) = served {
            let cause = format!("a thread of the thread engine's pool stopped on a {}", health::panic_message(&*p));
            entry.queue.health().fail(cause);
            entry.queue.fail(jobs);
        }
        jobs.clear();
    }
}
