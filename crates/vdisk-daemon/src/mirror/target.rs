//! Where a mirror or an active commit writes: a [`Target`] takes the copied
//! runs (data, or zeros), flushes, and says what it is for messages. Two
//! kinds: an image file opened on its own, written synchronously by the job's
//! thread through the image's own mapping ([`crate::chain`]: prepare, map,
//! write the extents, `write_done`), an NBD export reached with vdisk-nbd's
//! remote client, and an RBD image opened on its own by the job (librbd's
//! blocking calls, one connection of its own: the export's device never sees it).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_image::{Extent, Image, RbdImage};
use vdisk_nbd::remote::{Remote, RemoteDisk, Uri};

use crate::chain;

/// What a copy job writes to. Errors are messages for people, naming the target.
pub trait Target: Send {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// `len` bytes at `offset` read as zeros from now on.
    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String>;
    /// Makes everything written durable.
    fn flush(&mut self) -> Result<(), String>;
    /// The target for messages ("/x/y.qcow2 (qcow2)", "nbd://h:p/name").
    fn describe(&self) -> String;
    /// The target as an image an export of `size` bytes can be served from
    /// (a pivot onto it), through the job's own connection; an image file is
    /// opened anew instead (as the export opens its images).
    fn into_served(self: Box<Self>, _size: u64) -> Result<Arc<dyn Image>, String> {
        Err(format!("{} is opened anew to be served", self.describe()))
    }
}

/// An image file opened on its own, read-write, written through its own
/// mapping ([`crate::chain::write`], [`crate::chain::zero`]).
pub struct ImageTarget {
    pub image: Arc<dyn Image>,
    pub path: PathBuf,
    extents: Vec<Extent>,
}

impl ImageTarget {
    pub fn new(image: Arc<dyn Image>, path: &Path) -> ImageTarget {
        ImageTarget { image, path: path.to_owned(), extents: Vec::new() }
    }
}

impl Target for ImageTarget {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        chain::write(&*self.image, offset, data, &mut self.extents)
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String> {
        chain::zero(&*self.image, offset, len, &mut self.extents)
    }

    fn flush(&mut self) -> Result<(), String> {
        chain::flush(&*self.image)
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.path.display(), self.image.format())
    }
}

/// An NBD export (another vdisk, qemu-nbd, nbdkit), of the source's size.
pub struct NbdTarget {
    pub remote: Remote,
    pub uri: String,
}

impl Target for NbdTarget {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.remote
            .write(offset, data)
            .map_err(|e| format!("writing {} bytes at offset {offset} of {}: {e}", data.len(), self.uri))
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.remote
            .zero(offset, len)
            .map_err(|e| format!("zeroing {len} bytes at offset {offset} of {}: {e}", self.uri))
    }

    fn flush(&mut self) -> Result<(), String> {
        self.remote.flush().map_err(|e| format!("flushing {}: {e}", self.uri))
    }

    fn describe(&self) -> String {
        self.uri.clone()
    }

    fn into_served(self: Box<Self>, size: u64) -> Result<Arc<dyn Image>, String> {
        let uri = Uri::parse(&self.uri)?;
        let disk = RemoteDisk::new(uri, self.remote);
        Ok(Arc::new(vdisk_image::RemoteImage::new(&self.uri, size, false, "nbd", Box::new(disk))))
    }
}

/// An RBD image: made by the job at the export's size, or an existing one
/// at least that large (`--existing`).
pub struct RbdTarget(pub RbdImage);

impl Target for RbdTarget {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.0
            .write_at(data, offset)
            .map_err(|e| format!("writing {} bytes at offset {offset} of {}: {e}", data.len(), self.0.spec()))
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.0
            .write_zeroes_at(offset, len)
            .map_err(|e| format!("zeroing {len} bytes at offset {offset} of {}: {e}", self.0.spec()))
    }

    fn flush(&mut self) -> Result<(), String> {
        self.0.flush().map_err(|e| e.report().to_string())
    }

    fn describe(&self) -> String {
        self.0.spec().to_string()
    }

    fn into_served(self: Box<Self>, size: u64) -> Result<Arc<dyn Image>, String> {
        if self.0.size() != size {
            return Err(format!(
                "the RBD image {} is {} bytes and the export {size}: only an image of the same size can be served in \
                 its place",
                self.0.spec(),
                self.0.size()
            ));
        }
        Ok(Arc::new(self.0))
    }
}
