//! The thread engine's work: [`execute`] performs a batch with blocking
//! `preadv`/`pwritev2` calls. The shared pool (`pool`) runs it for every
//! thread-engine device; a connection runs it inline in its own thread.
//!
//! Every call it blocks in retries EINTR (`sys`). A panic is caught by the
//! caller (the pool's thread, at its edge): the blocking calls of the batch
//! have returned by then, so its requests' data is the caller's again.

use crate::plan::Planner;
use crate::{Op, Request};

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
    planner.release_reads();
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
