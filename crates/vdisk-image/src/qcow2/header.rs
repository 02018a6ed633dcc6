//! The qcow2 header and its extensions: parsing untrusted bytes into a
//! checked [`Header`], and writing the header of a new or updated image.
//!
//! What it owns: the on-disk layout of cluster 0 (qemu's
//! `docs/interop/qcow2.txt`, big-endian):
//!
//! ```text
//! 0   u32 magic "QFI\xfb"          48  u64 refcount_table_offset
//! 4   u32 version (2 or 3)         56  u32 refcount_table_clusters
//! 8   u64 backing_file_offset      60  u32 nb_snapshots
//! 16  u32 backing_file_size        64  u64 snapshots_offset
//! 20  u32 cluster_bits             -- version 3 only --
//! 24  u64 size                     72  u64 incompatible_features
//! 32  u32 crypt_method             80  u64 compatible_features
//! 36  u32 l1_size                  88  u64 autoclear_features
//! 40  u64 l1_table_offset          96  u32 refcount_order, 100 u32 header_length
//!                                  104 u8 compression_type (if header_length > 104)
//! ```
//!
//! then header extensions (u32 type, u32 length, data padded to 8 bytes) up
//! to a type-0 end marker, and the backing file name at its own offset.
//!
//! What it must never do: touch a file (it takes bytes, so it can be fuzzed),
//! panic or allocate without bound on hostile input, or accept a header whose
//! tables could not be addressed with the arithmetic the rest of the module
//! does unchecked (every offset and size is bounded here).

use crate::{Error, ErrorKind, Result};

pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Bytes of a version 2 header; version 3 headers are at least 104.
pub const V2_HEADER_LEN: usize = 72;
pub const V3_HEADER_LEN: usize = 104;

/// Incompatible feature bits.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 = 0x1f;
/// Compatible feature bit: lazy refcounts.
pub const COMPAT_LAZY_REFCOUNTS: u64 = 1 << 0;

pub(super) const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
pub(super) const EXT_BITMAPS: u32 = 0x2385_2875;
const EXT_ENCRYPTION: u32 = 0x0537_be77;
const EXT_DATA_FILE: u32 = 0x4441_5441;

/// Host offsets above this are refused: qcow2 descriptors hold 56 bits.
pub const MAX_HOST_OFFSET: u64 = 1 << 56;
/// Virtual sizes above this are refused (qemu's own limit is 2^61 / 512 * 512).
pub const MAX_SIZE: u64 = 1 << 61;
/// Most L1 entries accepted (qemu's limit: 32 MiB of L1 table).
pub const MAX_L1_ENTRIES: u64 = (32 << 20) / 8;
/// Most refcount table clusters accepted (qemu's limit: 8 MiB of table).
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;

/// What a header says, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub size: u64,
    pub crypt_method: u32,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible: u64,
    pub compatible: u64,
    pub autoclear: u64,
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression_type: u8,
    pub backing_file_offset: u64,
    pub backing_file_size: u32,
    /// The backing file name, raw bytes (not trusted: see `open`).
    pub backing: Option<Vec<u8>>,
    /// The backing format extension's value ("raw", "qcow2", ...).
    pub backing_format: Option<String>,
    /// Extensions present that vdisk does not interpret, by type (for `info`).
    pub has_bitmaps: bool,
    /// The bitmaps extension: (nb_bitmaps, bitmap_directory_size, bitmap_directory_offset).
    pub bitmaps_ext: Option<(u32, u64, u64)>,
    pub has_encryption_ext: bool,
    pub has_data_file_ext: bool,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, msg.into())
}

/// True when `bytes` starts with the qcow2 magic.
pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && bytes[..4] == MAGIC
}

impl Header {
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    pub fn extended_l2(&self) -> bool {
        self.incompatible & INCOMPAT_EXTL2 != 0
    }

    /// Bytes of one L2 entry (16 with extended L2: descriptor and subcluster bitmap).
    pub fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    /// Entries in one L2 table.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_bytes()
    }

    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// Clusters one refcount block describes.
    pub fn refcount_block_entries(&self) -> u64 {
        self.cluster_size() * 8 / self.refcount_bits() as u64
    }

    /// L1 entries a disk of this size needs.
    pub fn l1_needed(&self) -> u64 {
        self.size.div_ceil(self.cluster_size() * self.l2_entries())
    }

    /// Guest clusters on the disk.
    pub fn clusters(&self) -> u64 {
        self.size.div_ceil(self.cluster_size())
    }

    /// Zero clusters and the zero flag exist from version 3 on.
    pub fn has_zero_flag(&self) -> bool {
        self.version >= 3
    }
}

/// Parses and checks the header in `b` (the whole first cluster, or as much
/// of the file as there is). Never panics; refuses what it cannot bound.
pub fn parse_header(b: &[u8]) -> Result<Header> {
    if !has_magic(b) {
        return Err(Error::invalid("not a qcow2 image (no QFI\\xfb magic at its start)"));
    }
    if b.len() < V2_HEADER_LEN {
        return Err(corrupt(format!("the qcow2 header is cut short ({} bytes)", b.len())));
    }
    let version = be32(b, 4);
    if version != 2 && version != 3 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("qcow2 version {version} is not supported (only 2 and 3 are)"),
        ));
    }
    let mut h = Header {
        version,
        backing_file_offset: be64(b, 8),
        backing_file_size: be32(b, 16),
        cluster_bits: be32(b, 20),
        size: be64(b, 24),
        crypt_method: be32(b, 32),
        l1_size: be32(b, 36),
        l1_table_offset: be64(b, 40),
        refcount_table_offset: be64(b, 48),
        refcount_table_clusters: be32(b, 56),
        nb_snapshots: be32(b, 60),
        snapshots_offset: be64(b, 64),
        incompatible: 0,
        compatible: 0,
        autoclear: 0,
        refcount_order: 4,
        header_length: V2_HEADER_LEN as u32,
        compression_type: 0,
        backing: None,
        backing_format: None,
        has_bitmaps: false,
        bitmaps_ext: None,
        has_encryption_ext: false,
        has_data_file_ext: false,
    };
    if version == 3 {
        if b.len() < V3_HEADER_LEN {
            return Err(corrupt(format!("the qcow2 v3 header is cut short ({} bytes)", b.len())));
        }
        h.incompatible = be64(b, 72);
        h.compatible = be64(b, 80);
        h.autoclear = be64(b, 88);
        h.refcount_order = be32(b, 96);
        h.header_length = be32(b, 100);
        if (h.header_length as usize) < V3_HEADER_LEN || !h.header_length.is_multiple_of(8) {
            return Err(corrupt(format!("header_length {} is invalid", h.header_length)));
        }
        if h.header_length > V3_HEADER_LEN as u32 && b.len() > V3_HEADER_LEN {
            h.compression_type = b[104];
        }
    }
    check_geometry(&h)?;
    check_features(&h)?;
    parse_extensions(b, &mut h)?;
    parse_backing_name(b, &mut h)?;
    Ok(h)
}

fn check_geometry(h: &Header) -> Result<()> {
    if !(9..=21).contains(&h.cluster_bits) {
        return Err(corrupt(format!("cluster_bits {} is outside 9..=21 (512 B to 2 MiB)", h.cluster_bits)));
    }
    if h.refcount_order > 6 {
        return Err(corrupt(format!("refcount_order {} is above 6 (64-bit refcounts)", h.refcount_order)));
    }
    if h.size > MAX_SIZE {
        return Err(corrupt(format!("the virtual size {} is beyond what vdisk accepts", h.size)));
    }
    let cs = h.cluster_size();
    if h.extended_l2() && h.cluster_bits < 14 {
        return Err(corrupt("extended L2 entries need clusters of at least 16 KiB"));
    }
    if (h.l1_size as u64) < h.l1_needed() {
        return Err(corrupt(format!("the L1 table ({} entries) is too small for the virtual size", h.l1_size)));
    }
    if h.l1_size as u64 > MAX_L1_ENTRIES {
        return Err(corrupt(format!("the L1 table ({} entries) is larger than vdisk accepts", h.l1_size)));
    }
    let reftable = h.refcount_table_clusters as u64 * cs;
    if reftable == 0 || reftable > MAX_REFTABLE_BYTES {
        return Err(corrupt(format!(
            "the refcount table ({} clusters) is empty or too large",
            h.refcount_table_clusters
        )));
    }
    for (what, at, len) in
        [("L1 table", h.l1_table_offset, h.l1_size as u64 * 8), ("refcount table", h.refcount_table_offset, reftable)]
    {
        if at == 0 || at % cs != 0 || at >= MAX_HOST_OFFSET || at + len > MAX_HOST_OFFSET {
            return Err(corrupt(format!("the {what} offset {at:#x} is not a valid cluster offset")));
        }
    }
    if !h.snapshots_offset.is_multiple_of(cs) || h.snapshots_offset >= MAX_HOST_OFFSET {
        return Err(corrupt(format!("the snapshot table offset {:#x} is invalid", h.snapshots_offset)));
    }
    Ok(())
}

fn check_features(h: &Header) -> Result<()> {
    if h.crypt_method != 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "the image is encrypted (qcow2 crypt_method set): vdisk does not serve encrypted qcow2; \
             decrypt it with `qemu-img convert --object secret,... --image-opts ... -O qcow2 NEW`",
        ));
    }
    let unknown = h.incompatible & !INCOMPAT_KNOWN;
    if unknown != 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("the image uses incompatible features vdisk does not know ({unknown:#x})"),
        ));
    }
    if h.incompatible & INCOMPAT_DATA_FILE != 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "the image keeps its data in an external data file, which vdisk does not support",
        ));
    }
    if h.incompatible & INCOMPAT_COMPRESSION != 0 && h.compression_type > 1 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("compression type {} is unknown (0 is zlib, 1 zstd)", h.compression_type),
        ));
    }
    Ok(())
}

/// Walks the header extensions after the header, up to the end marker or
/// the end of `b` (whichever comes first; the backing name is after them).
fn parse_extensions(b: &[u8], h: &mut Header) -> Result<()> {
    let mut at = h.header_length as usize;
    let limit = b.len().min(h.cluster_size() as usize);
    while at + 8 <= limit {
        let (ty, len) = (be32(b, at), be32(b, at + 4) as usize);
        at += 8;
        if ty == EXT_END {
            return Ok(());
        }
        if len > limit - at {
            return Err(corrupt(format!("header extension {ty:#x} runs past the first cluster")));
        }
        let data = &b[at..at + len];
        match ty {
            EXT_BACKING_FORMAT => {
                let s = std::str::from_utf8(data).map_err(|_| corrupt("the backing format name is not UTF-8"))?;
                h.backing_format = Some(s.trim_end_matches('\0').to_owned());
            }
            EXT_BITMAPS => {
                h.has_bitmaps = true;
                if len >= 24 {
                    h.bitmaps_ext = Some((be32(data, 0), be64(data, 8), be64(data, 16)));
                }
            }
            EXT_ENCRYPTION => h.has_encryption_ext = true,
            EXT_DATA_FILE => h.has_data_file_ext = true,
            EXT_FEATURE_TABLE => {}
            _ => {}
        }
        at += len.div_ceil(8) * 8;
    }
    Ok(())
}

fn parse_backing_name(b: &[u8], h: &mut Header) -> Result<()> {
    if h.backing_file_offset == 0 || h.backing_file_size == 0 {
        return Ok(());
    }
    let (at, len) = (h.backing_file_offset, h.backing_file_size as u64);
    if len > 1023 || at > h.cluster_size() || len > h.cluster_size() - at {
        return Err(corrupt(format!("the backing file name ({len} bytes at {at}) is not within the first cluster")));
    }
    if at + len > b.len() as u64 {
        return Err(corrupt("the backing file name is past the end of the file"));
    }
    let name = &b[at as usize..(at + len) as usize];
    if name.contains(&0) {
        return Err(corrupt("the backing file name contains a NUL byte"));
    }
    h.backing = Some(name.to_vec());
    Ok(())
}

/// What a new image's first cluster holds.
pub struct NewHeader<'a> {
    pub cluster_bits: u32,
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub refcount_order: u32,
    pub backing: Option<(&'a [u8], &'a str)>,
}

/// The first cluster of a new version 3 image (extensions and backing name included).
pub fn write_new_header(n: &NewHeader) -> Result<Vec<u8>> {
    let cs = 1usize << n.cluster_bits;
    let mut b = vec![0u8; V3_HEADER_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    b[20..24].copy_from_slice(&n.cluster_bits.to_be_bytes());
    b[24..32].copy_from_slice(&n.size.to_be_bytes());
    b[36..40].copy_from_slice(&n.l1_size.to_be_bytes());
    b[40..48].copy_from_slice(&n.l1_table_offset.to_be_bytes());
    b[48..56].copy_from_slice(&n.refcount_table_offset.to_be_bytes());
    b[56..60].copy_from_slice(&n.refcount_table_clusters.to_be_bytes());
    b[96..100].copy_from_slice(&n.refcount_order.to_be_bytes());
    b[100..104].copy_from_slice(&(V3_HEADER_LEN as u32).to_be_bytes());
    if let Some((_, fmt)) = n.backing {
        push_ext(&mut b, EXT_BACKING_FORMAT, fmt.as_bytes());
    }
    push_ext(&mut b, EXT_END, &[]);
    if let Some((name, _)) = n.backing {
        if name.len() > 1023 {
            return Err(Error::invalid("the backing file path is longer than qcow2's 1023 bytes"));
        }
        let at = b.len() as u64;
        b[8..16].copy_from_slice(&at.to_be_bytes());
        b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        b.extend_from_slice(name);
    }
    if b.len() > cs {
        return Err(Error::invalid("the header and backing file name do not fit in one cluster; pick larger clusters"));
    }
    b.resize(cs, 0);
    Ok(b)
}

pub(super) fn push_ext(b: &mut Vec<u8>, ty: u32, data: &[u8]) {
    b.extend_from_slice(&ty.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b.resize(b.len().div_ceil(8) * 8, 0);
}

/// Where the incompatible/autoclear fields sit, for in-place header updates.
pub const INCOMPATIBLE_AT: u64 = 72;
pub const AUTOCLEAR_AT: u64 = 88;
pub const REFTABLE_AT: u64 = 48;

#[cfg(test)]
mod tests {
    use super::*;

    fn v3(cluster_bits: u32, size: u64) -> Vec<u8> {
        let n = NewHeader {
            cluster_bits,
            size,
            l1_size: 8,
            l1_table_offset: 3 << cluster_bits,
            refcount_table_offset: 1 << cluster_bits,
            refcount_table_clusters: 1,
            refcount_order: 4,
            backing: Some((b"base.img", "raw")),
        };
        write_new_header(&n).unwrap()
    }

    #[test]
    fn a_written_header_parses_back() {
        let h = parse_header(&v3(16, 1 << 30)).unwrap();
        assert_eq!((h.version, h.cluster_size(), h.size, h.refcount_bits()), (3, 65536, 1 << 30, 16));
        assert_eq!(h.backing.as_deref(), Some(&b"base.img"[..]));
        assert_eq!(h.backing_format.as_deref(), Some("raw"));
    }

    #[test]
    fn hostile_fields_are_refused_not_panicked_on() {
        let good = v3(16, 1 << 30);
        let set = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            parse_header(&b)
        };
        assert!(set(8, &u64::MAX.to_be_bytes()).is_err(), "backing name offset at the end of u64");
        assert!(set(20, &40u32.to_be_bytes()).is_err(), "cluster bits");
        assert!(set(24, &u64::MAX.to_be_bytes()).is_err(), "size");
        assert!(set(36, &u32::MAX.to_be_bytes()).is_err(), "L1 size");
        assert!(set(40, &(u64::MAX - 7).to_be_bytes()).is_err(), "L1 offset");
        assert!(set(56, &u32::MAX.to_be_bytes()).is_err(), "refcount table clusters");
        assert!(set(96, &7u32.to_be_bytes()).is_err(), "refcount order");
        assert!(set(32, &1u32.to_be_bytes()).unwrap_err().message().contains("encrypted"));
        assert!(set(72, &(1u64 << 40).to_be_bytes()).is_err(), "unknown incompatible feature");
        assert!(parse_header(&good[..50]).is_err());
    }
}
