//! The NBD export: serves devices to NBD clients over unix sockets and TCP.
//!
//! It owns the wire (handshake, request validation, reply encoding) and the
//! connections' threads; it never touches an image's files: every request
//! goes to the device's engine. One connection is a reader thread and a
//! writer thread; many connections to one export share one device, which is
//! what makes multi-conn safe (a FLUSH syncs the files all of them write).

mod conn;
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
mod outbox;
pub mod proto;
#[cfg(feature = "psk")]
pub mod psk;
mod reply;
mod stream;
pub mod tls;

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vdisk_engine::inflight::InFlight;
use vdisk_engine::Device;

pub use conn::MAX_INFLIGHT_BYTES;
pub use handshake::Policy;
pub use stream::Stream;
pub use tls::{CredentialError, CredentialErrorKind, Tls, TlsFiles, TlsMode};

/// A device as NBD clients see it.
pub struct Export {
    pub name: String,
    pub description: String,
    pub device: Arc<Device>,
}

/// A socket the server accepts clients on.
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Unix(l, _) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<Stream> {
        let stream = match self {
            Listener::Unix(l, _) => Stream::Unix(l.accept()?.0),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        };
        stream.set_buffer_sizes(SOCKET_BUFFER);
        Ok(stream)
    }
}

/// Socket buffer size asked for: room for several large requests and replies
/// per wake-up (the kernel caps it at net.core.[rw]mem_max).
const SOCKET_BUFFER: usize = 4 << 20;

/// How long a client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for clients to finish before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How the server runs its connections.
#[derive(Clone)]
pub struct ServerOptions {
    /// Submit everything one read brought as one batch and send all waiting
    /// replies with one write. Off only to measure what batching is worth.
    pub batching: bool,
    /// Clients served at once; one more is disconnected right after accept.
    pub max_connections: Option<usize>,
    /// TLS, export listing, the default export.
    pub policy: Policy,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions { batching: true, max_connections: None, policy: Policy::default() }
    }
}

pub struct Server {
    exports: Vec<Export>,
    options: ServerOptions,
    stopping: AtomicBool,
    /// Written once on stop; acceptors poll its read end.
    wake: (OwnedFd, OwnedFd),
    conns: Mutex<HashMap<u64, Stream>>,
    next_id: AtomicU64,
    /// Connections open (each counts as one in flight).
    live: InFlight,
}

impl Server {
    pub fn new(exports: Vec<Export>, options: ServerOptions) -> io::Result<Arc<Server>> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two fds into the array we pass; we own them from here on.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fds[0] was just created by pipe2 and is owned by nobody else.
        let read_end = unsafe { OwnedFd::from_raw_fd(fds[0]) };
        // SAFETY: the same for fds[1].
        let wake = (read_end, unsafe { OwnedFd::from_raw_fd(fds[1]) });
        Ok(Arc::new(Server {
            exports,
            options,
            stopping: AtomicBool::new(false),
            wake,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            live: InFlight::new(),
        }))
    }

    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// Accepts clients on every listener until [`Server::stop`]; then waits for
    /// the connections to finish their requests (cutting off, after a grace
    /// period, clients that do not read their replies) and returns.
    pub fn serve(self: &Arc<Self>, listeners: Vec<Listener>) -> io::Result<()> {
        let mut acceptors = Vec::new();
        for l in listeners {
            let me = self.clone();
            acceptors.push(std::thread::Builder::new().name("nbd-accept".into()).spawn(move || me.accept_loop(l))?);
        }
        for a in acceptors {
            let _ = a.join();
        }
        if !self.live.wait_idle_timeout(SHUTDOWN_GRACE) {
            log::warn!("clients still busy after {SHUTDOWN_GRACE:?}; disconnecting them");
            for s in self.conns.lock().unwrap().values() {
                s.shutdown(Shutdown::Both);
            }
            self.live.wait_idle();
        }
        Ok(())
    }

    /// Stops accepting and asks every connection to finish. Safe from any thread, repeatable.
    pub fn stop(&self) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: writes one byte from a valid buffer to the pipe we own.
        unsafe { libc::write(self.wake.1.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        for s in self.conns.lock().unwrap().values() {
            s.shutdown(Shutdown::Read);
        }
    }

    /// Number of connections open now.
    pub fn connections(&self) -> usize {
        self.live.counts().requests
    }

    fn accept_loop(self: Arc<Self>, listener: Listener) {
        let mut pfd = [
            libc::pollfd { fd: listener.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.wake.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        while !self.stopping.load(Ordering::SeqCst) {
            // SAFETY: pfd is a valid array of two pollfds for the duration of the call.
            let r = unsafe { libc::poll(pfd.as_mut_ptr(), 2, -1) };
            if r < 0 || pfd[1].revents != 0 {
                continue;
            }
            match listener.accept() {
                Ok(stream) => self.spawn_connection(stream),
                Err(e) if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) => {
                    log::warn!("cannot accept a client: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => log::debug!("accept: {e}"),
            }
        }
    }

    fn spawn_connection(self: &Arc<Self>, stream: Stream) {
        if let Some(max) = self.options.max_connections {
            if self.connections() >= max {
                log::warn!("{}: refused: already {max} clients, the most allowed", stream.peer());
                return;
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let Ok(handle) = stream.try_clone() else { return };
        self.conns.lock().unwrap().insert(id, handle);
        self.live.begin(1, 0);
        if self.stopping.load(Ordering::SeqCst) {
            stream.shutdown(Shutdown::Read);
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn({
            let me = me.clone();
            move || {
                me.connection(stream);
                me.forget(id);
            }
        });
        if let Err(e) = spawned {
            log::warn!("cannot start a thread for a client: {e}");
            me.forget(id);
        }
    }

    fn forget(&self, id: u64) {
        self.conns.lock().unwrap().remove(&id);
        self.live.end(1, 0);
    }

    fn connection(&self, mut stream: Stream) {
        let peer = stream.peer();
        let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let stopping = || self.stopping.load(Ordering::SeqCst);
        let neg = match handshake::handshake(&mut stream, &self.exports, &self.options.policy, &stopping) {
            Ok(neg) => neg,
            Err(handshake::HandshakeEnd::Violation(why)) => {
                log::warn!("{peer}: handshake failed: {why}; closing the connection");
                return;
            }
            Err(handshake::HandshakeEnd::Io(e)) => {
                log::info!("{peer}: handshake ended: {e}");
                return;
            }
            Err(handshake::HandshakeEnd::Aborted) => return,
        };
        let _ = stream.set_read_timeout(None);
        let export = &self.exports[neg.export];
        log::debug!("{peer}: connected to export {:?}{}", export.name, if stream.is_tls() { " over TLS" } else { "" });
        if let Err(e) = conn::transmission(stream, export.device.clone(), neg, self.options.batching) {
            if e.kind() == io::ErrorKind::InvalidData {
                log::warn!("{peer}: {e}; closing the connection");
            } else {
                log::info!("{peer}: connection ended: {e}");
            }
        }
    }
}
