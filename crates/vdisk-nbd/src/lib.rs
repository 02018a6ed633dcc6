//! The NBD export: serves devices to NBD clients over unix sockets and TCP.
//!
//! It owns the wire (handshake, request validation, reply encoding) and the
//! connections' threads; it never touches an image's files: every request
//! goes to the device's engine. One connection is a reader thread and a
//! writer thread; many connections to one export share one device, which is
//! what makes multi-conn safe (a FLUSH syncs the files all of them write).

pub mod allow;
pub mod budget;
pub mod client;
mod conn;
mod engine;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
pub mod meta;
mod outbox;
pub mod proto;
#[cfg(feature = "psk")]
pub mod psk;
pub mod remote;
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
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use budget::{Account, Budget};
use vdisk_engine::inflight::InFlight;
use vdisk_engine::Device;

pub use conn::MAX_INFLIGHT_BYTES;
pub use handshake::Policy;
pub use stream::Stream;
pub use tls::{CredentialError, CredentialErrorKind, Tls, TlsFiles, TlsMode};

/// A device as NBD clients see it.
#[derive(Clone)]
pub struct Export {
    pub name: String,
    pub description: String,
    pub device: Arc<Device>,
    /// Who may open it (TLS identities); empty: every client.
    pub allow: allow::Allow,
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

    fn accept(&self, buffer: usize) -> io::Result<Stream> {
        let stream = match self {
            Listener::Unix(l, _) => Stream::Unix(l.accept()?.0),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        };
        stream.set_buffer_sizes(buffer);
        set_send_timeout(&stream, SEND_WAKE);
        Ok(stream)
    }
}

/// Socket buffer size asked for: room for several large requests and replies
/// per wake-up (the kernel caps it at net.core.[rw]mem_max). Smaller when the
/// memory budget shared by `max_connections` clients is: the kernel's buffers
/// (twice what is asked) are memory a client can pin too.
const SOCKET_BUFFER: usize = 4 << 20;
const MIN_SOCKET_BUFFER: usize = 128 << 10;

/// A blocking send returns at least this often, so a writer on a socket that
/// takes nothing shows it ([`budget::Budget::stalled_ms`]).
/// It is also how long a writer waits on a socket that takes nothing before
/// it parks (drops the data of unsent read replies, read again later).
pub(crate) const SEND_WAKE: Duration = Duration::from_millis(100);

fn set_send_timeout(stream: &Stream, t: Duration) {
    let tv = libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as libc::suseconds_t };
    // SAFETY: setsockopt reads a timeval from a valid pointer for the given length.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
}

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
    /// Bytes all connections together may hold in request and reply buffers.
    pub max_buffer_memory: usize,
    /// A client whose replies the socket has not taken for this long is disconnected.
    pub send_timeout: Duration,
    /// TLS, export listing, the default export.
    pub policy: Policy,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            batching: true,
            max_connections: None,
            max_buffer_memory: 1 << 30,
            send_timeout: Duration::from_secs(60),
            policy: Policy::default(),
        }
    }
}

/// An open connection: a handle to shut it, and once its handshake chose one,
/// its export's name and the export's count of connections.
struct Conn {
    stream: Stream,
    export: Option<(String, Arc<InFlight>)>,
    /// Its standing against the memory budget; its writer's stalls.
    account: Arc<Account>,
}

pub struct Server {
    /// Exports come and go while the server runs ([`Server::add_export`],
    /// [`Server::remove_export`]); a handshake works on a copy of the list.
    exports: RwLock<Vec<Export>>,
    options: ServerOptions,
    stopping: AtomicBool,
    /// Written once on stop; acceptors poll its read end.
    wake: (OwnedFd, OwnedFd),
    conns: Mutex<HashMap<u64, Conn>>,
    next_id: AtomicU64,
    /// Connections open (each counts as one in flight).
    live: InFlight,
    /// Set once `serve` is done: the send watchdog stops.
    watchdog_done: AtomicBool,
    /// Connections open per export name, for [`Server::disconnect`].
    trackers: Mutex<HashMap<String, Arc<InFlight>>>,
    /// Request and reply buffers of every connection together.
    budget: Arc<Budget>,
    /// Socket buffer size asked for each client.
    socket_buffer: usize,
    /// The bitmaps each export serves as `qemu:dirty-bitmap:NAME`, by export name.
    bitmaps: RwLock<HashMap<String, meta::ServedBitmaps>>,
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
        let budget = Arc::new(Budget::new(options.max_buffer_memory));
        let socket_buffer = options
            .max_connections
            .map_or(SOCKET_BUFFER, |n| (options.max_buffer_memory / n.max(1)).clamp(MIN_SOCKET_BUFFER, SOCKET_BUFFER));
        Ok(Arc::new(Server {
            exports: RwLock::new(exports),
            options,
            budget,
            socket_buffer,
            stopping: AtomicBool::new(false),
            wake,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            live: InFlight::new(),
            watchdog_done: AtomicBool::new(false),
            trackers: Mutex::new(HashMap::new()),
            bitmaps: RwLock::new(HashMap::new()),
        }))
    }

    /// Every client that completes TLS is identified (client certificates or
    /// PSK): export allow lists can work.
    pub fn identifies_clients(&self) -> bool {
        self.options.policy.tls.as_ref().is_some_and(|t| t.identifies_clients())
    }

    /// Serves `bitmaps` (name, bitmap) as the `qemu:dirty-bitmap:NAME` meta
    /// contexts of export `export` to clients that connect from now on (an
    /// empty list serves none). Kept by export name: whoever removes an
    /// export clears its bitmaps too.
    pub fn set_bitmaps(&self, export: &str, bitmaps: Vec<(String, Arc<vdisk_image::bitmap::DirtyBitmap>)>) {
        let mut all = self.bitmaps.write().unwrap();
        if bitmaps.is_empty() {
            all.remove(export);
        } else {
            all.insert(export.to_owned(), bitmaps.into());
        }
    }

    /// The exports served now.
    pub fn exports(&self) -> Vec<Export> {
        self.exports.read().unwrap().clone()
    }

    /// Serves one more export on every listener; a name already served is refused.
    pub fn add_export(&self, export: Export) -> Result<(), Export> {
        let mut exports = self.exports.write().unwrap();
        if exports.iter().any(|e| e.name == export.name) {
            return Err(export);
        }
        exports.push(export);
        Ok(())
    }

    /// Stops offering export `name` to new clients; connected ones go on
    /// until [`Server::disconnect`]. Returns the export and where it was in
    /// the list, if it was served.
    pub fn remove_export(&self, name: &str) -> Option<(usize, Export)> {
        let mut exports = self.exports.write().unwrap();
        let at = exports.iter().position(|e| e.name == name)?;
        Some((at, exports.remove(at)))
    }

    /// Puts back an export [`Server::remove_export`] took, at its place (the
    /// first export is the default one).
    pub fn restore_export(&self, at: usize, export: Export) {
        let mut exports = self.exports.write().unwrap();
        let at = at.min(exports.len());
        exports.insert(at, export);
    }

    /// Clients connected to export `name` now.
    pub fn connections_to(&self, name: &str) -> usize {
        self.trackers.lock().unwrap().get(name).map_or(0, |t| t.counts().requests)
    }

    /// Disconnects every client of export `name` the way [`Server::stop`]
    /// does (no more requests are read; those read are answered) and waits
    /// until they are gone. Remove the export first, or new clients may come.
    pub fn disconnect(&self, name: &str) {
        let Some(tracker) = self.trackers.lock().unwrap().get(name).cloned() else { return };
        let shut = |how| {
            let conns = self.conns.lock().unwrap();
            for c in conns.values().filter(|c| c.export.as_ref().is_some_and(|(n, _)| n == name)) {
                c.stream.shutdown(how);
            }
        };
        shut(Shutdown::Read);
        if !tracker.wait_idle_timeout(SHUTDOWN_GRACE) {
            log::warn!("clients of export {name:?} still busy after {SHUTDOWN_GRACE:?}; cutting them off");
            shut(Shutdown::Both);
            tracker.wait_idle();
        }
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
        let watchdog = {
            let me = self.clone();
            std::thread::Builder::new().name("nbd-watchdog".into()).spawn(move || me.watch_senders())?
        };
        for a in acceptors {
            let _ = a.join();
        }
        if !self.live.wait_idle_timeout(SHUTDOWN_GRACE) {
            log::warn!("clients still busy after {SHUTDOWN_GRACE:?}; disconnecting them");
            for c in self.conns.lock().unwrap().values() {
                c.stream.shutdown(Shutdown::Both);
            }
            self.live.wait_idle();
        }
        self.watchdog_done.store(true, Ordering::SeqCst);
        let _ = watchdog.join();
        Ok(())
    }

    /// Disconnects clients that take no reply for the send timeout (a sixth of
    /// it while others wait for the memory budget); their requests still run
    /// to their end (writes complete), replies are dropped.
    fn watch_senders(&self) {
        let full = self.options.send_timeout.as_millis() as u64;
        let tick = (self.options.send_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut last = usize::MAX;
        while !self.watchdog_done.load(Ordering::SeqCst) {
            std::thread::sleep(tick);
            let used = self.budget.used();
            if used != last {
                log::debug!(
                    "buffer budget: {} of {} MiB held, {} clients",
                    used >> 20,
                    self.budget.max() >> 20,
                    self.connections()
                );
                last = used;
            }
            let pressed = self.budget.waiting() > 0;
            let timeout = if pressed { full / 6 } else { full };
            for c in self.conns.lock().unwrap().values() {
                let stalled = self.budget.stalled_ms(&c.account);
                if stalled > timeout {
                    let why = if pressed { ", while others wait for the memory budget" } else { "" };
                    log::warn!(client:% = c.stream.peer();
                        "{}: took none of its replies for {:.1} s (--send-timeout {} s{why}); disconnecting it \
                         ({} bytes of replies dropped, its requests still complete)",
                        c.stream.peer(), stalled as f64 / 1000.0, full / 1000, c.account.held());
                    c.stream.shutdown(Shutdown::Both);
                    self.budget.idle(&c.account);
                }
            }
        }
    }

    /// The server-wide memory budget (for metrics and tests).
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Stops accepting and asks every connection to finish. Safe from any thread, repeatable.
    pub fn stop(&self) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: writes one byte from a valid buffer to the pipe we own.
        unsafe { libc::write(self.wake.1.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        for c in self.conns.lock().unwrap().values() {
            c.stream.shutdown(Shutdown::Read);
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
            // EINTR (r < 0) polls again; std's accept below retries EINTR itself.
            let r = unsafe { libc::poll(pfd.as_mut_ptr(), 2, -1) };
            if r < 0 || pfd[1].revents != 0 {
                continue;
            }
            match listener.accept(self.socket_buffer) {
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
                log::warn!(client:% = stream.peer(); "{}: refused: already {max} clients, the most allowed", stream.peer());
                return;
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let Ok(handle) = stream.try_clone() else { return };
        let account = Account::new();
        self.conns.lock().unwrap().insert(id, Conn { stream: handle, export: None, account: account.clone() });
        self.live.begin(1, 0);
        if self.stopping.load(Ordering::SeqCst) {
            stream.shutdown(Shutdown::Read);
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn({
            let me = me.clone();
            move || {
                // The thread's panic edge (the handshake, or what the transmission's own
                // edge let through): this client's socket is shut, others go on.
                if let Err(p) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.connection(stream, id, account)))
                {
                    me.panicked(id, &conn::panic_text(&*p));
                }
                me.forget(id);
            }
        });
        if let Err(e) = spawned {
            log::warn!("cannot start a thread for a client: {e}");
            me.forget(id);
        }
    }

    /// Connection `id` panicked: one error line naming the export, the client
    /// and the cause, and its socket shut so the client sees the end at once.
    fn panicked(&self, id: u64, why: &str) {
        let conns = self.conns.lock().unwrap();
        let Some(c) = conns.get(&id) else { return };
        let peer = c.stream.peer();
        let export = c.export.as_ref().map_or("(none chosen yet)", |(name, _)| name.as_str());
        log::error!(client:% = peer, export:% = export; "{peer}: export {export:?}: a panic while serving it: {why}; closing the connection");
        c.stream.shutdown(Shutdown::Both);
    }

    fn forget(&self, id: u64) {
        if let Some(Conn { export: Some((_, of_export)), .. }) = self.conns.lock().unwrap().remove(&id) {
            of_export.end(1, 0);
        }
        self.live.end(1, 0);
    }

    /// Marks connection `id` as a client of `export`, unless the export was
    /// removed since the handshake chose it (then the client is turned away).
    fn attach(&self, id: u64, export: &Export) -> bool {
        let exports = self.exports.read().unwrap();
        if !exports.iter().any(|e| e.name == export.name && Arc::ptr_eq(&e.device, &export.device)) {
            return false;
        }
        let mut trackers = self.trackers.lock().unwrap();
        let tracker = trackers.entry(export.name.clone()).or_insert_with(|| Arc::new(InFlight::new()));
        if let Some(c) = self.conns.lock().unwrap().get_mut(&id) {
            tracker.begin(1, 0);
            c.export = Some((export.name.clone(), tracker.clone()));
        }
        true
    }

    fn connection(&self, mut stream: Stream, id: u64, account: Arc<Account>) {
        let peer = stream.peer();
        let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let stopping = || self.stopping.load(Ordering::SeqCst);
        let exports = self.exports();
        let bitmaps: Vec<meta::ServedBitmaps> = {
            let all = self.bitmaps.read().unwrap();
            exports.iter().map(|e| all.get(&e.name).cloned().unwrap_or_else(|| Arc::new([]))).collect()
        };
        let neg =
            match handshake::handshake_with_bitmaps(&mut stream, &exports, &bitmaps, &self.options.policy, &stopping) {
                Ok(neg) => neg,
                Err(handshake::HandshakeEnd::Violation(why)) => {
                    log::warn!(client:% = peer; "{peer}: handshake failed: {why}; closing the connection");
                    return;
                }
                Err(handshake::HandshakeEnd::Io(e)) => {
                    log::info!(client:% = peer; "{peer}: handshake ended: {e}");
                    return;
                }
                Err(handshake::HandshakeEnd::Aborted) => return,
            };
        let _ = stream.set_read_timeout(None);
        let export = &exports[neg.export];
        if !self.attach(id, export) {
            log::info!(client:% = peer, export:% = export.name; "{peer}: export {:?} was removed during the handshake; closing the connection", export.name);
            return;
        }
        log::debug!(client:% = peer, export:% = export.name; "{peer}: connected to export {:?}{}", export.name, if stream.is_tls() { " over TLS" } else { "" });
        let budget = self.budget.clone();
        if let Err(e) = conn::transmission(stream, export.device.clone(), neg, self.options.batching, budget, account) {
            if e.get_ref().is_some_and(|inner| inner.is::<conn::Panicked>()) {
                log::error!(client:% = peer, export:% = export.name; "{peer}: export {:?}: {e}; closed the connection", export.name);
            } else if e.kind() == io::ErrorKind::InvalidData {
                log::warn!(client:% = peer, export:% = export.name; "{peer}: {e}; closing the connection");
            } else {
                log::info!(client:% = peer, export:% = export.name; "{peer}: connection ended: {e}");
            }
        }
    }
}

#[cfg(test)]
mod meta_tests;
#[cfg(test)]
mod tests;
