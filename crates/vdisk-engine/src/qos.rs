//! Per-device QoS: token buckets in front of the device queue, one for
//! operations per second and one each for total, read and write bytes per
//! second. Each bucket holds at most one second of its rate (the burst).
//!
//! A batch over the limit waits, in the thread that submits it, until the
//! buckets have paid for it; nothing is ever refused. Each device has its own
//! buckets and only its own submitters wait, so a limited device never slows
//! another. Limits change live: waiters are woken and pay again at the new
//! rates (a lifted limit lets them through at once). Without limits a batch
//! costs one relaxed load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Op, Request};

/// Limits of one device; 0 means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub iops: u64,
    pub bps: u64,
    pub read_bps: u64,
    pub write_bps: u64,
}

impl Limits {
    pub fn is_unlimited(&self) -> bool {
        *self == Limits::default()
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: f64,
    /// May go negative: a reservation made by a waiter that has not yet slept it off.
    tokens: f64,
}

impl Bucket {
    fn new(rate: u64) -> Self {
        Bucket { rate: rate as f64, tokens: rate as f64 }
    }

    fn refill(&mut self, secs: f64) {
        if self.rate > 0.0 {
            self.tokens = (self.tokens + secs * self.rate).min(self.rate);
        }
    }

    /// Takes `cost` tokens; returns how long the taker must wait for them.
    fn take(&mut self, cost: f64) -> f64 {
        if self.rate <= 0.0 || cost <= 0.0 {
            return 0.0;
        }
        self.tokens -= cost;
        if self.tokens >= 0.0 {
            0.0
        } else {
            -self.tokens / self.rate
        }
    }
}

struct State {
    limits: Limits,
    /// iops, bps, read_bps, write_bps.
    buckets: [Bucket; 4],
    last: Instant,
    /// Bumped on every change of limits: a waiter that sees it move pays again.
    generation: u64,
}

/// The limiter of one device.
pub struct Qos {
    active: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
}

impl Default for Qos {
    fn default() -> Self {
        Qos {
            active: AtomicBool::new(false),
            state: Mutex::new(State {
                limits: Limits::default(),
                buckets: [Bucket::new(0); 4],
                last: Instant::now(),
                generation: 0,
            }),
            changed: Condvar::new(),
        }
    }
}

impl Qos {
    pub fn limits(&self) -> Limits {
        self.state.lock().unwrap().limits
    }

    /// Replaces the limits; buckets start full. Waiters pay again at the new rates.
    pub fn set(&self, limits: Limits) {
        let mut st = self.state.lock().unwrap();
        st.limits = limits;
        let Limits { iops, bps, read_bps, write_bps } = limits;
        st.buckets = [Bucket::new(iops), Bucket::new(bps), Bucket::new(read_bps), Bucket::new(write_bps)];
        st.last = Instant::now();
        st.generation += 1;
        self.active.store(!limits.is_unlimited(), Ordering::SeqCst);
        self.changed.notify_all();
    }

    /// Waits until the buckets have paid for `batch`.
    pub(crate) fn admit(&self, batch: &[Request]) {
        if !self.active.load(Ordering::Relaxed) || batch.is_empty() {
            return;
        }
        let (mut reads, mut writes) = (0u64, 0u64);
        for r in batch {
            match r.op() {
                Op::Read => reads += r.len,
                Op::Write { .. } => writes += r.len,
                _ => {}
            }
        }
        let costs = [batch.len() as f64, (reads + writes) as f64, reads as f64, writes as f64];
        let mut st = self.state.lock().unwrap();
        'pay: loop {
            let now = Instant::now();
            let secs = now.duration_since(st.last).as_secs_f64();
            st.last = now;
            let mut wait = 0.0f64;
            for (b, cost) in st.buckets.iter_mut().zip(costs) {
                b.refill(secs);
                wait = wait.max(b.take(cost));
            }
            let deadline = now + Duration::from_secs_f64(wait);
            let generation = st.generation;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return;
                }
                st = self.changed.wait_timeout(st, left).unwrap().0;
                if st.generation != generation {
                    continue 'pay;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_over_the_rate_waits_and_lifting_frees_it() {
        let q = std::sync::Arc::new(Qos::default());
        q.set(Limits { iops: 100, ..Default::default() });
        let batch: Vec<Request> = (0..100).map(|i| Request::new(Op::Read, 0, 512, i)).collect();
        let t = Instant::now();
        q.admit(&batch); // the burst pays for it
        assert!(t.elapsed() < Duration::from_millis(50));
        let t = Instant::now();
        q.admit(&batch[..20]); // 20 ops at 100/s: 200 ms
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(150) && waited < Duration::from_secs(2), "{waited:?}");
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || {
                let batch: Vec<Request> = (0..1000).map(|i| Request::new(Op::Read, 0, 512, i)).collect();
                let t = Instant::now();
                q.admit(&batch); // 10 s at 100/s, unless lifted
                t.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        q.set(Limits::default());
        assert!(waiter.join().unwrap() < Duration::from_secs(2));
    }
}
