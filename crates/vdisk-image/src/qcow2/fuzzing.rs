//! The qcow2 fuzz target's body (`fuzz/fuzz_targets/qcow2_image.rs`), here
//! so a plain `cargo test` replays the corpus too.
//!
//! An input is a whole image file. It is parsed, then put in an anonymous
//! in-memory file and opened read-write (its backing file, if it names one,
//! is replaced by an empty in-memory raw file: the fuzzer must never open
//! host files), read, written, zeroed and flushed through the same calls the
//! engine makes. What must hold: no panic, whatever the bytes; every write
//! maps to file 0, outside the header, the L1 table and the refcount table;
//! the header is still there afterwards. What this module must never do:
//! touch a file other than the two anonymous ones it makes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

use super::header::parse_header;
use super::{Qcow2Image, Qcow2Options};
use crate::{Extent, Image};

/// An anonymous in-memory file holding `bytes`.
fn memfd(bytes: &[u8]) -> Option<File> {
    let f = super::compressed::memfd(c"vdisk-fuzz").ok()?;
    f.write_all_at(bytes, 0).ok()?;
    Some(f)
}

fn fd_path(f: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

/// Runs one input (see the module docs); panics only on a broken property.
/// Returns whether the image opened.
pub fn image_input(data: &[u8]) -> bool {
    let Ok(h) = parse_header(data) else { return false };
    let (Some(file), Some(backing)) = (memfd(data), memfd(&[0u8; 65536])) else { return false };
    // Room for two L2 tables: eviction and re-reading are exercised too.
    let o = Qcow2Options {
        backing: h.backing.as_ref().map(|_| fd_path(&backing)),
        l2_cache: Some(2 << h.cluster_bits),
        ..Default::default()
    };
    let Ok(img) = Qcow2Image::open_with(&fd_path(&file), &o) else { return false };
    let size = img.size();
    let cs = h.cluster_size();
    let span = size.min(4 * cs).min(1 << 20);
    let mut out = Vec::new();
    for (at, len) in [(0, span), (size.saturating_sub(span), span), (cs / 2, cs)] {
        let len = len.min(size.saturating_sub(at));
        if len > 0 {
            out.clear();
            if img.map_read(at, len, &mut out).is_ok() {
                assert_eq!(out.iter().map(|e| e.len()).sum::<u64>(), len, "a read mapped to the wrong length");
            }
            let _ = img.allocation(at, len, 8, &mut Vec::new());
        }
    }
    let protected = [
        (0, cs),
        (h.l1_table_offset, h.l1_size as u64 * 8),
        (h.refcount_table_offset, h.refcount_table_clusters as u64 * cs),
    ];
    let writes = [(cs / 2 + 3, cs), (0, 512.min(size)), (size.saturating_sub(700), 700), (cs, 3 * cs)];
    for (k, (at, len)) in writes.into_iter().enumerate() {
        let len = len.min(size.saturating_sub(at));
        if len == 0 || img.prepare_write(at, len).is_err() {
            continue;
        }
        out.clear();
        if img.map_write(at, len, &mut out).is_err() {
            continue;
        }
        for e in &out {
            let Extent::Data { file: f, offset, len: n } = *e else { panic!("a write mapped to zeros") };
            assert_eq!(f, 0, "a write mapped to the backing file");
            for (p, plen) in protected {
                assert!(offset + n <= p || offset >= p + plen, "a write at {offset:#x} hits metadata at {p:#x}");
            }
            let _ = img.files()[0].write_all_at(&vec![0xa5; n as usize], offset);
        }
        // The last write "fails" after its data went out: its claim stays, filled with the old data.
        if k == 3 {
            img.write_failed(at, len);
        } else {
            let _ = img.write_done(at, len, false);
        }
    }
    let _ = img.zero(0, size.min(2 * cs), false, false);
    let _ = img.write_done(0, size.min(2 * cs), false);
    let _ = img.sync_metadata();
    let mut head = vec![0u8; cs as usize];
    if file.read_exact_at(&mut head, 0).is_ok() {
        assert!(parse_header(&head).is_ok(), "the header no longer parses after writes");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/qcow2_image");
        std::fs::read_dir(dir)
            .map(|d| d.filter_map(|e| std::fs::read(e.ok()?.path()).ok()).collect())
            .unwrap_or_default()
    }

    /// The seeds open; they and a few thousand mutations never panic.
    #[test]
    fn qcow2_image_never_panics() {
        let seeds = corpus();
        assert!(seeds.len() >= 3, "fuzz/corpus/qcow2_image is missing (fuzz/make-seeds.py writes it)");
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for s in &seeds {
            assert!(image_input(s), "a seed does not open");
        }
        for _ in 0..3000 {
            let mut v = seeds[next() as usize % seeds.len()].clone();
            for _ in 0..1 + next() % 6 {
                // Half the mutations land in the first cluster (header, extensions, tables).
                let span = if next() % 2 == 0 { v.len().min(640) } else { v.len() };
                let i = next() as usize % span;
                match next() % 3 {
                    0 => v[i] ^= 1 << (next() % 8),
                    1 => v[i] = [0, 0xff, 0x80, 0x01][next() as usize % 4],
                    _ => v.truncate(i.max(104)),
                }
            }
            image_input(&v);
        }
    }
}
