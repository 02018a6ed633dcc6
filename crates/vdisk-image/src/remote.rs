//! An image whose disk is another server's: every byte at the same offset
//! of one [`BlockTarget`] (an NBD export, through vdisk-nbd's client). What
//! a mirror's pivot onto an NBD target serves from. The engine performs its
//! I/O with the target's blocking calls ([`Storage::Remote`]); it has no
//! file, no metadata of its own, and every byte counts as data.

use std::path::PathBuf;

use crate::{map_one_to_one, Allocation, BlockTarget, Extent, Image, ImageBase, Result, Storage};

pub struct RemoteImage {
    base: ImageBase,
    target: Box<dyn BlockTarget>,
    format: &'static str,
}

impl RemoteImage {
    /// The disk of `size` bytes that `target` holds, named `name` (its URI)
    /// in messages, of format `format` ("nbd").
    pub fn new(name: &str, size: u64, read_only: bool, format: &'static str, target: Box<dyn BlockTarget>) -> Self {
        RemoteImage { base: ImageBase::new(PathBuf::from(name), size, read_only, Vec::new()), target, format }
    }
}

impl Image for RemoteImage {
    fn format(&self) -> &'static str {
        self.format
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    /// One target, the remote disk.
    fn target(&self, i: usize) -> Option<Storage<'_>> {
        (i == 0).then_some(Storage::Remote(&*self.target))
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    /// All data: always a correct answer, and no round trip.
    fn allocation(&self, _offset: u64, len: u64, _max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        out.push(Allocation { len, hole: false, zero: false, depth: 1 });
        Ok(())
    }
}
