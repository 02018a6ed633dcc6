//! Opening a qcow2 image: the header, L1 and refcount tables read and
//! checked, the feature bits honoured, and the backing chain opened.
//!
//! What it owns: the decisions made once at open (what is refused, what is
//! served read-only, which backing file in which format) and `inspect` for
//! `vdisk info`. The backing file name in the header is untrusted: it is
//! resolved as qemu does (relative to the image's directory), must be a
//! regular file or block device that is not the image itself, is opened
//! read-only with a shared lock, and its format is the one the header's
//! backing format names (probed by magic only when the header names none,
//! as qemu does, and never with a protocol prefix or `json:`).
//! What it must never do: open the backing file for writing, follow a chain
//! deeper than [`super::MAX_CHAIN`], or write anything but the autoclear bits.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::Seek;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use super::compressed::{memfd, Inflated};
use super::header::{self, Header, INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use super::l2::{L2Cache, L2_CACHE_CAP, OFFSET_MASK};
use super::refcount::Refcounts;
use super::{Qcow2Image, MAX_CHAIN};
use crate::{cow, Advice, CowImage, Error, ErrorKind, Image, ImageBase, RawImage, Result};

/// How to open a qcow2 image.
#[derive(Debug, Clone, Default)]
pub struct Qcow2Options {
    pub read_only: bool,
    /// Use this backing file instead of the one the header names.
    pub backing: Option<PathBuf>,
    /// How deep in a backing chain this image is (0: the image served).
    pub depth: usize,
    /// The (device, inode) of every image above this one in the chain.
    pub above: Vec<(u64, u64)>,
    /// The most memory its L2 tables may take (default: all of them, up to
    /// [`super::l2::L2_CACHE_CAP`]).
    pub l2_cache: Option<u64>,
}

fn at(path: &Path, e: std::io::Error, what: &str) -> Error {
    Error::io(e, format!("{what} {}", path.display())).path(path)
}

/// Reads the first cluster (at most 2 MiB) and parses the header.
fn read_header(file: &File, path: &Path) -> Result<(Header, u64)> {
    let len = (&*file).seek(std::io::SeekFrom::End(0)).map_err(|e| at(path, e, "cannot find the size of"))?;
    let mut buf = vec![0u8; len.min(2 << 20) as usize];
    file.read_exact_at(&mut buf, 0).map_err(|e| at(path, e, "cannot read the header of"))?;
    let h =
        header::parse_header(&buf).map_err(|e| Error::new(e.kind(), format!("{}: {}", path.display(), e.message())))?;
    Ok((h, len))
}

fn refuse_features(h: &Header, path: &Path, read_only: bool) -> Result<()> {
    let p = path.display();
    if h.incompatible & INCOMPAT_CORRUPT != 0 && !read_only {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{p} is marked corrupt: it can only be read (to rescue its data), or repaired with \
                 `qemu-img check -r all {p}`"
            ),
        )
        .advise(Advice::ReadOnly));
    }
    if h.nb_snapshots > 0 && !read_only {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{p} has {} internal snapshots, which vdisk does not write around: it can only be read, \
                 or they can be deleted with `qemu-img snapshot -d`",
                h.nb_snapshots
            ),
        )
        .advise(Advice::ReadOnly));
    }
    Ok(())
}

impl Qcow2Image {
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        Self::open_with(path, &Qcow2Options { read_only, ..Default::default() })
    }

    pub fn open_with(path: &Path, o: &Qcow2Options) -> Result<Self> {
        let file = crate::files::open(path, !o.read_only, "image")?;
        let meta = file.metadata().map_err(|e| at(path, e, "cannot stat image"))?;
        cow::lock_file(&file, path, !o.read_only)?;
        let (h, file_len) = read_header(&file, path)?;
        refuse_features(&h, path, o.read_only)?;
        let l1 = read_l1(&h, &file, path, file_len)?;
        let refs = Refcounts::open(&h, &file, path, file_len)?;
        let mut metadata: HashSet<u64> = HashSet::new();
        let cs = h.cluster_size();
        metadata.insert(0);
        for (at, len) in [
            (h.l1_table_offset, h.l1_size as u64 * 8),
            (h.refcount_table_offset, h.refcount_table_clusters as u64 * cs),
        ] {
            metadata.extend((0..len.div_ceil(cs)).map(|k| at + k * cs));
        }
        metadata.extend(l1.iter().map(|e| e & OFFSET_MASK).filter(|&a| a != 0));
        metadata.extend(refs.table_entries());
        let (backing, backing_path, backing_format) = open_backing(path, &meta, &h, o)?;
        let mut files = vec![file];
        if let Some(b) = &backing {
            for f in b.files() {
                files.push(f.try_clone().map_err(|e| at(path, e, "cannot share the backing file of"))?);
            }
        }
        files.push(memfd(c"vdisk-qcow2-inflated").map_err(|e| at(path, e, "cannot make a memory file for"))?);
        let zstd = h.incompatible & header::INCOMPAT_COMPRESSION != 0 && h.compression_type == 1;
        let h_bits = h.cluster_bits;
        let l2_cache = o.l2_cache.unwrap_or((h.l1_size as u64 * cs).min(L2_CACHE_CAP));
        let mut image = Qcow2Image {
            base: ImageBase::new(path.to_owned(), h.size, o.read_only, files),
            l2: L2Cache::new(&h, l1, file_len, metadata, l2_cache),
            refs: Mutex::new(refs),
            header: h,
            inflated: Inflated::new(h_bits, zstd),
            backing,
            backing_path,
            backing_format,
            pending: std::array::from_fn(|_| Mutex::new(Default::default())),
            released: Mutex::new(Vec::new()),
            file_len: AtomicU64::new(file_len),
            rounds_done: Mutex::new(0),
            rounds_started: AtomicU64::new(0),
            bitmaps: Mutex::new(Default::default()),
        };
        image.repair_if_dirty()?;
        // Bitmaps are loaded (and, read-write, marked in use) once the
        // refcounts are sound; other autoclear features are cleared.
        image.open_bitmaps()?;
        Ok(image)
    }
}

impl Qcow2Image {
    /// Also opens the image's files with O_DIRECT, for aligned requests: this
    /// image's own and every file of its backing chain, reopened through
    /// /proc/self/fd (the very files already open and checked). The in-memory
    /// file of inflated clusters has no O_DIRECT; its twin is a plain dup.
    pub fn with_direct_io(mut self) -> Result<Self> {
        let last = self.base.files.len() - 1;
        let mut direct = Vec::with_capacity(self.base.files.len());
        for (i, f) in self.base.files.iter().enumerate() {
            let flags = if i == last { libc::O_CLOEXEC } else { libc::O_CLOEXEC | libc::O_DIRECT };
            let twin = OpenOptions::new()
                .read(true)
                .write(i == 0 && !self.base.read_only)
                .custom_flags(flags)
                .open(format!("/proc/self/fd/{}", std::os::unix::io::AsRawFd::as_raw_fd(f)))
                .map_err(|e| crate::raw::direct_io_error(crate::Image::file_path(&self, i), e))?;
            direct.push(twin);
        }
        self.base.direct = direct;
        Ok(self)
    }
}

impl Qcow2Image {
    /// A dirty image (lazy refcounts, not closed cleanly): read-only, served
    /// as it is (reads do not use refcounts); read-write, its refcounts are
    /// repaired first.
    fn repair_if_dirty(&mut self) -> Result<()> {
        if self.header.incompatible & INCOMPAT_DIRTY == 0 {
            return Ok(());
        }
        let p = self.base.path.display().to_string();
        if self.base.read_only {
            log::warn!("{p} was not closed cleanly (lazy refcounts): served read-only as it is");
            return Ok(());
        }
        let raised = self.repair_refcounts().map_err(|e| {
            Error::new(
                e.kind(),
                format!(
                    "{p} was not closed cleanly (lazy refcounts) and its refcounts could not be repaired ({}): \
                     repair it with `qemu-img check -r all {p}`",
                    e.report()
                ),
            )
        })?;
        log::warn!("{p} was not closed cleanly (lazy refcounts): {raised} refcounts repaired, dirty bit cleared");
        Ok(())
    }
}

fn read_l1(h: &Header, file: &File, path: &Path, file_len: u64) -> Result<Vec<u64>> {
    let len = h.l1_size as u64 * 8;
    if h.l1_table_offset + len > file_len {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("{}: the L1 table runs past the end of the file (truncated image?)", path.display()),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, h.l1_table_offset).map_err(|e| at(path, e, "cannot read the L1 table of"))?;
    let l1: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes"))).collect();
    L2Cache::check_l1(h, &l1, file_len, path)?;
    Ok(l1)
}

/// Where a backing file name from `image`'s header points, as qemu resolves
/// it: relative names from the image's directory.
pub fn resolve_backing(image: &Path, name: &Path) -> PathBuf {
    cow::resolve_backing(image, name)
}

type Backing = (Option<Box<dyn Image>>, Option<PathBuf>, Option<&'static str>);

fn open_backing(path: &Path, meta: &std::fs::Metadata, h: &Header, o: &Qcow2Options) -> Result<Backing> {
    let written = h.backing.as_ref().map(|b| PathBuf::from(OsStr::from_bytes(b)));
    let backing = match (&o.backing, &written) {
        (Some(b), Some(_)) => b.clone(),
        (Some(_), None) => {
            return Err(Error::invalid(format!("{} has no backing file to replace", path.display())));
        }
        (None, Some(w)) => {
            let s = w.to_string_lossy();
            if s.starts_with("json:") || (s.contains("://") && !w.exists()) {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "{}: the backing file {s} is not a local file; vdisk opens only local files",
                        path.display()
                    ),
                ));
            }
            resolve_backing(path, w)
        }
        (None, None) => return Ok((None, None, None)),
    };
    let named = format!("backing file {} of {}", backing.display(), path.display());
    if o.depth + 1 >= MAX_CHAIN {
        return Err(Error::invalid(format!("{named}: the backing chain is deeper than {MAX_CHAIN} (a loop?)")));
    }
    // Opened (beneath the roots, when confined) and type-checked first; the
    // format's own open below opens the same path again through the same rules.
    let bfile = crate::files::open(&backing, false, "backing file").map_err(|e| {
        let what = if e.kind() == ErrorKind::NotFound { " (if it moved)" } else { "" };
        let m = format!("{named} cannot be opened{what}: {}", e.message());
        e.reworded(m).op("open").path(&backing).advise(Advice::NameBacking)
    })?;
    let bmeta = bfile.metadata().map_err(|e| Error::io(e, format!("cannot stat {named}")))?;
    if bmeta.dev() == meta.dev() && bmeta.ino() == meta.ino() {
        return Err(Error::invalid(format!("{named} is the image itself")));
    }
    if o.above.contains(&(bmeta.dev(), bmeta.ino())) {
        return Err(Error::invalid(format!("{named}: the backing chain loops back to an image above it")));
    }
    let format = match h.backing_format.as_deref() {
        Some("qcow2") => "qcow2",
        Some("raw") => "raw",
        Some("cow") => "cow",
        Some(f) => {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("{named} is in format {f:?}, which vdisk does not serve (raw, qcow2 and cow are)"),
            ))
        }
        // Probed by magic only when the header names no format, as qemu does.
        None => crate::detect_file(&bfile).name(),
    };
    let image: Box<dyn Image> = match format {
        "qcow2" => Box::new(Qcow2Image::open_with(
            &backing,
            &Qcow2Options {
                read_only: true,
                backing: None,
                depth: o.depth + 1,
                above: o.above.iter().copied().chain([(meta.dev(), meta.ino())]).collect(),
                l2_cache: o.l2_cache,
            },
        )?),
        "cow" => Box::new(CowImage::open(&backing, true, None, false)?),
        _ => Box::new(RawImage::open(&backing, true)?),
    };
    let canonical = backing.canonicalize().unwrap_or(backing);
    log::info!("{}: backing file {} ({format})", path.display(), canonical.display());
    Ok((Some(image), Some(canonical), Some(format)))
}

/// What `vdisk info` shows of a qcow2 image, read without locking it.
pub struct Inspection {
    pub header: Header,
    pub backing_resolved: Option<PathBuf>,
    /// Guest clusters holding data in this image, and zero clusters.
    pub data_clusters: u64,
    pub zero_clusters: u64,
    pub file_len: u64,
}

/// Reads the header and the L2 tables of `path`, without opening its backing file.
pub fn inspect(path: &Path) -> Result<Inspection> {
    let file = crate::files::open(path, false, "image")?;
    let (h, file_len) = read_header(&file, path)?;
    let l1 = read_l1(&h, &file, path, file_len)?;
    let cache = L2Cache::new(&h, l1, file_len, HashSet::new(), L2_CACHE_CAP);
    let (mut data, mut zero) = (0, 0);
    let per = h.l2_entries();
    let used = (0..cache.l1_len()).filter(|&i| cache.has_table(i));
    for c in used.flat_map(|i| i as u64 * per..((i as u64 + 1) * per).min(h.clusters())) {
        let e = cache.entry(&file, path, c)?;
        match cache.unit(e, 0) {
            super::l2::Unit::Data(_) | super::l2::Unit::Compressed { .. } => data += 1,
            super::l2::Unit::Zero => zero += 1,
            super::l2::Unit::Backing => {}
        }
    }
    let backing_resolved = h.backing.as_ref().map(|b| resolve_backing(path, Path::new(OsStr::from_bytes(b))));
    Ok(Inspection { header: h, backing_resolved, data_clusters: data, zero_clusters: zero, file_len })
}
