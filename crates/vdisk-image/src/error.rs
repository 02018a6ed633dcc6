//! The one error type of vdisk. Every layer returns it; each export maps its
//! [`ErrorKind`] to its own wire code (NBD errno, virtio status, FUSE errno).
//! A message says what failed and where (path, offset). What the user can do
//! about it is an [`Advice`], which the binary words in its own terms (its
//! command-line flags): a library never names a flag.
//!
//! An error can be cloned with its OS error kept (shared), so when one merged
//! call fails, each request in it reports the real errno.

use std::fmt;
use std::io;
use std::sync::Arc;

/// What kind of failure this is; the edge maps it to the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request or argument is malformed (bad range, bad flag, not a number).
    InvalidInput,
    /// A write was attempted on something read-only.
    ReadOnly,
    /// The backing store is full.
    NoSpace,
    /// The operation is not supported here (e.g. a fast zero the file system cannot do).
    Unsupported,
    /// A file does not exist.
    NotFound,
    /// The file exists but its contents are not what they must be.
    Corrupt,
    /// The backing store failed.
    Io,
}

/// What the user can do about an error; the binary says how (which flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Advice {
    /// The path is not an image: create one.
    CreateImage,
    /// The image cannot be opened for writing: serve it read-only.
    ReadOnly,
    /// The file system cannot do direct I/O: serve without it.
    NoDirectIo,
    /// The backing file of an overlay is not found or not certain: name it.
    NameBacking,
    /// The backing file's mtime differs from the overlay's header: if it holds
    /// the same data, ignore the mtime; else name the right file.
    IgnoreBackingMtime,
    /// A Ceph cluster cannot be reached or configured: name its configuration
    /// file and client id.
    CephConfig,
}

/// An error with its kind, a message for people, what they can do about it
/// and, where there was one, the OS error.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    advice: Option<Advice>,
    source: Option<Arc<io::Error>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), advice: None, source: None }
    }

    /// Wraps an OS error, classifying it by errno, with a message that says where it happened.
    pub fn io(source: io::Error, message: impl Into<String>) -> Self {
        let kind = match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
            Some(libc::EROFS) | Some(libc::EPERM) | Some(libc::EACCES) => ErrorKind::ReadOnly,
            Some(libc::EOPNOTSUPP) => ErrorKind::Unsupported,
            Some(libc::ENOENT) => ErrorKind::NotFound,
            Some(libc::EINVAL) => ErrorKind::InvalidInput,
            _ => match source.kind() {
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::ReadOnly,
                _ => ErrorKind::Io,
            },
        };
        Error { kind, message: message.into(), advice: None, source: Some(Arc::new(source)) }
    }

    /// The same error, with what the user can do about it.
    pub fn advise(mut self, advice: Advice) -> Self {
        self.advice = Some(advice);
        self
    }

    pub fn advice(&self) -> Option<Advice> {
        self.advice
    }

    /// The OS error number, if an OS error caused this.
    pub fn os_error(&self) -> Option<i32> {
        self.source.as_ref().and_then(|s| s.raw_os_error())
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The POSIX errno that best describes this error, for exports whose wire speaks errno.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::InvalidInput => libc::EINVAL,
            ErrorKind::ReadOnly => libc::EPERM,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Unsupported => libc::EOPNOTSUPP,
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Corrupt | ErrorKind::Io => libc::EIO,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| &**e as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_errors_map_to_kinds_and_back() {
        let e = Error::io(io::Error::from_raw_os_error(libc::ENOSPC), "write disk.img at 4096");
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.errno(), libc::ENOSPC);
        assert!(e.to_string().starts_with("write disk.img at 4096: "));
        let e = Error::io(io::Error::from_raw_os_error(libc::EIO), "x").advise(Advice::ReadOnly);
        assert_eq!(e.errno(), libc::EIO);
        let c = e.clone();
        assert_eq!((c.os_error(), c.advice(), c.to_string()), (Some(libc::EIO), Some(Advice::ReadOnly), e.to_string()));
    }
}
