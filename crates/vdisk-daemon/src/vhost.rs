//! `serve --vhost-user-blk SOCKET`: the device as a VM's virtio-blk disk.

use std::path::Path;
use std::sync::Arc;

use vdisk_engine::Device;
use vdisk_vhost::VhostBlk;

use crate::frontend::Frontend;
use crate::listen::bind_unix;
use crate::Error;

pub fn start(
    socket: &Path,
    device: &Arc<Device>,
    num_queues: Option<u16>,
    socket_mode: u32,
    banner: &mut Vec<String>,
) -> Result<Box<dyn Frontend>, Error> {
    let queues =
        num_queues.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get().min(64) as u16).unwrap_or(1));
    // A socket the service manager passed is used as it is, and left to it at the end.
    let (listener, inherited) = match crate::systemd::take_vhost(socket) {
        Some(l) => (l, true),
        None => (bind_unix(socket, socket_mode, "--vhost-user-blk")?, false),
    };
    let export = VhostBlk::start(listener, socket, device.clone(), queues).map_err(|e| {
        if !inherited {
            let _ = std::fs::remove_file(socket);
        }
        Error::failed(format!("cannot start the vhost-user-blk export on {}", socket.display())).at(socket).because(e)
    })?;
    let export = if inherited { export.keep_socket_file() } else { export };
    banner.push(format!(
        "vdisk: vhost-user-blk for {:?} on {} ({queues} queue{})",
        device.name(),
        socket.display(),
        if queues == 1 { "" } else { "s" }
    ));
    banner.push(format!(
        "  try: qemu-system-x86_64 ... -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem \
         -chardev socket,id=vd,path={},reconnect=1 -device vhost-user-blk-pci,chardev=vd,num-queues={queues}",
        socket.display()
    ));
    Ok(Box::new(Export(export)))
}

struct Export(VhostBlk);

impl Frontend for Export {
    fn stop(self: Box<Self>) -> Result<(), Error> {
        self.0.stop().map_err(|e| Error::failed("vhost-user-blk").because(e))
    }
}
