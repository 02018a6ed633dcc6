//! A failing backing store: a file system that fills up (a real 8 MiB tmpfs),
//! a disk that fails reads and writes (the engine's fault injection,
//! `VDISK_FAULTS`: this kernel has no device-mapper for dm-error), and a COW
//! overlay's backing file deleted or truncated while it is served. The client
//! gets ENOSPC or EIO for the requests that failed, everything else keeps
//! working, and the server neither panics nor hangs: each test ends with a
//! clean SIGTERM stop (exit 0). docs/design.md ("Reliability") lists which
//! errors reach the client and which stop the device.

mod common;

use common::nbd::*;
use common::{create_image, output, text, vdisk, Server, TempDir, ENGINES};
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

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
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
