//! Images: where the bytes of a virtual disk live, and how a request's logical
//! range maps onto them.
//!
//! An image owns its files and its metadata (for a COW overlay, the bitmap in
//! memory). It answers "where is this range?" with a list of [`Extent`]s; it
//! does not move data itself and it knows nothing of threads, rings or wire
//! protocols. The engine performs the extents.

pub mod bitmap;
pub mod breakage;
pub mod cbw;
pub mod cow;
mod error;
pub mod files;
mod opening;
pub mod qcow2;
pub mod raw;
pub mod rbd;
pub mod remote;
#[cfg(test)]
mod testing;
mod window;

use std::fs::File;
use std::path::{Path, PathBuf};

pub use cow::CowImage;
pub use error::{Advice, Error, ErrorKind, Report, Result};
pub use opening::{detect, detect_bytes, detect_file, open, Backing, Format, OpenOptions, Opened, Target};
pub use qcow2::Qcow2Image;
pub use raw::RawImage;
pub use rbd::RbdImage;
pub use remote::RemoteImage;

/// Where one piece of a request lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// `len` bytes at `offset` of the image's target number `file` (see
    /// [`Image::target`]: a file of [`Image::files`] or an RBD image).
    Data { file: usize, offset: u64, len: u64 },
    /// `len` bytes that read as zeros and are stored nowhere.
    Zero { len: u64 },
}

impl Extent {
    pub fn len(&self) -> u64 {
        match *self {
            Extent::Data { len, .. } | Extent::Zero { len } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What target number `i` of an image's mapping is: where the bytes of an
/// [`Extent::Data`] naming it live. The engine moves a file's bytes with its
/// own calls (blocking or io_uring), an RBD image's with librbd's AIO on the
/// RBD engine, and those of any target that is not a file with its blocking
/// calls ([`Storage::blocking`]) on the file engines (an export switched
/// onto an RBD image or an NBD export by a mirror's pivot).
#[derive(Clone, Copy)]
pub enum Storage<'a> {
    /// A file (the same number in [`Image::files`], and in
    /// [`Image::direct_files`] when the image was opened for direct I/O).
    File(&'a File),
    /// An image on Ceph RBD.
    Rbd(&'a RbdImage),
    /// Storage reached by blocking calls only (an NBD export: [`RemoteImage`]).
    Remote(&'a dyn BlockTarget),
}

impl<'a> Storage<'a> {
    /// Makes what was written to it durable (fdatasync; librbd's flush; NBD FLUSH).
    pub fn sync(&self) -> std::io::Result<()> {
        match self {
            Storage::File(f) => f.sync_data(),
            Storage::Rbd(r) => BlockTarget::sync(*r),
            Storage::Remote(t) => t.sync(),
        }
    }

    /// The target's blocking calls; None for a file (moved by the engine's own calls).
    pub fn blocking(&self) -> Option<&'a dyn BlockTarget> {
        match *self {
            Storage::File(_) => None,
            Storage::Rbd(r) => Some(r),
            Storage::Remote(t) => Some(t),
        }
    }

    /// Lets go now of what the target holds against other clients (an RBD
    /// image's exclusive lock, which another client would wait for), rather
    /// than when the image is dropped; no I/O may follow. A file holds nothing.
    pub fn release(&self) {
        if let Storage::Rbd(r) = self {
            r.close();
        }
    }
}

/// A disk's bytes reached by blocking positional calls rather than a file
/// descriptor: an RBD image, an NBD export. Each call does all it is asked
/// or fails.
pub trait BlockTarget: Send + Sync {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()>;
    /// Makes every write it acknowledged durable.
    fn sync(&self) -> std::io::Result<()>;
}

/// The allocation state of a run of the disk, as block-status queries report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub len: u64,
    /// No storage is allocated for this run.
    pub hole: bool,
    /// The run reads as zeros.
    pub zero: bool,
    /// Which layer of the chain holds the run (NBD's `qemu:allocation-depth`):
    /// 1 this image, 2 its backing image, and so on; 0 none (it reads as
    /// zeros from nowhere: a layer without a backing image does not hold it).
    /// Zeros past the end of a shorter backing image count as that image's,
    /// as qemu counts them. A raw file or RBD image holds every byte it has
    /// (holes too, as qemu counts them): depth 1.
    pub depth: u32,
}

impl Allocation {
    /// The same run as seen from the image above this one in a chain.
    pub fn one_deeper(self) -> Allocation {
        Allocation { depth: if self.depth == 0 { 0 } else { self.depth + 1 }, ..self }
    }
}

/// What every open image holds of itself, whatever its format: the format
/// embeds one and hands it out through [`Image::base`], and [`Image`]'s
/// default methods answer from it.
/// Other crates make one with [`ImageBase::new`] and read it through those methods.
pub struct ImageBase {
    /// The image's own name: the path of file 0 (for RBD, `rbd:pool/image[@snap]`).
    pub(crate) path: PathBuf,
    /// The size of the virtual disk in bytes.
    pub(crate) size: u64,
    pub(crate) read_only: bool,
    /// The files that [`Extent::Data`] refers to (see [`Image::files`]).
    pub(crate) files: Vec<File>,
    /// Their O_DIRECT twins, index for index, or empty (see [`Image::direct_files`]).
    pub(crate) direct: Vec<File>,
}

impl ImageBase {
    /// The base of an image with these files, not (yet) opened for direct I/O.
    pub fn new(path: PathBuf, size: u64, read_only: bool, files: Vec<File>) -> Self {
        ImageBase { path, size, read_only, files, direct: Vec::new() }
    }
}

/// A virtual disk's storage. Implementations must be cheap to call from many
/// threads at once: mapping happens on the request path.
pub trait Image: Send + Sync {
    /// A short name of the format, as `vdisk info` prints it ("raw", "cow").
    fn format(&self) -> &'static str;

    /// The path, size, read-only flag and files of the image, which the
    /// default methods below read.
    fn base(&self) -> &ImageBase;

    /// The size of the virtual disk in bytes.
    fn size(&self) -> u64 {
        self.base().size
    }

    /// True when the image was opened read-only; writes are then refused at the edge.
    fn read_only(&self) -> bool {
        self.base().read_only
    }

    /// The files that [`Extent::Data`] refers to. File 0 receives all writes.
    fn files(&self) -> &[File] {
        &self.base().files
    }

    /// The same files opened with O_DIRECT, index for index, when the image was
    /// opened for direct I/O; empty otherwise. The engine uses them for requests
    /// whose offset, length and memory are aligned, and `files()` for the rest.
    fn direct_files(&self) -> &[File] {
        &self.base().direct
    }

    /// Target number `i` of the mapping (what an [`Extent::Data`] with
    /// `file: i` names), or None past the last. By default file `i` of
    /// [`Image::files`]; an image with targets on RBD says which.
    fn target(&self, i: usize) -> Option<Storage<'_>> {
        self.files().get(i).map(Storage::File)
    }

    /// The path of file number `file`, for messages. By default the image's
    /// own path, for every file: an image of several files says which is which.
    fn file_path(&self, _file: usize) -> &Path {
        &self.base().path
    }

    /// Appends to `out` the extents that a read of `len` bytes at `offset` covers,
    /// in order, adding up to exactly `len`. The range is already validated.
    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()>;

    /// Appends to `out` the extents a write of `len` bytes at `offset` must go
    /// to. For TRIM and WRITE_ZEROES the same extents are punched or zeroed.
    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()>;

    /// True for an image that holds something of each read from `map_read`
    /// until [`Image::read_done`] (a backup view pins the granules it mapped
    /// to the live image, see [`cbw`]). The engine serves such an image on the
    /// thread engine, which maps and performs a read in one thread, and calls
    /// `read_done` once for every read `map_read` mapped without error.
    fn pins_reads(&self) -> bool {
        false
    }

    /// Called, for an image whose [`Image::pins_reads`] is true, once a read
    /// it mapped has been performed (or failed).
    fn read_done(&self, _offset: u64, _len: u64) {}

    /// Called before a write, TRIM or WRITE_ZEROES is mapped. An image whose
    /// allocation unit is bigger than a byte makes the untouched bytes of each
    /// partly covered unit valid in its own storage here (a COW overlay copies
    /// the rest of a partly written sector up from its backing file).
    fn prepare_write(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// Called once a write, TRIM or WRITE_ZEROES has reached the files, before
    /// it is acknowledged: the image may now point at the new data (a COW
    /// overlay sets its bitmap bits in memory). With `durable`, the metadata
    /// for this range must be durable before returning. (For durable writes the
    /// engine passes false and calls `sync_metadata` once for the whole batch
    /// before replying, which gives the same guarantee for less.)
    fn write_done(&self, _offset: u64, _len: u64, _durable: bool) -> Result<()> {
        Ok(())
    }

    /// Called instead of `write_done` when a write failed (at any point: it
    /// may or may not have been prepared, and part of its data may be in the
    /// files). The image may undo what `prepare_write` did for it, so that
    /// the range reads as before, or partly as the failed write's data, and
    /// nothing else. (qcow2 needs nothing here: a claimed cluster is filled
    /// with what the guest read there before any write to it is mapped.)
    fn write_failed(&self, _offset: u64, _len: u64) {}

    /// Records a TRIM (`trim`) or WRITE_ZEROES of `len` bytes at `offset` in
    /// the image's own metadata where it can (a qcow2 zero cluster: no data
    /// written), and returns the ranges it left for the engine to zero in the
    /// files the usual way (prepare, map, punch or zero, `write_done`). With
    /// `no_hole` the image keeps the storage allocated. The engine calls
    /// `write_done` for the whole range afterwards either way.
    fn zero(&self, offset: u64, len: u64, _trim: bool, _no_hole: bool) -> Result<Vec<(u64, u64)>> {
        Ok(vec![(offset, len)])
    }

    /// Appends the allocation state of `len` bytes at `offset`, in order, at most
    /// `max` runs (the last one may end early: the caller asks again from there).
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()>;

    /// Makes the image's own metadata durable. Called by a flush after every
    /// data file has been synced, so metadata never points at data that is not.
    fn sync_metadata(&self) -> Result<()> {
        Ok(())
    }

    /// Where this image keeps its own persistent bitmaps (qcow2: in the
    /// image, qemu's format; RBD: in its RBD metadata, not for a snapshot);
    /// None for a format that has no place for them,
    /// whose bitmaps go to a sidecar file ([`bitmap::sidecar::SidecarStore`]).
    fn bitmap_store(&self) -> Option<&dyn bitmap::BitmapStore> {
        None
    }
}

/// The mapping of an image whose disk is file 0 byte for byte (raw, RBD), for
/// reads and writes alike: one extent, at the same offset. Each such format
/// calls it from its own `map_read` and `map_write` on purpose; there is no
/// trait default that a new format could inherit by forgetting to map.
pub(crate) fn map_one_to_one(offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
    out.push(Extent::Data { file: 0, offset, len });
    Ok(())
}

/// Creates the new file `path` (which must not exist), lets `fill` write it,
/// and removes it again if `fill` fails: a new image is whole or not there.
pub(crate) fn create_whole(path: &Path, fill: impl FnOnce(&File) -> Result<()>) -> Result<()> {
    let file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            Error::invalid(format!("{} already exists; remove it first or pick another name", path.display()))
        } else {
            Error::io(e, format!("cannot create {}", path.display()))
        }
    })?;
    let result = fill(&file);
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}
