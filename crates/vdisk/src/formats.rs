//! Opening an image in whichever format it is: a UML COW overlay when the file
//! starts with the COW magic (or `--format cow`), raw otherwise.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use vdisk_image::{cow, CowImage, Image, RawImage};

use crate::cli::{BackingArgs, FormatArg};
use crate::size::human;
use crate::Failure;

/// True when the file starts with the COW magic. A file that cannot be read
/// is "not COW": opening it as raw then reports why.
pub fn is_cow(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && cow::has_magic(&magic)
}

/// An opened image and a one-line description of it for the export list.
pub struct Opened {
    pub image: Arc<dyn Image>,
    pub description: String,
}

pub fn open(
    path: &Path,
    format: FormatArg,
    read_only: bool,
    direct: bool,
    backing: &BackingArgs,
) -> Result<Opened, Failure> {
    let cow = match format {
        FormatArg::Auto => is_cow(path),
        FormatArg::Raw => false,
        FormatArg::Cow => true,
    };
    let direct_err = |e: vdisk_image::Error| Failure::usage(crate::advised(&e));
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
    let mut image = CowImage::open(path, read_only, backing.backing.as_deref(), backing.ignore_backing_mtime)?;
    if direct {
        image = image.with_direct_io().map_err(direct_err)?;
    }
    let description =
        format!("{} (cow over {}, {})", path.display(), image.backing_path().display(), human(image.size()));
    Ok(Opened { image: Arc::new(image), description })
}
