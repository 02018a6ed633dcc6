//! `serve --fuse PATH`: the device as a regular file through FUSE.

use std::path::Path;
use std::sync::Arc;

use vdisk_engine::Device;

use crate::serve::Frontend;
use crate::Failure;

pub fn start(
    path: &Path,
    _device: &Arc<Device>,
    _uring: bool,
    _banner: &mut Vec<String>,
) -> Result<Box<dyn Frontend>, Failure> {
    Err(Failure::usage(format!("--fuse {}: the FUSE export is not built yet", path.display())))
}
