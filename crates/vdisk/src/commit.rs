//! `vdisk commit`: merge an overlay into its backing file or into a new image.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use vdisk_daemon::size::human;
use vdisk_daemon::Error;
use vdisk_image::cow::OverlayOptions;
use vdisk_image::{CowImage, Format, Image};

use crate::cli::CommitArgs;

pub fn run(a: CommitArgs) -> Result<(), Error> {
    // The format's own open below needs concrete types (for the merge), so
    // it is detected here and the format opened directly.
    match vdisk_image::detect(&a.overlay) {
        Ok(Format::Qcow2) => return qcow2(&a),
        Ok(Format::Cow) => {}
        Err(_) if !a.overlay.exists() => {
            return Err(Error::invalid(format!("{} does not exist", a.overlay.display())));
        }
        Err(e) => return Err(e.into()),
        Ok(Format::Rbd) => {
            return Err(Error::invalid(format!(
                "{} is an RBD image, not an overlay: only COW and qcow2 overlays can be committed",
                a.overlay.display()
            )));
        }
        Ok(Format::Raw) => {
            return Err(Error::invalid(format!(
                "{} is not a COW overlay or a qcow2 image (no COW or qcow2 magic at its start); only overlays can \
                 be committed",
                a.overlay.display()
            )));
        }
    }
    let options = OverlayOptions {
        read_only: true,
        backing: a.backing.backing.clone(),
        ignore_mtime: a.backing.ignore_backing_mtime,
        backing_writable: a.into.is_none(),
        ceph: a.backing.ceph.options(),
    };
    let image = CowImage::open_with(&a.overlay, &options)?;
    merge(&a, image.size(), image.backing_path(), |new, p| image.write_merged(new, p), |p| image.commit_to_backing(p))?;
    if a.into.is_none() {
        println!(
            "note: {} changed, so overlays made over it no longer match it; {} still reads the same \
             (serve it with --ignore-backing-mtime) or can be removed",
            image.backing_path().display(),
            a.overlay.display()
        );
    }
    Ok(())
}

/// A qcow2 overlay: into its raw backing file, or with --into into a new raw image.
fn qcow2(a: &CommitArgs) -> Result<(), Error> {
    if a.backing.ignore_backing_mtime {
        return Err(Error::invalid("--ignore-backing-mtime applies to COW overlays only"));
    }
    let options =
        vdisk_image::qcow2::Qcow2Options { read_only: true, backing: a.backing.backing.clone(), ..Default::default() };
    let image = vdisk_image::Qcow2Image::open_with(&a.overlay, &options)?;
    let Some(base) = image.backing_path().map(|p| p.to_owned()) else {
        return Err(Error::invalid(format!(
            "{} has no backing file: there is nothing to commit into",
            a.overlay.display()
        )));
    };
    if a.into.is_none() && image.backing_format() != Some("raw") {
        return Err(Error::invalid(format!(
            "the backing file of {} is {}, not raw: vdisk commits a qcow2 overlay in place only into a raw \
             file; write the merged disk to a new raw image with --into NEW",
            a.overlay.display(),
            image.backing_format().unwrap_or("of no format")
        )));
    }
    merge(a, image.size(), &base, |new, p| image.write_merged(new, p), |p| image.commit_to_backing(p))?;
    Ok(())
}

/// Runs a merge under a progress bar: into a new raw image with `--into`
/// (`into_new`), else into the backing file `base` (`in_place`, which returns
/// the bytes it copied); then says what it did.
fn merge(
    a: &CommitArgs,
    size: u64,
    base: &Path,
    into_new: impl FnOnce(&Path, &dyn Fn(u64, u64)) -> Result<(), vdisk_image::Error>,
    in_place: impl FnOnce(&dyn Fn(u64, u64)) -> Result<u64, vdisk_image::Error>,
) -> Result<(), Error> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("merging {bar:40} {bytes}/{total_bytes} ({eta})").expect("a valid template"),
    );
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    match &a.into {
        Some(new) => {
            into_new(new, &progress)?;
            bar.finish_and_clear();
            let (new, overlay, base) = (new.display(), a.overlay.display(), base.display());
            println!("wrote {new} ({}, raw): {overlay} merged over {base}", human(size));
        }
        None => {
            let copied = in_place(&progress)?;
            bar.finish_and_clear();
            println!("merged {} of {} into {}", human(copied), a.overlay.display(), base.display());
        }
    }
    Ok(())
}
