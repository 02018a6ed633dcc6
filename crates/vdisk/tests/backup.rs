//! Point-in-time backup views (`vdisk ctl backup begin|end`, issue 26) end
//! to end with real clients:
//! - the README's "Backup and restore" blocks, extracted and run as written
//!   (paths substituted), so the README cannot drift;
//! - an incremental chain (full, incremental 1, incremental 2, each copying
//!   only the dirty extents of the view's `qemu:dirty-bitmap:B` with the
//!   README's libnbd script) while fio `--verify` writes the export: the
//!   restored last backup equals, byte for byte, what a client read through
//!   the view of backup 2; the view stays frozen while the guest rewrites the
//!   ranges it reads;
//! - the refusals (nothing changed after each);
//! - kill -9 of the server during a backup: the disk holds the guest's
//!   flushed data and no scratch data, no scratch file is left, and each
//!   bitmap comes back inconsistent or covering every range written.
//!
//! Raw and qcow2 exports.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::control::{ctl_ok, ctl_refused, nbdinfo_dirty, qemu_img_dirty};
use common::{assert_same, nbdsh, read_file, run, s, text, Server, TempDir};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// PATH with the system Python first (libnbd's bindings belong to it) and the vdisk binary's directory.
fn path_env() -> String {
    let bin = Path::new(common::vdisk_bin()).parent().unwrap().display().to_string();
    format!("/usr/bin:{bin}:{}", std::env::var("PATH").unwrap_or_default())
}

/// The "Backup and restore" section of README.md: its sh blocks in order, and its python block.
fn readme_blocks() -> (Vec<String>, String) {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme.find("\n## Backup and restore\n").expect("README.md has a \"Backup and restore\" section");
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let (mut sh, mut py) = (Vec::new(), Vec::new());
    let mut lines = section.lines();
    while let Some(l) = lines.next() {
        let lang = match l.trim_end() {
            "```sh" => &mut sh,
            "```python" => &mut py,
            _ => continue,
        };
        let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim_end() != "```").collect();
        lang.push(block.join("\n") + "\n");
    }
    assert_eq!((sh.len(), py.len()), (3, 1), "README \"Backup and restore\": 3 sh blocks and 1 python block");
    (sh, py.remove(0))
}

/// The README's paths, made the test's.
fn substitute(block: &str, dir: &Path, socket: &Path) -> String {
    block
        .replace("/tmp/vd/nbd.sock", s(socket))
        .replace("/backup/", &format!("{}/backup/", dir.display()))
        .replace("/tmp/vd/", &format!("{}/", dir.display()))
}

/// Runs a README sh block in `dir` with `VDISK_CONTROL` set.
fn run_sh(block: &str, dir: &Path, control: &Path) -> String {
    let out = Command::new("sh")
        .args(["-ec", block])
        .current_dir(dir)
        .env("PATH", path_env())
        .env("VDISK_CONTROL", control)
        .output()
        .expect("run sh");
    assert!(out.status.success(), "README block failed:\n{block}\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The README's incremental.py: copies the dirty extents of `bitmap` of `uri` into `target`.
fn incremental(dir: &Path, uri: &str, bitmap: &str, target: &Path) {
    let out = Command::new("python3")
        .args(["incremental.py", uri, bitmap, s(target)])
        .current_dir(dir)
        .env("PATH", path_env())
        .output()
        .expect("run python3");
    assert!(out.status.success(), "incremental.py {uri} {bitmap} failed:\n{}", text(&out));
}

/// A pattern of `len` bytes (a multiple of 4096) for `seed`.
fn pattern(seed: u8, len: u64) -> Vec<u8> {
    let block: Vec<u8> = (0..4096u32).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) | 1).collect();
    block.repeat((len / 4096) as usize)
}

/// Writes `pattern(seed, len)` at each offset through NBD, then flushes.
fn write(uri: &str, at: &[u64], len: u64, seed: u8) {
    let script: String = at
        .iter()
        .map(|o| {
            format!("h.pwrite((bytes([(i * 13 + {seed}) % 256 | 1 for i in range(4096)]) * {}), {o})\n", len / 4096)
        })
        .collect::<String>()
        + "h.flush()\n";
    nbdsh(uri, &script);
}

/// sha256 of `len` bytes at `offset` of `uri`, as a client reads them.
fn digest(uri: &str, offset: u64, len: u64) -> String {
    nbdsh(uri, &format!("import hashlib; print(hashlib.sha256(h.pread({len}, {offset})).hexdigest())"))
        .trim()
        .to_owned()
}

fn covered(runs: &[(u64, u64)], offset: u64, len: u64) -> bool {
    (offset..offset + len).step_by(512).all(|o| runs.iter().any(|&(a, l)| a <= o && o < a + l))
}

fn nbdcopy(uri: &str, to: &Path) {
    let _ = std::fs::remove_file(to);
    run("nbdcopy", &["--connections=4", uri, s(to)]);
}

fn image(dir: &TempDir, format: &str) -> PathBuf {
    let img = dir.path(&format!("disk.{format}"));
    run("qemu-img", &["create", "-q", "-f", format, s(&img), &SIZE.to_string()]);
    img
}

/// Files in `dir` that look like scratch data (none may be left or visible).
fn scratch_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("scratch"))
        .collect()
}

/// Bytes held by the unlinked files process `pid` has open in `dir` (the
/// scratch file has no name: O_TMPFILE shows as `DIR/#INODE (deleted)`).
fn scratch_bytes(pid: u32, dir: &Path) -> u64 {
    let prefix = format!("{}/", dir.display());
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| {
            let fd = e.ok()?.path();
            let target = std::fs::read_link(&fd).ok()?.display().to_string();
            (target.starts_with(&prefix) && target.ends_with(" (deleted)")).then(|| std::fs::metadata(&fd).ok())?
        })
        .map(|m| m.len())
        .sum()
}

#[test]
fn readme_backup_and_restore_runs_as_written() {
    let (sh, py) = readme_blocks();
    let dir = TempDir::new("backup-readme");
    std::fs::create_dir(dir.path("backup")).unwrap();
    let img = dir.path("vm1.img");
    run("qemu-img", &["create", "-q", "-f", "raw", s(&img), &(32 * MIB).to_string()]);
    let control = dir.path("ctl.sock");
    let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
    let uri = server.uri("vm1");
    let sub = |b: &str| substitute(b, &dir.0, &server.socket);
    std::fs::write(dir.path("incremental.py"), &py).unwrap();

    write(&uri, &[0, 5 * MIB, 31 * MIB], MIB, 1);
    let at_full = common::read_export(&dir, &uri, "now.img");
    run_sh(&sub(&sh[0]), &dir.0, &control);
    assert_same("full backup", &read_file(&dir.path("backup/full.img")), &at_full);

    write(&uri, &[5 * MIB + 4096, 20 * MIB], 3 * 4096, 2);
    let at_inc = common::read_export(&dir, &uri, "now.img");
    run_sh(&sub(&sh[1]), &dir.0, &control);
    assert_same("incremental backup", &read_file(&dir.path("backup/inc1.img")), &at_inc);
    assert!(ctl_ok(&control, &["bitmap", "list", "vm1"]).contains("b2"), "the next bitmap was started");

    // Restore the incremental one over a disk changed since.
    write(&uri, &[0, 20 * MIB], MIB, 3);
    run_sh(&sub(&sh[2]), &dir.0, &control);
    assert_same("restored disk", &common::read_export(&dir, &uri, "now.img"), &at_inc);
    assert!(scratch_files(&dir.0).is_empty());
    server.stop();
}

/// fio --verify over the first 16 MiB of `uri`, again and again until `stop`.
fn fio_loop(dir: &Path, uri: &str, stop: &AtomicBool, runs: &AtomicUsize) {
    std::fs::create_dir_all(dir).unwrap();
    while runs.load(Ordering::SeqCst) == 0 || !stop.load(Ordering::SeqCst) {
        common::fio_randwrite_verify(dir, uri, "the export under backup");
        runs.fetch_add(1, Ordering::SeqCst);
    }
}

fn chain(format: &str) {
    let dir = TempDir::new(&format!("backup-chain-{format}"));
    std::fs::write(dir.path("incremental.py"), readme_blocks().1).unwrap();
    let img = image(&dir, format);
    let control = dir.path("ctl.sock");
    let scratch = dir.path("spare");
    std::fs::create_dir(&scratch).unwrap();
    let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
    let uri = server.uri("disk");
    let view = |v: &str| server.uri(v);
    // What the guest holds before the first backup, beyond fio's first 16 MiB.
    write(&uri, &[32 * MIB, 40 * MIB, 63 * MIB], MIB, 10);
    let (stop, runs) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|sc| {
        let fio = sc.spawn(|| fio_loop(&dir.path("fio"), &uri, &stop, &runs));
        let go = || {
            // Full backup; the view stays frozen while the guest rewrites what it reads.
            ctl_ok(
                &control,
                &["backup", "begin", "disk", "--name", "full", "--new-bitmap", "b1", "--scratch", s(&scratch)],
            );
            let before = digest(&view("full"), 32 * MIB, 2 * MIB);
            write(&uri, &[32 * MIB + 4096, 33 * MIB], 64 * 1024, 11);
            assert_eq!(digest(&view("full"), 32 * MIB, 2 * MIB), before, "the view changed under guest writes");
            assert_ne!(digest(&uri, 32 * MIB, 2 * MIB), before, "the guest's writes landed");
            assert!(scratch_files(&dir.0).is_empty() && std::fs::read_dir(&scratch).unwrap().next().is_none());
            nbdcopy(&view("full"), &dir.path("full.img"));
            let pid = server.child.id();
            assert!(scratch_bytes(pid, &scratch) > 0, "the overwritten data is in the scratch file");
            ctl_ok(&control, &["backup", "end", "full"]);
            assert_eq!(scratch_bytes(pid, &scratch), 0, "the scratch data outlived the backup");

            // Incremental 1: what changed since the full backup.
            let w1 = [40 * MIB + 512 * 1024, 50 * MIB, 63 * MIB + 4096];
            write(&uri, &w1, 128 * 1024, 12);
            ctl_ok(&control, &["backup", "begin", "disk", "--name", "inc1", "--bitmap", "b1", "--new-bitmap", "b2"]);
            let d1 = nbdinfo_dirty(&view("inc1"), "b1");
            for o in w1 {
                assert!(covered(&d1, o, 128 * 1024), "b1 misses the write at {o}: {d1:?}");
            }
            assert!(!covered(&d1, 20 * MIB, 4096), "b1 marks what nobody wrote: {d1:?}");
            assert_eq!(qemu_img_dirty(&server.socket, "inc1", "b1"), d1, "qemu-img map of the view's bitmap");
            std::fs::copy(dir.path("full.img"), dir.path("inc1.img")).unwrap();
            incremental(&dir.0, &view("inc1"), "b1", &dir.path("inc1.img"));
            ctl_ok(&control, &["backup", "end", "inc1"]);

            // Incremental 2, and what a client reads through its view meanwhile.
            let w2 = [32 * MIB, 45 * MIB + 4096, 60 * MIB];
            write(&uri, &w2, 256 * 1024, 13);
            ctl_ok(&control, &["backup", "begin", "disk", "--name", "inc2", "--bitmap", "b2", "--new-bitmap", "b3"]);
            let d2 = nbdinfo_dirty(&view("inc2"), "b2");
            for o in w2 {
                assert!(covered(&d2, o, 256 * 1024), "b2 misses the write at {o}: {d2:?}");
            }
            std::fs::copy(dir.path("inc1.img"), dir.path("inc2.img")).unwrap();
            incremental(&dir.0, &view("inc2"), "b2", &dir.path("inc2.img"));
            write(&uri, &w2, 256 * 1024, 14);
            nbdcopy(&view("inc2"), &dir.path("view2.img"));
            let list = ctl_ok(&control, &["--json", "backup", "list"]);
            assert!(common::json(&list)[0]["copied_bytes"].as_u64().unwrap() > 0, "{list}");
            ctl_ok(&control, &["backup", "end", "inc2"]);
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(go));
        stop.store(true, Ordering::SeqCst);
        fio.join().expect("fio --verify failed on the export during the backups");
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    });
    assert!(runs.load(Ordering::SeqCst) >= 1);
    assert_same(
        &format!("{format}: full + incremental 1 + incremental 2 against the view of backup 2"),
        &read_file(&dir.path("inc2.img")),
        &read_file(&dir.path("view2.img")),
    );
    assert!(scratch_files(&dir.0).is_empty());
    server.stop();
    if format == "qcow2" {
        run("qemu-img", &["check", "-q", s(&img)]);
    }
}

#[test]
fn raw_incremental_chain_under_fio_restores_the_view_byte_for_byte() {
    chain("raw");
}

#[test]
fn qcow2_incremental_chain_under_fio_restores_the_view_byte_for_byte() {
    chain("qcow2");
}

#[test]
fn refusals_change_nothing() {
    let dir = TempDir::new("backup-refusals");
    let img = image(&dir, "raw");
    let control = dir.path("ctl.sock");
    let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
    ctl_ok(&control, &["bitmap", "add", "disk", "b1"]);
    let state =
        || (ctl_ok(&control, &["--json", "backup", "list"]), ctl_ok(&control, &["--json", "bitmap", "list", "disk"]));
    let empty = state();
    ctl_refused(&control, &["backup", "begin", "nosuch", "--name", "v"], "no export");
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "v", "--bitmap", "nosuch"], "no bitmap");
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "disk"], "in use");
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "v", "--new-bitmap", "b1"], "already");
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "v", "--scratch", "/nonexistent-dir"], "scratch");
    ctl_refused(&control, &["backup", "end", "v"], "no backup view");
    assert_eq!(state(), empty, "a refusal changed something");

    ctl_ok(&control, &["backup", "begin", "disk", "--name", "v", "--bitmap", "b1"]);
    let one = state();
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "v2"], "running already");
    ctl_refused(&control, &["backup", "begin", "v", "--name", "v2"], "backup view");
    ctl_refused(&control, &["backup", "begin", "disk", "--name", "v"], "in use");
    ctl_refused(&control, &["remove", "v"], "backup end");
    let overlay = dir.path("snap.qcow2");
    ctl_refused(&control, &["snapshot", "disk", "--overlay", s(&overlay)], "backup running");
    assert!(!overlay.exists());
    ctl_refused(&control, &["add", s(&dir.path("other.raw")), "--name", "v"], "backup view");
    assert_eq!(state(), one, "a refusal changed something");
    // The view is read-only.
    let out = common::output("nbdsh", &["-u", &server.uri("v"), "-c", "h.pwrite(b'x' * 512, 0)"]);
    assert!(!out.status.success(), "a write to the view succeeded:\n{}", text(&out));
    // Removing the export ends its backup.
    ctl_ok(&control, &["remove", "disk"]);
    assert_eq!(common::json(&ctl_ok(&control, &["--json", "backup", "list"])), serde_json::json!([]));
    assert!(!common::output("nbdinfo", &[&server.uri("v")]).status.success(), "the view outlived its export");

    // An inconsistent bitmap (kill -9 with it enabled) is refused.
    let control2 = dir.path("ctl2.sock");
    drop(server);
    let server = Server::start(&dir, &[s(&img), "--control", s(&control2)]);
    server.stop_with(libc::SIGKILL);
    let server = Server::start(&dir, &[s(&img), "--control", s(&control2)]);
    let before = ctl_ok(&control2, &["--json", "bitmap", "list", "disk"]);
    assert!(before.contains("\"inconsistent\": true"), "{before}");
    ctl_refused(&control2, &["backup", "begin", "disk", "--name", "v", "--bitmap", "b1"], "inconsistent");
    assert_eq!(ctl_ok(&control2, &["--json", "bitmap", "list", "disk"]), before);
    assert_eq!(common::json(&ctl_ok(&control2, &["--json", "backup", "list"])), serde_json::json!([]));
    // A stop during a backup ends it and exits cleanly; the disk is the guest's.
    ctl_ok(&control2, &["backup", "begin", "disk", "--name", "v", "--new-bitmap", "b2"]);
    let frozen = digest(&server.uri("v"), 0, MIB);
    write(&server.uri("disk"), &[0], MIB, 7);
    assert_eq!(digest(&server.uri("v"), 0, MIB), frozen);
    server.stop();
    let mut now = vec![0u8; MIB as usize];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(&img).unwrap(), &mut now, 0).unwrap();
    assert_same("the disk after a stop during a backup", &now, &pattern(7, MIB));
    assert!(scratch_files(&dir.0).is_empty());
}

/// kill -9 during a backup, a few rounds: the disk reads the guest's flushed
/// data (no scratch data), no scratch file is left, and each bitmap is
/// inconsistent or covers every range written before the kill.
fn killed(format: &str) {
    let dir = TempDir::new(&format!("backup-kill-{format}"));
    let img = image(&dir, format);
    let control = dir.path("ctl.sock");
    let mut model = vec![0u8; SIZE as usize];
    let put = |model: &mut Vec<u8>, uri: &str, at: &[u64], len: u64, seed: u8| {
        write(uri, at, len, seed);
        for &o in at {
            model[o as usize..(o + len) as usize].copy_from_slice(&pattern(seed, len));
        }
    };
    let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
    put(&mut model, &server.uri("disk"), &[0, 8 * MIB, 30 * MIB], 2 * MIB, 20);
    server.stop();
    let mut last: Vec<(u64, u64)> = Vec::new();
    for round in 0..3u8 {
        let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
        let uri = server.uri("disk");
        assert_same(
            &format!("{format} round {round}: the disk after a kill -9"),
            &common::read_export(&dir, &uri, "now.img"),
            &model,
        );
        // Bitmaps left by the last kill: inconsistent (then dropped) or covering its writes.
        let list = common::json(&ctl_ok(&control, &["--json", "bitmap", "list", "disk"]));
        for b in list.as_array().unwrap() {
            let name = b["name"].as_str().unwrap();
            if b["inconsistent"] == true {
                ctl_ok(&control, &["bitmap", "remove", "disk", name]);
            } else if name.ends_with('n') {
                // Started at the last backup's begin: it must hold every write after it.
                let d = nbdinfo_dirty(&uri, name);
                for &(o, l) in &last {
                    assert!(covered(&d, o, l), "bitmap {name} is short at {o}+{l}: {d:?}");
                }
            }
        }
        let b = format!("r{round}");
        ctl_ok(&control, &["bitmap", "add", "disk", &b]);
        ctl_ok(&control, &["backup", "begin", "disk", "--name", "v", "--bitmap", &b, "--new-bitmap", &format!("{b}n")]);
        let frozen = digest(&server.uri("v"), 0, 10 * MIB);
        // Overwrite what the view froze (scratch gets the old data), flushed.
        let w = 4 * MIB + round as u64 * 3 * MIB;
        put(&mut model, &uri, &[w, 8 * MIB + 4096], 64 * 1024, 30 + round);
        put(&mut model, &uri, &[MIB], MIB, 40 + round);
        last = vec![(w, 64 * 1024), (8 * MIB + 4096, 64 * 1024), (MIB, MIB)];
        assert_eq!(digest(&server.uri("v"), 0, 10 * MIB), frozen);
        server.stop_with(libc::SIGKILL);
        assert!(scratch_files(&dir.0).is_empty(), "{:?}", scratch_files(&dir.0));
    }
    let server = Server::start(&dir, &[s(&img), "--control", s(&control)]);
    assert_same(
        &format!("{format}: the disk at the end"),
        &common::read_export(&dir, &server.uri("disk"), "now.img"),
        &model,
    );
    server.stop();
    if format == "qcow2" {
        run("qemu-img", &["check", "-q", s(&img)]);
    }
}

#[test]
fn raw_kill_during_backup_leaves_the_guests_data_and_honest_bitmaps() {
    killed("raw");
}

#[test]
fn qcow2_kill_during_backup_leaves_the_guests_data_and_honest_bitmaps() {
    killed("qcow2");
}
