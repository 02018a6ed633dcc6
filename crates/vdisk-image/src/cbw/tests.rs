//! Unit tests of copy-before-write: the view stays frozen while the wrapped
//! image is written, trimmed and zeroed; copies and view reads follow the
//! per-granule rule; the scratch file never shows up in the directory.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::qcow2::{CreateOptions, Qcow2Image};
use crate::testing::write;
use crate::RawImage;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vdisk-cbw-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn raw(d: &Path, size: u64) -> Arc<dyn Image> {
    let p = d.join("disk.raw");
    RawImage::create(&p, size, None).unwrap();
    Arc::new(RawImage::open(&p, false).unwrap())
}

fn qcow2(d: &Path, size: u64) -> Arc<dyn Image> {
    let p = d.join("disk.qcow2");
    Qcow2Image::create(&p, &CreateOptions { size, cluster_bits: 16, backing: None }).unwrap();
    Arc::new(Qcow2Image::open(&p, false).unwrap())
}

/// Reads through an image's mapping as the engine does, releasing the pins after.
fn read(img: &dyn Image, offset: u64, len: u64) -> Vec<u8> {
    let out = crate::testing::read(img, offset, len);
    if img.pins_reads() {
        img.read_done(offset, len);
    }
    out
}

fn zero_through(img: &dyn Image, offset: u64, len: u64, trim: bool) {
    for (o, l) in img.zero(offset, len, trim, false).unwrap() {
        img.prepare_write(o, l).unwrap();
        let mut ext = Vec::new();
        img.map_write(o, l, &mut ext).unwrap();
        for e in ext {
            if let Extent::Data { file, offset, len } = e {
                img.files()[file].write_all_at(&vec![0u8; len as usize], offset).unwrap();
            }
        }
    }
    img.write_done(offset, len, false).unwrap();
}

fn frozen_while_written(inner: Arc<dyn Image>, d: &Path) {
    let size = inner.size();
    let before = pattern(3, 300_000);
    write(&*inner, 10_000, &before);
    let (live, view) = Cbw::wrap(inner.clone(), d, 4096).unwrap();
    assert!(view.read_only());
    assert_eq!(view.size(), size);
    let snapshot = read(&*view, 0, size);
    // Writes of every shape: partial granules, across granules, at the end.
    write(&*live, 12_345, &pattern(9, 70_000));
    write(&*live, 0, &pattern(10, 100));
    write(&*live, size - 5000, &pattern(11, 5000));
    zero_through(&*live, 200_000, 50_000, true);
    zero_through(&*live, 260_000, 10_000, false);
    assert_eq!(read(&*view, 0, size), snapshot, "the view changed under writes");
    assert_eq!(read(&*live, 12_345, 70_000), pattern(9, 70_000));
    assert_eq!(read(&*live, 200_000, 50_000), vec![0u8; 50_000]);
    // Writing the same granules again copies nothing new.
    let copied = live.cbw().copied_bytes();
    write(&*live, 12_345, &pattern(12, 70_000));
    assert_eq!(live.cbw().copied_bytes(), copied);
    assert_eq!(read(&*view, 0, size), snapshot);
    // Allocation adds up to the range and is not data where zeros were frozen.
    let mut alloc = Vec::new();
    view.allocation(0, size, usize::MAX, &mut alloc).unwrap();
    assert_eq!(alloc.iter().map(|a| a.len).sum::<u64>(), size);
    // Writing the view is refused.
    assert!(view.map_write(0, 512, &mut Vec::new()).is_err());
    // Nothing of the scratch file in the directory.
    let names: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(names.iter().all(|n| !n.to_string_lossy().contains("scratch")), "{names:?}");
    live.cbw().detach();
    write(&*live, 0, &pattern(13, 4096));
    assert_eq!(read(&*inner, 0, 4096), pattern(13, 4096));
}

#[test]
fn raw_view_stays_frozen() {
    let d = dir("raw");
    frozen_while_written(raw(&d, (1 << 20) + 1536), &d);
}

#[test]
fn qcow2_view_stays_frozen() {
    let d = dir("qcow2");
    frozen_while_written(qcow2(&d, 1 << 20), &d);
}

#[test]
fn zero_granules_take_no_scratch_space() {
    let d = dir("sparse");
    let inner = raw(&d, 4 << 20);
    let (live, view) = Cbw::wrap(inner, &d, 64 << 10).unwrap();
    write(&*live, 0, &vec![5u8; 4 << 20]);
    assert_eq!(live.cbw().copied_bytes(), 4 << 20);
    assert_eq!(live.cbw().scratch.metadata().unwrap().len(), 0, "zeros were written to the scratch file");
    let mut ext = Vec::new();
    view.map_read(0, 4 << 20, &mut ext).unwrap();
    view.read_done(0, 4 << 20);
    assert_eq!(ext, vec![Extent::Zero { len: 4 << 20 }]);
}

#[test]
fn a_pinned_granule_holds_the_write_until_read_done() {
    let d = dir("pin");
    let inner = raw(&d, 1 << 20);
    write(&*inner, 0, &pattern(1, 65536));
    let (live, view) = Cbw::wrap(inner.clone(), &d, 65536).unwrap();
    // The view maps the live image (nothing copied yet) and has not read yet.
    let mut ext = Vec::new();
    view.map_read(0, 4096, &mut ext).unwrap();
    assert_eq!(ext, vec![Extent::Data { file: 0, offset: 0, len: 4096 }]);
    let landed = Arc::new(AtomicBool::new(false));
    let writer = {
        let (live, landed) = (live.clone(), landed.clone());
        std::thread::spawn(move || {
            write(&*live, 100, &[0xEE; 100]);
            landed.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(!landed.load(Ordering::SeqCst), "the write went ahead of a pinned view read");
    let mut got = vec![0u8; 4096];
    inner.files()[0].read_exact_at(&mut got, 0).unwrap();
    assert_eq!(got, pattern(1, 65536)[..4096]);
    view.read_done(0, 4096);
    writer.join().unwrap();
    assert!(landed.load(Ordering::SeqCst));
    assert_eq!(read(&*view, 0, 65536), pattern(1, 65536));
    assert_eq!(read(&*inner, 100, 100), vec![0xEE; 100]);
}

#[test]
fn a_batch_of_view_reads_never_waits_for_a_copy_that_waits_for_it() {
    // The thread engine maps a whole batch, then performs it: read A pins a
    // granule, a guest write copies it and waits for A, then read B of the
    // same granule is mapped (in A's batch) and must not wait for that write.
    let d = dir("batch");
    let inner = raw(&d, 1 << 20);
    write(&*inner, 0, &pattern(4, 65536));
    let (live, view) = Cbw::wrap(inner.clone(), &d, 65536).unwrap();
    let mut a = Vec::new();
    view.map_read(0, 4096, &mut a).unwrap();
    let landed = Arc::new(AtomicBool::new(false));
    let writer = {
        let (live, landed) = (live.clone(), landed.clone());
        std::thread::spawn(move || {
            write(&*live, 0, &[0xEE; 512]);
            landed.store(true, Ordering::SeqCst);
        })
    };
    // The copy is made (or under way) while A is pinned.
    let t0 = std::time::Instant::now();
    while live.cbw().copied_bytes() == 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let view = view.clone();
        std::thread::spawn(move || {
            let mut b = Vec::new();
            view.map_read(0, 8192, &mut b).unwrap();
            tx.send(b).unwrap();
        });
    }
    let b = rx.recv_timeout(Duration::from_secs(10)).expect("a view read waited for a copy");
    assert!(!landed.load(Ordering::SeqCst), "the write went ahead of pinned view reads");
    // Both reads see the frozen data, wherever they were mapped.
    for (ext, len) in [(&a, 4096usize), (&b, 8192)] {
        let mut got = Vec::new();
        for e in ext.iter() {
            let Extent::Data { file, offset, len } = *e else { panic!("{e:?}") };
            let mut buf = vec![0u8; len as usize];
            read_full(&view.files()[file], &mut buf, offset).unwrap();
            got.extend(buf);
        }
        assert_eq!(got, pattern(4, 65536)[..len]);
    }
    view.read_done(0, 8192);
    assert!(!landed.load(Ordering::SeqCst), "released with a read still pinning the granule");
    view.read_done(0, 4096);
    writer.join().unwrap();
    assert_eq!(read(&*inner, 0, 512), vec![0xEE; 512]);
    assert_eq!(read(&*view, 0, 65536), pattern(4, 65536));
}

#[test]
fn concurrent_writers_and_readers_see_one_frozen_disk() {
    let d = dir("race");
    let size = 8u64 << 20;
    let inner = raw(&d, size);
    write(&*inner, 0, &pattern(7, size as usize));
    let (live, view) = Cbw::wrap(inner, &d, 64 << 10).unwrap();
    let frozen = pattern(7, size as usize);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let live = live.clone();
            s.spawn(move || {
                for i in 0..200u64 {
                    let off = (i * 7919 + t * 104_729) * 4096 % (size - 8192);
                    write(&*live, off, &pattern(t as u8 + i as u8, 8192));
                }
            });
        }
        for _ in 0..2 {
            let (view, frozen) = (view.clone(), &frozen);
            s.spawn(move || {
                for i in 0..100u64 {
                    let off = i * 81_920 % (size - 65536);
                    assert_eq!(read(&*view, off, 65536), frozen[off as usize..off as usize + 65536]);
                }
            });
        }
    });
    assert_eq!(read(&*view, 0, size), frozen);
}

#[test]
fn a_scratch_directory_that_is_not_one_is_refused() {
    let d = dir("bad");
    let inner = raw(&d, 1 << 20);
    let e = Cbw::wrap(inner.clone(), &d.join("nope"), 65536).err().unwrap();
    assert!(e.to_string().contains("nope"), "{e}");
    assert!(Cbw::wrap(inner, &d, 1000).is_err(), "a granule that is not a power of two");
}
