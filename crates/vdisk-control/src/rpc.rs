//! The control socket's JSON-RPC 2.0, with no socket and no daemon: one
//! request line in, one response line out ([`answer`]). Parsing turns the
//! untrusted line into a typed [`Method`] (every param checked for its type,
//! unknown ones refused) and hands it to a [`Handler`]; what the handler
//! answers becomes the response. The daemon is one handler, the fuzz target
//! (fuzz/fuzz_targets/control_rpc.rs, which includes this file) another.
//!
//! Depends on serde_json alone, on purpose: the fuzz crate compiles this file.

use serde_json::{json, Map, Value};

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;

/// The formats `export_add` takes, as the command line spells them.
pub const FORMATS: [&str; 4] = ["auto", "raw", "cow", "qcow2"];

/// QoS fields a request gave; an absent one keeps its value, 0 lifts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Qos {
    pub iops: Option<u64>,
    pub bps: Option<u64>,
    pub read_bps: Option<u64>,
    pub write_bps: Option<u64>,
}

/// `export_add`'s params, type-checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddParams {
    pub image: String,
    pub name: Option<String>,
    pub readonly: bool,
    /// One of [`FORMATS`].
    pub format: Option<String>,
    pub backing: Option<String>,
    pub ignore_backing_mtime: bool,
    pub ceph_conf: Option<String>,
    pub ceph_id: Option<String>,
    pub fuse: Option<String>,
    pub vhost_user_blk: Option<String>,
    /// 1 to 64, as the command line's `--num-queues` takes it.
    pub num_queues: Option<u64>,
    pub qos: Qos,
    /// Who may open the export over TLS (certificate patterns, PSK identities); empty: anyone.
    pub allow: Vec<String>,
}

/// One request, parsed (docs/control.md describes each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    ExportAdd(AddParams),
    ExportRemove {
        name: String,
        hard: bool,
    },
    ExportList,
    ExportStats {
        name: Option<String>,
    },
    ExportSetQos {
        name: String,
        qos: Qos,
    },
    ServerInfo,
    ConfigReload,
    /// A new overlay over the export's top, switched to live; `format` is "qcow2" (default) or "cow".
    ExportSnapshot {
        name: String,
        overlay: String,
        format: Option<String>,
    },
    /// `export_snapshot` with `rbd_snap`: an RBD snapshot of an RBD export's image.
    ExportRbdSnapshot {
        name: String,
        snap: String,
    },
    /// Copy the backing chain into the export's qcow2 top and drop the chain (a job).
    ExportStream {
        name: String,
        /// The job's own I/O limit, bytes per second.
        bps: Option<u64>,
    },
    /// Merge layers of the export's chain down into a lower one (a job).
    ExportCommit(CommitParams),
    JobList,
    /// Mirror the export to a file or NBD export (`to`); `format` "raw" (default) or "qcow2".
    ExportMirror {
        name: String,
        to: String,
        format: Option<String>,
        pivot: bool,
        existing: bool,
        bps: u64,
    },
    /// Commit the export's live top (and the layers above `base`) into `base` (default: the chain's bottom).
    /// Ask a running job to stop, leaving its export as it was.
    JobCancel {
        id: u64,
    },
    /// Ask a ready mirror or active commit to switch its export.
    JobPivot {
        id: u64,
    },
    /// `bitmap_*`: one export's dirty bitmaps.
    Bitmap(BitmapCall),
    /// `backup_begin`: a point-in-time view `view` of export `export` (fleecing).
    BackupBegin(BackupParams),
    /// `backup_end`: drop view `view` and its scratch data.
    BackupEnd {
        view: String,
    },
    /// `backup_list`: the backups in progress.
    BackupList,
}

/// `backup_begin`'s params, type-checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupParams {
    pub export: String,
    pub view: String,
    pub bitmap: Option<String>,
    pub new_bitmap: Option<String>,
    pub scratch: Option<String>,
}

fn backup_params(p: &mut Params) -> Result<Method, Fault> {
    let export = p.str("export")?.ok_or_else(|| bad("\"export\" (the export backed up) is required"))?;
    let view = p.str("view")?.ok_or_else(|| bad("\"view\" (the name of the view's NBD export) is required"))?;
    let (bitmap, new_bitmap, scratch) = (p.str("bitmap")?, p.str("new_bitmap")?, p.str("scratch")?);
    Ok(Method::BackupBegin(BackupParams { export, view, bitmap, new_bitmap, scratch }))
}

/// `export_commit`'s params, type-checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitParams {
    pub name: String,
    /// The highest layer merged (a path of the chain); default: the one below the live top.
    pub top: Option<String>,
    /// The layer merged into; default: the bottom of the chain.
    pub base: Option<String>,
    /// Remove the dropped layers' files once the new chain serves.
    pub delete: bool,
    pub bps: Option<u64>,
    /// Commit the live top itself (an active commit: a mirror into the base).
    pub active: bool,
}

/// The bitmap verbs (`bitmap_add` ... `bitmap_list`).
pub const BITMAP_VERBS: [&str; 7] = ["add", "remove", "clear", "enable", "disable", "merge", "list"];

/// A `bitmap_*` request's params, type-checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapCall {
    /// One of [`BITMAP_VERBS`].
    pub verb: &'static str,
    pub export: String,
    /// The bitmap (all but `list`).
    pub name: Option<String>,
    pub granularity: Option<u64>,
    pub disabled: bool,
    /// `merge`: the bitmaps merged into `name`.
    pub sources: Vec<String>,
}

fn bitmap_call(verb: &'static str, p: &mut Params) -> Result<BitmapCall, Fault> {
    let export = p.str("export")?.ok_or_else(|| bad("\"export\" (the export's name) is required"))?;
    let name = p.str("name")?;
    if name.is_none() && verb != "list" {
        return Err(bad(format!("bitmap_{verb}: \"name\" (the bitmap's name) is required")));
    }
    let (mut granularity, mut disabled, mut sources) = (None, false, Vec::new());
    if verb == "add" {
        granularity = p.u64("granularity")?;
        disabled = p.bool("disabled")?.unwrap_or(false);
    }
    if verb == "merge" {
        sources = p.strings("sources")?;
        if sources.is_empty() {
            return Err(bad("bitmap_merge: \"sources\" (the bitmaps merged into \"name\") is required"));
        }
    }
    Ok(BitmapCall { verb, export, name, granularity, disabled, sources })
}

impl Method {
    /// True for the requests that change what is served (only the server's
    /// own user, root and the control group may send them).
    pub fn changes_state(&self) -> bool {
        match self {
            Method::Bitmap(b) => b.verb != "list",
            m => !matches!(
                m,
                Method::ExportList
                    | Method::ExportStats { .. }
                    | Method::ServerInfo
                    | Method::JobList
                    | Method::BackupList
            ),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Method::ExportAdd(_) => "export_add",
            Method::ExportRemove { .. } => "export_remove",
            Method::ExportList => "export_list",
            Method::ExportStats { .. } => "export_stats",
            Method::ExportSetQos { .. } => "export_set_qos",
            Method::ServerInfo => "server_info",
            Method::ConfigReload => "config_reload",
            Method::Bitmap(b) => match b.verb {
                "add" => "bitmap_add",
                "remove" => "bitmap_remove",
                "clear" => "bitmap_clear",
                "enable" => "bitmap_enable",
                "disable" => "bitmap_disable",
                "merge" => "bitmap_merge",
                _ => "bitmap_list",
            },
            Method::ExportSnapshot { .. } | Method::ExportRbdSnapshot { .. } => "export_snapshot",
            Method::ExportStream { .. } => "export_stream",
            Method::ExportCommit(_) => "export_commit",
            Method::JobList => "job_list",
            Method::ExportMirror { .. } => "export_mirror",
            Method::JobCancel { .. } => "job_cancel",
            Method::JobPivot { .. } => "job_pivot",
            Method::BackupBegin(_) => "backup_begin",
            Method::BackupEnd { .. } => "backup_end",
            Method::BackupList => "backup_list",
        }
    }
}

/// A JSON-RPC error: its code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub code: i64,
    pub message: String,
}

impl Fault {
    pub fn new(code: i64, message: impl Into<String>) -> Fault {
        Fault { code, message: message.into() }
    }
}

/// What carries out a parsed request.
pub trait Handler {
    fn call(&self, method: Method) -> Result<Value, Fault>;
}

/// The response line (no newline) to one request line, or None for a
/// notification (a request without `id`, which is still carried out).
pub fn answer(handler: &dyn Handler, line: &[u8]) -> Option<String> {
    respond(handler, line).map(|v| v.to_string())
}

/// As [`answer`], the response as a JSON value.
pub fn respond(handler: &dyn Handler, line: &[u8]) -> Option<Value> {
    let req: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return Some(error(Value::Null, PARSE_ERROR, format!("parse error: {e}"))),
    };
    let Value::Object(mut req) = req else {
        return Some(error(Value::Null, INVALID_REQUEST, "a request is one JSON object (batches are not supported)"));
    };
    let id = req.remove("id");
    let reply_id = id.clone().unwrap_or(Value::Null);
    if !matches!(reply_id, Value::Null | Value::String(_) | Value::Number(_)) {
        return Some(error(Value::Null, INVALID_REQUEST, "id must be a string, a number or null"));
    }
    if req.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Some(error(reply_id, INVALID_REQUEST, "\"jsonrpc\": \"2.0\" is missing"));
    }
    let Some(Value::String(method)) = req.remove("method") else {
        return Some(error(reply_id, INVALID_REQUEST, "\"method\" must be a string"));
    };
    let params = match req.remove("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => return Some(error(reply_id, INVALID_PARAMS, "params must be an object (by name)")),
    };
    let result = parse(&method, Params(params)).and_then(|m| handler.call(m));
    id.as_ref()?;
    Some(match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": reply_id, "result": v}),
        Err(f) => error(reply_id, f.code, f.message),
    })
}

/// An error response.
pub fn error(id: Value, code: i64, message: impl Into<String>) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

/// The method and its params, every one checked; what is left over is an error.
pub fn parse(method: &str, mut p: Params) -> Result<Method, Fault> {
    let m = match method {
        "export_add" => Method::ExportAdd(add_params(&mut p)?),
        "export_remove" => Method::ExportRemove { name: p.name()?, hard: p.bool("hard")?.unwrap_or(false) },
        "export_list" => Method::ExportList,
        "export_stats" => Method::ExportStats { name: p.str("name")? },
        "export_set_qos" => Method::ExportSetQos { name: p.name()?, qos: p.qos()? },
        "server_info" => Method::ServerInfo,
        "config_reload" => Method::ConfigReload,
        m if m.strip_prefix("bitmap_").is_some_and(|v| BITMAP_VERBS.contains(&v)) => {
            let verb = BITMAP_VERBS.iter().find(|v| m.ends_with(*v) && m.len() == 7 + v.len()).expect("matched");
            Method::Bitmap(bitmap_call(verb, &mut p)?)
        }
        "export_snapshot" => snapshot_params(&mut p)?,
        "export_stream" => Method::ExportStream { name: p.name()?, bps: p.u64("bps")? },
        "export_commit" => Method::ExportCommit(CommitParams {
            name: p.name()?,
            top: p.str("top")?,
            base: p.str("base")?,
            delete: p.bool("delete")?.unwrap_or(false),
            bps: p.u64("bps")?,
            active: p.bool("active")?.unwrap_or(false),
        }),
        "job_list" => Method::JobList,
        "job_cancel" => Method::JobCancel { id: p.id()? },
        "job_pivot" => Method::JobPivot { id: p.id()? },
        "export_mirror" => mirror_params(&mut p)?,
        "backup_begin" => backup_params(&mut p)?,
        "backup_end" => {
            Method::BackupEnd { view: p.str("view")?.ok_or_else(|| bad("\"view\" (the view to end) is required"))? }
        }
        "backup_list" => Method::BackupList,
        _ => {
            return Err(Fault::new(METHOD_NOT_FOUND, format!("no method {method:?} (docs/control.md lists them)")));
        }
    };
    p.done(method)?;
    Ok(m)
}

fn add_params(p: &mut Params) -> Result<AddParams, Fault> {
    let image = p.str("image")?.ok_or_else(|| bad("\"image\" (the image's path) is required"))?;
    let format = p.one_of("format", &FORMATS)?;
    Ok(AddParams {
        image,
        name: p.str("name")?,
        readonly: p.bool("readonly")?.unwrap_or(false),
        format,
        backing: p.str("backing")?,
        ignore_backing_mtime: p.bool("ignore_backing_mtime")?.unwrap_or(false),
        ceph_conf: p.str("ceph_conf")?,
        ceph_id: p.str("ceph_id")?,
        fuse: p.str("fuse")?,
        vhost_user_blk: p.str("vhost_user_blk")?,
        num_queues: match p.u64("num_queues")? {
            Some(n @ (0 | 65..)) => return Err(bad(format!("num_queues {n} is not between 1 and 64"))),
            n => n,
        },
        qos: p.qos()?,
        allow: p.strings("allow")?,
    })
}

fn snapshot_params(p: &mut Params) -> Result<Method, Fault> {
    let name = p.name()?;
    let format = p.one_of("format", &["qcow2", "cow"])?;
    match (p.str("overlay")?, p.str("rbd_snap")?) {
        (Some(overlay), None) => Ok(Method::ExportSnapshot { name, overlay, format }),
        (None, Some(snap)) if format.is_none() => Ok(Method::ExportRbdSnapshot { name, snap }),
        (None, Some(_)) => Err(bad("\"format\" is an overlay's: an RBD snapshot (\"rbd_snap\") has none")),
        (Some(_), Some(_)) => Err(bad("give \"overlay\" (a new top) or \"rbd_snap\" (an RBD snapshot), not both")),
        (None, None) => Err(bad(
            "\"overlay\" (the new top's path) is required, or \"rbd_snap\" (a snapshot's name) for an RBD export",
        )),
    }
}

fn mirror_params(p: &mut Params) -> Result<Method, Fault> {
    let name = p.name()?;
    let to = p.str("to")?.ok_or_else(|| bad("\"to\" (the target: a new file's path or an NBD URI) is required"))?;
    let format = p.one_of("format", &["raw", "qcow2"])?;
    let pivot = p.bool("pivot")?.unwrap_or(false);
    let existing = p.bool("existing")?.unwrap_or(false);
    Ok(Method::ExportMirror { name, to, format, pivot, existing, bps: p.u64("bps")?.unwrap_or(0) })
}

fn bad(message: impl Into<String>) -> Fault {
    Fault::new(INVALID_PARAMS, message)
}

/// A request's params, taken out one by one.
pub struct Params(pub Map<String, Value>);

impl Params {
    fn str(&mut self, key: &str) -> Result<Option<String>, Fault> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(bad(format!("{key} must be a string, not {}", short(&v)))),
        }
    }

    /// A string that must be one of `names`, if given.
    fn one_of(&mut self, key: &str, names: &[&str]) -> Result<Option<String>, Fault> {
        let s = self.str(key)?;
        match &s {
            Some(v) if !names.contains(&v.as_str()) => {
                Err(bad(format!("{key} {v:?} is not one of {}", names.join(", "))))
            }
            _ => Ok(s),
        }
    }

    /// A list of strings (absent: empty).
    fn strings(&mut self, key: &str) -> Result<Vec<String>, Fault> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    v => Err(bad(format!("{key} must be a list of strings, not one holding {}", short(&v)))),
                })
                .collect(),
            Some(v) => Err(bad(format!("{key} must be a list of strings, not {}", short(&v)))),
        }
    }

    fn name(&mut self) -> Result<String, Fault> {
        self.str("name")?.ok_or_else(|| bad("\"name\" (the export's name) is required"))
    }

    /// A job's id.
    fn id(&mut self) -> Result<u64, Fault> {
        self.u64("id")?.ok_or_else(|| bad("\"id\" (the job's number, as job_list shows it) is required"))
    }

    fn bool(&mut self, key: &str) -> Result<Option<bool>, Fault> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(bad(format!("{key} must be true or false, not {}", short(&v)))),
        }
    }

    fn u64(&mut self, key: &str) -> Result<Option<u64>, Fault> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                v.as_u64().map(Some).ok_or_else(|| bad(format!("{key} must be a whole number >= 0, not {}", short(&v))))
            }
        }
    }

    fn qos(&mut self) -> Result<Qos, Fault> {
        Ok(Qos {
            iops: self.u64("iops")?,
            bps: self.u64("bps")?,
            read_bps: self.u64("read_bps")?,
            write_bps: self.u64("write_bps")?,
        })
    }

    fn done(self, method: &str) -> Result<(), Fault> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) => Err(bad(format!("{method} takes no parameter {k:?} (docs/control.md lists its params)"))),
        }
    }
}

/// A value as an error message quotes it: at most 100 characters of it.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(100) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers every request with its method's name.
    struct Echo;

    impl Handler for Echo {
        fn call(&self, m: Method) -> Result<Value, Fault> {
            Ok(json!(m.name()))
        }
    }

    fn ask(line: &str) -> Value {
        serde_json::from_str(&answer(&Echo, line.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn a_line_in_gives_a_line_out() {
        assert_eq!(ask(r#"{"jsonrpc":"2.0","id":1,"method":"export_list"}"#)["result"], "export_list");
        assert_eq!(ask("{").get("error").unwrap()["code"], PARSE_ERROR);
        assert_eq!(ask("[1]")["error"]["code"], INVALID_REQUEST);
        let v = ask(r#"{"jsonrpc":"2.0","id":"a","method":"export_add","params":{"image":"/x","format":"vmdk"}}"#);
        assert_eq!((v["id"].as_str(), v["error"]["code"].as_i64()), (Some("a"), Some(INVALID_PARAMS)));
        assert!(answer(&Echo, br#"{"jsonrpc":"2.0","method":"server_info"}"#).is_none(), "a notification");
        let long =
            format!(r#"{{"jsonrpc":"2.0","id":1,"method":"export_remove","params":{{"name":"{}"}}}}"#, "x".repeat(9));
        assert_eq!(ask(&long)["result"], "export_remove");
    }

    #[test]
    fn changing_requests_are_told_apart() {
        let add = Method::ExportAdd(AddParams { image: "/x".into(), ..Default::default() });
        assert!(add.changes_state() && Method::ConfigReload.changes_state());
        assert!(!Method::ExportList.changes_state() && !Method::ServerInfo.changes_state());
    }

    #[test]
    fn a_snapshot_is_an_overlay_or_an_rbd_snapshot_never_both() {
        let p = |j: &str| Params(serde_json::from_str(j).unwrap());
        let m = parse("export_snapshot", p(r#"{"name":"d","rbd_snap":"s1"}"#)).unwrap();
        assert_eq!(m, Method::ExportRbdSnapshot { name: "d".into(), snap: "s1".into() });
        for bad in [
            r#"{"name":"d"}"#,
            r#"{"name":"d","rbd_snap":"s","overlay":"/o"}"#,
            r#"{"name":"d","rbd_snap":"s","format":"cow"}"#,
        ] {
            assert_eq!(parse("export_snapshot", p(bad)).unwrap_err().code, INVALID_PARAMS, "{bad}");
        }
    }

    #[test]
    fn bitmap_methods_are_parsed_and_checked() {
        let v = ask(
            r#"{"jsonrpc":"2.0","id":1,"method":"bitmap_add","params":{"export":"d","name":"b","granularity":4096}}"#,
        );
        assert_eq!(v["result"], "bitmap_add");
        let p = |j: &str| Params(serde_json::from_str(j).unwrap());
        let Method::Bitmap(c) = parse("bitmap_merge", p(r#"{"export":"d","name":"b","sources":["x","y"]}"#)).unwrap()
        else {
            panic!("not a bitmap call")
        };
        assert_eq!((c.verb, c.sources.len()), ("merge", 2));
        assert!(Method::Bitmap(c).changes_state());
        let list = parse("bitmap_list", p(r#"{"export":"d"}"#)).unwrap();
        assert!(!list.changes_state() && list.name() == "bitmap_list");
        for (m, j) in [
            ("bitmap_add", r#"{"export":"d"}"#),
            ("bitmap_merge", r#"{"export":"d","name":"b"}"#),
            ("bitmap_clear", r#"{"name":"b"}"#),
            ("bitmap_clear", r#"{"export":"d","name":"b","granularity":1}"#),
            ("bitmap_list", r#"{"export":"d","sources":[]}"#),
        ] {
            assert_eq!(parse(m, p(j)).unwrap_err().code, INVALID_PARAMS, "{m} {j}");
        }
        assert_eq!(parse("bitmap_frob", p("{}")).unwrap_err().code, METHOD_NOT_FOUND);
    }

    #[test]
    fn job_methods_are_parsed_and_checked() {
        let p = |j: &str| Params(serde_json::from_str(j).unwrap());
        assert_eq!(parse("job_cancel", p(r#"{"id":3}"#)).unwrap(), Method::JobCancel { id: 3 });
        assert!(parse("job_pivot", p(r#"{"id":3}"#)).unwrap().changes_state());
        assert_eq!(parse("job_pivot", p("{}")).unwrap_err().code, INVALID_PARAMS);
        assert_eq!(parse("job_cancel", p(r#"{"id":"3"}"#)).unwrap_err().code, INVALID_PARAMS);
        let c = parse("export_commit", p(r#"{"name":"d","top":"/m.qcow2","delete":true,"bps":1048576}"#)).unwrap();
        let want = CommitParams {
            name: "d".into(),
            top: Some("/m.qcow2".into()),
            delete: true,
            bps: Some(1 << 20),
            ..Default::default()
        };
        assert_eq!(c, Method::ExportCommit(want));
        assert_eq!(parse("export_stream", p(r#"{"name":"d","bps":-1}"#)).unwrap_err().code, INVALID_PARAMS);
    }

    #[test]
    fn backup_methods_are_parsed_and_checked() {
        let p = |j: &str| Params(serde_json::from_str(j).unwrap());
        let m = parse("backup_begin", p(r#"{"export":"d","view":"v","bitmap":"b","new_bitmap":"b2"}"#)).unwrap();
        let Method::BackupBegin(b) = &m else { panic!("not a backup") };
        assert_eq!((b.bitmap.as_deref(), b.new_bitmap.as_deref(), b.scratch.as_deref()), (Some("b"), Some("b2"), None));
        assert!(m.changes_state() && m.name() == "backup_begin");
        assert_eq!(parse("backup_end", p(r#"{"view":"v"}"#)).unwrap(), Method::BackupEnd { view: "v".into() });
        assert!(!parse("backup_list", p("{}")).unwrap().changes_state());
        for (m, params) in [
            ("backup_begin", r#"{"export":"d"}"#),
            ("backup_begin", r#"{"view":"v"}"#),
            ("backup_begin", r#"{"export":"d","view":"v","bitmap":1}"#),
            ("backup_begin", r#"{"export":"d","view":"v","frob":true}"#),
            ("backup_end", r#"{}"#),
        ] {
            assert_eq!(parse(m, p(params)).unwrap_err().code, INVALID_PARAMS, "{m} {params}");
        }
    }
}
