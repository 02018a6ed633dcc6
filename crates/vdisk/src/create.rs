//! `vdisk create`.

use indicatif::{ProgressBar, ProgressStyle};
use vdisk_image::{CowImage, Image, RawImage, RbdImage};

use crate::cli::CreateArgs;
use crate::size::human;
use crate::Failure;

pub fn run(a: CreateArgs) -> Result<(), Failure> {
    if let Some(spec) = crate::formats::rbd_spec(&a.image, &a.ceph.options())? {
        if a.backing.is_some() || a.preallocate {
            return Err(Failure::usage(format!(
                "{spec} is an RBD image: --backing and --preallocate apply to image files \
                 (for an overlay over an RBD snapshot: vdisk create --backing rbd:POOL/IMAGE@SNAP overlay.cow)"
            )));
        }
        let Some(size) = a.size else {
            return Err(Failure::usage("vdisk create needs --size for an RBD image (e.g. --size 10G)"));
        };
        RbdImage::create(&spec, size)?;
        println!("created {spec} ({}, rbd)", human(size));
        return Ok(());
    }
    if let Some(base) = &a.backing {
        if let Some(spec) = crate::formats::rbd_spec(base, &a.ceph.options())? {
            CowImage::create_over_rbd(&a.image, &spec)?;
            println!("created {} (cow overlay over RBD snapshot {spec}, {})", a.image.display(), human(spec_size(&a)?));
            return Ok(());
        }
        CowImage::create(&a.image, base)?;
        let image = CowImage::open(&a.image, true, None, false)?;
        println!(
            "created {} (cow overlay over {}, {})",
            a.image.display(),
            image.backing_path().display(),
            human(image.size())
        );
        return Ok(());
    }
    let Some(size) = a.size else {
        return Err(Failure::usage(
            "vdisk create needs --size (e.g. --size 10G), or --backing BASE for an overlay (see --help)",
        ));
    };
    if a.preallocate {
        let bar = ProgressBar::new(size).with_style(
            ProgressStyle::with_template("preallocating {bar:40} {bytes}/{total_bytes} ({eta})")
                .expect("a valid template"),
        );
        RawImage::create(&a.image, size, Some(&|done| bar.set_position(done)))?;
        bar.finish_and_clear();
    } else {
        RawImage::create(&a.image, size, None)?;
    }
    let how = if a.preallocate { "preallocated" } else { "sparse" };
    println!("created {} ({}, raw, {how})", a.image.display(), human(size));
    Ok(())
}

/// The size a new overlay recorded (from its header).
fn spec_size(a: &CreateArgs) -> Result<u64, Failure> {
    Ok(vdisk_image::cow::inspect(&a.image)?.header.size)
}
