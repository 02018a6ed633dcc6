//! The FUSE export's error: a kind and a message. The message never names a
//! command-line flag; the kind tells the binary how to word its advice.

use std::fmt;

/// What an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file the disk is exported as (the message starts with its path).
    File,
    /// The FUSE-over-io_uring transport of that file (the message starts with its path).
    Ring,
    /// FUSE-over-io_uring is switched off in this kernel (the message says how to turn it on).
    RingOff,
    /// This kernel has no FUSE-over-io_uring.
    RingMissing,
    /// Anything else: /dev/fuse, mounting, threads, unmounting.
    Other,
}

#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
    }

    pub fn other(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Other, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}
