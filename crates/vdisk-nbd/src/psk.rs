//! TLS with pre-shared keys (TLS-PSK), through OpenSSL.
//!
//! Why OpenSSL here when X.509 uses rustls: rustls has no external PSK (only
//! its own resumption tickets), and qemu's tls-creds-psk, nbdkit's --tls-psk
//! and libnbd's tls-psk-file clients all speak external PSK (GnuTLS). OpenSSL
//! is used for this and nothing else.
//!
//! The key file is GnuTLS psktool's format, which qemu (`keys.psk` in a
//! tls-creds-psk dir), nbdkit and libnbd read: one `username:hexkey` a line.
//!
//! Both TLS 1.3 (external PSK with (EC)DHE, SHA-256 binders) and TLS 1.2 PSK
//! suites are served: OpenSSL's PSK server callback answers both. A client
//! whose identity is not in the file, or whose key differs, fails the
//! handshake.
//!
//! How it fits the connection: OpenSSL runs over an in-memory transport
//! ([`MemIo`]): the socket never meets OpenSSL. Ciphertext comes in through
//! [`Engine::read_tls`] and leaves through [`Engine::write_tls`], exactly like
//! rustls, so [`crate::tls::TlsStream`] drives both engines the same way
//! (locking, non-blocking senders, the writer's owed flush). The cost is one
//! copy of the ciphertext each way, which a custom socket Read/Write would not
//! save either without giving OpenSSL a blocking socket.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use openssl::ex_data::Index;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslOptions, SslSessionCacheMode, SslStream, SslVersion,
};

use crate::allow::PeerIdentity;
use crate::engine::{CredentialError, CredentialErrorKind, Engine};

/// TLS 1.3 suites with SHA-256: the hash OpenSSL's PSK callback gives TLS 1.3
/// external keys, and GnuTLS's default for them.
const TLS13_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";
/// TLS 1.2 PSK suites, forward-secret ones first.
const TLS12_SUITES: &str = "ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:\
                            PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305";
/// Plaintext encrypted at once by one [`Engine::write_plain`].
const WRITE_CHUNK: usize = 256 << 10;
/// Longest key accepted (OpenSSL's PSK_MAX_PSK_LEN).
const MAX_KEY: usize = 512;

/// Where the PSK callback leaves an unknown username, for the handshake's error
/// (OpenSSL itself only says "no suitable signature algorithm" in TLS 1.3).
fn unknown_user_slot() -> Result<Index<Ssl, String>, openssl::error::ErrorStack> {
    static SLOT: OnceLock<Index<Ssl, String>> = OnceLock::new();
    if let Some(i) = SLOT.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index()?;
    Ok(*SLOT.get_or_init(|| i))
}

/// Where the PSK callback leaves the username whose key it gave: the
/// client's identity once the handshake succeeds (the key proved it).
fn user_slot() -> Result<Index<Ssl, String>, openssl::error::ErrorStack> {
    static SLOT: OnceLock<Index<Ssl, String>> = OnceLock::new();
    if let Some(i) = SLOT.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index()?;
    Ok(*SLOT.get_or_init(|| i))
}

/// The keys of a psktool-style file: username to key.
pub struct PskKeys(HashMap<Vec<u8>, Vec<u8>>);

impl PskKeys {
    /// Reads `path`; errors name the file (and line) and the fix.
    pub fn load(path: &Path) -> Result<PskKeys, CredentialError> {
        let p = path.display();
        let unreadable = |m: String| CredentialError::new(CredentialErrorKind::Unreadable, m);
        let meta = std::fs::metadata(path).map_err(|e| unreadable(format!("cannot use PSK file {p}")).because(e))?;
        if meta.permissions().mode() & 0o004 != 0 {
            return Err(CredentialError::new(
                CredentialErrorKind::Exposed,
                format!("PSK file {p} is readable by every user, and its keys are secrets: chmod o-r {p} (or 600)"),
            ));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| unreadable(format!("cannot read PSK file {p}")).because(e))?;
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: &str| {
                CredentialError::invalid(format!("PSK file {p} line {}: {why} (lines are username:hexkey)", i + 1))
            };
            let (user, hex) = line.rsplit_once(':').ok_or_else(|| bad("no ':'"))?;
            if user.is_empty() {
                return Err(bad("empty username"));
            }
            let key = unhex(hex).ok_or_else(|| bad("the key is not an even number of hex digits"))?;
            if key.is_empty() || key.len() > MAX_KEY {
                return Err(bad(&format!("keys are 1 to {MAX_KEY} bytes")));
            }
            if keys.insert(user.as_bytes().to_vec(), key).is_some() {
                return Err(bad(&format!("username {user:?} appears twice")));
            }
        }
        if keys.is_empty() {
            return Err(CredentialError::invalid(format!(
                "PSK file {p} holds no key (lines are username:hexkey, as psktool writes)"
            )));
        }
        Ok(PskKeys(keys))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Names the users, never the keys.
impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys().map(|u| String::from_utf8_lossy(u))).finish()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// The server's OpenSSL context, made once: every connection's session comes from it.
pub struct PskServer {
    ctx: SslContext,
}

impl PskServer {
    pub fn new(keys: PskKeys) -> Result<PskServer, CredentialError> {
        let keys = Arc::new(keys);
        let setup = |e: openssl::error::ErrorStack| {
            CredentialError::new(CredentialErrorKind::Setup, "OpenSSL PSK setup").because(e)
        };
        let unknown = unknown_user_slot().map_err(setup)?;
        let user = user_slot().map_err(setup)?;
        let mut b = SslContextBuilder::new(SslMethod::tls_server()).map_err(setup)?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2)).map_err(setup)?;
        b.set_cipher_list(TLS12_SUITES).map_err(setup)?;
        b.set_ciphersuites(TLS13_SUITES).map_err(setup)?;
        // Every connection authenticates afresh: no tickets, no session cache.
        b.set_num_tickets(0).map_err(setup)?;
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        // Whole buffers from the in-memory transport, not a header then a body per record.
        b.set_read_ahead(true);
        b.set_options(SslOptions::NO_TICKET | SslOptions::NO_RENEGOTIATION | SslOptions::CIPHER_SERVER_PREFERENCE);
        b.set_psk_server_callback(move |ssl, identity, out| {
            let Some(id) = identity else {
                ssl.set_ex_data(unknown, String::new());
                return Ok(0);
            };
            match keys.0.get(id) {
                Some(key) if key.len() <= out.len() => {
                    log::debug!("TLS-PSK: user {:?}", String::from_utf8_lossy(id));
                    ssl.set_ex_data(user, String::from_utf8_lossy(id).into_owned());
                    out[..key.len()].copy_from_slice(key);
                    Ok(key.len())
                }
                Some(_) => Ok(0),
                None => {
                    ssl.set_ex_data(unknown, String::from_utf8_lossy(id).into_owned());
                    Ok(0)
                }
            }
        });
        Ok(PskServer { ctx: b.build() })
    }

    pub(crate) fn session(&self) -> io::Result<Box<dyn Engine>> {
        let mut ssl = Ssl::new(&self.ctx).map_err(io::Error::other)?;
        ssl.set_accept_state();
        let s = SslStream::new(ssl, MemIo::default()).map_err(io::Error::other)?;
        Ok(Box::new(PskSession { s, scratch: Vec::new() }))
    }
}

/// A TLS-PSK client session over `sock` as `username`, with that user's
/// key from psktool-style `file` (libnbd's `tls-psk-file`): the handshake is
/// done when this returns. What a mirror to an `nbds://USER@...` target uses.
pub fn connect<S: Read + Write>(sock: S, file: &Path, username: &str) -> io::Result<SslStream<S>> {
    let keys = PskKeys::load(file).map_err(io::Error::other)?;
    let key = keys
        .0
        .get(username.as_bytes())
        .cloned()
        .ok_or_else(|| io::Error::other(format!("PSK file {} has no key for user {username:?}", file.display())))?;
    let mut identity = username.as_bytes().to_vec();
    identity.push(0);
    let setup = io::Error::other;
    let mut b = SslContextBuilder::new(SslMethod::tls_client()).map_err(setup)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2)).map_err(setup)?;
    b.set_cipher_list(TLS12_SUITES).map_err(setup)?;
    b.set_ciphersuites(TLS13_SUITES).map_err(setup)?;
    b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
        if identity.len() > id_out.len() || key.len() > key_out.len() {
            return Ok(0);
        }
        id_out[..identity.len()].copy_from_slice(&identity);
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let mut ssl = Ssl::new(&b.build()).map_err(setup)?;
    ssl.set_connect_state();
    let mut stream = SslStream::new(ssl, sock).map_err(setup)?;
    stream.do_handshake().map_err(|e| {
        io::Error::other(format!("the TLS-PSK handshake failed (is the key for {username:?} the server's?): {e}"))
    })?;
    Ok(stream)
}

/// OpenSSL's transport: ciphertext in from the socket, ciphertext out to it.
#[derive(Default)]
struct MemIo {
    rx: Vec<u8>,
    rx_at: usize,
    tx: Vec<u8>,
    tx_at: usize,
}

impl Read for MemIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let have = &self.rx[self.rx_at..];
        if have.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = have.len().min(buf.len());
        buf[..n].copy_from_slice(&have[..n]);
        self.rx_at += n;
        if self.rx_at == self.rx.len() {
            self.rx.clear();
            self.rx_at = 0;
        }
        Ok(n)
    }
}

impl Write for MemIo {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct PskSession {
    s: SslStream<MemIo>,
    /// Small slices gathered into one write (OpenSSL has no vectored write).
    scratch: Vec<u8>,
}

/// OpenSSL's reasons ("binder does not verify"), without its source file names.
fn ssl_err(e: openssl::ssl::Error) -> io::Error {
    let why = match e.ssl_error() {
        Some(stack) => {
            let reasons: Vec<&str> = stack.errors().iter().filter_map(|r| r.reason()).collect();
            if reasons.is_empty() {
                stack.to_string()
            } else {
                format!("{} (OpenSSL)", reasons.join(", "))
            }
        }
        None => match e.into_io_error() {
            Ok(io) => return io,
            Err(e) => e.to_string(),
        },
    };
    io::Error::new(io::ErrorKind::InvalidData, why)
}

impl Engine for PskSession {
    fn is_handshaking(&self) -> bool {
        !self.s.ssl().is_init_finished()
    }

    fn wants_write(&self) -> bool {
        let io = self.s.get_ref();
        io.tx_at < io.tx.len()
    }

    fn read_tls(&mut self, data: &[u8]) -> io::Result<usize> {
        self.s.get_mut().rx.extend_from_slice(data);
        Ok(data.len())
    }

    fn process(&mut self) -> io::Result<()> {
        if !self.is_handshaking() {
            return Ok(());
        }
        match self.s.accept() {
            Ok(()) => {
                let ssl = self.s.ssl();
                let suite = ssl.current_cipher().map(|c| c.name()).unwrap_or("?");
                log::debug!("TLS-PSK session: {} {suite}", ssl.version_str());
                Ok(())
            }
            Err(e) if e.code() == ErrorCode::WANT_READ => Ok(()),
            Err(e) => {
                let user = unknown_user_slot().ok().and_then(|i| self.s.ssl().ex_data(i));
                Err(match user {
                    Some(u) if u.is_empty() => io::Error::new(io::ErrorKind::InvalidData, "no PSK username"),
                    Some(u) => io::Error::new(io::ErrorKind::InvalidData, format!("unknown PSK username {u:?}")),
                    None => ssl_err(e),
                })
            }
        }
    }

    fn write_tls(&mut self, w: &mut dyn Write) -> io::Result<usize> {
        let io = self.s.get_mut();
        let n = w.write(&io.tx[io.tx_at..])?;
        io.tx_at += n;
        if io.tx_at == io.tx.len() {
            io.tx.clear();
            io.tx_at = 0;
        }
        Ok(n)
    }

    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.s.ssl_read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) if e.code() == ErrorCode::WANT_READ => Err(io::ErrorKind::WouldBlock.into()),
            Err(e) => Err(ssl_err(e)),
        }
    }

    fn write_plain(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut taken = 0;
        self.scratch.clear();
        for s in iov {
            let room = WRITE_CHUNK - self.scratch.len();
            if room == 0 {
                break;
            }
            let part = &s[..s.len().min(room)];
            self.scratch.extend_from_slice(part);
            taken += part.len();
        }
        if taken > 0 {
            // The transport takes everything, so OpenSSL takes all of it.
            let n = self.s.ssl_write(&self.scratch).map_err(ssl_err)?;
            debug_assert_eq!(n, taken);
        }
        Ok(taken)
    }

    fn send_close_notify(&mut self) {
        let _ = self.s.shutdown();
    }

    fn peer_identity(&self) -> Option<PeerIdentity> {
        if self.is_handshaking() {
            return None;
        }
        let user = self.s.ssl().ex_data(user_slot().ok()?)?;
        Some(PeerIdentity::Psk(user.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, mode: u32) -> Result<PskKeys, String> {
        let path = std::env::temp_dir().join(format!("vdisk-psk-test-{}-{mode:o}-{}", std::process::id(), text.len()));
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let r = PskKeys::load(&path).map_err(|e| e.to_string());
        std::fs::remove_file(&path).unwrap();
        r
    }

    #[test]
    fn key_files_are_checked() {
        let k = load("alice:00ff10\n\nbob:0123456789abcdef\n", 0o600).unwrap();
        assert_eq!(k.len(), 2);
        assert_eq!(k.0[&b"alice"[..]], vec![0, 0xff, 0x10]);
        assert!(load("alice:00ff10\n", 0o644).unwrap_err().contains("chmod"));
        assert!(load("alice:0ff\n", 0o600).unwrap_err().contains("line 1"));
        assert!(load("alice:zz\n", 0o600).unwrap_err().contains("hex"));
        assert!(load("alice\n", 0o600).unwrap_err().contains("no ':'"));
        assert!(load("a:00\na:01\n", 0o600).unwrap_err().contains("twice"));
        assert!(load("\n", 0o600).unwrap_err().contains("no key"));
    }
}
