//! `vdisk commit`: merge an overlay into its backing file or into a new image.

use indicatif::{ProgressBar, ProgressStyle};
use vdisk_image::cow::OverlayOptions;
use vdisk_image::{CowImage, Image};

use crate::cli::CommitArgs;
use crate::formats::is_cow;
use crate::size::human;
use crate::Failure;

pub fn run(a: CommitArgs) -> Result<(), Failure> {
    if !is_cow(&a.overlay) {
        // Opening it says what is wrong: missing, unreadable, or not an overlay.
        if !a.overlay.exists() {
            return Err(Failure::usage(format!("{} does not exist", a.overlay.display())));
        }
        return Err(Failure::usage(format!(
            "{} is not a COW overlay (no COW magic at its start); only overlays can be committed",
            a.overlay.display()
        )));
    }
    let options = OverlayOptions {
        read_only: true,
        backing: a.backing.backing.clone(),
        ignore_mtime: a.backing.ignore_backing_mtime,
        backing_writable: a.into.is_none(),
        ceph: a.backing.ceph.options(),
    };
    let image = CowImage::open_with(&a.overlay, &options)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("merging {bar:40} {bytes}/{total_bytes} ({eta})").expect("a valid template"),
    );
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    match &a.into {
        Some(new) => {
            image.write_merged(new, &progress)?;
            bar.finish_and_clear();
            println!(
                "wrote {} ({}, raw): {} merged over {}",
                new.display(),
                human(image.size()),
                a.overlay.display(),
                image.backing_path().display()
            );
        }
        None => {
            let copied = image.commit_to_backing(&progress)?;
            bar.finish_and_clear();
            println!("merged {} of {} into {}", human(copied), a.overlay.display(), image.backing_path().display());
            println!(
                "note: {} changed, so overlays made over it no longer match it; {} still reads the same \
                 (serve it with --ignore-backing-mtime) or can be removed",
                image.backing_path().display(),
                a.overlay.display()
            );
        }
    }
    Ok(())
}
