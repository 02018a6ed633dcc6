//! NBD clients across a restart of vdisk: qemu's NBD driver with
//! `reconnect-delay` (here through qemu-io --image-opts; qemu-storage-daemon
//! and a VM's -blockdev use the same driver) keeps its I/O waiting while the
//! server is gone and goes on once it is back, first across a clean SIGTERM
//! restart, then across a SIGKILL; everything it wrote and flushed is there.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{create_image, read_file, Server, TempDir, MIB};

/// Waits for a line of qemu-io's output that contains `what`.
fn wait_line(rx: &mpsc::Receiver<String>, seen: &mut Vec<String>, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !seen.iter().any(|l| l.contains(what)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("qemu-io never printed {what:?}; it printed:\n{}", seen.join("\n")),
        }
    }
}

#[test]
fn qemu_nbd_client_with_reconnect_delay_rides_out_restarts() {
    let dir = TempDir::new("restart");
    let img = dir.path("d.img");
    create_image(&img, "64M");
    let args = [img.to_str().unwrap()];
    let server = Server::start(&dir, &args);
    let opts =
        format!("driver=nbd,server.type=unix,server.path={},export=d,reconnect-delay=30", server.socket.display());
    let script = [
        "write -P 0xaa 0 4M",
        "flush",
        "sleep 1500",
        // The server is down now: this waits for it.
        "read -P 0xaa 0 4M",
        "write -P 0xbb 4M 4M",
        "flush",
        "sleep 1500",
        "read -P 0xbb 4M 4M",
        "read -P 0xaa 0 4M",
        "write -P 0xcc 8M 1M",
        "flush",
    ];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["--image-opts", &opts]);
    for c in script {
        cmd.args(["-c", c]);
    }
    let started = Instant::now();
    let mut qemu = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("qemu-io (qemu-utils)");
    let (tx, rx) = mpsc::channel();
    let out = qemu.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = Vec::new();

    // A clean restart (an upgrade of the binary) while the client sleeps between requests.
    wait_line(&rx, &mut seen, "wrote 4194304/4194304 bytes at offset 0");
    std::thread::sleep(Duration::from_millis(300));
    assert!(server.stop_with(libc::SIGTERM).success());
    std::thread::sleep(Duration::from_millis(2500));
    let server = Server::start(&dir, &args);

    // A crash: SIGKILL once the second write was acknowledged.
    wait_line(&rx, &mut seen, "wrote 4194304/4194304 bytes at offset 4194304");
    std::thread::sleep(Duration::from_millis(300));
    server.stop_with(libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(2500));
    let server = Server::start(&dir, &args);

    let status = qemu.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut qemu.stderr.take().unwrap(), &mut err).unwrap();
    seen.extend(rx.try_iter());
    let text = seen.join("\n");
    assert!(status.success(), "qemu-io failed ({status}):\n{text}\n{err}");
    assert!(!text.contains("Pattern verification failed") && !err.contains("error"), "{text}\n{err}");
    assert_eq!(text.matches("read 4194304/4194304 bytes").count(), 3, "{text}");
    assert!(text.contains("wrote 1048576/1048576 bytes at offset 8388608"), "{text}");
    assert!(started.elapsed() > Duration::from_secs(5), "the client did not wait for the server");
    server.stop();
    let disk = read_file(&img);
    assert!(disk[..4 * MIB].iter().all(|&b| b == 0xaa));
    assert!(disk[4 * MIB..8 * MIB].iter().all(|&b| b == 0xbb));
    assert!(disk[8 * MIB..9 * MIB].iter().all(|&b| b == 0xcc));
}
