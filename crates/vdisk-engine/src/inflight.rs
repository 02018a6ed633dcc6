//! What an export has in flight: requests and bytes handed to the engine and
//! not yet answered. One implementation for every export: the counting (and
//! the memory budget a connection may hold) is [`Counts`], plain data to keep
//! under a lock the caller already holds; [`InFlight`] wraps it with its own
//! lock and a condition variable, so a stop can wait until nothing is in
//! flight without polling.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Requests and bytes in flight.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub requests: usize,
    pub bytes: usize,
}

impl Counts {
    /// True when `bytes` more fit within `max_bytes` (always, with nothing in flight:
    /// one request larger than the budget must still be able to run).
    pub fn admits(&self, bytes: usize, max_bytes: usize) -> bool {
        self.requests == 0 || self.bytes + bytes <= max_bytes
    }

    pub fn add(&mut self, requests: usize, bytes: usize) {
        self.requests += requests;
        self.bytes += bytes;
    }

    pub fn remove(&mut self, requests: usize, bytes: usize) {
        self.requests -= requests;
        self.bytes -= bytes;
    }

    pub fn is_idle(&self) -> bool {
        self.requests == 0
    }
}

/// [`Counts`] behind a lock, with waiting for idle.
#[derive(Debug, Default)]
pub struct InFlight {
    counts: Mutex<Counts>,
    changed: Condvar,
}

impl InFlight {
    pub fn new() -> Self {
        Self::default()
    }

    /// `requests` (holding `bytes`) went to the engine.
    pub fn begin(&self, requests: usize, bytes: usize) {
        if requests > 0 {
            self.counts.lock().unwrap().add(requests, bytes);
        }
    }

    /// `requests` (holding `bytes`) were answered; wakes waiters once idle.
    pub fn end(&self, requests: usize, bytes: usize) {
        if requests == 0 {
            return;
        }
        let mut c = self.counts.lock().unwrap();
        c.remove(requests, bytes);
        if c.is_idle() {
            self.changed.notify_all();
        }
    }

    /// What is in flight now.
    pub fn counts(&self) -> Counts {
        *self.counts.lock().unwrap()
    }

    /// Blocks until nothing is in flight.
    pub fn wait_idle(&self) {
        let c = self.counts.lock().unwrap();
        drop(self.changed.wait_while(c, |c| !c.is_idle()).unwrap());
    }

    /// Like [`InFlight::wait_idle`], giving up after `timeout`; true when idle.
    pub fn wait_idle_timeout(&self, timeout: Duration) -> bool {
        let c = self.counts.lock().unwrap();
        let (c, _) = self.changed.wait_timeout_while(c, timeout, |c| !c.is_idle()).unwrap();
        c.is_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn counts_admit_within_budget_and_waiters_wake_when_idle() {
        let mut c = Counts::default();
        assert!(c.admits(100, 10), "nothing in flight: anything runs");
        c.add(1, 8);
        assert!(!c.admits(3, 10) && c.admits(2, 10));
        let f = Arc::new(InFlight::new());
        f.begin(2, 10);
        assert!(!f.wait_idle_timeout(Duration::from_millis(10)));
        let g = f.clone();
        let t = std::thread::spawn(move || g.wait_idle());
        f.end(1, 5);
        f.end(1, 5);
        t.join().unwrap();
        assert_eq!(f.counts(), Counts::default());
    }
}
