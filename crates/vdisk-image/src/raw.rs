//! Raw images: the disk is the file, byte for byte. Sparse where the file
//! system allows; allocation comes from SEEK_DATA/SEEK_HOLE.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::{io, io::Seek};

use crate::{map_one_to_one, Advice, Allocation, Error, ErrorKind, Extent, Image, ImageBase, Result};

pub struct RawImage {
    /// One file, the image itself (and its O_DIRECT twin when opened for direct I/O).
    base: ImageBase,
}

impl RawImage {
    /// Opens an existing raw image. Fails with a message naming the file when it
    /// is missing, a directory, or cannot be opened as asked.
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        let mut file = crate::files::open(path, !read_only, "image")?;
        // A block device reports length 0 in its metadata; its end is its size.
        let size = file
            .seek(io::SeekFrom::End(0))
            .map_err(|e| Error::io(e, format!("cannot find the size of {}", path.display())))?;
        Ok(RawImage { base: ImageBase::new(path.to_owned(), size, read_only, vec![file]) })
    }

    /// Creates a new sparse raw image of `size` bytes. Refuses to replace an
    /// existing file. With `preallocate`, reserves every block, calling
    /// `progress(done_bytes)` as it goes.
    pub fn create(path: &Path, size: u64, preallocate: Option<&dyn Fn(u64)>) -> Result<()> {
        let file = OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("{} already exists; remove it first or pick another name", path.display()),
                )
            } else {
                Error::io(e, format!("cannot create {}", path.display()))
            }
        })?;
        let result = (|| {
            file.set_len(size).map_err(|e| Error::io(e, format!("cannot size {}", path.display())))?;
            if let Some(progress) = preallocate {
                preallocate_file(&file, path, size, progress)?;
            }
            file.sync_all().map_err(|e| Error::io(e, format!("cannot sync {}", path.display())))
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result
    }

    /// Also opens the file with O_DIRECT, so aligned I/O bypasses the host page
    /// cache (qemu's cache=none). Fails with a clear message where the file
    /// system cannot do direct I/O (tmpfs, for one).
    pub fn with_direct_io(mut self) -> Result<Self> {
        // The very file already open (and checked), whatever its path names by now.
        let file = OpenOptions::new()
            .read(true)
            .write(!self.base.read_only)
            .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
            .open(format!("/proc/self/fd/{}", self.base.files[0].as_raw_fd()))
            .map_err(|e| direct_io_error(&self.base.path, e))?;
        self.base.direct = vec![file];
        Ok(self)
    }

    pub fn path(&self) -> &Path {
        &self.base.path
    }
}

/// Reserves blocks in chunks so progress can be shown; writes zeros where the
/// file system has no fallocate.
fn preallocate_file(file: &File, path: &Path, size: u64, progress: &dyn Fn(u64)) -> Result<()> {
    const CHUNK: u64 = 64 << 20;
    let zeros = vec![0u8; CHUNK as usize];
    let mut done = 0;
    while done < size {
        let len = CHUNK.min(size - done);
        // SAFETY: fallocate only reads its integer arguments; the fd is open for writing.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, done as i64, len as i64) };
        if r != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(Error::io(err, format!("cannot preallocate {} at {done}", path.display())));
            }
            use std::os::unix::fs::FileExt;
            file.write_all_at(&zeros[..len as usize], done)
                .map_err(|e| Error::io(e, format!("cannot preallocate {} at {done}", path.display())))?;
        }
        done += len;
        progress(done);
    }
    Ok(())
}

impl Image for RawImage {
    fn format(&self) -> &'static str {
        "raw"
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        seek_allocation(&self.base.files[0], offset, len, max, out).map_err(|e| {
            Error::io(e, format!("cannot map {} at {offset}", self.base.path.display()))
                .at(offset)
                .path(&self.base.path)
        })
    }
}

/// Walks SEEK_DATA/SEEK_HOLE from `offset`. A file system without them reports
/// everything as data, which is always a correct answer.
pub(crate) fn seek_allocation(
    file: &File,
    offset: u64,
    len: u64,
    max: usize,
    out: &mut Vec<Allocation>,
) -> io::Result<()> {
    let fd = file.as_raw_fd();
    let end = offset + len;
    let mut pos = offset;
    let seek = |whence, at: u64| -> io::Result<Option<u64>> {
        // SAFETY: lseek only reads its integer arguments.
        let r = unsafe { libc::lseek(fd, at as i64, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(err),
        }
    };
    let mut n = 0;
    while pos < end && n < max {
        let data = match seek(libc::SEEK_DATA, pos) {
            Ok(d) => d.unwrap_or(end).min(end),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => pos,
            Err(e) => return Err(e),
        };
        if data > pos {
            out.push(Allocation { len: data - pos, hole: true, zero: true, depth: 1 });
            n += 1;
            pos = data;
            continue;
        }
        let hole = match seek(libc::SEEK_HOLE, pos) {
            Ok(h) => h.unwrap_or(end).min(end),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => end,
            Err(e) => return Err(e),
        };
        let hole = hole.max(pos + 1).min(end);
        out.push(Allocation { len: hole - pos, hole: false, zero: false, depth: 1 });
        n += 1;
        pos = hole;
    }
    Ok(())
}

/// Why a file cannot be opened with O_DIRECT (EINVAL: its file system cannot).
pub(crate) fn direct_io_error(path: &Path, e: io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EINVAL) {
        let why = "its file system does not support O_DIRECT";
        Error::new(ErrorKind::Unsupported, format!("cannot open {} for direct I/O: {why}", path.display()))
            .advise(Advice::NoDirectIo)
    } else {
        Error::new(ErrorKind::Unsupported, format!("cannot open {} for direct I/O: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::path::PathBuf;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vdisk-image-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn create_open_and_map() {
        let p = tmp("a.img");
        RawImage::create(&p, 1 << 20, None).unwrap();
        let img = RawImage::open(&p, false).unwrap();
        assert_eq!(img.size(), 1 << 20);
        img.files()[0].write_all_at(&[1u8; 4096], 65536).unwrap();
        let mut out = Vec::new();
        img.allocation(0, 1 << 20, 100, &mut out).unwrap();
        let total: u64 = out.iter().map(|a| a.len).sum();
        assert_eq!(total, 1 << 20);
        assert!(out.iter().any(|a| !a.hole));
        assert!(out[0].hole, "the start of a sparse file is a hole: {out:?}");
        let mut ext = Vec::new();
        img.map_read(10, 20, &mut ext).unwrap();
        assert_eq!(ext, vec![Extent::Data { file: 0, offset: 10, len: 20 }]);
    }

    #[test]
    fn create_refuses_to_overwrite_and_open_names_the_file() {
        let p = tmp("b.img");
        RawImage::create(&p, 4096, None).unwrap();
        let e = RawImage::create(&p, 4096, None).unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        let e = RawImage::open(&tmp("missing.img"), false).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.to_string().contains("missing.img"));
        let e = RawImage::open(&std::env::temp_dir(), false).err().unwrap();
        assert!(e.to_string().contains("is a directory"));
    }

    #[test]
    fn preallocation_reports_progress_and_allocates() {
        let p = tmp("c.img");
        let seen = std::cell::Cell::new(0);
        RawImage::create(&p, 3 << 20, Some(&|d| seen.set(d))).unwrap();
        assert_eq!(seen.get(), 3 << 20);
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(&p).unwrap().blocks();
        assert!(blocks * 512 >= 3 << 20, "only {blocks} blocks allocated");
    }
}
