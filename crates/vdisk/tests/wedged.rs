//! Changes that meet hung storage (issues 22 and 27): an image that is a file
//! on a FUSE file system whose server is stopped (SIGSTOP: a hung NFS mount
//! looks the same) must never wedge the daemon. A SIGHUP reload that opens
//! such an image runs off the signal thread under `--control-timeout`, so a
//! SIGTERM meanwhile still stops the server within `--stop-timeout`, and the
//! reload is reported failed at its deadline while the server serves on;
//! a removal whose flush hangs holds no lock that other changes need. Every
//! wait is bounded: a hang fails the test instead of hanging CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use common::logged::{exiting, signal, state, LoggedServer};
use common::{image, qemu_io, refused, rpc, s, Server, TempDir};
use serde_json::json;

/// `vdisk serve ARGS` with its log in DIR/server.log.
fn serve(dir: &TempDir, args: &[&str]) -> LoggedServer {
    LoggedServer::start(dir, "server", args)
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

fn names(control: &Path) -> Vec<String> {
    let list = rpc(control, "export_list", json!({}));
    list["result"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap().to_owned()).collect()
}

/// The set-up every test shares: the FUSE lock, DIR (named after `tag`), the
/// storage file DIR/slow and an 8M image DIR/good.img (the image's path).
fn rig(tag: &str) -> (MutexGuard<'static, ()>, TempDir, Storage, String) {
    let fuse = common::fuse::serial();
    let dir = TempDir::new(tag);
    let storage = Storage::start(&dir, "slow");
    let good = image(&dir, "good.img", "8M");
    (fuse, dir, storage, good)
}

/// `slow` (the storage file) and `good` on the threads engine, with the NBD
/// and control sockets in DIR, then `extra`.
fn serve_both(dir: &TempDir, storage: &Storage, good: &str, extra: &[&str]) -> LoggedServer {
    let (sock, control) = (dir.path("nbd.sock"), dir.path("ctl.sock"));
    let mut args = vec![s(&storage.file), good, "--engine", "threads", "--socket", s(&sock), "--control", s(&control)];
    args.extend_from_slice(extra);
    serve(dir, &args)
}

/// SIGTERM; the server must exit with status 0 within 30 s.
fn stop_cleanly(server: &mut LoggedServer) {
    signal(server.pid(), libc::SIGTERM);
    let status = server.wait(Duration::from_secs(30));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", server.log());
}

/// A fresh server of IMAGE alone (export NAME) on DIR/SOCK: qemu-io runs `cmd` on it.
fn read_back(dir: &TempDir, image: &str, name: &str, sock: &str, cmd: &str) {
    let sock = dir.path(sock);
    let server = serve(dir, &[image, "--socket", s(&sock)]);
    qemu_io(&format!("nbd+unix:///{name}?socket={}", sock.display()), &[cmd]);
    drop(server);
}

/// A reload stuck opening an image on hung storage: SIGTERM is still handled
/// and the stop ends within `--stop-timeout`, cleanly (status 0: every export
/// was flushed; the stuck open holds nothing of theirs).
#[test]
fn sigterm_during_a_reload_stuck_on_hung_storage_stops_within_the_limit() {
    let (_fuse, dir, storage, good) = rig("wedged-reload-stop");
    let config = write_config(&dir, &export(&good, "good"));
    let mut server = serve(&dir, &["--config", s(&config), "--stop-timeout", "5s"]);
    qemu_io(&uri(&dir, "good"), &["write -P 9 0 1M"]);
    storage.hang();
    write_config(&dir, &(export(&good, "good") + &export(s(&storage.file), "slow")));
    signal(server.pid(), libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    signal(server.pid(), libc::SIGTERM);
    let pid = server.pid();
    loop {
        if matches!(state(pid), Some('Z') | None) || exiting(pid) {
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
    read_back(&dir, &good, "good", "check.sock", "read -P 9 0 1M");
}

/// The same stuck reload without a SIGTERM: reported failed at its deadline
/// (`--control-timeout 3`) while the exports serve on; a SIGHUP meanwhile is
/// queued behind it, and runs (adding the export) once the storage answers.
#[test]
fn a_reload_stuck_on_hung_storage_fails_at_its_deadline_and_the_server_serves_on() {
    let (_fuse, dir, storage, good) = rig("wedged-reload");
    let config = write_config(&dir, &export(&good, "good"));
    let mut server = serve(&dir, &["--config", s(&config), "--control-timeout", "3"]);
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
    stop_cleanly(&mut server);
    drop(storage);
}

/// `remove --hard` of an export on hung storage: it fails at its deadline,
/// saying the export is out of service but still flushing; other exports are
/// added and removed meanwhile; its name is refused ("being removed") until
/// the flush ends, then free again.
#[test]
fn a_removal_whose_flush_hangs_blocks_no_other_change() {
    let (_fuse, dir, storage, good) = rig("wedged-remove");
    let other = image(&dir, "other.img", "8M");
    let control = dir.path("ctl.sock");
    let mut server = serve_both(&dir, &storage, &good, &["--control-timeout", "3"]);
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
    stop_cleanly(&mut server);
    // What the removal flushed reached the storage.
    drop(storage);
    read_back(&dir, s(&dir.path("slow-src.img")), "slow-src", "back.sock", "read -P 7 0 4M");
}

/// SIGTERM while a removal's flush hangs: the stop waits for it as for any
/// export, within `--stop-timeout 3s`, then gives up with status 3 and a log
/// line naming the export that was being removed.
#[test]
fn sigterm_during_a_hung_removal_names_it_and_ends_within_the_limit() {
    let (_fuse, dir, storage, good) = rig("wedged-remove-stop");
    let control = dir.path("ctl.sock");
    let mut server = serve_both(&dir, &storage, &good, &["--control-timeout", "2", "--stop-timeout", "3s"]);
    qemu_io(&uri(&dir, "slow"), &["write -P 7 0 4M"]);
    storage.hang();
    let v = rpc(&control, "export_remove", json!({"name": "slow", "hard": true}));
    assert!(refused(&v).contains("no longer served"), "{v}");
    let t = Instant::now();
    signal(server.pid(), libc::SIGTERM);
    let pid = server.pid();
    loop {
        if server.log().contains("giving up the stop") && (matches!(state(pid), Some('Z') | None) || exiting(pid)) {
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
