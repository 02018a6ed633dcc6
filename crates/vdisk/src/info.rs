//! `vdisk info`.

use std::os::unix::fs::MetadataExt;

use vdisk_image::{Image, RawImage};

use crate::cli::InfoArgs;
use crate::size::human;
use crate::Failure;

pub fn run(a: InfoArgs) -> Result<(), Failure> {
    let image = RawImage::open(&a.image, true)?;
    let meta = std::fs::metadata(&a.image).map_err(|e| Failure::runtime(format!("{}: {e}", a.image.display())))?;
    let allocated = meta.blocks() * 512;
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
