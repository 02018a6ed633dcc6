//! A failing backing store: a file system that fills up (a real 8 MiB tmpfs,
//! under a raw image or under a COW overlay alone), a disk that fails reads,
//! writes and flushes (the engine's fault injection, `VDISK_FAULTS`: this
//! kernel has no device-mapper for dm-error), and a COW overlay's backing file
//! deleted or truncated while it is served. The client
//! gets ENOSPC or EIO for the requests that failed, everything else keeps
//! working, and the server neither panics nor hangs: each test ends with a
//! clean SIGTERM stop (exit 0). docs/design.md ("Reliability") lists which
//! errors reach the client and which stop the device.

mod common;

use common::nbd::*;
use common::{create_image, output, s, text, vdisk, Server, TempDir, ENGINES};
use std::path::{Path, PathBuf};
use std::process::Command;

const EIO: u32 = 5;

/// A tmpfs of `size` mounted on a new directory, unmounted when dropped.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(dir: &TempDir, size: &str) -> SmallFs {
        let p = dir.path("small");
        std::fs::create_dir_all(&p).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&p)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "cannot mount a {size} tmpfs on {} (needs root):\n{}", p.display(), text(&out));
        SmallFs(p)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_file_system_gives_enospc_and_everything_else_goes_on() {
    for engine in ENGINES {
        let dir = TempDir::new(&format!("enospc-{engine}"));
        let fs = SmallFs::mount(&dir, "8m");
        let full = fs.0.join("full.img");
        create_image(&full, "64M");
        let other = dir.path("other.img");
        create_image(&other, "16M");
        let server = Server::start(&dir, &[full.to_str().unwrap(), other.to_str().unwrap(), "--engine", engine]);
        let (mut c, _) = Client::open(&server.socket, "full");

        // 1 MiB writes (the engine's path) and 64 KiB ones (done inline on
        // tmpfs) until the file system is full.
        let mut written = Vec::new();
        let mut offset = 0u64;
        let error = loop {
            let len = if written.len() % 2 == 0 { MIB } else { 64 * KIB };
            let data = pattern(offset, len as usize);
            let r = c.call(0, CMD_WRITE, offset, len as u32, &data);
            if r.error != 0 {
                break r.error;
            }
            written.push((offset, data));
            offset += len;
            assert!(offset < 32 * MIB, "{engine}: 32 MiB written to an 8 MiB file system without an error");
        };
        assert_eq!(error, ENOSPC, "{engine}: a write to a full file system");
        assert!(offset >= 4 * MIB, "{engine}: ENOSPC after only {offset} bytes");
        // What was written reads back; FLUSH works; the connection goes on.
        for (off, data) in &written {
            assert!(c.read(*off, data.len() as u32) == *data, "{engine}: data at {off} after ENOSPC");
        }
        c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH on a full file system");
        // Another export of the same server is untouched.
        let (mut o, _) = Client::open(&server.socket, "other");
        o.write(0, &pattern(7, 256 * KIB as usize), 0);
        assert_eq!(o.read(0, 256 * KIB as u32), pattern(7, 256 * KIB as usize), "{engine}: the other export");
        o.disconnect();
        // Freeing space (TRIM punches holes) makes writes work again.
        c.call(0, CMD_TRIM, 0, 4 * MIB as u32, &[]).assert_ok("TRIM");
        c.write(offset, &pattern(99, MIB as usize), 0);
        assert_eq!(c.read(offset, MIB as u32), pattern(99, MIB as usize), "{engine}: written after the TRIM");
        c.disconnect();
        server.stop();
        drop(fs);
    }
}

#[test]
fn injected_disk_errors_reach_the_client_as_eio() {
    // A bad stretch [1 MiB, 1 MiB + 4 KiB) fails every read touching it; the
    // third write of the device fails once.
    for engine in ENGINES {
        let dir = TempDir::new(&format!("eio-{engine}"));
        let image = dir.path("disk.img");
        create_image(&image, "16M");
        let server = Server::start_env(
            &dir,
            &[image.to_str().unwrap(), "--engine", engine],
            &[("VDISK_FAULTS", "read@1048576+4096,write#3")],
        );
        let (mut c, _) = Client::open(&server.socket, "disk");
        c.write(0, &pattern(1, 8192), 0);
        c.write(MIB - 4096, &pattern(2, 16384), 0);
        assert_eq!(c.call(0, CMD_WRITE, 65536, 4096, &pattern(3, 4096)).error, EIO, "{engine}: the third write");
        c.write(65536, &pattern(4, 4096), 0);
        assert_eq!(c.read(65536, 4096), pattern(4, 4096), "{engine}: a write after the failed one");
        for (off, len) in [(MIB, 512u32), (MIB - 512, 1024), (MIB + 4095, 1), (0, 2 * MIB as u32)] {
            assert_eq!(c.call(0, CMD_READ, off, len, &[]).error, EIO, "{engine}: read of {len} at {off}");
        }
        assert_eq!(c.read(MIB - 4096, 4096), pattern(2, 16384)[..4096], "{engine}: beside the bad stretch");
        assert_eq!(c.read(0, 8192), pattern(1, 8192), "{engine}: far from it");
        c.disconnect();
        // Structured replies carry it as an error chunk.
        let (mut s, _, _) = Client::open_structured(&server.socket, "disk");
        assert_eq!(s.call(0, CMD_READ, MIB, 4096, &[]).error, EIO, "{engine}: structured read");
        s.assert_alive();
        s.disconnect();
        // And a real client says so.
        let out = output("qemu-io", &["-f", "raw", &server.uri("disk"), "-c", "read 1M 4k", "-c", "read 0 4k"]);
        let all = text(&out);
        assert!(all.contains("Input/output error"), "{engine}: qemu-io should see EIO:\n{all}");
        assert!(all.contains("read 4096/4096 bytes at offset 0"), "{engine}: and read the rest:\n{all}");
        server.stop();
    }
}

#[test]
fn backing_file_deleted_or_truncated_under_a_running_overlay() {
    let dir = TempDir::new("backing-gone");
    let base = dir.path("base.img");
    let data = pattern(5, 8 * MIB as usize);
    std::fs::write(&base, &data).unwrap();
    let overlay = dir.path("vm.cow");
    let out = vdisk(&["create", "--backing", s(&base), s(&overlay)]);
    assert!(out.status.success(), "{}", text(&out));

    // Deleted: the server holds it open, so the disk reads as before.
    let server = Server::start(&dir, &[s(&overlay)]);
    let (mut c, _) = Client::open(&server.socket, "vm");
    c.write(0, &pattern(6, 65536), 0);
    std::fs::remove_file(&base).unwrap();
    assert_eq!(c.read(0, 65536), pattern(6, 65536), "overlay data after the base was deleted");
    assert!(c.read(MIB, 4 * MIB as u32) == data[MIB as usize..5 * MIB as usize], "base data after it was deleted");
    c.write(2 * MIB, &pattern(7, 4096), CMD_FLAG_FUA);
    assert_eq!(c.read(2 * MIB, 4096), pattern(7, 4096));
    c.disconnect();
    server.stop();

    // Truncated to half: what lies past the new end is gone. Reading it is
    // EIO; the rest of the disk, and the overlay's own data, still read.
    std::fs::write(&base, &data).unwrap();
    std::fs::remove_file(&overlay).unwrap();
    let out = vdisk(&["create", "--backing", s(&base), s(&overlay)]);
    assert!(out.status.success(), "{}", text(&out));
    let server = Server::start(&dir, &[s(&overlay)]);
    let (mut c, _) = Client::open(&server.socket, "vm");
    c.write(6 * MIB, &pattern(8, 4096), 0);
    std::fs::OpenOptions::new().write(true).open(&base).unwrap().set_len(4 * MIB).unwrap();
    assert_eq!(c.call(0, CMD_READ, 5 * MIB, 4096, &[]).error, EIO, "a read past the backing file's new end");
    assert_eq!(c.call(0, CMD_READ, 4 * MIB - 512, 1024, &[]).error, EIO, "a read across the new end");
    assert!(c.read(0, 4 * MIB as u32) == data[..4 * MIB as usize], "base data before the new end");
    assert_eq!(c.read(6 * MIB, 4096), pattern(8, 4096), "overlay data past the new end");
    c.assert_alive();
    c.disconnect();
    server.stop();
}

const UMIB: usize = MIB as usize;
const UKIB: usize = KIB as usize;

/// An image to serve holding `base`: a raw file, or a new COW overlay (in
/// `overlay_dir`) over one. Returns the file to serve and its export name.
fn image_of(dir: &TempDir, cow: bool, base: &[u8], overlay_dir: &Path) -> (PathBuf, &'static str) {
    let raw = dir.path("base.img");
    std::fs::write(&raw, base).unwrap();
    if !cow {
        return (raw, "base");
    }
    let overlay = overlay_dir.join("vm.cow");
    let out = vdisk(&["create", "--backing", s(&raw), s(&overlay)]);
    assert!(out.status.success(), "vdisk create: {}", text(&out));
    (overlay, "vm")
}

#[test]
fn a_failed_flush_gets_its_error_and_the_next_flush_makes_the_writes_durable() {
    // The second flush of the device fails with EIO, the third with ENOSPC;
    // the fourth succeeds. Then the server is killed (SIGKILL: nothing more
    // is synced) and a new one must read everything written before it.
    let base = pattern(40, 8 * UMIB);
    for engine in ENGINES {
        for cow in [false, true] {
            let what = format!("{engine} {}", if cow { "cow" } else { "raw" });
            let dir = TempDir::new(&format!("flush-{engine}-{cow}"));
            let (image, name) = image_of(&dir, cow, &base, &dir.0);
            let args = [s(&image), "--engine", engine];
            let server = Server::start_env(&dir, &args, &[("VDISK_FAULTS", "flush#2,flush#3=enospc")]);
            let (mut c, _) = Client::open(&server.socket, name);
            let writes = [(0u64, pattern(41, 65536)), (3 * MIB + 512, pattern(42, 1000)), (5 * MIB, pattern(43, 4096))];
            c.write(writes[0].0, &writes[0].1, 0);
            c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("the first FLUSH");
            c.write(writes[1].0, &writes[1].1, 0);
            assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, EIO, "{what}: the second FLUSH");
            assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, ENOSPC, "{what}: the third FLUSH");
            // Writes and reads go on.
            c.write(writes[2].0, &writes[2].1, 0);
            for (off, data) in &writes {
                assert_eq!(c.read(*off, data.len() as u32), *data, "{what}: read at {off} after the failed FLUSHes");
            }
            c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("the FLUSH after the failed ones");
            c.assert_alive();
            drop(c);
            let st = server.stop_with(libc::SIGKILL);
            assert!(!st.success(), "{what}: SIGKILL");
            let _ = std::fs::remove_file(dir.path("nbd.sock"));

            let server = Server::start(&dir, &args);
            let (mut c, _) = Client::open(&server.socket, name);
            let mut want = base.clone();
            for (off, data) in &writes {
                want[*off as usize..*off as usize + data.len()].copy_from_slice(data);
            }
            let got = c.read(0, want.len() as u32);
            assert!(
                got == want,
                "{what}: after the good FLUSH and a SIGKILL, the disk differs at byte {:?}",
                first_diff(&got, &want)
            );
            c.disconnect();
            server.stop();
        }
    }
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn a_cow_overlay_on_a_full_file_system_never_points_at_data_it_did_not_write() {
    // The overlay (not the base) lives on an 8 MiB tmpfs, with a 2 MiB filler
    // file beside it to delete later.
    const SIZE: usize = 32 * UMIB;
    let base = pattern(50, SIZE);
    for engine in ENGINES {
        let dir = TempDir::new(&format!("cow-enospc-{engine}"));
        let fs = SmallFs::mount(&dir, "8m");
        let filler = fs.0.join("filler");
        std::fs::write(&filler, vec![1u8; 2 * UMIB]).unwrap();
        let (overlay, name) = image_of(&dir, true, &base, &fs.0);
        let args = [s(&overlay), "--engine", engine];
        let server = Server::start(&dir, &args);
        let (mut c, _) = Client::open(&server.socket, name);

        // What the disk must read: the base, with every acknowledged write.
        // A failed write may leave each sector old or new, nothing else.
        let mut want = base.clone();
        let mut failed: Vec<(u64, Vec<u8>)> = Vec::new();
        let write = |c: &mut Client,
                     want: &mut Vec<u8>,
                     failed: &mut Vec<(u64, Vec<u8>)>,
                     off: u64,
                     data: Vec<u8>,
                     flags: u16| {
            let r = c.call(flags, CMD_WRITE, off, data.len() as u32, &data);
            if r.error == 0 {
                want[off as usize..off as usize + data.len()].copy_from_slice(&data);
            } else {
                failed.push((off, data));
            }
            r.error
        };
        // Whole-sector writes (1 MiB, through the engine; 64 KiB) and
        // unaligned ones (copy-up of both end sectors) until the file system
        // is full.
        let mut offset = 0u64;
        let mut n = 0u64;
        let error = loop {
            let (at, len) = match n % 3 {
                0 => (offset, UMIB),
                1 => (offset, 64 * UKIB),
                _ => (offset + 100, 5000),
            };
            let e = write(&mut c, &mut want, &mut failed, at, pattern(60 + n, len), 0);
            if e != 0 {
                break e;
            }
            offset = (at + len as u64).next_multiple_of(4096) + 4096;
            n += 1;
            assert!(offset < 20 * MIB, "{engine}: 20 MiB written to an 8 MiB file system without an error");
        };
        assert_eq!(error, ENOSPC, "{engine}: a write to a full overlay");
        assert!(offset >= 2 * MIB, "{engine}: ENOSPC after only {offset} bytes");
        // A partial write far away needs a copy-up, which cannot be written.
        let far = 24 * MIB;
        assert_eq!(
            write(&mut c, &mut want, &mut failed, far + 700, pattern(70, 1000), 0),
            ENOSPC,
            "{engine}: a copy-up"
        );
        assert_eq!(
            write(&mut c, &mut want, &mut failed, far + 8192, pattern(71, 8192), CMD_FLAG_FUA),
            ENOSPC,
            "{engine}: FUA"
        );
        // A FLUSH may fail (its bitmap block may need a page); it must not stop anything.
        let flush = c.call(0, CMD_FLUSH, 0, 0, &[]).error;
        assert!(flush == 0 || flush == ENOSPC, "{engine}: FLUSH on a full overlay got {flush}");
        // Acknowledged writes read back, untouched areas read the base, and
        // the sectors of failed writes read old or new data.
        check_disk(&mut c, &want, &failed, &format!("{engine}, full"));

        // Free space: delete the filler. Writes, the copy-up and FLUSH work again.
        std::fs::remove_file(&filler).unwrap();
        assert_eq!(
            write(&mut c, &mut want, &mut failed, far + 700, pattern(72, 1000), 0),
            0,
            "{engine}: copy-up after freeing"
        );
        assert_eq!(
            write(&mut c, &mut want, &mut failed, offset, pattern(73, 64 * UKIB), CMD_FLAG_FUA),
            0,
            "{engine}: a FUA write"
        );
        c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH after freeing space");
        // TRIM of overlay data punches holes there; the range reads as zeros.
        c.call(0, CMD_TRIM, 0, MIB as u32, &[]).assert_ok("TRIM");
        want[..UMIB].fill(0);
        c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH after TRIM");
        check_disk(&mut c, &want, &failed, &format!("{engine}, freed"));
        c.disconnect();
        server.stop();

        // A new server reads the same: the bitmap on disk points only at data
        // that was written.
        let server = Server::start(&dir, &args);
        let (mut c, _) = Client::open(&server.socket, name);
        check_disk(&mut c, &want, &failed, &format!("{engine}, re-served"));
        c.disconnect();
        server.stop();
        drop(fs);
    }
}

/// The whole disk equals `want`, except that each 512-byte sector a failed
/// write touched may hold that write's data instead.
fn check_disk(c: &mut Client, want: &[u8], failed: &[(u64, Vec<u8>)], what: &str) {
    let mut got = Vec::with_capacity(want.len());
    for at in (0..want.len()).step_by(4 * UMIB) {
        got.extend(c.read(at as u64, (4 * UMIB).min(want.len() - at) as u32));
    }
    for sector in (0..want.len()).step_by(512) {
        let (g, w) = (&got[sector..sector + 512], &want[sector..sector + 512]);
        if g == w {
            continue;
        }
        // The failed write covering this sector, laid over what it held.
        let ok = failed.iter().any(|(off, data)| {
            let (off, end) = (*off as usize, *off as usize + data.len());
            if end <= sector || off >= sector + 512 {
                return false;
            }
            let mut new = w.to_vec();
            let (from, to) = (off.max(sector), end.min(sector + 512));
            new[from - sector..to - sector].copy_from_slice(&data[from - off..to - off]);
            g == new
        });
        assert!(ok, "{what}: sector at byte {sector} holds data never written");
    }
}
