//! A device's request queue: many producers (connections) push batches, many
//! consumers (thread workers or rings) take batches. One short lock per batch,
//! not per request. Ring consumers sleep in `io_uring_enter`, not on the
//! condvar: they register a [`Waker`] (an eventfd the ring has a read armed on)
//! and a push writes to it only when that ring said it was going idle.
//!
//! A uring device's queue is served by a core worker (see `core`): a push
//! marks the device ready on that worker, and wakes it only if it is idle.
//! A thread-engine device's queue is served by the shared pool (see `pool`)
//! the same way.
//!
//! The queue also carries the device's [`Health`]: once failed, whatever a
//! consumer takes is answered with EIO at once instead of handed to it, and
//! [`Queue::deliver`] (the one place queued requests complete) answers with
//! EIO too, and catches a sink that panics so the other sinks still get theirs.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use crate::faults::Faults;
use crate::gate::{GateSlot, Held};
use crate::health::{self, Health};
use crate::wake::EventFd;
use crate::{Request, Sink, Stats};

/// A request, where it goes when done, and when it was submitted.
pub(crate) type Job = (Request, Arc<dyn Sink>, Instant);

/// How a sleeping ring is woken: its eventfd, written only when it said it was going idle.
pub(crate) struct Waker {
    pub efd: EventFd,
    pub idle: AtomicBool,
}

impl Waker {
    pub fn wake(&self) {
        self.efd.wake();
    }
}

/// Who serves a queue that is not consumed by threads waiting on it (a core
/// worker): told of every push and of the close, it takes the jobs itself.
/// A trait, so the queue needs nothing of the worker's types.
pub(crate) trait Server: Send + Sync {
    fn notify(&self);
}

pub(crate) struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    consumers: usize,
    wakers: Mutex<Vec<Arc<Waker>>>,
    /// Who serves this device when no thread waits on the queue (a core
    /// worker, the thread engine's pool): a push marks it ready there.
    server: OnceLock<Arc<dyn Server>>,
    /// Counts every request in ([`Queue::push`]) and out ([`Queue::deliver`]).
    stats: Arc<Stats>,
    health: Health,
    /// `panic#N` (tests only).
    faults: Option<Arc<Faults>>,
    /// Requests taken from the queue and not yet delivered (see `swap`).
    taken: AtomicUsize,
    /// Batches the inline path is running in a caller's thread.
    inline: AtomicUsize,
    /// Quiesced: consumers take nothing, the inline path queues (see `swap`).
    held: AtomicBool,
    /// What completed requests pass before their sinks get them (see `gate`).
    pub gate: GateSlot,
}

/// A batch the inline path runs: in flight until dropped (a panic included).
pub(crate) struct InlineTurn<'a>(&'a Queue);

impl Drop for InlineTurn<'_> {
    fn drop(&mut self) {
        self.0.inline.fetch_sub(1, Ordering::SeqCst);
    }
}

struct State {
    jobs: VecDeque<Job>,
    closed: bool,
    /// Consumers blocked on `ready`: only then is a wake-up (a futex call) owed.
    waiting: usize,
}

impl Queue {
    pub fn new(consumers: usize, stats: Arc<Stats>, device: &str, faults: Option<Arc<Faults>>) -> Self {
        Queue {
            state: Mutex::new(State { jobs: VecDeque::new(), closed: false, waiting: 0 }),
            ready: Condvar::new(),
            consumers: consumers.max(1),
            wakers: Mutex::new(Vec::new()),
            server: OnceLock::new(),
            stats,
            health: Health::new(device),
            faults,
            taken: AtomicUsize::new(0),
            inline: AtomicUsize::new(0),
            held: AtomicBool::new(false),
            gate: GateSlot::default(),
        }
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    pub fn add_waker(&self, w: Arc<Waker>) {
        self.wakers.lock().unwrap().push(w);
    }

    /// Hands the queue to its server (a core worker, the pool): from now on a push marks the device ready there.
    pub fn attach(&self, server: Arc<dyn Server>) {
        let _ = self.server.set(server);
    }

    /// Closed, with nothing left waiting.
    pub fn is_drained(&self) -> bool {
        let st = self.state.lock().unwrap();
        st.closed && st.jobs.is_empty()
    }

    /// Requests are waiting (and may be taken: not while held).
    pub fn has_jobs(&self) -> bool {
        let st = self.state.lock().unwrap();
        !st.jobs.is_empty() && !self.is_held(&st)
    }

    /// Held, and not closed (a closing device drains what it holds).
    fn is_held(&self, st: &State) -> bool {
        self.held.load(Ordering::SeqCst) && !st.closed
    }

    /// Quiesces: from now on consumers take nothing and [`Queue::enter_inline`] refuses.
    pub fn hold(&self) {
        let _st = self.state.lock().unwrap();
        self.held.store(true, Ordering::SeqCst);
    }

    /// Lifts [`Queue::hold`]: wakes the consumers for what waited meanwhile.
    pub fn release(&self) {
        let waiting = {
            let st = self.state.lock().unwrap();
            self.held.store(false, Ordering::SeqCst);
            !st.jobs.is_empty()
        };
        self.ready.notify_all();
        if let Some(s) = self.server.get() {
            s.notify();
        }
        if waiting {
            for w in self.wakers.lock().unwrap().iter() {
                w.idle.store(false, Ordering::SeqCst);
                w.wake();
            }
        }
    }

    /// Requests taken and not delivered, plus inline batches running.
    pub fn in_flight(&self) -> usize {
        self.taken.load(Ordering::SeqCst) + self.inline.load(Ordering::SeqCst)
    }

    /// The inline path may run a batch while the turn lives (it counts as in
    /// flight); None while held: queue the batch instead.
    pub fn enter_inline(&self) -> Option<InlineTurn<'_>> {
        self.inline.fetch_add(1, Ordering::SeqCst);
        let turn = InlineTurn(self);
        if self.held.load(Ordering::SeqCst) {
            return None;
        }
        Some(turn)
    }

    /// Queues a batch submitted at `started`.
    pub fn push(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>, started: Instant) {
        self.stats.submitted(batch.len());
        self.push_counted(batch, sink, started);
    }

    /// [`Queue::push`] for requests the stats already count as in flight.
    pub fn push_counted(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>, started: Instant) {
        let n = batch.len();
        if n == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.jobs.extend(batch.into_iter().map(|r| (r, sink.clone(), started)));
        let waiting = st.waiting;
        drop(st);
        if waiting == 1 || (waiting > 1 && n == 1) {
            self.ready.notify_one();
        } else if waiting > 1 {
            self.ready.notify_all();
        }
        if let Some(s) = self.server.get() {
            return s.notify();
        }
        for w in self.wakers.lock().unwrap().iter() {
            if w.idle.swap(false, Ordering::SeqCst) {
                w.wake();
                if n == 1 {
                    break;
                }
            }
        }
    }

    /// Takes a fair share of what is waiting (at least one, at most `max`),
    /// blocking while the queue is empty. Returns false once closed and drained.
    /// On a failed device it answers what is waiting with EIO and waits on.
    pub fn take(&self, max: usize, into: &mut Vec<Job>) -> bool {
        let mut st = self.state.lock().unwrap();
        loop {
            if !st.jobs.is_empty() && self.health.is_failed() {
                let mut jobs: Vec<Job> = st.jobs.drain(..).collect();
                self.taken.fetch_add(jobs.len(), Ordering::SeqCst);
                drop(st);
                self.fail(&mut jobs);
                st = self.state.lock().unwrap();
                continue;
            }
            if !st.jobs.is_empty() && !self.is_held(&st) {
                self.share(&mut st, max, into);
                return true;
            }
            if st.closed {
                return false;
            }
            st.waiting += 1;
            st = self.ready.wait(st).unwrap();
            st.waiting -= 1;
        }
    }

    /// Like [`Queue::take`] without blocking: returns false once closed and drained.
    /// On a failed device it answers what is waiting with EIO and takes nothing.
    pub fn try_take(&self, max: usize, into: &mut Vec<Job>) -> bool {
        let mut st = self.state.lock().unwrap();
        if !st.jobs.is_empty() && self.health.is_failed() {
            let mut jobs: Vec<Job> = st.jobs.drain(..).collect();
            self.taken.fetch_add(jobs.len(), Ordering::SeqCst);
            let open = !st.closed;
            drop(st);
            self.fail(&mut jobs);
            return open;
        }
        if !st.jobs.is_empty() && !self.is_held(&st) {
            self.share(&mut st, max, into);
            return true;
        }
        !st.closed
    }

    fn share(&self, st: &mut State, max: usize, into: &mut Vec<Job>) {
        let share = st.jobs.len().div_ceil(self.consumers).clamp(1, max.max(1));
        self.taken.fetch_add(share, Ordering::SeqCst);
        into.extend(st.jobs.drain(..share));
        if !st.jobs.is_empty() && st.waiting > 0 {
            self.ready.notify_one();
        }
    }

    pub fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.ready.notify_all();
        for w in self.wakers.lock().unwrap().iter() {
            w.idle.store(false, Ordering::SeqCst);
            w.wake();
        }
        if let Some(s) = self.server.get() {
            s.notify();
        }
    }

    /// Answers `jobs` with the device's failure (EIO), through [`Queue::deliver`].
    pub(crate) fn fail(&self, jobs: &mut Vec<Job>) {
        let e = self.health.error();
        jobs.iter_mut().for_each(|(r, _, _)| health::failed(r, &e));
        self.deliver(jobs);
    }

    /// [`Queue::fail`] for requests whose data the kernel (or librbd) may
    /// still touch: their data is forgotten (leaked), never freed.
    pub(crate) fn fail_leaked(&self, jobs: &mut Vec<Job>) {
        let e = self.health.error();
        jobs.iter_mut().for_each(|(r, _, _)| health::leaked(r, &e));
        self.deliver(jobs);
    }

    /// What a worker of a failed device does until the device stops: answer
    /// every request pushed with EIO. Returns once the queue is closed.
    pub(crate) fn serve_failed(&self) {
        let mut none = Vec::new();
        // A failed device's `take` answers what it finds and hands out nothing; a
        // panic in it (a sink's is caught already) must not leave the device without
        // a worker to answer.
        loop {
            match catch_unwind(AssertUnwindSafe(|| self.take(1, &mut none))) {
                Ok(true) => {}
                Ok(false) => return,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }

    /// Counts completed requests in the stats (once each: this is the one
    /// place queued requests complete), then hands each sink its own in one call.
    /// On a failed device every request goes back with EIO.
    pub(crate) fn deliver(&self, jobs: &mut Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let failed = self.health.is_failed();
        if let (Some(f), false) = (&self.faults, failed) {
            // Before anything is handed over: the requests stay in `jobs`.
            f.check_delivery();
        }
        if failed {
            let e = self.health.error();
            jobs.iter_mut().for_each(|(r, _, _)| health::failed(r, &e));
        }
        // Under `faults`: none of it may still be with a backend (the sink may free it).
        #[cfg(feature = "faults")]
        for (r, _, _) in jobs.iter_mut() {
            if let Some(data) = r.cmd.data_mut().filter(|d| !d.is_empty()) {
                let seg = data.segment(0, data.len());
                crate::faults::check_not_lent(seg.ptr, seg.len, "answered");
            }
        }
        let n = jobs.len();
        self.hand_over(jobs);
        self.taken.fetch_sub(n, Ordering::SeqCst);
    }

    /// Counts complete and hands each sink its completed requests in one
    /// call, but for those the device's gate holds back. A sink that panics
    /// fails the device (its own requests are its own to answer) and the
    /// other sinks still get theirs.
    fn hand_over(&self, jobs: &mut Vec<Job>) {
        let held = |(request, sink, started)| Held::new(request, sink, started, self.stats.clone());
        let mut done: Vec<Held> = jobs.drain(..).map(held).collect();
        self.gate.filter(&mut done);
        // After a panic the device is failed, so what the sink left behind only sees EIO.
        if let Some(p) = crate::gate::answer(done).into_iter().next() {
            self.health.fail(format!("a sink taking its completions panicked ({p})"));
        }
    }
}
