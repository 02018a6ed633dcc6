//! The sidecar bitmap file: where the bitmaps of a raw or UML COW disk
//! persist (qcow2 keeps its own, in qemu's format; an RBD image keeps these
//! same bytes in its RBD metadata, `rbd/bitmaps.rs`). vdisk's own format,
//! documented in docs/design.md ("Dirty bitmaps"):
//!
//! ```text
//! header, 48 bytes (integers little-endian):
//!   0  8  magic "VDBITMAP"        8  4  version (1)
//!  12  4  reserved (0)           16  8  disk size in bytes
//!  24  4  number of bitmaps      28  4  reserved (0)
//!  32  8  generation (each save +1)
//!  40  8  length of everything after the header, before the checksum
//! each bitmap:
//!   0  4  flags: 1 in-use, 2 enabled, 4 inconsistent
//!   4  1  granularity bits (9..=31)     5  1  reserved (0)
//!   6  2  name length (1..=1023)        8  8  data length in bytes
//!  16     name (UTF-8), zero-padded to 8; then the data (bit k of the disk's
//!         granules at byte k/8, bit k%8, as qcow2), zero-padded to 8
//! trailer: 4-byte CRC-32C of everything before it (header included), 4 zero bytes
//! ```
//!
//! What it owns: reading and writing that file. A save writes `NAME.tmp`,
//! syncs it, renames it over the file and syncs the directory, so a crash
//! leaves the old file or the new one. A file that fails its checksum is
//! refused (never half trusted).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::store::check_name;
use super::{check_granularity, BitmapStore, DirtyBitmap, StoredBitmap};
use crate::{Error, ErrorKind, Result};

const MAGIC: &[u8; 8] = b"VDBITMAP";
const VERSION: u32 = 1;
const HEADER: usize = 48;
const F_IN_USE: u32 = 1;
const F_ENABLED: u32 = 2;
const F_INCONSISTENT: u32 = 4;

/// A disk's bitmaps in a sidecar file.
pub struct SidecarStore {
    path: PathBuf,
    size: u64,
    read_only: bool,
}

/// The sidecar path vdisk uses for an image file by default: `IMAGE.bitmaps`.
pub fn default_path(image: &Path) -> PathBuf {
    let mut s = image.as_os_str().to_owned();
    s.push(".bitmaps");
    PathBuf::from(s)
}

/// CRC-32C (Castagnoli), a byte at a time from a table.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| t[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The file's bytes for `set` of a disk of `size` bytes.
pub fn encode(size: u64, set: &[StoredBitmap], close: bool, generation: u64) -> Vec<u8> {
    let mut b = vec![0u8; HEADER];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[16..24].copy_from_slice(&size.to_le_bytes());
    b[24..28].copy_from_slice(&(set.len() as u32).to_le_bytes());
    b[32..40].copy_from_slice(&generation.to_le_bytes());
    for m in set {
        let in_use = !close || m.inconsistent;
        let flags = if in_use { F_IN_USE } else { 0 }
            | if m.map.enabled() { F_ENABLED } else { 0 }
            | if m.inconsistent { F_INCONSISTENT } else { 0 };
        let data_len = m.map.bits().div_ceil(8);
        b.extend_from_slice(&flags.to_le_bytes());
        b.push(m.map.granularity().trailing_zeros() as u8);
        b.push(0);
        b.extend_from_slice(&(m.name.len() as u16).to_le_bytes());
        b.extend_from_slice(&data_len.to_le_bytes());
        b.extend_from_slice(m.name.as_bytes());
        b.resize(b.len().div_ceil(8) * 8, 0);
        let at = b.len();
        b.resize(at + (data_len as usize).div_ceil(8) * 8, 0);
        m.map.export_bits(0, &mut b[at..]);
    }
    let body = (b.len() - HEADER) as u64;
    b[40..48].copy_from_slice(&body.to_le_bytes());
    let crc = crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b
}

/// The bitmaps in the file's bytes `b` (untrusted), of a disk of `size`
/// bytes, and the file's generation. A bitmap marked in use comes back
/// inconsistent.
pub fn decode(b: &[u8], size: u64) -> Result<(Vec<StoredBitmap>, u64)> {
    let bad = |m: &str| Error::new(ErrorKind::Corrupt, m.to_owned());
    if b.len() < HEADER + 8 || &b[..8] != MAGIC {
        return Err(bad("not a vdisk bitmap file (no VDBITMAP magic)"));
    }
    if le32(b, 8) != VERSION {
        return Err(bad(&format!("bitmap file version {} is not supported (only 1 is)", le32(b, 8))));
    }
    let body = le64(b, 40);
    if body != (b.len() - HEADER - 8) as u64 {
        return Err(bad("the bitmap file is cut short or has bytes past its end"));
    }
    let end = b.len() - 8;
    if crc32c(&b[..end]) != le32(b, end) || le32(b, end + 4) != 0 {
        return Err(bad("the bitmap file fails its checksum"));
    }
    if le64(b, 16) != size {
        return Err(Error::invalid(format!(
            "the bitmaps are of a {}-byte disk but the disk has {size} bytes (was it resized?)",
            le64(b, 16)
        )));
    }
    let n = le32(b, 24);
    let generation = le64(b, 32);
    let mut at = HEADER;
    let mut out: Vec<StoredBitmap> = Vec::new();
    for _ in 0..n {
        if end - at < 16 {
            return Err(bad("a bitmap entry runs past the file's end"));
        }
        let flags = le32(b, at);
        let gbits = b[at + 4] as u32;
        let name_len = u16::from_le_bytes([b[at + 6], b[at + 7]]) as usize;
        let data_len = le64(b, at + 8);
        at += 16;
        if gbits > 31 {
            return Err(bad("a bitmap has a bad granularity"));
        }
        let g = 1u64 << gbits;
        check_granularity(g).map_err(|e| bad(e.message()))?;
        if data_len != size.div_ceil(g).div_ceil(8) {
            return Err(bad("a bitmap's data length does not match its granularity"));
        }
        let name_pad = name_len.div_ceil(8) * 8;
        let data_pad = (data_len as usize).div_ceil(8) * 8;
        if name_pad > end - at || data_pad > end - at - name_pad {
            return Err(bad("a bitmap entry runs past the file's end"));
        }
        let name = std::str::from_utf8(&b[at..at + name_len]).map_err(|_| bad("a bitmap name is not UTF-8"))?;
        check_name(name).map_err(|e| bad(e.message()))?;
        if out.iter().any(|m| m.name == name) {
            return Err(bad(&format!("two bitmaps are named {name:?}")));
        }
        at += name_pad;
        let map = DirtyBitmap::new(size, g)?;
        map.import_bits(0, &b[at..at + data_len as usize]);
        map.set_enabled(flags & F_ENABLED != 0);
        at += data_pad;
        let inconsistent = flags & (F_IN_USE | F_INCONSISTENT) != 0;
        out.push(StoredBitmap { name: name.to_owned(), map: Arc::new(map), inconsistent });
    }
    if at != end {
        return Err(bad("the bitmap file has bytes past its last bitmap"));
    }
    Ok((out, generation))
}

impl SidecarStore {
    /// The bitmaps of a disk of `size` bytes in the file `path` (which need
    /// not exist yet: no file is no bitmaps).
    pub fn new(path: impl Into<PathBuf>, size: u64, read_only: bool) -> Self {
        SidecarStore { path: path.into(), size, read_only }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read(&self) -> Result<(Vec<StoredBitmap>, u64)> {
        let p = self.path.display();
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(Error::io(e, format!("cannot read the bitmap file {p}"))),
        };
        decode(&bytes, self.size).map_err(|e| {
            Error::new(e.kind(), format!("{p}: {}; remove the file to start without bitmaps", e.message()))
        })
    }

    fn write(&self, bytes: &[u8]) -> Result<()> {
        let p = self.path.display();
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let io = |e, what: &str| Error::io(e, format!("cannot {what} the bitmap file {p}"));
        let mut f = File::create(&tmp).map_err(|e| io(e, "create a new copy of"))?;
        f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| io(e, "write"))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| io(e, "replace"))?;
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(e, "sync the directory of"))
    }
}

impl BitmapStore for SidecarStore {
    fn open_session(&self) -> Result<Vec<StoredBitmap>> {
        let (set, _) = self.read()?;
        for m in set.iter().filter(|m| m.inconsistent) {
            log::warn!(
                "{}: bitmap {:?} was not saved cleanly: it is inconsistent and will not be used for \
                 incremental backup; remove it and start a new one",
                self.path.display(),
                m.name
            );
        }
        // VDISK_BREAK=bitmap-not-in-use (a test build only): the in-use marks are not written.
        let broken = crate::breakage::active(crate::breakage::Breakage::BitmapNotInUse);
        if !self.read_only && !set.is_empty() && !broken {
            self.save(&set, false)?;
        }
        Ok(set)
    }

    fn save(&self, set: &[StoredBitmap], close: bool) -> Result<()> {
        if self.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!("{} is open read-only: the bitmaps cannot be saved", self.path.display()),
            ));
        }
        for (i, m) in set.iter().enumerate() {
            check_name(&m.name)?;
            if m.map.size() != self.size || set[..i].iter().any(|o| o.name == m.name) {
                return Err(Error::invalid(format!("bitmap {:?} is of another disk size or named twice", m.name)));
            }
        }
        let (_, generation) = self.read().unwrap_or((Vec::new(), 0));
        self.write(&encode(self.size, set, close, generation + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "vdisk-sidecar-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn a_session_marks_in_use_and_a_clean_close_clears_it() {
        let d = tmpdir();
        let p = d.join("disk.raw.bitmaps");
        let size = (10 << 20) + 512;
        let store = SidecarStore::new(&p, size, false);
        assert!(store.open_session().unwrap().is_empty());
        let a = DirtyBitmap::new(size, 65536).unwrap();
        a.set(1 << 20, 4096);
        a.set(size - 1, 1);
        let b = DirtyBitmap::new(size, 4096).unwrap();
        b.set_enabled(false);
        store.save(&[StoredBitmap::new("a", a), StoredBitmap::new("b", b)], true).unwrap();
        let set = store.open_session().unwrap();
        assert_eq!(set.len(), 2);
        assert!(set.iter().all(|m| !m.inconsistent));
        assert_eq!(set[0].map.extents(0, size, 10).iter().filter(|e| e.1).count(), 2);
        assert!(set[0].map.enabled() && !set[1].map.enabled());
        assert_eq!(set[1].map.granularity(), 4096);
        // The session did not close: found again, they are inconsistent.
        let again = SidecarStore::new(&p, size, true).open_session().unwrap();
        assert!(again.iter().all(|m| m.inconsistent));
        // And stay so across a clean close.
        store.save(&again, true).unwrap();
        assert!(SidecarStore::new(&p, size, true).open_session().unwrap().iter().all(|m| m.inconsistent));
        store.save(&[], true).unwrap();
        assert!(SidecarStore::new(&p, size, true).open_session().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn damaged_files_are_refused_never_half_read() {
        let size = 1 << 20;
        let m = DirtyBitmap::new(size, 65536).unwrap();
        m.set(0, 1);
        let good = encode(size, &[StoredBitmap::new("x", m)], true, 1);
        assert_eq!(decode(&good, size).unwrap().0.len(), 1);
        assert!(decode(&good, size * 2).is_err());
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x10;
            assert!(decode(&b, size).is_err(), "a flip at byte {i} was not caught");
        }
        for n in 0..good.len() {
            assert!(decode(&good[..n], size).is_err());
        }
    }
}
