//! The vhost-user-blk export: serves a device to a virtual machine (QEMU,
//! cloud-hypervisor, Firecracker) as its virtio-blk disk. The guest's queues
//! live in shared memory; each queue has its own worker thread which drains
//! every available request per kick, submits them to the device's engine as
//! one batch, and completes them as one batch with one notification.
//!
//! Built on rust-vmm's vhost-user-backend (protocol, memory table, rings).
//! This crate owns the virtio-blk part: the request parser ([`parse`]), the
//! config space ([`config`]) and the request path ([`queue`]). It never
//! touches the image: every request goes through the engine.
//!
//! One frontend at a time: when it disconnects, the socket is served again
//! and the next frontend gets the device from a clean state.

mod backend;
pub mod config;
#[doc(hidden)]
pub mod fuzzing;
pub mod parse;
mod queue;

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vdisk_engine::Device;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use backend::BlkBackend;
use queue::Shared;

/// A running export, serving one frontend after another until stopped.
pub struct VhostBlk {
    control: Arc<Mutex<Control>>,
    path: PathBuf,
    thread: Option<JoinHandle<()>>,
    /// Whether [`VhostBlk::stop`] removes the socket file (not when a service manager owns it).
    remove_socket: bool,
}

#[derive(Default)]
struct Control {
    stopping: bool,
    /// The connected frontend, if any.
    current: Option<ShutdownHandle>,
}

impl VhostBlk {
    /// Serves `device` on `listener` (bound at `path`, which [`VhostBlk::stop`] removes)
    /// with `num_queues` virtqueues.
    pub fn start(listener: UnixListener, path: &Path, device: Arc<Device>, num_queues: u16) -> io::Result<VhostBlk> {
        let control = Arc::new(Mutex::new(Control::default()));
        let serial = config::serial(device.image().file_path(0));
        let thread = {
            let control = control.clone();
            let name = format!("{}-vhost", device.name());
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || serve(Listener::from(listener), &name, &device, num_queues.max(1), serial, &control))?
        };
        Ok(VhostBlk { control, path: path.to_owned(), thread: Some(thread), remove_socket: true })
    }

    /// Leaves the socket file in place at [`VhostBlk::stop`]: its owner (a
    /// service manager that passed the listening socket) keeps it.
    pub fn keep_socket_file(mut self) -> VhostBlk {
        self.remove_socket = false;
        self
    }

    /// Disconnects the frontend (after the requests it already gave are
    /// answered), stops listening and removes the socket.
    pub fn stop(mut self) -> io::Result<()> {
        {
            let mut c = self.control.lock().unwrap();
            c.stopping = true;
            if let Some(h) = c.current.take() {
                h.shutdown();
            }
        }
        // Wakes the listener if it is waiting for a frontend; the loop sees
        // `stopping` and ends. (Refused is fine: the loop is already past accept.)
        let _ = UnixStream::connect(&self.path);
        let joined = self.thread.take().map(|t| t.join());
        if self.remove_socket {
            let _ = std::fs::remove_file(&self.path);
        }
        match joined {
            Some(Err(_)) => Err(io::Error::other("the vhost-user-blk thread panicked")),
            _ => Ok(()),
        }
    }
}

impl Drop for VhostBlk {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let t = VhostBlk {
                control: self.control.clone(),
                path: self.path.clone(),
                thread: self.thread.take(),
                remove_socket: self.remove_socket,
            };
            let _ = t.stop();
        }
    }
}

/// Accepts frontends one after another; each gets a fresh backend.
fn serve(
    mut listener: Listener,
    name: &str,
    device: &Arc<Device>,
    num_queues: u16,
    serial: [u8; config::ID_BYTES],
    control: &Mutex<Control>,
) {
    loop {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let shared = Arc::new(Shared {
            device: device.clone(),
            mem: Mutex::new(mem.clone()),
            writeback: AtomicBool::new(true),
            event_idx: AtomicBool::new(false),
            serial,
            zero_copy: true,
        });
        let backend = BlkBackend::new(shared, num_queues);
        let mut daemon = match VhostUserDaemon::new(name.to_owned(), backend.clone(), mem) {
            Ok(d) => d,
            Err(e) => {
                log::error!("{name}: cannot set up the vhost-user backend: {e}");
                return;
            }
        };
        let started = daemon.start(&mut listener);
        {
            let mut c = control.lock().unwrap();
            if c.stopping {
                daemon.request_shutdown();
                let _ = daemon.wait();
                return;
            }
            c.current = daemon.shutdown_handle();
        }
        if let Err(e) = started {
            log::warn!("{name}: accepting a vhost-user frontend failed: {e}");
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        log::info!("{name}: vhost-user frontend connected");
        match daemon.wait() {
            Ok(()) => log::info!("{name}: vhost-user frontend disconnected"),
            Err(e) => log::info!("{name}: vhost-user frontend gone: {e}"),
        }
        control.lock().unwrap().current = None;
        // Requests the engine still holds finish before the queues go away.
        backend.wait_idle();
        drop(daemon);
        if control.lock().unwrap().stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
