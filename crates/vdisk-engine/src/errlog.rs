//! Failed requests in the log, without flooding it. Every export reports the
//! requests the engine failed through its device's [`ErrorLog`]: the first
//! failure is logged as it is; after it, at most one line per interval (10 s)
//! says how many more failed and which was the latest. A failed device (see
//! [`crate::Device::failure`]) fails every request of a busy export, which
//! would otherwise be a warning per request.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use vdisk_image::ErrorKind;

use crate::Request;

/// How often, at most, a device logs a line about failed requests (after the first).
pub const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A device's log of failed requests (see the module's comment).
pub struct ErrorLog {
    device: String,
    interval: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// When the last line was written; None before the first failure.
    last_line: Option<Instant>,
    /// Failures since that line that no line has told of.
    untold: u64,
}

/// What to do about one failure.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Log it; `untold` more failed since the last line and are counted in it.
    Line { untold: u64 },
    /// Count it; a later line tells.
    Count,
}

impl ErrorLog {
    pub fn new(device: &str) -> ErrorLog {
        Self::with_interval(device, ERROR_LOG_INTERVAL)
    }

    pub fn with_interval(device: &str, interval: Duration) -> ErrorLog {
        ErrorLog { device: device.to_owned(), interval, state: Mutex::new(State::default()) }
    }

    /// Reports a request the engine failed, as seen by `export` (such as
    /// "nbd" or "vhost-user-blk"); a request without an error is ignored, and
    /// so is an operation the image does not support (the client asked for a
    /// fast zero it cannot have: an answer, not a fault). Returns true when
    /// this wrote a line.
    pub fn failed(&self, export: &str, req: &Request) -> bool {
        let Some(e) = &req.error else { return false };
        if e.kind() == ErrorKind::Unsupported {
            return false;
        }
        let what = format!("{} of {} bytes at {} failed: {}", req.op().name(), req.len, req.offset, e.report());
        match self.decide(Instant::now()) {
            Verdict::Count => false,
            Verdict::Line { untold: 0 } => {
                log::warn!("{} ({export}): {what}", self.device);
                true
            }
            Verdict::Line { untold } => {
                let s = if untold == 1 { "" } else { "s" };
                log::warn!(
                    "{} ({export}): {untold} more request{s} failed since the last such line (at most one every {} s); \
                     the latest: {what}",
                    self.device,
                    self.interval.as_secs()
                );
                true
            }
        }
    }

    fn decide(&self, now: Instant) -> Verdict {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match st.last_line {
            Some(at) if now.saturating_duration_since(at) < self.interval => {
                st.untold += 1;
                Verdict::Count
            }
            _ => {
                st.last_line = Some(now);
                Verdict::Line { untold: std::mem::take(&mut st.untold) }
            }
        }
    }
}

impl Drop for ErrorLog {
    /// What no line told of yet is told when the device goes.
    fn drop(&mut self) {
        let untold = self.state.get_mut().map(|s| s.untold).unwrap_or(0);
        if untold > 0 {
            log::warn!("{}: {untold} more request(s) failed after the last line about failures", self.device);
        }
    }
}

#[cfg(test)]
mod tests {
    use vdisk_image::Error;

    use super::*;
    use crate::Op;

    #[test]
    fn the_first_failure_is_logged_then_one_line_per_interval_with_the_count() {
        let log = ErrorLog::with_interval("d", Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.decide(t0), Verdict::Line { untold: 0 });
        for i in 1..1000 {
            assert_eq!(log.decide(t0 + Duration::from_millis(i)), Verdict::Count);
        }
        assert_eq!(log.decide(t0 + Duration::from_secs(10)), Verdict::Line { untold: 999 });
        assert_eq!(log.decide(t0 + Duration::from_secs(11)), Verdict::Count);
        assert_eq!(log.decide(t0 + Duration::from_secs(25)), Verdict::Line { untold: 1 });
        // Quiet for a while: the next failure is logged at once, with nothing untold.
        assert_eq!(log.decide(t0 + Duration::from_secs(100)), Verdict::Line { untold: 0 });
    }

    #[test]
    fn only_real_failures_count() {
        let log = ErrorLog::with_interval("d", Duration::from_secs(3600));
        let mut req = Request::new(Op::Read, 0, 512, 1);
        assert!(!log.failed("test", &req), "no error, no line");
        req.error = Some(Error::new(ErrorKind::Unsupported, "no fast zero"));
        assert!(!log.failed("test", &req), "an unsupported operation is an answer");
        req.error = Some(Error::new(ErrorKind::Io, "the device failed"));
        assert!(log.failed("test", &req), "the first failure");
        assert!((0..100).all(|_| !log.failed("test", &req)), "then none within the interval");
        assert_eq!(log.state.lock().unwrap().untold, 100);
    }
}
