//! The one error type of vdisk. Every layer returns it; each export maps its
//! [`ErrorKind`] to its own wire code (NBD errno, virtio status, FUSE errno).
//! A message says what failed and where (path, offset). What the user can do
//! about it is an [`Advice`], which the binary words in its own terms (its
//! command-line flags): a library never names a flag.
//!
//! Where it is known, the error also carries the operation ("write"), the
//! offset and the path it concerns as fields ([`Error::op`], [`Error::at`],
//! [`Error::path`]), so callers need not parse them out of the message.
//!
//! Display is the message alone and never repeats the cause; [`Error::report`]
//! adds the chain of causes (the OS error text, "No space left on device"),
//! which is what logs and users must be shown.
//!
//! An error can be cloned with its OS error kept (shared), so when one merged
//! call fails, each request in it reports the real errno.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What kind of failure this is; the edge maps it to the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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

/// An error with its kind, a message for people, what they can do about it,
/// the operation, offset and path where known and, where there was one, the
/// OS error.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    advice: Option<Advice>,
    op: Option<&'static str>,
    offset: Option<u64>,
    path: Option<PathBuf>,
    source: Option<Arc<io::Error>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), advice: None, op: None, offset: None, path: None, source: None }
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
        Error { source: Some(Arc::new(source)), ..Self::new(kind, message) }
    }

    /// The same error, from the operation `op` ("read", "write", "open").
    pub fn op(mut self, op: &'static str) -> Self {
        self.op = Some(op);
        self
    }

    /// The same error, at byte `offset` (of the image or of the file in [`Error::path`]).
    pub fn at(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    /// The same error, about the file at `path`.
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// The same error (kind, cause, fields) with a new message, which may
    /// quote the old one ([`Error::message`]): the cause stays a cause.
    pub fn reworded(self, message: impl Into<String>) -> Self {
        Error { message: message.into(), ..self }
    }

    /// The same error (kind, message), caused by the OS error `source`.
    pub fn caused_by(self, source: io::Error) -> Self {
        Error { source: Some(Arc::new(source)), ..self }
    }

    /// The OS error that caused this, shared, for an error of another layer
    /// to keep as its own cause.
    pub fn os_source(&self) -> Option<Arc<io::Error>> {
        self.source.clone()
    }

    /// The operation that failed, if known.
    pub fn operation(&self) -> Option<&'static str> {
        self.op
    }

    /// The byte offset it failed at, if known.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// The file it concerns, if known.
    pub fn file(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The message and every cause after it ("write ... of disk.img: No space
    /// left on device (os error 28)"): what users and logs are shown.
    pub fn report(&self) -> Report<'_> {
        Report(self)
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

/// An error with its causes, one after another: [`Error::report`], and the
/// daemon's error's too (any error whose Display is its own message alone).
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The message alone: the cause is [`std::error::Error::source`], which
/// [`Error::report`] adds.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
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
        let e = Error::io(io::Error::from_raw_os_error(libc::EIO), "x").advise(Advice::ReadOnly);
        assert_eq!(e.errno(), libc::EIO);
        let c = e.clone();
        assert_eq!(
            (c.os_error(), c.advice(), c.report().to_string()),
            (Some(libc::EIO), Some(Advice::ReadOnly), e.report().to_string())
        );
    }

    #[test]
    fn display_is_the_message_and_the_report_adds_the_os_error() {
        let os = io::Error::from_raw_os_error(libc::ENOSPC);
        let text = os.to_string();
        let e =
            Error::io(os, "write of 512 bytes at offset 4096 of /x/disk.img").op("write").at(4096).path("/x/disk.img");
        assert_eq!(e.to_string(), "write of 512 bytes at offset 4096 of /x/disk.img", "the source is not repeated");
        assert_eq!(e.report().to_string(), format!("{e}: {text}"));
        assert!(text.contains("No space left on device"), "{text}");
        assert_eq!((e.operation(), e.offset(), e.file()), (Some("write"), Some(4096), Some(Path::new("/x/disk.img"))));
        assert!(std::error::Error::source(&e).is_some() && e.os_source().is_some());
        // Reworded, it keeps its kind, cause and fields.
        let r = e.clone().reworded(format!("backing file b: {}", e.message()));
        assert_eq!((r.kind(), r.os_error(), r.offset()), (ErrorKind::NoSpace, Some(libc::ENOSPC), Some(4096)));
        assert_eq!(r.report().to_string(), format!("backing file b: {}", e.report()));
        // Without a cause, the report is the message; without fields, none are made up.
        let plain = Error::invalid("bad size");
        assert_eq!(
            (plain.report().to_string(), plain.operation(), plain.offset(), plain.file()),
            ("bad size".into(), None, None, None)
        );
    }
}
