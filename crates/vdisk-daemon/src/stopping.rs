//! The bound on stopping (`--stop-timeout`, `[server] stop_timeout`).
//!
//! SIGTERM/SIGINT stop the server cleanly: every export's NBD clients finish
//! their requests, its FUSE file and vhost-user socket stop, its device drains
//! and flushes. Exports stop in parallel, so one whose storage does not answer
//! (an RBD cluster with every OSD down, a hung NFS file) never keeps another
//! from being flushed. A [`Watchdog`] thread, armed at the first signal, waits
//! for the whole stop for at most the limit; past it (or at a second signal)
//! it logs, export by export, what could not be flushed or stopped, lazily
//! unmounts the FUSE files of those exports, removes the socket and pid files,
//! and ends the process with [`EXIT_STOP_TIMEOUT`] through `_exit`, without
//! waiting for the wedged threads (nor running destructors that would join
//! them). It never touches an export's data itself.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Exit status when the stop did not finish within the limit (README: Stopping).
pub const EXIT_STOP_TIMEOUT: i32 = 3;

/// The default `--stop-timeout`; contrib/systemd/vdisk.service's TimeoutStopSec is this plus a margin.
pub const DEFAULT_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// Where one export's stop is.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Its NBD clients are finishing the requests they sent.
    Clients,
    /// Its FUSE file / vhost-user socket answer what they took and stop.
    Frontends,
    /// Its device finishes what is queued and flushes.
    Flushing,
    /// Flushed and stopped.
    Done,
    /// Stopped, but something failed (the message says what).
    Failed(String),
}

impl Step {
    fn finished(&self) -> bool {
        matches!(self, Step::Done | Step::Failed(_))
    }

    /// For the log line of an export that did not stop in time.
    fn stuck(&self) -> &'static str {
        match self {
            Step::Clients => "its NBD clients were still waiting for requests to finish (not flushed)",
            Step::Frontends => "its FUSE file or vhost-user socket was still answering requests (not flushed)",
            Step::Flushing => "its device was still finishing requests and flushing (not flushed)",
            Step::Done | Step::Failed(_) => "stopped",
        }
    }
}

struct Export {
    name: String,
    fuse: Option<PathBuf>,
    step: Step,
}

#[derive(Default)]
struct State {
    /// What the stop as a whole is doing.
    phase: &'static str,
    exports: Vec<Export>,
    /// The whole stop returned (the process is about to exit on its own).
    finished: bool,
    /// A second signal: give up now.
    hurry: bool,
}

/// What the stop has done so far, export by export; shared by the stopping
/// threads and the watchdog.
#[derive(Default)]
pub struct StopProgress {
    state: Mutex<State>,
    cond: Condvar,
}

impl StopProgress {
    /// An export whose stop begins (its FUSE file, if any, is unmounted lazily should it not finish).
    pub fn begin(&self, name: &str, fuse: Option<PathBuf>) {
        let mut s = self.state.lock().unwrap();
        s.exports.push(Export { name: name.to_owned(), fuse, step: Step::Clients });
    }

    /// Export `name` went on to `step`.
    pub fn step(&self, name: &str, step: Step) {
        let mut s = self.state.lock().unwrap();
        if let Some(e) = s.exports.iter_mut().find(|e| e.name == name) {
            e.step = step;
        }
        self.cond.notify_all();
    }

    /// What the stop as a whole does now (named in the log if it never ends).
    pub fn phase(&self, phase: &'static str) {
        self.state.lock().unwrap().phase = phase;
    }

    fn finish(&self) {
        self.state.lock().unwrap().finished = true;
        self.cond.notify_all();
    }

    fn hurry(&self) {
        self.state.lock().unwrap().hurry = true;
        self.cond.notify_all();
    }
}

/// Ends the process if the stop takes longer than its limit.
#[derive(Clone)]
pub struct Watchdog {
    progress: Arc<StopProgress>,
}

impl Watchdog {
    /// Starts the watchdog thread: from now, the stop has `limit`. `remove` are
    /// files (the NBD socket, the pid file) to remove should it give up.
    pub fn arm(limit: Duration, remove: Vec<PathBuf>) -> Watchdog {
        let progress = Arc::new(StopProgress::default());
        let p = progress.clone();
        let started = std::thread::Builder::new().name("stop-watchdog".into()).spawn(move || watch(&p, limit, &remove));
        if let Err(e) = started {
            // Without it the stop is unbounded, as it was before the bound existed; say so.
            log::error!("cannot start the stop watchdog ({e}): this stop waits for every export, however long");
        }
        Watchdog { progress }
    }

    pub fn progress(&self) -> &StopProgress {
        &self.progress
    }

    /// A second SIGTERM/SIGINT: give up on what has not stopped, now.
    pub fn hurry(&self) {
        self.progress.hurry();
    }

    /// The stop returned in time.
    pub fn disarm(&self) {
        self.progress.finish();
    }
}

fn watch(p: &StopProgress, limit: Duration, remove: &[PathBuf]) {
    let deadline = Instant::now() + limit;
    let mut s = p.state.lock().unwrap();
    loop {
        if s.finished {
            return;
        }
        let now = Instant::now();
        if s.hurry || now >= deadline {
            break;
        }
        s = p.cond.wait_timeout(s, deadline - now).unwrap().0;
    }
    let why = if s.hurry {
        "second signal".to_owned()
    } else {
        format!("the stop did not finish within {} (--stop-timeout)", show(limit))
    };
    let done = s.exports.iter().filter(|e| e.step == Step::Done).count();
    for e in &s.exports {
        match &e.step {
            Step::Done => log::warn!(export:% = e.name; "export {:?}: flushed and stopped", e.name),
            Step::Failed(m) => log::error!(export:% = e.name; "export {:?}: stopped with errors: {m}", e.name),
            step => log::error!(
                export:% = e.name;
                "export {:?}: not stopped: {}; its storage may not answer. Writes acknowledged since its last flush may not be durable",
                e.name,
                step.stuck()
            ),
        }
    }
    let stuck: Vec<&Export> = s.exports.iter().filter(|e| !e.step.finished()).collect();
    log::error!(
        "giving up the stop ({why}) while {}: {done} of {} export(s) flushed and stopped, {} not; exiting with status {EXIT_STOP_TIMEOUT} without waiting for them",
        if s.phase.is_empty() { "starting it" } else { s.phase },
        s.exports.len(),
        stuck.len()
    );
    for e in &stuck {
        if let Some(path) = &e.fuse {
            detach(path);
        }
    }
    for path in remove {
        let _ = std::fs::remove_file(path);
    }
    crate::systemd::notify(&format!("STATUS=stop timed out: {} export(s) not flushed", stuck.len()));
    log::logger().flush();
    // SAFETY: _exit ends the process at once; nothing after it runs. Skipping
    // destructors and atexit handlers is the point: they would join threads
    // that wait for storage that does not answer. Every log line is written.
    unsafe { libc::_exit(EXIT_STOP_TIMEOUT) };
}

/// Lazily unmounts a FUSE file whose server gives up, so the path is not left
/// a dead mount ("Transport endpoint is not connected") for the next start.
fn detach(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINVAL) {
            return; // Not mounted (any more): its stop got that far.
        }
        log::warn!(
            "cannot detach FUSE file {}: {e} (unmount it with `fusermount3 -uz {}`)",
            path.display(),
            path.display()
        );
    }
}

/// "30s", "1500ms", "2m" or a number of seconds; at least 1 ms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len()));
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration such as 30s, 500ms or 2m"))?;
    let secs = match unit.trim() {
        "" | "s" | "sec" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        u => return Err(format!("{s:?}: unknown unit {u:?}; give a duration such as 30s, 500ms or 2m")),
    };
    let d = Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is not a duration such as 30s"))?;
    if d < Duration::from_millis(1) {
        return Err(format!("{s:?}: the stop timeout must be at least 1ms"));
    }
    Ok(d)
}

/// A duration as the flag takes it.
pub fn show(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("soon").is_err());
        assert_eq!(show(Duration::from_secs(5)), "5s");
        assert_eq!(show(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn steps_say_what_is_stuck() {
        let p = StopProgress::default();
        p.begin("a", None);
        p.begin("b", None);
        p.step("a", Step::Done);
        p.step("b", Step::Flushing);
        let s = p.state.lock().unwrap();
        assert!(s.exports[0].step.finished());
        assert!(s.exports[1].step.stuck().contains("flushing"));
    }
}
