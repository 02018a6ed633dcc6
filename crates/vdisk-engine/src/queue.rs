//! A device's request queue: many producers (connections) push batches, many
//! consumers (thread workers or rings) take batches. One short lock per batch,
//! not per request. Ring consumers sleep in `io_uring_enter`, not on the
//! condvar: they register a [`Waker`] (an eventfd the ring has a read armed on)
//! and a push writes to it only when that ring said it was going idle.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::wake::EventFd;
use crate::{Request, Sink};

pub(crate) type Job = (Request, Arc<dyn Sink>);

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

pub(crate) struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    consumers: usize,
    wakers: Mutex<Vec<Arc<Waker>>>,
}

struct State {
    jobs: VecDeque<Job>,
    closed: bool,
    /// Consumers blocked on `ready`: only then is a wake-up (a futex call) owed.
    waiting: usize,
}

impl Queue {
    pub fn new(consumers: usize) -> Self {
        Queue {
            state: Mutex::new(State { jobs: VecDeque::new(), closed: false, waiting: 0 }),
            ready: Condvar::new(),
            consumers: consumers.max(1),
            wakers: Mutex::new(Vec::new()),
        }
    }

    pub fn add_waker(&self, w: Arc<Waker>) {
        self.wakers.lock().unwrap().push(w);
    }

    pub fn push(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>) {
        let n = batch.len();
        if n == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.jobs.extend(batch.into_iter().map(|r| (r, sink.clone())));
        let waiting = st.waiting;
        drop(st);
        if waiting == 1 || (waiting > 1 && n == 1) {
            self.ready.notify_one();
        } else if waiting > 1 {
            self.ready.notify_all();
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
    pub fn take(&self, max: usize, into: &mut Vec<Job>) -> bool {
        let mut st = self.state.lock().unwrap();
        loop {
            if !st.jobs.is_empty() {
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
    pub fn try_take(&self, max: usize, into: &mut Vec<Job>) -> bool {
        let mut st = self.state.lock().unwrap();
        if !st.jobs.is_empty() {
            self.share(&mut st, max, into);
            return true;
        }
        !st.closed
    }

    fn share(&self, st: &mut State, max: usize, into: &mut Vec<Job>) {
        let share = st.jobs.len().div_ceil(self.consumers).clamp(1, max.max(1));
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
    }
}

/// Hands each sink its completed requests in one call.
pub(crate) fn deliver(jobs: &mut Vec<Job>) {
    let mut groups: Vec<(Arc<dyn Sink>, Vec<Request>)> = Vec::new();
    for (req, sink) in jobs.drain(..) {
        match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
            Some((_, reqs)) => reqs.push(req),
            None => groups.push((sink, vec![req])),
        }
    }
    for (sink, reqs) in groups {
        sink.complete(reqs);
    }
}
