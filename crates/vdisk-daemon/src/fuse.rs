//! `serve --fuse PATH`: the device as a regular file through FUSE (crate vdisk-fuse).

use std::path::Path;
use std::sync::Arc;

use vdisk_engine::Device;
use vdisk_fuse::{FuseExport, Options};

use crate::frontend::Frontend;
use crate::{Error, ErrorKind};

pub fn start(
    path: &Path,
    device: &Arc<Device>,
    uring: bool,
    banner: &mut Vec<String>,
) -> Result<Box<dyn Frontend>, Error> {
    let opts = Options { uring, ..Default::default() };
    let mut export = vdisk_fuse::start(path, device.clone(), &opts).map_err(|e| advised(ErrorKind::Invalid, &e))?;
    banner.append(&mut export.notes);
    let mode = if device.read_only() { "read-only" } else { "read-write" };
    banner.push(format!(
        "vdisk: export {:?} as file {} ({}, {mode}, {} bytes)",
        device.name(),
        path.display(),
        export.transport,
        device.size()
    ));
    banner.push(format!("  try: losetup --find --show --direct-io=on {}", path.display()));
    Ok(Box::new(Fuse(export)))
}

struct Fuse(FuseExport);

impl Frontend for Fuse {
    fn stop(self: Box<Self>) -> Result<(), Error> {
        self.0.stop().map_err(|e| advised(ErrorKind::Failed, &e))
    }
}

/// A FUSE error in the terms of this command line, its OS error kept as the cause.
fn advised(kind: ErrorKind, e: &vdisk_fuse::Error) -> Error {
    use vdisk_fuse::ErrorKind::*;
    let message = match e.kind() {
        File => format!("--fuse {e}"),
        Ring => format!("--fuse-uring {e}"),
        RingOff => format!("--fuse-uring: {e}"),
        RingMissing => format!("--fuse-uring: {e}; use --fuse without --fuse-uring"),
        _ => e.to_string(),
    };
    let error = Error::new(kind, message);
    match e.os_source() {
        Some(os) => error.because_shared(os),
        None => error,
    }
}
