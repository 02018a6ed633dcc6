//! `vdisk create`.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use vdisk_daemon::size::human;
use vdisk_daemon::Error;
use vdisk_image::qcow2::{CreateOptions, DEFAULT_CLUSTER_BITS};
use vdisk_image::{CowImage, Format, Image, Qcow2Image, RawImage, RbdImage};

use crate::cli::{CreateArgs, CreateFormat};

pub fn run(a: CreateArgs) -> Result<(), Error> {
    if let Some(spec) = vdisk_daemon::formats::rbd_spec(&a.image, &a.ceph.options())? {
        return rbd(&a, &spec);
    }
    let format = a.format.unwrap_or(if a.backing.is_some() { CreateFormat::Cow } else { CreateFormat::Raw });
    if a.cluster_size.is_some() && format != CreateFormat::Qcow2 {
        return Err(Error::invalid("--cluster-size applies to --format qcow2 only"));
    }
    match format {
        CreateFormat::Qcow2 => return qcow2(&a),
        CreateFormat::Cow => return cow(&a),
        CreateFormat::Raw if a.backing.is_some() => {
            return Err(Error::invalid("a raw image has no backing file: use --format cow or --format qcow2"))
        }
        CreateFormat::Raw => {}
    }
    let Some(size) = a.size else {
        return Err(Error::invalid(
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

fn cow(a: &CreateArgs) -> Result<(), Error> {
    let Some(base) = &a.backing else {
        return Err(Error::invalid("a COW overlay needs --backing BASE"));
    };
    if a.size.is_some() || a.preallocate {
        return Err(Error::invalid("a COW overlay takes its size from BASE: drop --size and --preallocate"));
    }
    if let Some(spec) = vdisk_daemon::formats::rbd_spec(base, &a.ceph.options())? {
        CowImage::create_over_rbd(&a.image, &spec)?;
        println!("created {} (cow overlay over RBD snapshot {spec}, {})", a.image.display(), human(spec_size(a)?));
        return Ok(());
    }
    // A COW overlay reads its backing file as raw bytes: an image format there would be served as data.
    if let Ok(format @ (Format::Cow | Format::Qcow2)) = vdisk_image::detect(base) {
        return Err(Error::invalid(format!(
            "{} is a {format} image, and a COW overlay reads its backing file as raw bytes: make a qcow2 overlay \
             over it (--format qcow2)",
            base.display()
        )));
    }
    CowImage::create(&a.image, base)?;
    let image = CowImage::open(&a.image, true, None, false)?;
    println!(
        "created {} (cow overlay over {}, {})",
        a.image.display(),
        image.backing_path().display(),
        human(image.size())
    );
    Ok(())
}

/// The format and virtual size of a base image, as a qcow2 overlay records it.
fn probe_base(base: &Path) -> Result<(&'static str, u64), Error> {
    let opened = vdisk_image::open(base, &vdisk_image::OpenOptions { read_only: true, ..Default::default() })?;
    Ok((opened.format.name(), opened.image.size()))
}

fn qcow2(a: &CreateArgs) -> Result<(), Error> {
    if a.preallocate {
        return Err(Error::invalid("--preallocate applies to raw images only"));
    }
    let cluster_bits = match a.cluster_size {
        None => DEFAULT_CLUSTER_BITS,
        Some(c) if c.is_power_of_two() && (512..=2 << 20).contains(&c) => c.trailing_zeros(),
        Some(c) => return Err(Error::invalid(format!("--cluster-size {c}: a power of two from 512 to 2M"))),
    };
    let base = match &a.backing {
        None => None,
        Some(b) if vdisk_daemon::formats::rbd_spec(b, &a.ceph.options())?.is_some() => {
            return Err(Error::invalid(format!(
                "{}: a qcow2 overlay over an RBD snapshot is not supported; make a COW overlay (drop --format qcow2)",
                b.display()
            )))
        }
        Some(b) => {
            let (fmt, size) = probe_base(b)?;
            let abs = std::path::absolute(b).map_err(|e| Error::invalid(b.display().to_string()).at(b).because(e))?;
            Some((abs, fmt, size))
        }
    };
    let size = match (a.size, &base) {
        (Some(s), Some((b, _, bsize))) if s < *bsize => {
            return Err(Error::invalid(format!(
                "--size {s} is smaller than the backing file {} ({bsize} bytes)",
                b.display()
            )))
        }
        (Some(s), _) => s,
        (None, Some((_, _, bsize))) => *bsize,
        (None, None) => {
            return Err(Error::invalid("vdisk create --format qcow2 needs --size (e.g. --size 10G) or --backing BASE"))
        }
    };
    let backing = base.as_ref().map(|(p, f, _)| (p.as_path(), *f));
    Qcow2Image::create(&a.image, &CreateOptions { size, cluster_bits, backing })?;
    let over = base.as_ref().map(|(p, f, _)| format!(" over {} ({f})", p.display())).unwrap_or_default();
    println!("created {} (qcow2{over}, {}, {} clusters)", a.image.display(), human(size), human(1 << cluster_bits));
    Ok(())
}

/// A new image on Ceph RBD.
fn rbd(a: &CreateArgs, spec: &vdisk_image::rbd::Spec) -> Result<(), Error> {
    if a.backing.is_some() || a.preallocate || a.format.is_some_and(|f| f != CreateFormat::Raw) {
        return Err(Error::invalid(format!(
            "{spec} is an RBD image: --backing, --preallocate and --format apply to image files \
             (for an overlay over an RBD snapshot: vdisk create --backing rbd:POOL/IMAGE@SNAP overlay.cow)"
        )));
    }
    let Some(size) = a.size else {
        return Err(Error::invalid("vdisk create needs --size for an RBD image (e.g. --size 10G)"));
    };
    RbdImage::create(spec, size)?;
    println!("created {spec} ({}, rbd)", human(size));
    Ok(())
}

/// The size a new overlay recorded (from its header).
fn spec_size(a: &CreateArgs) -> Result<u64, Error> {
    Ok(vdisk_image::cow::inspect(&a.image)?.header.size)
}
