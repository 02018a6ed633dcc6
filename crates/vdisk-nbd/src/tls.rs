//! TLS for NBD (NBD_OPT_STARTTLS), in userspace: rustls for X.509
//! certificates, OpenSSL for pre-shared keys ([`crate::psk`], as rustls has none).
//!
//! Owns the server's TLS settings (certificate, key, optional client CA, or
//! PSK file) and the encrypted stream a connection switches to after STARTTLS. It never
//! decides protocol matters (which options need TLS): that is the handshake's.
//!
//! Why userspace and not kTLS: kTLS would keep the vectored-sendmsg fast path,
//! but it exists only for TCP (not the unix sockets most clients use here), and
//! needs the kernel's `tls` ULP, which this platform lacks
//! (`/proc/sys/net/ipv4/tcp_available_ulp` has no `tls`).
//!
//! How the stream fits the connection's threads: one TLS session (an
//! [`Engine`]: rustls or OpenSSL, both fed ciphertext by hand) behind a mutex, shared by the reader (decrypts requests) and whoever sends replies
//! (a completer, non-blocking, or the writer thread, blocking). Ciphertext only
//! ever goes to the socket with that mutex held, so records never interleave;
//! nobody holds it while waiting for the socket. A non-blocking sender whose
//! ciphertext did not all fit leaves the rest in the engine ([`TlsStream::needs_flush`])
//! and the connection's writer thread sends it. The plain path is untouched.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use crate::allow::PeerIdentity;
use crate::engine::Engine;
pub use crate::engine::{CredentialError, CredentialErrorKind};
#[cfg(feature = "psk")]
use crate::psk::{PskKeys, PskServer};

/// The plain socket under a TLS session (a unix or TCP stream): what
/// [`TlsStream`] needs of it, so that the session does not depend on the
/// connection's stream type, which holds sessions.
pub trait Socket: AsRawFd + Send + Sync {
    /// Reads what is there (ciphertext).
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// One vectored send of `slices` from `skip` bytes in; WouldBlock without `blocking` when full.
    fn send_from(&self, slices: &[&[u8]], skip: usize, blocking: bool) -> io::Result<usize>;
    fn shutdown(&self, how: std::net::Shutdown);
    fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()>;
    /// Who is at the other end, for logs.
    fn peer(&self) -> String;
}

/// When clients must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// Offered; plain clients are served too (the spec's SELECTIVETLS, no TLS-only exports).
    On,
    /// Every option but STARTTLS and ABORT is refused until TLS is up (FORCEDTLS).
    Require,
}

/// The server's TLS settings, built once and shared by every connection.
pub struct Tls {
    pub mode: TlsMode,
    creds: Creds,
    /// X.509 with a client CA: every client shows a verified certificate.
    verifies_peers: bool,
    /// One line for the startup banner.
    pub summary: String,
}

enum Creds {
    X509(Arc<ServerConfig>),
    #[cfg(feature = "psk")]
    Psk(PskServer),
}

impl Engine for ServerConnection {
    fn is_handshaking(&self) -> bool {
        (**self).is_handshaking()
    }

    fn wants_write(&self) -> bool {
        (**self).wants_write()
    }

    fn read_tls(&mut self, mut data: &[u8]) -> io::Result<usize> {
        (**self).read_tls(&mut data)
    }

    fn process(&mut self) -> io::Result<()> {
        self.process_new_packets().map(|_| ()).map_err(invalid)
    }

    fn write_tls(&mut self, mut w: &mut dyn Write) -> io::Result<usize> {
        (**self).write_tls(&mut w)
    }

    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.reader().read(buf) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            r => r,
        }
    }

    fn write_plain(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize> {
        self.writer().write_vectored(iov)
    }

    fn send_close_notify(&mut self) {
        (**self).send_close_notify()
    }

    fn peer_identity(&self) -> Option<PeerIdentity> {
        // rustls hands out the chain only after verifying it against the client CA.
        PeerIdentity::from_certificate(self.peer_certificates()?.first()?)
    }
}

/// Where the server's credentials are.
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA that client certificates must chain to; `None`: no client certificate asked for.
    pub client_ca: Option<PathBuf>,
}

/// Most ciphertext a connection keeps waiting for the socket; more plaintext waits.
const TLS_BUFFER: usize = 4 << 20;
/// Ciphertext read from the socket at once.
const RX_BUFFER: usize = 256 << 10;

fn certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, CredentialError> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| {
        CredentialError::new(CredentialErrorKind::Unreadable, format!("cannot read {what} {}", path.display()))
            .because(e)
    })?;
    let certs: Vec<_> = iter
        .collect::<Result<_, _>>()
        .map_err(|e| CredentialError::invalid(format!("{what} {} is not valid PEM", path.display())).because(e))?;
    if certs.is_empty() {
        return Err(CredentialError::invalid(format!(
            "{what} {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        )));
    }
    Ok(certs)
}

/// A TLS client's settings from a directory in qemu's and libnbd's layout:
/// the server's certificate must come from `ca-cert.pem`; `client-cert.pem`
/// with `client-key.pem`, if there, is shown to a server that asks for one.
/// What a mirror to an `nbds://` target connects with ([`crate::remote`]).
pub fn client_config(dir: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, CredentialError> {
    let dir = dir.ok_or_else(|| {
        CredentialError::invalid(
            "an nbds:// URI needs ?tls-certificates=DIR, a directory holding ca-cert.pem (the CA the server's \
             certificate comes from) and, if the server asks for one, client-cert.pem and client-key.pem",
        )
    })?;
    let ca = dir.join("ca-cert.pem");
    let mut roots = RootCertStore::empty();
    for c in certs(&ca, "CA certificate")? {
        roots.add(c).map_err(|e| CredentialError::invalid(format!("CA certificate {}", ca.display())).because(e))?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CredentialError::new(CredentialErrorKind::Setup, "TLS setup").because(e))?
        .with_root_certificates(roots);
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    if !cert.exists() {
        return Ok(Arc::new(builder.with_no_client_auth()));
    }
    let chain = certs(&cert, "client certificate")?;
    let key = PrivateKeyDer::from_pem_file(&key).map_err(|e| {
        CredentialError::invalid(format!("cannot read a PEM private key from {}", key.display())).because(e)
    })?;
    let config = builder.with_client_auth_cert(chain, key).map_err(|e| {
        CredentialError::invalid(format!("{} and its key do not make a usable client certificate", cert.display()))
            .because(e)
    })?;
    Ok(Arc::new(config))
}

/// What a private key is, as far as an error message needs to say.
#[derive(Debug, PartialEq, Eq)]
enum KeyKind {
    /// RSA with a modulus of this many bits.
    Rsa(usize),
    Other(&'static str),
}

/// One DER TLV: (tag, contents, what follows).
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, &x| a << 8 | x as usize);
        b = &b[n..];
        len
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

/// The modulus size of a PKCS#1 RSAPrivateKey (SEQUENCE { version, modulus, ... }).
fn rsa_bits(pkcs1: &[u8]) -> Option<usize> {
    let (0x30, seq, _) = der(pkcs1)? else { return None };
    let (0x02, _, rest) = der(seq)? else { return None };
    let (0x02, n, _) = der(rest)? else { return None };
    let n = &n[n.iter().position(|&x| x != 0)?..];
    Some(n.len() * 8 - n[0].leading_zeros() as usize)
}

fn key_kind(key: &PrivateKeyDer<'_>) -> KeyKind {
    const RSA_OID: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
    let bits = match key {
        PrivateKeyDer::Pkcs1(k) => rsa_bits(k.secret_pkcs1_der()),
        PrivateKeyDer::Sec1(_) => return KeyKind::Other("an EC key (SEC1)"),
        PrivateKeyDer::Pkcs8(k) => {
            // PrivateKeyInfo: SEQUENCE { version, SEQUENCE { algorithm OID, ... }, OCTET STRING key }
            let inner = || {
                let (0x30, seq, _) = der(k.secret_pkcs8_der())? else { return None };
                let (0x02, _, rest) = der(seq)? else { return None };
                let (0x30, alg, rest) = der(rest)? else { return None };
                let (0x06, oid, _) = der(alg)? else { return None };
                if oid != RSA_OID {
                    return Some(None);
                }
                let (0x04, key, _) = der(rest)? else { return None };
                Some(rsa_bits(key))
            };
            match inner() {
                Some(None) => return KeyKind::Other("not RSA (PKCS#8)"),
                Some(bits) => bits,
                None => None,
            }
        }
        _ => None,
    };
    bits.map_or(KeyKind::Other("unreadable as DER"), KeyKind::Rsa)
}

impl Tls {
    /// Loads the PEM files; errors name the file and what is wrong with it.
    pub fn new(mode: TlsMode, files: &TlsFiles) -> Result<Tls, CredentialError> {
        let chain = certs(&files.cert, "certificate")?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| {
            CredentialError::invalid(format!(
                "cannot read a PEM private key from {} (PKCS#8, PKCS#1 or SEC1)",
                files.key.display()
            ))
            .because(e)
        })?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| CredentialError::new(CredentialErrorKind::Setup, "TLS setup").because(e))?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in certs(ca, "CA certificate")? {
                    roots
                        .add(c)
                        .map_err(|e| CredentialError::invalid(format!("CA certificate {}", ca.display())).because(e))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| CredentialError::invalid(format!("CA certificate {}", ca.display())).because(e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let kind = key_kind(&key);
        let config = builder.with_single_cert(chain, key).map_err(|e| {
            CredentialError::invalid(format!(
                "{} and {} do not make a usable certificate and key{}",
                files.cert.display(),
                files.key.display(),
                match kind {
                    KeyKind::Rsa(bits) if !(2048..=8192).contains(&bits) => format!(
                        " (the key is RSA with a {bits}-bit modulus; rustls with aws-lc-rs signs only with RSA keys \
                         of 2048 to 8192 bits: make a new one, e.g. certtool --generate-privkey --bits 3072)"
                    ),
                    KeyKind::Rsa(bits) => format!(" (the key is RSA with a {bits}-bit modulus)"),
                    KeyKind::Other(what) => format!(" (the key is {what})"),
                }
            ))
            .because(e)
        })?;
        let summary = format!(
            "TLS {} (X.509: {}{})",
            if mode == TlsMode::Require { "required" } else { "offered, plain allowed" },
            files.cert.display(),
            match &files.client_ca {
                Some(ca) => format!(", client certificates must chain to {}", ca.display()),
                None => String::new(),
            }
        );
        let verifies_peers = files.client_ca.is_some();
        Ok(Tls { mode, creds: Creds::X509(Arc::new(config)), verifies_peers, summary })
    }

    /// Pre-shared keys from a psktool-style file (`username:hexkey` lines), served with OpenSSL.
    #[cfg(feature = "psk")]
    pub fn psk(mode: TlsMode, file: &Path) -> Result<Tls, CredentialError> {
        let keys = PskKeys::load(file)?;
        let summary = format!(
            "TLS {} (PSK: {} user{} in {})",
            if mode == TlsMode::Require { "required" } else { "offered, plain allowed" },
            keys.len(),
            if keys.len() == 1 { "" } else { "s" },
            file.display()
        );
        Ok(Tls { mode, creds: Creds::Psk(PskServer::new(keys)?), verifies_peers: false, summary })
    }

    /// This build has no OpenSSL: say how to get one that has.
    #[cfg(not(feature = "psk"))]
    pub fn psk(_mode: TlsMode, file: &Path) -> Result<Tls, CredentialError> {
        Err(CredentialError::new(
            CredentialErrorKind::NotBuilt,
            format!(
            "{}: this vdisk was built without pre-shared keys; rebuild with `cargo build --release --features psk` \
             (needs libssl-dev and pkg-config), or use X.509 certificates",
            file.display()
        ),
        ))
    }

    /// Every client that completes TLS has a [`PeerIdentity`]: PSK, or
    /// certificates with a client CA (what export allow lists need).
    pub fn identifies_clients(&self) -> bool {
        match &self.creds {
            Creds::X509(_) => self.verifies_peers,
            #[cfg(feature = "psk")]
            Creds::Psk(_) => true,
        }
    }

    fn session(&self) -> io::Result<Box<dyn Engine>> {
        match &self.creds {
            Creds::X509(config) => {
                let mut conn = ServerConnection::new(config.clone()).map_err(invalid)?;
                conn.set_buffer_limit(Some(TLS_BUFFER));
                Ok(Box::new(conn))
            }
            #[cfg(feature = "psk")]
            Creds::Psk(server) => server.session(),
        }
    }
}

/// Ciphertext read from the socket and not yet given to the engine. Only the reader uses it.
struct Rx {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// Follows the record framing of what the client sends during the handshake
/// to see a plaintext close_notify alert (a client that refused the server's
/// certificate says goodbye that way, e.g. GnuTLS's `gnutls_bye`). rustls
/// takes one in a TLS 1.2 handshake for a harmless warning and waits for more,
/// so without this the connection would sit until the handshake timeout.
#[derive(Default)]
struct RecordWatch {
    /// The header of the record being read (type, version, length).
    head: [u8; 5],
    have: usize,
    /// Payload bytes of the current record still to come.
    left: usize,
    /// The current record is a plaintext alert (two bytes: level, description).
    alert: bool,
    payload: [u8; 2],
    got: usize,
}

impl RecordWatch {
    const ALERT: u8 = 21;
    const CLOSE_NOTIFY: u8 = 0;

    /// Looks at the next bytes from the client: true once a plaintext close_notify has gone by.
    fn closes(&mut self, mut b: &[u8]) -> bool {
        while !b.is_empty() {
            if self.left == 0 {
                let n = (5 - self.have).min(b.len());
                self.head[self.have..self.have + n].copy_from_slice(&b[..n]);
                self.have += n;
                b = &b[n..];
                if self.have == 5 {
                    self.have = 0;
                    self.left = u16::from_be_bytes([self.head[3], self.head[4]]) as usize;
                    self.alert = self.head[0] == Self::ALERT && self.left == 2;
                    self.got = 0;
                }
                continue;
            }
            let n = self.left.min(b.len());
            if self.alert {
                for &x in &b[..n] {
                    self.payload[self.got] = x;
                    self.got += 1;
                }
                if self.got == 2 && self.payload[1] == Self::CLOSE_NOTIFY {
                    return true;
                }
            }
            self.left -= n;
            b = &b[n..];
        }
        false
    }
}

/// A connection after STARTTLS: everything goes through `conn`.
pub struct TlsStream {
    sock: Box<dyn Socket>,
    conn: Mutex<Box<dyn Engine>>,
    rx: Mutex<Rx>,
}

/// Hands ciphertext to the socket without ever blocking.
struct SocketWriter<'a>(&'a dyn Socket);

impl Write for SocketWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.send_from(&[buf], 0, false)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let slices: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
        self.0.send_from(&slices, 0, false)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn invalid(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Waits until the socket can take more bytes.
fn wait_writable(fd: i32) -> io::Result<()> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    loop {
        // SAFETY: pfd is one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, -1) };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl TlsStream {
    /// Runs the TLS handshake as the server on `sock` (the STARTTLS ACK already sent).
    pub fn accept(sock: Box<dyn Socket>, tls: &Tls) -> io::Result<TlsStream> {
        let t = TlsStream {
            sock,
            conn: Mutex::new(tls.session()?),
            rx: Mutex::new(Rx { buf: vec![0; RX_BUFFER], start: 0, end: 0 }),
        };
        let mut rx = t.rx.lock().unwrap();
        let mut watch = RecordWatch::default();
        loop {
            let (handshaking, wants_write) = {
                let c = t.conn.lock().unwrap();
                (c.is_handshaking(), c.wants_write())
            };
            if wants_write {
                t.flush_all()?;
            } else if !handshaking {
                break;
            } else {
                if rx.start == rx.end {
                    if !t.fill(&mut rx)? {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the client left during the TLS handshake",
                        ));
                    }
                    if watch.closes(&rx.buf[rx.start..rx.end]) {
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "the client closed the TLS handshake (close_notify; it may have refused the server's \
                             certificate or name)",
                        ));
                    }
                }
                t.feed(&mut rx)?;
            }
        }
        drop(rx);
        Ok(t)
    }

    /// Reads more ciphertext from the socket; false at end of stream.
    fn fill(&self, rx: &mut Rx) -> io::Result<bool> {
        if rx.start == rx.end {
            (rx.start, rx.end) = (0, 0);
        } else if rx.end == rx.buf.len() {
            rx.buf.copy_within(rx.start..rx.end, 0);
            (rx.start, rx.end) = (0, rx.end - rx.start);
        }
        loop {
            let end = rx.end;
            match self.sock.recv(&mut rx.buf[end..]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    rx.end += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Gives buffered ciphertext to the engine and lets it work; whatever it
    /// has to say back (an alert, a key update) is sent if the socket takes it now.
    fn feed(&self, rx: &mut Rx) -> io::Result<()> {
        let mut conn = self.conn.lock().unwrap();
        let n = conn.read_tls(&rx.buf[rx.start..rx.end])?;
        rx.start += n;
        let processed = conn.process();
        let _ = self.flush_locked(&mut **conn);
        processed
    }

    /// Sends the ciphertext the engine holds: true when all went, false when the socket is full.
    fn flush_locked(&self, conn: &mut dyn Engine) -> io::Result<bool> {
        while conn.wants_write() {
            match conn.write_tls(&mut SocketWriter(&*self.sock)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Sends all pending ciphertext, waiting for the socket without holding the lock.
    pub fn flush_all(&self) -> io::Result<()> {
        loop {
            if self.flush_locked(&mut **self.conn.lock().unwrap())? {
                return Ok(());
            }
            wait_writable(self.sock.as_raw_fd())?;
        }
    }

    /// Ciphertext is waiting for the socket.
    pub fn needs_flush(&self) -> bool {
        self.conn.lock().unwrap().wants_write()
    }

    /// Encrypts plaintext from `slices` (past `skip`) and sends it. Returns the
    /// plaintext bytes taken. Non-blocking: WouldBlock while older ciphertext
    /// still waits for the socket; what does not fit now stays queued in the engine.
    pub fn send_from(&self, slices: &[&[u8]], mut skip: usize, blocking: bool) -> io::Result<usize> {
        let mut conn = self.conn.lock().unwrap();
        while !self.flush_locked(&mut **conn)? {
            if !blocking {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            drop(conn);
            wait_writable(self.sock.as_raw_fd())?;
            conn = self.conn.lock().unwrap();
        }
        let mut iov = Vec::with_capacity(slices.len());
        for s in slices {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            iov.push(IoSlice::new(&s[skip..]));
            skip = 0;
        }
        let n = conn.write_plain(&iov)?;
        let all_out = self.flush_locked(&mut **conn)?;
        drop(conn);
        if !all_out && blocking {
            self.flush_all()?;
        }
        Ok(n)
    }

    /// Reads decrypted bytes; 0 at the end of the stream (close_notify or EOF).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut rx = self.rx.lock().unwrap();
        loop {
            match self.conn.lock().unwrap().read_plain(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if rx.start == rx.end && !self.fill(&mut rx)? {
                return Ok(0);
            }
            self.feed(&mut rx)?;
        }
    }

    /// Who the client proved to be during the TLS handshake.
    pub fn peer_identity(&self) -> Option<PeerIdentity> {
        self.conn.lock().unwrap().peer_identity()
    }

    /// Says goodbye (close_notify), if the socket takes it now.
    pub fn close(&self) {
        let mut conn = self.conn.lock().unwrap();
        conn.send_close_notify();
        let _ = self.flush_locked(&mut **conn);
    }

    pub fn socket(&self) -> &dyn Socket {
        &*self.sock
    }
}

#[cfg(test)]
mod tests {
    use super::RecordWatch;

    const HELLO: &[u8] = &[0x16, 3, 1, 0, 4, 1, 0, 0, 0];
    const CLOSE_NOTIFY: &[u8] = &[0x15, 3, 3, 0, 2, 1, 0];

    #[test]
    fn a_plaintext_close_notify_is_seen_in_any_split() {
        let mut all = HELLO.to_vec();
        all.extend_from_slice(CLOSE_NOTIFY);
        for cut in 0..=all.len() {
            let mut w = RecordWatch::default();
            let first = w.closes(&all[..cut]);
            assert!(first || w.closes(&all[cut..]), "split at {cut}");
        }
        // One byte at a time.
        let mut w = RecordWatch::default();
        assert!(all.iter().any(|b| w.closes(std::slice::from_ref(b))));
    }

    #[test]
    fn other_records_and_alerts_are_not_a_close() {
        let mut w = RecordWatch::default();
        // A fatal alert is rustls's to handle; an encrypted record of type 21 is longer than 2.
        assert!(!w.closes(&[0x15, 3, 3, 0, 2, 2, 40]));
        assert!(!w.closes(&[0x15, 3, 3, 0, 3, 1, 0, 0]));
        // A close_notify's bytes inside another record's payload.
        assert!(!w.closes(&[0x17, 3, 3, 0, 7, 0x15, 3, 3, 0, 2, 1, 0]));
        assert!(!w.closes(HELLO));
        assert!(w.closes(CLOSE_NOTIFY));
    }
}
