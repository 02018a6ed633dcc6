//! Fault injection, for reliability tests only: a device started while the
//! environment variable `VDISK_FAULTS` is set fails the reads and writes its
//! rules name, with the error a failing disk would give, before any I/O is
//! done for them. Unset (always, outside tests), a device holds `None` and a
//! request costs one branch. This module never touches a file.
//!
//! Rules, comma-separated:
//! - `read@OFFSET+LEN`, `write@OFFSET+LEN`: every read (write) touching the
//!   byte range fails, like a bad stretch of disk;
//! - `read#N`, `write#N`: the Nth read (write) of the device fails, once;
//! - any rule may end in `=eio` (the default) or `=enospc`.
//!
//! Example: `VDISK_FAULTS=read@1048576+4096,write#5=enospc`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vdisk_image::Error;

pub const ENV: &str = "VDISK_FAULTS";

enum Target {
    Range { start: u64, end: u64 },
    Nth(u64),
}

struct Rule {
    write: bool,
    target: Target,
    errno: i32,
}

pub struct Faults {
    rules: Vec<Rule>,
    reads: AtomicU64,
    writes: AtomicU64,
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
            } else {
                return Err(format!("{item:?}: want OP@OFFSET+LEN or OP#N"));
            };
            let write = match op {
                "read" => false,
                "write" => true,
                _ => return Err(format!("{item:?}: the operation is read or write")),
            };
            rules.push(Rule { write, target, errno });
        }
        Ok(Faults { rules, reads: AtomicU64::new(0), writes: AtomicU64::new(0) })
    }

    /// The error a read or write of `[offset, offset + len)` must fail with, if any.
    pub fn check(&self, write: bool, offset: u64, len: u64) -> Option<Error> {
        let n = if write { &self.writes } else { &self.reads }.fetch_add(1, Ordering::Relaxed) + 1;
        let rule = self.rules.iter().find(|r| {
            r.write == write
                && match r.target {
                    Target::Range { start, end } => offset < end && start < offset + len,
                    Target::Nth(k) => k == n,
                }
        })?;
        let what = if write { "write" } else { "read" };
        Some(Error::io(
            std::io::Error::from_raw_os_error(rule.errno),
            format!("{what} of {len} bytes at offset {offset} (injected by {ENV})"),
        ))
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
        for bad in ["read", "flush#1", "read@1", "read#x", "write#1=ebusy"] {
            assert!(Faults::parse(bad).is_err(), "{bad}");
        }
    }
}
