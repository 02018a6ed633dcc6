//! The control methods of live disk operations: `export_snapshot` and
//! `job_list` (docs/control.md), as JSON.

use std::path::Path;

use serde_json::{json, Value};
use vdisk_daemon::jobs::JobInfo;
use vdisk_daemon::snapshot::OverlayFormat;
use vdisk_daemon::{Daemon, Error, Ticket};

/// `export_snapshot`: made unless the request was given up before it started.
pub fn snapshot(
    daemon: &Daemon,
    name: &str,
    overlay: &str,
    format: Option<String>,
    ticket: &Ticket,
) -> Result<Value, Error> {
    let format = match format.as_deref() {
        None => OverlayFormat::default(),
        Some(f) => OverlayFormat::from_name(f)
            .ok_or_else(|| Error::invalid(format!("format {f:?} is not one of qcow2, cow")))?,
    };
    let Some(_committing) = ticket.commit() else {
        return Err(Error::failed("the request ran past its deadline and was given up; nothing was changed"));
    };
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

/// `export_stream`: done by the time it answers (it holds the export's changes meanwhile).
pub fn stream(daemon: &Daemon, name: &str, ticket: &Ticket) -> Result<Value, Error> {
    let Some(_committing) = ticket.commit() else {
        return Err(Error::failed("the request ran past its deadline and was given up; nothing was changed"));
    };
    let s = daemon.stream(name)?;
    Ok(json!({"job": s.job, "name": s.export, "copied": s.copied}))
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
                })
            })
            .collect(),
    )
}
