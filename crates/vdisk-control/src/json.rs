//! The daemon's typed answers as the JSON the control socket sends
//! (docs/control.md), and `export_add`'s params as the daemon's
//! [`ExportSpec`]. Presentation only: what is in them is the daemon's.

use std::path::PathBuf;

use serde_json::{json, Value};
use vdisk_daemon::spec::Amount;
use vdisk_daemon::{ExportInfo, ExportSpec, ExportStats, ImageFormat, ReloadReport, ServerInfo};
use vdisk_engine::{EngineKind, Limits};

use crate::rpc::{AddParams, Qos};

pub fn limits_json(l: Limits) -> Value {
    json!({"iops": l.iops, "bps": l.bps, "read_bps": l.read_bps, "write_bps": l.write_bps})
}

/// "serving", or "failed" once the device's engine failed (its requests get
/// EIO until the export is removed and added again).
fn state(failure: &Option<String>) -> &'static str {
    if failure.is_some() {
        "failed"
    } else {
        "serving"
    }
}

/// One entry of `export_list`.
pub fn export(e: &ExportInfo) -> Value {
    let mut transports = vec![json!({"type": "nbd"})];
    if let Some(p) = &e.fuse {
        transports.push(json!({"type": "fuse", "path": p}));
    }
    if let Some(p) = &e.vhost_user_blk {
        transports.push(json!({"type": "vhost-user-blk", "path": p}));
    }
    json!({
        "name": e.name,
        "image": e.image,
        "format": e.format,
        "size": e.size,
        "readonly": e.readonly,
        "connections": e.connections,
        "transports": transports,
        "qos": limits_json(e.qos),
        "state": state(&e.failure),
        "failure": e.failure,
        "allow": e.allow,
    })
}

/// One export's `export_stats`.
pub fn stats(s: &ExportStats) -> Value {
    let mut v = crate::stats::to_json(&s.name, s.connections, &s.snapshot);
    v["state"] = json!(state(&s.failure));
    v["failure"] = json!(s.failure);
    v
}

pub fn info(i: &ServerInfo) -> Value {
    json!({
        "version": i.version,
        "pid": i.pid,
        "uptime_seconds": i.uptime.as_secs(),
        "exports": i.exports,
        "connections": i.connections,
        "engine": match i.engine { EngineKind::Uring => "uring", EngineKind::Threads => "threads", EngineKind::Rbd => "rbd" },
    })
}

pub fn reload(r: &ReloadReport) -> Value {
    let kept: Vec<Value> = r.kept.iter().map(|(n, reason)| json!({"name": n, "reason": reason})).collect();
    json!({
        "config": r.config,
        "added": r.added,
        "removed": r.removed,
        "restarted": r.restarted,
        "qos_changed": r.qos_changed,
        "unchanged": r.unchanged,
        "kept": kept,
        "server_changed": r.server_changed,
    })
}

/// QoS fields over `current`: an absent one keeps its value, 0 lifts it.
pub fn limits(q: Qos, current: Limits) -> Limits {
    Limits {
        iops: q.iops.unwrap_or(current.iops),
        bps: q.bps.unwrap_or(current.bps),
        read_bps: q.read_bps.unwrap_or(current.read_bps),
        write_bps: q.write_bps.unwrap_or(current.write_bps),
    }
}

/// `export_add`'s params (checked by [`crate::rpc`]) as the spec the command
/// line and the config file give: the same keys, the same struct.
pub fn export_spec(a: AddParams) -> ExportSpec {
    let format = match a.format.as_deref() {
        Some("raw") => ImageFormat::Raw,
        Some("cow") => ImageFormat::Cow,
        Some("qcow2") => ImageFormat::Qcow2,
        // rpc checked it is one of FORMATS.
        _ => ImageFormat::Auto,
    };
    ExportSpec {
        image: PathBuf::from(a.image),
        name: a.name,
        readonly: a.readonly,
        format,
        backing: a.backing.map(PathBuf::from),
        ignore_backing_mtime: a.ignore_backing_mtime,
        ceph_conf: a.ceph_conf.map(PathBuf::from),
        ceph_id: a.ceph_id,
        fuse: a.fuse.map(PathBuf::from),
        vhost_user_blk: a.vhost_user_blk.map(PathBuf::from),
        num_queues: a.num_queues,
        iops: a.qos.iops.unwrap_or(0),
        bps: Amount::Number(a.qos.bps.unwrap_or(0)),
        read_bps: Amount::Number(a.qos.read_bps.unwrap_or(0)),
        write_bps: Amount::Number(a.qos.write_bps.unwrap_or(0)),
        allow: a.allow,
    }
}

/// The [`ExportSpec`] of one `export_add` request line (for tests and tools:
/// the same parse and conversion the socket makes).
pub fn export_add_spec(line: &[u8]) -> Result<ExportSpec, crate::rpc::Fault> {
    let req: Value =
        serde_json::from_slice(line).map_err(|e| crate::rpc::Fault::new(crate::rpc::PARSE_ERROR, e.to_string()))?;
    let params = req.get("params").and_then(Value::as_object).cloned().unwrap_or_default();
    match crate::rpc::parse("export_add", crate::rpc::Params(params))? {
        crate::rpc::Method::ExportAdd(a) => Ok(export_spec(a)),
        _ => unreachable!("parsed as export_add"),
    }
}
