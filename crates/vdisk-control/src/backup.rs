//! The `backup_*` methods (point-in-time backup views): a parsed request
//! carried out by the daemon, its answer as JSON and as text for people
//! (docs/control.md).

use serde_json::{json, Value};
use vdisk_daemon::backup::BackupRequest;
use vdisk_daemon::size::human;
use vdisk_daemon::views::BackupInfo;
use vdisk_daemon::{Daemon, Error, Ticket};

use crate::rpc::BackupParams;

/// One backup as the methods answer it.
pub fn info(b: &BackupInfo) -> Value {
    json!({
        "view": b.view,
        "export": b.export,
        "bitmap": b.bitmap,
        "new_bitmap": b.new_bitmap,
        "scratch_dir": b.scratch_dir,
        "copied_bytes": b.copied_bytes,
    })
}

pub fn begin(daemon: &Daemon, p: BackupParams, ticket: &Ticket) -> Result<Value, Error> {
    let r = BackupRequest {
        export: p.export,
        view: p.view,
        bitmap: p.bitmap,
        new_bitmap: p.new_bitmap,
        scratch: p.scratch.map(Into::into),
    };
    Ok(info(&daemon.backup_begin(&r, ticket)?))
}

pub fn end(daemon: &Daemon, view: &str, ticket: &Ticket) -> Result<Value, Error> {
    Ok(info(&daemon.backup_end(view, ticket)?))
}

pub fn list(daemon: &Daemon) -> Value {
    Value::Array(daemon.backup_list().iter().map(info).collect())
}

/// A `backup_*` answer for people.
pub fn text(method: &str, r: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("-").to_owned();
    match method {
        "backup_begin" => format!(
            "export {}: backup view {} begun (bitmap {}, new bitmap {}, scratch in {})\n",
            r["export"],
            r["view"],
            s(&r["bitmap"]),
            s(&r["new_bitmap"]),
            s(&r["scratch_dir"])
        ),
        "backup_end" => format!(
            "backup view {} of export {} ended ({} copied before write)\n",
            r["view"],
            r["export"],
            human(r["copied_bytes"].as_u64().unwrap_or(0))
        ),
        _ => {
            let header = ["VIEW", "EXPORT", "BITMAP", "NEW BITMAP", "COPIED", "SCRATCH DIR"];
            let rows: Vec<Vec<String>> = r
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| {
                    vec![
                        s(&b["view"]),
                        s(&b["export"]),
                        s(&b["bitmap"]),
                        s(&b["new_bitmap"]),
                        human(b["copied_bytes"].as_u64().unwrap_or(0)),
                        s(&b["scratch_dir"]),
                    ]
                })
                .collect();
            crate::stats::render(&header, &rows)
        }
    }
}
