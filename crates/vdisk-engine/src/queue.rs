//! A device's request queue: many producers (connections) push batches, many
//! workers take batches. One short lock per batch, not per request.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use crate::{Request, Sink};

pub(crate) type Job = (Request, Arc<dyn Sink>);

pub(crate) struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    workers: usize,
}

struct State {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl Queue {
    pub fn new(workers: usize) -> Self {
        Queue { state: Mutex::new(State { jobs: VecDeque::new(), closed: false }), ready: Condvar::new(), workers }
    }

    pub fn push(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>) {
        let n = batch.len();
        if n == 0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.jobs.extend(batch.into_iter().map(|r| (r, sink.clone())));
        drop(st);
        if n == 1 {
            self.ready.notify_one();
        } else {
            self.ready.notify_all();
        }
    }

    /// Takes a fair share of what is waiting (at least one, at most `max`),
    /// blocking while the queue is empty. Returns false once closed and drained.
    pub fn take(&self, max: usize, into: &mut Vec<Job>) -> bool {
        let mut st = self.state.lock().unwrap();
        loop {
            if !st.jobs.is_empty() {
                let share = st.jobs.len().div_ceil(self.workers).clamp(1, max.max(1));
                into.extend(st.jobs.drain(..share));
                let more = !st.jobs.is_empty();
                drop(st);
                if more {
                    self.ready.notify_one();
                }
                return true;
            }
            if st.closed {
                return false;
            }
            st = self.ready.wait(st).unwrap();
        }
    }

    pub fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.ready.notify_all();
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
