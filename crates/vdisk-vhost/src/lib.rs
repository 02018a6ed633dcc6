//! The vhost-user-blk export: serves a device to a virtual machine (QEMU,
//! cloud-hypervisor, Firecracker) as its virtio-blk disk. The guest's queues
//! live in shared memory; each queue has its own worker thread which drains
//! every available request per kick, submits them to the device's engine as
//! one batch, and completes them as one batch with one notification.
//!
//! The `vhost` crate reads and writes the protocol's messages; this crate's
//! handler answers them (memory table, rings, config, inflight buffer) and
//! drives the rings with virtio-queue. It owns the virtio-blk part: the
//! request parser ([`parse`]), the config space ([`config`]), the request
//! path ([`queue`]) and inflight tracking ([`inflight`]), so that QEMU can
//! reconnect to a restarted backend and the requests in flight are served
//! again. It never touches the image: every request goes through the engine.
//!
//! One frontend at a time: when it disconnects, the socket is served again
//! and the next frontend gets the device from a clean state (except for what
//! the frontend's inflight buffer says).

pub mod config;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod handler;
pub mod inflight;
pub mod parse;
mod queue;
mod vring;

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vdisk_engine::Device;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use handler::BlkHandler;
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
    /// The connected frontend's socket and handler, if any.
    current: Option<(UnixStream, Arc<Mutex<BlkHandler>>)>,
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
                .spawn(move || serve(listener, &name, &device, num_queues.max(1), serial, &control))?
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
            if let Some((conn, handler)) = c.current.take() {
                // The requests taken are answered while the frontend still
                // listens (their interrupts arrive), no more are taken, and
                // only then the connection ends: a frontend that reconnects
                // to the next backend finds nothing in flight.
                let mut h = handler.lock().unwrap_or_else(|e| e.into_inner());
                h.shutdown();
                let _ = conn.shutdown(std::net::Shutdown::Both);
                drop(h);
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

/// Accepts frontends one after another; each gets a fresh handler.
fn serve(
    listener: UnixListener,
    name: &str,
    device: &Arc<Device>,
    num_queues: u16,
    serial: [u8; config::ID_BYTES],
    control: &Mutex<Control>,
) {
    loop {
        let stream = listener.accept().map(|(s, _)| s);
        if control.lock().unwrap().stopping {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("{name}: accepting a vhost-user frontend failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        let shared = Arc::new(Shared {
            device: device.clone(),
            mem: Mutex::new(GuestMemoryAtomic::new(GuestMemoryMmap::new())),
            writeback: AtomicBool::new(true),
            event_idx: AtomicBool::new(false),
            serial,
            zero_copy: true,
        });
        let handler = Arc::new(Mutex::new(BlkHandler::new(shared, num_queues, name)));
        let mut conn = BackendReqHandler::from_stream(stream, handler.clone());
        {
            let mut c = control.lock().unwrap();
            if c.stopping {
                return;
            }
            c.current = conn.try_clone_connection().ok().map(|sock| (sock, handler.clone()));
        }
        log::info!("{name}: vhost-user frontend connected");
        let end = loop {
            match conn.handle_request() {
                Ok(()) => {}
                // EINTR/EAGAIN: the vhost crate retries them itself while reading
                // a header and while sending; one that still comes back (from a
                // body read) ends nothing: serve the next message.
                Err(VuError::SocketRetry(e)) => log::debug!("{name}: vhost-user socket: {e}; going on"),
                Err(e) => break e,
            }
        };
        match end {
            VuError::Disconnected | VuError::PartialMessage => log::info!("{name}: vhost-user frontend disconnected"),
            e => log::info!("{name}: vhost-user frontend gone: {e}"),
        }
        control.lock().unwrap().current = None;
        // The rings stop, and requests the engine still holds finish (and reach
        // the used ring, the inflight log in step) before the memory goes away.
        handler.lock().unwrap_or_else(|e| e.into_inner()).shutdown();
        drop(conn);
        if control.lock().unwrap().stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
