//! `vdisk serve` as a service: `--config FILE` with `--check` and live reload
//! (SIGHUP, `vdisk ctl reload`), sd_notify readiness on a test datagram
//! socket, socket activation through `systemd-socket-activate`, the pid file's
//! life cycle, JSON log lines, and the systemd units under `systemd-analyze
//! verify`. Real binary, real clients (nbdinfo, the test NBD client).

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::nbd::{pattern, Client};
use common::*;
use serde_json::Value;

fn image(dir: &TempDir, name: &str) -> String {
    let p = dir.path(name);
    create_image(&p, "8M");
    p.to_str().unwrap().to_owned()
}

/// `[server]` with the NBD and control sockets in `dir`, then `exports` (TOML text).
fn write_config(dir: &TempDir, exports: &str) -> PathBuf {
    let path = dir.path("vdisk.toml");
    let text = format!("[server]\nsocket = \"nbd.sock\"\ncontrol = \"ctl.sock\"\n\n{exports}");
    // Written beside and renamed: a reload never sees half a file.
    std::fs::write(dir.path("vdisk.toml.new"), text).unwrap();
    std::fs::rename(dir.path("vdisk.toml.new"), &path).unwrap();
    path
}

fn ctl(dir: &TempDir, args: &[&str]) -> std::process::Output {
    let control = dir.path("ctl.sock");
    let mut all = vec!["ctl", "--control", control.to_str().unwrap()];
    all.extend_from_slice(args);
    vdisk(&all)
}

fn names(dir: &TempDir) -> Vec<String> {
    let out = ctl(dir, &["list", "--json"]);
    assert!(out.status.success(), "ctl list: {}", text(&out));
    let list = json(&String::from_utf8_lossy(&out.stdout));
    list.as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap().to_owned()).collect()
}

fn wait_for_names(dir: &TempDir, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = names(dir);
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "exports are {got:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill only reads its integer arguments.
    unsafe { libc::kill(child.id() as i32, sig) };
}

/// Writes, reads back and checks 64 KiB blocks of `export` until `stop`; returns the rounds done.
fn busy_client(socket: PathBuf, export: &'static str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let (mut c, _) = Client::open(&socket, export);
        let mut round = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let offset = (round % 64) * 65536;
            let data = pattern(round, 65536);
            c.write(offset, &data, 0);
            assert_same("a block read back during reloads", &c.read(offset, 65536), &data);
            round += 1;
        }
        round
    })
}

#[test]
fn reload_adds_removes_and_changes_qos_while_a_client_works() {
    let dir = TempDir::new("svc-reload");
    let (a, b, c) = (image(&dir, "a.img"), image(&dir, "b.img"), image(&dir, "c.img"));
    let two = format!("[[export]]\nimage = \"{a}\"\n\n[[export]]\nimage = \"{b}\"\n");
    let config = write_config(&dir, &two);
    let server = Server::spawn(&["serve", "--config", config.to_str().unwrap()], dir.path("nbd.sock"));
    assert_eq!(names(&dir), ["a", "b"]);
    let stop = Arc::new(AtomicBool::new(false));
    let client = busy_client(server.socket.clone(), "a", stop.clone());

    // SIGHUP: c comes, b goes.
    write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n\n[[export]]\nimage = \"{c}\"\niops = 1000\n"));
    signal(&server.child, libc::SIGHUP);
    wait_for_names(&dir, &["a", "c"]);
    let list = run("nbdinfo", &["--list", &format!("nbd+unix:///?socket={}", server.socket.display())]);
    assert!(list.contains("export=\"c\"") && !list.contains("export=\"b\""), "{list}");

    // ctl reload: c's QoS changes live.
    write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n\n[[export]]\nimage = \"{c}\"\niops = 2000\n"));
    let out = ctl(&dir, &["reload", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let report = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(report["qos_changed"], serde_json::json!(["c"]), "{report}");
    assert_eq!(report["unchanged"], serde_json::json!(["a"]), "{report}");

    // c has a client: taking it out of the file keeps it, reported; once idle a reload removes it.
    let (holder, _) = Client::open(&server.socket, "c");
    write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n"));
    let out = ctl(&dir, &["reload", "--json"]);
    let report = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(report["kept"][0]["name"], "c", "{report}");
    assert!(report["kept"][0]["reason"].as_str().unwrap().contains("1 NBD client"), "{report}");
    assert_eq!(names(&dir), ["a", "c"]);
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(15);
    while names(&dir) != ["a"] {
        assert!(Instant::now() < deadline, "c was never removed");
        assert!(ctl(&dir, &["reload"]).status.success());
        std::thread::sleep(Duration::from_millis(50));
    }

    stop.store(true, Ordering::SeqCst);
    let rounds = client.join().expect("the client of export a saw an error");
    assert!(rounds > 0, "the client of a did nothing");
    server.stop();
}

#[test]
fn a_broken_reload_changes_nothing() {
    let dir = TempDir::new("svc-broken");
    let (a, b) = (image(&dir, "a.img"), image(&dir, "b.img"));
    let config = write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n"));
    let server = Server::spawn(&["serve", "--config", config.to_str().unwrap()], dir.path("nbd.sock"));
    // A typo in a new export: nothing is added or removed.
    write_config(&dir, &format!("[[export]]\nimage = \"{b}\"\n\n[[export]]\nimgae = \"{a}\"\n"));
    signal(&server.child, libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(names(&dir), ["a"]);
    let out = ctl(&dir, &["reload"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vdisk.toml:9:") && err.contains("imgae") && err.contains("nothing changed"), "{err}");
    // A new export that cannot open: the one added before it in the same reload is taken back.
    write_config(
        &dir,
        &format!("[[export]]\nimage = \"{b}\"\n\n[[export]]\nimage = \"{}\"\n", dir.path("gone.img").display()),
    );
    let out = ctl(&dir, &["reload"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("gone"), "{}", text(&out));
    assert_eq!(names(&dir), ["a"], "a failed reload left something behind");
    assert!(run("nbdinfo", &[&server.uri("a")]).contains("export-size"));
    // The file is what should be served: an export of it removed by hand comes back.
    write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n"));
    assert!(ctl(&dir, &["remove", "a", "--hard"]).status.success());
    assert!(names(&dir).is_empty());
    let out = ctl(&dir, &["reload", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json(&String::from_utf8_lossy(&out.stdout))["added"], serde_json::json!(["a"]));
    server.stop();
}

#[test]
fn check_accepts_a_good_file_and_names_file_and_line_of_a_bad_one() {
    let dir = TempDir::new("svc-check");
    let a = image(&dir, "a.img");
    let good = write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\nbps = \"10M\"\n"));
    let out = vdisk(&["serve", "--config", good.to_str().unwrap(), "--check"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK, 1 export"), "{}", text(&out));
    assert!(!dir.path("nbd.sock").exists(), "--check must not listen");
    let cases = [
        ("[server]\nsocket = \n", 2, "string"),
        ("[[export]]\nimage = \"a.img\"\nreadonly = \"yes\"\n", 3, "bool"),
        ("[[export]]\nimage = \"a.img\"\n[[export]]\nimage = \"a.img\"\n", 3, "a second export named \"a\""),
        ("[server]\nsocket_mode = \"999\"\n", 2, "socket_mode"),
        ("[server]\nlisten = \"x\"\nsockets = \"y\"\n", 3, "unknown field `sockets`"),
        ("\n\n[[export]]\nimage = \"missing.img\"\n", 3, "missing.img"),
        ("[[export]]\nimage = \"a.img\"\nnum_queues = 4\n", 1, "vhost_user_blk"),
        ("[server]\nsocket = \"s\"\nlisten = \"no:port:x\"\n", 3, "HOST:PORT"),
        ("# TLS\n[server]\ntls_certificates = \"nope\"\n", 2, "TLS settings: "),
    ];
    for (i, (body, line, what)) in cases.iter().enumerate() {
        let path = dir.path(&format!("bad{i}.toml"));
        std::fs::write(&path, body).unwrap();
        let out = vdisk(&["serve", "--config", path.to_str().unwrap(), "--check"]);
        assert_eq!(out.status.code(), Some(2), "case {i}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "case {i}: one line: {err}");
        let want = format!("vdisk: {}:{line}: ", path.display());
        assert!(err.starts_with(&want) && err.contains(what), "case {i}: want {want}...{what}, got {err}");
    }
    // A flag on the command line is checked with the file.
    let out = vdisk(&["serve", "--config", good.to_str().unwrap(), "--check", "--tls-cert", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// A datagram socket standing in for systemd's notify socket.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Notify {
    fn bind(dir: &TempDir) -> Notify {
        let path = dir.path("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        Notify { sock, path }
    }

    /// The next message, or None after `secs`.
    fn next(&self, secs: u64) -> Option<String> {
        self.sock.set_read_timeout(Some(Duration::from_secs(secs))).unwrap();
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Messages until one contains `what`.
    fn until(&self, what: &str) -> String {
        let mut seen = Vec::new();
        loop {
            let m = self.next(30).unwrap_or_else(|| panic!("no {what} within 30 s; got {seen:?}"));
            if m.contains(what) {
                return m;
            }
            seen.push(m);
        }
    }
}

fn spawn_quiet(cmd: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(cmd).args(args).envs(env.iter().copied()).stdout(Stdio::null()).spawn().unwrap()
}

#[test]
fn ready_once_clients_can_connect_reloading_and_stopping() {
    let dir = TempDir::new("svc-notify");
    let a = image(&dir, "a.img");
    let config = write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n"));
    let notify = Notify::bind(&dir);
    let mut child = spawn_quiet(
        vdisk_bin(),
        &["serve", "--config", config.to_str().unwrap()],
        &[("NOTIFY_SOCKET", notify.path.to_str().unwrap())],
    );
    let ready = notify.until("READY=1");
    assert!(ready.contains("STATUS=serving 1 export"), "{ready}");
    // The moment READY=1 arrives, a client gets in.
    let uri = format!("nbd+unix:///a?socket={}", dir.path("nbd.sock").display());
    assert!(run("nbdinfo", &[&uri]).contains("export-size: 8388608"));
    signal(&child, libc::SIGHUP);
    let reloading = notify.until("RELOADING=1");
    let usec =
        reloading.lines().find_map(|l| l.strip_prefix("MONOTONIC_USEC=")).expect("MONOTONIC_USEC with RELOADING");
    assert!(usec.parse::<u64>().unwrap() > 0, "{reloading}");
    assert!(notify.until("READY=1").contains("STATUS="), "READY=1 again after the reload");
    signal(&child, libc::SIGTERM);
    notify.until("STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[test]
fn socket_activation_through_systemd_socket_activate() {
    let dir = TempDir::new("svc-activate");
    let a = image(&dir, "a.img");
    // No socket or control in the file: both come from the "service manager".
    let config = dir.path("vdisk.toml");
    let (nbd, control, vhost) = (dir.path("nbd.sock"), dir.path("ctl.sock"), dir.path("a.vhost"));
    let export = format!("[[export]]\nimage = \"{a}\"\nvhost_user_blk = \"{}\"\n", vhost.display());
    std::fs::write(&config, export).unwrap();
    let mut child = spawn_quiet(
        "systemd-socket-activate",
        &[
            "-l",
            nbd.to_str().unwrap(),
            "-l",
            control.to_str().unwrap(),
            "-l",
            vhost.to_str().unwrap(),
            "--fdname=nbd:control:vhost-user-blk",
            vdisk_bin(),
            "serve",
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(nbd.exists() && control.exists()) {
        assert!(Instant::now() < deadline, "systemd-socket-activate made no sockets");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The first client starts vdisk and waits in the listen queue meanwhile.
    let uri = format!("nbd+unix:///a?socket={}", nbd.display());
    assert!(run("nbdinfo", &[&uri]).contains("export-size: 8388608"));
    assert_eq!(names(&dir), ["a"], "the control socket came from LISTEN_FDS too");
    // The vhost-user-blk socket too: binding it would have been refused (it is live).
    let list = json(&String::from_utf8_lossy(&ctl(&dir, &["list", "--json"]).stdout));
    assert_eq!(list[0]["transports"][1]["type"], "vhost-user-blk", "{list}");
    signal(&child, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
    // The socket files belong to the service manager: vdisk leaves them.
    for s in [&nbd, &control, &vhost] {
        assert!(s.exists(), "{} was removed", s.display());
    }
}

#[test]
fn pid_file_written_when_ready_locked_and_removed_at_exit() {
    let dir = TempDir::new("svc-pid");
    let a = image(&dir, "a.img");
    let pid_file = dir.path("vdisk.pid");
    let pid_arg = pid_file.to_str().unwrap();
    let socket = dir.path("nbd.sock");
    let server =
        Server::spawn(&["serve", &a, "--socket", socket.to_str().unwrap(), "--pid-file", pid_arg], socket.clone());
    let written = std::fs::read_to_string(&pid_file).unwrap();
    assert_eq!(written.trim(), server.child.id().to_string());
    let other = dir.path("other.sock");
    let out = vdisk_bounded(&["serve", &a, "--socket", other.to_str().unwrap(), "--pid-file", pid_arg]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("locked by another vdisk serve") && err.contains(written.trim()), "{err}");
    assert!(!other.exists(), "the refused server listened anyway");
    assert_eq!(std::fs::read_to_string(&pid_file).unwrap(), written, "the refused server touched the pid file");
    server.stop();
    assert!(!pid_file.exists(), "pid file left behind");
}

#[test]
fn json_log_lines_parse() {
    let dir = TempDir::new("svc-json");
    let (a, b) = (image(&dir, "a.img"), image(&dir, "b.img"));
    let config = write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n"));
    let child = Command::new(vdisk_bin())
        .args(["serve", "--config", config.to_str().unwrap(), "--log-format", "json", "--log-level", "debug"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_socket(&dir.path("ctl.sock"));
    run("nbdinfo", &[&format!("nbd+unix:///a?socket={}", dir.path("nbd.sock").display())]);
    write_config(&dir, &format!("[[export]]\nimage = \"{a}\"\n\n[[export]]\nimage = \"{b}\"\n"));
    assert!(ctl(&dir, &["reload"]).status.success());
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stderr).lines().map(json).collect();
    for l in &lines {
        for key in ["time", "level", "message"] {
            assert!(l[key].is_string(), "{key} missing in {l}");
        }
    }
    assert!(lines.iter().any(|l| l["export"] == "b" && l["message"].as_str().unwrap().contains("added")), "{lines:#?}");
    assert!(lines.iter().any(|l| l["client"].is_string() && l["export"] == "a"), "{lines:#?}");
    assert!(lines.iter().any(|l| l["message"].as_str().unwrap().starts_with("reload of")), "{lines:#?}");
}

#[test]
fn under_the_journal_text_lines_carry_a_priority_instead_of_the_name() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new("svc-journal");
    let a = image(&dir, "a.img");
    let log = std::fs::File::create(dir.path("stderr")).unwrap();
    let meta = log.metadata().unwrap();
    let stream = format!("{}:{}", meta.dev(), meta.ino());
    let socket = dir.path("nbd.sock");
    let mut child = Command::new(vdisk_bin())
        .args(["serve", &a, "--socket", socket.to_str().unwrap()])
        .env("JOURNAL_STREAM", &stream)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    wait_for_socket(&socket);
    signal(&child, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
    let text = std::fs::read_to_string(dir.path("stderr")).unwrap();
    assert!(text.lines().any(|l| l.starts_with("<4>warning: signal 15")), "{text}");
    assert!(!text.contains("vdisk: warning"), "{text}");
}

fn wait_for_socket(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(Instant::now() < deadline, "{} never accepted", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let dir = TempDir::new("svc-units");
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd");
    let mut args = Vec::new();
    for name in ["vdisk.service", "vdisk.socket", "vdisk-control.socket"] {
        // The units name the installed binary; here, the one just built.
        let text = std::fs::read_to_string(units.join(name)).unwrap().replace("/usr/local/bin/vdisk", vdisk_bin());
        std::fs::write(dir.path(name), text).unwrap();
        args.push(dir.path(name).to_str().unwrap().to_owned());
    }
    let mut all = vec!["verify".to_owned()];
    all.extend(args);
    let out =
        Command::new("systemd-analyze").args(&all).output().expect("systemd-analyze (scripts/install-test-deps.sh)");
    assert!(out.status.success() && out.stderr.is_empty(), "systemd-analyze verify: {}", text(&out));
}
