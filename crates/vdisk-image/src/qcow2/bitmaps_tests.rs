//! Interop of qcow2 bitmaps with the real qemu-img, qemu-io, qemu-nbd and
//! nbdinfo: bitmaps qemu made are read with their bits, bitmaps vdisk wrote
//! are listed, checked clean and exported with the same extents.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::Qcow2Image;
use crate::bitmap::{BitmapStore, DirtyBitmap, StoredBitmap};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir() -> Dir {
    let out = Command::new("mktemp").args(["-d", "/tmp/vdisk-qbm.XXXXXX"]).output().unwrap();
    Dir(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} is needed for this test (scripts/install-test-deps.sh): {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// An 8 MiB qcow2 with enabled b0 (64K), disabled b1 (4K) and, after data
/// was written while they were, enabled b2 made by --merge of b0.
fn qemu_made(d: &Path) -> PathBuf {
    let p = d.join("q.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&p), "8M"]);
    run("qemu-img", &["bitmap", "--add", s(&p), "b0"]);
    run("qemu-img", &["bitmap", "--add", "-g", "4096", s(&p), "b1"]);
    run("qemu-io", &["-c", "write 65536 4096", "-c", "write 3M 100", s(&p)]);
    run("qemu-img", &["bitmap", "--disable", s(&p), "b1"]);
    run("qemu-io", &["-c", "write 7M 512", s(&p)]);
    run("qemu-img", &["bitmap", "--add", s(&p), "b2"]);
    run("qemu-img", &["bitmap", "--merge", "b1", s(&p), "b2"]);
    p
}

fn dirty(b: &StoredBitmap) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((s, l)) = b.map.next_run(at, b.map.size() - at, true) {
        out.push((s, l));
        at = s + l;
    }
    out
}

fn by_name<'a>(set: &'a [StoredBitmap], n: &str) -> &'a StoredBitmap {
    set.iter().find(|b| b.name == n).unwrap()
}

#[test]
fn bitmaps_qemu_made_are_read_with_their_bits_and_state() {
    let d = dir();
    let p = qemu_made(&d.0);
    let img = Qcow2Image::open(&p, true).unwrap();
    let set = img.bitmaps();
    assert_eq!(set.len(), 3);
    let (b0, b1, b2) = (by_name(&set, "b0"), by_name(&set, "b1"), by_name(&set, "b2"));
    assert_eq!((b0.map.granularity(), b1.map.granularity(), b2.map.granularity()), (65536, 4096, 65536));
    assert!(b0.map.enabled() && !b1.map.enabled() && b2.map.enabled());
    assert!(!b0.inconsistent && !b1.inconsistent);
    assert_eq!(dirty(b0), [(65536, 65536), (3 << 20, 65536), (7 << 20, 65536)]);
    assert_eq!(dirty(b1), [(65536, 4096), (3 << 20, 4096)]);
    assert_eq!(dirty(b2), [(65536, 65536), (3 << 20, 65536)]);
}

#[test]
fn a_read_write_open_marks_bitmaps_in_use_and_a_clean_close_clears_it() {
    let d = dir();
    let p = qemu_made(&d.0);
    {
        let img = Qcow2Image::open(&p, false).unwrap();
        let store = crate::Image::bitmap_store(&img).expect("qcow2 keeps its own bitmaps");
        let set = store.open_session().unwrap();
        assert!(set.iter().all(|b| !b.inconsistent));
        // While open read-write, qemu sees them in use.
        assert!(run("qemu-img", &["info", "-U", s(&p)]).contains("in-use"));
        by_name(&set, "b0").map.record_write(5 << 20, 1);
        let mut set = set;
        set.retain(|b| b.name != "b2");
        let b3 = DirtyBitmap::new(8 << 20, 1 << 20).unwrap();
        b3.set(2 << 20, 1);
        b3.set_enabled(false);
        set.push(StoredBitmap::new("b3", b3));
        img.save(&set, true).unwrap();
    }
    let info = run("qemu-img", &["info", s(&p)]);
    assert!(!info.contains("in-use"), "{info}");
    assert!(info.contains("name: b3") && !info.contains("name: b2"), "{info}");
    run("qemu-img", &["check", s(&p)]);
    let img = Qcow2Image::open(&p, true).unwrap();
    let set = img.bitmaps();
    assert_eq!(dirty(by_name(&set, "b0")), [(65536, 65536), (3 << 20, 65536), (5 << 20, 65536), (7 << 20, 65536)]);
    let b3 = by_name(&set, "b3");
    assert_eq!((b3.map.granularity(), b3.map.enabled()), (1 << 20, false));
    assert_eq!(dirty(b3), [(2 << 20, 1 << 20)]);
}

#[test]
fn bitmaps_of_an_image_not_closed_cleanly_are_inconsistent() {
    let d = dir();
    let p = qemu_made(&d.0);
    drop(Qcow2Image::open(&p, false).unwrap()); // no save: as a crash leaves it
    let img = Qcow2Image::open(&p, false).unwrap();
    let set = img.open_session().unwrap();
    assert!(set.iter().all(|b| b.inconsistent), "{set:?}");
    // A clean close keeps them marked: they stay refused until removed.
    img.save(&set, true).unwrap();
    drop(img);
    assert!(Qcow2Image::open(&p, true).unwrap().bitmaps().iter().all(|b| b.inconsistent));
    // qemu agrees: it reports them in use.
    assert!(run("qemu-img", &["info", s(&p)]).contains("in-use"));
    let check = run("qemu-img", &["check", s(&p)]);
    assert!(check.contains("No errors"), "{check}");
}

#[test]
fn a_bitmap_vdisk_wrote_is_exported_by_qemu_nbd_with_the_same_extents() {
    let d = dir();
    let p = d.0.join("v.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&p), "4M"]);
    {
        let img = Qcow2Image::open(&p, false).unwrap();
        let m = DirtyBitmap::new(4 << 20, 65536).unwrap();
        m.set(0, 1);
        m.set(1 << 20, 200 << 10);
        m.set((4 << 20) - 1, 1);
        img.save(&[StoredBitmap::new("vb", m)], true).unwrap();
    }
    let check = run("qemu-img", &["check", s(&p)]);
    assert!(check.contains("No errors"), "{check}");
    let sock = d.0.join("nbd.sock");
    let mut nbd = Command::new("qemu-nbd")
        .args(["-r", "-f", "qcow2", "-B", "vb", "-k", s(&sock), s(&p)])
        .spawn()
        .expect("qemu-nbd is needed for this test");
    let t0 = std::time::Instant::now();
    while !sock.exists() && t0.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let uri = format!("nbd+unix:///?socket={}", s(&sock));
    let out = Command::new("nbdinfo").args(["--map=qemu:dirty-bitmap:vb", &uri]).output();
    let _ = nbd.kill();
    let _ = nbd.wait();
    let out = out.expect("nbdinfo is needed for this test");
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<(u64, u64, u32)> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    let m64 = 65536;
    assert_eq!(
        rows,
        [
            (0, m64, 1),
            (m64, (1 << 20) - m64, 0),
            (1 << 20, 4 * m64, 1),
            ((1 << 20) + 4 * m64, (3 << 20) - 5 * m64, 0),
            ((4 << 20) - m64, m64, 1)
        ],
        "{text}"
    );
}

#[test]
fn removing_every_bitmap_drops_the_extension() {
    let d = dir();
    let p = qemu_made(&d.0);
    let img = Qcow2Image::open(&p, false).unwrap();
    img.save(&[], true).unwrap();
    drop(img);
    let info = run("qemu-img", &["info", s(&p)]);
    assert!(!info.contains("bitmaps:"), "{info}");
    let check = run("qemu-img", &["check", s(&p)]);
    assert!(check.contains("No errors"), "{check}");
}
