//! Reloading `--config FILE` (SIGHUP or `vdisk ctl reload`): reread it and
//! apply the difference to the running daemon through the daemon's own
//! methods (`add`, `remove`, `set_qos`) — the same calls the command line and
//! the control socket make. This module only decides which calls to make.
//!
//! The rules:
//! - A file that does not parse or validate changes nothing.
//! - New exports are added first; if one fails, the ones this reload added are
//!   removed again, and nothing else is touched (the reload failed, changing nothing).
//! - Exports that vanished from the file are removed safely: one with
//!   clients attached stays (and is reported) until a later reload finds it idle.
//! - Changed QoS limits apply live. Other changes to a served export (image,
//!   format, transports) cannot apply without a restart of that export; they
//!   are reported and the export goes on as it was.
//! - With image roots (`--image-root`), what the file adds must lie beneath
//!   them, as for `vdisk ctl add`.
//! - Exports this file did not start (command-line IMAGEs, `vdisk ctl add`)
//!   are never touched; `[server]` changes need a restart and are reported.
//! - What is compared is the file against the file last applied: a QoS set
//!   with `vdisk ctl qos` stays until the file's own limits change. An export
//!   of the file removed with `vdisk ctl remove` is added again.
//! - An export of the file whose device failed (`failure` in `vdisk ctl
//!   list`) is removed and added again as the file says: a reload brings it back.
//!
//! SIGHUP reloads run on a thread of their own ([`Reloader`]), never on the
//! signal thread (a reload that waits on a hung file system must not keep a
//! SIGTERM from being handled): one at a time, SIGHUPs that come meanwhile
//! coalesce into one more reload after it, and each has the control
//! requests' deadline (`--control-timeout`), past which it is given up.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::config::{Config, ServerTable};
use crate::daemon::{Daemon, Origin, Ticket};
use crate::spec::{limits_text, ExportSpec};
use crate::{Error, ErrorKind};

/// The daemon and the config file it follows (`--config FILE`), held
/// through a reload: what SIGHUP and the control socket's `config_reload` call.
pub struct Reload {
    daemon: Arc<Daemon>,
    source: Mutex<Option<Source>>,
}

impl Reload {
    pub fn new(daemon: Arc<Daemon>) -> Reload {
        Reload { daemon, source: Mutex::new(None) }
    }

    /// From now on [`Reload::reload_within`] rereads this config file.
    pub fn follow(&self, source: Source) {
        *self.source.lock().unwrap() = Some(source);
    }

    /// Rereads `--config FILE` and applies the difference (SIGHUP, `vdisk ctl
    /// reload`); tells a service manager it is reloading, then ready again.
    /// A caller may give up (`ticket`): the exports it added are then taken back.
    pub fn reload_within(&self, ticket: &Ticket) -> Result<ReloadReport, Error> {
        // A reload that panicked leaves the last applied file as it was: go on from it.
        let mut config = self.source.lock().unwrap_or_else(|e| e.into_inner());
        let Some(source) = config.as_mut() else {
            log::warn!("reload asked for, but this server was started without --config FILE: nothing to reread");
            return Err(Error::invalid("this server was started without --config FILE: there is nothing to reload"));
        };
        crate::systemd::notify_reloading();
        let done = apply(&self.daemon, source, ticket);
        crate::systemd::notify(&format!("READY=1\nSTATUS={}", self.daemon.status()));
        done
    }
}

/// The config file and the exports it started that are still served.
pub struct Source {
    pub path: PathBuf,
    server: ServerTable,
    managed: Vec<ExportSpec>,
}

impl Source {
    /// After `config`'s exports were all added at start-up.
    pub fn new(config: &Config) -> Source {
        Source { path: config.path.clone(), server: config.server.clone(), managed: config.exports.clone() }
    }
}

/// What a reload did, as `config_reload` answers.
#[derive(Default, Debug, Clone)]
pub struct ReloadReport {
    pub config: PathBuf,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub restarted: Vec<String>,
    pub qos_changed: Vec<String>,
    pub unchanged: Vec<String>,
    /// Exports kept as they were: name, and why.
    pub kept: Vec<(String, String)>,
    pub server_changed: bool,
}

fn name(spec: &ExportSpec) -> String {
    spec.name.clone().unwrap_or_default()
}

/// Rereads the file and applies the difference (module doc: the rules).
/// A `ticket` given up on (the control request's deadline) stops the adds;
/// the ones made are taken back, as for any failed add.
fn apply(daemon: &Daemon, source: &mut Source, ticket: &Ticket) -> Result<ReloadReport, Error> {
    let new = crate::config::load(&source.path).map_err(|f| {
        log::error!("reload: {}; nothing changed", f.report());
        Error::invalid(format!("{}; nothing changed", f.report()))
    })?;
    // The file says what should be served: one of its exports removed with
    // `vdisk ctl remove` since is added again, as new.
    let served = daemon.names();
    source.managed.retain(|m| m.name.as_ref().is_some_and(|n| served.contains(n)));
    let mut report =
        ReloadReport { config: source.path.clone(), server_changed: new.server != source.server, ..Default::default() };
    add_new(daemon, source, &new.exports, &mut report, ticket)?;
    restart_failed(daemon, source, &new.exports, &mut report, ticket);
    for spec in &new.exports {
        change(daemon, source, spec, &mut report);
    }
    remove_vanished(daemon, source, &new.exports, &mut report);
    if report.server_changed {
        log::warn!("reload: [server] in {} changed: that takes effect at the next restart", source.path.display());
    }
    source.server = new.server;
    log::info!(
        "reload of {}: {} added, {} removed, {} restarted, {} QoS changed, {} kept as they were",
        source.path.display(),
        report.added.len(),
        report.removed.len(),
        report.restarted.len(),
        report.qos_changed.len(),
        report.kept.len()
    );
    Ok(report)
}

/// Adds the exports new in the file; on a failure removes those it added and fails.
fn add_new(
    daemon: &Daemon,
    source: &mut Source,
    new: &[ExportSpec],
    report: &mut ReloadReport,
    ticket: &Ticket,
) -> Result<(), Error> {
    let fresh: Vec<&ExportSpec> = new.iter().filter(|s| !source.managed.iter().any(|m| m.name == s.name)).collect();
    for spec in fresh {
        let n = name(spec);
        // Beneath the image roots, if any, as a control-socket add.
        match daemon.add_as(spec.clone(), Origin::Request, ticket) {
            // The daemon logs what it added and removed.
            Ok(_) => {
                report.added.push(n);
                source.managed.push(spec.clone());
            }
            Err(e) => {
                for undo in report.added.drain(..).rev() {
                    if let Err(u) = daemon.remove(&undo, true) {
                        log::warn!(export:% = undo; "reload: cannot take back export {undo:?}: {}", u.report());
                    }
                    source.managed.retain(|m| m.name.as_deref() != Some(undo.as_str()));
                }
                let message = format!("{}: export {n:?}: {}; nothing changed", source.path.display(), e.report());
                log::error!(export:% = n; "reload: {message}");
                return Err(Error::new(e.kind(), message));
            }
        }
    }
    Ok(())
}

/// Brings back the exports of the file whose device failed: each is removed
/// (its failure is no error of the removal) and added again as the file says.
fn restart_failed(
    daemon: &Daemon,
    source: &mut Source,
    new: &[ExportSpec],
    report: &mut ReloadReport,
    ticket: &Ticket,
) {
    for spec in new {
        let n = name(spec);
        if report.added.contains(&n) || !source.managed.iter().any(|m| m.name == spec.name) {
            continue;
        }
        let Some(why) = daemon.failure(&n) else { continue };
        if let Some(now) = daemon.served_image(&n).filter(|now| *now != spec.image) {
            // The file's image is now the backing of `now`: served read-write
            // again it would change what the overlay reads through.
            keep(
                report,
                &n,
                format!(
                    "it had failed ({why}), but a live snapshot moved it from {} to {}: name {} in the file (or \
                     remove the export and add it again) to start it again",
                    spec.image.display(),
                    now.display(),
                    now.display()
                ),
            );
            continue;
        }
        log::warn!(export:% = n; "reload: export {n:?} had failed ({why}): starting it again");
        if let Err(e) = daemon.remove_within(&n, true, ticket) {
            keep(report, &n, format!("it had failed ({why}) and could not be removed to start again: {}", e.report()));
            continue;
        }
        // No longer served: should the add fail, the next reload adds it as new.
        source.managed.retain(|m| m.name != spec.name);
        match daemon.add_as(spec.clone(), Origin::Request, ticket) {
            Ok(_) => {
                report.restarted.push(n);
                source.managed.push(spec.clone());
            }
            Err(e) => keep(
                report,
                &n,
                format!(
                    "it had failed ({why}) and was removed, but adding it again failed: {}; the next reload tries again",
                    e.report()
                ),
            ),
        }
    }
}

/// Applies a changed QoS to an export both in the served set and the file; reports other changes.
fn change(daemon: &Daemon, source: &mut Source, spec: &ExportSpec, report: &mut ReloadReport) {
    let n = name(spec);
    let Some(old) = source.managed.iter_mut().find(|m| m.name == spec.name) else { return };
    if report.added.contains(&n) || report.restarted.contains(&n) {
        return;
    }
    if old == spec {
        report.unchanged.push(n);
        return;
    }
    if old.limits() != spec.limits() {
        match daemon.set_qos(&n, spec.limits()) {
            Ok(()) => {
                log::info!(export:% = n; "reload: export {n:?}: QoS now {}", limits_text(spec.limits()));
                old.set_limits(spec.limits());
                report.qos_changed.push(n.clone());
            }
            Err(e) => keep(report, &n, e.report().to_string()),
        }
    }
    if old != spec {
        keep(
            report,
            &n,
            "only QoS changes apply to a served export: to change the rest, take it out of the file, reload, put it back and reload"
                .into(),
        );
    }
}

fn keep(report: &mut ReloadReport, n: &str, reason: String) {
    log::warn!(export:% = n; "reload: export {n:?} kept as it was: {reason}");
    report.kept.push((n.to_owned(), reason));
}

/// Removes, safely, the exports the file no longer has.
fn remove_vanished(daemon: &Daemon, source: &mut Source, new: &[ExportSpec], report: &mut ReloadReport) {
    let gone: Vec<String> = source.managed.iter().filter(|m| !new.iter().any(|s| s.name == m.name)).map(name).collect();
    for n in gone {
        match daemon.remove(&n, false) {
            Ok(()) => report.removed.push(n.clone()),
            // Removed already (`vdisk ctl remove`): nothing left to do.
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                keep(report, &n, format!("{}; it is removed at a later reload once idle", e.report()));
                continue;
            }
        }
        source.managed.retain(|m| m.name.as_deref() != Some(n.as_str()));
    }
}

/// Runs SIGHUP reloads on their own thread (module doc): one at a time, each
/// under `deadline`; requests that come while one runs coalesce into one more.
pub struct Reloader {
    shared: Arc<Wanted>,
}

#[derive(Default)]
struct Wanted {
    /// (a reload is asked for, a reload is running)
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Reloader {
    /// Starts the reload thread for `reload`.
    pub fn start(reload: Arc<Reload>, deadline: Duration) -> std::io::Result<Reloader> {
        let shared = Arc::new(Wanted::default());
        let s = shared.clone();
        std::thread::Builder::new().name("reload".into()).spawn(move || loop {
            {
                let mut st = s.cond.wait_while(s.state.lock().unwrap(), |st| !st.0).unwrap();
                *st = (false, true);
            }
            reload_once(&reload, deadline);
            s.state.lock().unwrap().1 = false;
        })?;
        Ok(Reloader { shared })
    }

    /// SIGHUP: a reload, now or right after the one running.
    pub fn request(&self) {
        let mut st = self.shared.state.lock().unwrap();
        if st.1 {
            log::warn!("SIGHUP: a reload is still running; one more follows once it has ended");
        } else {
            log::info!("SIGHUP: reloading the config");
        }
        st.0 = true;
        self.shared.cond.notify_all();
    }
}

/// One reload on a thread of its own, given up past `deadline` (then
/// waited for, so reloads never overlap: the next one queues behind it).
fn reload_once(reload: &Arc<Reload>, deadline: Duration) {
    let ticket = Arc::new(Ticket::default());
    let (tx, rx) = mpsc::channel();
    let (r, t) = (reload.clone(), ticket.clone());
    // Its outcome, failures included, is logged by the reload itself.
    let spawned = std::thread::Builder::new().name("reload-run".into()).spawn(move || {
        let _ = tx.send(r.reload_within(&t).is_ok());
    });
    if let Err(e) = spawned {
        log::error!("reload: cannot start a thread for it ({e}); nothing changed");
        return;
    }
    let until = Instant::now() + deadline;
    loop {
        let wait = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) if ticket.abandon() => break,
            // A change is being made right now: wait for it.
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    let made = ticket.made_already().map(|m| format!(" ({m})")).unwrap_or_default();
    log::error!(
        "reload failed: it did not finish within {} s (--control-timeout) and was given up{made}; what it had \
         added is taken back once it ends, the exports served go on (is an image on a slow or hung file system?)",
        deadline.as_secs()
    );
    // The service manager waits for READY=1 after RELOADING=1: the reload is over, failed.
    crate::systemd::notify(&format!("READY=1\nSTATUS=reload failed (past its deadline); {}", reload.daemon.status()));
    // Reloads never overlap: a SIGHUP meanwhile waits for this one to end.
    let _ = rx.recv();
}
