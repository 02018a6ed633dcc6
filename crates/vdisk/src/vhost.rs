//! `serve --vhost-user-blk SOCKET`: the device as a VM's virtio-blk disk.

use std::path::Path;
use std::sync::Arc;

use vdisk_engine::Device;

use crate::serve::Frontend;
use crate::Failure;

pub fn start(
    socket: &Path,
    _device: &Arc<Device>,
    _num_queues: Option<u16>,
    _socket_mode: u32,
    _banner: &mut Vec<String>,
) -> Result<Box<dyn Frontend>, Failure> {
    Err(Failure::usage(format!("--vhost-user-blk {}: the vhost-user-blk export is not built yet", socket.display())))
}
