//! The FUSE export through the host kernel: `vdisk serve --fuse FILE` (and
//! `--fuse-uring`), the file turned into a block device by `losetup`, a real
//! ext4 made, filled, checked and read back. Also odd-offset I/O through the
//! file, hole punching, fsync, read-only, NBD and FUSE on one device, and
//! a stale mount from a killed server.
//!
//! These tests mount file systems and attach loop devices, so they run one at a
//! time (one process-wide lock) and need root, as CI has. Every mount and loop
//! device is released by a guard, also when a test fails.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::fuse::{fuse_args, fuse_disk, on_transport, serial, UringSwitch};
use common::{assert_same, output, qemu_io, read_file, run, text, vdisk_bounded, xorshift, Server, KIB, MIB};

/// A loop device over a file, detached when dropped.
struct Loop(String);

impl Loop {
    fn attach(file: &Path) -> Loop {
        let f = file.to_str().unwrap();
        let out = output("losetup", &["--find", "--show", "--direct-io=on", f]);
        let dev = if out.status.success() {
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        } else {
            // Direct I/O on the backing file is an optimisation; buffered loop works too.
            run("losetup", &["--find", "--show", f]).trim().to_owned()
        };
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        Loop(dev)
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A mounted file system, unmounted when dropped.
struct Mounted(PathBuf);

impl Mounted {
    fn new(dev: &str, dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        run("mount", &[dev, dir.to_str().unwrap()]);
        Mounted(dir.to_owned())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let p = self.0.to_str().unwrap();
        let st = Command::new("umount").arg(p).status();
        if !st.map(|s| s.success()).unwrap_or(false) {
            let _ = Command::new("umount").args(["-l", p]).status();
        }
    }
}

/// Deterministic bytes.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len).map(|_| (xorshift(&mut x) >> 32) as u8).collect()
}

/// A tree of files of many sizes (empty to 6 MiB) in nested directories.
fn make_tree(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for i in 0..120u64 {
        let dir = root.join(format!("d{}", i % 7)).join(format!("e{}", i % 3));
        std::fs::create_dir_all(&dir).unwrap();
        let size = match i % 6 {
            0 => 0,
            1 => 1 + (i as usize * 37) % 4000,
            2 => 4096 * (1 + i as usize % 5),
            3 => 65_536 + i as usize * 1013,
            4 => 300 * KIB + 17,
            _ => 1 + (i as usize * 7919) % (200 * KIB),
        };
        let rel = PathBuf::from(format!("d{}/e{}/f{i}.bin", i % 7, i % 3));
        std::fs::write(root.join(&rel), noise(size, i)).unwrap();
        files.push(rel);
    }
    std::fs::write(root.join("big.bin"), noise(6 * MIB + 123, 999)).unwrap();
    files.push("big.bin".into());
    files
}

/// Serves an image through FUSE (classic or ring), puts ext4 on it through a
/// loop device, copies a tree in, checks it with fsck, mounts it again and
/// compares every file.
fn ext4_roundtrip(ring: bool) {
    let (dir, img, file) = fuse_disk(if ring { "fuse-ring-ext4" } else { "fuse-ext4" }, "disk.img", "256M");
    let server = Server::start(&dir, &fuse_args(&img, &file, ring));
    let banner = server.stdout.join("\n");
    let transport = if ring { "FUSE-over-io_uring" } else { "/dev/fuse" };
    assert!(banner.contains(transport), "banner does not name {transport}:\n{banner}");
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 256 * MIB as u64, "the FUSE file has the image's size");

    let src = dir.path("src");
    let files = make_tree(&src);
    {
        let lo = Loop::attach(&file);
        run("mkfs.ext4", &["-q", "-F", &lo.0]);
        {
            let mnt = Mounted::new(&lo.0, &dir.path("mnt"));
            run("cp", &["-a", &format!("{}/.", src.display()), mnt.0.to_str().unwrap()]);
            run("sync", &[]);
        }
        let fsck = output("fsck.ext4", &["-f", "-n", &lo.0]);
        assert!(fsck.status.success(), "fsck.ext4 found problems after unmount:\n{}", text(&fsck));
        let mnt = Mounted::new(&lo.0, &dir.path("mnt"));
        for rel in &files {
            let what = format!("{} read back through ext4 on FUSE ({transport})", rel.display());
            assert_same(&what, &read_file(&mnt.0.join(rel)), &read_file(&src.join(rel)));
        }
    }
    server.stop();
    assert!(!file.exists(), "the FUSE file vdisk created was not removed at exit");
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(file.to_str().unwrap()),
        "{} is still mounted after stop",
        file.display()
    );
}

#[test]
fn fuse_ext4_through_loop_device() {
    on_transport(false, ext4_roundtrip);
}

#[test]
fn fuse_uring_ext4_through_loop_device() {
    let _s = serial();
    let (_dir, img, file) = fuse_disk("fuse-ring-off", "d.img", "16M");
    {
        let _off = UringSwitch::set("N");
        let out = vdisk_bounded(&["serve", img.to_str().unwrap(), "--fuse", file.to_str().unwrap(), "--fuse-uring"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--fuse-uring with the switch off must fail:\n{}", text(&out));
        assert!(err.contains("echo Y > /sys/module/fuse/parameters/enable_uring (as root)"), "unclear error: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
    let _on = UringSwitch::on();
    ext4_roundtrip(true);
}

/// Reads and writes at odd offsets through the file, fsync, a punched hole,
/// a zeroed range and SEEK_DATA/SEEK_HOLE, all checked against the image file
/// itself; over /dev/fuse and over the ring.
#[test]
fn fuse_file_io_matches_the_image() {
    on_transport(false, file_io);
    on_transport(true, file_io);
}

fn file_io(ring: bool) {
    let (dir, img, file) = fuse_disk(if ring { "fuse-ring-io" } else { "fuse-io" }, "d.img", "32M");
    let server = Server::start(&dir, &fuse_args(&img, &file, ring));
    let f = OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let pieces = [(1u64, 1usize), (4095, 2), (12_345, 70_001), (MIB as u64 - 7, 2 * MIB + 11), (31 * MIB as u64, MIB)];
    for (i, &(off, len)) in pieces.iter().enumerate() {
        f.write_all_at(&noise(len, i as u64 + 10), off).unwrap();
    }
    f.sync_all().unwrap();
    let image = read_file(&img);
    let through = {
        let mut v = vec![0u8; 32 * MIB];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    };
    assert_same("whole disk through FUSE vs the image", &through, &image);
    for (i, &(off, len)) in pieces.iter().enumerate() {
        let mut got = vec![0u8; len];
        f.read_exact_at(&mut got, off).unwrap();
        assert_same(&format!("piece {i} at {off}"), &got, &noise(len, i as u64 + 10));
    }
    // A read past the end is short, as on any file.
    let mut tail = vec![0u8; 8192];
    assert_eq!(f.read_at(&mut tail, 32 * MIB as u64 - 100).unwrap(), 100);

    // fallocate -p: FALLOCATE(PUNCH_HOLE|KEEP_SIZE) -> trim; -z: ZERO_RANGE -> write zeroes.
    let blocks_before = std::fs::metadata(&img).unwrap().blocks();
    run("fallocate", &["-p", "-o", "1M", "-l", "2M", file.to_str().unwrap()]);
    run("fallocate", &["-z", "-o", &(31 * MIB).to_string(), "-l", "64K", file.to_str().unwrap()]);
    f.sync_all().unwrap();
    let image = read_file(&img);
    assert!(image[MIB..3 * MIB].iter().all(|&b| b == 0), "punched range does not read as zeros");
    assert!(image[31 * MIB..31 * MIB + 64 * KIB].iter().all(|&b| b == 0), "zeroed range does not read as zeros");
    assert!(image[31 * MIB + 64 * KIB..].iter().any(|&b| b != 0), "zeroing went past its range");
    assert!(std::fs::metadata(&img).unwrap().blocks() < blocks_before, "punching 2 MiB freed no blocks of the image");
    // SEEK_DATA / SEEK_HOLE through the file (FUSE_LSEEK -> block status) agree with the image's own.
    let img_f = std::fs::File::open(&img).unwrap();
    for off in [0u64, 100_000, 2 * MIB as u64, 3 * MIB as u64 + 100, 20 * MIB as u64, 31 * MIB as u64 + 70_000] {
        for (whence, name) in [(libc::SEEK_DATA, "SEEK_DATA"), (libc::SEEK_HOLE, "SEEK_HOLE")] {
            let want = seek(&img_f, off, whence);
            let got = seek(&f, off, whence);
            assert_eq!(got, want, "{name} from {off}: FUSE file says {got:?}, the image {want:?}");
        }
    }
    // The size cannot change: the file is a disk.
    assert!(f.set_len(MIB as u64).is_err(), "truncate was allowed");
    assert!(f.write_all_at(b"x", 32 * MIB as u64).is_err(), "a write past the end was allowed");
    drop(f);
    server.stop();
}

/// lseek(2) with SEEK_DATA/SEEK_HOLE: the offset, or the errno.
fn seek(f: &std::fs::File, off: u64, whence: i32) -> Result<i64, i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on an open descriptor only moves its offset.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off as i64, whence) };
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(r)
    }
}

#[test]
fn fuse_readonly_refuses_writes() {
    let _s = serial();
    let (dir, img, file) = fuse_disk("fuse-ro", "d.img", "8M");
    std::fs::OpenOptions::new().write(true).open(&img).unwrap().write_all_at(b"hello", 4096).unwrap();
    let server = Server::start(&dir, &[img.to_str().unwrap(), "--fuse", file.to_str().unwrap(), "--readonly"]);
    let err = OpenOptions::new().write(true).open(&file).expect_err("opening a read-only export for writing");
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let mut got = [0u8; 5];
    std::fs::File::open(&file).unwrap().read_exact_at(&mut got, 4096).unwrap();
    assert_eq!(&got, b"hello");
    let out = output("fallocate", &["-p", "-o", "0", "-l", "4096", file.to_str().unwrap()]);
    assert!(!out.status.success(), "punching a read-only export worked:\n{}", text(&out));
    server.stop();
}

/// One engine under both exports: what NBD writes, the FUSE file reads, and back.
#[test]
fn fuse_and_nbd_share_one_device() {
    let _s = serial();
    let (dir, img, file) = fuse_disk("fuse-nbd", "shared.img", "16M");
    let server = Server::start(&dir, &fuse_args(&img, &file, false));
    let uri = server.uri("shared");
    qemu_io(&uri, &["write -P 0x5a 1000000 300000", "flush"]);
    let f = OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let mut got = vec![0u8; 300_000];
    f.read_exact_at(&mut got, 1_000_000).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a), "the FUSE file does not see what NBD wrote");
    f.write_all_at(&[0xc3; 8192], 5 * MIB as u64 + 3).unwrap();
    f.sync_all().unwrap();
    qemu_io(&uri, &[format!("read -P 0xc3 {} 8192", 5 * MIB + 3)]);
    drop(f);
    server.stop();
}

/// A server killed with SIGKILL leaves a dead mount; the next start on the
/// same file clears it (and says so) and serves again.
#[test]
fn fuse_stale_mount_is_cleared_at_start() {
    let _s = serial();
    let (dir, img, file) = fuse_disk("fuse-stale", "d.img", "8M");
    let args = fuse_args(&img, &file, false);
    let first = Server::start(&dir, &args);
    let st = first.stop_with(libc::SIGKILL);
    assert!(!st.success());
    let err = std::fs::metadata(&file).expect_err("a dead FUSE mount");
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
    let _ = std::fs::remove_file(dir.path("nbd.sock"));

    let second = Server::start(&dir, &args);
    let banner = second.stdout.join("\n");
    assert!(banner.contains("stale FUSE mount"), "no word of the stale mount:\n{banner}");
    let f = OpenOptions::new().read(true).write(true).open(&file).unwrap();
    f.write_all_at(b"again", 123).unwrap();
    f.sync_all().unwrap();
    drop(f);
    second.stop();
    let mut got = [0u8; 5];
    std::fs::File::open(&img).unwrap().read_exact_at(&mut got, 123).unwrap();
    assert_eq!(&got, b"again");
    // vdisk did not create the file the second time (the first one did): it stays.
    let _ = std::fs::remove_file(&file);
}

/// SIGTERM while a loop device still uses the file: the server does not hang
/// on the busy mount; it aborts the connection, unmounts and exits cleanly,
/// and the loop device can still be detached.
#[test]
fn fuse_stop_with_loop_device_attached() {
    let _s = serial();
    let (dir, img, file) = fuse_disk("fuse-busy", "d.img", "16M");
    let server = Server::start(&dir, &fuse_args(&img, &file, false));
    let lo = Loop::attach(&file);
    let st = server.stop_with(libc::SIGTERM);
    assert!(st.success(), "vdisk exited with {st} when stopped with a loop device attached");
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(file.to_str().unwrap()),
        "{} is still mounted after stop",
        file.display()
    );
    drop(lo);
}
