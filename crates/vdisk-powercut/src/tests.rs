//! The storage's own rules, and what this kernel sends it (printed, for
//! docs/design.md's table of what the kernel carries).

use super::*;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;

fn mountpoint(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("vdisk-powercut-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn only_fsynced_writes_survive_a_cut() {
    let mut s = Storage::mount(&mountpoint("rules")).unwrap();
    let f = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(s.path("a")).unwrap();
    f.write_all_at(&[1u8; 4096], 0).unwrap();
    f.sync_data().unwrap();
    f.write_all_at(&[2u8; 4096], 0).unwrap();
    f.write_all_at(&[3u8; 512], 8192).unwrap();
    let mut buf = [0u8; 4096];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, [2u8; 4096], "reads see what was written");
    s.cut(Survival::Nothing);
    assert!(f.write_all_at(&[4u8; 1], 0).is_err(), "a dead storage fails writes");
    drop(f);
    s.restart().unwrap();
    let got = std::fs::read(s.path("a")).unwrap();
    assert_eq!(got, vec![1u8; 4096], "the unsynced write and the size change are gone");
    assert_eq!(s.stats().cuts, 1);
}

#[test]
fn a_rename_replaces_the_target_at_once_and_keeps_what_was_synced() {
    let mut s = Storage::mount(&mountpoint("rename")).unwrap();
    std::fs::write(s.path("b"), [7u8; 512]).unwrap();
    let f = OpenOptions::new().create(true).truncate(true).write(true).open(s.path("a.tmp")).unwrap();
    f.write_all_at(&[1u8; 1024], 0).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(&[2u8; 512], 1024).unwrap();
    drop(f);
    std::fs::rename(s.path("a.tmp"), s.path("b")).unwrap();
    assert!(std::fs::metadata(s.path("a.tmp")).is_err(), "the old name is gone");
    s.cut(Survival::Nothing);
    s.restart().unwrap();
    assert!(std::fs::metadata(s.path("a.tmp")).is_err(), "the rename survived the cut");
    assert_eq!(std::fs::read(s.path("b")).unwrap(), vec![1u8; 1024], "the target holds what was synced, only");
}

#[test]
fn random_survival_tears_at_sector_boundaries() {
    let mut s = Storage::mount(&mountpoint("random")).unwrap();
    let f = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(s.path("a")).unwrap();
    f.write_all_at(&vec![0u8; 64 << 10], 0).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(&vec![9u8; 64 << 10], 0).unwrap();
    drop(f);
    s.cut(Survival::Random(7));
    s.restart().unwrap();
    let got = std::fs::read(s.path("a")).unwrap();
    let kept = got.chunks(512).filter(|c| c.iter().all(|&b| b == 9)).count();
    let lost = got.chunks(512).filter(|c| c.iter().all(|&b| b == 0)).count();
    assert_eq!(kept + lost, 128, "every sector whole");
    assert!(kept > 20 && lost > 20, "some survive, some not: {kept} kept, {lost} lost");
}

/// Writes 4 KiB at 0 through `f` with RWF_DSYNC, with a blocking pwritev2
/// or an io_uring WRITEV, and returns the FSYNCs the storage saw for it.
fn fsyncs_for_dsync_write(s: &Storage, f: &std::fs::File, ring: bool) -> u64 {
    #[repr(align(4096))]
    struct Page([u8; 4096]);
    let page = Page([5u8; 4096]);
    let iov = libc::iovec { iov_base: page.0.as_ptr() as *mut _, iov_len: 4096 };
    let before = s.stats().fsyncs;
    if ring {
        let mut r = io_uring::IoUring::new(4).unwrap();
        let e = io_uring::opcode::Writev::new(io_uring::types::Fd(f.as_raw_fd()), &iov, 1)
            .offset(0)
            .rw_flags(libc::RWF_DSYNC)
            .build();
        // SAFETY: the iovec and the page it points at outlive the completion, awaited below.
        unsafe { r.submission().push(&e).unwrap() };
        r.submit_and_wait(1).unwrap();
        let res = r.completion().next().unwrap().result();
        assert_eq!(res, 4096, "io_uring write");
    } else {
        // SAFETY: one valid iovec over a live page.
        let n = unsafe { libc::pwritev2(f.as_raw_fd(), &iov, 1, 0, libc::RWF_DSYNC) };
        assert_eq!(n, 4096, "pwritev2: {}", io::Error::last_os_error());
    }
    s.stats().fsyncs - before
}

#[test]
fn what_the_kernel_sends_for_dsync_writes() {
    kernel_rows(false);
}

/// The same with FOPEN_DIRECT_IO answered to every OPEN.
#[test]
fn what_the_kernel_sends_for_dsync_writes_with_fopen_direct_io() {
    let rows = kernel_rows_of(true);
    for (what, n) in &rows {
        eprintln!("FOPEN_DIRECT_IO, {what}: {n} FSYNC");
    }
}

fn kernel_rows(direct_io: bool) {
    let rows = kernel_rows_of(direct_io);
    for (what, n) in &rows {
        eprintln!("{what}: {n} FSYNC");
    }
    // What vdisk relies on: a blocking RWF_DSYNC write is followed by an FSYNC.
    assert_eq!(rows[0].1, 1);
    assert_eq!(rows[1].1, 1);
}

fn kernel_rows_of(direct_io: bool) -> Vec<(&'static str, u64)> {
    let s = Storage::mount_with(&mountpoint(if direct_io { "kernel-dio" } else { "kernel" }), direct_io).unwrap();
    std::fs::write(s.path("a"), vec![0u8; 1 << 20]).unwrap();
    let buffered = OpenOptions::new().read(true).write(true).open(s.path("a")).unwrap();
    let direct = OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(s.path("a")).unwrap();
    let rows = [
        ("buffered pwritev2(RWF_DSYNC)", fsyncs_for_dsync_write(&s, &buffered, false)),
        ("O_DIRECT pwritev2(RWF_DSYNC)", fsyncs_for_dsync_write(&s, &direct, false)),
        ("buffered io_uring WRITEV(RWF_DSYNC)", fsyncs_for_dsync_write(&s, &buffered, true)),
        ("O_DIRECT io_uring WRITEV(RWF_DSYNC)", fsyncs_for_dsync_write(&s, &direct, true)),
    ];
    let st = s.stats();
    assert_eq!(st.dsync_writes, 4, "every one of them carried O_DSYNC in the WRITE's flags: {st:?}");
    rows.to_vec()
}
