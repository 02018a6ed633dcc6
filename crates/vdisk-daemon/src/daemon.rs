//! The daemon: owns the devices and the exports over them while `vdisk serve`
//! runs. Adding an export (open the image, start its device, its FUSE file and
//! vhost-user socket, offer it on every NBD listener) and removing one are
//! methods here; the command line at start-up and the control socket are just
//! callers, so there is one code path for each.
//!
//! Changes (add, remove, QoS, shutdown) are serialized by one lock; reading
//! (list, stats) never waits for a change in progress. An add that fails
//! leaves nothing started; a removal never loses an acknowledged write.
//!
//! Opening an image (which may wait on a slow or hung file system) happens
//! outside that lock: the name is reserved first, so a second add of it is
//! refused, and the image is opened, then the lock taken to start it. A
//! caller with a deadline hands in a [`Ticket`]; once it is abandoned, the
//! change is not made (an image that opens late is closed and dropped).
//! What a control-socket request or the config file adds is opened inside
//! the image roots when there are any ([`Origin::Request`]).
//!
//! Removing is the mirror image: the export is taken out of the table under
//! the lock, then stopped and flushed outside it (storage that does not
//! answer must not hold every later change). Its name stays taken until the
//! stop ends, so adding it again meanwhile is refused; a shutdown waits for
//! such stops too (within the stop limit, which names them).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use vdisk_engine::{Device, EngineConfig, EngineKind, Limits, Snapshot};
use vdisk_image::files::Roots;
use vdisk_nbd::{Export, Server};

use crate::bitmaps::{BitmapInfo, BitmapOp, ExportBitmaps};
use crate::formats::{self, Opened};
use crate::frontend::{Frontend, Frontends};
use crate::spec::ExportSpec;
use crate::stopping::{Step, StopProgress};
use crate::{Error, ErrorKind};

/// What every export of this daemon shares: how devices run and sockets are made.
pub struct Settings {
    pub engine: EngineConfig,
    pub direct: bool,
    pub socket_mode: u32,
    pub fuse_uring: bool,
    /// `--image-root`: where what [`Origin::Request`] adds must lie.
    pub roots: Option<Arc<Roots>>,
}

/// Who asked for an export.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Origin {
    /// The command line: the operator's own images, unrestricted.
    Operator,
    /// The control socket or the config file: beneath the image roots, if any.
    Request,
}

/// A change that a caller may give up on (a control request past its
/// deadline): once [`Ticket::abandon`] succeeds, no change starts under it.
#[derive(Default)]
pub struct Ticket {
    /// (abandoned, changes being made right now)
    state: Mutex<(bool, u32)>,
    /// What was changed already, should the request still be running at its deadline.
    made: Mutex<Option<String>>,
}

impl Ticket {
    /// Marks a change as being made, or None once abandoned.
    pub fn commit(&self) -> Option<Committing<'_>> {
        let mut s = self.state.lock().unwrap();
        if s.0 {
            return None;
        }
        s.1 += 1;
        Some(Committing(self))
    }

    /// [`Ticket::commit`], or the error a request given up at its deadline answers.
    pub fn go_ahead(&self) -> Result<Committing<'_>, Error> {
        self.commit().ok_or_else(abandoned)
    }

    /// Records that the change was made, though the request goes on (a
    /// removal still flushing): what a caller given up at its deadline is told.
    pub(crate) fn made(&self, what: String) {
        *self.made.lock().unwrap() = Some(what);
    }

    /// What [`Ticket::made`] recorded, if anything.
    pub fn made_already(&self) -> Option<String> {
        self.made.lock().unwrap().clone()
    }

    /// Gives up, unless a change is being made right now (then false: wait for it).
    pub fn abandon(&self) -> bool {
        let mut s = self.state.lock().unwrap();
        if s.1 == 0 {
            s.0 = true;
        }
        s.0
    }
}

/// While alive, its ticket cannot be abandoned.
pub struct Committing<'a>(&'a Ticket);

impl Drop for Committing<'_> {
    fn drop(&mut self) {
        self.0.state.lock().unwrap().1 -= 1;
    }
}

fn abandoned() -> Error {
    Error::failed("the request ran past its deadline and was given up; nothing was changed")
}

/// A name being added: released when dropped, whatever happens.
struct Reserved<'a> {
    names: &'a Mutex<HashSet<String>>,
    name: String,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.names.lock().unwrap().remove(&self.name);
    }
}

/// Exports taken out of the table whose stop (unmount, flush) has not ended:
/// name and FUSE file. Their names stay taken; a shutdown waits for them.
#[derive(Default)]
struct Removing {
    names: Mutex<HashMap<String, Option<PathBuf>>>,
    ended: Condvar,
}

/// One export being stopped after its removal: its name is freed when dropped, whatever happens.
struct Stopping<'a> {
    removing: &'a Removing,
    name: String,
}

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        self.removing.names.lock().unwrap().remove(&self.name);
        self.removing.ended.notify_all();
    }
}

/// An export as `export_list` shows it.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    pub name: String,
    pub image: PathBuf,
    pub format: &'static str,
    pub size: u64,
    pub readonly: bool,
    /// NBD clients attached.
    pub connections: usize,
    pub fuse: Option<PathBuf>,
    pub vhost_user_blk: Option<PathBuf>,
    pub qos: Limits,
    /// Why its device failed (its requests get EIO until it is removed and added again).
    pub failure: Option<String>,
    pub allow: Vec<String>,
}

/// An export's statistics.
#[derive(Clone, Debug)]
pub struct ExportStats {
    pub name: String,
    pub connections: usize,
    pub snapshot: Snapshot,
    pub failure: Option<String>,
}

/// The server as `server_info` shows it.
#[derive(Clone, Debug)]
pub struct ServerInfo {
    pub version: &'static str,
    pub pid: u32,
    pub uptime: std::time::Duration,
    pub exports: usize,
    pub connections: usize,
    pub engine: EngineKind,
}

/// An export being served.
struct Running {
    name: String,
    spec: ExportSpec,
    format: &'static str,
    device: Arc<Device>,
    /// FUSE file and vhost-user socket, in the order started.
    frontends: Vec<Box<dyn Frontend>>,
    /// Its dirty bitmaps (None: an RBD image, which keeps none).
    bitmaps: Option<Arc<ExportBitmaps>>,
}

pub struct Daemon {
    settings: Settings,
    nbd: Arc<Server>,
    exports: Arc<Mutex<Vec<Running>>>,
    /// Held by every change, so two never interleave; true once shut down.
    changes: Arc<Mutex<bool>>,
    /// Names of exports being opened (outside `changes`), so a second add of one is refused.
    reserved: Mutex<HashSet<String>>,
    /// Exports removed from the table and still stopping (outside `changes`).
    removing: Removing,
    started: Instant,
    /// Live disk operations, running and ended (`jobs`, `snapshot`).
    pub(crate) jobs: crate::jobs::Jobs,
    /// Backups in progress: their views and copy-before-write wrappers (`backup`).
    pub(crate) views: crate::views::Views,
}

/// An export as a live disk operation changes it ([`Daemon::live_change`]):
/// its device, and the spec and format the export list shows, written back after.
pub(crate) struct Live {
    pub device: Arc<Device>,
    pub spec: ExportSpec,
    pub format: &'static str,
    /// `--direct`: how the daemon opens images.
    pub direct: bool,
    /// Where files the operation makes or opens must lie (a control request's image roots).
    pub roots: Option<Arc<Roots>>,
    /// Its dirty bitmaps, which follow a change of its top ([`crate::bitmaps::swap_top`]).
    pub bitmaps: Option<Arc<ExportBitmaps>>,
}

/// The daemon's export table and change lock, for a job thread that outlives
/// the request which started it ([`Daemon::changer`]).
#[derive(Clone)]
pub(crate) struct Changer {
    exports: Arc<Mutex<Vec<Running>>>,
    changes: Arc<Mutex<bool>>,
    direct: bool,
    roots: Option<Arc<Roots>>,
}

impl Changer {
    /// [`Daemon::live_change`].
    pub(crate) fn live_change<T>(&self, name: &str, f: impl FnOnce(&mut Live) -> Result<T, Error>) -> Result<T, Error> {
        let closed = self.changes.lock().unwrap();
        if *closed {
            return Err(Error::failed("the server is shutting down"));
        }
        let mut live = {
            let exports = self.exports.lock().unwrap();
            let e = exports.iter().find(|e| e.name == name).ok_or_else(|| not_found(name))?;
            let (direct, roots) = (self.direct, self.roots.clone());
            let bitmaps = e.bitmaps.clone();
            Live { device: e.device.clone(), spec: e.spec.clone(), format: e.format, direct, roots, bitmaps }
        };
        let r = f(&mut live)?;
        if let Some(e) = self.exports.lock().unwrap().iter_mut().find(|e| e.name == name) {
            e.spec = live.spec;
            e.format = live.format;
        }
        Ok(r)
    }

    /// Export `name` is served, by `device`.
    pub(crate) fn serves(&self, name: &str, device: &Arc<Device>) -> bool {
        self.exports.lock().unwrap().iter().any(|e| e.name == name && Arc::ptr_eq(&e.device, device))
    }
}

/// Why an allow list cannot work on this server.
pub const NO_IDENTITIES: &str = "this server does not learn who its NBD clients are: allow lists need TLS \
     with client certificates (--tls-verify-peer or --tls-ca) or pre-shared keys (--tls-psk)";

impl Daemon {
    pub fn new(settings: Settings, nbd: Arc<Server>) -> Daemon {
        Daemon {
            settings,
            nbd,
            exports: Arc::new(Mutex::new(Vec::new())),
            changes: Arc::new(Mutex::new(false)),
            reserved: Mutex::new(HashSet::new()),
            removing: Removing::default(),
            started: Instant::now(),
            jobs: Default::default(),
            views: Default::default(),
        }
    }

    /// Runs a live disk operation on export `name` under the change lock (no
    /// add, remove or shutdown meanwhile); what `f` sets in [`Live`]'s spec
    /// and format is what the export list shows from then on.
    /// Refused while the export has a backup running: the operation would
    /// swap its copy-before-write wrapper out from under the view.
    pub(crate) fn live_change<T>(&self, name: &str, f: impl FnOnce(&mut Live) -> Result<T, Error>) -> Result<T, Error> {
        self.live_change_unchecked(name, |live| {
            if let Some(view) = self.views.view_of(name) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "export {name:?} has a backup running (view {view:?}): end it first (`vdisk ctl backup end \
                         {view}`); nothing was changed"
                    ),
                ));
            }
            f(live)
        })
    }

    /// [`Daemon::live_change`] without the backup check (what `backup` itself uses).
    pub(crate) fn live_change_unchecked<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut Live) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.changer().live_change(name, f)
    }

    /// What a job's own thread keeps to change an export when it ends (a mirror's pivot).
    pub(crate) fn changer(&self) -> Changer {
        Changer {
            exports: self.exports.clone(),
            changes: self.changes.clone(),
            direct: self.settings.direct,
            roots: self.settings.roots.clone(),
        }
    }

    /// Export `name` is served, by `device` still (not removed, nor removed and added again).
    pub(crate) fn serves(&self, name: &str, device: &Arc<Device>) -> bool {
        self.changer().serves(name, device)
    }

    /// The change lock, unless the server is shutting down.
    pub(crate) fn changes_lock(&self) -> Result<MutexGuard<'_, bool>, Error> {
        let closed = self.changes.lock().unwrap();
        if *closed {
            return Err(Error::failed("the server is shutting down"));
        }
        Ok(closed)
    }

    /// True when `name` is an export's, a backup view's, or one being added or removed.
    pub(crate) fn name_in_use(&self, name: &str) -> bool {
        self.exports.lock().unwrap().iter().any(|e| e.name == name)
            || self.views.export_of(name).is_some()
            || self.reserved.lock().unwrap().contains(name)
            || self.removing.names.lock().unwrap().contains_key(name)
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// One line for a service manager's status: exports and clients.
    pub fn status(&self) -> String {
        let (e, c) = (self.exports.lock().unwrap().len(), self.nbd.connections());
        format!("serving {e} export{}, {c} NBD client{}", if e == 1 { "" } else { "s" }, if c == 1 { "" } else { "s" })
    }

    /// Starts serving one export of the operator's (the command line);
    /// returns lines worth printing (where it is served).
    pub fn add(&self, spec: ExportSpec) -> Result<Vec<String>, Error> {
        self.add_as(spec, Origin::Operator, &Ticket::default())
    }

    /// Starts serving one export for `origin`, unless `ticket` is abandoned
    /// before it is started (the module doc: how the open avoids the lock).
    pub fn add_as(&self, mut spec: ExportSpec, origin: Origin, ticket: &Ticket) -> Result<Vec<String>, Error> {
        spec.check()?;
        let name = spec.export_name();
        let roots = match origin {
            Origin::Request => self.settings.roots.clone(),
            Origin::Operator => None,
        };
        let spec = match &roots {
            Some(r) => confine_paths(spec, r)?,
            None => spec,
        };
        let allow = self.allow_list(&name, &spec.allow)?;
        let _reserved = self.reserve(&name)?;
        let Opened { image, description } = vdisk_image::files::confined(roots, || {
            formats::open(&spec.image, &spec.open_options(self.settings.direct))
        })?;
        if image.size() == 0 {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!(
                    "{} is empty: a disk needs a size (make one with `vdisk create IMAGE --size 10G`)",
                    spec.image.display()
                ),
            ));
        }
        let closed = self.changes.lock().unwrap();
        if *closed {
            return Err(Error::failed("the server is shutting down"));
        }
        // Past the deadline: the image opened late is closed here, unserved.
        let _committing = ticket.go_ahead()?;
        self.start(name, spec, allow, image, description, closed)
    }

    /// Reserves `name` for an add in progress, or refuses if it is taken.
    fn reserve(&self, name: &str) -> Result<Reserved<'_>, Error> {
        let closed = self.changes.lock().unwrap();
        if *closed {
            return Err(Error::failed("the server is shutting down"));
        }
        let exists = || {
            Error::new(
                ErrorKind::Exists,
                format!("export {name:?} exists already: remove it first, or give the new one another name (--name)"),
            )
        };
        if self.exports.lock().unwrap().iter().any(|e| e.name == name) {
            return Err(exists());
        }
        if let Some(of) = self.views.export_of(name) {
            return Err(Error::new(
                ErrorKind::Exists,
                format!("{name:?} is a backup view of export {of:?}: give the new export another name (--name)"),
            ));
        }
        if self.removing.names.lock().unwrap().contains_key(name) {
            return Err(Error::new(
                ErrorKind::Exists,
                format!(
                    "export {name:?} is being removed (its device is still stopping and flushing): add it again once \
                     the removal has ended, or pick another name"
                ),
            ));
        }
        if !self.reserved.lock().unwrap().insert(name.to_owned()) {
            return Err(Error::new(
                ErrorKind::Exists,
                format!("export {name:?} is being added by another request: wait for it, or pick another name"),
            ));
        }
        drop(closed);
        Ok(Reserved { names: &self.reserved, name: name.to_owned() })
    }

    /// Starts the device and frontends of an opened image and serves it; `_change` is the change lock.
    fn start(
        &self,
        name: String,
        spec: ExportSpec,
        allow: vdisk_nbd::allow::Allow,
        image: Arc<dyn vdisk_image::Image>,
        description: String,
        _change: MutexGuard<'_, bool>,
    ) -> Result<Vec<String>, Error> {
        let format = image.format();
        let device = Device::start(&name, image, &self.settings.engine).map_err(|e| {
            Error::failed(format!("cannot start workers for {}", spec.image.display())).at(&spec.image).because(e)
        })?;
        let device = Arc::new(device);
        device.set_limits(spec.limits());
        let mut notes = vec![self.describe(&name, &description, &device)];
        // Stopped again (unmounted, closed) if anything below fails.
        let mut frontends = Frontends(Vec::new());
        if let Some(path) = &spec.fuse {
            frontends.0.push(crate::fuse::start(path, &device, self.settings.fuse_uring, &mut notes)?);
        }
        if let Some(socket) = &spec.vhost_user_blk {
            let mode = self.settings.socket_mode;
            frontends.0.push(crate::vhost::start(
                socket,
                &device,
                spec.num_queues.map(|n| n as u16),
                mode,
                &mut notes,
            )?);
        }
        let bitmaps = ExportBitmaps::open(&name, &spec.image, &device)?.map(Arc::new);
        let export = Export { name: name.clone(), description, device: device.clone(), allow };
        if self.nbd.add_export(export).is_err() {
            if let Some(b) = &bitmaps {
                let _ = b.close();
            }
            return Err(Error::new(ErrorKind::Exists, format!("export {name:?} is already served over NBD")));
        }
        if let Some(b) = &bitmaps {
            self.nbd.set_bitmaps(&name, b.served());
        }
        let frontends = std::mem::take(&mut frontends.0);
        log::info!(export:% = name; "export {name:?} added: {}", notes[0].trim_start_matches("vdisk: "));
        self.exports.lock().unwrap().push(Running { name, spec, format, device, frontends, bitmaps });
        Ok(notes)
    }

    /// An export's allow list, checked: the patterns parse, and the server
    /// learns who its clients are (else the list could never admit anyone).
    pub(crate) fn allow_list_of(&self, name: &str, patterns: &[String]) -> Result<vdisk_nbd::allow::Allow, Error> {
        self.allow_list(name, patterns)
    }

    fn allow_list(&self, name: &str, patterns: &[String]) -> Result<vdisk_nbd::allow::Allow, Error> {
        let allow = vdisk_nbd::allow::Allow::new(patterns)
            .map_err(|e| Error::invalid(format!("export {name:?}")).because(e))?;
        if !allow.is_open() && !self.nbd.identifies_clients() {
            return Err(Error::invalid(format!("export {name:?} has an allow list, but {}", NO_IDENTITIES)));
        }
        Ok(allow)
    }

    fn describe(&self, name: &str, description: &str, device: &Device) -> String {
        let mode = if device.read_only() { "read-only" } else { "read-write" };
        let e = &self.settings.engine;
        let sync =
            format!("{}{}", if e.sync { ", sync" } else { "" }, if self.settings.direct { ", O_DIRECT" } else { "" });
        let engine = match device.kind() {
            EngineKind::Uring => {
                format!("io_uring engine, shared I/O core of {} ring(s)", vdisk_engine::Core::global().size())
            }
            EngineKind::Threads => format!(
                "thread engine, up to {} of the shared pool's {} threads",
                device.pool_share().unwrap_or(e.workers),
                vdisk_engine::Device::thread_pool_size()
            ),
            EngineKind::Rbd => "librbd AIO engine".to_owned(),
        };
        format!("vdisk: export {name:?}: {description}, {mode}, {engine}{sync}")
    }

    /// Stops serving export `name`. Without `hard`, refused while anything is
    /// attached. With it: no new requests, those in flight finish, NBD clients
    /// are disconnected, the FUSE file unmounted, the vhost-user frontend
    /// disconnected, the device flushed and the image closed.
    pub fn remove(&self, name: &str, hard: bool) -> Result<(), Error> {
        self.remove_within(name, hard, &Ticket::default())
    }

    /// [`Daemon::remove`], unless `ticket` was abandoned before it starts.
    /// The export leaves the table under the change lock; its stop and flush
    /// run after the lock is let go (the module doc).
    pub fn remove_within(&self, name: &str, hard: bool, ticket: &Ticket) -> Result<(), Error> {
        let (running, _stopping) = {
            let _change = self.changes.lock().unwrap();
            let _committing = ticket.go_ahead()?;
            if let Some(of) = self.views.export_of(name) {
                return Err(Error::invalid(format!(
                    "{name:?} is a backup view of export {of:?}: end the backup (`vdisk ctl backup end {name}`)"
                )));
            }
            let Some((at, export)) = self.nbd.remove_export(name) else {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("no export {name:?} (`vdisk ctl list` shows them)"),
                ));
            };
            if !hard {
                let attached = self.attached(name);
                if !attached.is_empty() {
                    self.nbd.restore_export(at, export);
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!("export {name:?} is in use: {}; `remove --hard` disconnects them", attached.join(", ")),
                    ));
                }
            }
            // Requests waiting for QoS tokens are in flight too: they go now.
            export.device.set_limits(Limits::default());
            let running = {
                let mut exports = self.exports.lock().unwrap();
                let at = exports.iter().position(|e| e.name == name).expect("served over NBD, so listed");
                exports.remove(at)
            };
            self.removing.names.lock().unwrap().insert(name.to_owned(), running.spec.fuse.clone());
            ticket.made(format!(
                "export {name:?} is no longer served, but its stop (unmount, flush) had not ended: it goes on, and \
                 the name stays taken until it ends (is its storage slow or hung?)"
            ));
            (running, Stopping { removing: &self.removing, name: name.to_owned() })
        };
        // Its clients finish what they sent (on hung storage that may never end): outside the lock too.
        self.nbd.disconnect(name);
        self.nbd.set_bitmaps(name, Vec::new());
        // Its backups end with it (their scratch data goes).
        for view in self.views.take_of(Some(name)) {
            if let Err(e) = crate::views::end(view, &self.nbd, true) {
                log::warn!(export:% = name; "{}", e.report());
            }
        }
        let failed = running.device.failure().is_some();
        let stopped = match stop_export(running, &|_| {}) {
            // Removing a failed export is how it is brought back: that is no error of the removal.
            Err(errors) if failed => {
                log::warn!(export:% = name; "export {name:?} had failed; stopped: {}", joined(&errors));
                Ok(())
            }
            r => r.map_err(|errors| Error::failed(joined(&errors))),
        };
        log::info!(export:% = name; "export {name:?} removed{}", if hard { " (--hard)" } else { "" });
        stopped
    }

    /// The NBD server the exports are served on.
    pub(crate) fn nbd(&self) -> &Server {
        &self.nbd
    }

    /// Export `name`'s bitmaps: None for no such export, Some(None) for one that keeps none.
    pub(crate) fn export_bitmaps(&self, name: &str) -> Option<Option<Arc<ExportBitmaps>>> {
        self.exports.lock().unwrap().iter().find(|e| e.name == name).map(|e| e.bitmaps.clone())
    }

    /// The image export `name` serves now (a live snapshot moves it to the new overlay).
    pub(crate) fn served_image(&self, name: &str) -> Option<std::path::PathBuf> {
        self.exports.lock().unwrap().iter().find(|e| e.name == name).map(|e| e.spec.image.clone())
    }

    /// Why export `name`'s device failed, if it did (None too for no such export).
    pub fn failure(&self, name: &str) -> Option<String> {
        let exports = self.exports.lock().unwrap();
        exports.iter().find(|e| e.name == name).and_then(|e| e.device.failure())
    }

    /// What is attached to an export, for people ("2 NBD clients", "FUSE file /x").
    fn attached(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        let n = self.nbd.connections_to(name);
        if n > 0 {
            out.push(format!("{n} NBD client{}", if n == 1 { "" } else { "s" }));
        }
        if let Some(e) = self.exports.lock().unwrap().iter().find(|e| e.name == name) {
            if let Some(p) = &e.spec.fuse {
                out.push(format!("FUSE file {} (a loop device or program may have it open)", p.display()));
            }
            if let Some(p) = &e.spec.vhost_user_blk {
                out.push(format!("vhost-user-blk socket {} (a VM may be attached)", p.display()));
            }
        }
        out
    }

    /// Changes the QoS limits of export `name`, live.
    pub fn set_qos(&self, name: &str, limits: Limits) -> Result<(), Error> {
        self.set_qos_within(name, limits, &Ticket::default())
    }

    /// [`Daemon::set_qos`], unless `ticket` was abandoned before it starts.
    pub fn set_qos_within(&self, name: &str, limits: Limits, ticket: &Ticket) -> Result<(), Error> {
        let _change = self.changes.lock().unwrap();
        let _committing = ticket.go_ahead()?;
        let mut exports = self.exports.lock().unwrap();
        let e = exports.iter_mut().find(|e| e.name == name).ok_or_else(|| not_found(name))?;
        e.device.set_limits(limits);
        e.spec.set_limits(limits);
        Ok(())
    }

    pub fn limits(&self, name: &str) -> Result<Limits, Error> {
        let exports = self.exports.lock().unwrap();
        exports.iter().find(|e| e.name == name).map(|e| e.device.limits()).ok_or_else(|| not_found(name))
    }

    /// Lifts every export's QoS limits (at shutdown: what waits for tokens goes at once).
    pub fn lift_limits(&self) {
        for e in self.exports.lock().unwrap().iter() {
            e.device.set_limits(Limits::default());
        }
    }

    pub fn names(&self) -> Vec<String> {
        self.exports.lock().unwrap().iter().map(|e| e.name.clone()).collect()
    }

    /// Every export, as `export_list` shows them.
    pub fn list(&self) -> Vec<ExportInfo> {
        let exports = self.exports.lock().unwrap();
        exports
            .iter()
            .map(|e| ExportInfo {
                name: e.name.clone(),
                image: e.spec.image.clone(),
                format: e.format,
                size: e.device.size(),
                readonly: e.device.read_only(),
                connections: self.nbd.connections_to(&e.name),
                fuse: e.spec.fuse.clone(),
                vhost_user_blk: e.spec.vhost_user_blk.clone(),
                qos: e.device.limits(),
                failure: e.device.failure(),
                allow: e.spec.allow.clone(),
            })
            .collect()
    }

    /// The statistics of export `name`, or of every export.
    pub fn stats(&self, name: Option<&str>) -> Result<Vec<ExportStats>, Error> {
        let exports = self.exports.lock().unwrap();
        let one = |e: &Running| ExportStats {
            name: e.name.clone(),
            connections: self.nbd.connections_to(&e.name),
            snapshot: e.device.stats(),
            failure: e.device.failure(),
        };
        match name {
            Some(n) => exports.iter().find(|e| e.name == n).map(|e| vec![one(e)]).ok_or_else(|| not_found(n)),
            None => Ok(exports.iter().map(one).collect()),
        }
    }

    /// Every export's device, name and NBD clients, for metrics.
    pub fn devices(&self) -> Vec<(String, Arc<Device>, usize)> {
        let exports = self.exports.lock().unwrap();
        exports.iter().map(|e| (e.name.clone(), e.device.clone(), self.nbd.connections_to(&e.name))).collect()
    }

    pub fn info(&self) -> ServerInfo {
        ServerInfo {
            version: env!("CARGO_PKG_VERSION"),
            pid: std::process::id(),
            uptime: self.started.elapsed(),
            exports: self.exports.lock().unwrap().len(),
            connections: self.nbd.connections(),
            engine: self.settings.engine.kind,
        }
    }

    /// Stops every export once the NBD server stops accepting: each export's
    /// clients finish their requests, its frontends stop, its device flushes.
    /// Exports stop in parallel, so one whose storage does not answer keeps no
    /// other from being flushed; `progress` follows each (the stop watchdog
    /// reads it). Refuses further changes. Every failure is reported.
    pub fn shutdown(&self, progress: &StopProgress) -> Result<(), Error> {
        let mut closed = self.changes.lock().unwrap();
        *closed = true;
        // Backups end first: their views go, their scratch data with them.
        for view in self.views.take_of(None) {
            if let Err(e) = crate::views::end(view, &self.nbd, true) {
                log::warn!("{}", e.report());
            }
        }
        let all = std::mem::take(&mut *self.exports.lock().unwrap());
        for running in &all {
            progress.begin(&running.name, running.spec.fuse.clone());
        }
        // Removed before the stop began and still flushing: waited for below.
        let removing: Vec<String> = {
            let names = self.removing.names.lock().unwrap();
            for (name, fuse) in names.iter() {
                progress.begin(name, fuse.clone());
                progress.step(name, Step::Flushing);
            }
            names.keys().cloned().collect()
        };
        let errors: Vec<Error> = std::thread::scope(|scope| {
            let stopping: Vec<_> = all
                .into_iter()
                .rev()
                .map(|running| {
                    scope.spawn(move || {
                        let name = running.name.clone();
                        self.nbd.remove_export(&name);
                        self.nbd.disconnect(&name);
                        self.nbd.set_bitmaps(&name, Vec::new());
                        let stopped = stop_export(running, &|step| progress.step(&name, step));
                        progress.step(
                            &name,
                            match &stopped {
                                Ok(()) => Step::Done,
                                Err(e) => Step::Failed(joined(e)),
                            },
                        );
                        stopped.err().unwrap_or_default()
                    })
                })
                .collect();
            stopping
                .into_iter()
                .flat_map(|t| t.join().unwrap_or_else(|_| vec![Error::failed("a stop thread panicked")]))
                .collect()
        });
        let mut names = self.removing.names.lock().unwrap();
        for name in removing {
            names = self.removing.ended.wait_while(names, |n| n.contains_key(&name)).unwrap();
            progress.step(&name, Step::Done);
        }
        drop(names);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::failed(joined(&errors)))
        }
    }
}

/// Stops an export's FUSE file and vhost socket, then finishes and flushes its
/// device, telling `step` as it goes. Goes on past failures and returns all of them.
fn stop_export(running: Running, step: &dyn Fn(Step)) -> Result<(), Vec<Error>> {
    let Running { name, device, frontends, bitmaps, .. } = running;
    let mut errors = Vec::new();
    step(Step::Frontends);
    for f in frontends.into_iter().rev() {
        if let Err(e) = f.stop() {
            errors.push(e.context(format_args!("export {name:?}")));
        }
    }
    step(Step::Flushing);
    let failed = device.failure().is_some();
    match device.shutdown() {
        Err(e) if failed => errors.push(Error::failed(format!("export {name:?}")).because(e)),
        Err(e) => errors.push(Error::failed(format!("flush of export {name:?} failed")).because(e)),
        // After the last flush: the bitmaps' in-use marks are cleared (a clean close).
        Ok(()) => {
            if let Some(Err(e)) = bitmaps.map(|b| b.close()) {
                errors.push(e);
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn not_found(name: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("no export {name:?} (`vdisk ctl list` shows them)"))
}

/// With image roots, the paths a request names besides the image: the FUSE
/// file and vhost-user socket the server would create must lie beneath them
/// (else a request could mount a disk over any file), and a Ceph
/// configuration file too. The image and backing files are opened beneath
/// them by [`vdisk_image::files::confined`].
fn confine_paths(mut spec: ExportSpec, roots: &Arc<Roots>) -> Result<ExportSpec, Error> {
    for p in [&mut spec.fuse, &mut spec.vhost_user_blk].into_iter().flatten() {
        *p = roots.check_new(p).map_err(|e| Error::image(ErrorKind::Invalid, &e))?;
    }
    // Another server's NBD export, over TCP: a host the control socket's
    // clients might not reach themselves. Its unix sockets are checked at the open.
    if let Some(Ok(u)) = formats::nbd_uri(&spec.image).map(vdisk_nbd::remote::Uri::parse) {
        if matches!(u.address, vdisk_nbd::remote::Address::Tcp { .. }) {
            return Err(Error::invalid(format!(
                "{}: with image roots, an NBD export may be added only over a unix socket beneath them (serve a TCP \
                 one from the command line)",
                spec.image.display()
            )));
        }
    }
    let named = formats::rbd_spec(&spec.image, &Default::default()).ok().flatten().and_then(|s| s.options.conf);
    for conf in [spec.ceph_conf.clone(), named].into_iter().flatten() {
        vdisk_image::files::confined(Some(roots.clone()), || vdisk_image::files::check_confined(&conf))
            .map_err(|e| Error::image(ErrorKind::Invalid, &e))?;
    }
    Ok(spec)
}

/// Several errors in one line, each with its causes.
fn joined(errors: &[Error]) -> String {
    errors.iter().map(|e| e.report().to_string()).collect::<Vec<_>>().join("; ")
}

/// Dirty bitmaps (kept by `bitmaps`), by export.
impl Daemon {
    /// The bitmaps of export `export`.
    pub(crate) fn bitmaps_of(&self, export: &str) -> Result<Arc<ExportBitmaps>, Error> {
        match self.export_bitmaps(export) {
            None => Err(Error::new(ErrorKind::NotFound, format!("no export {export:?} (`vdisk ctl list` shows them)"))),
            Some(None) => Err(Error::invalid(format!(
                "export {export:?} keeps no dirty bitmaps: it is an RBD snapshot (the RBD image keeps them in its \
                 metadata: export the image itself) or another server's NBD export (keep them on that server)"
            ))),
            Some(Some(b)) => Ok(b),
        }
    }

    /// The bitmaps of export `export`.
    pub fn bitmap_list(&self, export: &str) -> Result<Vec<BitmapInfo>, Error> {
        Ok(self.bitmaps_of(export)?.list())
    }

    /// Changes bitmap `name` of export `export`, unless `ticket` was
    /// abandoned; the NBD export serves the new set to clients that connect
    /// from now on.
    pub fn bitmap_change(&self, export: &str, name: &str, op: &BitmapOp, ticket: &Ticket) -> Result<(), Error> {
        let b = self.bitmaps_of(export)?;
        let _committing = ticket.go_ahead()?;
        b.change(name, op)?;
        self.nbd().set_bitmaps(export, b.served());
        Ok(())
    }
}
