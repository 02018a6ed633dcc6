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
    // One sector: its whole page is copied up and goes to the overlay.
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
            Extent::Data { file: 0, offset: d + 65536, len: 4096 },
            Extent::Data { file: 1, offset: 69632, len: (1 << 20) - 69632 },
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
    assert_eq!(img.allocated_sectors(), 24);
}

#[test]
fn partial_page_writes_copy_the_rest_up() {
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
    // Page 0 (700..800 written) is whole in the overlay: backing bytes around the write.
    let d = img.header().data_offset();
    let mut page = [0u8; 4096];
    img.files()[0].read_exact_at(&mut page, d).unwrap();
    assert_eq!(page[..], model[..4096]);
    // Written pages: 0 (two writes), 1 (4095..4097 crosses into it), and the
    // last two: 255, and 256, one short sector.
    assert_eq!(img.allocated_sectors(), 8 + 8 + 8 + 1);
    assert_whole_pages(&img);
    drop(img);
}

#[test]
fn concurrent_partial_writes_to_one_page_all_land() {
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

/// Every page's bits are all set or all unset, as the UML kernel needs.
fn assert_whole_pages(img: &CowImage) {
    let k = img.header().page_sectors();
    for first in (0..img.map.sectors()).step_by(k as usize) {
        let end = (first + k).min(img.map.sectors());
        let n = img.map.count(first, end);
        assert!(n == 0 || n == end - first, "page of sectors {first}..{end} has {n} bits set");
    }
}

#[test]
fn two_partial_writes_into_one_fresh_page_both_land() {
    use crate::testing::{finish, start};
    let dir = Dir::new("race");
    let (_, overlay, mut model) = setup(&dir, 8 << 20);
    let img = open(&overlay);
    // Two writes to different sectors of one page (sector 1, part of sector 5),
    // each either started (copy-up, mapped) or finished (data, bits), in
    // every order: neither copy-up may overwrite the other's data.
    let (a, b) = ((512u64, [0xa1u8; 512]), (5 * 512 + 17, [0xb2u8; 100]));
    let orders: [[(bool, bool); 4]; 4] = [
        [(true, true), (false, true), (true, false), (false, false)], // A starts, B starts, A, B finish
        [(true, true), (true, false), (false, true), (false, false)], // A whole, then B
        [(false, true), (false, false), (true, true), (true, false)], // B whole, then A
        [(true, true), (false, true), (false, false), (true, false)], // B finishes before A
    ];
    for (i, order) in orders.iter().enumerate() {
        let page = 4096 * (1 + i as u64);
        let mut ext = [Vec::new(), Vec::new()];
        for &(is_a, starting) in order {
            let (off, data) = if is_a { (page + a.0, &a.1[..]) } else { (page + b.0, &b.1[..]) };
            let e = &mut ext[!is_a as usize];
            if starting {
                *e = start(&img, off, data.len() as u64);
            } else {
                finish(&img, off, e, data);
            }
        }
        for (off, data) in [(page + a.0, &a.1[..]), (page + b.0, &b.1[..])] {
            model[off as usize..off as usize + data.len()].copy_from_slice(data);
        }
        assert_eq!(read(&img, 0, 8 << 20), model, "order {i}");
    }
    // And really at once: four threads, each to its own part of every one of
    // 2000 fresh pages (sectors 1, 3, part of 5, 7), a barrier before each page.
    let img = Arc::new(img);
    let parts: [(u64, usize); 4] = [(512, 512), (3 * 512, 512), (5 * 512 + 17, 100), (7 * 512, 512)];
    let barrier = Arc::new(std::sync::Barrier::new(parts.len()));
    let threads: Vec<_> = parts
        .into_iter()
        .enumerate()
        .map(|(t, (at, len))| {
            let (img, barrier) = (img.clone(), barrier.clone());
            std::thread::spawn(move || {
                for p in 8..2008u64 {
                    barrier.wait();
                    write(&*img, p * 4096 + at, &vec![p as u8 ^ (0x10 << t); len]);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    for p in 8..2008usize {
        for (t, &(at, len)) in parts.iter().enumerate() {
            model[p * 4096 + at as usize..p * 4096 + at as usize + len].fill(p as u8 ^ (0x10 << t));
        }
    }
    assert_eq!(read(&img, 0, 8 << 20), model);
    assert_whole_pages(&img);
    assert_eq!(img.allocated_sectors(), 2004 * 8);
}

#[test]
fn sub_page_bits_of_older_overlays_read_right_and_the_next_write_completes_the_page() {
    let dir = Dir::new("subpage");
    let (_, overlay, mut model) = setup(&dir, 1 << 20);
    // What older vdisk left after 5000 bytes at offset 1000: bits 1..=11 (sectors
    // 1 to 11), and in sector 17 alone. The data area elsewhere holds junk
    // that must never be read.
    let h = parse_header(&std::fs::read(&overlay).unwrap()[..MAX_HEADER_LEN]).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&overlay).unwrap();
    f.write_all_at(&[0xee; 16384], h.data_offset()).unwrap();
    f.write_all_at(&[0xc3; 11 * 512], h.data_offset() + 512).unwrap();
    f.write_all_at(&[0x3c; 512], h.data_offset() + 17 * 512).unwrap();
    f.write_all_at(&[0b1111_1110, 0b0000_1111, 0b0000_0010], h.bitmap_offset()).unwrap();
    drop(f);
    model[512..6144].fill(0xc3);
    model[17 * 512..18 * 512].fill(0x3c);
    let img = open(&overlay);
    assert_eq!(img.allocated_sectors(), 12);
    assert_eq!(read(&img, 0, 1 << 20), model, "sub-page bits read by sector");
    // A partial write into page 1 (sectors 8..=11 set, 12..=15 not) copies up
    // only what is missing: the written sectors 8..=11 keep their data.
    write(&img, 7000, &[0x11; 10]);
    model[7000..7010].fill(0x11);
    assert_eq!(read(&img, 0, 1 << 20), model);
    assert_eq!(img.allocated_sectors(), 12 + 4);
    // Page 0 (sectors 1..=7 set), by a write into its unset sector 0.
    write(&img, 100, &[0x22; 3]);
    model[100..103].fill(0x22);
    // Page 2 (sector 17 set), by a write of the whole page.
    write(&img, 8192, &[0x33; 4096]);
    model[8192..12288].fill(0x33);
    assert_eq!(read(&img, 0, 1 << 20), model);
    assert_whole_pages(&img);
    img.sync_metadata().unwrap();
    let mut bits = [0u8; 4];
    img.files()[0].read_exact_at(&mut bits, h.bitmap_offset()).unwrap();
    assert_eq!(bits, [0xff, 0xff, 0xff, 0]);
    drop(img);
    assert_eq!(read(&open(&overlay), 0, 1 << 20), model, "after reopening");
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
    assert_eq!(reopen(img), 16, "a durable write_done persists its bits, with its page's copy-up");
    // The bitmap on disk is exactly what UML would write: bits 0..8 and 16..24.
    let h = parse_header(&std::fs::read(&overlay).unwrap()[..MAX_HEADER_LEN]).unwrap();
    let mut bits = [0u8; 4];
    File::open(&overlay).unwrap().read_exact_at(&mut bits, h.bitmap_offset()).unwrap();
    assert_eq!(bits, [0xff, 0, 0xff, 0]);
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
    // qemu:allocation-depth: the overlay's sectors 1, the raw backing file's 2 (holes too).
    assert_eq!(type_at(3 << 20).unwrap().depth, 1, "{st:?}");
    assert_eq!(type_at(0).unwrap().depth, 2, "{st:?}");
    assert_eq!(type_at(1 << 20).unwrap().depth, 2, "{st:?}");
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
    // Page 0 whole (777..3777 copied it up) and the last, one-sector page.
    assert_eq!(copied, 8 * 512 + 512);
    assert_eq!(seen.get(), (copied, copied));
    assert_eq!(std::fs::read(&base).unwrap(), model);
}
