//! The server under test: this very binary run as `vdisk serve`, started,
//! killed with SIGKILL or stopped with SIGTERM by the soak. Its stderr goes
//! to a log file beside the images, quoted when something goes wrong.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Served {
    child: Child,
    pub socket: PathBuf,
    log: PathBuf,
}

impl Served {
    /// Starts `vdisk serve IMAGES --socket DIR/soak.sock EXTRA` and waits for "vdisk: ready".
    pub fn start(dir: &Path, images: &[PathBuf], extra: &[&str]) -> Result<Served, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
        let socket = dir.join("soak.sock");
        let log = dir.join("server.log");
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
        let mut child = Command::new(exe)
            .arg("serve")
            .args(images)
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start vdisk serve: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads stdout to its end, so the server never blocks on it.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.trim() == "vdisk: ready" {
                    let _ = tx.send(());
                }
            }
        });
        let mut served = Served { child, socket, log };
        if rx.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = served.child.kill();
            let _ = served.child.wait();
            return Err(format!("vdisk serve did not become ready in 30 s{}", served.log_tail()));
        }
        Ok(served)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then waits for it to be gone.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; the server must exit 0 within 30 s.
    pub fn stop(mut self) -> Result<(), String> {
        // SAFETY: kill(2) only reads its two integer arguments.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("vdisk serve exited with {st} after SIGTERM{}", self.log_tail())),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                _ => {
                    let _ = self.child.kill();
                    return Err(format!("vdisk serve did not stop within 30 s of SIGTERM{}", self.log_tail()));
                }
            }
        }
    }

    /// The last lines of the server's stderr, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(10)..].join("\n  ");
        if tail.is_empty() {
            String::new()
        } else {
            format!("; its log ({}) ends:\n  {tail}", self.log.display())
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
