//! Sockets the server listens on: a unix socket bound safely (a stale file
//! replaced, a live one or another kind of file never), and a listen address
//! as the flags and the config file spell it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::Error;

/// Binds a unix socket, replacing a stale socket file but never a live one or another kind of file.
/// The socket is created with `mode` from the start (through the umask), so
/// there is no moment at which others could connect.
pub fn bind_unix(path: &Path, mode: u32, flag: &str) -> Result<UnixListener, Error> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::invalid(format!(
                "{} exists and is not a socket; choose another {flag} path",
                path.display()
            )));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(Error::invalid(format!(
                "{} is in use by another server; choose another {flag} path",
                path.display()
            )));
        }
        let _ = std::fs::remove_file(path);
    }
    // SAFETY: umask only swaps the process's file-creation mask; nothing else
    // creates files while the server starts.
    let old = unsafe { libc::umask(!mode & 0o777) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    bound.map_err(|e| Error::invalid(format!("cannot listen on unix socket {}", path.display())).at(path).because(e))
}

/// HOST:PORT, :PORT or PORT (host 127.0.0.1).
pub fn parse_listen(s: &str, flag: &str, example: &str) -> Result<SocketAddr, Error> {
    let full = if let Some(port) = s.strip_prefix(':') {
        format!("127.0.0.1:{port}")
    } else if s.chars().all(|c| c.is_ascii_digit()) {
        format!("127.0.0.1:{s}")
    } else {
        s.to_owned()
    };
    full.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Error::invalid(format!("{flag} {s:?} is not HOST:PORT (e.g. {example})")))
}
