//! The thread engine: a pool of workers per device, each taking a fair share
//! of the queue, performing its runs with blocking `preadv`/`pwritev2`, then
//! handing completions back grouped by sink. [`execute`] is also what runs a
//! batch inline in the caller's thread.
//!
//! Every call a worker blocks in retries EINTR (`sys`; the queue's condvar
//! has none). A panic is caught at the thread's edge: the blocking calls of
//! the batch have returned by then, so its requests' data is the worker's
//! again; they are answered with EIO, the device is failed, and the worker
//! goes on answering the device's requests with EIO until it stops.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::health;
use crate::plan::Planner;
use crate::queue::{Job, Queue};
use crate::{Op, Request};

pub(crate) struct Worker {
    planner: Planner,
    queue: Arc<Queue>,
    batch: usize,
}

impl Worker {
    pub fn new(planner: Planner, queue: Arc<Queue>, batch: usize) -> Self {
        Worker { planner, queue, batch: batch.max(1) }
    }

    pub fn run(mut self) {
        // Outside the unwinding: a panic leaves the batch here to be answered.
        let mut jobs = Vec::with_capacity(self.batch);
        while let Err(p) = catch_unwind(AssertUnwindSafe(|| self.serve(&mut jobs))) {
            let cause = format!("a worker thread of its thread engine stopped on a {}", health::panic_message(&*p));
            self.queue.health().fail(cause);
            self.queue.fail(&mut jobs);
            // Serving again, on a failed queue: every request taken is answered with EIO.
        }
    }

    fn serve(&mut self, jobs: &mut Vec<Job>) {
        while self.queue.take(self.batch, jobs) {
            self.planner.refresh();
            let mut reqs: Vec<&mut Request> = jobs.iter_mut().map(|(r, _, _)| r).collect();
            execute(&mut self.planner, &mut reqs);
            self.queue.deliver(jobs);
        }
    }
}

/// Performs a batch with blocking calls: data runs first, then the other
/// operations, then one flush for all the FLUSH requests of the batch.
pub(crate) fn execute(planner: &mut Planner, reqs: &mut [&mut Request]) {
    let runs = planner.plan(reqs.iter_mut().map(|r| &mut **r).enumerate());
    for run in &runs {
        // SAFETY: the runs point into `reqs`, which this function borrows mutably
        // throughout: alive, and touched by nothing else until it returns.
        if unsafe { planner.perform(run) }.is_err() {
            let fail = |job: usize, e| {
                reqs[job].error.get_or_insert(e);
            };
            // SAFETY: as above.
            unsafe { planner.finish_run(run, None, fail) };
        }
    }
    let durable: Vec<bool> = reqs.iter_mut().map(|r| planner.write_done(r)).collect();
    if durable.contains(&true) {
        planner.settle_metadata(reqs.iter_mut().zip(&durable).filter(|(_, &d)| d).map(|(r, _)| &mut **r));
    }
    let mut flush = false;
    for req in reqs.iter_mut() {
        if !planner.perform_other(req) && req.op() == Op::Flush {
            flush = true;
        }
    }
    if flush {
        let r = planner.flush();
        for req in reqs.iter_mut().filter(|r| r.op() == Op::Flush) {
            if let Err(e) = &r {
                req.error = Some(e.clone());
            }
        }
    }
}
