//! Living under a service manager, without libsystemd: readiness and status
//! datagrams to `$NOTIFY_SOCKET` (sd_notify's protocol), listening sockets
//! handed over through `LISTEN_FDS`/`LISTEN_PID`/`LISTEN_FDNAMES` (socket
//! activation), and the `--pid-file` lock.
//!
//! This module reads the environment once, at start-up, before any thread
//! exists, and removes those variables so nothing the server runs inherits
//! them. It never binds a socket: it hands over what it was given.

use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::Error;

/// Where `sd_notify` datagrams go, if anywhere.
static NOTIFY: OnceLock<Option<SocketAddr>> = OnceLock::new();

/// Reads `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace) and
/// unsets it. Call before threads start.
pub fn init_notify() {
    let addr = std::env::var_os("NOTIFY_SOCKET").and_then(|p| {
        use std::os::unix::ffi::OsStrExt;
        let bytes = p.as_bytes();
        match bytes.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name).ok(),
            None => SocketAddr::from_pathname(Path::new(&p)).ok(),
        }
    });
    std::env::remove_var("NOTIFY_SOCKET");
    let _ = NOTIFY.set(addr);
}

/// Sends one sd_notify message (`READY=1`, `STATUS=...`, newline-separated);
/// a no-op without a service manager. Failures are logged, never fatal.
pub fn notify(state: &str) {
    let Some(Some(addr)) = NOTIFY.get() else { return };
    let sent = UnixDatagram::unbound().and_then(|s| s.send_to_addr(state.as_bytes(), addr));
    if let Err(e) = sent {
        log::warn!("cannot notify the service manager ({state:?}): {e}");
    }
}

/// `RELOADING=1` with the `MONOTONIC_USEC=` that systemd 253+ wants for Type=notify-reload.
pub fn notify_reloading() {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let usec = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000;
    notify(&format!("RELOADING=1\nMONOTONIC_USEC={usec}"));
}

/// Sockets handed to us by the service manager, by name, until taken.
static INHERITED: Mutex<Vec<(String, OwnedFd)>> = Mutex::new(Vec::new());

/// The names a socket unit may give (FileDescriptorName=); unnamed is "nbd".
pub const FD_NAMES: [&str; 4] = ["nbd", "control", "metrics", "vhost-user-blk"];

/// Takes the sockets of `LISTEN_FDS` (when `LISTEN_PID` is us) and unsets the
/// variables. Call before threads start. A name not in [`FD_NAMES`] is a usage error.
pub fn init_listen_fds() -> Result<usize, Error> {
    let var = |k: &str| std::env::var(k).ok();
    let (pid, fds, names) = (var("LISTEN_PID"), var("LISTEN_FDS"), var("LISTEN_FDNAMES"));
    for k in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(k);
    }
    if pid.and_then(|p| p.parse::<u32>().ok()) != Some(std::process::id()) {
        return Ok(0);
    }
    let n: RawFd = fds.and_then(|n| n.parse().ok()).unwrap_or(0);
    let names: Vec<String> = names.map(|s| s.split(':').map(str::to_owned).collect()).unwrap_or_default();
    let mut taken = INHERITED.lock().unwrap();
    for i in 0..n {
        let fd = 3 + i;
        let name = match names.get(i as usize).map(String::as_str) {
            None | Some("" | "unknown" | "stored" | "connection") => "nbd".to_owned(),
            Some(s) => s.to_owned(),
        };
        if !FD_NAMES.contains(&name.as_str()) {
            return Err(Error::invalid(format!(
                "LISTEN_FDNAMES names socket {i} {name:?}: name each socket one of {} (FileDescriptorName= in the socket unit)",
                FD_NAMES.join(", ")
            )));
        }
        // SAFETY: the service manager passed fds 3..3+LISTEN_FDS to this process
        // (LISTEN_PID is ours); each is taken once, here, and owned from now on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fcntl on an fd we own; FD_CLOEXEC keeps it out of programs we run.
        unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        taken.push((name, owned));
    }
    Ok(n as usize)
}

/// Every inherited socket named `name`, taken.
fn take(name: &str) -> Vec<OwnedFd> {
    let mut all = INHERITED.lock().unwrap();
    let (mine, rest) = std::mem::take(&mut *all).into_iter().partition(|(n, _)| n == name);
    *all = rest;
    mine.into_iter().map(|(_, fd)| fd).collect()
}

/// Whether any socket is named `name` (without taking it).
pub fn has(name: &str) -> bool {
    INHERITED.lock().unwrap().iter().any(|(n, _)| n == name)
}

/// An inherited listening socket, unix or TCP.
pub enum Inherited {
    Unix(UnixListener, Option<PathBuf>),
    Tcp(TcpListener),
}

/// The inherited sockets named `name`; one that is not a listening stream socket is an error.
pub fn listeners(name: &str) -> Result<Vec<Inherited>, Error> {
    take(name).into_iter().map(|fd| classify(fd, name)).collect()
}

fn classify(fd: OwnedFd, name: &str) -> Result<Inherited, Error> {
    let mut family: libc::sockaddr_storage =
        // SAFETY: sockaddr_storage is plain data; all zeros is valid.
        unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `family` and `len` are valid out-pointers of the size given.
    let r = unsafe { libc::getsockname(fd.as_raw_fd(), std::ptr::addr_of_mut!(family).cast(), &mut len) };
    if r != 0 {
        return Err(Error::invalid(format!(
            "the socket named {name:?} from the service manager is not a socket: check the socket unit"
        )));
    }
    match family.ss_family as i32 {
        libc::AF_UNIX => {
            let l = UnixListener::from(fd);
            let path = l.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned));
            Ok(Inherited::Unix(l, path))
        }
        libc::AF_INET | libc::AF_INET6 => Ok(Inherited::Tcp(TcpListener::from(fd))),
        f => Err(Error::invalid(format!(
            "the socket named {name:?} from the service manager has address family {f}: give a unix or TCP ListenStream="
        ))),
    }
}

/// The inherited vhost-user-blk socket bound at `path`, if there is one.
pub fn take_vhost(path: &Path) -> Option<UnixListener> {
    let mut all = INHERITED.lock().unwrap();
    let at = all.iter().position(|(n, fd)| {
        n == "vhost-user-blk"
            && fd
                .try_clone()
                .ok()
                .map(UnixListener::from)
                .and_then(|l| l.local_addr().ok())
                .is_some_and(|a| a.as_pathname().is_some_and(|p| p == path))
    })?;
    Some(UnixListener::from(all.remove(at).1))
}

/// `--pid-file`: locked from start-up (a second server with the same file is
/// refused), the pid written once ready, the file removed at exit.
pub struct PidFile {
    path: PathBuf,
    file: File,
}

impl PidFile {
    pub fn lock(path: &Path) -> Result<PidFile, Error> {
        // The file may be removed between our open and our lock by the server
        // that held it: then lock the new one.
        for _ in 0..10 {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(|e| {
                Error::invalid(format!("cannot open --pid-file {}: {e} (choose a writable path)", path.display()))
            })?;
            // SAFETY: flock on an fd we own; non-blocking, so it cannot hang.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                return Err(Error::invalid(format!(
                    "--pid-file {} is locked by another vdisk serve (pid {}): stop it, or give this one another --pid-file",
                    path.display(),
                    pid.trim()
                )));
            }
            let same = std::fs::metadata(path).ok().zip(file.metadata().ok());
            if same.is_some_and(|(a, b)| a.ino() == b.ino() && a.dev() == b.dev()) {
                return Ok(PidFile { path: path.to_owned(), file });
            }
        }
        Err(Error::failed(format!("--pid-file {}: keeps being replaced; is another server starting?", path.display())))
    }

    /// Writes our pid (at readiness).
    pub fn write_pid(&mut self) -> Result<(), Error> {
        let pid = format!("{}\n", std::process::id());
        self.file.set_len(0).and_then(|()| self.file.write_all_at(pid.as_bytes(), 0)).map_err(|e| {
            Error::failed(format!("cannot write --pid-file {}", self.path.display())).at(&self.path).because(e)
        })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        // Removed while still locked, so no other server loses its lock to us.
        let _ = std::fs::remove_file(&self.path);
    }
}
