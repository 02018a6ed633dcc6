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
pub mod rpc;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vdisk_engine::Limits;

pub use access::Access;
use access::Peer;
use rpc::{AddParams, Fault, Method, Qos, INVALID_REQUEST};

use crate::cli::{BackingArgs, CephArgs, FormatArg};
use crate::daemon::{limits_json, Daemon, ExportSpec, Origin, Refusal, Ticket, ERR_FAILED};
use crate::Failure;

/// The longest request line accepted.
pub const MAX_LINE: usize = 1 << 20;
/// Control clients connected at once.
pub const MAX_CLIENTS: usize = 1024;
/// A client that sends nothing for this long is disconnected.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a request may take by default (`--control-timeout`).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// A changing request from someone who may only read.
pub const ERR_DENIED: i64 = -32006;

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
    fn check(&self, mode: u32, path: &Path) -> Result<(), Failure> {
        if Access::reaches_others(mode) && !self.roots {
            return Err(Failure::usage(format!(
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
    pub fn start(path: &Path, policy: Policy, daemon: Arc<Daemon>) -> Result<ControlSocket, Failure> {
        policy.check(policy.access.mode, path)?;
        let listener = crate::serve::bind_unix(path, 0o600, "--control")?;
        if let Err(e) = policy.access.apply(path) {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Self::serve(listener, path, true, policy, daemon)
    }

    /// Serves on a socket the service manager made (socket activation), bound at `path`.
    pub fn inherited(
        listener: UnixListener,
        path: &Path,
        policy: Policy,
        daemon: Arc<Daemon>,
    ) -> Result<ControlSocket, Failure> {
        use std::os::unix::fs::PermissionsExt;
        // Its mode is the service manager's (SocketMode=): the same rule holds.
        if let Ok(meta) = std::fs::metadata(path) {
            policy.check(meta.permissions().mode() & 0o777, path)?;
        }
        Self::serve(listener, path, false, policy, daemon)
    }

    fn serve(
        listener: UnixListener,
        path: &Path,
        remove: bool,
        policy: Policy,
        daemon: Arc<Daemon>,
    ) -> Result<ControlSocket, Failure> {
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let policy = Arc::new(policy);
        let acceptor = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, daemon, policy, stop))
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

fn accept_loop(listener: UnixListener, daemon: Arc<Daemon>, policy: Arc<Policy>, stopping: Arc<AtomicBool>) {
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
        let (daemon, policy, count) = (daemon.clone(), policy.clone(), clients.clone());
        let spawned =
            std::thread::Builder::new().name("control-client".into()).stack_size(256 << 10).spawn(move || {
                if let Err(e) = client(stream, daemon, policy) {
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
fn client(stream: UnixStream, daemon: Arc<Daemon>, policy: Arc<Policy>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    let session = Session { peer: Peer::of(&stream)?, daemon, policy };
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
    daemon: Arc<Daemon>,
    peer: Peer,
    policy: Arc<Policy>,
}

impl rpc::Handler for Session {
    fn call(&self, method: Method) -> Result<Value, Fault> {
        let p = &self.peer;
        if !method.changes_state() {
            return call(&self.daemon, method, &Ticket::default()).map_err(fault);
        }
        let what = method.name();
        if !self.policy.access.may_change(p) {
            log::warn!("control: {what} refused: uid {} gid {} pid {} may only read", p.uid, p.gid, p.pid);
            return Err(Fault::new(ERR_DENIED, self.policy.access.refusal(p, what)));
        }
        log::info!("control: {what} from uid {} gid {} pid {}", p.uid, p.gid, p.pid);
        let daemon = self.daemon.clone();
        within(self.policy.deadline, what, move |ticket| call(&daemon, method, ticket)).map_err(fault)
    }
}

fn fault(r: Refusal) -> Fault {
    Fault::new(r.code, r.message)
}

/// Runs a changing request on its own thread; past `deadline` gives it up
/// (its ticket abandoned, so it changes nothing) and answers with an error.
/// A change already being made when the deadline passes is waited for.
fn within(
    deadline: Duration,
    what: &str,
    change: impl FnOnce(&Ticket) -> Result<Value, Refusal> + Send + 'static,
) -> Result<Value, Refusal> {
    let ticket = Arc::new(Ticket::default());
    let (tx, rx) = mpsc::channel();
    let t = ticket.clone();
    std::thread::Builder::new()
        .name("control-change".into())
        .spawn(move || {
            let _ = tx.send(change(&t));
        })
        .map_err(|e| Refusal { code: ERR_FAILED, message: format!("cannot start a thread for {what}: {e}") })?;
    let until = Instant::now() + deadline;
    loop {
        let wait = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Ok(result) => return result,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Refusal { code: ERR_FAILED, message: format!("{what} failed (its thread ended)") })
            }
            Err(mpsc::RecvTimeoutError::Timeout) if ticket.abandon() => {
                log::warn!("control: {what} ran past its deadline of {} s: given up", deadline.as_secs());
                // A removal takes the export out first: that much is done, and said.
                if let Some(made) = ticket.made_already() {
                    return Err(Refusal {
                        code: ERR_FAILED,
                        message: format!(
                            "{what} did not finish within {} s (--control-timeout): {made}",
                            deadline.as_secs()
                        ),
                    });
                }
                return Err(Refusal {
                    code: ERR_FAILED,
                    message: format!(
                        "{what} did not finish within {} s (--control-timeout) and was given up: nothing was \
                         changed (is the image on a slow or hung file system?)",
                        deadline.as_secs()
                    ),
                });
            }
            // A change is being made right now: wait for it to finish.
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

fn call(daemon: &Daemon, method: Method, ticket: &Ticket) -> Result<Value, Refusal> {
    match method {
        Method::ExportAdd(a) => {
            let spec = export_spec(a);
            let name = spec.name.clone().unwrap_or_else(|| crate::daemon::export_name(&spec.image));
            let notes = daemon.add_as(spec, Origin::Request, ticket)?;
            Ok(json!({"name": name, "notes": notes}))
        }
        Method::ExportRemove { name, hard } => {
            daemon.remove_within(&name, hard, ticket)?;
            Ok(json!({"name": name, "removed": true}))
        }
        Method::ExportList => Ok(daemon.list()),
        Method::ExportStats { name } => daemon.stats(name.as_deref()),
        Method::ExportSetQos { name, qos } => {
            let limits = limits(qos, daemon.limits(&name)?);
            daemon.set_qos_within(&name, limits, ticket)?;
            Ok(json!({"name": name, "qos": limits_json(limits)}))
        }
        Method::ServerInfo => Ok(daemon.info()),
        Method::ConfigReload => daemon.reload_within(ticket),
    }
}

/// QoS fields over `current`: an absent one keeps its value, 0 lifts it.
fn limits(q: Qos, current: Limits) -> Limits {
    Limits {
        iops: q.iops.unwrap_or(current.iops),
        bps: q.bps.unwrap_or(current.bps),
        read_bps: q.read_bps.unwrap_or(current.read_bps),
        write_bps: q.write_bps.unwrap_or(current.write_bps),
    }
}

fn export_spec(a: AddParams) -> ExportSpec {
    let format = match a.format.as_deref() {
        Some("raw") => FormatArg::Raw,
        Some("cow") => FormatArg::Cow,
        Some("qcow2") => FormatArg::Qcow2,
        // rpc checked it is one of FORMATS.
        _ => FormatArg::Auto,
    };
    ExportSpec {
        image: PathBuf::from(a.image),
        name: a.name,
        readonly: a.readonly,
        format,
        backing: BackingArgs {
            backing: a.backing.map(PathBuf::from),
            ignore_backing_mtime: a.ignore_backing_mtime,
            ceph: CephArgs { ceph_conf: a.ceph_conf.map(PathBuf::from), ceph_id: a.ceph_id },
        },
        fuse: a.fuse.map(PathBuf::from),
        vhost_user_blk: a.vhost_user_blk.map(PathBuf::from),
        num_queues: a.num_queues,
        limits: limits(a.qos, Limits::default()),
        allow: a.allow,
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
            let _committing = ticket.commit().ok_or(Refusal { code: ERR_FAILED, message: "given up".into() })?;
            c.store(true, Ordering::SeqCst);
            Ok(Value::Null)
        });
        let e = r.unwrap_err();
        assert!(e.message.contains("did not finish within") && e.message.contains("nothing was"), "{}", e.message);
        assert!(started.elapsed() < Duration::from_millis(350), "answered at the deadline, not after the open");
        std::thread::sleep(Duration::from_millis(600));
        assert!(!changed.load(Ordering::SeqCst), "the late open changed nothing");
        assert_eq!(within(Duration::from_secs(5), "x", |_| Ok(json!(1))).unwrap(), json!(1));
    }
}
