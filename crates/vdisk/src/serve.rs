//! `vdisk serve`: opens the images, starts a device (engine) per image, the
//! NBD listeners over them, and runs until SIGINT/SIGTERM. Shutdown order:
//! stop accepting, let connections finish their requests, flush every device,
//! remove the socket file.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_engine::{Device, EngineConfig, EngineKind};
use vdisk_image::RawImage;
use vdisk_nbd::{Export, Listener, Server, ServerOptions};

use crate::cli::{EngineArg, ServeArgs};
use crate::formats::{self, Opened};
use crate::Failure;

const DEMO_SIZE: u64 = 1 << 30;

pub fn run(a: ServeArgs) -> Result<(), Failure> {
    // Signals go to one thread that waits for them; block them before any thread starts.
    let signals = block_signals();
    // Declared first, so dropped (and removed) last, on every way out of this function.
    let demo = if a.images.is_empty() { Some(DemoImage::create()?) } else { None };
    let paths: Vec<PathBuf> = demo.iter().map(|d| d.image.clone()).chain(a.images.iter().cloned()).collect();

    let config = EngineConfig {
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
    let policy = crate::security::policy(&a.security)?;
    let tls_summary = policy.tls.as_ref().map(|t| t.summary.clone());
    let options =
        ServerOptions { batching: a.batch > 1, max_connections: a.max_connections.map(|n| n as usize), policy };
    let mut exports = Vec::new();
    if a.security.export_name.len() > paths.len() {
        return Err(Failure::usage(format!(
            "{} --export-name but {} image(s): give it at most once per image, in image order",
            a.security.export_name.len(),
            paths.len()
        )));
    }
    for (i, path) in paths.iter().enumerate() {
        let Opened { image, description } = formats::open(path, a.format, a.readonly, a.direct, &a.backing)?;
        if image.size() == 0 {
            return Err(Failure::usage(format!(
                "{} is empty: a disk needs a size (make one with `vdisk create IMAGE --size 10G`)",
                path.display()
            )));
        }
        let name = a.security.export_name.get(i).cloned().unwrap_or_else(|| export_name(path));
        if exports.iter().any(|e: &Export| e.name == name) {
            return Err(Failure::usage(format!(
                "two images would both be export {name:?} ({}); export names come from file stems: rename one or use --export-name",
                path.display()
            )));
        }
        let device = Device::start(&name, image, &config)
            .map_err(|e| Failure::runtime(format!("cannot start workers for {}: {e}", path.display())))?;
        exports.push(Export { name, description, device: Arc::new(device) });
    }

    for (flag, n) in [("--fuse", a.fuse.len()), ("--vhost-user-blk", a.vhost_user_blk.len())] {
        if n > exports.len() {
            return Err(Failure::usage(format!(
                "{n} {flag} paths but {} image(s): give {flag} at most once per image, in image order",
                exports.len()
            )));
        }
    }
    let mut listeners = Vec::new();
    let mut banner = Vec::new();
    // Other exports of the same devices. Declared before anything that can fail
    // below, so a failure stops (unmounts, closes) the ones already started.
    let mut frontends = Frontends(Vec::new());
    for (path, e) in a.fuse.iter().zip(&exports) {
        frontends.0.push(crate::fuse::start(path, &e.device, a.fuse_uring, &mut banner)?);
    }
    for (socket, e) in a.vhost_user_blk.iter().zip(&exports) {
        frontends.0.push(crate::vhost::start(socket, &e.device, a.num_queues, a.socket_mode, &mut banner)?);
    }
    let first = exports[0].name.clone();
    let others = !frontends.0.is_empty();
    let socket = match (&a.socket, &a.listen) {
        (Some(p), _) => Some(p.clone()),
        (None, None) if !others => Some(default_socket()),
        (None, _) => None,
    };
    if let Some(path) = &socket {
        listeners.push(Listener::Unix(bind_unix(path, a.socket_mode, "--socket")?, path.clone()));
        banner.push(format!("vdisk: listening on unix socket {}", path.display()));
        if tls_summary.is_some() {
            let uri = format!("nbds+unix:///{first}?socket={}", path.display());
            banner.push(format!("  try: nbdinfo '{uri}'  (with the client's TLS credentials: README, Security)"));
        } else {
            let uri = format!("nbd+unix:///{first}?socket={}", path.display());
            banner.push(format!("  try: nbdinfo '{uri}'"));
            banner.push(format!("       qemu-img info '{uri}'"));
        }
    }
    if let Some(addr) = &a.listen {
        let addr = parse_listen(addr)?;
        let l = TcpListener::bind(addr).map_err(|e| {
            Failure::usage(format!(
                "cannot listen on {addr}: {e} (is another server using the port? pick another with --listen HOST:PORT)"
            ))
        })?;
        listeners.push(Listener::Tcp(l));
        banner.push(format!("vdisk: listening on tcp {addr}"));
        let scheme = if tls_summary.is_some() { "nbds" } else { "nbd" };
        banner.push(format!("  try: nbdinfo {scheme}://{addr}/{first}"));
    }

    for e in &exports {
        let mode = if e.device.read_only() { "read-only" } else { "read-write" };
        let sync = format!("{}{}", if a.sync { ", sync" } else { "" }, if a.direct { ", O_DIRECT" } else { "" });
        let engine = match e.device.kind() {
            EngineKind::Uring => format!("io_uring engine, {} ring(s)", a.rings),
            EngineKind::Threads => format!("thread engine, {} workers", a.workers),
            EngineKind::Rbd => "librbd AIO engine".to_owned(),
        };
        println!("vdisk: export {:?}: {}, {mode}, {engine}{sync}", e.name, e.description);
    }
    if demo.is_some() {
        println!("vdisk: no image given: serving a fresh sparse 1 GiB demo image, removed at exit");
    }
    if let Some(t) = tls_summary {
        println!("vdisk: {t}");
    }
    for line in banner {
        println!("{line}");
    }
    println!("vdisk: stop with Ctrl-C (SIGINT) or SIGTERM");
    println!("vdisk: ready");

    let server =
        Server::new(exports, options).map_err(|e| Failure::runtime(format!("cannot start the server: {e}")))?;
    let stop = Arc::new(Stop::default());
    {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || wait_for_signals(signals, &server, &stop))
            .map_err(|e| Failure::runtime(format!("cannot start the signal thread: {e}")))?;
    }
    // Returns at once without listeners; the other exports run until the signal.
    let served = server.serve(listeners);
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    stop.wait();
    let mut failed = None;
    for (i, f) in std::mem::take(&mut frontends.0).into_iter().enumerate().rev() {
        if let Err(err) = f.stop() {
            failed = Some(Failure::runtime(format!("stopping export {i}: {err}")));
        }
    }
    // Every connection and export has finished: no request is in flight. Flush each device.
    for e in server.exports() {
        if let Err(err) = e.device.shutdown() {
            failed = Some(Failure::runtime(format!("flush of export {:?} failed at shutdown: {err}", e.name)));
        }
    }
    served.map_err(|e| Failure::runtime(format!("server failed: {e}")))?;
    log::info!("stopped cleanly");
    failed.map_or(Ok(()), Err)
}

/// The export name of an image: its file stem.
fn export_name(path: &Path) -> String {
    formats::export_name(path)
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "disk".into()))
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
fn parse_listen(s: &str) -> Result<SocketAddr, Failure> {
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
        .ok_or_else(|| Failure::usage(format!("--listen {s:?} is not HOST:PORT (e.g. 127.0.0.1:10809)")))
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
pub trait Frontend {
    /// Stops serving and releases what it holds (mount point, socket); requests
    /// already taken are answered first.
    fn stop(self: Box<Self>) -> Result<(), String>;
}

/// Started frontends; whatever is still here when dropped is stopped, last started first.
struct Frontends(Vec<Box<dyn Frontend>>);

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
fn wait_for_signals(set: libc::sigset_t, server: &Server, stop: &Stop) {
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
            server.stop();
            stop.trigger();
        } else {
            eprintln!("vdisk: second signal: quitting without waiting");
            std::process::exit(1);
        }
    }
}
