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
use std::time::Duration;

use vdisk_engine::{EngineConfig, EngineKind};
use vdisk_image::RawImage;
use vdisk_nbd::{Listener, Server, ServerOptions};

use crate::cli::{EngineArg, ServeArgs};
use crate::daemon::{export_name, Daemon, ExportSpec, Settings};
use crate::stopping::{StopProgress, Watchdog};
use crate::systemd::{Inherited, PidFile};
use crate::Failure;

const DEMO_SIZE: u64 = 1 << 30;

pub fn run(mut a: ServeArgs) -> Result<(), Failure> {
    let config = a.config.as_deref().map(crate::config::load).transpose()?;
    if let Some(c) = &config {
        crate::config::merge(&mut a, &c.server);
    }
    if a.check {
        return check(&a, config.as_ref());
    }
    // Before any other thread starts: the environment is read once, here.
    let mut pid_file = a.pid_file.as_deref().map(PidFile::lock).transpose()?;
    crate::systemd::init_notify();
    crate::systemd::init_listen_fds()?;
    // Signals go to one thread that waits for them; block them before any thread starts.
    let signals = block_signals();
    let daemon_mode = a.control.is_some() || config.is_some() || crate::systemd::has("control");
    // Declared first, so dropped (and removed) last, on every way out of this function.
    let demo = if a.images.is_empty() && !daemon_mode { Some(DemoImage::create()?) } else { None };
    let specs = export_specs(&a, demo.as_ref().map(|d| d.image.clone()))?;
    let policy = crate::security::policy(&a.security)?;
    crate::security::check_allow(&policy, specs.iter().chain(config.iter().flat_map(|c| &c.exports)))?;
    let tls = policy.tls.as_ref().map(|t| t.summary.clone());
    let options = server_options(&a, policy);
    let server =
        Server::new(Vec::new(), options).map_err(|e| Failure::runtime(format!("cannot start the server: {e}")))?;
    let daemon = Arc::new(Daemon::new(settings(&a)?, server.clone()));
    let mut banner = Vec::new();
    let started = start_exports(&daemon, specs, &mut banner)
        .and_then(|()| start_config(&daemon, config.as_ref(), &mut banner))
        .and_then(|()| Listeners::open(&a, &daemon, tls.is_some()));
    let listeners = match started {
        Ok(l) => l,
        Err(e) => {
            // Unmount and close what did start; its failures are logged, the first cause reported.
            if let Err(more) = daemon.shutdown(&StopProgress::default()) {
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
    if let Some(Err(e)) = pid_file.as_mut().map(PidFile::write_pid) {
        if let Err(more) = daemon.shutdown(&StopProgress::default()) {
            log::warn!("{more}");
        }
        return Err(e);
    }
    println!(
        "vdisk: stop with Ctrl-C (SIGINT) or SIGTERM{}",
        if config.is_some() { "; reload the config with SIGHUP" } else { "" }
    );
    println!("vdisk: ready");
    // Every listener is bound and listening: a client that connects now waits in its queue.
    crate::systemd::notify(&format!("READY=1\nMAINPID={}\nSTATUS={}", std::process::id(), daemon.status()));
    let limit = a.stop_timeout.unwrap_or(crate::stopping::DEFAULT_STOP_TIMEOUT);
    let mut remove: Vec<PathBuf> = listeners.socket.iter().cloned().collect();
    remove.extend(a.pid_file.iter().cloned());
    // A SIGHUP reload has the control requests' deadline.
    let reload = a.control_timeout.map_or(crate::control::DEFAULT_DEADLINE, |s| Duration::from_secs(s.into()));
    serve_until_signal(&server, &daemon, listeners, signals, (limit, remove, reload))
}

/// Clients served at once when --max-connections is not given.
const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Seconds a client may take no reply when --send-timeout is not given.
const DEFAULT_SEND_TIMEOUT: u64 = 60;

fn server_options(a: &ServeArgs, policy: vdisk_nbd::Policy) -> ServerOptions {
    let budget = a.max_buffer_memory.map_or_else(default_buffer_memory, |b| b as usize);
    ServerOptions {
        batching: a.batch > 1,
        max_connections: Some(a.max_connections.map_or(DEFAULT_MAX_CONNECTIONS, |n| n as usize)),
        max_buffer_memory: budget,
        send_timeout: std::time::Duration::from_secs(a.send_timeout.map_or(DEFAULT_SEND_TIMEOUT, u64::from)),
        policy,
    }
}

/// 1/8 of MemTotal (/proc/meminfo), at least 64 MiB; 1 GiB if it cannot be read.
fn default_buffer_memory() -> usize {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|kib| kib * 1024)
    });
    total.map_or(1 << 30, |t| (t / 8).max(64 << 20))
}

/// `--check`: everything start-up would check, without serving: the file, the
/// flags with it, TLS credentials, every image (opened read-only and closed).
fn check(a: &ServeArgs, config: Option<&crate::config::Config>) -> Result<(), Failure> {
    let policy = crate::security::policy(&a.security)?;
    crate::security::check_allow(&policy, export_specs(a, None)?.iter().chain(config.iter().flat_map(|c| &c.exports)))?;
    let cli = export_specs(a, None)?.into_iter().map(|s| (s, "the command line".to_owned()));
    let file = config
        .into_iter()
        .flat_map(|c| c.exports.iter().cloned().zip(c.lines.iter().map(move |l| format!("{}:{l}", c.path.display()))));
    let mut names = std::collections::HashSet::new();
    // The file's exports lie beneath the image roots, if any, as at start-up.
    let roots = settings(a)?.roots;
    let cli: Vec<_> = cli.map(|(s, at)| (s, at, None)).collect();
    let file = file.map(|(s, at)| (s, at, roots.clone()));
    for (spec, at, roots) in cli.into_iter().chain(file) {
        let name = spec.name.clone().unwrap_or_default();
        if !names.insert(name.clone()) {
            return Err(Failure::usage(format!(
                "{at}: export {name:?} is named on the command line and in the file: rename one (name = \"...\")"
            )));
        }
        let opened = vdisk_image::files::confined(roots, || {
            crate::formats::open(&spec.image, spec.format, true, false, &spec.backing)
        })
        .map_err(|e| Failure::usage(format!("{at}: export {name:?}: {e}")))?;
        if opened.image.size() == 0 {
            return Err(Failure::usage(format!(
                "{at}: export {name:?}: {} is empty (make a disk with `vdisk create IMAGE --size 10G`)",
                spec.image.display()
            )));
        }
    }
    let what = config.map_or_else(|| "the command line".into(), |c| c.path.display().to_string());
    println!("vdisk: {what}: OK, {} export{}", names.len(), if names.len() == 1 { "" } else { "s" });
    Ok(())
}

/// Adds the config file's exports and lets the daemon follow the file from now on.
fn start_config(
    daemon: &Daemon,
    config: Option<&crate::config::Config>,
    banner: &mut Vec<String>,
) -> Result<(), Failure> {
    let Some(c) = config else { return Ok(()) };
    for (spec, line) in c.exports.iter().zip(&c.lines) {
        // Beneath the image roots, if any, as what a reload adds later.
        let ticket = crate::daemon::Ticket::default();
        let notes = daemon.add_as(spec.clone(), crate::daemon::Origin::Request, &ticket).map_err(|r| {
            let name = spec.name.clone().unwrap_or_default();
            Failure::from(crate::daemon::Refusal {
                message: format!("{}:{line}: export {name:?}: {}", c.path.display(), r.message),
                ..r
            })
        })?;
        banner.extend(notes);
    }
    daemon.follow_config(crate::reload::Source::new(c));
    Ok(())
}

/// Serves until the first signal, then stops everything: NBD clients finish,
/// every export is stopped and flushed. Every failure on the way is reported.
/// The stop is bounded (`bound`: the limit, and files to remove if it is
/// reached, and the deadline of a SIGHUP reload): past it the watchdog ends
/// the process (crate::stopping). Reloads run on their own thread
/// (crate::reload::Reloader), so the signal thread is always free for SIGTERM.
fn serve_until_signal(
    server: &Arc<Server>,
    daemon: &Arc<Daemon>,
    listeners: Listeners,
    signals: libc::sigset_t,
    bound: (Duration, Vec<PathBuf>, Duration),
) -> Result<(), Failure> {
    let stop = Arc::new(Stop::default());
    {
        let (limit, remove, reload) = bound;
        let reloader = crate::reload::Reloader::start(daemon.clone(), reload)
            .map_err(|e| Failure::runtime(format!("cannot start the reload thread: {e}")))?;
        let (server, stop, daemon) = (server.clone(), stop.clone(), daemon.clone());
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || wait_for_signals(signals, (&server, &daemon, &reloader), &stop, (limit, remove)))
            .map_err(|e| Failure::runtime(format!("cannot start the signal thread: {e}")))?;
    }
    let Listeners { nbd, socket, control, metrics, .. } = listeners;
    // Accepts until the signal, then waits for the last connection to end:
    // beside the exports' stop below, which disconnects each export's clients.
    let serving = {
        let server = server.clone();
        std::thread::Builder::new()
            .name("nbd-serve".into())
            .spawn(move || server.serve(nbd))
            .map_err(|e| Failure::runtime(format!("cannot start the NBD server thread: {e}")))?
    };
    let watchdog = stop.wait();
    let progress = watchdog.progress();
    progress.phase("closing the control socket and the metrics endpoint");
    drop(control);
    drop(metrics);
    progress.phase("stopping the exports");
    let mut errors = Vec::new();
    if let Err(e) = daemon.shutdown(progress) {
        errors.push(format!("at shutdown: {e}"));
    }
    progress.phase("waiting for the last NBD connections to end");
    match serving.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => errors.insert(0, format!("server failed: {e}")),
        Err(_) => errors.insert(0, "the NBD server thread panicked".into()),
    }
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    watchdog.disarm();
    if errors.is_empty() {
        log::info!("stopped cleanly");
        Ok(())
    } else {
        Err(Failure::runtime(errors.join("; ")))
    }
}

fn settings(a: &ServeArgs) -> Result<Settings, Failure> {
    vdisk_engine::Core::configure(a.io_threads.map_or(0, usize::from));
    let engine = EngineConfig {
        kind: match a.engine.unwrap_or(EngineArg::Uring) {
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
    let roots = if a.image_roots.is_empty() {
        None
    } else {
        Some(Arc::new(vdisk_image::files::Roots::open(&a.image_roots).map_err(|e| Failure::usage(e.to_string()))?))
    };
    Ok(Settings { engine, direct: a.direct, socket_mode: a.socket_mode(), fuse_uring: a.fuse_uring, roots })
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
    let allow = crate::security::export_allow(&a.security.export_allow)?;
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
            allow: Vec::new(),
        });
    }
    for (name, pattern) in allow {
        let Some(spec) = specs.iter_mut().find(|s| s.name.as_deref() == Some(&name)) else {
            let names: Vec<_> = specs.iter().filter_map(|s| s.name.as_deref()).collect();
            return Err(Failure::usage(format!(
                "--export-allow {name}={pattern}: no export {name:?} on the command line (exports: {}); \
                 for exports of the config file, write allow = [...] in their [[export]]",
                if names.is_empty() { "none".to_owned() } else { names.join(", ") }
            )));
        };
        spec.allow.push(pattern);
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
        let first = daemon.names().into_iter().next().unwrap_or_else(|| "NAME".into());
        // Sockets from the service manager replace binding our own (README: Running under systemd).
        if !l.inherit_nbd(&first, tls)? {
            let others = !a.fuse.is_empty() || !a.vhost_user_blk.is_empty();
            l.socket = match (&a.socket, &a.listen) {
                (Some(p), _) => Some(p.clone()),
                (None, None) if !others => Some(default_socket()),
                (None, _) => None,
            };
            l.open_nbd(a, &first, tls)?;
        } else if a.socket.is_some() || a.listen.is_some() {
            log::info!("NBD sockets came from the service manager (LISTEN_FDS): socket/listen settings not bound");
        }
        l.open_control(a, daemon)?;
        let inherited = crate::systemd::listeners("metrics")?.into_iter().find_map(|i| match i {
            Inherited::Tcp(t) => Some(t),
            Inherited::Unix(..) => None,
        });
        let metrics = match (inherited, &a.metrics) {
            (Some(t), _) => Some(crate::metrics::MetricsServer::serve(t, daemon.clone())?),
            (None, Some(addr)) => Some(crate::metrics::MetricsServer::start(
                parse_listen(addr, "--metrics", "127.0.0.1:9100")?,
                daemon.clone(),
            )?),
            (None, None) => None,
        };
        if let Some(m) = &metrics {
            l.banner.push(format!("vdisk: metrics on http://{}/metrics", m.addr()));
        }
        l.metrics = metrics;
        Ok(l)
    }

    /// Takes the NBD sockets the service manager passed; false if there are none.
    fn inherit_nbd(&mut self, first: &str, tls: bool) -> Result<bool, Failure> {
        let scheme = if tls { "nbds" } else { "nbd" };
        for i in crate::systemd::listeners("nbd")? {
            match i {
                Inherited::Unix(l, path) => {
                    let path = path.unwrap_or_else(|| PathBuf::from("(unnamed)"));
                    self.banner
                        .push(format!("vdisk: listening on unix socket {} (from the service manager)", path.display()));
                    self.banner.push(format!("  try: nbdinfo '{scheme}+unix:///{first}?socket={}'", path.display()));
                    self.nbd.push(Listener::Unix(l, path));
                }
                Inherited::Tcp(t) => {
                    let addr = t.local_addr().map(|a| a.to_string()).unwrap_or_default();
                    self.banner.push(format!("vdisk: listening on tcp {addr} (from the service manager)"));
                    self.banner.push(format!("  try: nbdinfo {scheme}://{addr}/{first}"));
                    self.nbd.push(Listener::Tcp(t));
                }
            }
        }
        Ok(!self.nbd.is_empty())
    }

    fn open_control(&mut self, a: &ServeArgs, daemon: &Arc<Daemon>) -> Result<(), Failure> {
        let inherited = crate::systemd::listeners("control")?.into_iter().find_map(|i| match i {
            Inherited::Unix(l, Some(path)) => Some((l, path)),
            _ => None,
        });
        // The control socket's own mode and group: --socket-mode never applies to it.
        let policy = || -> Result<crate::control::Policy, Failure> {
            Ok(crate::control::Policy {
                access: crate::control::Access::new(a.control_mode, a.control_group.as_deref())?,
                deadline: a
                    .control_timeout
                    .map_or(crate::control::DEFAULT_DEADLINE, |s| std::time::Duration::from_secs(s.into())),
                roots: !a.image_roots.is_empty(),
            })
        };
        let (control, path, from) = match (inherited, &a.control) {
            (Some((l, path)), _) => {
                let c = crate::control::ControlSocket::inherited(l, &path, policy()?, daemon.clone())?;
                (c, path, " (from the service manager)")
            }
            (None, Some(path)) => {
                (crate::control::ControlSocket::start(path, policy()?, daemon.clone())?, path.clone(), "")
            }
            (None, None) => return Ok(()),
        };
        self.control = Some(control);
        self.banner.push(format!("vdisk: control socket {}{from}", path.display()));
        self.banner.push(format!("  try: vdisk ctl --control {} list", path.display()));
        Ok(())
    }

    fn open_nbd(&mut self, a: &ServeArgs, first: &str, tls: bool) -> Result<(), Failure> {
        if let Some(path) = &self.socket {
            self.nbd.push(Listener::Unix(bind_unix(path, a.socket_mode(), "--socket")?, path.clone()));
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
pub(crate) fn parse_listen(s: &str, flag: &str, example: &str) -> Result<SocketAddr, Failure> {
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
    // SAFETY: as above.
    unsafe { libc::sigaddset(&mut set, libc::SIGHUP) };
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

/// Set once by the signal thread (with the armed stop watchdog); the main thread waits for it.
#[derive(Default)]
struct Stop {
    stopped: std::sync::Mutex<Option<Watchdog>>,
    cond: std::sync::Condvar,
}

impl Stop {
    fn trigger(&self, watchdog: Watchdog) {
        *self.stopped.lock().unwrap() = Some(watchdog);
        self.cond.notify_all();
    }

    fn wait(&self) -> Watchdog {
        let stopped = self.stopped.lock().unwrap();
        self.cond.wait_while(stopped, |s| s.is_none()).unwrap().clone().expect("set before the wait ends")
    }
}

/// SIGHUP: reload the config. First SIGINT/SIGTERM: stop cleanly, within the
/// limit of `bound`; second: give up on what has not stopped yet (the watchdog
/// logs it and exits). Between signals, every few seconds, the status line for systemd.
fn wait_for_signals(
    set: libc::sigset_t,
    (server, daemon, reloader): (&Server, &Daemon, &crate::reload::Reloader),
    stop: &Stop,
    bound: (Duration, Vec<PathBuf>),
) {
    let (limit, remove) = bound;
    let mut watchdog = None;
    let mut count = 0;
    let mut status = String::new();
    loop {
        let timeout = libc::timespec { tv_sec: STATUS_EVERY, tv_nsec: 0 };
        // SAFETY: `set` is an initialised signal set, `timeout` a valid timespec; no siginfo asked for.
        let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
        if sig < 0 {
            if count == 0 && status != daemon.status() {
                status = daemon.status();
                crate::systemd::notify(&format!("STATUS={status}"));
            }
            continue;
        }
        if sig == libc::SIGHUP {
            // On the reload thread, under its deadline; logged there.
            reloader.request();
            continue;
        }
        count += 1;
        if count == 1 {
            log::warn!(
                "signal {sig}: finishing requests, flushing and stopping (within {}; again to quit at once)",
                crate::stopping::show(limit)
            );
            crate::systemd::notify("STOPPING=1\nSTATUS=stopping: finishing requests and flushing");
            let w = Watchdog::arm(limit, remove.clone());
            watchdog = Some(w.clone());
            // Requests waiting for QoS tokens are in flight too: let them finish now.
            daemon.lift_limits();
            server.stop();
            stop.trigger(w);
        } else if let Some(w) = &watchdog {
            log::warn!("second signal: giving up on what has not stopped yet");
            w.hurry();
        }
    }
}

/// Seconds between STATUS= updates (sent only when the line changed).
const STATUS_EVERY: libc::time_t = 5;
