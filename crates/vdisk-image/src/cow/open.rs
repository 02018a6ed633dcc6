//! Opening and creating overlays: the header and bitmap read and checked,
//! the backing file found (relative paths from the overlay's directory),
//! checked against the header and locked, as UML does before it trusts one.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use super::{parse_header, CowImage, CowMap, Header, OverlayOptions, MAX_HEADER_LEN};
use crate::rbd::{is_rbd, RbdImage, Spec};
use crate::{Advice, Error, ErrorKind, Image, ImageBase, Result};

pub(super) fn at(path: &Path, e: io::Error, what: &str) -> Error {
    Error::io(e, format!("{what} {}", path.display())).path(path)
}

/// Takes a BSD lock on `file` or says the file is in use. A process that just
/// exited may hold its locks a moment longer (io_uring releases registered
/// files after the process is gone), so a held lock is retried for a second.
pub(crate) fn lock(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        // SAFETY: flock only reads its integer arguments; the fd is open.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Some(libc::EWOULDBLOCK) => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "{} is in use by another process (a running `vdisk serve` or `vdisk commit`?)",
                        path.display()
                    ),
                ))
            }
            _ => return Err(at(path, e, "cannot lock")),
        }
    }
}

/// Size of a regular file or block device (whose metadata says 0).
fn file_size(mut file: &File, path: &Path) -> Result<u64> {
    file.seek(io::SeekFrom::End(0)).map_err(|e| at(path, e, "cannot find the size of"))
}

/// Where a backing path written in `overlay`'s header points: relative paths
/// are taken from the overlay's directory, not the current one.
pub fn resolve_backing(overlay: &Path, written: &Path) -> PathBuf {
    if written.is_absolute() {
        return written.to_owned();
    }
    match overlay.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(written),
        _ => written.to_owned(),
    }
}

/// A relative backing path that names two different files: one from the
/// overlay's directory (what vdisk opens) and another from the current
/// directory (what UML's tools would open). Returns the message, or None when
/// there is no such doubt. The header is untrusted: it must never pick a file
/// the user did not expect without saying so.
pub fn ambiguous_backing(overlay: &Path, written: &Path) -> Option<String> {
    let resolved = resolve_backing(overlay, written);
    if written.is_absolute() || resolved == written {
        return None;
    }
    let here = std::fs::metadata(written).ok()?;
    let there = std::fs::metadata(&resolved).ok()?;
    if here.dev() == there.dev() && here.ino() == there.ino() {
        return None;
    }
    Some(format!(
        "the header of {} names the relative path {}: from the overlay's directory that is {}, from the current \
         directory another file",
        overlay.display(),
        written.display(),
        resolved.display()
    ))
}

/// The mtime UML records: seconds, truncated to 32 bits.
pub(super) fn mtime32(meta: &std::fs::Metadata) -> u32 {
    meta.mtime() as u32
}

impl CowImage {
    /// Opens an overlay and its backing file (read-only, shared lock). The
    /// overlay is locked exclusively unless `read_only`. Refuses a backing
    /// file whose size differs from the header's, or whose mtime does (unless
    /// `ignore_mtime`), naming both files and the way out.
    pub fn open(path: &Path, read_only: bool, backing: Option<&Path>, ignore_mtime: bool) -> Result<Self> {
        Self::open_with(
            path,
            &OverlayOptions {
                read_only,
                backing: backing.map(Path::to_owned),
                ignore_mtime,
                backing_writable: false,
                ceph: Default::default(),
            },
        )
    }

    pub fn open_with(path: &Path, o: &OverlayOptions) -> Result<Self> {
        let read_only = o.read_only || o.backing_writable;
        let (overlay, meta) = open_overlay(path, read_only)?;
        let (header, map) = read_metadata(&overlay, path)?;
        let written = header.backing_path();
        let rbd_name = match &o.backing {
            Some(b) => is_rbd(b).then(|| b.clone()),
            None => is_rbd(written).then(|| written.to_owned()),
        };
        if let Some(name) = rbd_name {
            return Self::open_over_rbd(path, overlay, header, map, read_only, &name, o);
        }
        let (bfile, bmeta, backing, canonical) = open_backing(path, &meta, header.backing_path(), o)?;
        check_backing(path, &header, (&bfile, &bmeta), &backing, o.ignore_mtime)?;
        Ok(CowImage {
            base: ImageBase::new(path.to_owned(), header.size, read_only, vec![overlay, bfile]),
            // The file really opened, symlinks resolved: what `serve` prints and O_DIRECT reopens.
            backing: canonical,
            data_offset: header.data_offset(),
            sector: header.sector_size as u64,
            header,
            rbd_backing: None,
            backing_writable: o.backing_writable,
            map,
            copy_locks: std::array::from_fn(|_| Mutex::new(())),
            rounds_done: Mutex::new(0),
            rounds_started: AtomicU64::new(0),
        })
    }

    /// The overlay over an RBD snapshot: a snapshot never changes, so it stands
    /// in for the mtime check; the size check stays.
    fn open_over_rbd(
        path: &Path,
        overlay: File,
        header: Header,
        map: CowMap,
        read_only: bool,
        name: &Path,
        o: &OverlayOptions,
    ) -> Result<Self> {
        if o.backing_writable {
            return Err(Error::invalid(format!(
                "the backing of {} is an RBD snapshot, which never changes: it cannot take a commit (merge into a new image instead)",
                path.display()
            )));
        }
        let spec = Spec::parse(&name.to_string_lossy(), &o.ceph)?;
        // librados reads it by name: beneath the image roots too, when confined.
        if let Some(conf) = &spec.options.conf {
            crate::files::check_confined(conf)?;
        }
        if spec.snap.is_none() {
            return Err(Error::invalid(format!(
                "the backing of {} is {spec}, an RBD image that can change under the overlay; an overlay needs a \
                 snapshot (rbd:POOL/IMAGE@SNAP)",
                path.display()
            )));
        }
        let rbd = RbdImage::open(&spec, true)?;
        if rbd.size() != header.size {
            return Err(Error::invalid(format!(
                "backing snapshot {spec} is {} bytes but overlay {} was made over {} bytes: it is not the snapshot \
                 the overlay was made over",
                rbd.size(),
                path.display(),
                header.size
            ))
            .advise(Advice::NameBacking));
        }
        log::info!("overlay {}: backing snapshot {spec}", path.display());
        Ok(CowImage {
            base: ImageBase::new(path.to_owned(), header.size, read_only, vec![overlay]),
            backing: PathBuf::from(spec.to_string()),
            data_offset: header.data_offset(),
            sector: header.sector_size as u64,
            header,
            rbd_backing: Some(rbd),
            backing_writable: false,
            map,
            copy_locks: std::array::from_fn(|_| Mutex::new(())),
            rounds_done: Mutex::new(0),
            rounds_started: AtomicU64::new(0),
        })
    }

    /// Creates a new, empty overlay over the RBD snapshot `spec`: the header
    /// records its name (`rbd:POOL/IMAGE@SNAP`, without connection options)
    /// and size; its mtime field is 0 (a snapshot never changes).
    pub fn create_over_rbd(overlay: &Path, spec: &Spec) -> Result<()> {
        if spec.snap.is_none() {
            return Err(Error::invalid(format!(
                "{spec} is an RBD image, which can change under an overlay: make a snapshot \
                 (rbd snap create {}/{}@NAME) and use rbd:{}/{}@NAME",
                spec.pool, spec.image, spec.pool, spec.image
            )));
        }
        let size = RbdImage::open(spec, true)?.size();
        if size == 0 {
            return Err(Error::invalid(format!("backing snapshot {spec} is empty: a disk needs a size")));
        }
        let header = Header::new(Path::new(&spec.to_string()), size, 0)?;
        write_new(overlay, &header, size)
    }

    /// Creates a new, empty overlay over `backing`: the header records the
    /// backing file's absolute path, size and mtime (as uml_mkcow does); the
    /// bitmap and data area are sparse. Refuses to replace an existing file.
    pub fn create(overlay: &Path, backing: &Path) -> Result<()> {
        let bfile = crate::files::open(backing, false, "backing file")?;
        let bmeta = bfile.metadata().map_err(|e| at(backing, e, "cannot stat backing file"))?;
        let size = file_size(&bfile, backing)?;
        if size == 0 {
            return Err(Error::invalid(format!("backing file {} is empty: a disk needs a size", backing.display())));
        }
        let absolute = absolutize(backing)?;
        let header = Header::new(&absolute, size, mtime32(&bmeta))?;
        write_new(overlay, &header, size)
    }

    /// Also opens both files with O_DIRECT, for aligned requests. They are
    /// reopened through /proc/self/fd, so they are the very files already open
    /// (and checked), whatever their paths name by now.
    pub fn with_direct_io(mut self) -> Result<Self> {
        let open = |path: &Path, file: &File, write: bool| {
            OpenOptions::new()
                .read(true)
                .write(write)
                .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
                .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
                .map_err(|e| crate::raw::direct_io_error(path, e))
        };
        if self.rbd_backing.is_some() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{} is an overlay over an RBD snapshot, which has no direct I/O", self.base.path.display()),
            )
            .advise(Advice::NoDirectIo));
        }
        self.base.direct = vec![
            open(&self.base.path, &self.base.files[0], !self.base.read_only)?,
            open(&self.backing, &self.base.files[1], false)?,
        ];
        Ok(self)
    }
}

/// The absolute path of `p` as uml_mkcow records it: its directory resolved,
/// its own name kept.
fn absolutize(p: &Path) -> Result<PathBuf> {
    let name = p.file_name().ok_or_else(|| Error::invalid(format!("{} names no file", p.display())))?;
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let dir = dir.canonicalize().map_err(|e| at(&dir, e, "cannot resolve"))?;
    Ok(dir.join(name))
}

/// Reads the header and bitmap of an open overlay, checking the file is long
/// enough to hold them.
pub(super) fn read_metadata(file: &File, path: &Path) -> Result<(Header, CowMap)> {
    let mut buf = vec![0u8; MAX_HEADER_LEN];
    let n = read_full(file, &mut buf, 0).map_err(|e| at(path, e, "cannot read the header of"))?;
    let header =
        parse_header(&buf[..n]).map_err(|e| Error::new(e.kind(), format!("{}: {}", path.display(), e.message())))?;
    let len = file_size(file, path)?;
    let need = header.bitmap_offset() + header.bitmap_len();
    if len < need {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{}: the file is {len} bytes, too short for the bitmap of a {}-byte disk \
                 ({} bytes at offset {}): a truncated overlay",
                path.display(),
                header.size,
                header.bitmap_len(),
                header.bitmap_offset()
            ),
        ));
    }
    let mut bits = vec![0u8; header.bitmap_len() as usize];
    file.read_exact_at(&mut bits, header.bitmap_offset()).map_err(|e| at(path, e, "cannot read the bitmap of"))?;
    let map = CowMap::from_bytes(&bits, header.sectors());
    Ok((header, map))
}

/// Reads until `buf` is full or the file ends; the rest of `buf` is zeroed.
/// Returns the bytes read.
pub(super) fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf[n..].fill(0);
    Ok(n)
}

/// Writes a new overlay file: the header, a sparse bitmap and data area. Refuses
/// to replace an existing file.
fn write_new(overlay: &Path, header: &Header, size: u64) -> Result<()> {
    let file = OpenOptions::new().write(true).create_new(true).open(overlay).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            Error::invalid(format!("{} already exists; remove it first or pick another name", overlay.display()))
        } else {
            at(overlay, e, "cannot create")
        }
    })?;
    let result = (|| {
        file.write_all_at(&header.to_bytes(), 0).map_err(|e| at(overlay, e, "cannot write the header of"))?;
        file.set_len(header.data_offset() + size).map_err(|e| at(overlay, e, "cannot size"))?;
        file.sync_all().map_err(|e| at(overlay, e, "cannot sync"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(overlay);
    }
    result
}

/// Opens and locks the overlay file (exclusively unless `read_only`).
fn open_overlay(path: &Path, read_only: bool) -> Result<(File, std::fs::Metadata)> {
    let overlay = crate::files::open(path, !read_only, "overlay")?;
    let meta = overlay.metadata().map_err(|e| at(path, e, "cannot stat overlay"))?;
    lock(&overlay, path, !read_only)?;
    Ok((overlay, meta))
}

/// The backing file of the overlay at `path` (whose header names `written`),
/// described for messages: which file, and who named it.
fn name_backing(path: &Path, written: &Path, backing: &Path, given: bool) -> String {
    let (b, p, w) = (backing.display(), path.display(), written.display());
    if given {
        format!("{b} (named by the caller; the header of {p} names {w})")
    } else if backing != written {
        format!("{b} (the header of {p} names {w}, relative to the overlay)")
    } else {
        format!("{b} (named in the header of {p})")
    }
}

/// Opens and locks (shared, or exclusive when `o.backing_writable`) the
/// backing file of the overlay at `path`: the one `o` names, else the one its
/// header names. Returns it, its metadata, its path and its canonical path.
fn open_backing(
    path: &Path,
    meta: &std::fs::Metadata,
    written: &Path,
    o: &OverlayOptions,
) -> Result<(File, std::fs::Metadata, PathBuf, PathBuf)> {
    let backing = match &o.backing {
        Some(b) => b.clone(),
        None => resolve_backing(path, written),
    };
    let named = name_backing(path, written, &backing, o.backing.is_some());
    if o.backing.is_none() {
        if let Some(why) = ambiguous_backing(path, written) {
            return Err(Error::invalid(why).advise(Advice::NameBacking));
        }
    }
    // Opened for reading first: the checks below come before any write access.
    let bfile = crate::files::open(&backing, false, "backing file").map_err(|e| {
        let m = format!("backing file {named} cannot be opened: {}", e.message());
        let e = e.reworded(m).op("open").path(&backing);
        if o.backing.is_some() {
            e
        } else {
            e.advise(Advice::NameBacking)
        }
    })?;
    let itself = |b: &std::fs::Metadata| b.dev() == meta.dev() && b.ino() == meta.ino();
    if itself(&bfile.metadata().map_err(|e| at(&backing, e, "cannot stat backing file"))?) {
        return Err(Error::invalid(format!("backing file {named} is the overlay itself")));
    }
    let bfile = if o.backing_writable {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(format!("/proc/self/fd/{}", bfile.as_raw_fd()))
            .map_err(|e| Error::io(e, format!("cannot open backing file {named}")))?
    } else {
        bfile
    };
    lock(&bfile, &backing, o.backing_writable)?;
    // Checks from here on are on the file opened, not on whatever the path names now.
    let bmeta = bfile.metadata().map_err(|e| at(&backing, e, "cannot stat backing file"))?;
    if itself(&bmeta) {
        return Err(Error::invalid(format!("backing file {named} is the overlay itself")));
    }
    let canonical = backing.canonicalize().unwrap_or_else(|_| backing.clone());
    if canonical != backing {
        log::info!("backing file {named} resolves to {}", canonical.display());
    }
    log::info!(
        "overlay {}: backing file {} (device {:#x}, inode {}, mtime {})",
        path.display(),
        canonical.display(),
        bmeta.dev(),
        bmeta.ino(),
        bmeta.mtime()
    );
    Ok((bfile, bmeta, backing, canonical))
}

/// Refuses a backing file that is not the one the overlay was made over: its
/// size differs from the header's, or its mtime does (unless `ignore_mtime`).
fn check_backing(
    path: &Path,
    header: &Header,
    (bfile, bmeta): (&File, &std::fs::Metadata),
    backing: &Path,
    ignore_mtime: bool,
) -> Result<()> {
    let bsize = file_size(bfile, backing)?;
    if bsize != header.size {
        return Err(Error::invalid(format!(
            "backing file {} is {bsize} bytes but overlay {} was made over {} bytes: it is not the file \
             the overlay was made over",
            backing.display(),
            path.display(),
            header.size
        ))
        .advise(Advice::NameBacking));
    }
    if mtime32(bmeta) != header.mtime && !ignore_mtime {
        return Err(Error::invalid(format!(
            "backing file {} was modified after overlay {} was made (mtime {} vs {} in the header)",
            backing.display(),
            path.display(),
            mtime32(bmeta),
            header.mtime
        ))
        .advise(Advice::IgnoreBackingMtime));
    }
    Ok(())
}
