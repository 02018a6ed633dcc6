//! `vdisk ctl` as the tests use it: a server with a control socket, verbs
//! that must succeed or be refused, the job table, fio write-and-verify
//! rounds to run beside a job, and a dirty bitmap as nbdinfo and qemu-img
//! read it.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{fio_randwrite_verify, json, nbdinfo_map, run, s, text, vdisk, Server, TempDir};

/// `vdisk serve IMG --control DIR/ctl.sock EXTRA...`; the server and its control socket.
pub fn serve_ctl(dir: &TempDir, img: &str, extra: &[&str]) -> (Server, PathBuf) {
    let control = dir.path("ctl.sock");
    let mut args = vec![img, "--control", s(&control)];
    args.extend_from_slice(extra);
    (Server::start(dir, &args), control)
}

/// `vdisk ctl --control CONTROL ARGS...`.
pub fn ctl(control: &Path, args: &[&str]) -> Output {
    let mut all = vec!["ctl", "--control", s(control)];
    all.extend_from_slice(args);
    vdisk(&all)
}

/// `vdisk ctl ARGS` that must succeed; its standard output.
pub fn ctl_ok(control: &Path, args: &[&str]) -> String {
    let out = ctl(control, args);
    assert!(out.status.success(), "vdisk ctl {args:?} failed:\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `vdisk ctl ARGS` that must be refused (exit 1) with `what` in its message.
pub fn ctl_refused(control: &Path, args: &[&str], what: &str) {
    let out = ctl(control, args);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "vdisk ctl {args:?} should be refused:\n{t}");
    assert!(t.contains(what), "vdisk ctl {args:?}: {what:?} not in:\n{t}");
}

/// fio write-and-verify rounds on `uri` until `stop` (at least one); panics on any error.
pub fn fio_until(dir: PathBuf, uri: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut rounds = 0;
        while rounds == 0 || !stop.load(Ordering::SeqCst) {
            fio_randwrite_verify(&dir, &uri, "disk");
            rounds += 1;
        }
        rounds
    })
}

/// The job `id` as `vdisk ctl jobs --json` lists it.
pub fn job(control: &Path, id: u64) -> serde_json::Value {
    let all = json(&ctl_ok(control, &["jobs", "--json"]));
    all.as_array().unwrap().iter().find(|j| j["id"] == id).cloned().unwrap_or_else(|| panic!("no job {id}: {all}"))
}

/// Waits (at most 60 s) until job `id` satisfies `ok`; returns it.
pub fn job_until(control: &Path, id: u64, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let j = job(control, id);
        if ok(&j) {
            return j;
        }
        assert!(Instant::now() < until, "job {id} did not get there within 60 s: {j}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Dirty runs of `nbdinfo --map=qemu:dirty-bitmap:B`.
pub fn nbdinfo_dirty(uri: &str, b: &str) -> Vec<(u64, u64)> {
    nbdinfo_map(uri, &format!("qemu:dirty-bitmap:{b}"))
        .into_iter()
        .filter(|r| r.2 & 1 == 1)
        .map(|r| (r.0, r.1))
        .collect()
}

/// Dirty runs as qemu's NBD client sees them: with x-dirty-bitmap, a dirty
/// run reads as "data": false (its flag 1 taken as NBD_STATE_HOLE).
pub fn qemu_img_dirty(socket: &Path, export: &str, b: &str) -> Vec<(u64, u64)> {
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export={export},x-dirty-bitmap=qemu:dirty-bitmap:{b}",
        socket.display()
    );
    let v = json(&run("qemu-img", &["map", "--output=json", "--image-opts", &opts]));
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for e in v.as_array().unwrap().iter().filter(|e| e["data"] == false) {
        let (o, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        match runs.last_mut() {
            Some((po, pl)) if *po + *pl == o => *pl += l,
            _ => runs.push((o, l)),
        }
    }
    runs
}
