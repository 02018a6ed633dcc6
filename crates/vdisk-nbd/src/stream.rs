//! A connected client socket, unix or TCP, plain or (after STARTTLS) TLS, behind one type.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use crate::handshake::Transport;
use crate::tls::{Socket, Tls, TlsStream};

const IOV_MAX: usize = 1024;

pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
    /// Shared by the connection's clones: one TLS session per socket.
    Tls(Arc<TlsStream>),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Tls(t) => Stream::Tls(t.clone()),
        })
    }

    pub fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Tls(t) => return t.socket().shutdown(how),
        };
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Tls(tls) => tls.socket().set_read_timeout(t),
        }
    }

    /// One vectored `sendmsg` of `slices`, starting `skip` bytes in. Returns the
    /// bytes sent; without `blocking`, WouldBlock when the socket is full.
    pub fn send_from(&self, slices: &[&[u8]], mut skip: usize, blocking: bool) -> io::Result<usize> {
        if let Stream::Tls(t) = self {
            return t.send_from(slices, skip, blocking);
        }
        let mut iov: SmallVec<[libc::iovec; 64]> = SmallVec::with_capacity(slices.len().min(IOV_MAX));
        for s in slices {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            let part = &s[skip..];
            skip = 0;
            iov.push(libc::iovec { iov_base: part.as_ptr() as *mut libc::c_void, iov_len: part.len() });
            if iov.len() == IOV_MAX {
                break;
            }
        }
        if iov.is_empty() {
            return Ok(0);
        }
        // SAFETY: msghdr is plain data; zeroed is a valid empty header we then fill.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        let flags = libc::MSG_NOSIGNAL | if blocking { 0 } else { libc::MSG_DONTWAIT };
        // SAFETY: msg points at `iov`, whose entries point into `slices`; all outlive the call,
        // and the kernel only reads them.
        let n = unsafe { libc::sendmsg(self.as_raw_fd(), &msg, flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Asks for `bytes` of send and receive buffer; a refusal is harmless.
    pub fn set_buffer_sizes(&self, bytes: usize) {
        let v = bytes as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: setsockopt reads a c_int from a valid pointer for the given length.
            unsafe {
                libc::setsockopt(
                    self.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }

    /// Bytes already taken by [`Stream::send_from`] still wait to go out (TLS
    /// only); the writer thread owes a [`Stream::flush_pending`].
    pub fn needs_flush(&self) -> bool {
        match self {
            Stream::Tls(t) => t.needs_flush(),
            _ => false,
        }
    }

    /// Sends whatever [`Stream::needs_flush`] reported, blocking.
    pub fn flush_pending(&self) -> io::Result<()> {
        match self {
            Stream::Tls(t) => t.flush_all(),
            _ => Ok(()),
        }
    }

    /// Ends a TLS session politely (close_notify); nothing for plain sockets.
    pub fn close(&self) {
        if let Stream::Tls(t) = self {
            t.close();
        }
    }

    /// One `read` from the socket itself (through `&self`).
    pub(crate) fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }

    /// Reads until `buf` is full, the peer closes or an error: on a plain
    /// socket one `recv(MSG_WAITALL)` (the kernel waits for the rest, instead
    /// of one system call per piece that arrives), with TLS a loop of reads.
    pub(crate) fn read_all(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut at = 0;
        while at < buf.len() {
            let rest = &mut buf[at..];
            let r = if self.is_tls() {
                self.read(rest)
            } else {
                // SAFETY: rest is valid for writes of rest.len() bytes for the whole call.
                let n =
                    unsafe { libc::recv(self.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), libc::MSG_WAITALL) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            };
            match r {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(at)
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    pub fn peer(&self) -> String {
        match self {
            Stream::Tls(t) => t.socket().peer(),
            Stream::Unix(_) => "unix client".to_owned(),
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp client".into()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(t) => t.send_from(&[buf], 0, true),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Tls(t) => t.socket().as_raw_fd(),
        }
    }
}

impl Transport for Stream {
    fn start_tls(&mut self, tls: &Tls) -> io::Result<()> {
        if self.is_tls() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "TLS is already on"));
        }
        let plain = self.try_clone()?;
        *self = Stream::Tls(Arc::new(TlsStream::accept(Box::new(plain), tls)?));
        Ok(())
    }

    fn peer_identity(&self) -> Option<crate::allow::PeerIdentity> {
        match self {
            Stream::Tls(t) => t.peer_identity(),
            _ => None,
        }
    }
}

/// The plain stream under a TLS session.
impl Socket for Stream {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        Stream::recv(self, buf)
    }

    fn send_from(&self, slices: &[&[u8]], skip: usize, blocking: bool) -> io::Result<usize> {
        Stream::send_from(self, slices, skip, blocking)
    }

    fn shutdown(&self, how: Shutdown) {
        Stream::shutdown(self, how)
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        Stream::set_read_timeout(self, t)
    }

    fn peer(&self) -> String {
        Stream::peer(self)
    }
}
