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
//! - any rule may end in `=eio` (the default) or `=enospc`.
//!
//! Example: `VDISK_FAULTS=read@1048576+4096,write#5=enospc,flush#2`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vdisk_image::Error;

pub const ENV: &str = "VDISK_FAULTS";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Read,
    Write,
    Flush,
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
}

pub struct Faults {
    rules: Vec<Rule>,
    /// How many reads, writes and flushes were checked, by [`Kind`].
    counts: [AtomicU64; 3],
}

impl Faults {
    /// The rules in `VDISK_FAULTS`, if set. A rule that cannot be parsed is
    /// a test's mistake: it panics with the rule, rather than run without it.
    pub fn from_env(device: &str) -> Option<Arc<Faults>> {
        let spec = std::env::var(ENV).ok()?;
        let faults = Faults::parse(&spec).unwrap_or_else(|e| panic!("{ENV}={spec:?}: {e}"));
        log::warn!("{device}: fault injection on ({ENV}={spec}): requests will fail on purpose");
        Some(Arc::new(faults))
    }

    pub fn parse(spec: &str) -> Result<Faults, String> {
        let mut rules = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
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
                _ => return Err(format!("{item:?}: the operation is read, write or flush")),
            };
            rules.push(Rule { kind, target, errno });
        }
        Ok(Faults { rules, counts: Default::default() })
    }

    /// The rule, if any, that fails this request of `kind` (counting it).
    fn matching(&self, kind: Kind, offset: u64, len: u64) -> Option<&Rule> {
        let n = self.counts[kind as usize].fetch_add(1, Ordering::Relaxed) + 1;
        self.rules.iter().find(|r| {
            r.kind == kind
                && match r.target {
                    Target::Range { start, end } => offset < end && start < offset + len,
                    Target::Nth(k) => k == n,
                    Target::Every => true,
                }
        })
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
        for bad in ["read", "write", "flush@0+1", "fsync#1", "read@1", "read#x", "write#1=ebusy"] {
            assert!(Faults::parse(bad).is_err(), "{bad}");
        }
    }
}
