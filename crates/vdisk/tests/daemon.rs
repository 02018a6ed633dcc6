//! `vdisk serve --control` as a daemon: exports added and removed while it
//! runs (`vdisk ctl` and raw JSON-RPC), per-export statistics, QoS and
//! Prometheus metrics, driven with real clients (fio, nbdcopy, qemu-io, the
//! test NBD client) against the real binary.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::nbd::{pattern, Client, CMD_FLUSH, CMD_WRITE};
use common::*;
use serde_json::{json, Value};

/// A `vdisk serve --control` with no image, its NBD socket and control socket in `dir`.
struct Daemon {
    server: Server,
    control: PathBuf,
}

impl Daemon {
    fn start(dir: &TempDir, extra: &[&str]) -> Daemon {
        let control = dir.path("ctl.sock");
        let socket = dir.path("nbd.sock");
        let mut args = vec!["serve", "--control", control.to_str().unwrap(), "--socket", socket.to_str().unwrap()];
        args.extend_from_slice(extra);
        let server = Server::spawn(&args, socket.clone());
        Daemon { server, control }
    }

    /// `vdisk ctl --control PATH ARGS`, whatever its exit status.
    fn ctl(&self, args: &[&str]) -> Output {
        let mut all = vec!["ctl", "--control", self.control.to_str().unwrap()];
        all.extend_from_slice(args);
        vdisk(&all)
    }

    /// `vdisk ctl ARGS`, asserting success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(out.status.success(), "vdisk ctl {args:?}:\n{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `vdisk ctl ARGS --json`, parsed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        json(&self.ok(&all))
    }

    fn stats(&self, name: &str) -> Value {
        self.json(&["stats", name])
    }

    /// Waits until the server has seen the clients of `name` leave (a client
    /// that exited may still be closing on the server's side).
    fn idle(&self, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.stats(name)["connections"] != 0 {
            assert!(Instant::now() < deadline, "clients of {name} did not leave");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A daemon with no exports in a new directory, and a new image `NAME.img`
/// of `size` beside it, not added yet: (dir, daemon, image).
fn daemon_and_image(tag: &str, name: &str, size: &str) -> (TempDir, Daemon, String) {
    let dir = TempDir::new(tag);
    let d = Daemon::start(&dir, &[]);
    let img = image(&dir, &format!("{name}.img"), size);
    (dir, d, img)
}

/// One JSON-RPC exchange on an open control connection.
fn rpc(conn: &mut BufReader<UnixStream>, line: &str) -> Value {
    writeln!(conn.get_mut(), "{line}").unwrap();
    let mut answer = String::new();
    conn.read_line(&mut answer).unwrap();
    json(&answer)
}

fn connect(path: &Path) -> BufReader<UnixStream> {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    BufReader::new(s)
}

#[test]
fn ctl_adds_lists_and_removes_exports() {
    let dir = TempDir::new("daemon-ctl");
    let d = Daemon::start(&dir, &[]);
    let mode = std::fs::metadata(&d.control).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the control socket is the owner's only");
    assert_eq!(d.json(&["list"]), json!([]), "--control and no image: no export");
    let a = image(&dir, "a.img", "8M");
    let added = d.ok(&["add", &a, "--name", "alpha"]);
    assert!(added.contains("export \"alpha\""), "{added}");
    let list = d.json(&["list"]);
    assert_eq!(list[0]["name"], "alpha");
    assert_eq!(list[0]["size"], 8 << 20);
    assert_eq!(list[0]["format"], "raw");
    assert_eq!(list[0]["readonly"], false);
    assert_eq!(list[0]["transports"][0]["type"], "nbd");
    let table = d.ok(&["list"]);
    assert!(table.starts_with("NAME") && table.contains("alpha"), "{table}");
    qemu_io(&d.server.uri("alpha"), &["write -P 7 0 64k", "read -P 7 0 64k"]);

    // Refusals: exit 1 with the server's reason.
    for (args, why) in [
        (vec!["add", a.as_str(), "--name", "alpha"], "exists already"),
        (vec!["add", "/nonexistent/x.img"], "x.img"),
        (vec!["remove", "nosuch"], "no export"),
        (vec!["qos", "nosuch", "--iops", "5"], "no export"),
    ] {
        let out = d.ctl(&args);
        assert_eq!(out.status.code(), Some(1), "vdisk ctl {args:?}:\n{}", text(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains(why), "{args:?}:\n{}", text(&out));
    }
    // Usage errors: exit 2.
    for args in [vec!["qos", "alpha"], vec!["frobnicate"], vec!["add"]] {
        let out = d.ctl(&args);
        assert_eq!(out.status.code(), Some(2), "vdisk ctl {args:?}:\n{}", text(&out));
    }
    let out = vdisk(&["ctl", "list"]);
    assert_eq!(out.status.code(), Some(2), "no --control: {}", text(&out));

    let info = d.json(&["info"]);
    assert_eq!(info["exports"], 1);
    d.ok(&["remove", "alpha"]);
    assert_eq!(d.json(&["list"]), json!([]));
    let out = output("nbdinfo", &[&d.server.uri("alpha")]);
    assert!(!out.status.success(), "a removed export is gone: {}", text(&out));
    // The name is free again at once, and the data was kept.
    d.ok(&["add", &a, "--name", "alpha", "--readonly"]);
    let out = output("qemu-io", &["-r", "-f", "raw", &d.server.uri("alpha"), "-c", "read -P 7 0 64k"]);
    assert!(out.status.success() && !text(&out).contains("fail"), "{}", text(&out));
    assert_eq!(d.json(&["list"])[0]["readonly"], true);
    d.server.stop();
    assert!(!d.control.exists(), "control socket removed at exit");
}

#[test]
fn hostile_control_input_changes_nothing() {
    let (_dir, d, a) = daemon_and_image("daemon-hostile", "a", "8M");
    d.ok(&["add", &a]);
    let mut c = connect(&d.control);
    let code = |v: &Value| v["error"]["code"].as_i64().unwrap_or_else(|| panic!("not an error: {v}"));
    assert_eq!(code(&rpc(&mut c, "this is not json")), -32700);
    assert_eq!(code(&rpc(&mut c, "[1, 2]")), -32600);
    assert_eq!(code(&rpc(&mut c, r#"{"id": 1, "method": "export_list"}"#)), -32600);
    assert_eq!(code(&rpc(&mut c, r#"{"jsonrpc": "2.0", "id": 2, "method": "rm_rf"}"#)), -32601);
    let bad_params = [
        r#"{"jsonrpc":"2.0","id":3,"method":"export_add","params":{"image":5}}"#,
        r#"{"jsonrpc":"2.0","id":4,"method":"export_add","params":{"image":"/x","colour":"red"}}"#,
        r#"{"jsonrpc":"2.0","id":5,"method":"export_remove","params":{}}"#,
        r#"{"jsonrpc":"2.0","id":6,"method":"export_set_qos","params":{"name":"a","iops":-1}}"#,
        r#"{"jsonrpc":"2.0","id":7,"method":"export_list","params":[1]}"#,
    ];
    for line in bad_params {
        let v = rpc(&mut c, line);
        assert_eq!(code(&v), -32602, "{line} -> {v}");
    }
    // The spec's own checks refuse as they do in the config file (tests/service.rs): one check.
    for (params, what) in [
        (format!(r#"{{"image":"{a}","num_queues":4}}"#), "num_queues applies to vhost_user_blk only"),
        (
            format!(r#"{{"image":"{a}","name":"b","vhost_user_blk":"/tmp/x.sock","num_queues":70}}"#),
            "not between 1 and 64",
        ),
        (format!(r#"{{"image":"{a}","name":"c","bps":"lots"}}"#), "bps"),
    ] {
        let v = rpc(&mut c, &format!(r#"{{"jsonrpc":"2.0","id":9,"method":"export_add","params":{params}}}"#));
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(what)), "{params} -> {v}");
    }
    let v = rpc(&mut c, r#"{"jsonrpc":"2.0","id":"x","method":"export_list"}"#);
    assert_eq!((v["id"].as_str(), v["result"][0]["name"].as_str()), (Some("x"), Some("a")), "{v}");

    // A line over 1 MiB: an error, then the connection is closed.
    let mut big = connect(&d.control);
    let _ = big.get_mut().write_all(&vec![b'x'; (1 << 20) + 4096]);
    let mut answer = String::new();
    big.read_line(&mut answer).unwrap();
    assert_eq!(code(&json(&answer)), -32600, "{answer}");
    answer.clear();
    assert_eq!(big.read_line(&mut answer).unwrap(), 0, "closed after an oversized line");

    // A client that vanishes mid-line: nothing is executed.
    let mut gone = UnixStream::connect(&d.control).unwrap();
    gone.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"export_remove","params":{"name":"a","hard":true}}"#).unwrap();
    drop(gone);
    // Hundreds of idle clients.
    let idle: Vec<UnixStream> = (0..300).map(|_| UnixStream::connect(&d.control).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let list = d.json(&["list"]);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    qemu_io(&d.server.uri("a"), &["write -P 3 0 4k", "read -P 3 0 4k"]);
    drop(idle);
    assert_eq!(code(&rpc(&mut c, r#"{"jsonrpc":"2.0","id":8,"method":"export_stats","params":{"name":"b"}}"#)), -32001);
    d.server.stop();
}

#[test]
fn stats_count_what_nbdcopy_wrote() {
    let (dir, d, img) = daemon_and_image("daemon-stats", "s", "32M");
    d.ok(&["add", &img]);
    // Data nbdcopy cannot skip: no zero block in it.
    let src = dir.path("src.img");
    let data: Vec<u8> = (0..32 << 20).map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8 | 1).collect();
    std::fs::write(&src, &data).unwrap();
    run("nbdcopy", &["--flush", src.to_str().unwrap(), &d.server.uri("s")]);
    let s = d.stats("s");
    let written = s["write_bytes"].as_u64().unwrap() as f64;
    let want = data.len() as f64;
    assert!((written - want).abs() <= want * 0.01, "stats say {written} bytes written, nbdcopy wrote {want}: {s}");
    assert!(s["write_ops"].as_u64().unwrap() > 0 && s["errors"] == 0 && s["in_flight"] == 0, "{s}");
    assert!(s["latency_us"]["write"]["p50"].as_u64().unwrap() > 0, "{s}");
    assert!(s["flush_ops"].as_u64().unwrap() >= 1, "nbdcopy flushes at the end: {s}");
    let before = s["read_bytes"].as_u64().unwrap();
    run("nbdcopy", &[&d.server.uri("s"), dir.path("back.img").to_str().unwrap()]);
    let read = d.stats("s")["read_bytes"].as_u64().unwrap() - before;
    // At least what nbdcopy read; a little more when the server dropped the
    // data of replies nbdcopy was slow to take (the socket took nothing for
    // 100 ms on a loaded machine) and read it again (vdisk-nbd outbox.rs):
    // those re-reads are reads of the image too.
    assert!(read as f64 >= want * 0.99 && read as f64 <= want * 1.1, "read {read} bytes, nbdcopy read {want}");
    assert_same("copied back", &read_file(&dir.path("back.img")), &data);
    let all = d.json(&["stats"]);
    assert_eq!(all.as_array().unwrap().len(), 1);
    d.server.stop();
}

/// fio random writes then a verify pass on `uri`, in a loop until `stop`; panics on any error.
fn fio_verify_until(dir: &Path, uri: &str, stop: &AtomicBool) -> usize {
    let mut rounds = 0;
    while rounds == 0 || !stop.load(Ordering::SeqCst) {
        fio_randwrite_verify(dir, uri, "A");
        rounds += 1;
    }
    rounds
}

/// Writes 64 KiB blocks (pattern = block number) to `export`, flushing every 4;
/// returns how many blocks were flushed when the server cut the connection.
fn write_until_disconnected(socket: &Path, export: &str, flushed: &AtomicU64) -> u64 {
    let (mut c, _) = Client::open(socket, export);
    let mut block = 0u64;
    loop {
        if block < 512 {
            let (_, msg) = c.encode_request(0, CMD_WRITE, block * 65536, 65536, &pattern(block, 65536));
            if c.sock.write_all(&msg).is_err() || c.try_recv().map(|r| r.error).unwrap_or(1) != 0 {
                return flushed.load(Ordering::SeqCst);
            }
            block += 1;
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
        if block.is_multiple_of(4) {
            let (_, msg) = c.encode_request(0, CMD_FLUSH, 0, 0, &[]);
            if c.sock.write_all(&msg).is_err() || c.try_recv().map(|r| r.error).unwrap_or(1) != 0 {
                return flushed.load(Ordering::SeqCst);
            }
            flushed.store(block, Ordering::SeqCst);
        }
    }
}

#[test]
fn exports_come_and_go_while_others_serve() {
    let dir = TempDir::new("daemon-churn");
    let d = Daemon::start(&dir, &[]);
    let (a, b, c) = (image(&dir, "a.img", "16M"), image(&dir, "b.img", "8M"), image(&dir, "c.img", "32M"));
    d.ok(&["add", &a]);
    d.ok(&["add", &c]);
    let stop = Arc::new(AtomicBool::new(false));
    let fio = {
        let (uri, stop, dir) = (d.server.uri("a"), stop.clone(), dir.0.clone());
        std::thread::spawn(move || fio_verify_until(&dir, &uri, &stop))
    };
    let flushed = Arc::new(AtomicU64::new(0));
    let writer = {
        let (socket, flushed) = (d.server.socket.clone(), flushed.clone());
        std::thread::spawn(move || write_until_disconnected(&socket, "c", &flushed))
    };
    for i in 0..40u32 {
        d.ok(&["add", &b]);
        if i.is_multiple_of(10) {
            qemu_io(&d.server.uri("b"), &["read 0 4k"]);
            d.idle("b");
        }
        d.ok(&["remove", "b"]);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while flushed.load(Ordering::SeqCst) < 64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = d.ctl(&["remove", "c"]);
    assert_eq!(out.status.code(), Some(1), "C has a client: a plain remove is refused:\n{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 NBD client"), "{}", text(&out));
    d.ok(&["remove", "c", "--hard"]);
    let done = writer.join().unwrap();
    assert!(done >= 64, "C's client flushed {done} blocks");
    stop.store(true, Ordering::SeqCst);
    let rounds = fio.join().unwrap();
    assert!(rounds >= 1);
    // Every block C's client saw flushed is there when C comes back.
    d.ok(&["add", &c]);
    let (mut client, _) = Client::open(&d.server.socket, "c");
    for block in 0..done {
        let got = client.read(block * 65536, 65536);
        assert_same(&format!("C block {block}"), &got, &pattern(block, 65536));
    }
    assert_eq!(d.stats("a")["errors"], 0);
    d.server.stop();
}

/// fio 4K random reads at queue depth 32 on `uri`: the IOPS it measured.
fn fio_randread_iops(dir: &Path, uri: &str, ramp: u32, runtime: u32) -> f64 {
    let (uri, ramp, runtime) = (format!("--uri={uri}"), format!("--ramp_time={ramp}"), format!("--runtime={runtime}"));
    let args = [
        "--name=q",
        "--ioengine=nbd",
        &uri,
        "--rw=randread",
        "--bs=4k",
        "--iodepth=32",
        "--size=32M",
        "--time_based",
        &ramp,
        &runtime,
        "--output-format=json",
    ];
    let out = Command::new("fio").args(args).current_dir(dir).output().expect("run fio");
    assert!(out.status.success(), "fio failed:\n{}", text(&out));
    // fio says "connected to NBD server" before its JSON.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v = json(&stdout[stdout.find('{').expect("fio printed JSON")..]);
    v["jobs"][0]["read"]["iops"].as_f64().unwrap()
}

#[test]
fn qos_limits_iops_live_and_only_its_own_export() {
    let (dir, d, q) = daemon_and_image("daemon-qos", "q", "32M");
    d.ok(&["add", &q, "--iops", "2000"]);
    assert_eq!(d.json(&["list"])[0]["qos"]["iops"], 2000);
    let other = image(&dir, "other.img", "32M");
    d.ok(&["add", &other]);
    // The ramp spends the one-second burst; what follows is the steady rate.
    let limited = {
        let (dir, uri) = (dir.0.clone(), d.server.uri("q"));
        std::thread::spawn(move || fio_randread_iops(&dir, &uri, 2, 5))
    };
    // Meanwhile an export without limits runs at its own speed.
    std::thread::sleep(Duration::from_millis(2500));
    let beside = fio_randread_iops(&dir.0, &d.server.uri("other"), 0, 3);
    let limited = limited.join().unwrap();
    assert!((1800.0..=2200.0).contains(&limited), "4K randread QD32 at a 2000 IOPS limit: {limited:.0} IOPS");
    eprintln!("beside the limited export, one without limits: {beside:.0} IOPS");
    assert!(beside > limited * 2.0, "a limited export slowed another: {beside:.0} IOPS beside {limited:.0}");
    eprintln!("4K randread QD32 at a 2000 IOPS limit: {limited:.0} IOPS");
    d.ok(&["qos", "q", "--iops", "0"]);
    let free = fio_randread_iops(&dir.0, &d.server.uri("q"), 0, 3);
    eprintln!("limit lifted: {free:.0} IOPS");
    assert!(free > limited * 2.0, "limit lifted: {free:.0} IOPS, limited: {limited:.0}");
    d.server.stop();
}

#[test]
fn metrics_parse_as_openmetrics() {
    let dir = TempDir::new("daemon-metrics");
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start(&dir, &["--metrics", &addr]);
    let m = image(&dir, "m.img", "8M");
    d.ok(&["add", &m]);
    qemu_io(&d.server.uri("m"), &["write -P 9 0 1M", "flush", "read -P 9 0 1M"]);
    let script = r#"
import json, sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1]).read().decode()
out = {}
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        key = s.name + "".join(sorted(f",{k}={v}" for k, v in s.labels.items() if k != "le"))
        if "le" not in s.labels:
            out[key] = s.value
print(json.dumps(out))
"#;
    let url = format!("http://{addr}/metrics");
    let out = Command::new("/usr/bin/python3").args(["-c", script, &url]).output().expect("run python3");
    assert!(out.status.success(), "python3-prometheus-client could not parse /metrics:\n{}", text(&out));
    let v = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["vdisk_bytes_total,export=m,op=write"], 1048576.0, "{v}");
    assert_eq!(v["vdisk_bytes_total,export=m,op=read"], 1048576.0, "{v}");
    assert!(v["vdisk_request_duration_seconds_count,export=m,op=write"].as_f64().unwrap() >= 1.0, "{v}");
    assert_eq!(v["vdisk_connections,export=m"], 0.0, "{v}");
    assert_eq!(v["vdisk_exports"], 1.0, "{v}");
    assert!(v["process_resident_memory_bytes"].as_f64().unwrap() > 0.0, "{v}");
    d.server.stop();
}

fn mounted(path: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mounts.lines().any(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
}

/// For a test that mounts FUSE (it needs root): [`daemon_and_image`] and the
/// path `NAME.disk` for the image's FUSE file: (dir, daemon, image, file).
fn fuse_daemon(tag: &str, name: &str, size: &str) -> (TempDir, Daemon, String, PathBuf) {
    // SAFETY: geteuid only returns a number.
    assert_eq!(unsafe { libc::geteuid() }, 0, "mounting FUSE needs root (CI runs as root)");
    let (dir, d, img) = daemon_and_image(tag, name, size);
    let file = dir.path(&format!("{name}.disk"));
    (dir, d, img, file)
}

#[test]
fn remove_hard_unmounts_the_fuse_file_even_under_a_loop_device() {
    let (dir, d, img, file) = fuse_daemon("daemon-fuse", "f", "16M");
    d.ok(&["add", &img, "--fuse", file.to_str().unwrap()]);
    assert!(mounted(&file), "{} is a FUSE mount", file.display());
    assert_eq!(d.json(&["list"])[0]["transports"][1]["type"], "fuse");
    let data = pattern(5, 1 << 20);
    std::fs::write(dir.path("data"), &data).unwrap();
    let of = format!("of={}", file.display());
    let inp = format!("if={}", dir.path("data").display());
    run("dd", &[&inp, &of, "bs=1M", "conv=notrunc,fsync", "status=none"]);
    let out = run("losetup", &["--find", "--show", file.to_str().unwrap()]);
    let dev = out.trim().to_owned();
    let out = d.ctl(&["remove", "f"]);
    assert_eq!(out.status.code(), Some(1), "a FUSE file may be in use: {}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FUSE file"), "{}", text(&out));
    d.ok(&["remove", "f", "--hard"]);
    let _ = Command::new("losetup").args(["-d", &dev]).status();
    assert!(!mounted(&file), "{} still mounted after remove --hard", file.display());
    // What the FUSE file was given and synced is in the image.
    d.ok(&["add", &img]);
    let (mut c, _) = Client::open(&d.server.socket, "f");
    assert_same("data written through FUSE", &c.read(0, 1 << 20), &data);
    d.server.stop();
}

#[test]
fn a_failed_add_leaves_nothing_started() {
    let (dir, d, img, file) = fuse_daemon("daemon-failed-add", "g", "8M");
    let not_a_socket = dir.path("plain");
    std::fs::write(&not_a_socket, b"x").unwrap();
    // The FUSE file is mounted before the vhost-user socket fails: it must go again.
    let args = ["add", &img, "--fuse", file.to_str().unwrap(), "--vhost-user-blk", not_a_socket.to_str().unwrap()];
    let out = d.ctl(&args);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"), "{}", text(&out));
    assert!(!mounted(&file), "a failed add left {} mounted", file.display());
    assert_eq!(d.json(&["list"]), json!([]));
    // A COW overlay whose base is not where it says.
    let cow = dir.path("o.cow");
    run(vdisk_bin(), &["create", "--backing", &img, cow.to_str().unwrap()]);
    let out = d.ctl(&["add", cow.to_str().unwrap(), "--backing", "/nonexistent/base.img"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(d.json(&["list"]), json!([]));
    // Nothing held the name or the image: both add cleanly now.
    d.ok(&["add", &img, "--fuse", file.to_str().unwrap()]);
    d.ok(&["add", cow.to_str().unwrap()]);
    let list = d.json(&["list"]);
    assert_eq!((list[1]["name"].as_str(), list[1]["format"].as_str()), (Some("o"), Some("cow")), "{list}");
    // The same overlay twice is refused: it is locked by the first.
    let out = d.ctl(&["add", cow.to_str().unwrap(), "--name", "again"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    d.server.stop();
    assert!(!mounted(&file));
}

#[test]
fn requests_waiting_for_qos_tokens_do_not_hold_up_remove_or_stop() {
    let (_dir, d, img) = daemon_and_image("daemon-qos-stop", "w", "8M");
    for round in 0..2 {
        // One byte a second: a 64 KiB write would wait 18 hours for its tokens.
        d.ok(&["add", &img, "--write-bps", "1"]);
        let mut writer = Command::new("qemu-io")
            .args(["-f", "raw", &d.server.uri("w"), "-c", "write -P 4 0 64k"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(d.stats("w")["write_ops"], 0, "the write waits for its tokens");
        if round == 1 {
            break; // SIGTERM below, with the write still waiting
        }
        let t = Instant::now();
        d.ok(&["remove", "w", "--hard"]);
        assert!(t.elapsed() < Duration::from_secs(8), "remove --hard waited {:?}", t.elapsed());
        assert!(writer.wait().unwrap().success(), "the waiting write was answered");
    }
    let t = Instant::now();
    d.server.stop();
    assert!(t.elapsed() < Duration::from_secs(8), "SIGTERM waited {:?}", t.elapsed());
    let data = read_file(&PathBuf::from(&img));
    assert_same("the write that waited, finished at stop", &data[..65536], &[4u8; 65536]);
}

#[test]
fn remove_hard_disconnects_the_vhost_user_frontend() {
    let (dir, d, img) = daemon_and_image("daemon-vhost", "v", "8M");
    let sock = dir.path("v.vhost");
    d.ok(&["add", &img, "--vhost-user-blk", sock.to_str().unwrap(), "--num-queues", "1"]);
    assert_eq!(d.json(&["list"])[0]["transports"][1]["type"], "vhost-user-blk");
    // A frontend that connected (and says nothing yet).
    let mut frontend = UnixStream::connect(&sock).unwrap();
    frontend.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let out = d.ctl(&["remove", "v"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("vhost-user-blk socket"), "{}", text(&out));
    d.ok(&["remove", "v", "--hard"]);
    let mut byte = [0u8; 1];
    let n = std::io::Read::read(&mut frontend, &mut byte);
    assert!(matches!(n, Ok(0) | Err(_)), "the frontend is disconnected: {n:?}");
    assert!(!sock.exists(), "the vhost-user socket is removed");
    d.ok(&["add", &img, "--vhost-user-blk", sock.to_str().unwrap()]);
    d.server.stop();
}
