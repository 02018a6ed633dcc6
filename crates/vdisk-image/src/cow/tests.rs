//! Overlays end to end at the image level: the tests play the engine's part
//! (prepare_write → map_write → pwrite → write_done; map_read → pread).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::testing::write;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("vdisk-cow-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn base_data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8 | 1).collect()
}

/// A backing file of `len` bytes of non-zero data and an overlay over it.
fn setup(dir: &Dir, len: usize) -> (PathBuf, PathBuf, Vec<u8>) {
    let base = dir.path("base.img");
    let data = base_data(len);
    std::fs::write(&base, &data).unwrap();
    let overlay = dir.path("disk.cow");
    CowImage::create(&overlay, &base).unwrap();
    (base, overlay, data)
}

fn open(overlay: &Path) -> CowImage {
    CowImage::open(overlay, false, None, false).unwrap()
}

fn read(img: &CowImage, offset: u64, len: u64) -> Vec<u8> {
    let mut ext = Vec::new();
    img.map_read(offset, len, &mut ext).unwrap();
    let mut out = vec![0u8; len as usize];
    let mut at = 0;
    for e in ext {
        let Extent::Data { file, offset, len } = e else { panic!("{e:?}") };
        read_full(&img.files()[file], &mut out[at..at + len as usize], offset).unwrap();
        at += len as usize;
    }
    out
}

#[test]
fn created_overlay_has_uml_layout_and_reads_the_backing_file() {
    let dir = Dir::new("create");
    let (base, overlay, data) = setup(&dir, 10 << 20);
    let img = open(&overlay);
    assert_eq!(img.size(), 10 << 20);
    assert_eq!(img.format(), "cow");
    assert_eq!(img.header().data_offset(), 12288);
    assert_eq!(std::fs::metadata(&overlay).unwrap().len(), 12288 + (10 << 20));
    assert_eq!(img.header().backing_path(), base.canonicalize().unwrap());
    let mut ext = Vec::new();
    img.map_read(0, 10 << 20, &mut ext).unwrap();
    assert_eq!(ext, [Extent::Data { file: 1, offset: 0, len: 10 << 20 }]);
    assert_eq!(read(&img, 1000, 5000), data[1000..6000]);
    assert_eq!(img.allocated_sectors(), 0);
    let e = CowImage::create(&overlay, &base).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
}

#[test]
fn reads_map_to_runs_not_sectors() {
    let dir = Dir::new("runs");
    let (_, overlay, mut model) = setup(&dir, 1 << 20);
    let img = open(&overlay);
    write(&img, 4096, &[7u8; 8192]);
    model[4096..12288].fill(7);
    write(&img, 65536, &[9u8; 512]);
    model[65536..66048].fill(9);
    let mut ext = Vec::new();
    img.map_read(0, 1 << 20, &mut ext).unwrap();
    let d = img.header().data_offset();
    assert_eq!(
        ext,
        [
            Extent::Data { file: 1, offset: 0, len: 4096 },
            Extent::Data { file: 0, offset: d + 4096, len: 8192 },
            Extent::Data { file: 1, offset: 12288, len: 65536 - 12288 },
            Extent::Data { file: 0, offset: d + 65536, len: 512 },
            Extent::Data { file: 1, offset: 66048, len: (1 << 20) - 66048 },
        ]
    );
    // Unaligned reads start and end inside runs.
    ext.clear();
    img.map_read(4000, 200, &mut ext).unwrap();
    assert_eq!(
        ext,
        [Extent::Data { file: 1, offset: 4000, len: 96 }, Extent::Data { file: 0, offset: d + 4096, len: 104 }]
    );
    assert_eq!(read(&img, 0, 1 << 20), model);
    assert_eq!(img.allocated_sectors(), 17);
}

#[test]
fn partial_sector_writes_copy_the_rest_up() {
    let dir = Dir::new("copyup");
    // A size that is not a multiple of the sector: the last sector is short.
    let size = (1 << 20) + 300;
    let (_, overlay, mut model) = setup(&dir, size);
    let img = open(&overlay);
    let cases: [(usize, usize); 5] = [(700, 100), (1000, 1100), (4095, 2), (size - 10, 10), (size - 400, 200)];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let data = vec![0xa0 + i as u8; len];
        write(&img, off as u64, &data);
        model[off..off + len].copy_from_slice(&data);
        assert_eq!(read(&img, 0, size as u64), model, "after writing {len} bytes at {off}");
    }
    // Sector 1 (700..800) is whole in the overlay: backing bytes around the write.
    let d = img.header().data_offset();
    let mut sector = [0u8; 512];
    img.files()[0].read_exact_at(&mut sector, d + 512).unwrap();
    assert_eq!(sector[..], model[512..1024]);
    // Written sectors: 1, 1..=4, 7..=8, and the last two (one of them short).
    assert_eq!(img.allocated_sectors(), 1 + 3 + 2 + 2);
    drop(img);
}

#[test]
fn concurrent_partial_writes_to_one_sector_all_land() {
    let dir = Dir::new("stripes");
    let (_, overlay, mut model) = setup(&dir, 256 << 10);
    let img = Arc::new(open(&overlay));
    // 16 threads each write 32 bytes of every one of the first 64 sectors.
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let img = img.clone();
            std::thread::spawn(move || {
                for s in 0..64u64 {
                    write(&*img, s * 512 + t * 32, &[t as u8 + 1; 32]);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    for s in 0..64usize {
        for t in 0..16usize {
            model[s * 512 + t * 32..s * 512 + t * 32 + 32].fill(t as u8 + 1);
        }
    }
    assert_eq!(read(&img, 0, 256 << 10), model);
}

#[test]
fn bits_reach_the_file_on_sync_or_durable_writes_only() {
    let dir = Dir::new("sync");
    let (base, overlay, _) = setup(&dir, 1 << 20);
    let reopen = |img: CowImage| {
        drop(img);
        let img = CowImage::open(&overlay, true, None, false).unwrap();
        img.allocated_sectors()
    };
    let img = open(&overlay);
    write(&img, 0, &[1u8; 4096]);
    assert_eq!(reopen(img), 0, "a write without flush leaves the on-disk bitmap alone");
    let img = open(&overlay);
    write(&img, 0, &[1u8; 4096]);
    img.sync_metadata().unwrap();
    assert_eq!(reopen(img), 8);
    let img = open(&overlay);
    img.prepare_write(8192, 512).unwrap();
    img.files()[0].write_all_at(&[2u8; 512], img.header().data_offset() + 8192).unwrap();
    img.write_done(8192, 512, true).unwrap();
    assert_eq!(reopen(img), 9, "a durable write_done persists its bits");
    // The bitmap on disk is exactly what UML would write: bits 0..8 and 16.
    let h = parse_header(&std::fs::read(&overlay).unwrap()[..MAX_HEADER_LEN]).unwrap();
    let mut bits = [0u8; 4];
    File::open(&overlay).unwrap().read_exact_at(&mut bits, h.bitmap_offset()).unwrap();
    assert_eq!(bits, [0xff, 0, 0x01, 0]);
    let _ = base;
}

#[test]
fn trimmed_and_zeroed_ranges_read_zeros_over_backing_data() {
    let dir = Dir::new("zero");
    let (_, overlay, mut model) = setup(&dir, 1 << 20);
    let img = open(&overlay);
    // What the engine does for TRIM / WRITE_ZEROES: prepare, punch the mapped range, write_done.
    for (off, len) in [(8192u64, 65536u64), (100_001, 999)] {
        img.prepare_write(off, len).unwrap();
        let mut ext = Vec::new();
        img.map_write(off, len, &mut ext).unwrap();
        for e in ext {
            let Extent::Data { file, offset, len } = e else { panic!() };
            // SAFETY: fallocate only reads its integer arguments; the fd is open.
            let r = unsafe {
                libc::fallocate(
                    img.files()[file].as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as i64,
                    len as i64,
                )
            };
            assert_eq!(r, 0);
        }
        img.write_done(off, len, false).unwrap();
        model[off as usize..(off + len) as usize].fill(0);
    }
    assert_eq!(read(&img, 0, 1 << 20), model);
    // Block status: zeroed overlay runs are holes, backing data is data.
    let mut st = Vec::new();
    img.allocation(0, 1 << 20, 100, &mut st).unwrap();
    assert_eq!(st.iter().map(|a| a.len).sum::<u64>(), 1 << 20);
    assert!(!st[0].hole && st[0].len == 8192, "{st:?}");
    assert!(st[1].hole && st[1].zero && st[1].len == 65536, "{st:?}");
    let mut one = Vec::new();
    img.allocation(0, 1 << 20, 1, &mut one).unwrap();
    assert_eq!(one, [st[0]]);
}

#[test]
fn allocation_shows_backing_holes() {
    let dir = Dir::new("alloc");
    let base = dir.path("base.img");
    let f = File::create(&base).unwrap();
    f.set_len(4 << 20).unwrap();
    f.write_all_at(&[1u8; 65536], 1 << 20).unwrap();
    drop(f);
    let overlay = dir.path("o.cow");
    CowImage::create(&overlay, &base).unwrap();
    let img = open(&overlay);
    write(&img, 3 << 20, &[5u8; 4096]);
    let mut st = Vec::new();
    img.allocation(0, 4 << 20, 100, &mut st).unwrap();
    let type_at = |pos: u64| {
        let mut o = 0;
        st.iter().find(|a| {
            o += a.len;
            pos < o
        })
    };
    assert!(type_at(0).unwrap().hole, "{st:?}");
    assert!(!type_at(1 << 20).unwrap().hole, "{st:?}");
    assert!(!type_at(3 << 20).unwrap().hole, "{st:?}");
    assert!(type_at((3 << 20) + 8192).unwrap().hole, "{st:?}");
}

/// The error's text, and the advice the binary would word (a library names no flag).
fn open_err(overlay: &Path) -> String {
    match CowImage::open(overlay, false, None, false) {
        Ok(_) => panic!("{} opened", overlay.display()),
        Err(e) => format!("{e} [advice: {:?}]", e.advice()),
    }
}

#[test]
fn bad_overlays_are_refused_with_the_file_named() {
    let dir = Dir::new("bad");
    let (base, overlay, _) = setup(&dir, 1 << 20);
    let good = std::fs::read(&overlay).unwrap();
    let name = overlay.display().to_string();
    let variant = |bytes: &[u8]| {
        let p = dir.path("bad.cow");
        std::fs::write(&p, bytes).unwrap();
        let e = open_err(&p);
        assert!(e.contains(&p.display().to_string()), "{e}");
        e
    };
    assert!(variant(&good[..100]).contains("truncated"));
    assert!(variant(&[b"QFI\xfb".as_slice(), &good[4..]].concat()).contains("not a COW overlay"));
    assert!(variant(&[&good[..4], &[0, 0, 0, 2], &good[8..]].concat()).contains("version 2"));
    assert!(variant(&[&good[..4], &[0, 0, 0, 1], &good[8..]].concat()).contains("version 1"));
    assert!(variant(&good[..8192 + 100]).contains("too short for the bitmap"));
    assert!(variant(&[&good[..20], &[0, 0, 0, 0], &good[24..]].concat()).contains("sector size 0"));
    assert!(variant(&[&good[..20], &[0, 0, 3, 0], &good[24..]].concat()).contains("sector size 768"));

    // The backing file changes.
    let touch = |path: &Path, secs: i64| {
        let times = [libc::timespec { tv_sec: secs, tv_nsec: 0 }; 2];
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: both pointers are valid for the call; utimensat only reads them.
        assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) }, 0);
    };
    touch(&base, 1_000_000_000);
    let e = open_err(&overlay);
    assert!(e.contains("modified after") && e.contains(&name) && e.contains("IgnoreBackingMtime"), "{e}");
    assert!(CowImage::open(&overlay, false, None, true).is_ok());
    std::fs::OpenOptions::new().append(true).open(&base).unwrap().write_all_at(&[0], 1 << 20).unwrap();
    let e = open_err(&overlay);
    assert!(e.contains("1048577 bytes") && e.contains("NameBacking"), "{e}");
    std::fs::rename(&base, dir.path("moved.img")).unwrap();
    let e = open_err(&overlay);
    assert!(e.contains("base.img") && e.contains(&name) && e.contains("NameBacking"), "{e}");

    // --backing names another file; its size still has to match.
    let other = dir.path("other.img");
    std::fs::write(&other, base_data(1 << 20)).unwrap();
    touch(&other, 1_000_000_000);
    let e = CowImage::open(&overlay, false, Some(&other), false).err().unwrap().to_string();
    assert!(e.contains("modified after") && e.contains("other.img"), "{e}");
    let img = CowImage::open(&overlay, false, Some(&other), true).unwrap();
    assert_eq!(img.backing_path(), other);
    let e = CowImage::open(&overlay, true, Some(&other), true).err().unwrap().to_string();
    assert!(e.contains("in use"), "a second open while one writes: {e}");
    drop(img);
    let e = CowImage::open(&overlay, false, Some(&overlay), true).err().unwrap().to_string();
    assert!(e.contains("overlay itself"), "{e}");
}

#[test]
fn relative_backing_paths_resolve_from_the_overlay_directory() {
    let dir = Dir::new("relative");
    let (_, overlay, data) = setup(&dir, 1 << 20);
    // Rewrite the header with a relative path, as another tool might.
    let mut bytes = std::fs::read(&overlay).unwrap();
    let mut h = parse_header(&bytes[..MAX_HEADER_LEN]).unwrap();
    h.backing = b"base.img".to_vec();
    bytes[..HEADER_LEN].copy_from_slice(&h.to_bytes());
    let sub = dir.path("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("o.cow"), &bytes).unwrap();
    std::fs::rename(dir.path("base.img"), sub.join("base.img")).unwrap();
    // Whatever the current directory, the overlay's sibling is the one opened.
    let img = CowImage::open(&sub.join("o.cow"), true, None, true).unwrap();
    assert_eq!(img.backing_path(), sub.join("base.img"));
    assert_eq!(read(&img, 0, 4096), data[..4096]);
    let info = inspect(&sub.join("o.cow")).unwrap();
    assert_eq!(info.backing_resolved, sub.join("base.img"));
    assert_eq!(info.header.backing, b"base.img");
}

#[test]
fn commit_in_place_and_into_a_new_image() {
    let dir = Dir::new("commit");
    let (base, overlay, mut model) = setup(&dir, (1 << 20) + 512);
    let img = open(&overlay);
    write(&img, 777, &[3u8; 3000]);
    write(&img, 1 << 20, &[4u8; 512]);
    model[777..3777].fill(3);
    model[1 << 20..].fill(4);
    img.sync_metadata().unwrap();
    drop(img);
    let img = CowImage::open(&overlay, true, None, false).unwrap();
    let merged = dir.path("merged.img");
    img.write_merged(&merged, &|_, _| {}).unwrap();
    assert_eq!(std::fs::read(&merged).unwrap(), model);
    drop(img);
    let o = OverlayOptions { backing_writable: true, ..Default::default() };
    let img = CowImage::open_with(&overlay, &o).unwrap();
    let seen = std::cell::Cell::new((0, 0));
    let copied = img.commit_to_backing(&|d, t| seen.set((d, t))).unwrap();
    assert_eq!(copied, 7 * 512 + 512);
    assert_eq!(seen.get(), (copied, copied));
    assert_eq!(std::fs::read(&base).unwrap(), model);
}
