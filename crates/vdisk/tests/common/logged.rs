//! A `vdisk serve` whose log (its stderr) goes to a file: started and waited
//! for until it prints "vdisk: ready", its log read back, its exit waited for
//! within a bound, killed when dropped. Also the signal and process-state
//! helpers the tests that stop, continue and terminate such servers share.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{vdisk_bin, TempDir};

/// Sends `sig` to `pid`.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill only reads its integer arguments.
    unsafe { libc::kill(pid, sig) };
}

/// The state letter of /proc/PID/stat ('Z' once the process has exited, even
/// while the kernel still holds one of its threads, e.g. one waiting for a
/// stopped FUSE server).
pub fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// True once process `pid` has begun to exit (PF_EXITING in the flags of
/// /proc/PID/stat) or is gone. A process that called `_exit` while one of its
/// files is on a FUSE server that does not answer can stay in the kernel's exit
/// path (closing that file) until the server answers: it is ending, whatever
/// state letter it shows meanwhile.
pub fn exiting(pid: i32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    let Some((_, rest)) = stat.rsplit_once(')') else { return true };
    // After the name: state, ppid, pgrp, session, tty_nr, tpgid, flags.
    rest.split_whitespace().nth(6).and_then(|f| f.parse::<u64>().ok()).is_some_and(|f| f & PF_EXITING != 0)
}

/// Waits for `child` at most `bound`; None (and the child killed) if it is still running.
pub fn wait_bounded(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.try_wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `vdisk serve ARGS` with its log in DIR/NAME.log; killed when dropped.
pub struct LoggedServer {
    pub name: String,
    pub child: Child,
    log: PathBuf,
}

impl LoggedServer {
    /// Starts it and waits (at most 30 s) for its "vdisk: ready" line.
    pub fn start(dir: &TempDir, name: &str, args: &[&str]) -> LoggedServer {
        let log = dir.path(&format!("{name}.log"));
        let mut child = Command::new(vdisk_bin())
            .arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .expect("spawn vdisk");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(l) if l.trim() == "vdisk: ready" => break,
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    panic!("vdisk serve {args:?} did not become ready: {}", std::fs::read_to_string(&log).unwrap());
                }
            }
        }
        LoggedServer { name: name.to_owned(), child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log has `what`, at most `bound`; the time it took.
    pub fn wait_log(&self, what: &str, bound: Duration) -> Duration {
        let t = Instant::now();
        while !self.log().contains(what) {
            assert!(t.elapsed() < bound, "no {what:?} in the log within {bound:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        t.elapsed()
    }

    /// The exit status within `bound`, or None (then it is killed).
    pub fn wait(&mut self, bound: Duration) -> Option<ExitStatus> {
        wait_bounded(&mut self.child, bound)
    }

    /// SIGCONT and SIGTERM; the exit status, or None if it did not exit within `bound`.
    pub fn stop(&mut self, bound: Duration) -> Option<ExitStatus> {
        signal(self.pid(), libc::SIGCONT);
        signal(self.pid(), libc::SIGTERM);
        self.wait(bound)
    }
}

impl Drop for LoggedServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.wait(Duration::from_secs(10));
        }
    }
}
