//! The classic transport's requests with the engine, by FUSE `unique`, so the
//! session's in-flight count is right on every path: each request is counted
//! in once when a batch is handed over ([`Owed::begin`]) and counted out once,
//! by whichever ends it first — its completion ([`Owed::settle`]) or the
//! guard of a submit that panicked ([`Begun`]), which answers what no
//! completion will. A completion that comes after the guard ended its request
//! is neither counted nor answered again. Without this a panic in the middle
//! of a submit left the count raised, and a stop waited out its 10 s limit.

use std::collections::HashSet;
use std::sync::Mutex;

use vdisk_engine::inflight::InFlight;

/// The uniques of requests handed to the engine and not yet ended.
#[derive(Default)]
pub struct Owed(Mutex<HashSet<u64>>);

impl Owed {
    /// `uniques` go to the engine: counted in now, and ended by the returned
    /// guard if it is dropped (a panic) or [`Begun::abandon`]ed before
    /// [`Begun::handed_over`].
    pub fn begin<'a>(&'a self, inflight: &'a InFlight, uniques: Vec<u64>) -> Begun<'a> {
        self.0.lock().unwrap().extend(uniques.iter().copied());
        inflight.begin(uniques.len(), 0);
        Begun { owed: self, inflight, uniques, armed: true }
    }

    /// The engine answered these: for each, whether it was still owed (then
    /// the caller answers it, and it is counted out when the returned
    /// [`Settled`] is dropped; else it was ended already).
    pub fn settle<'a>(&self, inflight: &'a InFlight, uniques: impl Iterator<Item = u64>) -> Settled<'a> {
        let mut owed = self.0.lock().unwrap();
        let settled: Vec<bool> = uniques.map(|u| owed.remove(&u)).collect();
        Settled { inflight, owed: settled }
    }

    fn end(&self, inflight: &InFlight, uniques: &[u64]) -> Vec<u64> {
        let mut owed = self.0.lock().unwrap();
        let ended: Vec<u64> = uniques.iter().copied().filter(|u| owed.remove(u)).collect();
        drop(owed);
        inflight.end(ended.len(), 0);
        ended
    }
}

/// Completions being answered: counted out once dropped (after the answers went).
pub struct Settled<'a> {
    inflight: &'a InFlight,
    /// Per request, whether to answer it.
    pub owed: Vec<bool>,
}

impl Drop for Settled<'_> {
    fn drop(&mut self) {
        self.inflight.end(self.owed.iter().filter(|o| **o).count(), 0);
    }
}

/// One batch being handed over: ends what it began unless the handover finished.
pub struct Begun<'a> {
    owed: &'a Owed,
    inflight: &'a InFlight,
    uniques: Vec<u64>,
    armed: bool,
}

impl Begun<'_> {
    /// The engine took the batch (or answered it inline): completions end it.
    pub fn handed_over(mut self) {
        self.armed = false;
    }

    /// The submit failed part-way: ends the requests no completion ended yet
    /// and returns their uniques, for the caller to answer (EIO).
    pub fn abandon(mut self) -> Vec<u64> {
        self.armed = false;
        self.owed.end(self.inflight, &self.uniques)
    }
}

impl Drop for Begun<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.owed.end(self.inflight, &self.uniques);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_is_counted_out_once_whoever_ends_it() {
        let (owed, inflight) = (Owed::default(), InFlight::new());
        // Handed over in full: completions end it.
        owed.begin(&inflight, vec![1, 2]).handed_over();
        assert_eq!(inflight.counts().requests, 2);
        let settled = owed.settle(&inflight, [2, 1].into_iter());
        assert_eq!(settled.owed, [true, true]);
        assert_eq!(inflight.counts().requests, 2, "counted out once answered");
        drop(settled);
        assert!(inflight.counts().is_idle());

        // A submit that panics part-way: 3 was answered by an engine thread
        // already, 4 and 5 are not (one dropped, one still in the engine).
        let begun = owed.begin(&inflight, vec![3, 4, 5]);
        assert_eq!(owed.settle(&inflight, [3].into_iter()).owed, [true]);
        assert_eq!(begun.abandon(), [4, 5], "what is left to answer EIO");
        assert!(inflight.counts().is_idle(), "a stop does not wait for what the panic ended");
        // The engine finishes 5 later: not counted again, not answered again.
        assert_eq!(owed.settle(&inflight, [5].into_iter()).owed, [false]);
        assert!(inflight.counts().is_idle());
    }

    #[test]
    fn a_panic_that_unwinds_past_the_guard_ends_what_it_began() {
        let (owed, inflight) = (Owed::default(), InFlight::new());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _begun = owed.begin(&inflight, vec![7, 8, 9]);
            owed.settle(&inflight, [8].into_iter());
            panic!("a submit panicked");
        }));
        assert!(r.is_err());
        assert!(inflight.counts().is_idle(), "left raised: {:?}", inflight.counts());
        assert_eq!(owed.settle(&inflight, [7, 9].into_iter()).owed, [false, false]);
        assert!(inflight.wait_idle_timeout(std::time::Duration::from_millis(10)));
    }
}
