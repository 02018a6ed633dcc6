//! Per-device statistics, counted once per request in the engine's completion
//! path, whatever export brought the request: operations, bytes, errors, what
//! is in flight, and latency (submission to completion) for reads, writes and
//! flushes.
//!
//! Counters are relaxed atomics; latencies go to one HDR histogram per class,
//! each locked once per completed batch, never per request, and made only
//! when its class first completes (an idle device holds none). This module reads
//! requests but never changes one.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use hdrhistogram::Histogram;

use crate::{Op, Request};

/// What a request counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
    /// Cache and block status: counted, never timed.
    Other,
}

fn class(req: &Request) -> (Class, u64) {
    match req.op() {
        Op::Read => (Class::Read, req.len),
        Op::Write { .. } => (Class::Write, req.len),
        Op::Flush => (Class::Flush, 0),
        Op::Trim { .. } => (Class::Trim, 0),
        Op::WriteZeroes { .. } => (Class::Zero, 0),
        Op::Cache | Op::BlockStatus { .. } => (Class::Other, 0),
    }
}

/// Upper bounds (seconds) of the latency buckets [`Latency::buckets`] reports.
pub const LATENCY_BOUNDS: [f64; 18] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,
    2.5, 10.0,
];

/// The counters of one device.
pub struct Stats {
    ops: [AtomicU64; 6],
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicI64,
    /// Read, write, flush latencies in microseconds; each made on its first
    /// sample (a histogram is ~140 KiB written at birth: an idle device of a
    /// thousand must not pay three).
    latency: [Mutex<Option<Histogram<u64>>>; 3],
}

impl Default for Stats {
    fn default() -> Self {
        let hist = || Mutex::new(None);
        Stats {
            ops: Default::default(),
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            latency: [hist(), hist(), hist()],
        }
    }
}

/// Latency of one class of request, in microseconds.
#[derive(Debug, Clone, Default)]
pub struct Latency {
    pub count: u64,
    pub sum_us: f64,
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    /// Requests at or under each of [`LATENCY_BOUNDS`] (cumulative).
    pub buckets: Vec<u64>,
}

/// The counters of one device at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub flush_ops: u64,
    pub trim_ops: u64,
    pub zero_ops: u64,
    pub other_ops: u64,
    pub errors: u64,
    pub in_flight: u64,
    pub read_latency: Latency,
    pub write_latency: Latency,
    pub flush_latency: Latency,
}

impl Stats {
    /// `n` requests entered the engine.
    pub(crate) fn submitted(&self, n: usize) {
        self.in_flight.fetch_add(n as i64, Ordering::Relaxed);
    }

    /// Requests submitted at `started` are complete.
    pub(crate) fn completed<'a>(&self, reqs: impl Iterator<Item = &'a Request>, started: Instant) {
        let us = started.elapsed().as_micros().clamp(1, 60_000_000) as u64;
        // Counted here first, then one atomic add per counter for the whole batch.
        let (mut n, mut ops, mut errors) = (0i64, [0u64; 6], 0u64);
        let (mut bytes, mut timed) = ([0u64; 2], [0u64; 3]);
        for req in reqs {
            n += 1;
            let (c, len) = class(req);
            ops[c as usize] += 1;
            if req.error.is_some() {
                errors += 1;
                continue;
            }
            if let Some(b) = bytes.get_mut(c as usize) {
                *b += len;
            }
            if let Some(t) = timed.get_mut(c as usize) {
                *t += 1;
            }
        }
        let add = |counter: &AtomicU64, v: u64| {
            if v > 0 {
                counter.fetch_add(v, Ordering::Relaxed);
            }
        };
        for (counter, &v) in self.ops.iter().zip(&ops) {
            add(counter, v);
        }
        add(&self.errors, errors);
        add(&self.read_bytes, bytes[Class::Read as usize]);
        add(&self.write_bytes, bytes[Class::Write as usize]);
        self.in_flight.fetch_sub(n, Ordering::Relaxed);
        for (h, count) in self.latency.iter().zip(timed) {
            if count > 0 {
                let mut h = h.lock().unwrap();
                let h = h.get_or_insert_with(|| {
                    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
                });
                let _ = h.record_n(us, count);
            }
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        let op = |c: Class| self.ops[c as usize].load(Ordering::Relaxed);
        let lat = |i: usize| match &*self.latency[i].lock().unwrap() {
            Some(h) => latency(h),
            None => Latency { buckets: vec![0; LATENCY_BOUNDS.len()], ..Default::default() },
        };
        Snapshot {
            read_ops: op(Class::Read),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_ops: op(Class::Write),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            flush_ops: op(Class::Flush),
            trim_ops: op(Class::Trim),
            zero_ops: op(Class::Zero),
            other_ops: op(Class::Other),
            errors: self.errors.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed).max(0) as u64,
            read_latency: lat(0),
            write_latency: lat(1),
            flush_latency: lat(2),
        }
    }
}

fn latency(h: &Histogram<u64>) -> Latency {
    let buckets = LATENCY_BOUNDS.iter().map(|&s| h.count_between(0, (s * 1e6) as u64)).collect();
    Latency {
        count: h.len(),
        sum_us: h.mean() * h.len() as f64,
        p50: h.value_at_quantile(0.5),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        buckets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_request_once_by_class() {
        let s = Stats::default();
        let mut reqs = vec![Request::new(Op::Read, 0, 4096, 1), Request::new(Op::WRITE, 0, 512, 2)];
        reqs.push(Request::new(Op::Flush, 0, 0, 3));
        let mut failed = Request::new(Op::WRITE, 0, 100, 4);
        failed.error = Some(vdisk_image::Error::new(vdisk_image::ErrorKind::Io, "x"));
        reqs.push(failed);
        s.submitted(reqs.len());
        s.completed(reqs.iter(), Instant::now());
        let snap = s.snapshot();
        assert_eq!((snap.read_ops, snap.read_bytes, snap.write_ops, snap.write_bytes), (1, 4096, 2, 512));
        assert_eq!((snap.flush_ops, snap.errors, snap.in_flight), (1, 1, 0));
        assert_eq!((snap.read_latency.count, snap.write_latency.count, snap.flush_latency.count), (1, 1, 1));
        assert_eq!(*snap.read_latency.buckets.last().unwrap(), 1);
    }
}
