//! The UML COW v3 header: parsing untrusted bytes, writing new headers, and
//! the layout arithmetic (where the bitmap and the data start).
//!
//! Layout (big-endian, packed, as linux `arch/um/drivers/cow_user.c` writes it):
//!
//! ```text
//! 0   u32  magic 0x4f4f4f4d ("OOOM")
//! 4   u32  version (3)
//! 8   u32  mtime of the backing file, seconds
//! 12  u64  size of the disk in bytes
//! 20  u32  sector size (one bitmap bit per sector; 512 in practice)
//! 24  u32  alignment of the bitmap and the data
//! 28  u32  cow format (0: bitmap)
//! 32  [u8; 4096] backing file path, NUL-terminated
//! ```
//!
//! The bitmap starts at the header size rounded up to the alignment; it holds
//! one bit per sector, `ceil(ceil(size / sector) / 8)` bytes, bit n in byte
//! n / 8 at position n % 8 (least significant first). The data starts at the
//! end of the bitmap rounded up to the alignment; sector n lives at
//! `data_offset + n * sector_size`.
//!
//! Until 2005 some 64-bit builds wrote the header unpacked (4 bytes of
//! padding after mtime, so every later field moves by 4). UML recognises such
//! files by the zero `cow_format` landing on the first 4 bytes of the path;
//! this parser does the same, reads them, and never writes that layout.
//!
//! Nothing here touches a file: [`parse_header`] takes bytes, so it can be
//! fuzzed, and must never panic whatever it is given.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::{Error, ErrorKind, Result};

pub const MAGIC: u32 = 0x4f4f_4f4d;
pub const VERSION: u32 = 3;
/// Bytes of the backing path field.
pub const PATH_LEN: usize = 4096;
/// Size of the (packed) v3 header.
pub const HEADER_LEN: usize = 32 + PATH_LEN;
/// Size of the old unpacked 64-bit v3 header (see the module docs).
const BROKEN_HEADER_LEN: usize = 40 + PATH_LEN;
/// The most header bytes a parser may need.
pub const MAX_HEADER_LEN: usize = BROKEN_HEADER_LEN;
/// Sector size and alignment of overlays vdisk creates (what uml_mkcow uses).
pub const DEFAULT_SECTOR_SIZE: u32 = 512;
pub const DEFAULT_ALIGNMENT: u32 = 4096;
/// Bounds this implementation accepts: wide enough for every real overlay,
/// narrow enough that no header can make vdisk allocate absurd buffers.
const MIN_SECTOR: u32 = 512;
const MAX_SECTOR: u32 = 64 << 10;
const MAX_ALIGNMENT: u32 = 1 << 20;

/// Which of the two on-disk v3 layouts a header uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The packed layout every current tool writes.
    Packed,
    /// The pre-2006 unpacked 64-bit layout (read only).
    Unpacked64,
}

/// A parsed, validated v3 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The backing file's modification time (seconds, truncated to 32 bits) when the overlay was made.
    pub mtime: u32,
    /// The virtual disk size in bytes: the backing file's size.
    pub size: u64,
    pub sector_size: u32,
    pub alignment: u32,
    /// The backing file path exactly as written (untrusted; may be relative).
    pub backing: Vec<u8>,
    pub layout: Layout,
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg)
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// True when `bytes` start with the COW magic in either byte order (the
/// native-endian form is how version 1 headers were written on x86).
pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && (be32(bytes, 0) == MAGIC || be32(bytes, 0) == MAGIC.swap_bytes())
}

/// Parses and validates a header from the first bytes of a file (pass at
/// least [`MAX_HEADER_LEN`] bytes when the file has them). The error says
/// what is wrong; the caller adds which file it was.
pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    if bytes.len() < 8 {
        return Err(corrupt(format!(
            "truncated COW header: the file has {} bytes, a header needs {HEADER_LEN}",
            bytes.len()
        )));
    }
    let magic = be32(bytes, 0);
    let version = if magic == MAGIC {
        be32(bytes, 4)
    } else if magic == MAGIC.swap_bytes() {
        // Native-endian (x86) headers are version 1 files from the oldest UML.
        u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]])
    } else {
        return Err(corrupt(format!("not a COW overlay: magic {magic:#010x}, want {MAGIC:#010x}")));
    };
    match version {
        3 => {}
        1 | 2 => {
            return Err(corrupt(format!(
                "COW version {version} overlays are not supported, only version 3 \
                     (merge it with `uml_moo OVERLAY NEW.img` and make a new overlay over the result)"
            )))
        }
        v => return Err(corrupt(format!("unknown COW version {v} (only version 3 is supported)"))),
    }
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "truncated COW header: the file has {} bytes, a v3 header needs {HEADER_LEN}",
            bytes.len()
        )));
    }
    // See the module docs: in the unpacked layout the zero cow_format sits
    // where the packed layout's path starts, which no real path can.
    let layout = if bytes[32..36] == [0, 0, 0, 0] { Layout::Unpacked64 } else { Layout::Packed };
    let (size_at, path_at) = match layout {
        Layout::Packed => (12, 32),
        Layout::Unpacked64 => (16, 36),
    };
    if layout == Layout::Unpacked64 && bytes.len() < BROKEN_HEADER_LEN {
        return Err(corrupt(format!(
            "truncated COW header: the file has {} bytes, this (old 64-bit) v3 header needs {BROKEN_HEADER_LEN}",
            bytes.len()
        )));
    }
    let mtime = be32(bytes, 8);
    let size = be64(bytes, size_at);
    let sector_size = be32(bytes, size_at + 8);
    let alignment = be32(bytes, size_at + 12);
    let format = be32(bytes, size_at + 16);
    let path_field = &bytes[path_at..path_at + PATH_LEN];

    if format != 0 {
        return Err(corrupt(format!("unknown COW format {format} (only 0, the bitmap, exists)")));
    }
    if !sector_size.is_power_of_two() || !(MIN_SECTOR..=MAX_SECTOR).contains(&sector_size) {
        return Err(corrupt(format!(
            "bad sector size {sector_size} in the COW header (want a power of two from {MIN_SECTOR} to {MAX_SECTOR})"
        )));
    }
    if alignment == 0 || alignment > MAX_ALIGNMENT {
        return Err(corrupt(format!("bad alignment {alignment} in the COW header (want 1 to {MAX_ALIGNMENT})")));
    }
    if size == 0 {
        return Err(corrupt("the COW header says the disk is 0 bytes"));
    }
    let Some(nul) = path_field.iter().position(|&b| b == 0) else {
        return Err(corrupt("the backing file name in the COW header is not terminated"));
    };
    if nul == 0 {
        return Err(corrupt("the COW header names no backing file"));
    }
    let header = Header { mtime, size, sector_size, alignment, backing: path_field[..nul].to_vec(), layout };
    // Every offset must be representable (and the data area must fit a file).
    match header.data_offset().checked_add(size) {
        Some(end) if end <= i64::MAX as u64 => Ok(header),
        _ => Err(corrupt(format!("the COW header's size {size} is too large"))),
    }
}

fn round_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align).saturating_mul(align)
}

impl Header {
    /// A new packed header for an overlay over a backing file of `size` bytes.
    pub fn new(backing: &Path, size: u64, mtime: u32) -> Result<Header> {
        let path = backing.as_os_str().as_bytes();
        if path.len() >= PATH_LEN {
            return Err(Error::invalid(format!(
                "the backing file path {} is too long for a COW header ({} bytes, at most {})",
                backing.display(),
                path.len(),
                PATH_LEN - 1
            )));
        }
        if path.contains(&0) || path.is_empty() {
            return Err(Error::invalid(format!("{:?} cannot be a backing file path", backing)));
        }
        Ok(Header {
            mtime,
            size,
            sector_size: DEFAULT_SECTOR_SIZE,
            alignment: DEFAULT_ALIGNMENT,
            backing: path.to_vec(),
            layout: Layout::Packed,
        })
    }

    /// The header bytes (always the packed layout).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&VERSION.to_be_bytes());
        b[8..12].copy_from_slice(&self.mtime.to_be_bytes());
        b[12..20].copy_from_slice(&self.size.to_be_bytes());
        b[20..24].copy_from_slice(&self.sector_size.to_be_bytes());
        b[24..28].copy_from_slice(&self.alignment.to_be_bytes());
        // 28..32: cow_format 0 (bitmap).
        let n = self.backing.len().min(PATH_LEN - 1);
        b[32..32 + n].copy_from_slice(&self.backing[..n]);
        b
    }

    /// The backing path as written in the header.
    pub fn backing_path(&self) -> &Path {
        Path::new(OsStr::from_bytes(&self.backing))
    }

    /// Number of sectors (bitmap bits); the last one may be partial.
    pub fn sectors(&self) -> u64 {
        self.size.div_ceil(self.sector_size as u64)
    }

    fn header_len(&self) -> u64 {
        match self.layout {
            Layout::Packed => HEADER_LEN as u64,
            Layout::Unpacked64 => BROKEN_HEADER_LEN as u64,
        }
    }

    /// Where the bitmap starts: the header rounded up to the alignment.
    pub fn bitmap_offset(&self) -> u64 {
        round_up(self.header_len(), self.alignment as u64)
    }

    /// Bytes of bitmap: one bit per sector.
    pub fn bitmap_len(&self) -> u64 {
        self.sectors().div_ceil(8)
    }

    /// Sectors per copy-up page: the alignment in sectors (8 for the 4 KiB of
    /// every overlay uml_mkcow or vdisk makes), or 1 when the alignment is not
    /// a whole number of sectors. Writers fill the overlay and set bits in
    /// whole pages, as the UML kernel does (see the `cow` module docs).
    pub fn page_sectors(&self) -> u64 {
        let (align, sector) = (self.alignment as u64, self.sector_size as u64);
        if align > sector && align.is_multiple_of(sector) {
            align / sector
        } else {
            1
        }
    }

    /// Where sector 0's data lives: the end of the bitmap rounded up to the alignment.
    pub fn data_offset(&self) -> u64 {
        round_up(self.bitmap_offset() + self.bitmap_len(), self.alignment as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header::new(Path::new("/srv/images/base.img"), 10 << 20, 0x6b0c_c113).unwrap()
    }

    #[test]
    fn round_trip_and_layout_matches_uml_mkcow() {
        let h = sample();
        let b = h.to_bytes();
        assert_eq!(b.len(), HEADER_LEN);
        assert_eq!(&b[..12], &[0x4f, 0x4f, 0x4f, 0x4d, 0, 0, 0, 3, 0x6b, 0x0c, 0xc1, 0x13]);
        assert_eq!(&b[12..20], &(10u64 << 20).to_be_bytes());
        assert_eq!(&b[20..32], &[0, 0, 2, 0, 0, 0, 0x10, 0, 0, 0, 0, 0]);
        assert_eq!(&b[32..52], b"/srv/images/base.img");
        assert_eq!(parse_header(&b).unwrap(), h);
        // What uml_mkcow writes for a 10 MiB backing file: bitmap at 8192 (4128
        // rounded up to 4096), 2560 bytes of bitmap, data at 12288.
        assert_eq!((h.bitmap_offset(), h.bitmap_len(), h.data_offset()), (8192, 2560, 12288));
        assert_eq!(h.backing_path(), Path::new("/srv/images/base.img"));
        assert_eq!(h.page_sectors(), 8, "4 KiB pages of 512-byte sectors");
    }

    #[test]
    fn page_is_the_alignment_in_whole_sectors() {
        let mut h = sample();
        for (sector, align, page) in [(512, 4096, 8), (512, 1 << 20, 2048), (4096, 8192, 2), (512, 1536, 3)] {
            (h.sector_size, h.alignment) = (sector, align);
            assert_eq!(h.page_sectors(), page, "sector {sector}, alignment {align}");
        }
        // An alignment below a sector, or not a whole number of them: one sector.
        for (sector, align) in [(512, 1), (512, 512), (4096, 4096), (4096, 512), (512, 700)] {
            (h.sector_size, h.alignment) = (sector, align);
            assert_eq!(h.page_sectors(), 1, "sector {sector}, alignment {align}");
        }
    }

    #[test]
    fn odd_sizes_round_up() {
        let mut h = sample();
        h.size = 512 * 8 * 3 + 1; // 25 sectors, the last partial: 4 bytes of bitmap
        assert_eq!(h.sectors(), 25);
        assert_eq!(h.bitmap_len(), 4);
        h.alignment = 512;
        assert_eq!(h.bitmap_offset(), 4608);
        assert_eq!(h.data_offset(), 5120);
        h.alignment = 1;
        assert_eq!(h.bitmap_offset(), 4128);
        assert_eq!(h.data_offset(), 4132);
    }

    /// The old unpacked 64-bit layout of `h`, with `path`.
    fn unpacked(h: &Header, path: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; BROKEN_HEADER_LEN];
        b[0..8].copy_from_slice(&h.to_bytes()[0..8]);
        b[8..12].copy_from_slice(&h.mtime.to_be_bytes());
        b[16..24].copy_from_slice(&h.size.to_be_bytes());
        b[24..28].copy_from_slice(&512u32.to_be_bytes());
        b[28..32].copy_from_slice(&4096u32.to_be_bytes());
        b[36..36 + path.len()].copy_from_slice(path);
        b
    }

    #[test]
    fn unpacked_64_bit_layout_is_read() {
        let h = sample();
        let b = unpacked(&h, b"/srv/images/base.img");
        let p = parse_header(&b).unwrap();
        assert_eq!(p.layout, Layout::Unpacked64);
        assert_eq!((p.size, p.mtime, p.backing_path()), (h.size, h.mtime, Path::new("/srv/images/base.img")));
        assert_eq!(p.bitmap_offset(), 8192);
        let e = parse_header(&b[..HEADER_LEN]).unwrap_err();
        assert!(e.message().contains("truncated"), "{e}");
    }

    fn err(b: &[u8]) -> String {
        parse_header(b).unwrap_err().to_string()
    }

    #[test]
    fn bad_headers_are_errors() {
        let good = sample().to_bytes();
        assert!(err(&[]).contains("truncated"));
        assert!(err(&good[..7]).contains("truncated"));
        assert!(err(&good[..HEADER_LEN - 1]).contains("truncated"));
        assert!(err(&[0u8; HEADER_LEN]).contains("not a COW overlay"));
        let with = |at: usize, v: &[u8]| {
            let mut b = good.clone();
            b[at..at + v.len()].copy_from_slice(v);
            b
        };
        assert!(err(&with(4, &1u32.to_be_bytes())).contains("version 1"));
        assert!(err(&with(4, &2u32.to_be_bytes())).contains("version 2"));
        assert!(err(&with(0, &[0x4d, 0x4f, 0x4f, 0x4f, 1, 0, 0, 0])).contains("version 1"));
        assert!(err(&with(4, &9u32.to_be_bytes())).contains("unknown COW version 9"));
        assert!(err(&with(20, &0u32.to_be_bytes())).contains("sector size 0"));
        assert!(err(&with(20, &1000u32.to_be_bytes())).contains("sector size 1000"));
        assert!(err(&with(24, &0u32.to_be_bytes())).contains("alignment 0"));
        assert!(err(&with(28, &1u32.to_be_bytes())).contains("format 1"));
        assert!(err(&with(12, &0u64.to_be_bytes())).contains("0 bytes"));
        assert!(err(&with(12, &u64::MAX.to_be_bytes())).contains("too large"));
        assert!(err(&with(32, &[b'x'; PATH_LEN])).contains("not terminated"));
        assert!(err(&unpacked(&sample(), b"")).contains("names no backing file"));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap stand-in for the fuzz target: random mutations of a good header.
        let good = sample().to_bytes();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let mut b = good.clone();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for k in 0..(x % 8) {
                let at = ((x >> (8 + k * 6)) as usize) % 40;
                b[at] = (x >> (k * 8)) as u8;
            }
            let cut = if x.is_multiple_of(5) { (x >> 20) as usize % (b.len() + 1) } else { b.len() };
            if let Ok(h) = parse_header(&b[..cut]) {
                let _ = (h.data_offset(), h.bitmap_len(), h.sectors());
            }
        }
    }

    #[test]
    fn new_refuses_paths_that_do_not_fit() {
        let long = "/".to_owned() + &"a".repeat(PATH_LEN);
        assert!(Header::new(Path::new(&long), 1, 0).is_err());
        assert!(Header::new(Path::new(""), 1, 0).is_err());
    }
}
