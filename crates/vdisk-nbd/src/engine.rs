//! What a TLS back end is to the rest of the crate: an [`Engine`] fed
//! ciphertext by hand (rustls in `tls.rs`, OpenSSL's PSK server in `psk.rs`),
//! and the [`CredentialError`] its credentials fail with. Neither back end
//! depends on the other through this module.

use std::io::{self, IoSlice, Write};
use std::sync::Arc;

use crate::allow::PeerIdentity;

/// A TLS session as [`crate::tls::TlsStream`] drives it: ciphertext in and out by hand,
/// plaintext in and out; nothing ever touches the socket.
pub(crate) trait Engine: Send {
    fn is_handshaking(&self) -> bool;
    /// Ciphertext waits for [`Engine::write_tls`].
    fn wants_write(&self) -> bool;
    /// Takes ciphertext from the socket; returns the bytes taken.
    fn read_tls(&mut self, data: &[u8]) -> io::Result<usize>;
    /// Handles what [`Engine::read_tls`] took (handshake steps, alerts).
    fn process(&mut self) -> io::Result<()>;
    /// Hands pending ciphertext to `w`.
    fn write_tls(&mut self, w: &mut dyn Write) -> io::Result<usize>;
    /// Decrypted bytes; WouldBlock when more ciphertext is needed, 0 at the end.
    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Encrypts plaintext; returns the bytes taken (fewer when its buffer is full).
    fn write_plain(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize>;
    fn send_close_notify(&mut self);
    /// Who the client proved to be, once the handshake is done (None: anonymous).
    fn peer_identity(&self) -> Option<PeerIdentity>;
}

/// Why TLS credentials cannot be used: a kind, a message that names the
/// file and what is wrong with it (never a command-line flag), and the error
/// that caused it (the OS's, the PEM parser's, the TLS library's), which the
/// message does not repeat.
#[derive(Debug, Clone)]
pub struct CredentialError {
    kind: CredentialErrorKind,
    message: String,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CredentialErrorKind {
    /// A file cannot be read.
    Unreadable,
    /// A file's contents are not usable credentials.
    Invalid,
    /// A secret is readable by every user.
    Exposed,
    /// This build cannot use this kind of credentials (PSK without OpenSSL).
    NotBuilt,
    /// The TLS library refused its own setup.
    Setup,
}

impl CredentialError {
    pub(crate) fn new(kind: CredentialErrorKind, message: impl Into<String>) -> Self {
        CredentialError { kind, message: message.into(), cause: None }
    }

    /// The same error, caused by `cause`.
    pub(crate) fn because(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(cause));
        self
    }

    /// What caused it, shared (for an error that wraps this one's message).
    pub fn cause(&self) -> Option<Arc<dyn std::error::Error + Send + Sync>> {
        self.cause.clone()
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(CredentialErrorKind::Invalid, message)
    }

    pub fn kind(&self) -> CredentialErrorKind {
        self.kind
    }
}

impl std::fmt::Display for CredentialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CredentialError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_deref().map(|c| c as &(dyn std::error::Error + 'static))
    }
}
