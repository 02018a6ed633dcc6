//! Unit tests of the qcow2 image: create, write, read back, reopen.

use super::create::{CreateOptions, DEFAULT_CLUSTER_BITS};
use super::*;
use crate::testing::{finish, read, start, write};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vdisk-qcow2-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("img.qcow2")
}

/// A new image of `size` bytes with clusters of `2^cluster_bits` bytes, no
/// backing file, in a fresh directory of its own.
fn created(name: &str, size: u64, cluster_bits: u32) -> PathBuf {
    let p = tmp(name);
    Qcow2Image::create(&p, &CreateOptions { size, cluster_bits, backing: None }).unwrap();
    p
}

#[test]
fn create_write_reopen_read() {
    for bits in [9, 12, DEFAULT_CLUSTER_BITS, 21] {
        let p = created(&format!("rw{bits}"), 8 << 20, bits);
        {
            let img = Qcow2Image::open(&p, false).unwrap();
            assert_eq!(read(&img, 0, 4096), vec![0u8; 4096]);
            write(&img, 1000, &[7u8; 5000]);
            write(&img, (8 << 20) - 700, &[9u8; 700]);
            assert_eq!(read(&img, 1000, 5000), vec![7u8; 5000]);
            assert_eq!(read(&img, 0, 1000), vec![0u8; 1000]);
            img.sync_metadata().unwrap();
        }
        let img = Qcow2Image::open(&p, true).unwrap();
        assert_eq!(read(&img, 1000, 5000), vec![7u8; 5000], "cluster bits {bits}");
        assert_eq!(read(&img, 6000, 100), vec![0u8; 100]);
        assert_eq!(read(&img, (8 << 20) - 700, 700), vec![9u8; 700]);
    }
}

#[test]
fn overlay_copies_on_write_from_backing() {
    let top = overlay_over_ones("base");
    let img = Qcow2Image::open(&top, false).unwrap();
    assert_eq!(read(&img, 4096, 10), vec![1u8; 10]);
    write(&img, 100, &[2u8; 10]);
    let got = read(&img, 0, 200);
    assert_eq!(&got[..100], &[1u8; 100][..]);
    assert_eq!(&got[100..110], &[2u8; 10][..]);
    assert_eq!(&got[110..], &[1u8; 90][..]);
    assert_eq!(img.zero(0, 1 << 20, false, false).unwrap(), vec![]);
    assert_eq!(read(&img, 0, 1 << 20), vec![0u8; 1 << 20]);
}

#[test]
fn a_small_l2_cache_evicts_clean_tables_and_loses_nothing() {
    // 512-byte clusters: one L2 table per 32 KiB of disk, 256 of them; room for 4.
    let p = created("evict", 8 << 20, 9);
    let o = Qcow2Options { l2_cache: Some(4 * 512), ..Default::default() };
    let pattern = |k: u64| vec![(k % 251) as u8 + 1; 700];
    {
        let img = Qcow2Image::open_with(&p, &o).unwrap();
        for k in 0..200u64 {
            write(&img, k * 40_000 + 13, &pattern(k));
            if k % 50 == 49 {
                img.sync_metadata().unwrap();
            }
        }
        for k in 0..200u64 {
            assert_eq!(read(&img, k * 40_000 + 13, 700), pattern(k), "before reopening, write {k}");
        }
        img.sync_metadata().unwrap();
    }
    let img = Qcow2Image::open_with(&p, &o).unwrap();
    for k in (0..200u64).rev() {
        assert_eq!(read(&img, k * 40_000 + 13, 700), pattern(k), "after reopening, write {k}");
    }
    assert_eq!(read(&img, 40_000 * 200 + 13, 700), vec![0u8; 700]);
}

/// An overlay (64 KiB clusters) over a 1 MiB base of 1s.
fn overlay_over_ones(name: &str) -> PathBuf {
    let base = created(name, 1 << 20, 12);
    {
        let img = Qcow2Image::open(&base, false).unwrap();
        write(&img, 0, &[1u8; 1 << 20]);
        img.sync_metadata().unwrap();
    }
    let top = base.with_file_name("top.qcow2");
    let o = CreateOptions { size: 1 << 20, cluster_bits: 16, backing: Some((Path::new("img.qcow2"), "qcow2")) };
    Qcow2Image::create(&top, &o).unwrap();
    top
}

/// Starts A, a write of the whole 64 KiB cluster at `at`, then starts and
/// lands B, 10 bytes of `b` at `at + 100`, inside it; returns A's extents,
/// A still in flight.
fn a_in_flight_b_landed(img: &Qcow2Image, at: u64, b: u8) -> Vec<Extent> {
    let a = start(img, at, 65536);
    let b_ext = start(img, at + 100, 10);
    finish(img, at + 100, &b_ext, &[b; 10]);
    a
}

#[test]
fn overlapping_writes_into_a_new_cluster_never_expose_unwritten_bytes_after_a_crash() {
    // A covers the new cluster whole and is still in flight (mapped, data not
    // landed) when B, a small write inside it, starts, lands and is flushed.
    // Then the power goes: A's data never reached the file. B must be there,
    // and the rest of the cluster must read what it read before (the backing
    // file's 1s), or A's data: never the fresh cluster's zeros.
    let top = overlay_over_ones("overlap");
    {
        let img = Qcow2Image::open(&top, false).unwrap();
        let a = a_in_flight_b_landed(&img, 0, 2);
        img.sync_metadata().unwrap(); // the FLUSH after B: B is durable
        let got = read(&img, 0, 65536);
        assert!(got[..100].iter().all(|&v| v == 1), "before the crash, A's range outside B reads {:?}", &got[..8]);
        drop(a); // the crash: A never lands
    }
    let img = Qcow2Image::open(&top, true).unwrap();
    let got = read(&img, 0, 65536);
    assert_eq!(&got[100..110], &[2u8; 10][..], "B was flushed");
    let bad = got.iter().enumerate().filter(|&(i, &v)| !(100..110).contains(&i) && v != 1).count();
    assert_eq!(bad, 0, "{bad} bytes outside B read neither the backing data nor A's (first: {:?})", &got[..8]);
}

#[test]
fn overlapping_writes_land_both_and_a_failed_whole_write_leaves_old_data() {
    let top = overlay_over_ones("overlap2");
    let img = Qcow2Image::open(&top, false).unwrap();
    // Both land, B first: A's data everywhere but where B's may be.
    let a = a_in_flight_b_landed(&img, 0, 2);
    finish(&img, 0, &a, &[3u8; 65536]);
    let got = read(&img, 0, 65536);
    assert!(got.iter().enumerate().all(|(i, &v)| v == 3 || ((100..110).contains(&i) && v == 2)));
    // A fails after B was published: A's range reads as before (or B).
    let a = a_in_flight_b_landed(&img, 65536, 4);
    drop(a);
    img.write_failed(65536, 65536);
    let got = read(&img, 65536, 65536);
    assert_eq!(&got[100..110], &[4u8; 10][..]);
    assert!(got.iter().enumerate().all(|(i, &v)| (100..110).contains(&i) || v == 1), "A failed: old data stays");
}

/// `qemu-img check`'s verdict on `p`: (exit code, its output).
fn qemu_img_check(p: &Path) -> Option<(i32, String)> {
    let out = std::process::Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(p).output().ok()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some((out.status.code().unwrap_or(-1), text))
}

#[test]
fn a_refcount_table_grown_twice_between_flushes_leaks_nothing() {
    // 512-byte clusters: one refcount table cluster counts 8 MiB of file; 30
    // MiB written without a flush moves the table twice before any round.
    let p = created("grow2", 64 << 20, 9);
    let first = Qcow2Image::open(&p, true).unwrap().header().refcount_table_offset;
    {
        let img = Qcow2Image::open(&p, false).unwrap();
        let mut moves = Vec::new();
        for k in 0..30u64 {
            write(&img, k << 20, &vec![(k + 1) as u8; 1 << 20]);
            let at = img.refs.lock().unwrap().table_at;
            if moves.last() != Some(&at) && at != first {
                moves.push(at);
            }
        }
        assert!(moves.len() >= 2, "the table moved {} times, not twice", moves.len());
        img.sync_metadata().unwrap();
        for k in 0..30u64 {
            assert_eq!(read(&img, (k << 20) + 4321, 10), vec![(k + 1) as u8; 10]);
        }
    }
    let Some((code, text)) = qemu_img_check(&p) else {
        eprintln!("no qemu-img: the check is skipped");
        return;
    };
    assert_eq!(code, 0, "qemu-img check after two moves of the refcount table:\n{text}");
    assert!(!text.contains("leaked"), "{text}");
}

#[test]
fn a_new_refcount_block_is_durable_before_the_table_entry_naming_it() {
    use super::write::trace::{self, Step};
    // 512-byte clusters, 16-bit refcounts: a block counts 128 KiB of file;
    // 200 KiB of data needs a second one, named by the table in place.
    let p = created("newblock", 8 << 20, 9);
    let img = Qcow2Image::open(&p, false).unwrap();
    let (table_at, blocks_before) = {
        let refs = img.refs.lock().unwrap();
        (refs.table_at, refs.table_entries().count())
    };
    write(&img, 0, &[5u8; 200 << 10]);
    let new_blocks: Vec<u64> = img.refs.lock().unwrap().table_entries().skip(blocks_before).collect();
    assert!(!new_blocks.is_empty(), "no refcount block was added");
    trace::start();
    img.sync_metadata().unwrap();
    let steps = trace::take();
    let at = |want: u64| steps.iter().position(|s| matches!(*s, Step::Write(a, _) if a == want));
    let table = at(table_at).expect("the refcount table was written");
    for b in new_blocks {
        let block = at(b).unwrap_or_else(|| panic!("the new refcount block at {b:#x} was not written: {steps:?}"));
        assert!(
            steps[block..table].contains(&Step::Sync),
            "the table naming the block at {b:#x} went out before a sync made the block durable: {steps:?}"
        );
    }
    // And the L1 table (it names new L2 tables) after a sync that follows every L2 table.
    let l1 = at(img.header().l1_table_offset).expect("the L1 table was written");
    let last_l2 = steps[..l1].iter().rposition(|s| matches!(s, Step::Write(..))).unwrap();
    assert!(steps[last_l2..l1].contains(&Step::Sync), "{steps:?}");
}

#[test]
fn a_write_covering_a_new_cluster_copies_nothing_and_wins_over_a_stale_claim() {
    use super::write::trace::{self, Step};
    let top = overlay_over_ones("whole");
    {
        let img = Qcow2Image::open(&top, false).unwrap();
        // A whole-cluster write copies nothing from the backing file; a
        // partial one fills its cluster.
        trace::start();
        write(&img, 0, &[3u8; 65536]);
        write(&img, 65536 + 100, &[4u8; 10]);
        let fills: Vec<Step> = trace::take().into_iter().filter(|s| matches!(s, Step::Fill(..))).collect();
        assert!(!fills.is_empty(), "the partial write filled nothing");
        let host = img.entry(0).unwrap().host();
        assert!(fills.iter().all(|s| !matches!(*s, Step::Fill(at, _) if at / 65536 == host / 65536)), "{fills:?}");
        assert_eq!(read(&img, 0, 65536), vec![3u8; 65536]);
        // A (whole) and B (partial) in flight on a new cluster; A is done
        // first, then B, whose claim (made before A's publish) is stale: A
        // wins all of it, never the old data B's claim was filled with.
        let at = 2 * 65536;
        let a = start(&img, at, 65536);
        let b = start(&img, at + 100, 10);
        finish(&img, at, &a, &[5u8; 65536]);
        finish(&img, at + 100, &b, &[6u8; 10]);
        let got = read(&img, at, 65536);
        assert!(got.iter().all(|&v| v == 5), "A was done last to publish, yet the cluster reads {:?}", &got[..8]);
        // Two identical whole writes in flight share one cluster.
        let at = 3 * 65536;
        let a1 = start(&img, at, 65536);
        let a2 = start(&img, at, 65536);
        assert_eq!(a1, a2);
        finish(&img, at, &a2, &[7u8; 65536]);
        finish(&img, at, &a1, &[8u8; 65536]);
        assert_eq!(read(&img, at, 65536), vec![8u8; 65536]);
        // A whole write that fails leaves the old data.
        let at = 4 * 65536;
        let a = start(&img, at, 65536);
        drop(a);
        img.write_failed(at, 65536);
        assert_eq!(read(&img, at, 65536), vec![1u8; 65536]);
        img.sync_metadata().unwrap();
    }
    let img = Qcow2Image::open(&top, true).unwrap();
    assert_eq!(read(&img, 0, 65536), vec![3u8; 65536]);
    assert_eq!(read(&img, 2 * 65536, 65536), vec![5u8; 65536]);
    drop(img);
    let Some((code, text)) = qemu_img_check(&top) else { return };
    // The failed write's cluster leaks (as a failed claim always has); nothing is corrupt.
    assert!(code == 0 || code == 3, "qemu-img check:\n{text}");
    assert!(!text.contains("ERROR"), "{text}");
}

/// Threads writing (many new L2 tables, many writes sharing a new cluster)
/// while another runs metadata rounds, as the threads engine does. Before
/// the fixes this raced two ways: a round could take a new L2 table before
/// its L1 entry named a place for it (and write it at offset 0, over the
/// header), and a write could find its cluster neither claimed nor
/// published while another write published the claim between the looks.
#[test]
fn writes_racing_metadata_rounds_keep_the_header_and_every_write() {
    // 512-byte clusters: an L2 table covers 32 KiB, so new tables are frequent.
    let p = created("race", 128 << 20, 9);
    let img = Qcow2Image::open(&p, false).unwrap();
    let header = std::fs::read(&p).unwrap()[..72].to_vec();
    let stop = std::sync::atomic::AtomicBool::new(false);
    const WRITERS: u64 = 4;
    const PIECES: u64 = 2000;
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                if let Err(e) = img.sync_metadata() {
                    stop.store(true, Ordering::Release);
                    panic!("metadata round: {e}");
                }
            }
        });
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let img = &img;
                s.spawn(move || {
                    for i in 0..PIECES {
                        // Each round of pieces in a new L2 table (32 KiB each), the
                        // writers' 100-byte pieces side by side in one new cluster.
                        let at = i * 40_000 + w * 100;
                        write(img, at, &[(w + 1) as u8; 100]);
                    }
                })
            })
            .collect();
        let panicked = writers.into_iter().map(|t| t.join()).filter(Result::is_err).count();
        stop.store(true, Ordering::Release);
        assert_eq!(panicked, 0, "a writer failed");
    });
    img.sync_metadata().unwrap();
    assert_eq!(std::fs::read(&p).unwrap()[..72], header[..], "the header was overwritten");
    drop(img);
    let img = Qcow2Image::open(&p, true).unwrap();
    for w in 0..WRITERS {
        for i in 0..PIECES {
            let at = i * 40_000 + w * 100;
            assert_eq!(read(&img, at, 100), vec![(w + 1) as u8; 100], "writer {w} piece {i} at {at}");
        }
    }
    if let Some((code, out)) = qemu_img_check(&p) {
        assert!(code == 0 || code == 3, "qemu-img check: {out}");
    }
}

/// The depth of each run of `img`, as (start, len, depth), neighbours of one depth merged.
fn depths(img: &dyn Image, len: u64) -> Vec<(u64, u64, u32)> {
    let mut st = Vec::new();
    img.allocation(0, len, 1000, &mut st).unwrap();
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    let mut at = 0;
    for a in st {
        match out.last_mut() {
            Some(l) if l.2 == a.depth => l.1 += a.len,
            _ => out.push((at, a.len, a.depth)),
        }
        at += a.len;
    }
    out
}

#[test]
fn allocation_depth_counts_layers_down_the_chain() {
    // top.qcow2 -> mid.qcow2 -> base.raw (2 MiB, shorter than the 4 MiB overlays).
    // (A layer without a backing file reports its unallocated runs as depth 0.)
    let p = tmp("depth");
    let d = p.parent().unwrap();
    let base = d.join("base.raw");
    std::fs::File::create(&base).unwrap().set_len(2 << 20).unwrap();
    let mid = d.join("mid.qcow2");
    let opts = |b, f| CreateOptions { size: 4 << 20, cluster_bits: 16, backing: Some((b, f)) };
    Qcow2Image::create(&mid, &opts(&base, "raw")).unwrap();
    Qcow2Image::create(&p, &opts(&mid, "qcow2")).unwrap();
    {
        let m = Qcow2Image::open(&mid, false).unwrap();
        write(&m, 1 << 20, &[2u8; 65536]);
        write(&m, 3 << 20, &[2u8; 65536]);
        m.sync_metadata().unwrap();
    }
    let top = Qcow2Image::open(&p, false).unwrap();
    write(&top, 0, &[1u8; 65536]);
    let k = 65536;
    assert_eq!(
        depths(&top, 4 << 20),
        // Past base.raw's end (2 MiB) the zeros count as base.raw's (depth 3), as qemu counts them.
        [
            (0, k, 1),
            (k, (1 << 20) - k, 3),
            (1 << 20, k, 2),
            ((1 << 20) + k, (2 << 20) - k, 3),
            (3 << 20, k, 2),
            ((3 << 20) + k, (1 << 20) - k, 3)
        ]
    );
}
