//! The control methods of live disk operations: `export_snapshot`,
//! `export_stream`, `export_commit`, `job_list`, `job_cancel` and
//! `job_pivot` (docs/control.md), as JSON.

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};
use vdisk_daemon::jobs::JobInfo;
use vdisk_daemon::mirror::{MirrorOptions, MirrorTarget, TargetFormat};
use vdisk_daemon::snapshot::OverlayFormat;
use vdisk_daemon::{Daemon, Error, Ticket};

/// The format named `format` (one of `names`), or the default.
fn named<T: Default>(format: Option<String>, parse: fn(&str) -> Option<T>, names: &str) -> Result<T, Error> {
    match format.as_deref() {
        None => Ok(T::default()),
        Some(f) => parse(f).ok_or_else(|| Error::invalid(format!("format {f:?} is not one of {names}"))),
    }
}

/// `export_snapshot`: made unless the request was given up before it started.
pub fn snapshot(
    daemon: &Daemon,
    name: &str,
    overlay: &str,
    format: Option<String>,
    ticket: &Ticket,
) -> Result<Value, Error> {
    let format = named(format, OverlayFormat::from_name, "qcow2, cow")?;
    let _committing = ticket.go_ahead()?;
    let s = daemon.snapshot(name, Path::new(overlay), format)?;
    Ok(json!({
        "job": s.job,
        "name": s.export,
        "overlay": s.overlay,
        "format": s.format.name(),
        "backing": s.backing,
        "backing_format": s.backing_format,
    }))
}

/// `export_snapshot` with `rbd_snap`: made unless the request was given up before it started.
pub fn rbd_snapshot(daemon: &Daemon, name: &str, snap: &str, ticket: &Ticket) -> Result<Value, Error> {
    let _committing = ticket.go_ahead()?;
    let (job, image) = daemon.rbd_snapshot(name, snap)?;
    Ok(json!({"job": job, "name": name, "rbd_snap": format!("{image}@{snap}")}))
}

/// `export_stream`: started as a job; the answer (its id) comes at once.
pub fn stream(daemon: &Arc<Daemon>, name: &str, bps: Option<u64>, ticket: &Ticket) -> Result<Value, Error> {
    let _committing = ticket.go_ahead()?;
    let s = daemon.stream(name, bps.unwrap_or(0))?;
    Ok(json!({"job": s.job, "name": s.export, "type": "stream"}))
}

/// `export_commit`: started as a job; the answer (its id) comes at once.
pub fn commit(daemon: &Arc<Daemon>, c: crate::rpc::CommitParams, ticket: &Ticket) -> Result<Value, Error> {
    let _committing = ticket.go_ahead()?;
    let request = vdisk_daemon::commit::CommitRequest {
        top: c.top.map(Into::into),
        base: c.base.map(Into::into),
        delete: c.delete,
        bps: c.bps.unwrap_or(0),
        active: c.active,
    };
    let s = daemon.commit(&c.name, &request)?;
    Ok(json!({"job": s.job, "name": s.export, "type": "commit"}))
}

/// `export_mirror`: starts a mirror job.
#[allow(clippy::too_many_arguments)]
pub fn mirror(
    daemon: &Daemon,
    name: &str,
    to: &str,
    format: Option<String>,
    pivot: bool,
    existing: bool,
    bps: u64,
    ticket: &Ticket,
) -> Result<Value, Error> {
    let format = named(format, TargetFormat::from_name, "raw, qcow2")?;
    let _committing = ticket.go_ahead()?;
    let o = MirrorOptions { format, pivot, bps, existing };
    let job = daemon.mirror(name, MirrorTarget::parse(to), o)?;
    Ok(json!({"job": job, "name": name, "to": to, "format": format.name(), "pivot": pivot}))
}

/// `job_cancel` and `job_pivot`: the job as it is once asked.
pub fn ask(daemon: &Daemon, id: u64, pivot: bool) -> Result<Value, Error> {
    let job = if pivot { daemon.job_pivot(id)? } else { daemon.job_cancel(id)? };
    Ok(list(&[job])[0].clone())
}

/// `job_list`: every job, oldest first.
pub fn list(jobs: &[JobInfo]) -> Value {
    Value::Array(
        jobs.iter()
            .map(|j| {
                json!({
                    "id": j.id,
                    "type": j.kind,
                    "export": j.export,
                    "done": j.done,
                    "total": j.total,
                    "state": j.state.name(),
                    "error": j.error,
                    "elapsed_ms": j.elapsed.as_millis() as u64,
                    "rate": j.rate,
                    "bps": j.bps,
                    "synchronous": j.synchronous,
                })
            })
            .collect(),
    )
}
