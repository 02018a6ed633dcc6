//! The FUSE export's error: a kind, a message and the OS error that caused
//! it. The message never names a command-line flag (the kind tells the binary
//! how to word its advice) and does not repeat its cause: Display is the
//! message alone, `source()` the OS error.

use std::fmt;
use std::io;
use std::sync::Arc;

/// What an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Shared so the error stays `Clone`.
    source: Option<Arc<io::Error>>,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into(), source: None }
    }

    pub fn other(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Other, message)
    }

    /// The same error, caused by `source`, which the message does not repeat.
    pub fn because(mut self, source: io::Error) -> Error {
        self.source = Some(Arc::new(source));
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The OS error that caused it, if one.
    pub fn os_source(&self) -> Option<Arc<io::Error>> {
        self.source.clone()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cause_is_the_source_not_the_message() {
        let e = Error::other("cannot open /dev/fuse").because(io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(e.to_string(), "cannot open /dev/fuse");
        let cause = std::error::Error::source(&e).map(|s| s.to_string());
        assert_eq!(cause, Some(io::Error::from_raw_os_error(libc::ENOENT).to_string()));
    }
}
