//! Creating new qcow2 images (version 3, 16-bit refcounts, as `qemu-img
//! create -f qcow2` makes them): header, refcount table and blocks, and an
//! empty L1 table, every metadata cluster counted.
//!
//! Layout: cluster 0 the header (with the backing format extension and the
//! backing file name), then the refcount table, the refcount blocks that
//! count all of this, then the L1 table. Everything else is allocated on
//! first write. What it must never do: replace an existing file, or leave a
//! half-written image behind (it is removed on failure).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::header::{write_new_header, NewHeader, MAX_SIZE};
use super::refcount;
use super::Qcow2Image;
use crate::{Error, Result};

/// Refcount width of new images (qemu's default).
const REFCOUNT_ORDER: u32 = 4;
/// Cluster size of new images unless asked otherwise (qemu's default).
pub const DEFAULT_CLUSTER_BITS: u32 = 16;

/// What a new image is made of.
pub struct CreateOptions<'a> {
    pub size: u64,
    pub cluster_bits: u32,
    /// The backing file name to record (as given) and its format.
    pub backing: Option<(&'a Path, &'a str)>,
}

impl Qcow2Image {
    /// Creates a new, empty qcow2 image. Refuses to replace an existing file.
    pub fn create(path: &Path, o: &CreateOptions) -> Result<()> {
        if o.size == 0 || o.size > MAX_SIZE {
            return Err(Error::invalid(format!("a qcow2 image cannot be {} bytes", o.size)));
        }
        if !(9..=21).contains(&o.cluster_bits) {
            return Err(Error::invalid("the cluster size must be a power of two from 512 B to 2 MiB"));
        }
        let cs = 1u64 << o.cluster_bits;
        let l1_size = o.size.div_ceil(cs * (cs / 8));
        let l1_clusters = (l1_size * 8).div_ceil(cs).max(1);
        let per_block = cs * 8 / (1 << REFCOUNT_ORDER);
        // Refcount blocks and table clusters enough to count everything made here.
        let (mut blocks, mut table) = (1u64, 1u64);
        while blocks * per_block < 1 + table + blocks + l1_clusters || table * cs / 8 < blocks {
            blocks += 1;
            table = (blocks * 8).div_ceil(cs);
        }
        let total = 1 + table + blocks + l1_clusters;
        let (table_at, blocks_at, l1_at) = (cs, cs * (1 + table), cs * (1 + table + blocks));
        let name = o.backing.map(|(p, f)| (p.as_os_str().as_bytes(), f));
        let head = write_new_header(&NewHeader {
            cluster_bits: o.cluster_bits,
            size: o.size,
            l1_size: l1_size as u32,
            l1_table_offset: l1_at,
            refcount_table_offset: table_at,
            refcount_table_clusters: table as u32,
            refcount_order: REFCOUNT_ORDER,
            backing: name,
        })?;
        let mut table_bytes = vec![0u8; (table * cs) as usize];
        for b in 0..blocks {
            let at = blocks_at + b * cs;
            table_bytes[b as usize * 8..b as usize * 8 + 8].copy_from_slice(&at.to_be_bytes());
        }
        let mut block_bytes = vec![0u8; (blocks * cs) as usize];
        for c in 0..total {
            refcount::set(&mut block_bytes, 1 << REFCOUNT_ORDER, c, 1);
        }
        let file = OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::invalid(format!("{} already exists; remove it first or pick another name", path.display()))
            } else {
                Error::io(e, format!("cannot create {}", path.display()))
            }
        })?;
        let result = (|| -> io::Result<()> {
            file.write_all_at(&head, 0)?;
            file.write_all_at(&table_bytes, table_at)?;
            file.write_all_at(&block_bytes, blocks_at)?;
            file.set_len(total * cs)?;
            file.sync_all()
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(path);
            return Err(Error::io(e, format!("cannot write the new image {}", path.display())));
        }
        Ok(())
    }
}
