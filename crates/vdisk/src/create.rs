//! `vdisk create`.

use indicatif::{ProgressBar, ProgressStyle};
use vdisk_image::RawImage;

use crate::cli::CreateArgs;
use crate::size::human;
use crate::Failure;

pub fn run(a: CreateArgs) -> Result<(), Failure> {
    if a.preallocate {
        let bar = ProgressBar::new(a.size).with_style(
            ProgressStyle::with_template("preallocating {bar:40} {bytes}/{total_bytes} ({eta})")
                .expect("a valid template"),
        );
        RawImage::create(&a.image, a.size, Some(&|done| bar.set_position(done)))?;
        bar.finish_and_clear();
    } else {
        RawImage::create(&a.image, a.size, None)?;
    }
    let how = if a.preallocate { "preallocated" } else { "sparse" };
    println!("created {} ({}, raw, {how})", a.image.display(), human(a.size));
    Ok(())
}
