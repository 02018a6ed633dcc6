//! The FUSE export with its image on storage that loses power
//! (crates/vdisk-powercut): a client of vdisk's FUSE file writes through
//! O_DSYNC, O_SYNC and O_DIRECT|O_DSYNC descriptors, with an asynchronous
//! io_uring RWF_DSYNC write, and with plain writes followed by fsync or
//! fdatasync; then the storage's power is cut (vdisk is killed after it),
//! and every one of those writes must be in what the storage kept. Both
//! transports (/dev/fuse, FUSE-over-io_uring), both engines, and --direct.
//!
//! Also: starting and stopping the FUSE export in a loop, with a `stat` of
//! the new file each time, on both transports; and shared mmap of the file.
//!
//! These tests mount file systems, so they run one at a time and need root.

mod common;

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use common::fuse::{fuse_args, fuse_disk, on_transport};
use common::{Server, TempDir, MIB};
use vdisk_powercut::{Storage, Survival};

const DISK: usize = 16 * MIB;
const PIECE: usize = 64 << 10;

fn pattern(round: u64, piece: u64) -> Vec<u8> {
    let mut x = (round << 32 ^ piece).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..PIECE).map(|_| common::xorshift(&mut x) as u8).collect()
}

/// A page-aligned copy of `data`, for O_DIRECT.
struct Aligned(*mut u8, usize);

impl Aligned {
    fn new(data: &[u8]) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(data.len(), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: p holds data.len() bytes, freshly allocated, not overlapping data.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Aligned(p, data.len())
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.0, std::alloc::Layout::from_size_align(self.1, 4096).unwrap()) };
    }
}

/// How one piece is written; each must be durable once the call returns.
const WAYS: [&str; 7] = [
    "O_DSYNC write",
    "O_SYNC write",
    "O_DIRECT|O_DSYNC write",
    "write + fsync",
    "write + fdatasync",
    "pwritev2(RWF_DSYNC)",
    "io_uring O_DIRECT RWF_DSYNC write",
];

/// Writes `data` at `offset` the way numbered `way`; returns the descriptor,
/// which the caller keeps open until after the power cut (a close sends
/// FLUSH, which vdisk makes a flush: it would hide a lost sync flag).
fn write_piece(file: &Path, way: usize, offset: u64, data: &[u8]) -> std::fs::File {
    let open = |flags: i32| OpenOptions::new().read(true).write(true).custom_flags(flags).open(file).unwrap();
    match way {
        0 => {
            let f = open(libc::O_DSYNC);
            f.write_all_at(data, offset).unwrap();
            f
        }
        1 => {
            let f = open(libc::O_SYNC);
            f.write_all_at(data, offset).unwrap();
            f
        }
        2 => {
            let f = open(libc::O_DIRECT | libc::O_DSYNC);
            let buf = Aligned::new(data);
            // SAFETY: buf holds data.len() readable bytes.
            let n = unsafe { libc::pwrite(f.as_raw_fd(), buf.0.cast(), buf.1, offset as i64) };
            assert_eq!(n as usize, data.len(), "{}", std::io::Error::last_os_error());
            f
        }
        3 => {
            let f = open(0);
            f.write_all_at(data, offset).unwrap();
            f.sync_all().unwrap();
            f
        }
        4 => {
            let f = open(0);
            f.write_all_at(data, offset).unwrap();
            f.sync_data().unwrap();
            f
        }
        5 => {
            let f = open(0);
            let iov = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
            // SAFETY: one iovec over live memory.
            let n = unsafe { libc::pwritev2(f.as_raw_fd(), &iov, 1, offset as i64, libc::RWF_DSYNC) };
            assert_eq!(n as usize, data.len(), "{}", std::io::Error::last_os_error());
            f
        }
        _ => {
            let f = open(libc::O_DIRECT);
            let buf = Aligned::new(data);
            let iov = libc::iovec { iov_base: buf.0.cast(), iov_len: buf.1 };
            let mut ring = io_uring::IoUring::new(4).unwrap();
            let e = io_uring::opcode::Writev::new(io_uring::types::Fd(f.as_raw_fd()), &iov, 1)
                .offset(offset)
                .rw_flags(libc::RWF_DSYNC)
                .build();
            // SAFETY: the iovec and its buffer outlive the completion, awaited here.
            unsafe { ring.submission().push(&e).unwrap() };
            ring.submit_and_wait(1).unwrap();
            let res = ring.completion().next().unwrap().result();
            assert_eq!(res as usize, data.len(), "io_uring write: {res}");
            f
        }
    }
}

fn detach(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: umount2 only reads the path.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

/// One round per way of writing, cycling through the engine configurations:
/// serve the image on the storage over FUSE, write one piece that way (and
/// unsynced noise beside it), cut the power, kill vdisk, check the storage.
/// One way per cut: a sync that works for one write makes every earlier
/// write of the file durable too, and would hide another way's loss.
fn sync_writes_survive(ring: bool) {
    let configs: [&[&str]; 3] = [&["--engine", "uring"], &["--engine", "threads"], &["--engine", "uring", "--direct"]];
    let dir = TempDir::new(if ring { "fuse-pl-ring" } else { "fuse-pl" });
    let mut storage = Storage::mount(&dir.path("store")).unwrap();
    std::fs::write(storage.path("disk.img"), vec![0u8; DISK]).unwrap();
    storage.sync_all();
    let img = storage.path("disk.img");
    let file = dir.path("disk");
    let mut lost = Vec::new();
    for (round, way) in (0..WAYS.len()).chain(0..WAYS.len()).enumerate() {
        let round = round as u64;
        let extra = configs[round as usize % configs.len()];
        let mut args = fuse_args(&img, &file, ring);
        args.extend_from_slice(extra);
        let server = Server::start(&dir, &args);
        let offset = (way * MIB) as u64;
        let plain = OpenOptions::new().write(true).open(&file).unwrap();
        plain.write_all_at(&pattern(round, 100), offset + 4 * PIECE as u64).unwrap();
        let synced = write_piece(&file, way, offset, &pattern(round, way as u64));
        plain.write_all_at(&pattern(round, 101), offset + 8 * PIECE as u64).unwrap();
        storage.cut(if round >= WAYS.len() as u64 { Survival::Random(round) } else { Survival::Nothing });
        drop(server); // SIGKILL
        drop((synced, plain));
        detach(&file);
        let _ = std::fs::remove_file(dir.path("nbd.sock"));
        storage.restart().unwrap();
        let disk = storage.durable("disk.img").unwrap();
        assert_eq!(disk.len(), DISK);
        if disk[way * MIB..way * MIB + PIECE] != pattern(round, way as u64)[..] {
            lost.push(format!("{} ({extra:?})", WAYS[way]));
        }
    }
    let _ = std::fs::remove_file(&file);
    let transport = if ring { "FUSE-over-io_uring" } else { "/dev/fuse" };
    assert!(lost.is_empty(), "{transport}: lost in a power cut although durable when the call returned: {lost:#?}");
}

#[test]
fn fuse_sync_writes_survive_a_power_cut() {
    on_transport(false, sync_writes_survive);
}

#[test]
fn fuse_uring_sync_writes_survive_a_power_cut() {
    on_transport(true, sync_writes_survive);
}

/// Starts vdisk with a FUSE export, `stat`s the file from another thread
/// from the moment the process starts until the file has the disk's size
/// (so a stat lands while the transport comes up), stops it with SIGTERM,
/// and again, `rounds` times. A stat that never returns fails the test.
fn start_stop_loop(ring: bool, rounds: usize) {
    let (dir, img, file) = fuse_disk(if ring { "fuse-loop-ring" } else { "fuse-loop" }, "d.img", "16M");
    let sock = dir.path("nbd.sock");
    for i in 0..rounds {
        let mut args = vec!["serve"];
        args.extend(fuse_args(&img, &file, ring));
        args.extend_from_slice(&["--socket", sock.to_str().unwrap()]);
        let mut child = std::process::Command::new(common::vdisk_bin())
            .args(&args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let f = file.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while std::time::Instant::now() < deadline {
                if std::fs::metadata(&f).is_ok_and(|m| m.len() == 16 * MIB as u64) {
                    let _ = tx.send(true);
                    return;
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            let _ = tx.send(false);
        });
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(true) => {}
            r => {
                let _ = child.kill();
                let _ = child.wait();
                detach(&file);
                let what =
                    if r.is_err() { "a stat of the file never returned" } else { "the file never got the disk's size" };
                panic!("{} start {i}: {what}", if ring { "--fuse-uring" } else { "--fuse" });
            }
        }
        // SAFETY: kill only reads its integer arguments.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let st = child.wait().unwrap();
        assert!(st.success(), "start {i}: vdisk exited with {st} after SIGTERM");
    }
}

#[test]
fn fuse_start_stat_stop_in_a_loop() {
    on_transport(false, |ring| start_stop_loop(ring, 15));
}

#[test]
fn fuse_uring_start_stat_stop_in_a_loop() {
    on_transport(true, |ring| start_stop_loop(ring, 30));
}

/// Shared mmap of the FUSE file (FUSE_DIRECT_IO_ALLOW_MMAP): stores through
/// the mapping reach the image with msync, and a write(2) through another
/// descriptor shows in the mapping.
fn shared_mmap(ring: bool) {
    let (dir, img, file) = fuse_disk(if ring { "fuse-mmap-ring" } else { "fuse-mmap" }, "d.img", "16M");
    let server = Server::start(&dir, &fuse_args(&img, &file, ring));
    let f = OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let len = MIB;
    // SAFETY: a fresh shared mapping of len bytes of an open file; unmapped below.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0)
    };
    assert_ne!(p, libc::MAP_FAILED, "shared mmap of the FUSE file: {}", std::io::Error::last_os_error());
    // SAFETY: p maps len bytes, readable and writable, until munmap below.
    let map = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
    map[4096..4096 + 11].copy_from_slice(b"hello mmap!");
    // SAFETY: p and len are the mapping's.
    assert_eq!(unsafe { libc::msync(p, len, libc::MS_SYNC) }, 0, "{}", std::io::Error::last_os_error());
    f.write_all_at(b"write(2) here", 8192).unwrap();
    let seen = map[8192..8192 + 13].to_vec();
    // SAFETY: p and len are the mapping's; `map` is not used after this.
    unsafe { libc::munmap(p, len) };
    assert_eq!(&seen, b"write(2) here", "the mapping does not show a write through another descriptor");
    drop(f);
    server.stop();
    let disk = common::read_file(&img);
    assert_eq!(&disk[4096..4096 + 11], b"hello mmap!", "a store through the mapping did not reach the image");
}

#[test]
fn fuse_shared_mmap_is_coherent() {
    on_transport(false, shared_mmap);
    on_transport(true, shared_mmap);
}

/// Runs a command; its output if it succeeded, else the panic names it.
fn sh(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", common::text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn umount(path: &Path) {
    let p = path.to_str().unwrap();
    if !std::process::Command::new("umount").arg(p).status().is_ok_and(|s| s.success()) {
        let _ = std::process::Command::new("umount").args(["-l", p]).status();
    }
}

/// ext4 on a loop device on vdisk's FUSE file, the image on the power-loss
/// storage: files written and fsynced (file and directory) survive a power
/// cut, and after the journal is replayed `fsck.ext4 -n -f` finds nothing.
fn ext4_power_cut(ring: bool, rounds: u64) {
    let dir = TempDir::new(if ring { "fuse-ext4-pl-ring" } else { "fuse-ext4-pl" });
    let mut storage = Storage::mount(&dir.path("store")).unwrap();
    std::fs::write(storage.path("disk.img"), vec![0u8; 64 * MIB]).unwrap();
    storage.sync_all();
    let img = storage.path("disk.img");
    let file = dir.path("disk");
    let mnt = dir.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let args = fuse_args(&img, &file, ring);
    let attach = || sh("losetup", &["--find", "--show", "--direct-io=on", file.to_str().unwrap()]).trim().to_owned();
    // Whatever happens, the mount, the loop devices on the file and the FUSE mount go at the end.
    struct Cleanup(PathBuf, PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            umount(&self.1);
            let list = std::process::Command::new("losetup").args(["-j", self.0.to_str().unwrap()]).output();
            for line in list.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default().lines() {
                if let Some(dev) = line.split(':').next() {
                    let _ = std::process::Command::new("losetup").args(["-d", dev]).status();
                }
            }
            detach(&self.0);
        }
    }
    let _cleanup = Cleanup(file.clone(), mnt.clone());
    let mut synced: Vec<(String, Vec<u8>)> = Vec::new();
    for round in 0..=rounds {
        let server = Server::start(&dir, &args);
        let lo = attach();
        if round == 0 {
            sh("mkfs.ext4", &["-q", "-F", &lo]);
        }
        sh("mount", &[&lo, mnt.to_str().unwrap()]);
        if round > 0 {
            // After the cut: the journal was replayed by the mount; every fsynced file is whole.
            for (name, data) in &synced {
                let got = std::fs::read(mnt.join(name)).unwrap_or_else(|e| panic!("round {round}: {name}: {e}"));
                assert!(got == *data, "round {round}: fsynced file {name} changed in the power cut");
            }
            umount(&mnt);
            let fsck = std::process::Command::new("fsck.ext4").args(["-n", "-f", &lo]).output().unwrap();
            assert!(fsck.status.success(), "round {round}: fsck.ext4 -n -f after the cut:\n{}", common::text(&fsck));
            sh("mount", &[&lo, mnt.to_str().unwrap()]);
        }
        if round == rounds {
            umount(&mnt);
            let _ = std::process::Command::new("losetup").args(["-d", &lo]).status();
            server.stop();
            break;
        }
        // Files written and fsynced (with their directory), then others left unsynced.
        let sub = mnt.join(format!("r{round}"));
        std::fs::create_dir_all(&sub).unwrap();
        for i in 0..8u64 {
            let name = format!("r{round}/f{i}");
            let data = pattern(round * 100 + i, i)[..(4096 * (i as usize + 1)).min(PIECE)].to_vec();
            let f = std::fs::File::create(mnt.join(&name)).unwrap();
            std::io::Write::write_all(&mut &f, &data).unwrap();
            f.sync_all().unwrap();
            std::fs::File::open(&sub).unwrap().sync_all().unwrap();
            std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
            synced.push((name, data));
        }
        for i in 0..8u64 {
            std::fs::write(sub.join(format!("unsynced{i}")), pattern(round * 100 + 50 + i, i)).unwrap();
        }
        storage.cut(if round % 2 == 1 { Survival::Random(round) } else { Survival::Nothing });
        drop(server); // SIGKILL
        umount(&mnt);
        let _ = std::process::Command::new("losetup").args(["-d", &lo]).status();
        detach(&file);
        let _ = std::fs::remove_file(dir.path("nbd.sock"));
        storage.restart().unwrap();
    }
    let _ = std::fs::remove_file(&file);
}

#[test]
fn fuse_ext4_keeps_fsynced_files_through_power_cuts() {
    on_transport(false, |ring| ext4_power_cut(ring, 2));
    on_transport(true, |ring| ext4_power_cut(ring, 1));
}
