//! `vdisk serve`: makes the daemon, asks it for one export per image on the
//! command line, opens the NBD listeners, the control socket and the metrics
//! endpoint, and runs until SIGINT/SIGTERM. Shutdown order: stop accepting,
//! let connections finish their requests, stop and flush every export (all
//! failures reported), remove the socket files.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_engine::{EngineConfig, EngineKind};
use vdisk_image::RawImage;
use vdisk_nbd::{Listener, Server, ServerOptions};

use crate::cli::{EngineArg, ServeArgs};
use crate::daemon::{export_name, Daemon, ExportSpec, Settings};
use crate::Failure;

const DEMO_SIZE: u64 = 1 << 30;

pub fn run(a: ServeArgs) -> Result<(), Failure> {
    // Signals go to one thread that waits for them; block them before any thread starts.
    let signals = block_signals();
    // Declared first, so dropped (and removed) last, on every way out of this function.
    let demo = if a.images.is_empty() && a.control.is_none() { Some(DemoImage::create()?) } else { None };
    let specs = export_specs(&a, demo.as_ref().map(|d| d.image.clone()))?;
    let policy = crate::security::policy(&a.security)?;
    let tls = policy.tls.as_ref().map(|t| t.summary.clone());
    let options =
        ServerOptions { batching: a.batch > 1, max_connections: a.max_connections.map(|n| n as usize), policy };
    let server =
        Server::new(Vec::new(), options).map_err(|e| Failure::runtime(format!("cannot start the server: {e}")))?;
    let daemon = Arc::new(Daemon::new(settings(&a), server.clone()));
    let mut banner = Vec::new();
    let started = start_exports(&daemon, specs, &mut banner).and_then(|()| Listeners::open(&a, &daemon, tls.is_some()));
    let listeners = match started {
        Ok(l) => l,
        Err(e) => {
            // Unmount and close what did start; its failures are logged, the first cause reported.
            if let Err(more) = daemon.shutdown() {
                log::warn!("{more}");
            }
            return Err(e);
        }
    };
    if demo.is_some() {
        banner.push("vdisk: no image given: serving a fresh sparse 1 GiB demo image, removed at exit".into());
    }
    if let Some(t) = tls {
        banner.push(format!("vdisk: {t}"));
    }
    for line in banner.iter().chain(listeners.banner.iter()) {
        println!("{line}");
    }
    println!("vdisk: stop with Ctrl-C (SIGINT) or SIGTERM");
    println!("vdisk: ready");
    serve_until_signal(&server, &daemon, listeners, signals)
}

/// Serves until the first signal, then stops everything: NBD clients finish,
/// every export is stopped and flushed. Every failure on the way is reported.
fn serve_until_signal(
    server: &Arc<Server>,
    daemon: &Arc<Daemon>,
    listeners: Listeners,
    signals: libc::sigset_t,
) -> Result<(), Failure> {
    let stop = Arc::new(Stop::default());
    {
        let (server, stop, daemon) = (server.clone(), stop.clone(), daemon.clone());
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || wait_for_signals(signals, &server, &daemon, &stop))
            .map_err(|e| Failure::runtime(format!("cannot start the signal thread: {e}")))?;
    }
    let Listeners { nbd, socket, control, metrics, .. } = listeners;
    // Returns at once without listeners; the other exports run until the signal.
    let served = server.serve(nbd);
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    stop.wait();
    drop(control);
    drop(metrics);
    let mut errors = Vec::new();
    if let Err(e) = served {
        errors.push(format!("server failed: {e}"));
    }
    if let Err(e) = daemon.shutdown() {
        errors.push(format!("at shutdown: {e}"));
    }
    if errors.is_empty() {
        log::info!("stopped cleanly");
        Ok(())
    } else {
        Err(Failure::runtime(errors.join("; ")))
    }
}

fn settings(a: &ServeArgs) -> Settings {
    let engine = EngineConfig {
        kind: match a.engine {
            EngineArg::Uring => EngineKind::Uring,
            EngineArg::Threads => EngineKind::Threads,
        },
        workers: a.workers as usize,
        rings: a.rings as usize,
        sqpoll: a.sqpoll,
        sync: a.sync,
        batch: a.batch as usize,
        coalesce: a.batch > 1,
        inline: !a.no_inline,
        ..Default::default()
    };
    Settings { engine, direct: a.direct, socket_mode: a.socket_mode, fuse_uring: a.fuse_uring }
}

/// The exports the command line asks for, checked against each other.
fn export_specs(a: &ServeArgs, demo: Option<PathBuf>) -> Result<Vec<ExportSpec>, Failure> {
    let paths: Vec<PathBuf> = demo.into_iter().chain(a.images.iter().cloned()).collect();
    for (flag, n) in [
        ("--export-name", a.security.export_name.len()),
        ("--fuse", a.fuse.len()),
        ("--vhost-user-blk", a.vhost_user_blk.len()),
    ] {
        if n > paths.len() {
            return Err(Failure::usage(format!(
                "{n} {flag} but {} image(s): give {flag} at most once per image, in image order",
                paths.len()
            )));
        }
    }
    let mut specs: Vec<ExportSpec> = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let name = a.security.export_name.get(i).cloned().unwrap_or_else(|| export_name(path));
        if specs.iter().any(|s| s.name.as_deref() == Some(&name)) {
            return Err(Failure::usage(format!(
                "two images would both be export {name:?} ({}); export names come from file stems: rename one or use --export-name",
                path.display()
            )));
        }
        specs.push(ExportSpec {
            image: path.clone(),
            name: Some(name),
            readonly: a.readonly,
            format: a.format,
            backing: a.backing.clone(),
            fuse: a.fuse.get(i).cloned(),
            vhost_user_blk: a.vhost_user_blk.get(i).cloned(),
            num_queues: a.num_queues,
            limits: Default::default(),
        });
    }
    Ok(specs)
}

fn start_exports(daemon: &Daemon, specs: Vec<ExportSpec>, banner: &mut Vec<String>) -> Result<(), Failure> {
    for spec in specs {
        banner.extend(daemon.add(spec)?);
    }
    Ok(())
}

/// Where the server listens: NBD sockets, the control socket, metrics.
struct Listeners {
    nbd: Vec<Listener>,
    /// The NBD unix socket file, removed at exit.
    socket: Option<PathBuf>,
    control: Option<crate::control::ControlSocket>,
    metrics: Option<crate::metrics::MetricsServer>,
    banner: Vec<String>,
}

impl Listeners {
    fn open(a: &ServeArgs, daemon: &Arc<Daemon>, tls: bool) -> Result<Listeners, Failure> {
        let mut l = Listeners { nbd: Vec::new(), socket: None, control: None, metrics: None, banner: Vec::new() };
        let others = !a.fuse.is_empty() || !a.vhost_user_blk.is_empty();
        l.socket = match (&a.socket, &a.listen) {
            (Some(p), _) => Some(p.clone()),
            (None, None) if !others => Some(default_socket()),
            (None, _) => None,
        };
        l.open_nbd(a, &daemon.names().into_iter().next().unwrap_or_else(|| "NAME".into()), tls)?;
        if let Some(path) = &a.control {
            l.control = Some(crate::control::ControlSocket::start(path, a.socket_mode, daemon.clone())?);
            l.banner.push(format!("vdisk: control socket {}", path.display()));
            l.banner.push(format!("  try: vdisk ctl --control {} list", path.display()));
        }
        if let Some(addr) = &a.metrics {
            let addr = parse_listen(addr, "--metrics", "127.0.0.1:9100")?;
            let metrics = crate::metrics::MetricsServer::start(addr, daemon.clone())?;
            l.banner.push(format!("vdisk: metrics on http://{}/metrics", metrics.addr()));
            l.metrics = Some(metrics);
        }
        Ok(l)
    }

    fn open_nbd(&mut self, a: &ServeArgs, first: &str, tls: bool) -> Result<(), Failure> {
        if let Some(path) = &self.socket {
            self.nbd.push(Listener::Unix(bind_unix(path, a.socket_mode, "--socket")?, path.clone()));
            self.banner.push(format!("vdisk: listening on unix socket {}", path.display()));
            if tls {
                let uri = format!("nbds+unix:///{first}?socket={}", path.display());
                self.banner
                    .push(format!("  try: nbdinfo '{uri}'  (with the client's TLS credentials: README, Security)"));
            } else {
                let uri = format!("nbd+unix:///{first}?socket={}", path.display());
                self.banner.push(format!("  try: nbdinfo '{uri}'"));
                self.banner.push(format!("       qemu-img info '{uri}'"));
            }
        }
        if let Some(addr) = &a.listen {
            let addr = parse_listen(addr, "--listen", "127.0.0.1:10809")?;
            let tcp = TcpListener::bind(addr).map_err(|e| {
                Failure::usage(format!(
                    "cannot listen on {addr}: {e} (is another server using the port? pick another with --listen HOST:PORT)"
                ))
            })?;
            self.nbd.push(Listener::Tcp(tcp));
            self.banner.push(format!("vdisk: listening on tcp {addr}"));
            let scheme = if tls { "nbds" } else { "nbd" };
            self.banner.push(format!("  try: nbdinfo {scheme}://{addr}/{first}"));
        }
        Ok(())
    }
}

fn default_socket() -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("vdisk-{}.sock", std::process::id()))
}

/// Binds a unix socket, replacing a stale socket file but never a live one or another kind of file.
/// The socket is created with `mode` from the start (through the umask), so
/// there is no moment at which others could connect.
pub(crate) fn bind_unix(path: &Path, mode: u32, flag: &str) -> Result<UnixListener, Failure> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Failure::usage(format!(
                "{} exists and is not a socket; choose another {flag} path",
                path.display()
            )));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(Failure::usage(format!(
                "{} is in use by another server; choose another {flag} path",
                path.display()
            )));
        }
        let _ = std::fs::remove_file(path);
    }
    // SAFETY: umask only swaps the process's file-creation mask; nothing else
    // creates files while the server starts.
    let old = unsafe { libc::umask(!mode & 0o777) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    bound.map_err(|e| Failure::usage(format!("cannot listen on unix socket {}: {e}", path.display())))
}

/// HOST:PORT, :PORT or PORT (host 127.0.0.1).
fn parse_listen(s: &str, flag: &str, example: &str) -> Result<SocketAddr, Failure> {
    let full = if let Some(port) = s.strip_prefix(':') {
        format!("127.0.0.1:{port}")
    } else if s.chars().all(|c| c.is_ascii_digit()) {
        format!("127.0.0.1:{s}")
    } else {
        s.to_owned()
    };
    full.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Failure::usage(format!("{flag} {s:?} is not HOST:PORT (e.g. {example})")))
}

/// A fresh sparse demo image, export "demo", in its own temp directory,
/// removed when this is dropped.
struct DemoImage {
    dir: PathBuf,
    image: PathBuf,
}

impl DemoImage {
    fn create() -> Result<DemoImage, Failure> {
        let dir = std::env::temp_dir().join(format!("vdisk-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Failure::runtime(format!("cannot create {}: {e}", dir.display())))?;
        let demo = DemoImage { image: dir.join("demo.img"), dir };
        let _ = std::fs::remove_file(&demo.image);
        RawImage::create(&demo.image, DEMO_SIZE, None)?;
        Ok(demo)
    }
}

impl Drop for DemoImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, for which all zeros is a valid value.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t we own (likewise below).
    unsafe { libc::sigemptyset(&mut set) };
    // SAFETY: as above.
    unsafe { libc::sigaddset(&mut set, libc::SIGINT) };
    // SAFETY: as above.
    unsafe { libc::sigaddset(&mut set, libc::SIGTERM) };
    // SAFETY: changes only this thread's mask (inherited by threads it starts).
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    set
}

/// An export beside NBD (FUSE, vhost-user-blk) over the same devices.
pub trait Frontend: Send {
    /// Stops serving and releases what it holds (mount point, socket); requests
    /// already taken are answered first.
    fn stop(self: Box<Self>) -> Result<(), String>;
}

/// Started frontends; whatever is still here when dropped is stopped, last started first.
pub struct Frontends(pub Vec<Box<dyn Frontend>>);

impl Drop for Frontends {
    fn drop(&mut self) {
        while let Some(f) = self.0.pop() {
            if let Err(e) = f.stop() {
                log::warn!("{e}");
            }
        }
    }
}

/// Set once by the signal thread; the main thread waits for it.
#[derive(Default)]
struct Stop {
    stopped: std::sync::Mutex<bool>,
    cond: std::sync::Condvar,
}

impl Stop {
    fn trigger(&self) {
        *self.stopped.lock().unwrap() = true;
        self.cond.notify_all();
    }

    fn wait(&self) {
        let stopped = self.stopped.lock().unwrap();
        drop(self.cond.wait_while(stopped, |s| !*s).unwrap());
    }
}

/// First signal: stop cleanly. Second: give up at once.
fn wait_for_signals(set: libc::sigset_t, server: &Server, daemon: &Daemon, stop: &Stop) {
    let mut count = 0;
    loop {
        let mut sig = 0;
        // SAFETY: `set` is an initialised signal set and `sig` a valid out-pointer.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            continue;
        }
        count += 1;
        if count == 1 {
            eprintln!("vdisk: signal {sig}: finishing requests, flushing and stopping (again to quit at once)");
            // Requests waiting for QoS tokens are in flight too: let them finish now.
            daemon.lift_limits();
            server.stop();
            stop.trigger();
        } else {
            eprintln!("vdisk: second signal: quitting without waiting");
            std::process::exit(1);
        }
    }
}
