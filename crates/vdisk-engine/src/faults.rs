//! Fault injection, for reliability tests only, compiled in only with the
//! cargo feature `faults` (which the tests turn on): a device started while the
//! environment variable `VDISK_FAULTS` is set fails the reads, writes and
//! flushes its rules name, with the error a failing disk would give, before
//! any I/O is done for them. Unset (always, outside tests), a device holds `None` and a
//! request costs one branch. This module never touches a file.
//!
//! Rules, comma-separated:
//! - `read@OFFSET+LEN`, `write@OFFSET+LEN`: every read (write) touching the
//!   byte range fails, like a bad stretch of disk;
//! - `read#N`, `write#N`: the Nth read (write) of the device fails, once;
//! - `flush#N`: the Nth flush the engine performs (an `fdatasync` of the
//!   image and its metadata round, for one or more FLUSH requests) fails,
//!   once, before it syncs anything; `flush`: every flush fails. The final
//!   flush of a device being shut down is never failed;
//! - `panic#N`: the Nth delivery of completions by a worker of the device
//!   panics, as a panicking `Sink` would, but before the requests reach the
//!   sink (so they must still be answered, with EIO, by the failure path);
//! - `enter#N`: the Nth `io_uring_enter` of the device's rings (counted
//!   together) fails with the rule's error instead of entering the kernel:
//!   an unrecoverable ring error, which fails the device;
//! - `eintr#N`: the Nth `io_uring_enter` returns EINTR instead of entering the
//!   kernel, as when the process is stopped and continued: it must be retried
//!   with no visible effect (`enter` and `eintr` share one count);
//! - `delay=MS`: every read and write of the device stays with the backend
//!   at least MS milliseconds (io_uring: a timeout linked ahead of it; the
//!   thread engine: a sleep before the call), so that tests can stop a device
//!   or the core with requests in flight;
//! - any rule may end in `=eio` (the default) or `=enospc`;
//! - any rule may start with `EXPORT:` to apply only to the device of that
//!   name (`a:panic#3,b:enter#20`); a rule without it applies to every device.
//!   A `#N` rule naming a device fires once per process: a device started
//!   again under that name (the export removed and added back) is spared it.
//!
//! Example: `VDISK_FAULTS=read@1048576+4096,write#5=enospc,flush#2,disk2:enter#40`.
//!
//! Besides the rules, this build watches the in-flight table (`flight`):
//! every iovec range handed to a backend is registered ([`Faults::lend`])
//! until its completion is reaped ([`Faults::returned`]); a buffer freed, or
//! a request handed back to its sink, while a backend holds part of its
//! memory is logged and aborts the process ([`check_not_lent`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use vdisk_image::Error;

pub const ENV: &str = "VDISK_FAULTS";

/// The `EXPORT:` rules with `#N` that have fired in this process.
static FIRED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Read,
    Write,
    Flush,
    Panic,
    /// `enter#N` and `eintr#N`: one count of `io_uring_enter` calls.
    Enter,
}

/// What an `io_uring_enter` must do instead of entering the kernel, if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnterFault {
    /// Fail with this errno (unrecoverable).
    Fail(i32),
    /// Return EINTR (to be retried).
    Interrupt,
}

enum Target {
    Range { start: u64, end: u64 },
    Nth(u64),
    Every,
}

struct Rule {
    kind: Kind,
    target: Target,
    errno: i32,
    /// `eintr#N`: the enter is interrupted rather than failed.
    interrupt: bool,
    /// The rule as written, for an `EXPORT:` rule with `#N`: it fires once per process.
    once: Option<String>,
}

pub struct Faults {
    rules: Vec<Rule>,
    /// How many reads, writes, flushes, deliveries and enters were checked, by [`Kind`].
    counts: [AtomicU64; 5],
    /// `delay=MS`: how long each read and write stays with the backend.
    delay: Option<u64>,
    /// Operations of this device whose memory a backend holds now ([`Faults::lend`]).
    lent: AtomicUsize,
}

/// Every iovec range a backend holds now, by start address (end, how many
/// operations hold it), over every device with faults.
static LENT: Mutex<BTreeMap<usize, (usize, usize)>> = Mutex::new(BTreeMap::new());
/// Buffers freed, or requests answered, while a backend still held part of their data (must stay 0).
static VIOLATIONS: AtomicUsize = AtomicUsize::new(0);

/// How many buffers were freed while a backend still held them (a bug: must stay 0).
#[cfg(test)]
pub fn violations() -> usize {
    VIOLATIONS.load(Ordering::SeqCst)
}

/// A buffer of `len` bytes at `ptr` is being freed (or given back to the
/// pool): if a backend still holds any of it, that is logged and the process
/// aborts (see [`check_not_lent`]).
pub fn freeing(ptr: *const u8, len: usize) {
    check_not_lent(ptr, len, "freed");
}

/// Memory of `len` bytes at `ptr` is about to be `what` ("freed", "answered":
/// handed back to a sink, which may free or reuse it): if a backend still
/// holds any of it, that is counted, logged, and the process aborts (a test
/// build only: this module is compiled in only with the `faults` feature).
pub fn check_not_lent(ptr: *const u8, len: usize, what: &str) {
    let (start, end) = (ptr as usize, ptr as usize + len);
    let lent = LENT.lock().unwrap();
    // Ranges are disjoint or equal (no two operations share memory), so the
    // one starting last before `end` is the only candidate.
    if let Some((&s, &(e, _))) = lent.range(..end).next_back() {
        if s < end && start < e {
            VIOLATIONS.fetch_add(1, Ordering::SeqCst);
            let msg = format!("a buffer at {ptr:?} ({len} bytes) was {what} while a backend still held {s:#x}..{e:#x}");
            log::error!("{msg}");
            // Memory the kernel or librbd may still write: a test build stops here, loudly,
            // so every test (the binary's too) fails on it, not on what it corrupts later.
            eprintln!("vdisk: fatal (faults build): {msg}");
            std::process::abort();
        }
    }
}

impl Faults {
    /// The rules in `VDISK_FAULTS`, if set. A rule that cannot be parsed is
    /// a test's mistake: it panics with the rule, rather than run without it.
    pub fn from_env(device: &str) -> Option<Arc<Faults>> {
        let spec = std::env::var(ENV).ok()?;
        let faults = Faults::parse_for(&spec, device).unwrap_or_else(|e| panic!("{ENV}={spec:?}: {e}"));
        if faults.rules.is_empty() && faults.delay.is_none() {
            return None;
        }
        log::warn!("{device}: fault injection on ({ENV}={spec}): requests will fail on purpose");
        Some(Arc::new(faults))
    }

    /// Every rule of `spec`, whatever device it names.
    #[cfg(test)]
    pub fn parse(spec: &str) -> Result<Faults, String> {
        Self::parse_for(spec, "")
    }

    /// The rules of `spec` for the device `device`: those without an
    /// `EXPORT:` prefix and those naming it (all of them when `device` is empty).
    pub fn parse_for(spec: &str, device: &str) -> Result<Faults, String> {
        let mut rules = Vec::new();
        let mut delay = None;
        for written in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let item = match written.rsplit_once(':') {
                Some((name, rule)) if name == device || device.is_empty() => rule,
                Some(_) => continue,
                None => written,
            };
            let once = (item != written && item.contains('#')).then(|| written.to_owned());
            if once.as_ref().is_some_and(|w| FIRED.lock().unwrap().contains(w)) {
                continue;
            }
            if let Some(ms) = item.strip_prefix("delay=") {
                delay = Some(ms.parse::<u64>().map_err(|_| format!("{item:?}: want delay=MILLISECONDS"))?);
                continue;
            }
            let (rule, errno) = match item.split_once('=') {
                Some((r, "eio")) => (r, libc::EIO),
                Some((r, "enospc")) => (r, libc::ENOSPC),
                Some((_, e)) => return Err(format!("unknown error {e:?} (eio or enospc)")),
                None => (item, libc::EIO),
            };
            let num = |s: &str| s.parse::<u64>().map_err(|_| format!("{s:?} in {item:?} is not a number"));
            let (op, target) = if let Some((op, range)) = rule.split_once('@') {
                let (start, len) = range.split_once('+').ok_or(format!("{item:?}: want OP@OFFSET+LEN"))?;
                let start = num(start)?;
                (op, Target::Range { start, end: start + num(len)? })
            } else if let Some((op, n)) = rule.split_once('#') {
                (op, Target::Nth(num(n)?))
            } else if rule == "flush" {
                (rule, Target::Every)
            } else {
                return Err(format!("{item:?}: want OP@OFFSET+LEN, OP#N or flush"));
            };
            let kind = match (op, &target) {
                ("read", _) => Kind::Read,
                ("write", _) => Kind::Write,
                ("flush", Target::Range { .. }) => return Err(format!("{item:?}: a flush has no range")),
                ("flush", _) => Kind::Flush,
                ("panic", Target::Nth(_)) => Kind::Panic,
                ("enter" | "eintr", Target::Nth(_)) => Kind::Enter,
                ("panic" | "enter" | "eintr", _) => return Err(format!("{item:?}: want {op}#N")),
                _ => return Err(format!("{item:?}: the operation is read, write, flush, panic, enter or eintr")),
            };
            rules.push(Rule { kind, target, errno, interrupt: op == "eintr", once });
        }
        Ok(Faults { rules, counts: Default::default(), delay, lent: AtomicUsize::new(0) })
    }

    /// The rule, if any, that fails this request of `kind` (counting it).
    fn matching(&self, kind: Kind, offset: u64, len: u64) -> Option<&Rule> {
        let n = self.counts[kind as usize].fetch_add(1, Ordering::Relaxed) + 1;
        let rule = self.rules.iter().find(|r| {
            r.kind == kind
                && match r.target {
                    Target::Range { start, end } => offset < end && start < offset + len,
                    Target::Nth(k) => k == n,
                    Target::Every => true,
                }
        })?;
        if let Some(w) = &rule.once {
            FIRED.lock().unwrap().push(w.clone());
        }
        Some(rule)
    }

    /// The error a read or write of `[offset, offset + len)` must fail with, if any.
    pub fn check(&self, write: bool, offset: u64, len: u64) -> Option<Error> {
        let rule = self.matching(if write { Kind::Write } else { Kind::Read }, offset, len)?;
        let what = if write { "write" } else { "read" };
        Some(Error::io(
            std::io::Error::from_raw_os_error(rule.errno),
            format!("{what} of {len} bytes at offset {offset} (injected by {ENV})"),
        ))
    }

    /// The error the flush about to be performed (of `what`) must fail with, if any.
    pub fn check_flush(&self, what: &str) -> Option<Error> {
        let rule = self.matching(Kind::Flush, 0, 0)?;
        Some(Error::io(std::io::Error::from_raw_os_error(rule.errno), format!("flush of {what} (injected by {ENV})")))
    }

    /// Panics when this delivery of completions is the one a `panic#N` rule names.
    pub fn check_delivery(&self) {
        if self.matching(Kind::Panic, 0, 0).is_some() {
            panic!("a delivery of completions panicked (injected by {ENV})");
        }
    }

    /// How long each read and write must stay with the backend, in milliseconds.
    pub fn delay(&self) -> Option<u64> {
        self.delay
    }

    /// A backend is about to hold the memory of `iov` (until [`Faults::returned`]).
    pub fn lend(&self, iov: &[libc::iovec]) {
        self.lent.fetch_add(1, Ordering::SeqCst);
        let mut lent = LENT.lock().unwrap();
        for v in iov.iter().filter(|v| v.iov_len > 0) {
            let e = lent.entry(v.iov_base as usize).or_insert((v.iov_base as usize + v.iov_len, 0));
            e.1 += 1;
        }
    }

    /// The backend gave back the memory of `iov` (its completion was reaped).
    pub fn returned(&self, iov: &[libc::iovec]) {
        self.lent.fetch_sub(1, Ordering::SeqCst);
        let mut lent = LENT.lock().unwrap();
        for v in iov.iter().filter(|v| v.iov_len > 0) {
            let start = v.iov_base as usize;
            if let Some(e) = lent.get_mut(&start) {
                e.1 -= 1;
                if e.1 == 0 {
                    lent.remove(&start);
                }
            }
        }
    }

    /// Operations of this device whose memory a backend holds now.
    #[cfg(test)]
    pub fn lent(&self) -> usize {
        self.lent.load(Ordering::SeqCst)
    }

    /// What this `io_uring_enter` must do instead of entering the kernel, if anything.
    pub fn check_enter(&self) -> Option<EnterFault> {
        let rule = self.matching(Kind::Enter, 0, 0)?;
        Some(if rule.interrupt { EnterFault::Interrupt } else { EnterFault::Fail(rule.errno) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_ranges_and_counts() {
        let f = Faults::parse("read@4096+512, write#2=enospc").unwrap();
        assert!(f.check(false, 0, 4096).is_none());
        assert_eq!(f.check(false, 4000, 100).unwrap().errno(), libc::EIO);
        assert!(f.check(false, 4608, 10).is_none());
        assert!(f.check(true, 4096, 512).is_none());
        assert_eq!(f.check(true, 0, 1).unwrap().errno(), libc::ENOSPC);
        assert!(f.check(true, 0, 1).is_none());
        assert!(f.check_flush("x").is_none(), "no flush rule");

        let f = Faults::parse("flush#2=enospc,flush#3").unwrap();
        let errs: Vec<_> = (0..4).map(|_| f.check_flush("x").map(|e| e.errno())).collect();
        assert_eq!(errs, [None, Some(libc::ENOSPC), Some(libc::EIO), None]);
        assert!(f.check(true, 0, 1).is_none() && f.check(false, 0, 1).is_none(), "flushes only");
        let f = Faults::parse("flush").unwrap();
        assert!((0..3).all(|_| f.check_flush("x").is_some()));
        for bad in ["read", "write", "flush@0+1", "fsync#1", "read@1", "read#x", "write#1=ebusy", "panic", "enter@0+1"]
        {
            assert!(Faults::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ring_rules_count_enters_and_deliveries_per_device() {
        let f = Faults::parse_for("a:enter#3,eintr#1,b:panic#1,eintr#2", "a").unwrap();
        let got: Vec<_> = (0..4).map(|_| f.check_enter()).collect();
        assert_eq!(
            got,
            [Some(EnterFault::Interrupt), Some(EnterFault::Interrupt), Some(EnterFault::Fail(libc::EIO)), None]
        );
        f.check_delivery();
        let b = Faults::parse_for("a:enter#3,b:panic#2", "b").unwrap();
        assert!(b.check_enter().is_none());
        b.check_delivery();
        let hit = std::panic::catch_unwind(|| b.check_delivery());
        assert!(hit.is_err(), "the second delivery of b panics");
        b.check_delivery();
        assert!(Faults::parse_for("a:panic#1", "c").unwrap().rules.is_empty(), "rules for another device");
        // Fired, b's rule is spared a new device b; a's is not (it never fired).
        assert!(Faults::parse_for("a:enter#9,b:panic#2", "b").unwrap().rules.is_empty());
        assert_eq!(Faults::parse_for("a:enter#9,b:panic#2", "a").unwrap().rules.len(), 1);
    }
}
