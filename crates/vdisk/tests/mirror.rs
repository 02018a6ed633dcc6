//! Copy jobs against the real binary: `vdisk ctl mirror` to a raw and a qcow2
//! file with pivot, and to a second vdisk over NBD; cancel; active commit
//! (JSON-RPC `export_commit` with `active`) of a raw <- qcow2 <- qcow2 chain; all
//! under fio verify, checked after with qemu-img (compare, check, the
//! backing chain). A target on a full file system fails its job clearly and
//! the export serves on.

mod common;

use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::control::*;
use common::*;
use serde_json::json;

fn serve(dir: &TempDir, img: &str) -> (Server, PathBuf) {
    serve_on(dir, img, "uring")
}

fn serve_on(dir: &TempDir, img: &str, engine: &str) -> (Server, PathBuf) {
    serve_ctl(dir, img, &["--engine", engine])
}

/// Job `id` as `job_list` shows it.
fn job(control: &Path, id: u64) -> serde_json::Value {
    let list = rpc(control, "job_list", json!({}));
    let all = list["result"].as_array().unwrap_or_else(|| panic!("{list}")).clone();
    all.into_iter().find(|j| j["id"] == id).unwrap_or_else(|| panic!("no job {id} in {list}"))
}

/// Waits (at most a minute) until job `id` is in one of `states`; returns it.
fn wait_state(control: &Path, id: u64, states: &[&str]) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let j = job(control, id);
        if states.contains(&j["state"].as_str().unwrap_or_default()) {
            return j;
        }
        assert!(Instant::now() < deadline, "job {id} is not {states:?} after a minute: {j}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until ready job `id` has copied everything dirty (done == total, twice, the same).
fn wait_caught_up(control: &Path, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    loop {
        let j = job(control, id);
        assert_eq!(j["state"], "ready", "{j}");
        if j["done"] == j["total"] {
            if last.as_ref() == Some(&j["done"]) {
                return;
            }
            last = Some(j["done"].clone());
        } else {
            last = None;
        }
        assert!(Instant::now() < deadline, "job {id} did not catch up in a minute: {j}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn started_job(said: &serde_json::Value) -> u64 {
    said["result"]["job"].as_u64().unwrap_or_else(|| panic!("no job started: {said}"))
}

#[test]
fn mirror_with_pivot_under_fio_verify_to_raw_and_qcow2_on_each_engine() {
    for (format, engine) in [("raw", "uring"), ("qcow2", "threads")] {
        let dir = TempDir::new(&format!("mirror-pivot-{format}"));
        let img = dir.path("disk.img");
        make_base(&img, 32 * MIB, 5);
        let (server, control) = serve_on(&dir, img.to_str().unwrap(), engine);
        let target = dir.path(&format!("target.{format}"));
        let stop = Arc::new(AtomicBool::new(false));
        let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
        std::thread::sleep(Duration::from_millis(300));
        let said =
            ctl_ok(&control, &["mirror", "disk", "--to", target.to_str().unwrap(), "--format", format, "--pivot"]);
        assert!(said.contains("mirror job") && said.contains("pivots once ready"), "{said}");
        let jobs = json(&ctl_ok(&control, &["jobs", "--json"]));
        let id = jobs.as_array().unwrap().iter().find(|j| j["type"] == "mirror").unwrap()["id"].as_u64().unwrap();
        let j = wait_state(&control, id, &["done", "failed"]);
        assert_eq!(j["state"], "done", "{j}");
        // Every byte of the random base was copied at least once.
        assert!(j["done"].as_u64().unwrap() >= 32 * MIB as u64 && j["done"] == j["total"], "{j}");
        // The export serves from the target now, and fio goes on verifying through it.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::SeqCst);
        fio.join().expect("every fio verify passed");
        let list = json(&ctl_ok(&control, &["list", "--json"]));
        assert_eq!(list[0]["image"].as_str(), target.to_str(), "{list}");
        assert_eq!(list[0]["format"], format, "{list}");
        // Refusals: an existing target, a running-job clash is checked by the table.
        let out = ctl(&control, &["mirror", "disk", "--to", img.to_str().unwrap()]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"), "{}", text(&out));
        let guest = dir.path("guest.raw");
        std::fs::write(&guest, read_export(&dir, &server.uri("disk"), "view.raw")).unwrap();
        server.stop();
        let same =
            run("qemu-img", &["compare", "-f", format, "-F", "raw", target.to_str().unwrap(), guest.to_str().unwrap()]);
        assert!(same.contains("Images are identical"), "{same}");
        if format == "qcow2" {
            run("qemu-img", &["check", target.to_str().unwrap()]);
            let info = run("qemu-img", &["info", target.to_str().unwrap()]);
            assert!(!info.contains("backing file"), "{info}");
        }
    }
}

#[test]
fn cancel_leaves_the_export_on_its_image_with_its_data() {
    let dir = TempDir::new("mirror-cancel");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 9);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    let target = dir.path("copy.raw");
    let said = rpc(&control, "export_mirror", json!({"name": "disk", "to": target}));
    let id = started_job(&said);
    wait_state(&control, id, &["ready"]);
    let pivot_early = rpc(&control, "job_pivot", json!({"id": id + 100}));
    assert!(refused(&pivot_early).contains("no job"), "{pivot_early}");
    // Writes while ready are copied too: once caught up, the target is the disk.
    qemu_io(&uri, &["write -P 0x5a 1M 192k", "write -z 4M 1M", "flush"]);
    wait_caught_up(&control, id);
    let view = read_export(&dir, &uri, "view.raw");
    assert_same("the target once caught up", &read_file(&target), &view);
    let c = rpc(&control, "job_cancel", json!({"id": id}));
    assert!(c.get("result").is_some(), "{c}");
    let j = wait_state(&control, id, &["cancelled", "failed"]);
    assert_eq!(j["state"], "cancelled", "{j}");
    // The export is where it was, and writes after the cancel are not mirrored.
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), img.to_str(), "{list}");
    qemu_io(&uri, &["write -P 0x77 0 64k", "flush"]);
    let after = read_export(&dir, &uri, "after.raw");
    assert_ne!(after, view);
    assert_same("the target after the cancel", &read_file(&target), &view);
    let again = rpc(&control, "job_cancel", json!({"id": id}));
    assert!(refused(&again).contains("has ended"), "{again}");
    server.stop();
    assert_same("the export's own image", &read_file(&img), &after);
}

#[test]
fn active_commit_of_the_top_under_fio_verify() {
    for (base_name, delete) in [("disk.img", false), ("middle.qcow2", true)] {
        let dir = TempDir::new(&format!("active-commit-{delete}"));
        let img = dir.path("disk.img");
        make_base(&img, 32 * MIB, 13);
        let (server, control) = serve(&dir, img.to_str().unwrap());
        let (middle, top) = (dir.path("middle.qcow2"), dir.path("top.qcow2"));
        let stop = Arc::new(AtomicBool::new(false));
        let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
        std::thread::sleep(Duration::from_millis(200));
        // Each layer holds writes of its own (beyond fio's 16 MiB, which may be verifying).
        let uri = server.uri("disk");
        ctl_ok(&control, &["snapshot", "disk", "--overlay", middle.to_str().unwrap()]);
        qemu_io(&uri, &["write -P 0x31 20M 1M", "write -z 30M 512k"]);
        std::thread::sleep(Duration::from_millis(300));
        ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
        qemu_io(&uri, &["write -P 0x32 20M 64k", "write -P 0x33 24M 1M"]);
        std::thread::sleep(Duration::from_millis(300));
        let base = dir.path(base_name);
        let params = if delete {
            json!({"name": "disk", "active": true, "base": base, "delete": true})
        } else {
            json!({"name": "disk", "active": true})
        };
        let said = rpc(&control, "export_commit", params);
        let id = started_job(&said);
        let j = wait_state(&control, id, &["done", "failed"]);
        assert_eq!(j["state"], "done", "{j}");
        assert_eq!(j["type"], "commit", "{j}");
        assert!(j["done"].as_u64().unwrap() > 0, "fio's writes above the base were copied: {j}");
        std::thread::sleep(Duration::from_millis(400));
        stop.store(true, Ordering::SeqCst);
        fio.join().expect("every fio verify passed");
        let list = json(&ctl_ok(&control, &["list", "--json"]));
        assert_eq!(list[0]["image"].as_str(), base.to_str(), "{list}");
        let guest = dir.path("guest.raw");
        std::fs::write(&guest, read_export(&dir, &server.uri("disk"), "view.raw")).unwrap();
        server.stop();
        let chain = run("qemu-img", &["info", "--backing-chain", base.to_str().unwrap()]);
        let files: Vec<&str> = chain.lines().filter_map(|l| l.strip_prefix("image: ")).collect();
        let fmt = if delete { "qcow2" } else { "raw" };
        if delete {
            assert_eq!(files, [middle.to_str().unwrap(), img.to_str().unwrap()], "{chain}");
            assert!(!top.exists(), "--delete removes the committed top");
            run("qemu-img", &["check", middle.to_str().unwrap()]);
        } else {
            assert_eq!(files, [img.to_str().unwrap()], "{chain}");
            assert!(top.exists() && middle.exists(), "without --delete the layers are left");
        }
        let same =
            run("qemu-img", &["compare", "-f", fmt, "-F", "raw", base.to_str().unwrap(), guest.to_str().unwrap()]);
        assert!(same.contains("Images are identical"), "{same}");
    }
}

#[test]
fn active_commit_refusals_change_nothing() {
    let dir = TempDir::new("active-commit-refused");
    let img = dir.path("disk.img");
    make_base(&img, 4 * MIB, 2);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let r = rpc(&control, "export_commit", json!({"active": true, "name": "disk"}));
    assert!(refused(&r).contains("nothing to commit"), "{r}");
    let top = dir.path("top.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    let r = rpc(&control, "export_commit", json!({"active": true, "name": "disk", "base": top}));
    assert!(refused(&r).contains("is the top itself"), "{r}");
    let other = dir.path("other.img");
    make_base(&other, MIB, 1);
    let r = rpc(&control, "export_commit", json!({"active": true, "name": "disk", "base": other}));
    assert!(refused(&r).contains("is not in the export's chain"), "{r}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), top.to_str(), "{list}");
    server.stop();
}

/// A second vdisk serving `far.img`, a new raw file of `size` bytes, as
/// export "far" (with `extra` arguments): its directory, file and server.
fn second_vdisk(tag: &str, size: usize, extra: &[&str]) -> (TempDir, PathBuf, Server) {
    let far_dir = TempDir::new(tag);
    let far = far_dir.path("far.img");
    std::fs::File::create(&far).unwrap().set_len(size as u64).unwrap();
    let mut args = vec![far.to_str().unwrap()];
    args.extend_from_slice(extra);
    let second = Server::start(&far_dir, &args);
    (far_dir, far, second)
}

#[test]
fn mirror_to_a_second_vdisk_over_nbd() {
    let dir = TempDir::new("mirror-nbd");
    let img = dir.path("disk.img");
    make_base(&img, 32 * MIB, 21);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    // The second vdisk: a new raw file of the same size, on TCP.
    let addr = format!("127.0.0.1:{}", free_port());
    let (far_dir, far, second) = second_vdisk("mirror-nbd-far", 32 * MIB, &["--listen", &addr]);
    let to = format!("nbd://{addr}/far");
    let out = ctl(&control, &["mirror", "disk", "--to", &to, "--format", "qcow2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("applies to a new file only"), "{}", text(&out));
    let out = ctl(&control, &["mirror", "disk", "--to", &format!("nbd://{addr}/nope")]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such export"), "{}", text(&out));
    let stop = Arc::new(AtomicBool::new(false));
    let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let said = ctl_ok(&control, &["mirror", "disk", "--to", &to]);
    assert!(said.contains(&to), "{said}");
    let id = json(&ctl_ok(&control, &["jobs", "--json"])).as_array().unwrap().last().unwrap()["id"].as_u64().unwrap();
    wait_state(&control, id, &["ready"]);
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed");
    wait_caught_up(&control, id);
    let view = read_export(&dir, &server.uri("disk"), "view.raw");
    let c = rpc(&control, "job_cancel", json!({"id": id}));
    assert!(c.get("result").is_some(), "{c}");
    assert_eq!(wait_state(&control, id, &["cancelled", "failed"])["state"], "cancelled");
    let copied = read_export(&far_dir, &second.uri("far"), "far-view.raw");
    assert_same("the NBD target", &copied, &view);
    let same = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", far.to_str().unwrap(), img.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");

    // Again with --pivot, under fio verify: from then on the export is served from the second vdisk.
    let fio = fio_until(dir.0.clone(), server.uri("disk"), stop.clone());
    stop.store(false, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(300));
    let said = ctl_ok(&control, &["mirror", "disk", "--to", &to, "--pivot", "--wait"]);
    assert!(said.contains("done"), "{said}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!((list[0]["image"].as_str(), list[0]["format"].as_str()), (Some(to.as_str()), Some("nbd")), "{list}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed, through the pivot onto NBD");
    // Writes go to the second vdisk; the first one's file is left as it was at the pivot.
    qemu_io(&server.uri("disk"), &["write -P 0x6b 3M 64k"]);
    let served = read_export(&dir, &server.uri("disk"), "served.raw");
    assert_same("the second vdisk", &read_export(&far_dir, &second.uri("far"), "far-after.raw"), &served);
    let out = ctl(&control, &["snapshot", "disk", "--overlay", dir.path("o.qcow2").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("served from the NBD export"), "{}", text(&out));
    // And back to a file of its own, with pivot.
    let home = dir.path("home.raw");
    ctl_ok(&control, &["mirror", "disk", "--to", home.to_str().unwrap(), "--pivot", "--wait"]);
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), home.to_str(), "{list}");
    server.stop();
    second.stop();
    assert_same("the file mirrored back", &read_file(&home), &served);
}

/// Another server's NBD export served as an image (`vdisk serve nbd://...`,
/// `vdisk ctl add nbd+unix://...`), as a pivot leaves one: so a daemon
/// restarted after a pivot onto NBD serves the same disk again.
#[test]
fn an_nbd_export_is_served_as_an_image() {
    let far_dir = TempDir::new("relay-far");
    let far = far_dir.path("far.img");
    make_base(&far, 16 * MIB, 23);
    let dir = TempDir::new("relay");
    let addr = format!("127.0.0.1:{}", free_port());
    let inside = dir.path("far.sock");
    let args = ["serve", s(&far), "--listen", &addr, "--socket", s(&inside)];
    let second = Server::spawn(&args, inside.clone());
    // Over TCP, named after the far export; with image roots, which bind only the control socket.
    let (relay, control) = serve_ctl(&dir, &format!("nbd://{addr}/far"), &["--image-root", s(&dir.0)]);
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!((list[0]["name"].as_str(), list[0]["format"].as_str()), (Some("far"), Some("nbd")), "{list}");
    let stop = Arc::new(AtomicBool::new(true));
    fio_until(dir.0.clone(), relay.uri("far"), stop).join().expect("fio verify through the relay");
    let via = read_export(&dir, &relay.uri("far"), "via.raw");
    assert_same("the far export read through the relay", &via, &read_export(&dir, &second.uri("far"), "far.raw"));
    // The control socket may add one only over a unix socket beneath the roots.
    let unix = |sock: &Path| format!("nbd+unix:///far?socket={}", sock.display());
    ctl_refused(&control, &["add", &format!("nbd://{addr}/far"), "--name", "tcp"], "only over a unix socket");
    ctl_refused(&control, &["add", &unix(&far_dir.path("x.sock")), "--name", "out"], "outside the image roots");
    ctl_ok(&control, &["add", &unix(&inside), "--name", "unix", "--readonly"]);
    assert_same("the read-only relay", &read_export(&dir, &relay.uri("unix"), "unix.raw"), &via);
    let out = output("qemu-io", &["-f", "raw", "-c", "write 0 4k", &relay.uri("unix")]);
    assert!(!out.status.success() && text(&out).contains("Permission denied"), "{}", text(&out));
    // Jobs that would write a chain beneath it are refused; a mirror away works.
    ctl_refused(&control, &["snapshot", "far", "--overlay", s(&dir.path("o.qcow2"))], "served from the NBD export");
    ctl_refused(&control, &["stream", "far"], "its top is nbd");
    let home = dir.path("home.raw");
    ctl_ok(&control, &["mirror", "far", "--to", s(&home), "--pivot", "--wait"]);
    relay.stop();
    second.stop();
    assert_same("the file mirrored home", &read_file(&home), &via);
}

/// A tmpfs of `size` mounted on `dir`, unmounted when dropped.
struct Mounted(PathBuf);

impl Mounted {
    fn tmpfs(dir: &Path, size: &str) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        let opts = format!("size={size}");
        let out = output("mount", &["-t", "tmpfs", "-o", &opts, "tmpfs", dir.to_str().unwrap()]);
        assert!(out.status.success(), "cannot mount a tmpfs for the full-target test (root needed):\n{}", text(&out));
        Mounted(dir.to_owned())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = output("umount", &[self.0.to_str().unwrap()]);
    }
}

#[test]
fn a_target_on_a_full_file_system_fails_the_job_and_the_export_serves_on() {
    let dir = TempDir::new("mirror-enospc");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 17);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    let full = Mounted::tmpfs(&dir.path("small"), "2M");
    let target = full.0.join("copy.raw");
    let said = rpc(&control, "export_mirror", json!({"name": "disk", "to": target, "pivot": true}));
    let id = started_job(&said);
    let j = wait_state(&control, id, &["failed", "done"]);
    assert_eq!(j["state"], "failed", "{j}");
    let e = j["error"].as_str().unwrap();
    assert!(e.contains("copy.raw") && e.contains("No space left") && e.contains("serves on unchanged"), "{j}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), img.to_str(), "{list}");
    qemu_io(&uri, &["write -P 0x3c 2M 256k", "read -P 0x3c 2M 256k"]);
    let view = read_export(&dir, &uri, "view.raw");
    // The export has no job now: a new one can start (and is refused on the full target for the file).
    let again = rpc(&control, "export_mirror", json!({"name": "disk", "to": target}));
    assert!(refused(&again).contains("exists already"), "{again}");
    server.stop();
    drop(full);
    assert_same("the export's image", &read_file(&img), &view);
}

#[test]
fn mirror_into_an_existing_file_writes_the_zeros_too() {
    let dir = TempDir::new("mirror-existing");
    // A sparse source: data in places, holes elsewhere.
    let img = dir.path("disk.img");
    std::fs::File::create(&img).unwrap().set_len(8 * MIB as u64).unwrap();
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    qemu_io(&uri, &["write -P 0x21 0 100k", "write -P 0x42 3M 1M", "flush"]);
    // The existing target holds other bytes everywhere.
    let target = dir.path("old.raw");
    std::fs::write(&target, vec![0xeeu8; 8 * MIB]).unwrap();
    let out = ctl(&control, &["mirror", "disk", "--to", target.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--existing"), "{}", text(&out));
    let short = dir.path("short.raw");
    std::fs::write(&short, vec![0u8; MIB]).unwrap();
    let out = ctl(&control, &["mirror", "disk", "--to", short.to_str().unwrap(), "--existing"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("same size"), "{}", text(&out));
    let out = ctl(&control, &["mirror", "disk", "--to", img.to_str().unwrap(), "--existing"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("a file of the image the export serves"), "{}", text(&out));
    let said = ctl_ok(&control, &["mirror", "disk", "--to", target.to_str().unwrap(), "--existing", "--bps", "16M"]);
    assert!(said.contains("started"), "{said}");
    let id = json(&ctl_ok(&control, &["jobs", "--json"])).as_array().unwrap().last().unwrap()["id"].as_u64().unwrap();
    // One job per export: a second mirror waits for this one.
    let other = dir.path("other.raw");
    let out = ctl(&control, &["mirror", "disk", "--to", other.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("running job"), "{}", text(&out));
    assert!(!other.exists(), "a refused mirror makes no file");
    wait_state(&control, id, &["ready"]);
    wait_caught_up(&control, id);
    let view = read_export(&dir, &uri, "view.raw");
    assert_same("the existing target", &read_file(&target), &view);
    let c = rpc(&control, "job_cancel", json!({"id": id}));
    assert!(c.get("result").is_some(), "{c}");
    wait_state(&control, id, &["cancelled"]);
    server.stop();
}

#[test]
fn a_server_killed_in_the_middle_of_an_active_commit_leaves_a_chain_that_reads_the_same() {
    let dir = TempDir::new("active-commit-kill");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 29);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    let (middle, top) = (dir.path("middle.qcow2"), dir.path("top.qcow2"));
    ctl_ok(&control, &["snapshot", "disk", "--overlay", middle.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x61 0 3M", "flush"]);
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x62 1M 6M", "write -z 9M 1M", "flush"]);
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, read_export(&dir, &uri, "view.raw")).unwrap();
    // A slow job (1 MiB/s over about 7 MiB), killed once it has copied some.
    let said = rpc(&control, "export_commit", json!({"active": true, "name": "disk", "base": middle, "bps": MIB}));
    let id = started_job(&said);
    let deadline = Instant::now() + Duration::from_secs(30);
    while job(&control, id)["done"].as_u64().unwrap() < 2 * MIB as u64 {
        assert!(Instant::now() < deadline, "the job copied nothing: {}", job(&control, id));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(job(&control, id)["state"], "running");
    server.stop_with(libc::SIGKILL);
    // The chain is the one the job started from, and reads as the guest saw it.
    let chain = run("qemu-img", &["info", "--backing-chain", top.to_str().unwrap()]);
    let files: Vec<&str> = chain.lines().filter_map(|l| l.strip_prefix("image: ")).collect();
    assert_eq!(files, [top.to_str().unwrap(), middle.to_str().unwrap(), img.to_str().unwrap()], "{chain}");
    for layer in [&top, &middle] {
        let out = output("qemu-img", &["check", layer.to_str().unwrap()]);
        let said = text(&out);
        // 0: clean; 3: leaked clusters only (space, never data).
        assert!(matches!(out.status.code(), Some(0) | Some(3)) && !said.contains("ERROR"), "{said}");
    }
    let same = run("qemu-img", &["compare", "-F", "raw", top.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
    // And the commit can start again on the chain served anew.
    let (server, control) = serve(&dir, top.to_str().unwrap());
    let id = started_job(&rpc(&control, "export_commit", json!({"active": true, "name": "top", "base": middle})));
    assert_eq!(wait_state(&control, id, &["done", "failed"])["state"], "done");
    let after = read_export(&dir, &server.uri("top"), "after.raw");
    assert_same("the chain after the commit", &after, &read_file(&guest));
    server.stop();
    let same = run("qemu-img", &["compare", "-F", "raw", middle.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
}

#[test]
fn job_pivot_switches_a_ready_mirror_and_is_refused_before() {
    let dir = TempDir::new("mirror-job-pivot");
    let img = dir.path("disk.img");
    make_base(&img, 8 * MIB, 31);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    // The source is a chain (raw <- qcow2): what the base holds is copied too.
    let top = dir.path("top.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", top.to_str().unwrap()]);
    qemu_io(&uri, &["write -P 0x97 2M 1M", "flush"]);
    let out = ctl(&control, &["mirror", "disk", "--to", img.to_str().unwrap(), "--existing"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("a file of the image"), "the backing file: {}", text(&out));
    let target = dir.path("next.qcow2");
    // 2 MiB/s over 8 MiB: running for a while, so a pivot comes too early.
    let said = rpc(&control, "export_mirror", json!({"name": "disk", "to": target, "format": "qcow2", "bps": 2 * MIB}));
    let id = started_job(&said);
    let early = rpc(&control, "job_pivot", json!({"id": id}));
    assert!(refused(&early).contains("not ready"), "{early}");
    wait_state(&control, id, &["ready"]);
    qemu_io(&uri, &["write -P 0x99 5M 64k"]);
    let p = rpc(&control, "job_pivot", json!({"id": id}));
    assert!(p.get("result").is_some(), "{p}");
    assert_eq!(wait_state(&control, id, &["done", "failed"])["state"], "done");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!((list[0]["image"].as_str(), list[0]["format"].as_str()), (target.to_str(), Some("qcow2")), "{list}");
    qemu_io(&uri, &["read -P 0x99 5M 64k", "write -P 0x98 0 4k", "flush"]);
    let view = read_export(&dir, &uri, "view.raw");
    server.stop();
    let guest = dir.path("guest.raw");
    std::fs::write(&guest, &view).unwrap();
    let same =
        run("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", target.to_str().unwrap(), guest.to_str().unwrap()]);
    assert!(same.contains("Images are identical"), "{same}");
    run("qemu-img", &["check", target.to_str().unwrap()]);
    let info = run("qemu-img", &["info", target.to_str().unwrap()]);
    assert!(!info.contains("backing file"), "{info}");
}

#[test]
fn an_nbd_target_that_goes_away_or_a_removed_export_fails_the_job_clearly() {
    let dir = TempDir::new("mirror-gone");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 37);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    let (_far_dir, _far, second) = second_vdisk("mirror-gone-far", 16 * MIB, &[]);
    let to = second.uri("far");
    // Slow (1 MiB/s over 16 MiB): the target goes while the job copies.
    let id = started_job(&rpc(&control, "export_mirror", json!({"name": "disk", "to": to, "bps": MIB})));
    std::thread::sleep(Duration::from_millis(700));
    second.stop_with(libc::SIGKILL);
    let j = wait_state(&control, id, &["failed", "done", "cancelled"]);
    assert_eq!(j["state"], "failed", "{j}");
    let e = j["error"].as_str().unwrap();
    assert!(e.contains(&to) && e.contains("serves on unchanged"), "{j}");
    qemu_io(&uri, &["write -P 0x44 1M 64k", "read -P 0x44 1M 64k"]);
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), img.to_str(), "{list}");

    // An export removed while its mirror runs: the job fails, the server goes on.
    let target = dir.path("copy.raw");
    let id = started_job(&rpc(&control, "export_mirror", json!({"name": "disk", "to": target, "bps": MIB})));
    std::thread::sleep(Duration::from_millis(300));
    ctl_ok(&control, &["remove", "disk"]);
    let j = wait_state(&control, id, &["failed", "done", "cancelled"]);
    assert!(j["state"] == "failed" && j["error"].as_str().unwrap().contains("removed"), "{j}");
    ctl_ok(&control, &["add", img.to_str().unwrap()]);
    qemu_io(&uri, &["read -P 0x44 1M 64k"]);
    server.stop();
}

#[test]
fn active_commit_of_a_cow_overlay_into_its_raw_base() {
    let dir = TempDir::new("active-commit-cow");
    let img = dir.path("disk.img");
    make_base(&img, 8 * MIB, 41);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let uri = server.uri("disk");
    let cow = dir.path("top.cow");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", cow.to_str().unwrap(), "--format", "cow"]);
    qemu_io(&uri, &["write -P 0x51 1000 5000", "write -P 0x52 6M 700k", "write -z 7M 64k", "flush"]);
    let view = read_export(&dir, &uri, "view.raw");
    let id = started_job(&rpc(&control, "export_commit", json!({"active": true, "name": "disk", "delete": true})));
    let j = wait_state(&control, id, &["done", "failed"]);
    assert_eq!(j["state"], "done", "{j}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!((list[0]["image"].as_str(), list[0]["format"].as_str()), (img.to_str(), Some("raw")), "{list}");
    assert!(!cow.exists(), "--delete removed the overlay");
    qemu_io(&uri, &["write -P 0x53 0 4k", "flush"]);
    let after = read_export(&dir, &uri, "after.raw");
    server.stop();
    assert_same("the base after the commit", &read_file(&img), &after);
    assert_same("what the commit kept", &after[4096..], &view[4096..]);
}

/// fio writing 4K at random over the whole export at queue depth 32, for at
/// most a minute (the test stops it sooner with SIGINT).
fn full_speed_writer(dir: &TempDir, uri: &str) -> std::process::Child {
    std::process::Command::new("fio")
        .args(["--name=writer", "--ioengine=nbd", &format!("--uri={uri}"), "--rw=randwrite", "--bs=4k"])
        .args(["--iodepth=32", "--time_based", "--runtime=60", "--randrepeat=0"])
        .current_dir(&dir.0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("fio runs")
}

/// Stops `fio` with SIGINT (it finishes what is in flight) and checks it wrote without error.
fn stop_writer(fio: std::process::Child) {
    common::logged::signal(fio.id() as i32, libc::SIGINT);
    let out = fio.wait_with_output().unwrap();
    let all = text(&out);
    assert!(all.contains("err= 0") && all.contains("write: IOPS"), "the writer failed:\n{all}");
}

/// Against a guest writing at full speed, a mirror's passes never catch up;
/// then the guest's writes wait for the target (the job says
/// `synchronous`) and the job gets ready while the guest still writes.
/// Once the writer stops, the target holds every acknowledged write (it
/// equals the export's view with no copy pending) and the pivot switches to it.
#[test]
fn a_mirror_converges_against_a_full_speed_writer_by_holding_its_writes() {
    let dir = TempDir::new("mirror-sync");
    let img = dir.path("disk.img");
    make_base(&img, 64 * MIB, 31);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let fio = full_speed_writer(&dir, &server.uri("disk"));
    std::thread::sleep(Duration::from_millis(500));
    let target = dir.path("target.raw");
    let id = started_job(&rpc(&control, "export_mirror", json!({"name": "disk", "to": target})));
    let j = wait_state(&control, id, &["ready", "failed"]);
    assert_eq!(j["state"], "ready", "{j}");
    assert_eq!(j["synchronous"], true, "a ready mirror holds the guest's writes: {j}");
    let table = ctl_ok(&control, &["jobs"]);
    assert!(table.contains("ready, sync"), "{table}");
    // Still ready (no pass falls behind) while the guest goes on writing.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(job(&control, id)["state"], "ready");
    stop_writer(fio);
    let view = read_export(&dir, &server.uri("disk"), "view.raw");
    assert_same("the target while the mirror is ready", &read_file(&target), &view);
    let p = rpc(&control, "job_pivot", json!({"id": id}));
    assert!(p.get("result").is_some(), "{p}");
    let j = wait_state(&control, id, &["done", "failed"]);
    assert_eq!((j["state"].as_str(), j["synchronous"].as_bool()), (Some("done"), Some(false)), "{j}");
    let list = json(&ctl_ok(&control, &["list", "--json"]));
    assert_eq!(list[0]["image"].as_str(), target.to_str(), "{list}");
    assert_same("the export after the pivot", &read_export(&dir, &server.uri("disk"), "after.raw"), &view);
    server.stop();
}

/// A synchronous mirror whose NBD target stops answering (its server is
/// stopped) holds a guest's write for at most 5 s: then writes stop
/// waiting for the target, the job says so (not synchronous), and once the
/// target answers again the job goes on; cancelled once ready, the target
/// equals the disk.
#[test]
fn a_target_that_stops_answering_does_not_hold_the_guests_writes() {
    let dir = TempDir::new("mirror-sync-stuck");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 33);
    let (server, control) = serve(&dir, img.to_str().unwrap());
    let (far_dir, _far, second) = second_vdisk("mirror-sync-stuck-far", 16 * MIB, &[]);
    let id = started_job(&rpc(&control, "export_mirror", json!({"name": "disk", "to": second.uri("far")})));
    let j = wait_state(&control, id, &["ready", "failed"]);
    assert_eq!((j["state"].as_str(), j["synchronous"].as_bool()), (Some("ready"), Some(true)), "{j}");
    let pid = second.child.id() as i32;
    common::logged::signal(pid, libc::SIGSTOP);
    let started = Instant::now();
    let out = output("qemu-io", &["-f", "raw", &server.uri("disk"), "-c", "write -P 0x5a 1M 64k"]);
    let took = started.elapsed();
    common::logged::signal(pid, libc::SIGCONT);
    assert!(out.status.success() && !text(&out).contains("failed"), "{}", text(&out));
    assert!(took < Duration::from_secs(30), "the write took {took:?}");
    // The job's thread sees it once its write to the target returns.
    let j = job_until(&control, id, |j| j["synchronous"] == false || j["state"] != "ready");
    assert_eq!((j["state"].as_str(), j["synchronous"].as_bool()), (Some("ready"), Some(false)), "{j}");
    // The target answers again: the job catches up in the background, and a cancel sweeps the rest.
    wait_state(&control, id, &["ready"]);
    wait_caught_up(&control, id);
    let view = read_export(&dir, &server.uri("disk"), "view.raw");
    let c = rpc(&control, "job_cancel", json!({"id": id}));
    assert!(c.get("result").is_some(), "{c}");
    assert_eq!(wait_state(&control, id, &["cancelled", "failed"])["state"], "cancelled");
    assert_same("the NBD target", &read_export(&far_dir, &second.uri("far"), "far.raw"), &view);
    server.stop();
    second.stop();
}

/// An export pivoted onto an NBD export whose server then stops answering
/// waits for it alone: another export on the same I/O core thread
/// (`--io-threads 1`) serves on, and the stalled write completes once the
/// server is continued.
#[test]
fn an_export_served_from_a_stopped_nbd_server_does_not_hold_up_the_others() {
    let dir = TempDir::new("mirror-pivot-stall");
    let img = dir.path("disk.img");
    make_base(&img, 16 * MIB, 45);
    let other = dir.path("other.img");
    make_base(&other, 4 * MIB, 46);
    let (server, control) = serve_ctl(&dir, img.to_str().unwrap(), &[other.to_str().unwrap(), "--io-threads", "1"]);
    let (_far_dir, far, second) = second_vdisk("mirror-pivot-stall-far", 16 * MIB, &[]);
    ctl_ok(&control, &["mirror", "disk", "--to", &second.uri("far"), "--pivot", "--wait"]);
    let pid = second.child.id() as i32;
    common::logged::signal(pid, libc::SIGSTOP);
    let uri = server.uri("disk");
    let stalled = std::thread::spawn(move || qemu_io(&uri, &["write -P 0x3e 0 64k", "flush"]));
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    qemu_io(&server.uri("other"), &["write -P 0x3f 0 64k", "read -P 0x3f 0 64k", "flush"]);
    let took = started.elapsed();
    assert!(!stalled.is_finished(), "the write to the stopped server's export did not wait for it");
    common::logged::signal(pid, libc::SIGCONT);
    stalled.join().expect("the stalled write completes once the server answers");
    assert!(took < Duration::from_secs(20), "the other export waited {took:?}");
    server.stop();
    second.stop();
    let mut want = base_data(16 * MIB, 45);
    want[..65536].fill(0x3e);
    assert_same("the far export", &read_file(&far), &want);
}
