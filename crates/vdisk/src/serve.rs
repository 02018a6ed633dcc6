//! `vdisk serve`: makes the daemon, asks it for one export per image on the
//! command line, opens the NBD listeners, the control socket and the metrics
//! endpoint, and runs until SIGINT/SIGTERM. Shutdown order: stop accepting,
//! let connections finish their requests, stop and flush every export (all
//! failures reported), remove the socket files.

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use vdisk_control::{ControlSocket, Served};
use vdisk_daemon::config::Config;
use vdisk_daemon::listen::{bind_unix, parse_listen};
use vdisk_daemon::metrics::MetricsServer;
use vdisk_daemon::reload::{Reloader, Source};
use vdisk_daemon::spec::export_name;
use vdisk_daemon::stopping::{StopProgress, Watchdog};
use vdisk_daemon::systemd::{self, Inherited, PidFile};
use vdisk_daemon::{security, Daemon, Error, ExportSpec, Origin, Reload, Settings, Ticket};
use vdisk_engine::{EngineConfig, EngineKind};
use vdisk_image::RawImage;
use vdisk_nbd::{Listener, Server, ServerOptions};

use crate::cli::{EngineArg, ServeArgs};
use crate::merge::{image_format, tls_settings};

const DEMO_SIZE: u64 = 1 << 30;

pub fn run(mut a: ServeArgs) -> Result<(), Error> {
    let config = a.config.as_deref().map(vdisk_daemon::config::load).transpose()?;
    if let Some(c) = &config {
        crate::merge::merge(&mut a, &c.server);
    }
    if a.check {
        return check(&a, config.as_ref());
    }
    raise_fd_limit();
    // Before any other thread starts: the environment is read once, here.
    let mut pid_file = a.pid_file.as_deref().map(PidFile::lock).transpose()?;
    systemd::init_notify();
    systemd::init_listen_fds()?;
    // Signals go to one thread that waits for them; block them before any thread starts.
    let signals = block_signals();
    let daemon_mode = a.control.is_some() || config.is_some() || systemd::has("control");
    // Declared first, so dropped (and removed) last, on every way out of this function.
    let demo = if a.images.is_empty() && !daemon_mode { Some(DemoImage::create()?) } else { None };
    let specs = export_specs(&a, demo.as_ref().map(|d| d.image.clone()))?;
    let policy = security::policy(&tls_settings(&a.security))?;
    security::check_allow(&policy, specs.iter().chain(config.iter().flat_map(|c| &c.exports)))?;
    let tls = policy.tls.as_ref().map(|t| t.summary.clone());
    let options = server_options(&a, policy);
    let server = Server::new(Vec::new(), options).map_err(|e| Error::failed("cannot start the server").because(e))?;
    let daemon = Arc::new(Daemon::new(settings(&a)?, server.clone()));
    let served = Served { daemon: daemon.clone(), reload: Arc::new(Reload::new(daemon.clone())) };
    let mut banner = Vec::new();
    let started = start_exports(&daemon, specs, &mut banner)
        .and_then(|()| start_config(&served, config.as_ref(), &mut banner))
        .and_then(|()| Listeners::open(&a, &served, tls.is_some()));
    let listeners = match started {
        Ok(l) => l,
        Err(e) => {
            // Unmount and close what did start; its failures are logged, the first cause reported.
            if let Err(more) = daemon.shutdown(&StopProgress::default()) {
                log::warn!("{}", more.report());
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
            log::warn!("{}", more.report());
        }
        return Err(e);
    }
    println!(
        "vdisk: stop with Ctrl-C (SIGINT) or SIGTERM{}",
        if config.is_some() { "; reload the config with SIGHUP" } else { "" }
    );
    println!("vdisk: ready");
    // Every listener is bound and listening: a client that connects now waits in its queue.
    systemd::notify(&format!("READY=1\nMAINPID={}\nSTATUS={}", std::process::id(), daemon.status()));
    let limit = a.stop_timeout.unwrap_or(vdisk_daemon::stopping::DEFAULT_STOP_TIMEOUT);
    let mut remove: Vec<PathBuf> = listeners.socket.iter().cloned().collect();
    remove.extend(a.pid_file.iter().cloned());
    // A SIGHUP reload has the control requests' deadline.
    let deadline = a.control_timeout.map_or(vdisk_control::DEFAULT_DEADLINE, |s| Duration::from_secs(s.into()));
    serve_until_signal(&server, &served, listeners, signals, (limit, remove, deadline))
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
fn check(a: &ServeArgs, config: Option<&Config>) -> Result<(), Error> {
    let policy = security::policy(&tls_settings(&a.security))?;
    security::check_allow(&policy, export_specs(a, None)?.iter().chain(config.iter().flat_map(|c| &c.exports)))?;
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
            return Err(Error::invalid(format!(
                "{at}: export {name:?} is named on the command line and in the file: rename one (name = \"...\")"
            )));
        }
        let options = vdisk_image::OpenOptions { read_only: true, ..spec.open_options(false) };
        let opened = vdisk_image::files::confined(roots, || vdisk_daemon::formats::open(&spec.image, &options))
            .map_err(|e| Error::invalid(format!("{at}: export {name:?}: {}", e.report())))?;
        if opened.image.size() == 0 {
            return Err(Error::invalid(format!(
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
fn start_config(served: &Served, config: Option<&Config>, banner: &mut Vec<String>) -> Result<(), Error> {
    let Some(c) = config else { return Ok(()) };
    for (spec, line) in c.exports.iter().zip(&c.lines) {
        // Beneath the image roots, if any, as what a reload adds later.
        let ticket = Ticket::default();
        let notes = served.daemon.add_as(spec.clone(), Origin::Request, &ticket).map_err(|e| {
            let name = spec.name.clone().unwrap_or_default();
            e.context(format_args!("{}:{line}: export {name:?}", c.path.display()))
        })?;
        banner.extend(notes);
    }
    served.reload.follow(Source::new(c));
    Ok(())
}

/// Serves until the first signal, then stops everything: NBD clients finish,
/// every export is stopped and flushed. Every failure on the way is reported.
/// The stop is bounded (`bound`: the limit, and files to remove if it is
/// reached, and the deadline of a SIGHUP reload): past it the watchdog ends
/// the process (vdisk_daemon::stopping). Reloads run on their own thread
/// ([`Reloader`]), so the signal thread is always free for SIGTERM.
fn serve_until_signal(
    server: &Arc<Server>,
    served: &Served,
    listeners: Listeners,
    signals: libc::sigset_t,
    bound: (Duration, Vec<PathBuf>, Duration),
) -> Result<(), Error> {
    let stop = Arc::new(Stop::default());
    {
        let (limit, remove, reload) = bound;
        let reloader = Reloader::start(served.reload.clone(), reload)
            .map_err(|e| Error::failed("cannot start the reload thread").because(e))?;
        let (server, stop, daemon) = (server.clone(), stop.clone(), served.daemon.clone());
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || wait_for_signals(signals, (&server, &daemon, &reloader), &stop, (limit, remove)))
            .map_err(|e| Error::failed("cannot start the signal thread").because(e))?;
    }
    let Listeners { nbd, socket, control, metrics, .. } = listeners;
    // Accepts until the signal, then waits for the last connection to end:
    // beside the exports' stop below, which disconnects each export's clients.
    let serving = {
        let server = server.clone();
        std::thread::Builder::new()
            .name("nbd-serve".into())
            .spawn(move || server.serve(nbd))
            .map_err(|e| Error::failed("cannot start the NBD server thread").because(e))?
    };
    let watchdog = stop.wait();
    let progress = watchdog.progress();
    progress.phase("closing the control socket and the metrics endpoint");
    drop(control);
    drop(metrics);
    progress.phase("stopping the exports");
    let mut errors = Vec::new();
    if let Err(e) = served.daemon.shutdown(progress) {
        errors.push(format!("at shutdown: {}", e.report()));
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
        Err(Error::failed(errors.join("; ")))
    }
}

/// A server of thousands of exports holds a descriptor per image file (more
/// for an overlay or a qcow2 backing chain) and per connection: more than the
/// usual soft limit of 1024. The soft limit is raised to the hard one, which
/// only the administrator sets (`ulimit -Hn`, systemd's `LimitNOFILE=`).
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed to it.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return log::debug!("cannot read the descriptor limit: {}", std::io::Error::last_os_error());
    }
    if r.rlim_cur < r.rlim_max {
        let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
        // SAFETY: setrlimit only reads the struct passed to it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            let e = std::io::Error::last_os_error();
            return log::debug!("descriptor limit {} (hard {}): raising it failed: {e}", r.rlim_cur, r.rlim_max);
        }
        log::debug!("descriptor limit raised from {} to the hard limit {}", r.rlim_cur, r.rlim_max);
    } else {
        log::debug!("descriptor limit {} (the hard limit)", r.rlim_cur);
    }
}

fn settings(a: &ServeArgs) -> Result<Settings, Error> {
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
        Some(Arc::new(
            vdisk_image::files::Roots::open(&a.image_roots)
                .map_err(|e| Error::image(vdisk_daemon::ErrorKind::Invalid, &e))?,
        ))
    };
    Ok(Settings { engine, direct: a.direct, socket_mode: a.socket_mode(), fuse_uring: a.fuse_uring, roots })
}

/// The exports the command line asks for, checked against each other.
pub(crate) fn export_specs(a: &ServeArgs, demo: Option<PathBuf>) -> Result<Vec<ExportSpec>, Error> {
    let paths: Vec<PathBuf> = demo.into_iter().chain(a.images.iter().cloned()).collect();
    for (flag, n) in [
        ("--export-name", a.security.export_name.len()),
        ("--fuse", a.fuse.len()),
        ("--vhost-user-blk", a.vhost_user_blk.len()),
    ] {
        if n > paths.len() {
            return Err(Error::invalid(format!(
                "{n} {flag} but {} image(s): give {flag} at most once per image, in image order",
                paths.len()
            )));
        }
    }
    let allow = security::export_allow(&a.security.export_allow)?;
    let mut specs: Vec<ExportSpec> = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let name = a.security.export_name.get(i).cloned().unwrap_or_else(|| export_name(path));
        if specs.iter().any(|s| s.name.as_deref() == Some(&name)) {
            return Err(Error::invalid(format!(
                "two images would both be export {name:?} ({}); export names come from file stems: rename one or use --export-name",
                path.display()
            )));
        }
        specs.push(ExportSpec {
            image: path.clone(),
            name: Some(name),
            readonly: a.readonly,
            format: image_format(a.format),
            backing: a.backing.backing.clone(),
            ignore_backing_mtime: a.backing.ignore_backing_mtime,
            ceph_conf: a.backing.ceph.ceph_conf.clone(),
            ceph_id: a.backing.ceph.ceph_id.clone(),
            fuse: a.fuse.get(i).cloned(),
            vhost_user_blk: a.vhost_user_blk.get(i).cloned(),
            num_queues: a.num_queues.map(u64::from),
            ..Default::default()
        });
    }
    for (name, pattern) in allow {
        let Some(spec) = specs.iter_mut().find(|s| s.name.as_deref() == Some(&name)) else {
            let names: Vec<_> = specs.iter().filter_map(|s| s.name.as_deref()).collect();
            return Err(Error::invalid(format!(
                "--export-allow {name}={pattern}: no export {name:?} on the command line (exports: {}); \
                 for exports of the config file, write allow = [...] in their [[export]]",
                if names.is_empty() { "none".to_owned() } else { names.join(", ") }
            )));
        };
        spec.allow.push(pattern);
    }
    Ok(specs)
}

fn start_exports(daemon: &Daemon, specs: Vec<ExportSpec>, banner: &mut Vec<String>) -> Result<(), Error> {
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
    control: Option<ControlSocket>,
    metrics: Option<MetricsServer>,
    banner: Vec<String>,
}

impl Listeners {
    fn open(a: &ServeArgs, served: &Served, tls: bool) -> Result<Listeners, Error> {
        let daemon = &served.daemon;
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
        l.open_control(a, served)?;
        let inherited = systemd::listeners("metrics")?.into_iter().find_map(|i| match i {
            Inherited::Tcp(t) => Some(t),
            Inherited::Unix(..) => None,
        });
        let metrics = match (inherited, &a.metrics) {
            (Some(t), _) => Some(MetricsServer::serve(t, daemon.clone())?),
            (None, Some(addr)) => {
                Some(MetricsServer::start(parse_listen(addr, "--metrics", "127.0.0.1:9100")?, daemon.clone())?)
            }
            (None, None) => None,
        };
        if let Some(m) = &metrics {
            l.banner.push(format!("vdisk: metrics on http://{}/metrics", m.addr()));
        }
        l.metrics = metrics;
        Ok(l)
    }

    /// Takes the NBD sockets the service manager passed; false if there are none.
    fn inherit_nbd(&mut self, first: &str, tls: bool) -> Result<bool, Error> {
        let scheme = if tls { "nbds" } else { "nbd" };
        for i in systemd::listeners("nbd")? {
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

    fn open_control(&mut self, a: &ServeArgs, served: &Served) -> Result<(), Error> {
        let inherited = systemd::listeners("control")?.into_iter().find_map(|i| match i {
            Inherited::Unix(l, Some(path)) => Some((l, path)),
            _ => None,
        });
        // The control socket's own mode and group: --socket-mode never applies to it.
        let policy = || -> Result<vdisk_control::Policy, Error> {
            Ok(vdisk_control::Policy {
                access: vdisk_control::Access::new(a.control_mode, a.control_group.as_deref())?,
                deadline: a
                    .control_timeout
                    .map_or(vdisk_control::DEFAULT_DEADLINE, |s| std::time::Duration::from_secs(s.into())),
                roots: !a.image_roots.is_empty(),
            })
        };
        let (control, path, from) = match (inherited, &a.control) {
            (Some((l, path)), _) => {
                let c = ControlSocket::inherited(l, &path, policy()?, served.clone())?;
                (c, path, " (from the service manager)")
            }
            (None, Some(path)) => (ControlSocket::start(path, policy()?, served.clone())?, path.clone(), ""),
            (None, None) => return Ok(()),
        };
        self.control = Some(control);
        self.banner.push(format!("vdisk: control socket {}{from}", path.display()));
        self.banner.push(format!("  try: vdisk ctl --control {} list", path.display()));
        Ok(())
    }

    fn open_nbd(&mut self, a: &ServeArgs, first: &str, tls: bool) -> Result<(), Error> {
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
                Error::invalid(format!(
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

/// A fresh sparse demo image, export "demo", in its own temp directory,
/// removed when this is dropped.
struct DemoImage {
    dir: PathBuf,
    image: PathBuf,
}

impl DemoImage {
    fn create() -> Result<DemoImage, Error> {
        let dir = std::env::temp_dir().join(format!("vdisk-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::failed(format!("cannot create {}", dir.display())).at(&dir).because(e))?;
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
    (server, daemon, reloader): (&Server, &Daemon, &Reloader),
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
                systemd::notify(&format!("STATUS={status}"));
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
                vdisk_daemon::stopping::show(limit)
            );
            systemd::notify("STOPPING=1\nSTATUS=stopping: finishing requests and flushing");
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
