//! Opening an image in whichever format it is: an RBD image on Ceph for an
//! `rbd:POOL/IMAGE[@SNAP]` name; qcow2 or a UML COW overlay when the file
//! starts with their magic (or `--format qcow2` / `--format cow`); raw otherwise.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use vdisk_image::qcow2::{self, Qcow2Options};
use vdisk_image::rbd::{self, ConnectOptions, Spec};
use vdisk_image::{cow, CowImage, Image, Qcow2Image, RawImage, RbdImage};

use crate::cli::{BackingArgs, FormatArg};
use crate::size::human;
use crate::Failure;

/// The first 4 bytes of the file, or None when it cannot be opened (through
/// the one open helper: never blocking, only files and block devices, beneath
/// the roots when confined) or read. Opening it as raw then reports why.
fn magic(path: &Path) -> Option<[u8; 4]> {
    let mut magic = [0u8; 4];
    let mut f = vdisk_image::files::open(path, false, "image").ok()?;
    f.read_exact(&mut magic).ok().map(|()| magic)
}

/// True when the file starts with the COW magic. A file that cannot be read
/// is "not COW".
pub fn is_cow(path: &Path) -> bool {
    magic(path).is_some_and(|m| cow::has_magic(&m))
}

/// True when the file starts with the qcow2 magic.
pub fn is_qcow2(path: &Path) -> bool {
    magic(path).is_some_and(|m| qcow2::has_magic(&m))
}

/// An opened image and a one-line description of it for the export list.
pub struct Opened {
    pub image: Arc<dyn Image>,
    pub description: String,
}

/// The RBD image an `rbd:` name means, or None for a path.
pub fn rbd_spec(name: &Path, defaults: &ConnectOptions) -> Result<Option<Spec>, Failure> {
    if !rbd::is_rbd(name) {
        return Ok(None);
    }
    let Some(text) = name.to_str() else {
        return Err(Failure::usage(format!("{} is not valid UTF-8", name.display())));
    };
    Ok(Some(Spec::parse(text, defaults)?))
}

/// The export name an image gets by default: an RBD image's name (and
/// snapshot), a file's stem. None: the caller's own rule.
pub fn export_name(name: &Path) -> Option<String> {
    rbd_spec(name, &ConnectOptions::default()).ok().flatten().map(|s| s.export_name())
}

pub fn open(
    path: &Path,
    format: FormatArg,
    read_only: bool,
    direct: bool,
    backing: &BackingArgs,
) -> Result<Opened, Failure> {
    if let Some(spec) = rbd_spec(path, &backing.ceph.options())? {
        if matches!(format, FormatArg::Cow | FormatArg::Qcow2)
            || backing.backing.is_some()
            || backing.ignore_backing_mtime
        {
            return Err(Failure::usage(format!(
                "{spec} is an RBD image: --format cow or qcow2, --backing and --ignore-backing-mtime apply to COW overlay files"
            )));
        }
        if direct {
            return Err(Failure::usage(format!(
                "{spec} is an RBD image: --direct applies to files (librbd's cache is off already)"
            )));
        }
        let image = RbdImage::open(&spec, read_only)?;
        let ro = if spec.snap.is_some() { ", snapshot" } else { "" };
        let description = format!("{spec} (rbd{ro}, {})", human(image.size()));
        return Ok(Opened { image: Arc::new(image), description });
    }
    let direct_err = |e: vdisk_image::Error| Failure::usage(crate::advised(&e));
    if format == FormatArg::Qcow2 || (format == FormatArg::Auto && is_qcow2(path)) {
        return open_qcow2(path, read_only, direct, backing);
    }
    let cow = match format {
        FormatArg::Auto => is_cow(path),
        FormatArg::Raw => false,
        FormatArg::Cow => true,
        FormatArg::Qcow2 => unreachable!("opened above"),
    };
    if !cow {
        if backing.backing.is_some() || backing.ignore_backing_mtime {
            return Err(Failure::usage(format!(
                "{} is a raw image: --backing and --ignore-backing-mtime apply to COW overlays only",
                path.display()
            )));
        }
        let mut image = RawImage::open(path, read_only)?;
        if direct {
            image = image.with_direct_io().map_err(direct_err)?;
        }
        let description = format!("{} ({}, {})", path.display(), image.format(), human(image.size()));
        return Ok(Opened { image: Arc::new(image), description });
    }
    let options = cow::OverlayOptions {
        read_only,
        backing: backing.backing.clone(),
        ignore_mtime: backing.ignore_backing_mtime,
        backing_writable: false,
        ceph: backing.ceph.options(),
    };
    let mut image = CowImage::open_with(path, &options)?;
    if direct {
        image = image.with_direct_io().map_err(direct_err)?;
    }
    let description =
        format!("{} (cow over {}, {})", path.display(), image.backing_path().display(), human(image.size()));
    Ok(Opened { image: Arc::new(image), description })
}

fn open_qcow2(path: &Path, read_only: bool, direct: bool, backing: &BackingArgs) -> Result<Opened, Failure> {
    if backing.ignore_backing_mtime {
        return Err(Failure::usage(format!(
            "{} is a qcow2 image: --ignore-backing-mtime applies to COW overlays only",
            path.display()
        )));
    }
    let options = Qcow2Options { read_only, backing: backing.backing.clone(), ..Default::default() };
    let mut image = Qcow2Image::open_with(path, &options)?;
    if direct {
        image = image.with_direct_io().map_err(|e| Failure::usage(crate::advised(&e)))?;
    }
    let over = match (image.backing_path(), image.backing_format()) {
        (Some(p), Some(f)) => format!(" over {} ({f})", p.display()),
        _ => String::new(),
    };
    let description = format!("{} (qcow2{over}, {})", path.display(), human(image.size()));
    Ok(Opened { image: Arc::new(image), description })
}
