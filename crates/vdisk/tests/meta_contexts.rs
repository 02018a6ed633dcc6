//! NBD meta contexts served by the real `vdisk serve`, read by nbdinfo:
//! `qemu:allocation-depth` shows which layer of the chain holds each run
//! (1 the overlay, 2 its backing file, 0 nothing) on a UML COW overlay and a
//! qcow2 overlay chain, and `base:allocation` is unchanged beside it; the
//! same chain served by qemu-nbd gives the same depths.
//! (`qemu:dirty-bitmap:NAME` of the running daemon: tests/bitmaps.rs.)

mod common;

use common::{nbdinfo_map as map, run, s, Server, TempDir};

const K64: u64 = 64 << 10;
const M: u64 = 1 << 20;

#[test]
fn allocation_depth_of_a_cow_overlay() {
    let dir = TempDir::new("meta-cow");
    let base = dir.path("base.raw");
    run("qemu-img", &["create", "-q", "-f", "raw", s(&base), "4M"]);
    run("qemu-io", &["-f", "raw", "-c", "write -P 1 1M 64k", s(&base)]);
    let overlay = dir.path("o.cow");
    run("uml_mkcow", &["-f", s(&overlay), s(&base)]);
    let server = Server::start(&dir, &[s(&overlay)]);
    let uri = server.uri("o");
    run("qemu-io", &["-f", "raw", "-c", "write -P 2 3M 64k", &uri]);
    // The overlay holds 3M..3M+64K; the raw backing file holds the rest (holes too: depth 2).
    assert_eq!(map(&uri, "qemu:allocation-depth"), [(0, 3 * M, 2), (3 * M, K64, 1), (3 * M + K64, M - K64, 2)]);
    let base_alloc = map(&uri, "base:allocation");
    assert!(base_alloc.contains(&(M, K64, 0)) && base_alloc.contains(&(3 * M, K64, 0)), "{base_alloc:?}");
    server.stop();
}

#[test]
fn allocation_depth_of_a_qcow2_chain_matches_qemu_nbd() {
    let dir = TempDir::new("meta-qcow2");
    let (base, mid, top) = (dir.path("base.raw"), dir.path("mid.qcow2"), dir.path("top.qcow2"));
    run("qemu-img", &["create", "-q", "-f", "raw", s(&base), "2M"]);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", s(&mid), "4M"]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 3 1M 64k", s(&mid)]);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", s(&top), "4M"]);
    let server = Server::start(&dir, &[s(&top)]);
    let uri = server.uri("top");
    run("qemu-io", &["-f", "raw", "-c", "write -P 4 0 64k", "-c", "write -P 4 3M 64k", &uri]);
    let ours = map(&uri, "qemu:allocation-depth");
    assert_eq!(
        ours,
        // Past base.raw's end (2M) the zeros count as its own (depth 3), as qemu counts them.
        [
            (0, K64, 1),
            (K64, M - K64, 3),
            (M, K64, 2),
            (M + K64, 2 * M - K64, 3),
            (3 * M, K64, 1),
            (3 * M + K64, M - K64, 3)
        ]
    );
    server.stop();
    // qemu-nbd -A over the same chain: the same depths.
    let sock = dir.path("qemu.sock");
    let mut qemu = std::process::Command::new("qemu-nbd")
        .args(["-r", "-A", "-f", "qcow2", "-k", s(&sock), s(&top)])
        .spawn()
        .expect("qemu-nbd (qemu-utils) is needed");
    let t0 = std::time::Instant::now();
    while !sock.exists() && t0.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let theirs = map(&format!("nbd+unix:///?socket={}", s(&sock)), "qemu:allocation-depth");
    let _ = qemu.kill();
    let _ = qemu.wait();
    assert_eq!(ours, theirs, "vdisk and qemu-nbd disagree on allocation depth");
}

/// A qcow2 image's bitmaps (here one `qemu-img bitmap --add` made) are kept
/// up to date by the daemon: after a clean stop qemu finds them consistent
/// (not in use), with the write in them, and the image clean for `qemu-img
/// check`. (Kill -9 and the rest: tests/bitmaps.rs.)
#[test]
fn a_served_qcow2_keeps_its_bitmaps_up_to_date() {
    let dir = TempDir::new("meta-qcow2-bitmaps");
    let img = dir.path("disk.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&img), "4M"]);
    run("qemu-img", &["bitmap", "--add", s(&img), "b0"]);
    assert!(!run("qemu-img", &["info", s(&img)]).contains("in-use"));
    let server = Server::start(&dir, &[s(&img)]);
    run("qemu-io", &["-f", "raw", "-c", "write -P 5 1M 64k", &server.uri("disk")]);
    server.stop();
    let info = run("qemu-img", &["info", s(&img)]);
    assert!(info.contains("name: b0") && !info.contains("in-use"), "{info}");
    let server = Server::start(&dir, &[s(&img)]);
    assert_eq!(map(&server.uri("disk"), "qemu:dirty-bitmap:b0"), [(0, M, 0), (M, K64, 1), (M + K64, 3 * M - K64, 0)]);
    server.stop();
    let check = run("qemu-img", &["check", s(&img)]);
    assert!(check.contains("No errors"), "{check}");
}
