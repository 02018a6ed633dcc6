//! The thread engine's backend: blocking `preadv`/`pwritev2` calls, behind
//! the same in-flight table and completion path as the ring (`flight`).
//! [`execute`] runs a batch through a table of its own over [`Blocking`]:
//! each operation is performed when the table starts it, and its result is
//! handed back at the next reap, so a short or failed transfer, a FLUSH's
//! metadata round and a write's bookkeeping are the ring's code, not a copy.
//! The shared pool (`pool`) runs it for every thread-engine device; a
//! connection runs it inline in its own thread.
//!
//! Every call it blocks in retries EINTR (`sys`). A panic is caught by the
//! caller (the pool's thread, at its edge): the blocking calls of the batch
//! have returned by then, so its requests' data is the caller's again, and
//! nothing is in flight: the table (which only borrowed the requests) goes
//! with the unwinding.

use std::cell::RefCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::Arc;

use vdisk_image::Image;

use crate::flight::{Backend, Flight, Held, Lane};
use crate::plan::{Planner, Run};
use crate::Request;

/// Blocking calls as a backend: done when started, handed back at the next reap.
#[derive(Default)]
pub(crate) struct Blocking {
    done: Vec<(u64, i64)>,
    /// FLUSHes of this batch: one data sync of `image` for them all, at the reap.
    syncs: Vec<u64>,
    image: Option<Arc<dyn Image>>,
}

fn errno(e: &vdisk_image::Error) -> i64 {
    -i64::from(match e.errno() {
        0 => libc::EIO,
        n => n,
    })
}

impl Backend for Blocking {
    unsafe fn rw(
        &mut self,
        planner: &Planner,
        run: &Run,
        _iov: &[libc::iovec],
        key: u64,
        sync: Option<u64>,
    ) -> std::io::Result<()> {
        if let Some(ms) = planner.faults.as_ref().and_then(|f| f.delay()) {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        // SAFETY: the run points into requests the table holds, alive and untouched
        // by anyone else until this blocking call returns (the caller's contract).
        let r = unsafe { planner.perform(run) };
        let res = match &r {
            Ok(()) => run.len() as i64,
            Err(e) => errno(e),
        };
        self.done.push((key, res));
        if let Some(s) = sync {
            // `perform` syncs a durable write itself where RWF_DSYNC may be dropped;
            // after a failure the blocking retry of `finish_run` does.
            self.done.push((s, if r.is_ok() { 0 } else { -i64::from(libc::ECANCELED) }));
        }
        Ok(())
    }

    fn sync(&mut self, planner: &Planner, key: u64) -> std::io::Result<bool> {
        if crate::plan::skips_data_sync() || planner.image.target(0).is_none() {
            return Ok(false);
        }
        self.syncs.push(key);
        self.image.get_or_insert_with(|| planner.image.clone());
        Ok(true)
    }

    /// It performs the run's segments (`Planner::perform`).
    fn takes_iovecs(&self) -> bool {
        false
    }

    /// Nothing to ask back: every call has returned.
    fn cancel(&mut self, _key: u64) {}

    fn reap(&mut self, out: &mut Vec<(u64, i64)>) {
        out.append(&mut self.done);
        if self.syncs.is_empty() {
            return;
        }
        // After every data call of the batch: one fdatasync of file 0 (the only
        // one writes reach), or a sync of a target that is not a file, for all its FLUSHes.
        let image = self.image.take().expect("set with the first sync");
        let synced = match image.target(0) {
            Some(vdisk_image::Storage::File(f)) => crate::sys::fdatasync(f),
            Some(other) => other.sync(),
            None => Ok(()),
        };
        let res = match synced {
            Ok(()) => 0,
            Err(e) => -i64::from(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        out.extend(self.syncs.drain(..).map(|k| (k, res)));
    }
}

/// A request the table borrows for one [`execute`] call: a pointer, so that
/// the table (with its capacity) can be kept per thread between calls.
pub(crate) struct Borrowed(NonNull<Request>);

impl Held for Borrowed {
    fn req(&mut self) -> &mut Request {
        // SAFETY: made in `execute` from a `&mut Request` that stays mutably borrowed,
        // and touched by nothing else, until it returns; every `Borrowed` is gone by then.
        unsafe { self.0.as_mut() }
    }
}

/// What [`execute`] keeps per thread between calls, so a batch allocates nothing
/// for its bookkeeping once the thread has served one as large.
#[derive(Default)]
struct Scratch {
    flight: Option<Flight<Borrowed, Blocking>>,
    new: Vec<Borrowed>,
    done: Vec<Borrowed>,
    owed: Vec<usize>,
    reaped: Vec<(u64, i64)>,
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Performs a batch with blocking calls, through the in-flight table: data
/// runs, then the other operations, then one data sync for all the FLUSH
/// requests of the batch and their metadata round. Returns the planner.
pub(crate) fn execute(planner: Planner, reqs: &mut [&mut Request]) -> Planner {
    // Taken out while in use: a nested call (a sink that submits inline) gets a fresh one.
    let mut sc = SCRATCH.with(|s| s.borrow_mut().take()).unwrap_or_default();
    let mut flight = sc.flight.take().unwrap_or_else(|| Flight::new(Blocking::default()));
    let mut lane = Lane::new(planner, None);
    lane.done = std::mem::take(&mut sc.done);
    lane.owed = std::mem::take(&mut sc.owed);
    sc.new.extend(reqs.iter_mut().map(|r| Borrowed(NonNull::from(&mut **r))));
    let run = catch_unwind(AssertUnwindSafe(|| {
        flight.start(&mut lane, 0, &mut sc.new).expect("blocking calls never fail to start");
        flight.backend.reap(&mut sc.reaped);
        for (key, res) in sc.reaped.drain(..) {
            flight.completed(&mut lane, key, res);
        }
    }));
    // Every read of the batch is performed (or failed): an image that pins
    // reads until then lets the writes waiting on them go, on every way out.
    lane.planner.release_reads();
    if let Err(p) = run {
        // Every blocking call has returned: nothing of the batch is with a backend.
        // The table and its pointers are dropped here, not kept for the next batch.
        flight.forget_ops(&lane);
        resume_unwind(p);
    }
    debug_assert!(flight.jobs.is_empty() && flight.ops.is_empty(), "every operation was handed back");
    lane.settle();
    // No pointer into `reqs` outlives this call.
    lane.done.clear();
    sc.done = std::mem::take(&mut lane.done);
    sc.owed = std::mem::take(&mut lane.owed);
    sc.flight = Some(flight);
    SCRATCH.with(|s| *s.borrow_mut() = Some(sc));
    lane.planner
}
