//! `vdisk info`.

use std::os::unix::fs::MetadataExt;

use vdisk_daemon::size::human;
use vdisk_daemon::Error;
use vdisk_image::rbd::Spec;
use vdisk_image::{cow, Format, Image, RawImage, RbdImage};

use crate::cli::InfoArgs;

pub fn run(a: InfoArgs) -> Result<(), Error> {
    if let Some(spec) = vdisk_daemon::formats::rbd_spec(&a.image, &a.ceph.options())? {
        return rbd_info(&spec, a.json);
    }
    // A file that cannot be opened is "raw": opening it below says why.
    match vdisk_image::detect(&a.image).unwrap_or(Format::Raw) {
        Format::Cow => return cow_info(&a),
        Format::Qcow2 => return qcow2_info(&a),
        Format::Raw | Format::Rbd => {}
    }
    let image = RawImage::open(&a.image, true)?;
    let allocated = allocated(&a)?;
    if a.json {
        let v = serde_json::json!({
            "path": a.image.display().to_string(),
            "format": image.format(),
            "virtual-size": image.size(),
            "allocated": allocated,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        println!("image:        {}", a.image.display());
        println!("format:       {}", image.format());
        println!("virtual size: {} ({} bytes)", human(image.size()), image.size());
        println!("allocated:    {} ({} bytes)", human(allocated), allocated);
    }
    Ok(())
}

/// Bytes the file occupies on disk.
fn allocated(a: &InfoArgs) -> Result<u64, Error> {
    let meta = std::fs::metadata(&a.image)
        .map_err(|e| Error::failed(a.image.display().to_string()).at(&a.image).because(e))?;
    Ok(meta.blocks() * 512)
}

/// An overlay: read without locking (it may be being served) and without
/// needing its backing file (whose state is reported instead).
fn cow_info(a: &InfoArgs) -> Result<(), Error> {
    let i = cow::inspect(&a.image)?;
    let h = &i.header;
    let allocated = allocated(a)?;
    let in_overlay = (i.sectors_allocated * h.sector_size as u64).min(h.size);
    let written = h.backing_path().display().to_string();
    let resolved = i.backing_resolved.display().to_string();
    let canonical = i.backing_canonical.as_ref().map(|p| p.display().to_string());
    if a.json {
        let v = serde_json::json!({
            "path": a.image.display().to_string(),
            "format": "cow",
            "cow-version": 3,
            "virtual-size": h.size,
            "allocated": allocated,
            "backing-file": written,
            "backing-file-resolved": resolved,
            "backing-file-opens": canonical,
            "backing-device": i.backing_stat.map(|s| s.0),
            "backing-inode": i.backing_stat.map(|s| s.1),
            "backing-size": i.backing_stat.map(|s| s.2),
            "backing-file-mtime": i.backing_stat.map(|s| s.3),
            "backing-ok": i.backing_problem.is_none(),
            "backing-problem": i.backing_problem,
            "backing-mtime": h.mtime,
            "sector-size": h.sector_size,
            "alignment": h.alignment,
            "bitmap-offset": h.bitmap_offset(),
            "bitmap-length": h.bitmap_len(),
            "data-offset": h.data_offset(),
            "sectors": h.sectors(),
            "sectors-allocated": i.sectors_allocated,
            "overlay-bytes": in_overlay,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    println!("image:        {}", a.image.display());
    println!("format:       cow (UML COW v3)");
    println!("virtual size: {} ({} bytes)", human(h.size), h.size);
    println!("backing file: {written}");
    if resolved != written {
        println!("  relative to the overlay: {resolved}");
    }
    match (&canonical, i.backing_stat) {
        _ if vdisk_image::rbd::is_rbd(h.backing_path()) => {
            println!("  an RBD snapshot (never changes): its size is checked when the overlay is opened")
        }
        (Some(c), Some((dev, ino, size, mtime))) => {
            if *c != resolved {
                println!("  through symlinks or ..: {c}");
            }
            println!("  `vdisk serve` opens {c}: device {dev:#x}, inode {ino}, {size} bytes, mtime {mtime}");
        }
        _ => println!("  `vdisk serve` would find no file there"),
    }
    match &i.backing_problem {
        None if vdisk_image::rbd::is_rbd(h.backing_path()) => {}
        None => println!("  ok: size and mtime match the header"),
        Some(p) => println!("  problem: {p}"),
    }
    println!("sector size:  {} bytes, alignment {}", h.sector_size, h.alignment);
    println!(
        "bitmap:       {} bytes at offset {}; data at offset {}",
        h.bitmap_len(),
        h.bitmap_offset(),
        h.data_offset()
    );
    println!(
        "in overlay:   {} of {} sectors ({}) as of the last flush",
        i.sectors_allocated,
        h.sectors(),
        human(in_overlay)
    );
    println!("allocated:    {} ({} bytes)", human(allocated), allocated);
    Ok(())
}

/// A qcow2 image: its header's facts and what its L2 tables hold, read
/// without locking it and without opening its backing file.
fn qcow2_info(a: &InfoArgs) -> Result<(), Error> {
    use vdisk_image::qcow2::header::{COMPAT_LAZY_REFCOUNTS, INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
    let i = vdisk_image::qcow2::inspect(&a.image)?;
    let h = &i.header;
    let allocated = allocated(a)?;
    let written = h.backing.as_ref().map(|b| String::from_utf8_lossy(b).into_owned());
    let resolved = i.backing_resolved.as_ref().map(|p| p.display().to_string());
    let compat = if h.version >= 3 { "1.1" } else { "0.10" };
    let compression = if h.compression_type == 1 { "zstd" } else { "zlib" };
    let (dirty, corrupt) = (h.incompatible & INCOMPAT_DIRTY != 0, h.incompatible & INCOMPAT_CORRUPT != 0);
    let lazy = h.compatible & COMPAT_LAZY_REFCOUNTS != 0;
    let in_image = i.data_clusters * h.cluster_size();
    if a.json {
        let v = serde_json::json!({
            "path": a.image.display().to_string(),
            "format": "qcow2",
            "qcow2-version": h.version,
            "compat": compat,
            "virtual-size": h.size,
            "allocated": allocated,
            "file-length": i.file_len,
            "cluster-size": h.cluster_size(),
            "refcount-bits": h.refcount_bits(),
            "extended-l2": h.extended_l2(),
            "compression-type": compression,
            "lazy-refcounts": lazy,
            "dirty": dirty,
            "corrupt": corrupt,
            "snapshots": h.nb_snapshots,
            "bitmaps": h.has_bitmaps,
            "l1-size": h.l1_size,
            "backing-file": written,
            "backing-file-resolved": resolved,
            "backing-format": h.backing_format,
            "data-clusters": i.data_clusters,
            "zero-clusters": i.zero_clusters,
            "image-bytes": in_image,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    println!("image:        {}", a.image.display());
    println!("format:       qcow2 (version {}, compat {compat})", h.version);
    println!("virtual size: {} ({} bytes)", human(h.size), h.size);
    if let Some(w) = &written {
        let fmt = h.backing_format.as_deref().unwrap_or("not recorded: probed");
        println!("backing file: {w} (format {fmt})");
        if let Some(r) = resolved.as_ref().filter(|r| *r != w) {
            println!("  relative to the image: {r}");
        }
    }
    println!("clusters:     {}, refcounts {} bits", human(h.cluster_size()), h.refcount_bits());
    println!(
        "features:     extended L2 {}, compression {compression}, lazy refcounts {lazy}, snapshots {}",
        h.extended_l2(),
        h.nb_snapshots
    );
    if dirty || corrupt {
        println!(
            "state:        {}{}: run `qemu-img check -r all {}`",
            if dirty { "dirty " } else { "" },
            if corrupt { "corrupt" } else { "" },
            a.image.display()
        );
    }
    println!(
        "in image:     {} data clusters ({}), {} zero clusters",
        i.data_clusters,
        human(in_image),
        i.zero_clusters
    );
    println!("allocated:    {} ({} bytes)", human(allocated), allocated);
    Ok(())
}

/// An RBD image or snapshot, opened read-only.
fn rbd_info(spec: &Spec, json: bool) -> Result<(), Error> {
    let image = RbdImage::open(spec, true)?;
    let i = image.info()?;
    if json {
        let v = serde_json::json!({
            "path": spec.to_string(),
            "format": "rbd",
            "virtual-size": i.size,
            "allocated": i.allocated,
            "pool": spec.pool,
            "image": spec.image,
            "snapshot": spec.snap,
            "object-size": i.object_size,
            "objects": i.objects,
            "features": i.features,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    println!("image:        {spec}");
    println!("format:       rbd (Ceph RBD{})", if spec.snap.is_some() { " snapshot, read-only" } else { "" });
    println!("virtual size: {} ({} bytes)", human(i.size), i.size);
    println!("objects:      {} of {}", i.objects, human(i.object_size));
    match i.allocated {
        Some(a) => println!("allocated:    {} ({a} bytes, whole objects)", human(a)),
        None => println!("allocated:    unknown (the image has no fast-diff)"),
    }
    Ok(())
}
