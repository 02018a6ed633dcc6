//! The control socket: JSON-RPC 2.0 over a unix socket, one request object per
//! line, one response per line (docs/control.md describes every method). Each
//! method is a call of the [`Daemon`]; this module only parses, checks and
//! answers, and owns nothing of the exports.
//!
//! Hostile input changes nothing: malformed JSON, an unknown method or wrong
//! params get a JSON-RPC error and the connection goes on; a line over 1 MiB
//! gets an error and the connection is closed; a partial line at EOF (a client
//! that vanished mid-line) is dropped unexecuted. Idle clients cost a parked
//! thread each, up to [`MAX_CLIENTS`]; past that new ones are closed at once,
//! and a client silent for [`IDLE_TIMEOUT`] is closed.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use clap::ValueEnum;
use serde_json::{json, Map, Value};
use vdisk_engine::Limits;

use crate::cli::{BackingArgs, CephArgs, FormatArg};
use crate::daemon::{limits_json, Daemon, ExportSpec, Refusal};
use crate::Failure;

/// The longest request line accepted.
pub const MAX_LINE: usize = 1 << 20;
/// Control clients connected at once.
pub const MAX_CLIENTS: usize = 1024;
/// A client that sends nothing for this long is disconnected.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;

/// The listening control socket; dropping it stops accepting and removes the file.
pub struct ControlSocket {
    path: PathBuf,
    /// Ours to remove at the end (not when the service manager made it).
    remove: bool,
    stopping: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl ControlSocket {
    pub fn start(path: &Path, mode: u32, daemon: Arc<Daemon>) -> Result<ControlSocket, Failure> {
        let listener = crate::serve::bind_unix(path, mode, "--control")?;
        Self::serve(listener, path, true, daemon)
    }

    /// Serves on a socket the service manager made (socket activation), bound at `path`.
    pub fn inherited(listener: UnixListener, path: &Path, daemon: Arc<Daemon>) -> Result<ControlSocket, Failure> {
        Self::serve(listener, path, false, daemon)
    }

    fn serve(listener: UnixListener, path: &Path, remove: bool, daemon: Arc<Daemon>) -> Result<ControlSocket, Failure> {
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let acceptor = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, daemon, stop))
            .map_err(|e| Failure::runtime(format!("cannot start the control socket thread: {e}")))?;
        Ok(ControlSocket { path: path.to_owned(), remove, stopping, acceptor: Some(acceptor) })
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wakes the acceptor out of accept().
        let _ = UnixStream::connect(&self.path);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn accept_loop(listener: UnixListener, daemon: Arc<Daemon>, stopping: Arc<AtomicBool>) {
    let clients = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            clients.fetch_sub(1, Ordering::SeqCst);
            log::warn!("control socket: already {MAX_CLIENTS} clients; closing a new one");
            continue;
        }
        let (daemon, count) = (daemon.clone(), clients.clone());
        let spawned =
            std::thread::Builder::new().name("control-client".into()).stack_size(256 << 10).spawn(move || {
                if let Err(e) = client(stream, &daemon) {
                    log::debug!("control client: {e}");
                }
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            clients.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Answers one client's requests, a line each, until it leaves.
fn client(stream: UnixStream, daemon: &Daemon) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = reader.by_ref().take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line)?;
        if n == 0 || line.last() != Some(&b'\n') {
            if line.len() > MAX_LINE {
                let e = error(Value::Null, INVALID_REQUEST, format!("request line over {MAX_LINE} bytes; closing"));
                writeln!(out, "{e}")?;
                // Closing with unread input would reset the connection and could
                // lose the error on its way: say we are done, drop what still comes.
                out.shutdown(std::net::Shutdown::Write)?;
                reader.get_ref().set_read_timeout(Some(Duration::from_secs(1)))?;
                let _ = std::io::copy(&mut reader.by_ref().take(64 * MAX_LINE as u64), &mut std::io::sink());
            }
            // EOF, maybe mid-line: what was not a whole line is not executed.
            return Ok(());
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if let Some(response) = handle(daemon, &line) {
            writeln!(out, "{response}")?;
        }
    }
}

/// The response to one request line, or None for a notification (no `id`).
pub fn handle(daemon: &Daemon, line: &[u8]) -> Option<Value> {
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
    let result = call(daemon, &method, Params(params));
    id.as_ref()?;
    Some(match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": reply_id, "result": v}),
        Err(r) => error(reply_id, r.code, r.message),
    })
}

fn error(id: Value, code: i64, message: impl Into<String>) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

fn call(daemon: &Daemon, method: &str, mut p: Params) -> Result<Value, Refusal> {
    match method {
        "export_add" => {
            let spec = export_spec(&mut p)?;
            p.done(method)?;
            let name = spec.name.clone().unwrap_or_else(|| crate::daemon::export_name(&spec.image));
            let notes = daemon.add(spec)?;
            Ok(json!({"name": name, "notes": notes}))
        }
        "export_remove" => {
            let (name, hard) = (p.name()?, p.bool("hard")?.unwrap_or(false));
            p.done(method)?;
            daemon.remove(&name, hard)?;
            Ok(json!({"name": name, "removed": true}))
        }
        "export_list" => p.done(method).map(|()| daemon.list()),
        "export_stats" => {
            let name = p.str("name")?;
            p.done(method)?;
            daemon.stats(name.as_deref())
        }
        "export_set_qos" => {
            let name = p.name()?;
            let current = daemon.limits(&name)?;
            let limits = p.limits(current)?;
            p.done(method)?;
            daemon.set_qos(&name, limits)?;
            Ok(json!({"name": name, "qos": limits_json(limits)}))
        }
        "server_info" => p.done(method).map(|()| daemon.info()),
        "config_reload" => p.done(method).and_then(|()| daemon.reload()),
        _ => Err(Refusal {
            code: METHOD_NOT_FOUND,
            message: format!("no method {method:?} (docs/control.md lists them)"),
        }),
    }
}

/// The formats `export_add` takes, as the command line spells them.
const FORMATS: &str = "auto, raw, cow, qcow2";

fn export_spec(p: &mut Params) -> Result<ExportSpec, Refusal> {
    let image = p.str("image")?.ok_or_else(|| bad("\"image\" (the image's path) is required"))?;
    let format = match p.str("format")?.as_deref() {
        None => FormatArg::Auto,
        Some(f) => FormatArg::from_str(f, false).map_err(|_| bad(format!("format {f:?} is not one of {FORMATS}")))?,
    };
    let num_queues = match p.u64("num_queues")? {
        None => None,
        Some(n @ 1..=64) => Some(n as u16),
        Some(n) => return Err(bad(format!("num_queues {n} is not between 1 and 64"))),
    };
    Ok(ExportSpec {
        image: PathBuf::from(image),
        name: p.str("name")?,
        readonly: p.bool("readonly")?.unwrap_or(false),
        format,
        backing: BackingArgs {
            backing: p.str("backing")?.map(PathBuf::from),
            ignore_backing_mtime: p.bool("ignore_backing_mtime")?.unwrap_or(false),
            ceph: CephArgs { ceph_conf: p.str("ceph_conf")?.map(PathBuf::from), ceph_id: p.str("ceph_id")? },
        },
        fuse: p.str("fuse")?.map(PathBuf::from),
        vhost_user_blk: p.str("vhost_user_blk")?.map(PathBuf::from),
        num_queues,
        limits: p.limits(Limits::default())?,
        allow: p.strings("allow")?,
    })
}

fn bad(message: impl Into<String>) -> Refusal {
    Refusal { code: INVALID_PARAMS, message: message.into() }
}

/// A request's params, taken out one by one; what is left over is an error.
struct Params(Map<String, Value>);

impl Params {
    fn str(&mut self, key: &str) -> Result<Option<String>, Refusal> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(bad(format!("{key} must be a string, not {v}"))),
        }
    }

    /// A list of strings (absent: empty).
    fn strings(&mut self, key: &str) -> Result<Vec<String>, Refusal> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    v => Err(bad(format!("{key} must be a list of strings, not one holding {v}"))),
                })
                .collect(),
            Some(v) => Err(bad(format!("{key} must be a list of strings, not {v}"))),
        }
    }

    fn name(&mut self) -> Result<String, Refusal> {
        self.str("name")?.ok_or_else(|| bad("\"name\" (the export's name) is required"))
    }

    fn bool(&mut self, key: &str) -> Result<Option<bool>, Refusal> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(bad(format!("{key} must be true or false, not {v}"))),
        }
    }

    fn u64(&mut self, key: &str) -> Result<Option<u64>, Refusal> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| bad(format!("{key} must be a whole number >= 0, not {v}"))),
        }
    }

    /// QoS fields over `current`: an absent one keeps its value, 0 lifts it.
    fn limits(&mut self, current: Limits) -> Result<Limits, Refusal> {
        Ok(Limits {
            iops: self.u64("iops")?.unwrap_or(current.iops),
            bps: self.u64("bps")?.unwrap_or(current.bps),
            read_bps: self.u64("read_bps")?.unwrap_or(current.read_bps),
            write_bps: self.u64("write_bps")?.unwrap_or(current.write_bps),
        })
    }

    fn done(self, method: &str) -> Result<(), Refusal> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) => Err(bad(format!("{method} takes no parameter {k:?} (docs/control.md lists its params)"))),
        }
    }
}
