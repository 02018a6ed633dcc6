//! The daemon: owns the devices and the exports over them while `vdisk serve`
//! runs. Adding an export (open the image, start its device, its FUSE file and
//! vhost-user socket, offer it on every NBD listener) and removing one are
//! methods here; the command line at start-up and the control socket are just
//! callers, so there is one code path for each.
//!
//! Changes (add, remove, QoS, shutdown) are serialized by one lock; reading
//! (list, stats) never waits for a change in progress. An add that fails
//! leaves nothing started; a removal never loses an acknowledged write.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{json, Value};
use vdisk_engine::{Device, EngineConfig, EngineKind, Limits};
use vdisk_nbd::{Export, Server};

use crate::cli::{BackingArgs, FormatArg};
use crate::formats::{self, Opened};
use crate::serve::Frontend;
use crate::Failure;

/// What every export of this daemon shares: how devices run and sockets are made.
pub struct Settings {
    pub engine: EngineConfig,
    pub direct: bool,
    pub socket_mode: u32,
    pub fuse_uring: bool,
}

/// One export to add: the image and how to serve it.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSpec {
    pub image: PathBuf,
    /// Default: the image's file stem.
    pub name: Option<String>,
    pub readonly: bool,
    pub format: FormatArg,
    pub backing: BackingArgs,
    pub fuse: Option<PathBuf>,
    pub vhost_user_blk: Option<PathBuf>,
    pub num_queues: Option<u16>,
    pub limits: Limits,
    /// TLS identities that may open it over NBD (vdisk_nbd::allow); empty: anyone.
    pub allow: Vec<String>,
}

/// An export being served.
struct Running {
    name: String,
    spec: ExportSpec,
    format: &'static str,
    device: Arc<Device>,
    /// FUSE file and vhost-user socket, in the order started.
    frontends: Vec<Box<dyn Frontend>>,
}

pub struct Daemon {
    settings: Settings,
    nbd: Arc<Server>,
    exports: Mutex<Vec<Running>>,
    /// Held by every change, so two never interleave.
    changes: Mutex<bool>,
    started: Instant,
    /// `--config FILE` and the exports it started; held through a reload.
    config: Mutex<Option<crate::reload::Source>>,
}

/// Why an allow list cannot work on this server.
pub const NO_IDENTITIES: &str = "this server does not learn who its NBD clients are: allow lists need TLS \
     with client certificates (--tls-verify-peer or --tls-ca) or pre-shared keys (--tls-psk)";

/// A change refused because of what the caller asked (exit 1 in `vdisk ctl`,
/// a JSON-RPC error with this code on the control socket).
pub const ERR_NOT_FOUND: i64 = -32001;
pub const ERR_EXISTS: i64 = -32002;
pub const ERR_BUSY: i64 = -32003;
pub const ERR_INVALID: i64 = -32004;
pub const ERR_FAILED: i64 = -32005;

/// Why the daemon refused: a JSON-RPC error code and a message for people.
#[derive(Debug)]
pub struct Refusal {
    pub code: i64,
    pub message: String,
}

impl Refusal {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Refusal { code, message: message.into() }
    }
}

impl From<Failure> for Refusal {
    fn from(f: Failure) -> Self {
        let code = if f.is_usage() { ERR_INVALID } else { ERR_FAILED };
        Refusal { code, message: f.to_string() }
    }
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        match r.code {
            ERR_FAILED => Failure::runtime(r.message),
            _ => Failure::usage(r.message),
        }
    }
}

impl Daemon {
    pub fn new(settings: Settings, nbd: Arc<Server>) -> Daemon {
        Daemon {
            settings,
            nbd,
            exports: Mutex::new(Vec::new()),
            changes: Mutex::new(false),
            started: Instant::now(),
            config: Mutex::new(None),
        }
    }

    /// From now on [`Daemon::reload`] rereads this config file.
    pub fn follow_config(&self, source: crate::reload::Source) {
        *self.config.lock().unwrap() = Some(source);
    }

    /// Rereads `--config FILE` and applies the difference (SIGHUP, `vdisk ctl
    /// reload`); tells a service manager it is reloading, then ready again.
    pub fn reload(&self) -> Result<Value, Refusal> {
        let mut config = self.config.lock().unwrap();
        let Some(source) = config.as_mut() else {
            log::warn!("reload asked for, but this server was started without --config FILE: nothing to reread");
            return Err(Refusal::new(
                ERR_INVALID,
                "this server was started without --config FILE: there is nothing to reload",
            ));
        };
        crate::systemd::notify_reloading();
        let done = crate::reload::apply(self, source);
        crate::systemd::notify(&format!("READY=1\nSTATUS={}", self.status()));
        done
    }

    /// One line for a service manager's status: exports and clients.
    pub fn status(&self) -> String {
        let (e, c) = (self.exports.lock().unwrap().len(), self.nbd.connections());
        format!("serving {e} export{}, {c} NBD client{}", if e == 1 { "" } else { "s" }, if c == 1 { "" } else { "s" })
    }

    /// Starts serving one export; returns lines worth printing (where it is served).
    pub fn add(&self, spec: ExportSpec) -> Result<Vec<String>, Refusal> {
        let closed = self.changes.lock().unwrap();
        if *closed {
            return Err(Refusal::new(ERR_FAILED, "the server is shutting down"));
        }
        let name = spec.name.clone().unwrap_or_else(|| export_name(&spec.image));
        check_name(&name)?;
        let allow = self.allow_list(&name, &spec.allow)?;
        if self.exports.lock().unwrap().iter().any(|e| e.name == name) {
            return Err(Refusal::new(
                ERR_EXISTS,
                format!("export {name:?} exists already: remove it first, or give the new one another name (--name)"),
            ));
        }
        let Opened { image, description } =
            formats::open(&spec.image, spec.format, spec.readonly, self.settings.direct, &spec.backing)?;
        if image.size() == 0 {
            return Err(Refusal::new(
                ERR_INVALID,
                format!(
                    "{} is empty: a disk needs a size (make one with `vdisk create IMAGE --size 10G`)",
                    spec.image.display()
                ),
            ));
        }
        let format = image.format();
        let device = Device::start(&name, image, &self.settings.engine)
            .map_err(|e| Refusal::new(ERR_FAILED, format!("cannot start workers for {}: {e}", spec.image.display())))?;
        let device = Arc::new(device);
        device.set_limits(spec.limits);
        let mut notes = vec![self.describe(&name, &description, &device)];
        // Stopped again (unmounted, closed) if anything below fails.
        let mut frontends = crate::serve::Frontends(Vec::new());
        if let Some(path) = &spec.fuse {
            frontends.0.push(crate::fuse::start(path, &device, self.settings.fuse_uring, &mut notes)?);
        }
        if let Some(socket) = &spec.vhost_user_blk {
            let mode = self.settings.socket_mode;
            frontends.0.push(crate::vhost::start(socket, &device, spec.num_queues, mode, &mut notes)?);
        }
        let export = Export { name: name.clone(), description, device: device.clone(), allow: allow.clone() };
        if self.nbd.add_export(export).is_err() {
            return Err(Refusal::new(ERR_EXISTS, format!("export {name:?} is already served over NBD")));
        }
        let frontends = std::mem::take(&mut frontends.0);
        log::info!(export:% = name; "export {name:?} added: {}", notes[0].trim_start_matches("vdisk: "));
        self.exports.lock().unwrap().push(Running { name, spec, format, device, frontends });
        drop(closed);
        Ok(notes)
    }

    /// An export's allow list, checked: the patterns parse, and the server
    /// learns who its clients are (else the list could never admit anyone).
    fn allow_list(&self, name: &str, patterns: &[String]) -> Result<vdisk_nbd::allow::Allow, Refusal> {
        let allow = vdisk_nbd::allow::Allow::new(patterns)
            .map_err(|e| Refusal::new(ERR_INVALID, format!("export {name:?}: {e}")))?;
        if !allow.is_open() && !self.nbd.identifies_clients() {
            return Err(Refusal::new(ERR_INVALID, format!("export {name:?} has an allow list, but {}", NO_IDENTITIES)));
        }
        Ok(allow)
    }

    fn describe(&self, name: &str, description: &str, device: &Device) -> String {
        let mode = if device.read_only() { "read-only" } else { "read-write" };
        let e = &self.settings.engine;
        let sync =
            format!("{}{}", if e.sync { ", sync" } else { "" }, if self.settings.direct { ", O_DIRECT" } else { "" });
        let engine = match device.kind() {
            EngineKind::Uring => format!("io_uring engine, {} ring(s)", e.rings),
            EngineKind::Threads => format!("thread engine, {} workers", e.workers),
            EngineKind::Rbd => "librbd AIO engine".to_owned(),
        };
        format!("vdisk: export {name:?}: {description}, {mode}, {engine}{sync}")
    }

    /// Stops serving export `name`. Without `hard`, refused while anything is
    /// attached. With it: no new requests, those in flight finish, NBD clients
    /// are disconnected, the FUSE file unmounted, the vhost-user frontend
    /// disconnected, the device flushed and the image closed.
    pub fn remove(&self, name: &str, hard: bool) -> Result<(), Refusal> {
        let _change = self.changes.lock().unwrap();
        let Some((at, export)) = self.nbd.remove_export(name) else {
            return Err(Refusal::new(ERR_NOT_FOUND, format!("no export {name:?} (`vdisk ctl list` shows them)")));
        };
        if !hard {
            let attached = self.attached(name);
            if !attached.is_empty() {
                self.nbd.restore_export(at, export);
                return Err(Refusal::new(
                    ERR_BUSY,
                    format!("export {name:?} is in use: {}; `remove --hard` disconnects them", attached.join(", ")),
                ));
            }
        }
        // Requests waiting for QoS tokens are in flight too: they go now.
        export.device.set_limits(Limits::default());
        self.nbd.disconnect(name);
        let running = {
            let mut exports = self.exports.lock().unwrap();
            let at = exports.iter().position(|e| e.name == name).expect("served over NBD, so listed");
            exports.remove(at)
        };
        drop(export);
        let stopped = stop_export(running).map_err(|errors| Refusal::new(ERR_FAILED, errors.join("; ")));
        log::info!(export:% = name; "export {name:?} removed{}", if hard { " (--hard)" } else { "" });
        stopped
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
    pub fn set_qos(&self, name: &str, limits: Limits) -> Result<(), Refusal> {
        let _change = self.changes.lock().unwrap();
        let mut exports = self.exports.lock().unwrap();
        let e = exports.iter_mut().find(|e| e.name == name).ok_or_else(|| not_found(name))?;
        e.device.set_limits(limits);
        e.spec.limits = limits;
        Ok(())
    }

    pub fn limits(&self, name: &str) -> Result<Limits, Refusal> {
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
    pub fn list(&self) -> Value {
        let exports = self.exports.lock().unwrap();
        Value::Array(exports.iter().map(|e| self.entry(e)).collect())
    }

    fn entry(&self, e: &Running) -> Value {
        let mut transports = vec![json!({"type": "nbd"})];
        if let Some(p) = &e.spec.fuse {
            transports.push(json!({"type": "fuse", "path": p}));
        }
        if let Some(p) = &e.spec.vhost_user_blk {
            transports.push(json!({"type": "vhost-user-blk", "path": p}));
        }
        json!({
            "name": e.name,
            "image": e.spec.image,
            "format": e.format,
            "size": e.device.size(),
            "readonly": e.device.read_only(),
            "connections": self.nbd.connections_to(&e.name),
            "transports": transports,
            "qos": limits_json(e.device.limits()),
            "allow": e.spec.allow,
        })
    }

    /// The statistics of export `name`, or of every export.
    pub fn stats(&self, name: Option<&str>) -> Result<Value, Refusal> {
        let exports = self.exports.lock().unwrap();
        let one = |e: &Running| crate::stats::to_json(&e.name, self.nbd.connections_to(&e.name), &e.device.stats());
        match name {
            Some(n) => exports.iter().find(|e| e.name == n).map(one).ok_or_else(|| not_found(n)),
            None => Ok(Value::Array(exports.iter().map(one).collect())),
        }
    }

    /// Every export's device, name and NBD clients, for metrics.
    pub fn devices(&self) -> Vec<(String, Arc<Device>, usize)> {
        let exports = self.exports.lock().unwrap();
        exports.iter().map(|e| (e.name.clone(), e.device.clone(), self.nbd.connections_to(&e.name))).collect()
    }

    pub fn info(&self) -> Value {
        let e = &self.settings.engine;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "uptime_seconds": self.started.elapsed().as_secs(),
            "exports": self.exports.lock().unwrap().len(),
            "connections": self.nbd.connections(),
            "engine": match e.kind { EngineKind::Uring => "uring", EngineKind::Threads => "threads", EngineKind::Rbd => "rbd" },
        })
    }

    /// Stops every export, last added first, once the NBD server has stopped
    /// (no connection left). Refuses further changes. Every failure is reported.
    pub fn shutdown(&self) -> Result<(), Failure> {
        let mut closed = self.changes.lock().unwrap();
        *closed = true;
        let all = std::mem::take(&mut *self.exports.lock().unwrap());
        let mut errors = Vec::new();
        for running in all.into_iter().rev() {
            self.nbd.remove_export(&running.name);
            if let Err(mut e) = stop_export(running) {
                errors.append(&mut e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Failure::runtime(errors.join("; ")))
        }
    }
}

/// Stops an export's FUSE file and vhost socket, then finishes and flushes its
/// device. Goes on past failures and returns all of them.
fn stop_export(running: Running) -> Result<(), Vec<String>> {
    let Running { name, device, frontends, .. } = running;
    let mut errors = Vec::new();
    for f in frontends.into_iter().rev() {
        if let Err(e) = f.stop() {
            errors.push(format!("export {name:?}: {e}"));
        }
    }
    if let Err(e) = device.shutdown() {
        errors.push(format!("flush of export {name:?} failed: {e}"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn not_found(name: &str) -> Refusal {
    Refusal::new(ERR_NOT_FOUND, format!("no export {name:?} (`vdisk ctl list` shows them)"))
}

/// NBD names are at most 4096 bytes; an empty one would shadow the default export.
fn check_name(name: &str) -> Result<(), Refusal> {
    if name.is_empty() || name.len() > 4096 || name.chars().any(char::is_control) {
        return Err(Refusal::new(
            ERR_INVALID,
            format!("{name:?} cannot be an export name: give 1 to 4096 bytes without control characters (--name)"),
        ));
    }
    Ok(())
}

pub fn limits_json(l: Limits) -> Value {
    json!({"iops": l.iops, "bps": l.bps, "read_bps": l.read_bps, "write_bps": l.write_bps})
}

/// The export name of an image: an RBD image's name (and snapshot), a file's stem.
pub fn export_name(path: &Path) -> String {
    crate::formats::export_name(path)
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "disk".into()))
}
