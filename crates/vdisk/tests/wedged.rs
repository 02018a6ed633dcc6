//! Changes that meet hung storage (issues 22 and 27): an image that is a file
//! on a FUSE file system whose server is stopped (SIGSTOP: a hung NFS mount
//! looks the same) must never wedge the daemon. A SIGHUP reload that opens
//! such an image runs off the signal thread under `--control-timeout`, so a
//! SIGTERM meanwhile still stops the server within `--stop-timeout`, and the
//! reload is reported failed at its deadline while the server serves on;
//! a removal whose flush hangs holds no lock that other changes need. Every
//! wait is bounded: a hang fails the test instead of hanging CI.

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{image, json, qemu_io, s, Server, TempDir};
use serde_json::{json, Value};

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill only reads its integer arguments.
    unsafe { libc::kill(pid, sig) };
}

/// A `vdisk serve ARGS` whose log goes to DIR/server.log; killed when dropped.
struct Logged {
    child: Child,
    log: PathBuf,
}

impl Logged {
    fn start(dir: &TempDir, args: &[&str]) -> Logged {
        let log = dir.path("server.log");
        let mut child = Command::new(common::vdisk_bin())
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
                    panic!("vdisk {args:?} did not become ready: {}", std::fs::read_to_string(&log).unwrap());
                }
            }
        }
        Logged { child, log }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log has `what`, at most `bound`; the time it took.
    fn wait_log(&self, what: &str, bound: Duration) -> Duration {
        let t = Instant::now();
        while !self.log().contains(what) {
            assert!(t.elapsed() < bound, "no {what:?} in the log within {bound:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        t.elapsed()
    }

    /// The exit status within `bound`, or None (then it is killed).
    fn wait(&mut self, bound: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.wait(Duration::from_secs(10));
        }
    }
}

/// A FUSE file DIR/NAME served by its own vdisk (the "storage"), stopped
/// with [`Storage::hang`]; continued when dropped whatever happens, and its
/// file unmounted lazily should the test fail.
struct Storage {
    server: Option<Server>,
    file: PathBuf,
}

impl Storage {
    fn start(dir: &TempDir, name: &str) -> Storage {
        let src = image(dir, &format!("{name}-src.img"), "8M");
        let file = dir.path(name);
        let sock = dir.path(&format!("{name}-storage.sock"));
        let server = Server::spawn(&["serve", &src, "--fuse", s(&file), "--socket", s(&sock)], sock.clone());
        Storage { server: Some(server), file }
    }

    fn pid(&self) -> i32 {
        self.server.as_ref().unwrap().child.id() as i32
    }

    fn hang(&self) {
        signal(self.pid(), libc::SIGSTOP);
    }

    fn resume(&self) {
        signal(self.pid(), libc::SIGCONT);
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.resume();
        if std::thread::panicking() {
            let _ = Command::new("umount").args(["-l", s(&self.file)]).output();
        }
        if let Some(server) = self.server.take() {
            if !std::thread::panicking() {
                server.stop();
            }
        }
    }
}

/// The state letter of /proc/PID/stat ('Z' once the process has exited, even
/// while the kernel still holds a thread of it waiting for the FUSE server).
fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// `[server]` with the NBD and control sockets in `dir`, then `exports` (TOML text).
fn write_config(dir: &TempDir, exports: &str) -> PathBuf {
    let path = dir.path("vdisk.toml");
    let text = format!("[server]\nsocket = \"nbd.sock\"\ncontrol = \"ctl.sock\"\n\n{exports}");
    std::fs::write(dir.path("vdisk.toml.new"), text).unwrap();
    std::fs::rename(dir.path("vdisk.toml.new"), &path).unwrap();
    path
}

fn export(image: &str, name: &str) -> String {
    format!("[[export]]\nimage = \"{image}\"\nname = \"{name}\"\n\n")
}

fn uri(dir: &TempDir, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", dir.path("nbd.sock").display())
}

/// One JSON-RPC request on a new connection; the response.
fn rpc(control: &Path, method: &str, params: Value) -> Value {
    let mut c = UnixStream::connect(control).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    writeln!(c, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line).unwrap();
    json(&line)
}

fn names(control: &Path) -> Vec<String> {
    let list = rpc(control, "export_list", json!({}));
    list["result"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap().to_owned()).collect()
}

fn refused(v: &Value) -> String {
    v["error"]["message"].as_str().unwrap_or_else(|| panic!("not an error: {v}")).to_owned()
}

/// A reload stuck opening an image on hung storage: SIGTERM is still handled
/// and the stop ends within `--stop-timeout`, cleanly (status 0: every export
/// was flushed; the stuck open holds nothing of theirs).
#[test]
fn sigterm_during_a_reload_stuck_on_hung_storage_stops_within_the_limit() {
    let _fuse = common::fuse::serial();
    let dir = TempDir::new("wedged-reload-stop");
    let storage = Storage::start(&dir, "slow");
    let good = image(&dir, "good.img", "8M");
    let config = write_config(&dir, &export(&good, "good"));
    let mut server = Logged::start(&dir, &["--config", s(&config), "--stop-timeout", "5s"]);
    qemu_io(&uri(&dir, "good"), &["write -P 9 0 1M"]);
    storage.hang();
    write_config(&dir, &(export(&good, "good") + &export(s(&storage.file), "slow")));
    signal(server.pid(), libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    signal(server.pid(), libc::SIGTERM);
    let pid = server.pid();
    loop {
        if matches!(state(pid), Some('Z') | None) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "vdisk still running {:?} after SIGTERM with --stop-timeout 5s and a reload stuck on hung storage:\n{}",
            t.elapsed(),
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = t.elapsed();
    storage.resume();
    let status = server.wait(Duration::from_secs(30));
    let log = server.log();
    assert!(took < Duration::from_secs(8), "the stop took {took:?} with a 5 s limit:\n{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "every export was flushed: a clean stop:\n{log}");
    assert!(!log.contains("giving up the stop") && !log.contains("error"), "{log}");
    // What the stopped server acknowledged is there.
    let check = Logged::start(&dir, &[&good, "--socket", s(&dir.path("check.sock"))]);
    qemu_io(&format!("nbd+unix:///good?socket={}", dir.path("check.sock").display()), &["read -P 9 0 1M"]);
    drop(check);
}

/// The same stuck reload without a SIGTERM: reported failed at its deadline
/// (`--control-timeout 3`) while the exports serve on; a SIGHUP meanwhile is
/// queued behind it, and runs (adding the export) once the storage answers.
#[test]
fn a_reload_stuck_on_hung_storage_fails_at_its_deadline_and_the_server_serves_on() {
    let _fuse = common::fuse::serial();
    let dir = TempDir::new("wedged-reload");
    let storage = Storage::start(&dir, "slow");
    let good = image(&dir, "good.img", "8M");
    let config = write_config(&dir, &export(&good, "good"));
    let mut server = Logged::start(&dir, &["--config", s(&config), "--control-timeout", "3"]);
    let control = dir.path("ctl.sock");
    storage.hang();
    write_config(&dir, &(export(&good, "good") + &export(s(&storage.file), "slow")));
    signal(server.pid(), libc::SIGHUP);
    let t = Instant::now();
    // Serving and answering meanwhile.
    qemu_io(&uri(&dir, "good"), &["write -P 5 0 1M", "read -P 5 0 1M"]);
    assert_eq!(names(&control), ["good"]);
    let took = server.wait_log("reload failed: it did not finish within 3 s", Duration::from_secs(12));
    assert!(t.elapsed() >= Duration::from_millis(2500), "reported failed after {took:?}, before its deadline");
    qemu_io(&uri(&dir, "good"), &["read -P 5 0 1M"]);
    signal(server.pid(), libc::SIGHUP);
    server.wait_log("a reload is still running", Duration::from_secs(5));
    // The storage answers again: the given-up open is dropped, the queued reload adds the export.
    storage.resume();
    let deadline = Instant::now() + Duration::from_secs(30);
    while names(&control) != ["good", "slow"] {
        assert!(Instant::now() < deadline, "the queued reload never added slow:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu_io(&uri(&dir, "slow"), &["write -P 6 0 64k", "read -P 6 0 64k"]);
    signal(server.pid(), libc::SIGTERM);
    let status = server.wait(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", server.log());
    drop(storage);
}

/// `remove --hard` of an export on hung storage: it fails at its deadline,
/// saying the export is out of service but still flushing; other exports are
/// added and removed meanwhile; its name is refused ("being removed") until
/// the flush ends, then free again.
#[test]
fn a_removal_whose_flush_hangs_blocks_no_other_change() {
    let _fuse = common::fuse::serial();
    let dir = TempDir::new("wedged-remove");
    let storage = Storage::start(&dir, "slow");
    let (good, other) = (image(&dir, "good.img", "8M"), image(&dir, "other.img", "8M"));
    let control = dir.path("ctl.sock");
    let sock = dir.path("nbd.sock");
    let args = [
        s(&storage.file),
        &good,
        "--engine",
        "threads",
        "--socket",
        s(&sock),
        "--control",
        s(&control),
        "--control-timeout",
        "3",
    ];
    let mut server = Logged::start(&dir, &args);
    // Written into the FUSE file: the removal's flush must reach the stopped server.
    qemu_io(&uri(&dir, "slow"), &["write -P 7 0 4M"]);
    storage.hang();
    let hung = {
        let control = control.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            (rpc(&control, "export_remove", json!({"name": "slow", "hard": true})), t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let v = rpc(&control, "export_add", json!({"image": other}));
    assert_eq!(v["result"]["name"], "other", "{v}");
    let v = rpc(&control, "export_remove", json!({"name": "other", "hard": true}));
    assert_eq!(v["result"]["removed"], true, "{v}");
    assert!(t.elapsed() < Duration::from_secs(2), "changes beside the hung removal took {:?}", t.elapsed());
    let v = rpc(&control, "export_add", json!({"image": other, "name": "slow"}));
    assert!(refused(&v).contains("being removed"), "{v}");
    assert_eq!(names(&control), ["good"], "the removed export is out of the table at once");
    let (v, took) = hung.join().unwrap();
    let m = refused(&v);
    assert!(m.contains("did not finish within 3 s") && m.contains("no longer served"), "{m}");
    assert!(took < Duration::from_secs(10), "the removal answered after {took:?}");
    qemu_io(&uri(&dir, "good"), &["write -P 8 0 1M", "read -P 8 0 1M"]);

    // The storage answers: the flush ends, the name is free again.
    storage.resume();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = rpc(&control, "export_add", json!({"image": other, "name": "slow"}));
        if v.get("result").is_some() {
            break;
        }
        assert!(refused(&v).contains("being removed"), "{v}");
        assert!(Instant::now() < deadline, "the removal never let go of its name:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    signal(server.pid(), libc::SIGTERM);
    let status = server.wait(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", server.log());
    // What the removal flushed reached the storage.
    drop(storage);
    let back = Logged::start(&dir, &[s(&dir.path("slow-src.img")), "--socket", s(&dir.path("back.sock"))]);
    qemu_io(&format!("nbd+unix:///slow-src?socket={}", dir.path("back.sock").display()), &["read -P 7 0 4M"]);
    drop(back);
}

/// SIGTERM while a removal's flush hangs: the stop waits for it as for any
/// export, within `--stop-timeout 3s`, then gives up with status 3 and a log
/// line naming the export that was being removed.
#[test]
fn sigterm_during_a_hung_removal_names_it_and_ends_within_the_limit() {
    let _fuse = common::fuse::serial();
    let dir = TempDir::new("wedged-remove-stop");
    let storage = Storage::start(&dir, "slow");
    let good = image(&dir, "good.img", "8M");
    let control = dir.path("ctl.sock");
    let sock = dir.path("nbd.sock");
    let args = [
        s(&storage.file),
        &good,
        "--engine",
        "threads",
        "--socket",
        s(&sock),
        "--control",
        s(&control),
        "--control-timeout",
        "2",
        "--stop-timeout",
        "3s",
    ];
    let mut server = Logged::start(&dir, &args);
    qemu_io(&uri(&dir, "slow"), &["write -P 7 0 4M"]);
    storage.hang();
    let v = rpc(&control, "export_remove", json!({"name": "slow", "hard": true}));
    assert!(refused(&v).contains("no longer served"), "{v}");
    let t = Instant::now();
    signal(server.pid(), libc::SIGTERM);
    let pid = server.pid();
    loop {
        if server.log().contains("giving up the stop") && matches!(state(pid), Some('Z') | None) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "still stopping after {:?}:\n{}", t.elapsed(), server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = t.elapsed();
    storage.resume();
    let status = server.wait(Duration::from_secs(30));
    let log = server.log();
    assert!(took < Duration::from_secs(8), "the stop took {took:?} with a 3 s limit:\n{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(3), "a stop that timed out:\n{log}");
    assert!(
        log.lines().any(|l| l.contains("export \"slow\": not stopped") && l.contains("not flushed")),
        "no log line names the export being removed:\n{log}"
    );
    drop(storage);
}
