//! The `bitmap_*` methods: a parsed [`BitmapCall`] carried out by the
//! daemon, and its answer as JSON (docs/control.md).

use serde_json::{json, Value};
use vdisk_daemon::bitmaps::{BitmapInfo, BitmapOp};
use vdisk_daemon::{Daemon, Error, Ticket};

use crate::rpc::BitmapCall;

/// One bitmap as `bitmap_list` shows it.
pub fn info(b: &BitmapInfo) -> Value {
    json!({
        "name": b.name,
        "granularity": b.granularity,
        "enabled": b.enabled,
        "inconsistent": b.inconsistent,
        "dirty_bytes": b.dirty_bytes,
    })
}

pub fn call(daemon: &Daemon, c: BitmapCall, ticket: &Ticket) -> Result<Value, Error> {
    let name = c.name.clone().unwrap_or_default();
    let op = match c.verb {
        "list" => return Ok(Value::Array(daemon.bitmap_list(&c.export)?.iter().map(info).collect())),
        "add" => BitmapOp::Add { granularity: c.granularity, disabled: c.disabled },
        "remove" => BitmapOp::Remove,
        "clear" => BitmapOp::Clear,
        "enable" => BitmapOp::Enable,
        "disable" => BitmapOp::Disable,
        "merge" => BitmapOp::Merge { sources: c.sources.clone() },
        v => return Err(Error::invalid(format!("no bitmap verb {v:?}"))),
    };
    daemon.bitmap_change(&c.export, &name, &op, ticket)?;
    Ok(json!({"export": c.export, "name": name, "done": c.verb}))
}
