//! `vdisk ctl snapshot`: live snapshots of a served disk while fio writes
//! and verifies through it, checked afterwards with qemu-img (the chain it
//! reads, the guest's data, clean overlays), and the refusals that change
//! nothing.

mod common;

use std::path::PathBuf;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::control::*;
use common::*;

/// `vdisk serve IMAGE --control` over `img` (the uring engine): its export is the file's stem.
fn serve(dir: &TempDir, img: &str) -> (Server, PathBuf) {
    serve_on(dir, img, "uring")
}

fn serve_on(dir: &TempDir, img: &str, engine: &str) -> (Server, PathBuf) {
    serve_ctl(dir, img, &["--engine", engine])
}

#[test]
fn snapshots_twice_under_fio_verify_make_a_chain_qemu_reads() {
    for engine in ENGINES {
        snapshots_twice(engine);
    }
}

fn snapshots_twice(engine: &str) {
    let dir = TempDir::new(&format!("snapshot-{engine}"));
    let img = dir.path("disk.img");
    make_base(&img, 32 * MIB, 7);
    let (server, control) = serve_on(&dir, img.to_str().unwrap(), engine);
    let (middle, top) = (dir.path("middle.qcow2"), dir.path("top.qcow2"));
    let stop = Arc::new(AtomicBool::new(false));
    let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let said = ctl_ok(&control, &["snapshot", "disk", "--overlay", middle.to_str().unwrap()]);
    assert!(said.contains("middle.qcow2 (qcow2) over") && said.contains("disk.img (raw)"), "{said}");
    std::thread::sleep(Duration::from_millis(400));
    let said = ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap(), "--format", "qcow2"]);
    assert!(said.contains("top.qcow2 (qcow2) over") && said.contains("middle.qcow2 (qcow2)"), "{said}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let rounds = fio.join().expect("every fio verify passed");
    assert!(rounds >= 1);

    // The refusals change nothing: an overlay that exists, a COW over a qcow2 top.
    let out = ctl(&control, &["snapshot", "disk", "--overlay", middle.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"), "{}", text(&out));
    let cow = dir.path("x.cow");
    let out = ctl(&control, &["snapshot", "disk", "--overlay", cow.to_str().unwrap(), "--format", "cow"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be raw"), "{}", text(&out));
    assert!(!cow.exists());
    let out = ctl(&control, &["snapshot", "nope", "--overlay", cow.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let ro = dir.path("ro.img");
    make_base(&ro, MIB, 1);
    ctl_ok(&control, &["add", ro.to_str().unwrap(), "--readonly"]);
    let out = ctl(&control, &["snapshot", "ro", "--overlay", cow.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("read-only"), "{}", text(&out));
    assert!(!cow.exists());
    ctl_ok(&control, &["remove", "ro"]);

    // The job table: two done, one failed (the overlay that existed) and so on.
    let jobs = ctl_ok(&control, &["jobs"]);
    assert!(jobs.contains("ID") && jobs.contains("snapshot") && jobs.contains("done"), "{jobs}");
    let listed = json(&ctl_ok(&control, &["jobs", "--json"]));
    let states: Vec<&str> = listed.as_array().unwrap().iter().map(|j| j["state"].as_str().unwrap()).collect();
    assert_eq!(&states[..3], ["done", "done", "failed"], "{listed}");
    assert_eq!(states.len(), 6, "{listed}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), top.to_str(), "{list}");
    assert_eq!(list[0]["format"], "qcow2", "{list}");

    let guest = dir.path("guest.raw");
    std::fs::write(&guest, read_export(&dir, &server.uri("disk"), "view.raw")).unwrap();
    server.stop();

    let chain = run("qemu-img", &["info", "--backing-chain", top.to_str().unwrap()]);
    let files: Vec<&str> = chain.lines().filter_map(|l| l.strip_prefix("image: ")).collect();
    let want = [top.to_str().unwrap(), middle.to_str().unwrap(), img.to_str().unwrap()];
    assert_eq!(files, want, "qemu-img's chain:\n{chain}");
    let same = run("qemu-img", &["compare", "-F", "raw", top.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
    for overlay in [&top, &middle] {
        run("qemu-img", &["check", overlay.to_str().unwrap()]);
    }
}

#[test]
fn a_cow_snapshot_of_a_raw_export_keeps_the_base_as_it_was() {
    let dir = TempDir::new("snapshot-cow");
    let img = dir.path("base.img");
    let base = make_base(&img, 8 * MIB, 3);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("base");
    qemu_io(&uri, &["write -P 0x11 0 64k"]);
    let before = read_export(&dir, &uri, "before.raw");
    let overlay = dir.path("top.cow");
    ctl_ok(&control, &["snapshot", "base", "--overlay", overlay.to_str().unwrap(), "--format", "cow"]);
    qemu_io(&uri, &["write -P 0x22 1M 64k", "flush"]);
    let after = read_export(&dir, &uri, "after.raw");
    server.stop();
    // The base holds what was written before the snapshot, nothing after.
    assert_same("the base after the snapshot", &read_file(&img), &before);
    assert_ne!(before, base);
    // The overlay over it serves what the guest saw last.
    let (server, _) = serve(&dir, overlay.to_str().unwrap());
    assert_same("the COW chain served again", &read_export(&dir, &server.uri("top"), "again.raw"), &after);
    server.stop();
}

#[test]
fn stream_under_fio_verify_leaves_a_top_that_needs_no_backing() {
    let dir = TempDir::new("stream");
    let img = dir.path("base.img");
    make_base(&img, 32 * MIB, 11);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let top = dir.path("top.qcow2");
    let raw = ctl(&control, &["stream", "base"]);
    assert!(String::from_utf8_lossy(&raw.stderr).contains("only a qcow2 top"), "{}", text(&raw));
    ctl_ok(&control, &["snapshot", "base", "--overlay", top.to_str().unwrap()]);
    let stop = Arc::new(AtomicBool::new(false));
    let fio = fio_until(dir.0.clone(), server.uri("base"), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let said = ctl_ok(&control, &["stream", "base", "--wait"]);
    assert!(said.contains("(stream of export \"base\"): done") && said.contains("100.0%"), "{said}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed");
    let again = ctl(&control, &["stream", "base"]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("nothing to stream"), "{}", text(&again));
    let jobs = json(&ctl_ok(&control, &["jobs", "--json"]));
    let stream = jobs.as_array().unwrap().iter().find(|j| j["type"] == "stream" && j["state"] == "done").unwrap();
    assert_eq!(stream["done"], stream["total"], "{jobs}");
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, read_export(&dir, &server.uri("base"), "view.raw")).unwrap();
    server.stop();

    // The base can go: the top alone is the disk the guest saw.
    std::fs::rename(&img, dir.path("gone.img")).unwrap();
    let info = run("qemu-img", &["info", top.to_str().unwrap()]);
    assert!(!info.contains("backing file"), "{info}");
    let same = run("qemu-img", &["compare", "-F", "raw", top.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
    run("qemu-img", &["check", top.to_str().unwrap()]);
}
