//! The daemon's side of opening an image: its one-line description for the
//! export list, and its errors. Which format a file is, what an `rbd:` name
//! means and which options fit which format are decided by
//! [`vdisk_image::open`], once, for every command.

use std::path::Path;
use std::sync::Arc;

use vdisk_image::rbd::{ConnectOptions, Spec};
use vdisk_image::{Format, Image, Target};

use crate::size::human;
use crate::Error;

/// An opened image and a one-line description of it for the export list.
pub struct Opened {
    pub image: Arc<dyn Image>,
    pub description: String,
}

/// The RBD image an `rbd:` name means, or None for a path.
pub fn rbd_spec(name: &Path, defaults: &ConnectOptions) -> Result<Option<Spec>, Error> {
    match Target::parse(name, defaults)? {
        Target::Rbd(spec) => Ok(Some(spec)),
        Target::File(_) => Ok(None),
    }
}

/// The export name an image gets by default: an RBD image's name (and
/// snapshot), a file's stem. None: the caller's own rule.
pub fn export_name(name: &Path) -> Option<String> {
    Target::parse(name, &ConnectOptions::default()).ok()?.export_name()
}

/// Opens an image for serving (within the caller's image roots, if any).
pub fn open(image: &Path, options: &vdisk_image::OpenOptions) -> Result<Opened, Error> {
    let direct = options.direct;
    let opened = vdisk_image::open(image, options).map_err(|e| {
        // The file system cannot do what --direct asked: the user's choice, exit 2.
        if direct && e.kind() == vdisk_image::ErrorKind::Unsupported {
            Error::image(crate::error::ErrorKind::Invalid, &e)
        } else {
            Error::from(e)
        }
    })?;
    let description = describe(&opened);
    Ok(Opened { image: opened.image, description })
}

/// "disk.qcow2 (qcow2 over /srv/base.img (raw), 10 GiB)": what the export
/// list shows of an image. Presentation: sizes in the command line's units.
pub fn describe(o: &vdisk_image::Opened) -> String {
    let size = human(o.image.size());
    let kind = match (&o.target, &o.backing) {
        (Target::Rbd(spec), _) if spec.snap.is_some() => "rbd, snapshot".to_owned(),
        (_, Some(b)) if o.format == Format::Qcow2 => format!("qcow2 over {} ({})", b.name.display(), b.format),
        (_, Some(b)) => format!("{} over {}", o.format, b.name.display()),
        (_, None) => o.format.to_string(),
    };
    format!("{} ({kind}, {size})", o.target)
}
