//! Holding completed writes back: what synchronous (write-blocking)
//! mirroring needs of the engine (docs/block-jobs.md).
//!
//! A device may have one [`WriteGate`]. Every completed request of the device
//! passes it on its way to the export's [`Sink`] ([`Queue::deliver`], the one
//! place queued requests complete, and the inline path): the gate takes the
//! ones it wants to hold back (a mirror's gate: the writes that succeeded) and
//! answers them itself later, through [`answer`], once their range is on the
//! mirror's target too. The engine is done with a held request: it no longer
//! counts as in flight, so a quiesce does not wait for it. Its statistics
//! count it complete only when it is answered, so the time it was held is in
//! the device's latency (and in flight meanwhile), as its client sees it.
//! The device opens its gate when it stops, so nothing held outlives it.
//!
//! [`Queue::deliver`]: crate::queue::Queue::deliver

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use crate::stats::Stats;
use crate::{Request, Sink};

/// A completed request and where its answer goes.
pub struct Held {
    pub request: Request,
    pub sink: Arc<dyn Sink>,
    /// When it entered the engine, and the statistics that count it complete
    /// once it is answered.
    started: Instant,
    stats: Arc<Stats>,
}

impl Held {
    pub(crate) fn new(request: Request, sink: Arc<dyn Sink>, started: Instant, stats: Arc<Stats>) -> Held {
        Held { request, sink, started, stats }
    }
}

/// Counts `held` complete in their device's statistics: one call per run
/// that entered the engine together.
fn count(held: &[Held]) {
    let mut at = 0;
    while at < held.len() {
        let (stats, started) = (&held[at].stats, held[at].started);
        let same = |h: &&Held| h.started == started && Arc::ptr_eq(&h.stats, stats);
        let end = at + held[at..].iter().take_while(same).count();
        stats.completed(held[at..end].iter().map(|h| &h.request), started);
        at = end;
    }
}

/// Holds back completed requests of a device until its owner answers them.
pub trait WriteGate: Send + Sync {
    /// Takes from `done` (completed requests of the device) those it holds
    /// back; the rest are answered when this returns. Must not block.
    fn hold(&self, done: &mut Vec<Held>);
    /// Answers everything held and holds nothing from now on (the device
    /// stops, or the gate is taken off it).
    fn open(&self);
}

/// Answers `held`: each sink gets its own requests in one call. A sink that
/// panics is logged and the others still get theirs; returns the panics'
/// messages (the queue fails its device over one).
pub fn answer(held: Vec<Held>) -> Vec<String> {
    count(&held);
    let mut groups: Vec<(Arc<dyn Sink>, Vec<Request>)> = Vec::new();
    for Held { request, sink, .. } in held {
        match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
            Some((_, reqs)) => reqs.push(request),
            None => groups.push((sink, vec![request])),
        }
    }
    let mut panics = Vec::new();
    for (sink, reqs) in groups {
        // AssertUnwindSafe: a sink is Sync and takes concurrent calls anyway.
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| sink.complete(reqs))) {
            panics.push(crate::health::panic_message(&*p));
        }
    }
    panics
}

/// A device's gate, if it has one.
#[derive(Default)]
pub(crate) struct GateSlot(RwLock<Option<Arc<dyn WriteGate>>>);

impl GateSlot {
    pub fn get(&self) -> Option<Arc<dyn WriteGate>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Puts `gate` on (or none); the one it replaces is opened.
    pub fn set(&self, gate: Option<Arc<dyn WriteGate>>) {
        let old = std::mem::replace(&mut *self.0.write().unwrap_or_else(|e| e.into_inner()), gate);
        if let Some(old) = old {
            old.open();
        }
    }

    /// Passes `done` through the gate, if there is one: what it holds is taken out.
    pub fn filter(&self, done: &mut Vec<Held>) {
        if let Some(gate) = self.get() {
            gate.hold(done);
        }
    }
}
