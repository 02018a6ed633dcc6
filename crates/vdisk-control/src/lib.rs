//! The control socket: JSON-RPC 2.0 over a unix socket, one request object per
//! line, one response per line (docs/control.md describes every method). Each
//! method is a call of the [`Daemon`]; this module only reads lines, checks
//! who sent them and answers ([`rpc`] parses, with no socket), and owns
//! nothing of the exports.
//!
//! Hostile input changes nothing: malformed JSON, an unknown method or wrong
//! params get a JSON-RPC error and the connection goes on; a line over 1 MiB
//! gets an error and the connection is closed; a partial line at EOF (a client
//! that vanished mid-line) is dropped unexecuted. Idle clients cost a parked
//! thread each, up to [`MAX_CLIENTS`]; past that new ones are closed at once,
//! and a client silent for [`IDLE_TIMEOUT`] is closed.
//!
//! Authority ([`access`]): anyone who can connect may read; changes come only
//! from the server's own user, root or the control group, and each is logged
//! with the peer's uid, gid and pid. No request wedges the socket: a change
//! runs on its own thread under a deadline; past it the client gets an error
//! and the change is given up (nothing half added, [`Ticket`]).

mod access;
pub mod backup;
pub mod bitmaps;
pub mod follow;
pub mod jobs;
pub mod json;
pub mod rpc;
pub mod stats;
pub mod text;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vdisk_daemon::{Daemon, Error, Origin, Reload, Ticket};

pub use access::Access;
use access::Peer;
use rpc::{Fault, Method, INVALID_REQUEST};

/// The longest request line accepted.
pub const MAX_LINE: usize = 1 << 20;
/// Control clients connected at once.
pub const MAX_CLIENTS: usize = 1024;
/// A client that sends nothing for this long is disconnected.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a request may take by default (`--control-timeout`).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// A change refused because of what the caller asked (exit 1 in `vdisk ctl`):
/// the JSON-RPC codes of the daemon's [`vdisk_daemon::ErrorKind`]s.
pub const ERR_NOT_FOUND: i64 = -32001;
pub const ERR_EXISTS: i64 = -32002;
pub const ERR_BUSY: i64 = -32003;
pub const ERR_INVALID: i64 = -32004;
pub const ERR_FAILED: i64 = -32005;
/// A changing request from someone who may only read.
pub const ERR_DENIED: i64 = -32006;

/// What the control socket serves: the daemon, and the config file it follows.
#[derive(Clone)]
pub struct Served {
    pub daemon: Arc<Daemon>,
    pub reload: Arc<Reload>,
}

/// Who may do what on the control socket, and how long a request may take.
#[derive(Clone, Debug)]
pub struct Policy {
    pub access: Access,
    pub deadline: Duration,
    /// Image roots are configured (a socket others can reach requires them).
    pub roots: bool,
}

impl Policy {
    /// Refuses a socket anyone but its owner can reach when there are no image roots.
    fn check(&self, mode: u32, path: &Path) -> Result<(), Error> {
        if Access::reaches_others(mode) && !self.roots {
            return Err(Error::invalid(format!(
                "control socket {} would be mode {mode:04o}: users other than its owner could add any file the \
                 server can open as a disk. Give --image-root DIR (image_roots in [server]) to confine what they \
                 add, or keep --control-mode 0600",
                path.display()
            )));
        }
        Ok(())
    }
}

/// The listening control socket; dropping it stops accepting and removes the file.
pub struct ControlSocket {
    path: PathBuf,
    /// Ours to remove at the end (not when the service manager made it).
    remove: bool,
    stopping: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl ControlSocket {
    /// Binds `path` (0600 until its group and mode are set: nobody else can
    /// connect before they are right) and serves it.
    pub fn start(path: &Path, policy: Policy, served: Served) -> Result<ControlSocket, Error> {
        policy.check(policy.access.mode, path)?;
        let listener = vdisk_daemon::listen::bind_unix(path, 0o600, "--control")?;
        if let Err(e) = policy.access.apply(path) {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Self::serve(listener, path, true, policy, served)
    }

    /// Serves on a socket the service manager made (socket activation), bound at `path`.
    pub fn inherited(
        listener: UnixListener,
        path: &Path,
        policy: Policy,
        served: Served,
    ) -> Result<ControlSocket, Error> {
        use std::os::unix::fs::PermissionsExt;
        // Its mode is the service manager's (SocketMode=): the same rule holds.
        if let Ok(meta) = std::fs::metadata(path) {
            policy.check(meta.permissions().mode() & 0o777, path)?;
        }
        Self::serve(listener, path, false, policy, served)
    }

    fn serve(
        listener: UnixListener,
        path: &Path,
        remove: bool,
        policy: Policy,
        served: Served,
    ) -> Result<ControlSocket, Error> {
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let policy = Arc::new(policy);
        let acceptor = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, served, policy, stop))
            .map_err(|e| Error::failed("cannot start the control socket thread").because(e))?;
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

fn accept_loop(listener: UnixListener, served: Served, policy: Arc<Policy>, stopping: Arc<AtomicBool>) {
    let clients = Arc::new(AtomicUsize::new(0));
    let (mut warned, mut closed) = (None, 0u64);
    loop {
        let accepted = listener.accept();
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok((s, _)) => s,
            // A stopped and continued process gets EINTR: simply accept again.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of descriptors and the like: wait a little rather than spin.
                log::debug!("control socket: accept: {e}");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            clients.fetch_sub(1, Ordering::SeqCst);
            closed += 1;
            // Once in a while, not once per client: a flood must not flood the log too.
            if warned.is_none_or(|w: Instant| w.elapsed() >= Duration::from_secs(10)) {
                log::warn!("control socket: already {MAX_CLIENTS} clients; closed {closed} new one(s)");
                (warned, closed) = (Some(Instant::now()), 0);
            }
            continue;
        }
        let (served, policy, count) = (served.clone(), policy.clone(), clients.clone());
        let spawned =
            std::thread::Builder::new().name("control-client".into()).stack_size(256 << 10).spawn(move || {
                if let Err(e) = client(stream, served, policy) {
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
fn client(stream: UnixStream, served: Served, policy: Arc<Policy>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    let session = Session { peer: Peer::of(&stream)?, served, policy };
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        // read_until and write_all retry EINTR themselves.
        let n = reader.by_ref().take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line)?;
        if n == 0 || line.last() != Some(&b'\n') {
            if line.len() > MAX_LINE {
                let e =
                    rpc::error(Value::Null, INVALID_REQUEST, format!("request line over {MAX_LINE} bytes; closing"));
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
        if let Some(response) = rpc::answer(&session, &line) {
            writeln!(out, "{response}")?;
        }
    }
}

/// One connection: who is at the other end, and what it may do.
struct Session {
    served: Served,
    peer: Peer,
    policy: Arc<Policy>,
}

impl rpc::Handler for Session {
    fn call(&self, method: Method) -> Result<Value, Fault> {
        let p = &self.peer;
        if !method.changes_state() {
            return call(&self.served, method, &Ticket::default()).map_err(fault);
        }
        let what = method.name();
        if !self.policy.access.may_change(p) {
            log::warn!("control: {what} refused: uid {} gid {} pid {} may only read", p.uid, p.gid, p.pid);
            return Err(Fault::new(ERR_DENIED, self.policy.access.refusal(p, what)));
        }
        log::info!("control: {what} from uid {} gid {} pid {}", p.uid, p.gid, p.pid);
        let served = self.served.clone();
        within(self.policy.deadline, what, move |ticket| call(&served, method, ticket)).map_err(fault)
    }
}

/// The daemon's error as a JSON-RPC error: its kind decides the code.
fn fault(e: Error) -> Fault {
    use vdisk_daemon::ErrorKind::*;
    let code = match e.kind() {
        NotFound => ERR_NOT_FOUND,
        Exists => ERR_EXISTS,
        Busy => ERR_BUSY,
        Invalid => ERR_INVALID,
        _ => ERR_FAILED,
    };
    Fault::new(code, e.report().to_string())
}

/// Runs a changing request on its own thread; past `deadline` gives it up
/// (its ticket abandoned, so it changes nothing) and answers with an error.
/// A change already being made when the deadline passes is waited for.
fn within(
    deadline: Duration,
    what: &str,
    change: impl FnOnce(&Ticket) -> Result<Value, Error> + Send + 'static,
) -> Result<Value, Error> {
    let ticket = Arc::new(Ticket::default());
    let (tx, rx) = mpsc::channel();
    let t = ticket.clone();
    std::thread::Builder::new()
        .name("control-change".into())
        .spawn(move || {
            let _ = tx.send(change(&t));
        })
        .map_err(|e| Error::failed(format!("cannot start a thread for {what}")).because(e))?;
    let until = Instant::now() + deadline;
    loop {
        let wait = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Ok(result) => return result,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Error::failed(format!("{what} failed (its thread ended)")))
            }
            Err(mpsc::RecvTimeoutError::Timeout) if ticket.abandon() => {
                log::warn!("control: {what} ran past its deadline of {} s: given up", deadline.as_secs());
                // A removal takes the export out first: that much is done, and said.
                if let Some(made) = ticket.made_already() {
                    return Err(Error::failed(format!(
                        "{what} did not finish within {} s (--control-timeout): {made}",
                        deadline.as_secs()
                    )));
                }
                return Err(Error::failed(format!(
                    "{what} did not finish within {} s (--control-timeout) and was given up: nothing was \
                     changed (is the image on a slow or hung file system?)",
                    deadline.as_secs()
                )));
            }
            // A change is being made right now: wait for it to finish.
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

fn call(served: &Served, method: Method, ticket: &Ticket) -> Result<Value, Error> {
    let daemon = &served.daemon;
    match method {
        Method::ExportAdd(a) => {
            let spec = json::export_spec(a);
            let name = spec.export_name();
            let notes = daemon.add_as(spec, Origin::Request, ticket)?;
            Ok(json!({"name": name, "notes": notes}))
        }
        Method::ExportRemove { name, hard } => {
            daemon.remove_within(&name, hard, ticket)?;
            Ok(json!({"name": name, "removed": true}))
        }
        Method::ExportList => Ok(Value::Array(daemon.list().iter().map(json::export).collect())),
        Method::ExportStats { name } => {
            let stats = daemon.stats(name.as_deref())?;
            let mut all: Vec<Value> = stats.iter().map(json::stats).collect();
            Ok(if name.is_some() { all.pop().unwrap_or(Value::Null) } else { Value::Array(all) })
        }
        Method::ExportSetQos { name, qos } => {
            let limits = json::limits(qos, daemon.limits(&name)?);
            daemon.set_qos_within(&name, limits, ticket)?;
            Ok(json!({"name": name, "qos": json::limits_json(limits)}))
        }
        Method::ServerInfo => Ok(json::info(&daemon.info())),
        Method::ConfigReload => served.reload.reload_within(ticket).map(|r| json::reload(&r)),
        Method::Bitmap(c) => bitmaps::call(daemon, c, ticket),
        Method::ExportSnapshot { name, overlay, format } => jobs::snapshot(daemon, &name, &overlay, format, ticket),
        Method::ExportRbdSnapshot { name, snap } => jobs::rbd_snapshot(daemon, &name, &snap, ticket),
        Method::ExportStream { name, bps } => jobs::stream(daemon, &name, bps, ticket),
        Method::ExportCommit(c) => jobs::commit(daemon, c, ticket),
        Method::JobList => Ok(jobs::list(&daemon.jobs())),
        Method::JobCancel { id } => jobs::ask(daemon, id, false),
        Method::JobPivot { id } => jobs::ask(daemon, id, true),
        Method::ExportMirror { name, to, format, pivot, existing, bps } => {
            jobs::mirror(daemon, &name, &to, format, pivot, existing, bps, ticket)
        }
        Method::BackupBegin(b) => backup::begin(daemon, b, ticket),
        Method::BackupEnd { view } => backup::end(daemon, &view, ticket),
        Method::BackupList => Ok(backup::list(daemon)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_past_its_deadline_is_given_up_and_changes_nothing() {
        let changed = Arc::new(AtomicBool::new(false));
        let c = changed.clone();
        let started = Instant::now();
        let r = within(Duration::from_millis(100), "export_add", move |ticket| {
            // A slow open: the change is made only if the ticket still holds.
            std::thread::sleep(Duration::from_millis(400));
            let _committing = ticket.commit().ok_or(Error::failed("given up"))?;
            c.store(true, Ordering::SeqCst);
            Ok(Value::Null)
        });
        let e = r.unwrap_err();
        assert!(e.message().contains("did not finish within") && e.message().contains("nothing was"), "{}", e.report());
        assert!(started.elapsed() < Duration::from_millis(350), "answered at the deadline, not after the open");
        std::thread::sleep(Duration::from_millis(600));
        assert!(!changed.load(Ordering::SeqCst), "the late open changed nothing");
        assert_eq!(within(Duration::from_secs(5), "x", |_| Ok(json!(1))).unwrap(), json!(1));
    }
}
