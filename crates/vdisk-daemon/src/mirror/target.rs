//! Where a mirror or an active commit writes: a [`Target`] takes the copied
//! runs (data, or zeros), flushes, and says what it is for messages. Two
//! kinds: an image file opened on its own, written synchronously by the job's
//! thread through the image's own mapping (prepare, map, write the extents,
//! `write_done`), and an NBD export reached with vdisk-nbd's remote client.
//! Reading the live source is here too ([`read_live`]): the image's mapping
//! and a plain `pread` of the extents, with no quiesce (see mirror.rs for why
//! that is correct).

use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_image::{Extent, Image};
use vdisk_nbd::remote::Remote;

/// What a copy job writes to. Errors are messages for people, naming the target.
pub trait Target: Send {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// `len` bytes at `offset` read as zeros from now on.
    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String>;
    /// Makes everything written durable.
    fn flush(&mut self) -> Result<(), String>;
    /// The target for messages ("/x/y.qcow2 (qcow2)", "nbd://h:p/name").
    fn describe(&self) -> String;
}

/// An image file opened on its own, read-write.
pub struct ImageTarget {
    pub image: Arc<dyn Image>,
    pub path: PathBuf,
    extents: Vec<Extent>,
}

impl ImageTarget {
    pub fn new(image: Arc<dyn Image>, path: &Path) -> ImageTarget {
        ImageTarget { image, path: path.to_owned(), extents: Vec::new() }
    }

    fn io(&self, what: &str, len: u64, offset: u64, e: impl std::fmt::Display) -> String {
        format!("{what} {len} bytes at offset {offset} of {}: {e}", self.describe())
    }

    /// Prepares and maps a write of `len` bytes at `offset` into `self.extents`.
    fn map(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.extents.clear();
        let image = &self.image;
        image
            .prepare_write(offset, len)
            .and_then(|()| image.map_write(offset, len, &mut self.extents))
            .map_err(|e| format!("mapping {len} bytes at offset {offset} of {}: {}", self.path.display(), e.report()))
    }

    fn done(&self, offset: u64, len: u64, r: Result<(), String>) -> Result<(), String> {
        match r {
            Ok(()) => {
                self.image.write_done(offset, len, false).map_err(|e| self.io("recording", len, offset, e.report()))
            }
            Err(e) => {
                self.image.write_failed(offset, len);
                Err(e)
            }
        }
    }
}

impl Target for ImageTarget {
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        let len = data.len() as u64;
        self.map(offset, len)?;
        let mut r = Ok(());
        let mut at = 0usize;
        for ext in &self.extents {
            let n = ext.len() as usize;
            if let Extent::Data { file, offset: fo, .. } = *ext {
                if let Err(e) = self.image.files()[file].write_all_at(&data[at..at + n], fo) {
                    r = Err(self.io("writing", n as u64, offset + at as u64, e));
                    break;
                }
            }
            at += n;
        }
        self.done(offset, len, r)
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), String> {
        let rest = match self.image.zero(offset, len, false, false) {
            Ok(rest) => rest,
            Err(e) => {
                self.image.write_failed(offset, len);
                return Err(self.io("zeroing", len, offset, e.report()));
            }
        };
        let mut r = Ok(());
        for (o, l) in rest {
            if let Err(e) = self.map(o, l) {
                r = Err(e);
                break;
            }
            for ext in &self.extents {
                let Extent::Data { file, offset: fo, len: n } = *ext else { continue };
                if let Err(e) = punch(&self.image.files()[file], fo, n) {
                    r = Err(format!("zeroing {n} bytes at offset {o} of {}: {e}", self.path.display()));
                    break;
                }
            }
        }
        self.done(offset, len, r)
    }

    fn flush(&mut self) -> Result<(), String> {
        for f in self.image.files().iter().take(1) {
            f.sync_all().map_err(|e| format!("flushing {}: {e}", self.describe()))?;
        }
        self.image.sync_metadata().map_err(|e| format!("flushing {}: {}", self.describe(), e.report()))
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.path.display(), self.image.format())
    }
}

/// Makes `len` bytes at `offset` of `file` read as zeros: a hole where the
/// file system punches one, written zeros where it does not.
fn punch(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate only reads its integer arguments; the fd is open (`file` holds it).
    if unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) } == 0 {
        return Ok(());
    }
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(zeros.len() as u64);
        file.write_all_at(&zeros[..n as usize], offset + at)?;
        at += n;
    }
    Ok(())
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
}

/// Reads `buf.len()` bytes at `offset` of the disk `image` serves, as it is
/// now, without the device: the image's read mapping, then each extent from
/// its file (zeros where it maps to none). RBD images are not read here.
pub fn read_live(image: &dyn Image, offset: u64, buf: &mut [u8], extents: &mut Vec<Extent>) -> Result<(), String> {
    extents.clear();
    let len = buf.len() as u64;
    image
        .map_read(offset, len, extents)
        .map_err(|e| format!("mapping {len} bytes at offset {offset} of the source: {}", e.report()))?;
    let mut at = 0usize;
    for ext in extents.iter() {
        let n = ext.len() as usize;
        match *ext {
            Extent::Data { file, offset: fo, .. } => image.files()[file]
                .read_exact_at(&mut buf[at..at + n], fo)
                .map_err(|e| format!("reading {n} bytes at offset {fo} of {}: {e}", image.file_path(file).display()))?,
            Extent::Zero { .. } => buf[at..at + n].fill(0),
        }
        at += n;
    }
    Ok(())
}
