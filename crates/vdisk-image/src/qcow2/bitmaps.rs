//! Persistent dirty bitmaps in qcow2 images, in qemu's format
//! (docs/interop/qcow2.txt, "Bitmaps"): the bitmaps header extension names a
//! bitmap directory; each entry names a bitmap table, whose entries name the
//! clusters of bitmap data (or say "all zeros"/"all ones"). Autoclear bit 0
//! says the extension is consistent; an entry's `in_use` flag says the
//! bitmap was not saved since a writer opened it.
//!
//! What it owns: reading the directory, tables and data of an image's
//! bitmaps into [`DirtyBitmap`]s (this file, untrusted bytes in), and
//! writing the whole set back (`bitmaps_write.rs`). A read-write open marks
//! every bitmap in use on disk before the image serves a write; only an
//! explicit [`BitmapStore::save`] with `close` clears the marks, so a crash
//! (or a writer that never tracked the bitmaps) leaves them marked, and the
//! next open loads them `inconsistent`, as qemu does.
//!
//! What it must never do: trust a bitmap found in use, or point the header
//! at a directory whose clusters (and their refcounts) are not durable.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::header::Header;
use super::Qcow2Image;
use crate::bitmap::{BitmapStore, DirtyBitmap, StoredBitmap};
use crate::{Error, ErrorKind, Result};

/// Directory entry flags.
pub(super) const FLAG_IN_USE: u32 = 1 << 0;
pub(super) const FLAG_AUTO: u32 = 1 << 1;
pub(super) const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
/// Autoclear bit 0: the bitmaps extension is consistent.
pub(super) const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// The one bitmap type: dirty tracking.
pub(super) const TYPE_DIRTY: u8 = 1;
/// Limits qemu keeps (and we with it).
const MAX_BITMAPS: u32 = 65535;
const MAX_DIRECTORY: u64 = 64 << 20;
const MAX_TABLE_ENTRIES: u64 = 0x800_0000;
/// The most memory one bitmap may take (qemu's limit too).
const MAX_BITMAP_BYTES: u64 = 512 << 20;
/// Bits 9-55 of a bitmap table entry: the data cluster's offset.
pub(super) const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// One entry of the bitmap directory, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub table_offset: u64,
    pub table_size: u32,
    pub flags: u32,
    pub kind: u8,
    pub granularity_bits: u8,
    pub name: String,
    pub extra_data_size: u32,
}

fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

/// Parses `n` directory entries from `b` (untrusted bytes).
pub fn parse_directory(b: &[u8], n: u32) -> Result<Vec<DirEntry>> {
    let mut at = 0usize;
    let mut out: Vec<DirEntry> = Vec::with_capacity(n.min(1024) as usize);
    for i in 0..n {
        if b.len() - at < 24 {
            return Err(corrupt(format!("bitmap directory entry {i} runs past the directory's end")));
        }
        let e = &b[at..];
        let name_size = u16::from_be_bytes([e[18], e[19]]) as usize;
        let extra = u32::from_be_bytes(e[20..24].try_into().unwrap());
        let total = (24 + extra as usize + name_size).div_ceil(8) * 8;
        if name_size == 0 || (extra as usize).saturating_add(24 + name_size) > b.len() - at {
            return Err(corrupt(format!("bitmap directory entry {i} has a bad name or extra data size")));
        }
        let name_at = 24 + extra as usize;
        let name = std::str::from_utf8(&e[name_at..name_at + name_size])
            .map_err(|_| corrupt(format!("bitmap directory entry {i}: the name is not UTF-8")))?
            .to_owned();
        if out.iter().any(|x| x.name == name) {
            return Err(corrupt(format!("two bitmaps are named {name:?}")));
        }
        out.push(DirEntry {
            table_offset: u64::from_be_bytes(e[0..8].try_into().unwrap()),
            table_size: u32::from_be_bytes(e[8..12].try_into().unwrap()),
            flags: u32::from_be_bytes(e[12..16].try_into().unwrap()),
            kind: e[16],
            granularity_bits: e[17],
            name,
            extra_data_size: extra,
        });
        at = (at + total).min(b.len());
    }
    Ok(out)
}

/// The number of bitmap table entries a bitmap of this geometry has.
pub(super) fn table_entries(size: u64, granularity: u64, cluster_size: u64) -> u64 {
    size.div_ceil(granularity).div_ceil(8).div_ceil(cluster_size)
}

/// What reading an image's bitmaps found.
pub(super) struct Loaded {
    pub bitmaps: Vec<StoredBitmap>,
    /// Every host cluster the bitmaps hold now (directory, tables, data).
    pub clusters: Vec<u64>,
}

/// Reads every bitmap of the image whose header is `h` from `file`.
pub(super) fn load(h: &Header, file: &std::fs::File, file_len: u64, path: &std::path::Path) -> Result<Loaded> {
    let mut loaded = Loaded { bitmaps: Vec::new(), clusters: Vec::new() };
    let Some((nb, dir_size, dir_offset)) = h.bitmaps_ext else {
        return Ok(loaded);
    };
    let p = path.display();
    let cs = h.cluster_size();
    let bad =
        |what: String| corrupt(format!("{p}: {what}; the bitmaps can be removed with `qemu-img bitmap --remove`"));
    if nb == 0 || nb > MAX_BITMAPS || dir_size > MAX_DIRECTORY || dir_size < 24 * nb as u64 {
        return Err(bad(format!("the bitmaps extension is invalid ({nb} bitmaps, a {dir_size}-byte directory)")));
    }
    if !dir_offset.is_multiple_of(cs) || dir_offset.saturating_add(dir_size) > file_len {
        return Err(bad(format!("the bitmap directory at {dir_offset:#x} is not inside the file")));
    }
    let mut dir = vec![0u8; dir_size as usize];
    file.read_exact_at(&mut dir, dir_offset).map_err(|e| Error::io(e, format!("cannot read the bitmaps of {p}")))?;
    loaded.clusters.extend((0..dir_size.div_ceil(cs)).map(|k| dir_offset + k * cs));
    // Without autoclear bit 0 a writer that knew nothing of bitmaps has had the image.
    let consistent = h.autoclear & AUTOCLEAR_BITMAPS != 0;
    for e in parse_directory(&dir, nb).map_err(|e| bad(e.message().to_owned()))? {
        let name = &e.name;
        if e.kind != TYPE_DIRTY || !(9..=31).contains(&e.granularity_bits) {
            return Err(bad(format!(
                "bitmap {name:?} has type {} and granularity bits {}, which vdisk does not use",
                e.kind, e.granularity_bits
            )));
        }
        let g = 1u64 << e.granularity_bits;
        if h.size.div_ceil(g).div_ceil(8) > MAX_BITMAP_BYTES {
            return Err(bad(format!("bitmap {name:?} would take more than 512 MiB of memory")));
        }
        let want = table_entries(h.size, g, cs);
        if e.table_size as u64 != want || want > MAX_TABLE_ENTRIES {
            return Err(bad(format!("bitmap {name:?} has {} table entries, not {want}", e.table_size)));
        }
        let tbytes = want * 8;
        if !e.table_offset.is_multiple_of(cs) || e.table_offset.saturating_add(tbytes) > file_len {
            return Err(bad(format!("the table of bitmap {name:?} is not inside the file")));
        }
        let mut table = vec![0u8; tbytes as usize];
        file.read_exact_at(&mut table, e.table_offset)
            .map_err(|err| Error::io(err, format!("cannot read bitmap {name:?} of {p}")))?;
        loaded.clusters.extend((0..tbytes.div_ceil(cs)).map(|k| e.table_offset + k * cs));
        let map = DirtyBitmap::new(h.size, g)?;
        let mut data = vec![0u8; cs as usize];
        for (k, raw) in table.chunks_exact(8).enumerate() {
            let entry = u64::from_be_bytes(raw.try_into().unwrap());
            let first_bit = k as u64 * cs * 8;
            let at = entry & TABLE_OFFSET_MASK;
            if at == 0 {
                if entry & 1 != 0 {
                    map.set_bits(first_bit, cs * 8);
                }
                continue;
            }
            if at.saturating_add(cs) > file_len {
                return Err(bad(format!("a data cluster of bitmap {name:?} is past the file's end")));
            }
            file.read_exact_at(&mut data, at)
                .map_err(|err| Error::io(err, format!("cannot read bitmap {name:?} of {p}")))?;
            map.import_bits(first_bit, &data);
            loaded.clusters.push(at);
        }
        map.set_enabled(e.flags & FLAG_AUTO != 0);
        let unknown_extra = e.extra_data_size != 0 && e.flags & FLAG_EXTRA_DATA_COMPATIBLE == 0;
        let inconsistent = !consistent || e.flags & FLAG_IN_USE != 0 || unknown_extra;
        if inconsistent {
            log::warn!(
                "{p}: bitmap {name:?} was not saved cleanly (in use, or the image was written by a program that \
                 does not keep bitmaps): it is inconsistent and will not be used for incremental backup; \
                 remove it and start a new one"
            );
        }
        loaded.bitmaps.push(StoredBitmap { name: e.name, map: Arc::new(map), inconsistent });
    }
    Ok(loaded)
}

impl BitmapStore for Qcow2Image {
    /// The bitmaps loaded at open (a read-write open already marked them in use).
    fn open_session(&self) -> Result<Vec<StoredBitmap>> {
        Ok(self.bitmaps.lock().unwrap_or_else(|e| e.into_inner()).set.clone())
    }

    fn save(&self, set: &[StoredBitmap], close: bool) -> Result<()> {
        self.write_bitmaps(set, close)
    }
}

impl Qcow2Image {
    /// The image's bitmaps as last loaded or saved.
    pub fn bitmaps(&self) -> Vec<StoredBitmap> {
        self.bitmaps.lock().unwrap_or_else(|e| e.into_inner()).set.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_directories_are_refused_not_panicked_on() {
        assert!(parse_directory(&[0u8; 10], 1).is_err());
        let mut e = vec![0u8; 32];
        e[19] = 3; // name_size 3
        e[24..27].copy_from_slice(b"abc");
        assert_eq!(parse_directory(&e, 1).unwrap()[0].name, "abc");
        e[23] = 200; // extra data past the end
        assert!(parse_directory(&e, 1).is_err());
        assert!(parse_directory(&[&e[..], &e[..]].concat(), 2).is_err());
    }
}
