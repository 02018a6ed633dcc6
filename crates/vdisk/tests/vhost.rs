//! vhost-user-blk export: a real guest (QEMU under TCG, from the team's VM rig
//! in scripts/vmrig) boots with vdisk's socket as its only disk and runs the
//! rig's workload: O_DIRECT pattern writes and reads, odd-offset sector
//! writes, discard, mkfs.ext4, files, remount and verify. Once with one queue
//! (then a second frontend on the same socket: reconnect), once with two
//! queues and two vCPUs, once on a COW overlay.
//!
//! The rig is set up by scripts/vmrig/vm-setup.sh (idempotent; downloads .debs
//! into /tmp/vmrig the first time). If it cannot be set up the tests fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use common::*;

/// One guest at a time (TCG is CPU-bound; the machine has few cores), and one setup.
static RIG: Mutex<bool> = Mutex::new(false);

fn rig_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vmrig")
}

/// Sets up the rig once; panics with its output if that fails.
fn setup(ready: &mut bool) {
    if *ready {
        return;
    }
    let out = Command::new("bash")
        .arg(rig_dir().join("vm-setup.sh"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/vmrig/vm-setup.sh: {e}"));
    assert!(
        out.status.success(),
        "the VM rig could not be set up (scripts/vmrig/vm-setup.sh; needs apt-get download \
         access to the Debian archive):\n{}",
        text(&out)
    );
    *ready = true;
}

/// Boots a guest on `socket` with the rig's options; asserts it passed and returns its output.
fn boot(socket: &Path, opts: &[&str]) -> String {
    let mut args = vec![s(&rig_dir().join("vm-vhost-user-blk.sh")).to_owned()];
    args.extend(["--timeout", "240"].iter().chain(opts).map(|a| a.to_string()));
    args.push(s(socket).to_owned());
    let out = Command::new("bash").args(&args).output().expect("run vm-vhost-user-blk.sh");
    let all = text(&out);
    assert!(out.status.success(), "guest workload failed ({args:?}):\n{all}");
    all
}

fn assert_full_workload(out: &str) {
    for step in ["raw_md5 ok", "small_io ok", "discard ok", "mkfs type=ext4", "fs_verify ok", "VMRIG-RESULT: rc=0"] {
        assert!(out.contains(step), "guest output lacks {step:?}:\n{out}");
    }
}

fn serve(dir: &TempDir, image: &Path, queues: &str) -> (Server, PathBuf) {
    let socket = dir.path("vub.sock");
    let args = ["serve", s(image), "--vhost-user-blk", s(&socket), "--num-queues", queues];
    (Server::spawn(&args, socket.clone()), socket)
}

#[test]
fn guest_on_one_queue_and_a_reconnecting_frontend() {
    let mut ready = RIG.lock().unwrap_or_else(|e| e.into_inner());
    setup(&mut ready);
    let dir = TempDir::new("vhost1");
    let image = dir.path("disk.img");
    create_image(&image, "256M");
    let (server, socket) = serve(&dir, &image, "1");
    let out = boot(&socket, &["--mb", "32", "--files", "50"]);
    assert_full_workload(&out);
    assert!(out.contains("nr_hw_queues=1") && out.contains("lbs=512"), "{out}");
    assert!(out.contains("write_cache=write back"), "{out}");
    // The first frontend is gone; a second one gets the device back.
    let again = boot(&socket, &["--mb", "16", "--no-fs"]);
    assert!(again.contains("raw_md5 ok") && again.contains("small_io ok"), "{again}");
    server.stop();
}

#[test]
fn guest_on_two_queues_with_two_vcpus() {
    let mut ready = RIG.lock().unwrap_or_else(|e| e.into_inner());
    setup(&mut ready);
    let dir = TempDir::new("vhost2");
    let image = dir.path("disk.img");
    create_image(&image, "256M");
    let (server, socket) = serve(&dir, &image, "2");
    let out = boot(&socket, &["--mb", "32", "--files", "50", "--smp", "2", "--num-queues", "2"]);
    assert_full_workload(&out);
    assert!(out.contains("nr_hw_queues=2"), "the guest should see two queues:\n{out}");
    server.stop();
}

#[test]
fn guest_on_a_cow_overlay_leaves_the_base_alone() {
    let mut ready = RIG.lock().unwrap_or_else(|e| e.into_inner());
    setup(&mut ready);
    let dir = TempDir::new("vhostcow");
    let base = dir.path("base.img");
    create_image(&base, "256M");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&base).unwrap();
        f.write_all_at(&[0x5a; 1 << 20], 100 << 20).unwrap();
    }
    let before = read_file(&base);
    let overlay = dir.path("vm.cow");
    let out = vdisk(&["create", "--backing", s(&base), s(&overlay)]);
    assert!(out.status.success(), "vdisk create --backing: {}", text(&out));
    let (server, socket) = serve(&dir, &overlay, "1");
    let out = boot(&socket, &["--mb", "32", "--files", "50"]);
    assert_full_workload(&out);
    server.stop();
    assert!(read_file(&base) == before, "the guest's writes reached the backing file");
    let info = vdisk(&["info", s(&overlay)]);
    assert!(info.status.success(), "vdisk info: {}", text(&info));
}

#[test]
fn the_socket_is_private_and_gone_after_exit() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("vhostsock");
    let image = dir.path("disk.img");
    create_image(&image, "16M");
    let (server, socket) = serve(&dir, &image, "2");
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the vhost-user socket is the owner's only by default");
    assert!(
        server.stdout.iter().any(|l| l.contains("vhost-user-blk") && l.contains("2 queues")),
        "{:?}",
        server.stdout
    );
    server.stop(); // asserts a clean exit and that the socket is gone
}

#[test]
fn a_socket_path_that_is_not_a_socket_is_refused() {
    let dir = TempDir::new("vhostbad");
    let image = dir.path("disk.img");
    create_image(&image, "16M");
    let file = dir.path("taken");
    std::fs::write(&file, b"keep me").unwrap();
    let out = vdisk(&["serve", s(&image), "--vhost-user-blk", s(&file)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(s(&file)) && err.contains("--vhost-user-blk"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}
