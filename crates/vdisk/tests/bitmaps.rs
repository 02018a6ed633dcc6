//! Dirty bitmaps of a running `vdisk serve`, end to end with real clients:
//! `vdisk ctl bitmap add`, writes by nbdsh, then `nbdinfo --map` and
//! `qemu-img map ... x-dirty-bitmap=` show exactly the granules written;
//! a removal saves the bitmap (qcow2: `qemu-img info` lists it, `qemu-img
//! check` is clean, qemu-nbd --bitmap serves the same extents, and a bitmap
//! `qemu-img bitmap --add` made is tracked; raw: the IMAGE.bitmaps sidecar),
//! a restart serves the same bits, and after kill -9 the bitmap comes back
//! inconsistent and is not served. Raw and qcow2.

mod common;

use std::path::Path;

use common::control::{ctl_ok, ctl_refused, nbdinfo_dirty, qemu_img_dirty};
use common::{output, run, s, text, Server, TempDir};

const G: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

/// The writes: (offset, length), some unaligned, one across a granule edge.
const WRITES: [(u64, u64); 5] =
    [(0, 4096), (3 * G + 100, 10), (16 * G - 1, 2), (2 << 20, 200 << 10), (SIZE - 512, 512)];

/// The dirty granules of [`WRITES`] as merged runs (offset, length).
fn expected() -> Vec<(u64, u64)> {
    let mut dirty = vec![false; (SIZE / G) as usize];
    for (o, l) in WRITES {
        for g in o / G..=(o + l - 1) / G {
            dirty[g as usize] = true;
        }
    }
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (i, d) in dirty.iter().enumerate() {
        let at = i as u64 * G;
        match runs.last_mut() {
            Some((o, l)) if *d && *o + *l == at => *l += G,
            _ if *d => runs.push((at, G)),
            _ => {}
        }
    }
    runs
}

fn list(control: &Path) -> serde_json::Value {
    common::json(&ctl_ok(control, &["--json", "bitmap", "list", "disk"]))
}

/// Bitmap `name` of a `bitmap list --json`.
fn entry<'a>(l: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    l.as_array().unwrap().iter().find(|b| b["name"] == name).unwrap_or_else(|| panic!("no {name} in {l}"))
}

/// Dirty runs of bitmap `b` of `img` served by qemu-nbd (`--bitmap`).
fn qemu_nbd_dirty(dir: &TempDir, img: &Path, b: &str) -> Vec<(u64, u64)> {
    let sock = dir.path("qemu.sock");
    let mut qemu = std::process::Command::new("qemu-nbd")
        .args(["-r", "-f", "qcow2", "-B", b, "-k", s(&sock), s(img)])
        .spawn()
        .expect("qemu-nbd (qemu-utils) is needed");
    let t0 = std::time::Instant::now();
    while !sock.exists() && t0.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let runs = nbdinfo_dirty(&format!("nbd+unix:///?socket={}", sock.display()), b);
    let _ = qemu.kill();
    let _ = qemu.wait();
    let _ = std::fs::remove_file(&sock);
    runs
}

fn serve(dir: &TempDir, img: &str, control: &Path) -> Server {
    Server::start(dir, &[img, "--control", s(control)])
}

fn round_trip(format: &str) {
    let dir = TempDir::new(&format!("bitmaps-{format}"));
    let img = dir.path(&format!("disk.{format}"));
    run("qemu-img", &["create", "-q", "-f", format, s(&img), &SIZE.to_string()]);
    if format == "qcow2" {
        // A bitmap qemu made: vdisk keeps it up to date.
        run("qemu-img", &["bitmap", "--add", s(&img), "q"]);
    }
    let control = dir.path("ctl.sock");
    let server = serve(&dir, s(&img), &control);
    let uri = server.uri("disk");
    ctl_ok(&control, &["bitmap", "add", "disk", "b0", "--granularity", "64K"]);
    ctl_ok(&control, &["bitmap", "add", "disk", "off", "--disabled"]);
    // Clear errors, nothing changed.
    ctl_refused(&control, &["bitmap", "add", "disk", "b0"], "already");
    ctl_refused(&control, &["bitmap", "add", "nosuch", "b0"], "no export");
    ctl_refused(&control, &["bitmap", "clear", "disk", "nosuch"], "no bitmap");
    ctl_refused(&control, &["bitmap", "add", "disk", "odd", "--granularity", "3000"], "power of two");
    let script: String =
        WRITES.iter().map(|(o, l)| format!("h.pwrite(b'\\x07' * {l}, {o})\n")).collect::<Vec<_>>().concat();
    common::nbdsh(&uri, &script);
    let want = expected();
    assert_eq!(nbdinfo_dirty(&uri, "b0"), want, "{format}: nbdinfo");
    assert_eq!(qemu_img_dirty(&server.socket, "disk", "b0"), want, "{format}: qemu-img map");
    assert!(nbdinfo_dirty(&uri, "off").is_empty(), "a disabled bitmap marks nothing");
    if format == "qcow2" {
        assert_eq!(nbdinfo_dirty(&uri, "q"), want, "the bitmap qemu-img made");
        ctl_ok(&control, &["bitmap", "remove", "disk", "q"]);
    }
    let l = list(&control);
    let dirty: u64 = want.iter().map(|r| r.1).sum();
    assert_eq!(entry(&l, "b0")["dirty_bytes"], dirty);
    let off = entry(&l, "off");
    assert_eq!((off["enabled"].as_bool(), off["inconsistent"].as_bool()), (Some(false), Some(false)));
    // Merge into the disabled one, then drop it.
    ctl_ok(&control, &["bitmap", "merge", "disk", "off", "--from", "b0"]);
    assert_eq!(nbdinfo_dirty(&uri, "off"), want);
    ctl_ok(&control, &["bitmap", "remove", "disk", "off"]);
    ctl_ok(&control, &["remove", "disk"]);
    server.stop();

    if format == "qcow2" {
        let info = common::json(&run("qemu-img", &["info", "--output=json", s(&img)]));
        let bitmaps = &info["format-specific"]["data"]["bitmaps"];
        assert_eq!(bitmaps.as_array().map(Vec::len), Some(1), "qemu-img info: {info}");
        assert_eq!((bitmaps[0]["name"].as_str(), bitmaps[0]["granularity"].as_u64()), (Some("b0"), Some(G)));
        assert!(!bitmaps[0]["flags"].to_string().contains("in-use"), "{bitmaps}");
        run("qemu-img", &["check", "-q", s(&img)]);
        assert_eq!(qemu_nbd_dirty(&dir, &img, "b0"), want, "qemu-nbd --bitmap reads the bitmap vdisk saved");
    } else {
        assert!(dir.path("disk.raw.bitmaps").exists(), "the sidecar file");
    }

    // A restart serves the same bits.
    let server = serve(&dir, s(&img), &control);
    let uri = server.uri("disk");
    let l = list(&control);
    assert_eq!((l.as_array().unwrap().len(), l[0]["inconsistent"].as_bool()), (1, Some(false)), "{l}");
    assert_eq!(nbdinfo_dirty(&uri, "b0"), want, "{format}: after a restart");
    // Killed with the bitmap enabled: inconsistent, listed, not served, refused but for remove.
    server.stop_with(libc::SIGKILL);
    let server = serve(&dir, s(&img), &control);
    let uri = server.uri("disk");
    let l = list(&control);
    assert_eq!(l[0]["inconsistent"], true, "{l}");
    let human = ctl_ok(&control, &["bitmap", "list", "disk"]);
    assert!(human.contains("inconsistent"), "{human}");
    let out = output("nbdinfo", &["--map=qemu:dirty-bitmap:b0", &uri]);
    assert!(
        !out.status.success() || text(&out).trim().is_empty(),
        "an inconsistent bitmap was served:\n{}",
        text(&out)
    );
    ctl_refused(&control, &["bitmap", "clear", "disk", "b0"], "inconsistent");
    ctl_refused(&control, &["bitmap", "enable", "disk", "b0"], "inconsistent");
    ctl_ok(&control, &["bitmap", "remove", "disk", "b0"]);
    assert_eq!(list(&control), serde_json::json!([]));
    server.stop();
    if format == "qcow2" {
        run("qemu-img", &["check", "-q", s(&img)]);
    }
}

#[test]
fn raw_bitmaps_track_writes_persist_and_survive_restarts() {
    round_trip("raw");
}

#[test]
fn qcow2_bitmaps_track_writes_persist_and_qemu_reads_them() {
    round_trip("qcow2");
}

/// The dirty runs of 64 KiB granules written at `offsets` (4 KiB each, in separate granules).
fn runs(offsets: &[u64]) -> Vec<(u64, u64)> {
    offsets.iter().map(|&o| (o, G)).collect()
}

/// An export's bitmaps are the export's, not its top file's: through a
/// live snapshot, a mirror with pivot onto a raw file and a stream that
/// reopens the top, the device's bitmap keeps every guest write (and not the
/// stream's copy, which changes nothing the disk reads); each layer left
/// behind keeps a consistent copy as of when it was left (qemu-nbd serves
/// it), the new top keeps the bitmap from then on (a restart serves the
/// same bits), and no layer is ever found "not saved cleanly".
#[test]
fn bitmaps_follow_the_export_through_snapshot_pivot_and_stream() {
    use common::logged::LoggedServer;
    let dir = TempDir::new("bitmaps-follow");
    let img = dir.path("disk.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&img), &SIZE.to_string()]);
    let control = dir.path("ctl.sock");
    let socket = dir.path("nbd.sock");
    let start = |image: &Path, tag: &str| {
        LoggedServer::start(
            &dir,
            tag,
            &[s(image), "--export-name", "disk", "--control", s(&control), "--socket", s(&socket)],
        )
    };
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    let write = |at: u64| common::nbdsh(&uri, &format!("h.pwrite(b'\\x07' * 4096, {at})\nh.flush()"));
    let (a, b, c, d) = (0, 1 << 20, 2 << 20, 3 << 20);
    let mut server = start(&img, "first");
    ctl_ok(&control, &["bitmap", "add", "disk", "b0", "--granularity", "64K"]);
    write(a);
    let s1 = dir.path("s1.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", s(&s1)]);
    write(b);
    let m = dir.path("m.raw");
    ctl_ok(&control, &["mirror", "disk", "--to", s(&m), "--pivot", "--wait"]);
    write(c);
    assert_eq!(nbdinfo_dirty(&uri, "b0"), runs(&[a, b, c]), "one bitmap through snapshot and pivot");
    let log = server.log();
    assert!(server.stop(std::time::Duration::from_secs(30)).is_some_and(|st| st.success()), "{log}");
    // The layers left behind: a consistent copy each, as of when they were left.
    run("qemu-img", &["check", "-q", s(&img)]);
    run("qemu-img", &["check", "-q", s(&s1)]);
    assert_eq!(qemu_nbd_dirty(&dir, &img, "b0"), runs(&[a]), "the first top, left at the snapshot");
    assert_eq!(qemu_nbd_dirty(&dir, &s1, "b0"), runs(&[a, b]), "the overlay, left at the pivot");
    assert!(dir.path("m.raw.bitmaps").exists(), "the raw top keeps it in its sidecar");

    // Served again from the raw top: the same bitmap, consistent.
    let mut server = start(&m, "second");
    assert_eq!(list(&control)[0]["inconsistent"], false);
    assert_eq!(nbdinfo_dirty(&uri, "b0"), runs(&[a, b, c]), "after a restart on the new top");
    // A stream reopens its top (the same file): the bitmap goes on in it.
    // Its copy changes nothing the disk reads, so it marks nothing.
    let s2 = dir.path("s2.qcow2");
    ctl_ok(&control, &["snapshot", "disk", "--overlay", s(&s2)]);
    write(d);
    ctl_ok(&control, &["stream", "disk", "--wait"]);
    let dirty = nbdinfo_dirty(&uri, "b0");
    assert_eq!(dirty, runs(&[a, b, c, d]), "after the stream");
    let log = server.log();
    assert!(server.stop(std::time::Duration::from_secs(30)).is_some_and(|st| st.success()), "{log}");
    assert!(!log.contains("not saved cleanly"), "a layer was found with its bitmaps in use:\n{log}");
    run("qemu-img", &["check", "-q", s(&s2)]);
    let info = common::json(&run("qemu-img", &["info", "--output=json", s(&s2)]));
    assert!(info.get("backing-filename").is_none(), "streamed: {info}");
    let bitmaps = &info["format-specific"]["data"]["bitmaps"];
    assert_eq!(bitmaps[0]["name"].as_str(), Some("b0"), "{info}");
    assert!(!bitmaps[0]["flags"].to_string().contains("in-use"), "{bitmaps}");
    let server = start(&s2, "third");
    assert_eq!(list(&control)[0]["inconsistent"], false);
    assert_eq!(nbdinfo_dirty(&uri, "b0"), dirty, "after a restart on the streamed top");
    drop(server);
}
