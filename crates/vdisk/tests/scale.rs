//! A thousand exports on one server (issue 23): 996 small images are added
//! through the control socket, each written and read back over NBD, all
//! removed, added again (each must still hold what was written) and removed
//! again, while fio writes and verifies (crc32c) four other exports of the
//! same server without a pause. Every add and removal must succeed, every
//! export must answer, every fio pass must verify.

mod common;

use common::{rpc, s, text, Server, TempDir};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vdisk_nbd::client::{Client, Cmd};

const BUSY: usize = 4;
const CHURN: usize = 996;
const BLOCK: usize = 4096;

/// Requests on one control connection, up to 64 ahead of their answers (the
/// server answers in order); every answer.
fn pipelined(control: &Path, reqs: &[Value]) -> Vec<Value> {
    let mut w = UnixStream::connect(control).unwrap();
    w.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut r = BufReader::new(w.try_clone().unwrap());
    let (mut sent, mut answers, mut line) = (0, Vec::new(), String::new());
    while answers.len() < reqs.len() {
        let mut out = String::new();
        while sent < reqs.len() && sent - answers.len() < 64 {
            let mut q = reqs[sent].clone();
            q["jsonrpc"] = "2.0".into();
            q["id"] = sent.into();
            out += &format!("{q}\n");
            sent += 1;
        }
        w.write_all(out.as_bytes()).unwrap();
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "the server closed the control connection");
        answers.push(common::json(&line));
    }
    answers
}

fn all_succeed(what: &str, answers: &[Value]) {
    let failed: Vec<&Value> = answers.iter().filter(|a| a.get("error").is_some()).collect();
    assert!(failed.is_empty(), "{} of {} {what} failed, first: {}", failed.len(), answers.len(), failed[0]);
}

fn tag(i: usize, round: u8) -> Vec<u8> {
    let mut b = vec![round; BLOCK];
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    b
}

/// Opens export `churnI`, checks block 0 holds `expect` (round 0: zeros),
/// writes `next` there (no FUA: the removal's flush must make it stay) and reads it back.
fn probe(socket: &Path, i: usize, expect: Option<&[u8]>, next: &[u8]) {
    let name = format!("churn{i}");
    let mut c = Client::connect(socket, &name, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("export {name} does not answer: {e}"));
    let got = c.call(Cmd::Read, 0, 0, BLOCK as u32, &[]).unwrap();
    let zeros = vec![0u8; BLOCK];
    assert!(got == expect.unwrap_or(&zeros), "export {name}: block 0 lost what was written before its removal");
    c.call(Cmd::Write, 0, 0, BLOCK as u32, next).unwrap();
    assert!(c.call(Cmd::Read, 0, 0, BLOCK as u32, &[]).unwrap() == next, "export {name}: write not read back");
    c.disconnect();
}

/// Probes every churned export, four at a time, in round `round` (1, 2, ...):
/// block 0 must hold the previous round's tag (zeros in round 1), then gets this round's.
fn probe_all(socket: &Path, round: u8) {
    std::thread::scope(|sc| {
        for k in 0..4 {
            sc.spawn(move || {
                for i in (k..CHURN).step_by(4) {
                    let expect = (round > 1).then(|| tag(i, round - 1));
                    probe(socket, i, expect.as_deref(), &tag(i, round));
                }
            });
        }
    });
}

/// Removes `churn0..CHURN`; a removal that comes before the server has seen a
/// probe's connection go answers "in use" (-32003) and is tried again.
fn remove_all(control: &Path) {
    let mut left: Vec<usize> = (0..CHURN).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !left.is_empty() {
        let reqs: Vec<Value> =
            left.iter().map(|i| json!({"method": "export_remove", "params": {"name": format!("churn{i}")}})).collect();
        let answers = pipelined(control, &reqs);
        let busy: Vec<usize> = left
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a["error"]["code"].as_i64() == Some(-32003) && Instant::now() < deadline)
            .map(|(&i, _)| i)
            .collect();
        let rest: Vec<Value> = left.iter().zip(answers).filter(|(i, _)| !busy.contains(i)).map(|(_, a)| a).collect();
        all_succeed("export_remove", &rest);
        left = busy;
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// fio's nbd engine on `uri`: 8 MiB of 4K random writes at QD16, then read
/// back and verified; passes until `stop`, at least one. Returns the passes.
fn fio_passes(dir: PathBuf, uri: String, stop: Arc<AtomicBool>) -> usize {
    let mut passes = 0;
    while passes == 0 || !stop.load(Ordering::Relaxed) {
        let out = Command::new("fio")
            .args(["--name=verify", "--ioengine=nbd", &format!("--uri={uri}"), "--rw=randwrite", "--bs=4k"])
            .args(["--iodepth=16", "--size=8M", "--verify=crc32c", "--do_verify=1"])
            .arg(format!("--randseed={}", passes + 1))
            .current_dir(&dir)
            .output()
            .expect("run fio (apt-get install fio)");
        let all = text(&out);
        assert!(out.status.success() && all.contains("err= 0"), "fio on {uri} failed (pass {passes}):\n{all}");
        assert!(!all.contains("verify: bad") && all.contains("read: IOPS"), "fio on {uri} did not verify:\n{all}");
        passes += 1;
    }
    passes
}

/// The server holds a few descriptors per export: more than the usual soft
/// limit of 1024 for a thousand exports. Raised to the hard limit (as a service
/// would set LimitNOFILE=) before the server is started, which inherits it.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed to it.
    let mut ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    r.rlim_cur = r.rlim_max;
    // SAFETY: setrlimit only reads the struct passed to it.
    ok = ok && unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0;
    assert!(ok && r.rlim_cur >= 8192, "the descriptor limit {} is too low for 1,000 exports (ulimit -Hn)", r.rlim_cur);
}

/// `vdisk serve` raises its soft descriptor limit to the hard one itself.
#[test]
fn serve_raises_its_descriptor_limit() {
    let dir = TempDir::new("nofile");
    let control = dir.path("ctl.sock");
    let mut cmd = Command::new(common::vdisk_bin());
    cmd.args(["serve", "--control", s(&control), "--socket", s(&dir.path("nbd.sock"))]);
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    fn lower_soft_limit() -> std::io::Result<()> {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit only writes the struct passed to it.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
            r.rlim_cur = r.rlim_cur.min(256);
            // SAFETY: setrlimit only reads the struct passed to it.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) };
        }
        Ok(())
    }
    // SAFETY: between fork and exec the hook only calls getrlimit and setrlimit (async-signal-safe).
    unsafe { std::os::unix::process::CommandExt::pre_exec(&mut cmd, lower_soft_limit) };
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !control.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert!(control.exists(), "the server did not start");
    assert_eq!(f[3], f[4], "the soft descriptor limit is not raised to the hard one: {line}");
}

#[test]
fn a_thousand_exports_come_and_go_while_four_verify() {
    raise_fd_limit();
    let started = Instant::now();
    let dir = TempDir::new("scale");
    let control = dir.path("ctl.sock");
    let server = Server::start(&dir, &["--control", s(&control)]);
    let image = |name: &str, size: u64| {
        let p = dir.path(&format!("{name}.img"));
        std::fs::File::create(&p).unwrap().set_len(size).unwrap();
        p
    };
    let mut fios = Vec::new();
    let stop = Arc::new(AtomicBool::new(false));
    for b in 0..BUSY {
        let img = image(&format!("busy{b}"), 16 << 20);
        let r = rpc(&control, "export_add", json!({"image": img}));
        assert!(r.get("result").is_some(), "adding {}: {r}", img.display());
        let work = dir.path(&format!("fio{b}"));
        std::fs::create_dir_all(&work).unwrap();
        let (uri, stop) = (server.uri(&format!("busy{b}")), stop.clone());
        fios.push(std::thread::spawn(move || fio_passes(work, uri, stop)));
    }
    let images: Vec<PathBuf> = (0..CHURN).map(|i| image(&format!("churn{i}"), 1 << 20)).collect();
    let adds: Vec<Value> = images.iter().map(|p| json!({"method": "export_add", "params": {"image": p}})).collect();

    let t = Instant::now();
    all_succeed("export_add", &pipelined(&control, &adds));
    let first_add = t.elapsed();
    // One descriptor per raw export (its image file), nothing per export on the shared core;
    // the rest is the server's own and the fio connections'.
    let fds = std::fs::read_dir(format!("/proc/{}/fd", server.child.id())).unwrap().count();
    assert!(fds <= BUSY + CHURN + 64, "{fds} descriptors open for {} exports: more than one each", BUSY + CHURN);
    let list = rpc(&control, "export_list", json!({}));
    assert_eq!(list["result"].as_array().map(Vec::len), Some(BUSY + CHURN), "export_list after the adds");
    let t = Instant::now();
    probe_all(&server.socket, 1);
    let probes = t.elapsed();
    let t = Instant::now();
    remove_all(&control);
    let removes = t.elapsed();

    let t = Instant::now();
    all_succeed("export_add (again)", &pipelined(&control, &adds));
    let second_add = t.elapsed();
    probe_all(&server.socket, 2);
    remove_all(&control);
    let list = rpc(&control, "export_list", json!({}));
    assert_eq!(list["result"].as_array().map(Vec::len), Some(BUSY), "export_list after the removals");

    stop.store(true, Ordering::Relaxed);
    let passes: Vec<usize> = fios.into_iter().map(|t| t.join().expect("a fio thread failed")).collect();
    server.stop();
    eprintln!(
        "{CHURN} exports added in {:.1} s (probed in {:.1} s, removed in {:.1} s), again in {:.1} s; fio passes on the {BUSY} busy exports: {passes:?}; \
         {:.1} s in all",
        first_add.as_secs_f64(),
        probes.as_secs_f64(),
        removes.as_secs_f64(),
        second_add.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
