//! The thread engine: a pool of workers per device, each taking a fair share
//! of the queue, performing its runs with blocking `preadv`/`pwritev2`, then
//! handing completions back grouped by sink.

use crate::plan::Planner;
use crate::queue::{deliver, Job, Queue};
use crate::Op;
use std::sync::Arc;

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
        let mut jobs = Vec::with_capacity(self.batch);
        while self.queue.take(self.batch, &mut jobs) {
            self.execute(&mut jobs);
            deliver(&mut jobs);
        }
    }

    fn execute(&mut self, jobs: &mut [Job]) {
        let runs = self.planner.plan(jobs.iter_mut().map(|(r, _)| r).enumerate());
        for run in &runs {
            if self.planner.perform(run).is_err() {
                // Retry piece by piece so only the requests that really failed see the error.
                let mut at = run.offset;
                for (seg, &job) in run.segs.iter().zip(&run.jobs) {
                    if let Err(e) = self.planner.perform_segs(run, std::slice::from_ref(seg), at) {
                        jobs[job].0.error.get_or_insert(e);
                    }
                    at += seg.len as u64;
                }
            }
        }
        let mut flush = false;
        for (req, _) in jobs.iter_mut() {
            if !self.planner.perform_other(req) && req.op == Op::Flush {
                flush = true;
            }
        }
        if flush {
            let r = self.planner.flush();
            for (req, _) in jobs.iter_mut().filter(|(r, _)| r.op == Op::Flush) {
                if let Err(e) = &r {
                    req.error = Some(vdisk_image::Error::new(e.kind(), e.to_string()));
                }
            }
        }
    }
}
