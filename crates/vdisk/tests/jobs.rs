//! Block jobs of `vdisk serve` driven through `vdisk ctl` with real clients:
//! commit of a layer below the live top while fio writes and verifies
//! (qcow2 and COW chains, checked afterwards with qemu-img), cancel of a
//! stream, the refusals (a second job, pivot of a stream, what commit
//! cannot do), the job metrics, and kill -9 in the middle of a commit.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::control::*;
use common::*;

/// The job id in "... started as job N; ...".
fn started(said: &str) -> u64 {
    let at = said.find("started as job ").unwrap_or_else(|| panic!("no job started: {said}")) + 15;
    said[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// The images `qemu-img info --backing-chain` lists, top first.
fn qemu_chain(top: &Path) -> Vec<String> {
    let chain = run("qemu-img", &["info", "--backing-chain", top.to_str().unwrap()]);
    chain.lines().filter_map(|l| l.strip_prefix("image: ")).map(str::to_owned).collect()
}

fn assert_qemu_reads(top: &Path, guest: &Path) {
    let same = run("qemu-img", &["compare", "-F", "raw", top.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
}

/// GET /metrics from `addr`.
fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// base.raw <- mid (the first snapshot, `mid_format`) <- top.qcow2, snapshotted
/// while fio writes and verifies, then `commit disk --wait` (with `extra`)
/// under fio too: the chain is top <- base, qemu-img reads the guest's view.
fn commit_middle_under_fio(
    tag: &str,
    engine: &str,
    mid_format: &str,
    extra: &[&str],
) -> (TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = TempDir::new(&format!("{tag}-{engine}"));
    let base = dir.path("disk.raw");
    make_base(&base, 32 * MIB, 5);
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &["--engine", engine]);
    let (mid, top) = (dir.path(&format!("mid.{mid_format}")), dir.path("top.qcow2"));
    let stop = Arc::new(AtomicBool::new(false));
    let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", mid.to_str().unwrap(), "--format", mid_format]);
    std::thread::sleep(Duration::from_millis(500));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    std::thread::sleep(Duration::from_millis(300));
    let mut args = vec!["commit", "disk", "--wait"];
    args.extend_from_slice(extra);
    let said = ctl_ok(&control, &args);
    assert!(said.contains("(commit of export \"disk\"): done") && said.contains("100.0%"), "{said}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed");
    // It served on from the shortened chain: the same export, the same top.
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), top.to_str(), "{list}");
    let jobs = json(&ctl_ok(&control, &["jobs", "--json"]));
    let commit = jobs.as_array().unwrap().iter().find(|j| j["type"] == "commit").unwrap();
    assert_eq!((commit["state"].as_str(), &commit["done"]), (Some("done"), &commit["total"]), "{jobs}");
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, read_export(&dir, &server.uri("disk"), "view.raw")).unwrap();
    server.stop();
    assert_eq!(qemu_chain(&top), [top.to_str().unwrap(), base.to_str().unwrap()], "the chain is top <- base");
    assert_qemu_reads(&top, &guest);
    run("qemu-img", &["check", top.to_str().unwrap()]);
    (dir, base, mid, guest)
}

#[test]
fn commit_of_the_middle_qcow2_layer_under_fio_verify() {
    for engine in ENGINES {
        commit_of_the_middle_qcow2_layer(engine);
    }
}

fn commit_of_the_middle_qcow2_layer(engine: &str) {
    let (dir, _base, mid, guest) = commit_middle_under_fio("jobs-commit-qcow2", engine, "qcow2", &["--bps", "64M"]);
    assert!(mid.exists(), "without --delete the dropped layer's file stays");
    // The chain served again from its files reads the same.
    let top = dir.path("top.qcow2");
    let (server, _) = serve_ctl(&dir, top.to_str().unwrap(), &[]);
    assert_same(
        "the committed chain served again",
        &read_export(&dir, &server.uri("top"), "again.raw"),
        &read_file(&guest),
    );
    server.stop();
}

#[test]
fn commit_of_a_middle_cow_layer_into_its_raw_base_under_fio_verify() {
    let (_dir, base, mid, _guest) = commit_middle_under_fio("jobs-commit-cow", "uring", "cow", &["--delete"]);
    assert!(!mid.exists(), "--delete removed the dropped COW layer");
    assert!(base.exists());
}

#[test]
fn commit_refuses_what_it_cannot_do_and_changes_nothing() {
    let dir = TempDir::new("jobs-commit-refusals");
    let base = dir.path("disk.raw");
    make_base(&base, 8 * MIB, 9);
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &[]);
    ctl_refused(&control, &["commit", "disk"], "no backing chain");
    let (mid, top) = (dir.path("mid.qcow2"), dir.path("top.qcow2"));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", mid.to_str().unwrap()]);
    ctl_refused(&control, &["commit", "disk"], "no layer between the live top and the base");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&server.uri("disk"), &["write -P 0x5a 1M 64k", "flush"]);
    let before = read_export(&dir, &server.uri("disk"), "before.raw");
    let elsewhere = dir.path("elsewhere.qcow2");
    make_base(&elsewhere, MIB, 1);
    for (args, why) in [
        (vec!["--top", elsewhere.to_str().unwrap()], "is not a layer of its chain"),
        (vec!["--base", elsewhere.to_str().unwrap()], "is not a layer of its chain"),
        (vec!["--top", base.to_str().unwrap(), "--base", mid.to_str().unwrap()], "is not below the top"),
    ] {
        let mut all = vec!["commit", "disk"];
        all.extend_from_slice(&args);
        ctl_refused(&control, &all, why);
    }
    let ro = dir.path("ro.img");
    make_base(&ro, MIB, 1);
    ctl_ok(&control, &["add", ro.to_str().unwrap(), "--readonly"]);
    ctl_refused(&control, &["commit", "ro"], "read-only");
    ctl_refused(&control, &["commit", "nope"], "no export");
    assert_same("after the refusals", &read_export(&dir, &server.uri("disk"), "after.raw"), &before);
    server.stop();
    assert_eq!(qemu_chain(&top).len(), 3, "the chain is as it was");
}

#[test]
fn a_cancelled_stream_leaves_a_chain_that_reads_the_same_and_the_refusals_while_it_runs() {
    let dir = TempDir::new("jobs-cancel");
    let base = dir.path("disk.raw");
    make_base(&base, 32 * MIB, 13);
    let addr = format!("127.0.0.1:{}", free_port());
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &["--metrics", &addr]);
    let top = dir.path("top.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&server.uri("disk"), &["write -P 0x33 4M 1M", "flush"]);
    let before = read_export(&dir, &server.uri("disk"), "before.raw");

    // Slow (1 MiB/s over 32 MiB): still running for all that follows.
    let waiting = {
        let control = control.clone();
        std::thread::spawn(move || ctl(&control, &["stream", "disk", "--bps", "1M", "--wait"]))
    };
    let id = {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let all = json(&ctl_ok(&control, &["jobs", "--json"]));
            if let Some(j) = all.as_array().unwrap().iter().find(|j| j["type"] == "stream") {
                break j["id"].as_u64().unwrap();
            }
            assert!(Instant::now() < until, "the stream did not start: {all}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let running = job_until(&control, id, |j| j["done"].as_u64() > Some(0));
    assert_eq!((running["state"].as_str(), running["bps"].as_u64()), (Some("running"), Some(1 << 20)), "{running}");
    let table = ctl_ok(&control, &["jobs"]);
    assert!(table.contains("RATE") && table.contains("running") && table.contains("1 MiB/s"), "{table}");
    let metrics = scrape(&addr);
    let series = format!("vdisk_job_state{{id=\"{id}\",type=\"stream\",export=\"disk\",state=\"running\"}} 1");
    assert!(metrics.contains(&series), "no {series} in:\n{metrics}");
    assert!(metrics.contains(&format!("vdisk_job_bytes_total{{id=\"{id}\",type=\"stream\",export=\"disk\"}} 33554432")));
    assert!(metrics.contains("vdisk_job_bytes_done{"), "{metrics}");
    // And they parse as OpenMetrics (the system Python's prometheus_client).
    let script = r#"
import sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1]).read().decode()
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        if s.name.startswith("vdisk_job_"):
            print(fam.type, s.name, s.labels.get("state", "-"), int(s.value))
"#;
    let parsed = run("/usr/bin/python3", &["-c", script, &format!("http://{addr}/metrics")]);
    assert!(
        parsed.contains("gauge vdisk_job_state running 1") && parsed.contains("gauge vdisk_job_bytes_total - 33554432"),
        "{parsed}"
    );

    // Refused while it runs: a second job, a snapshot, a pivot of a stream.
    ctl_refused(&control, &["stream", "disk"], "has a running job");
    let other = dir.path("other.qcow2");
    ctl_refused(&control, &["snapshot", "disk", "--overlay", other.to_str().unwrap()], "runs on it");
    assert!(!other.exists());
    ctl_refused(&control, &["pivot", &id.to_string()], "only a mirror or an active commit pivots");
    ctl_refused(&control, &["pivot", "999"], "no job 999");
    // The guest keeps writing meanwhile (beyond what the stream reached).
    qemu_io(&server.uri("disk"), &["write -P 0x44 30M 64k", "flush"]);
    let mut want = before.clone();
    want[30 * MIB..30 * MIB + 64 * KIB].fill(0x44);

    let said = ctl_ok(&control, &["cancel", &id.to_string()]);
    assert!(said.contains("cancel asked"), "{said}");
    let out = waiting.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("was cancelled"), "{}", text(&out));
    let ended = job(&control, id);
    assert_eq!(ended["state"], "cancelled", "{ended}");
    assert!(ended["done"].as_u64() < ended["total"].as_u64(), "{ended}");
    assert!(!scrape(&addr).contains("vdisk_job_state{"), "an ended job leaves the metrics");
    ctl_refused(&control, &["cancel", &id.to_string()], "has ended already");
    assert_same("the chain after the cancel", &read_export(&dir, &server.uri("disk"), "after.raw"), &want);
    server.stop();
    assert_eq!(qemu_chain(&top), [top.to_str().unwrap(), base.to_str().unwrap()], "still top <- base");
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, &want).unwrap();
    assert_qemu_reads(&top, &guest);
    run("qemu-img", &["check", top.to_str().unwrap()]);
}

#[test]
fn kill_9_in_the_middle_of_a_commit_leaves_a_chain_that_opens_and_commit_again_finishes() {
    let dir = TempDir::new("jobs-commit-kill");
    let base = dir.path("disk.raw");
    make_base(&base, 32 * MIB, 21);
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &[]);
    let uri = server.uri("disk");
    let (mid, top) = (dir.path("mid.qcow2"), dir.path("top.qcow2"));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", mid.to_str().unwrap()]);
    // The middle layer holds 24 MiB: at 2 MiB/s the commit runs for seconds.
    qemu_io(&uri, &["write -P 0x61 0 24M", "flush"]);
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x62 2M 1M", "write -P 0x63 28M 512k", "flush"]);
    let flushed = read_export(&dir, &uri, "flushed.raw");
    let said = ctl_ok(&control, &["commit", "disk", "--bps", "2M"]);
    let id = started(&said);
    job_until(&control, id, |j| j["done"].as_u64() >= Some(4 << 20));
    let st = server.stop_with(libc::SIGKILL);
    assert!(!st.success());

    // The chain opens with qemu-img, is clean, and reads what the client had flushed.
    assert_eq!(qemu_chain(&top), [top.to_str().unwrap(), mid.to_str().unwrap(), base.to_str().unwrap()]);
    for f in [&top, &mid] {
        run("qemu-img", &["check", f.to_str().unwrap()]);
    }
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, &flushed).unwrap();
    assert_qemu_reads(&top, &guest);

    // Served again, commit again finishes.
    let (server, control) = serve_ctl(&dir, top.to_str().unwrap(), &[]);
    assert_same("served again after the kill", &read_export(&dir, &server.uri("top"), "again.raw"), &flushed);
    let said = ctl_ok(&control, &["commit", "top", "--wait"]);
    assert!(said.contains("done"), "{said}");
    assert_same("after commit again", &read_export(&dir, &server.uri("top"), "after.raw"), &flushed);
    server.stop();
    assert_eq!(qemu_chain(&top), [top.to_str().unwrap(), base.to_str().unwrap()]);
    assert_qemu_reads(&top, &guest);
    run("qemu-img", &["check", top.to_str().unwrap()]);
}

#[test]
fn commit_between_inner_layers_into_a_qcow2_base_merges_data_and_zeros() {
    let dir = TempDir::new("jobs-commit-inner");
    let base = dir.path("disk.raw");
    make_base(&base, 16 * MIB, 17);
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &[]);
    let uri = server.uri("disk");
    let (a, b, c) = (dir.path("a.qcow2"), dir.path("b.qcow2"), dir.path("c.qcow2"));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", a.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x71 1M 1M", "flush"]);
    ctl_ok(&control, &["snapshot", "disk", "--overlay", b.to_str().unwrap()]);
    // b holds data, and zeros over what a holds (a zero cluster in b).
    qemu_io(&uri, &["write -P 0x72 3M 2M", "write -z 1M 128k", "write -z 12M 64k", "flush"]);
    ctl_ok(&control, &["snapshot", "disk", "--overlay", c.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x73 4M 64k", "flush"]);
    let want = read_export(&dir, &uri, "want.raw");
    let said =
        ctl_ok(&control, &["commit", "disk", "--top", b.to_str().unwrap(), "--base", a.to_str().unwrap(), "--wait"]);
    assert!(said.contains("done"), "{said}");
    assert_same("served after the commit", &read_export(&dir, &uri, "after.raw"), &want);
    qemu_io(&uri, &["write -P 0x74 6M 64k", "flush"]);
    let want = read_export(&dir, &uri, "want2.raw");
    server.stop();
    let files = [c.to_str().unwrap(), a.to_str().unwrap(), base.to_str().unwrap()];
    assert_eq!(qemu_chain(&c), files, "b left the chain: c <- a <- base");
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, &want).unwrap();
    assert_qemu_reads(&c, &guest);
    for f in [&c, &a] {
        run("qemu-img", &["check", f.to_str().unwrap()]);
    }
}

#[test]
fn a_stream_whose_export_is_removed_fails_and_changes_nothing() {
    let dir = TempDir::new("jobs-removed");
    let base = dir.path("disk.raw");
    make_base(&base, 16 * MIB, 19);
    let (server, control) = serve_ctl(&dir, base.to_str().unwrap(), &[]);
    let top = dir.path("top.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&server.uri("disk"), &["write -P 0x35 8M 256k", "flush"]);
    let before = read_export(&dir, &server.uri("disk"), "before.raw");
    let id = started(&ctl_ok(&control, &["stream", "disk", "--bps", "1M"]));
    job_until(&control, id, |j| j["done"].as_u64() > Some(0));
    ctl_ok(&control, &["remove", "disk", "--hard"]);
    let failed = job_until(&control, id, |j| j["state"] != "running");
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed["error"].as_str().unwrap().contains("was removed"), "{failed}");
    // The top still names its backing file and the chain reads the same.
    ctl_ok(&control, &["add", top.to_str().unwrap()]);
    assert_same("the chain added again", &read_export(&dir, &server.uri("top"), "again.raw"), &before);
    server.stop();
    assert_eq!(qemu_chain(&top), [top.to_str().unwrap(), base.to_str().unwrap()]);
    run("qemu-img", &["check", top.to_str().unwrap()]);
}
