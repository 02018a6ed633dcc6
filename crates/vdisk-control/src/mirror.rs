//! The control methods of copy jobs (docs/control.md): `export_mirror`,
//! `export_active_commit`, `job_cancel`, `job_pivot`, as JSON. Each starts
//! (or steers) a job of the daemon's job table and answers at once; the job
//! runs on its own thread and `job_list` shows how it goes.

use std::path::PathBuf;

use serde_json::{json, Value};
use vdisk_daemon::mirror::{MirrorOptions, MirrorTarget, TargetFormat};
use vdisk_daemon::{Daemon, Error, Ticket};

use crate::rpc::Method;

/// Carries out one of this module's methods (others are a bug of the caller).
pub fn call(daemon: &Daemon, method: Method, ticket: &Ticket) -> Result<Value, Error> {
    let Some(_committing) = ticket.commit() else {
        return Err(Error::failed("the request ran past its deadline and was given up; nothing was changed"));
    };
    match method {
        Method::ExportMirror { name, to, format, pivot, existing, bps } => {
            let format = match format.as_deref() {
                None => TargetFormat::default(),
                Some(f) => TargetFormat::from_name(f)
                    .ok_or_else(|| Error::invalid(format!("format {f:?} is not one of raw, qcow2")))?,
            };
            let o = MirrorOptions { format, pivot, bps, existing };
            let job = daemon.mirror(&name, MirrorTarget::parse(&to), o)?;
            Ok(json!({"job": job, "name": name, "to": to, "format": format.name(), "pivot": pivot}))
        }
        Method::ExportActiveCommit { name, base, delete, bps } => {
            let job = daemon.active_commit(&name, base.map(PathBuf::from), delete, bps)?;
            Ok(json!({"job": job, "name": name}))
        }
        Method::JobCancel { id } => {
            daemon.job_cancel(id)?;
            Ok(json!({"job": id, "cancel": true}))
        }
        Method::JobPivot { id } => {
            daemon.job_pivot(id)?;
            Ok(json!({"job": id, "pivot": true}))
        }
        m => Err(Error::failed(format!("{} is not a copy job's method", m.name()))),
    }
}
