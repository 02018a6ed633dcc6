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

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::config::{Config, ServerTable};
use crate::daemon::{Daemon, ExportSpec, Origin, Refusal, Ticket, ERR_INVALID, ERR_NOT_FOUND};

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
#[derive(Default)]
struct Report {
    added: Vec<String>,
    removed: Vec<String>,
    qos: Vec<String>,
    unchanged: Vec<String>,
    kept: Vec<Value>,
    server_changed: bool,
}

fn name(spec: &ExportSpec) -> String {
    spec.name.clone().unwrap_or_default()
}

/// Rereads the file and applies the difference (module doc: the rules).
/// A `ticket` given up on (the control request's deadline) stops the adds;
/// the ones made are taken back, as for any failed add.
pub fn apply(daemon: &Daemon, source: &mut Source, ticket: &Ticket) -> Result<Value, Refusal> {
    let new = crate::config::load(&source.path).map_err(|f| {
        log::error!("reload: {f}; nothing changed");
        Refusal { code: ERR_INVALID, message: format!("{f}; nothing changed") }
    })?;
    // The file says what should be served: one of its exports removed with
    // `vdisk ctl remove` since is added again, as new.
    let served = daemon.names();
    source.managed.retain(|m| m.name.as_ref().is_some_and(|n| served.contains(n)));
    let mut report = Report { server_changed: new.server != source.server, ..Default::default() };
    add_new(daemon, source, &new.exports, &mut report, ticket)?;
    for spec in &new.exports {
        change(daemon, source, spec, &mut report);
    }
    remove_vanished(daemon, source, &new.exports, &mut report);
    if report.server_changed {
        log::warn!("reload: [server] in {} changed: that takes effect at the next restart", source.path.display());
    }
    source.server = new.server;
    log::info!(
        "reload of {}: {} added, {} removed, {} QoS changed, {} kept as they were",
        source.path.display(),
        report.added.len(),
        report.removed.len(),
        report.qos.len(),
        report.kept.len()
    );
    Ok(json!({
        "config": source.path,
        "added": report.added,
        "removed": report.removed,
        "qos_changed": report.qos,
        "unchanged": report.unchanged,
        "kept": report.kept,
        "server_changed": report.server_changed,
    }))
}

/// Adds the exports new in the file; on a failure removes those it added and fails.
fn add_new(
    daemon: &Daemon,
    source: &mut Source,
    new: &[ExportSpec],
    report: &mut Report,
    ticket: &Ticket,
) -> Result<(), Refusal> {
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
                        log::warn!(export:% = undo; "reload: cannot take back export {undo:?}: {}", u.message);
                    }
                    source.managed.retain(|m| m.name.as_deref() != Some(undo.as_str()));
                }
                let message = format!("{}: export {n:?}: {}; nothing changed", source.path.display(), e.message);
                log::error!(export:% = n; "reload: {message}");
                return Err(Refusal { code: e.code, message });
            }
        }
    }
    Ok(())
}

/// Applies a changed QoS to an export both in the served set and the file; reports other changes.
fn change(daemon: &Daemon, source: &mut Source, spec: &ExportSpec, report: &mut Report) {
    let n = name(spec);
    let Some(old) = source.managed.iter_mut().find(|m| m.name == spec.name) else { return };
    if report.added.contains(&n) {
        return;
    }
    if old == spec {
        report.unchanged.push(n);
        return;
    }
    if old.limits != spec.limits {
        match daemon.set_qos(&n, spec.limits) {
            Ok(()) => {
                log::info!(export:% = n; "reload: export {n:?}: QoS now {}", crate::daemon::limits_json(spec.limits));
                old.limits = spec.limits;
                report.qos.push(n.clone());
            }
            Err(e) => keep(report, &n, e.message),
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

fn keep(report: &mut Report, n: &str, reason: String) {
    log::warn!(export:% = n; "reload: export {n:?} kept as it was: {reason}");
    report.kept.push(json!({"name": n, "reason": reason}));
}

/// Removes, safely, the exports the file no longer has.
fn remove_vanished(daemon: &Daemon, source: &mut Source, new: &[ExportSpec], report: &mut Report) {
    let gone: Vec<String> = source.managed.iter().filter(|m| !new.iter().any(|s| s.name == m.name)).map(name).collect();
    for n in gone {
        match daemon.remove(&n, false) {
            Ok(()) => report.removed.push(n.clone()),
            // Removed already (`vdisk ctl remove`): nothing left to do.
            Err(e) if e.code == ERR_NOT_FOUND => {}
            Err(e) => {
                keep(report, &n, format!("{}; it is removed at a later reload once idle", e.message));
                continue;
            }
        }
        source.managed.retain(|m| m.name.as_deref() != Some(n.as_str()));
    }
}
