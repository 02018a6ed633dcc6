//! Opening an image, whatever its format: the one factory that `vdisk serve`,
//! the daemon, `create`, `info` and `commit` use, and the one place where a
//! file's format is told from its first bytes (qcow2's backing chain asks
//! here too).
//!
//! What it owns: what a name means (a path, or `rbd:POOL/IMAGE[@SNAP]` on
//! Ceph), which format a file is, which options apply to which format (an
//! option that does not apply is refused, naming the image, never ignored),
//! and direct I/O. What it leaves to its callers: how to describe an image to
//! people (sizes, wording: [`Opened`] carries the facts), and whom to trust
//! (the image roots: [`OpenOptions::roots`], or the caller's own
//! [`crate::files::confined`]).

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cow::{self, OverlayOptions};
use crate::files::{self, Roots};
use crate::qcow2::{self, Qcow2Options};
use crate::rbd::{self, ConnectOptions, Spec};
use crate::{Advice, CowImage, Error, Image, Qcow2Image, RawImage, RbdImage, Result};

/// The formats vdisk serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// The file is the disk, byte for byte.
    Raw,
    /// A UML COW (version 3) overlay over a raw file or an RBD snapshot.
    Cow,
    /// A qcow2 image, possibly over a backing chain.
    Qcow2,
    /// An image (or snapshot) on Ceph RBD.
    Rbd,
}

impl Format {
    /// The name `vdisk info` prints and a qcow2 header records ("raw", "cow", "qcow2", "rbd").
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Cow => "cow",
            Format::Qcow2 => "qcow2",
            Format::Rbd => "rbd",
        }
    }

    /// The format `name` names, as [`Format::name`] spells it.
    pub fn from_name(name: &str) -> Option<Format> {
        [Format::Raw, Format::Cow, Format::Qcow2, Format::Rbd].into_iter().find(|f| f.name() == name)
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The format of a file whose first bytes are `magic`, as qemu probes: qcow2
/// or a UML COW overlay by their magic, raw otherwise (a file shorter than a
/// magic is raw too).
pub fn detect_bytes(magic: &[u8]) -> Format {
    if qcow2::has_magic(magic) {
        Format::Qcow2
    } else if cow::has_magic(magic) {
        Format::Cow
    } else {
        Format::Raw
    }
}

/// The format of an open file, by its first 4 bytes (raw when it has fewer
/// or they cannot be read: opening it as raw then says what is wrong).
pub fn detect_file(file: &File) -> Format {
    let mut magic = [0u8; 4];
    match file.read_exact_at(&mut magic, 0) {
        Ok(()) => detect_bytes(&magic),
        Err(_) => Format::Raw,
    }
}

/// The format of the image `name` names: RBD for an `rbd:` name, else by the
/// magic of the file, opened read-only through [`files::open`] (so beneath the
/// image roots when confined). Fails when the file cannot be opened.
pub fn detect(name: &Path) -> Result<Format> {
    if rbd::is_rbd(name) {
        return Ok(Format::Rbd);
    }
    Ok(detect_file(&files::open(name, false, "image")?))
}

/// What an image name means: a file (or block device), or an RBD image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    File(PathBuf),
    Rbd(Spec),
}

impl Target {
    /// Parses an image name: `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=NAME]` is an
    /// RBD image (`ceph` applies where the name sets nothing itself); anything
    /// else is a path.
    pub fn parse(name: &Path, ceph: &ConnectOptions) -> Result<Target> {
        if !rbd::is_rbd(name) {
            return Ok(Target::File(name.to_owned()));
        }
        let Some(text) = name.to_str() else {
            return Err(Error::invalid(format!(
                "{} is not valid UTF-8: an rbd: image name must be (rename the pool or image)",
                name.display()
            )));
        };
        Ok(Target::Rbd(Spec::parse(text, ceph)?))
    }

    /// The name an export of this image gets unless told otherwise: an RBD
    /// image's name (and snapshot), a file's stem; None when a file has none.
    pub fn export_name(&self) -> Option<String> {
        match self {
            Target::Rbd(spec) => Some(spec.export_name()),
            Target::File(p) => p.file_stem().map(|s| s.to_string_lossy().into_owned()),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::File(p) => write!(f, "{}", p.display()),
            Target::Rbd(spec) => write!(f, "{spec}"),
        }
    }
}

/// How to open an image.
#[derive(Clone, Default)]
pub struct OpenOptions {
    /// The format the image must be opened as; None: detect it ([`detect`]).
    /// Forcing raw serves an overlay's own bytes, header and all.
    pub format: Option<Format>,
    pub read_only: bool,
    /// Also open the files with O_DIRECT, for aligned requests (not for RBD).
    pub direct: bool,
    /// The backing file of a COW or qcow2 overlay, instead of the one its header names.
    pub backing: Option<PathBuf>,
    /// Accept a COW overlay's backing file whose mtime differs from the header's.
    pub ignore_backing_mtime: bool,
    /// How to reach Ceph for an `rbd:` name (the name's own options win).
    pub ceph: ConnectOptions,
    /// Open every file (the backing chain too) beneath these roots only. None:
    /// as the calling thread already is ([`files::confined`]), so a caller may
    /// confine a larger piece of work around the open instead.
    pub roots: Option<Arc<Roots>>,
}

/// The backing of an opened overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backing {
    /// The file really opened (symlinks resolved), or the RBD snapshot's name.
    pub name: PathBuf,
    pub format: Format,
}

/// An opened image and the facts a caller describes it by.
pub struct Opened {
    pub image: Arc<dyn Image>,
    pub format: Format,
    /// What the name meant.
    pub target: Target,
    /// An overlay's backing file (the first link of the chain), if any.
    pub backing: Option<Backing>,
}

/// Opens the image `name` names (a path or an `rbd:` name) as `o` says: in
/// its detected format unless `o.format` forces one, refusing options that do
/// not apply to that format.
pub fn open(name: &Path, o: &OpenOptions) -> Result<Opened> {
    match &o.roots {
        Some(roots) => files::confined(Some(roots.clone()), || open_here(name, o)),
        None => open_here(name, o),
    }
}

fn open_here(name: &Path, o: &OpenOptions) -> Result<Opened> {
    let path = match Target::parse(name, &o.ceph)? {
        Target::Rbd(spec) => return open_rbd(spec, o),
        Target::File(path) => path,
    };
    let format = match o.format {
        Some(Format::Rbd) => {
            return Err(Error::invalid(format!(
                "{} is not an RBD image name: the rbd format applies to rbd:POOL/IMAGE[@SNAP] names",
                path.display()
            )))
        }
        Some(f) => f,
        // A file that cannot be opened is "raw": opening it as raw says why.
        None => detect(&path).unwrap_or(Format::Raw),
    };
    let (image, backing): (Arc<dyn Image>, _) = match format {
        Format::Qcow2 => {
            let image = open_qcow2(&path, o)?;
            let backing = match (image.backing_path(), image.backing_format().and_then(Format::from_name)) {
                (Some(p), Some(format)) => Some(Backing { name: p.to_owned(), format }),
                _ => None,
            };
            (Arc::new(image), backing)
        }
        Format::Cow => {
            let image = open_cow(&path, o)?;
            let name = image.backing_path().to_owned();
            let format = if rbd::is_rbd(&name) { Format::Rbd } else { Format::Raw };
            (Arc::new(image), Some(Backing { name, format }))
        }
        Format::Raw | Format::Rbd => {
            if o.backing.is_some() || o.ignore_backing_mtime {
                return Err(Error::invalid(format!(
                    "{} is a raw image, which has no backing file: naming one or ignoring its mtime applies to \
                     COW overlays only (naming one to qcow2 overlays too)",
                    path.display()
                )));
            }
            let mut image = RawImage::open(&path, o.read_only)?;
            if o.direct {
                image = image.with_direct_io()?;
            }
            (Arc::new(image), None)
        }
    };
    Ok(Opened { image, format, target: Target::File(path), backing })
}

fn open_rbd(spec: Spec, o: &OpenOptions) -> Result<Opened> {
    if matches!(o.format, Some(Format::Cow | Format::Qcow2)) || o.backing.is_some() || o.ignore_backing_mtime {
        return Err(Error::invalid(format!(
            "{spec} is an RBD image: the cow and qcow2 formats and a backing file (named, its mtime ignored) apply \
             to overlay files"
        )));
    }
    if o.direct {
        return Err(Error::invalid(format!(
            "{spec} is an RBD image: direct I/O applies to files (librbd's cache is off already)"
        ))
        .advise(Advice::NoDirectIo));
    }
    // librados reads the configuration by name: beneath the image roots too, when confined.
    if let Some(conf) = &spec.options.conf {
        files::check_confined(conf)?;
    }
    let image = RbdImage::open(&spec, o.read_only)?;
    Ok(Opened { image: Arc::new(image), format: Format::Rbd, target: Target::Rbd(spec), backing: None })
}

fn open_qcow2(path: &Path, o: &OpenOptions) -> Result<Qcow2Image> {
    if o.ignore_backing_mtime {
        return Err(Error::invalid(format!(
            "{} is a qcow2 image: ignoring the backing file's mtime applies to COW overlays only (qcow2 records \
             no mtime)",
            path.display()
        )));
    }
    let options = Qcow2Options { read_only: o.read_only, backing: o.backing.clone(), ..Default::default() };
    let image = Qcow2Image::open_with(path, &options)?;
    if o.direct {
        return image.with_direct_io();
    }
    Ok(image)
}

fn open_cow(path: &Path, o: &OpenOptions) -> Result<CowImage> {
    let options = OverlayOptions {
        read_only: o.read_only,
        backing: o.backing.clone(),
        ignore_mtime: o.ignore_backing_mtime,
        backing_writable: false,
        ceph: o.ceph.clone(),
    };
    let image = CowImage::open_with(path, &options)?;
    if o.direct {
        return image.with_direct_io();
    }
    Ok(image)
}

#[cfg(test)]
#[path = "opening_tests.rs"]
mod tests;
