//! The daemon's one error type: what kind of refusal or failure (which the
//! control socket maps to a JSON-RPC code and the command line to an exit
//! code), a message for people that says what, where and what to do, the
//! path it concerns, and the error that caused it. Display is the message
//! alone; [`Error::report`] adds the chain of causes, as users see it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_image::Report;

/// What went wrong, as callers decide on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No such export.
    NotFound,
    /// The name is taken (served, being added or being removed).
    Exists,
    /// The export is in use (clients, a FUSE file, a VM attached).
    Busy,
    /// What was asked cannot be: a bad name, path, file, setting (the user's to fix).
    Invalid,
    /// Something failed while doing what was asked (the system's).
    Failed,
}

/// The cause of an error, shared so the error stays `Clone`.
type Source = Arc<dyn std::error::Error + Send + Sync>;

/// A refusal or failure of the daemon: its kind, the message, the path it
/// concerns, the operation and offset of a failed I/O, and its cause.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    path: Option<PathBuf>,
    operation: Option<&'static str>,
    offset: Option<u64>,
    source: Option<Source>,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into(), path: None, operation: None, offset: None, source: None }
    }

    /// The operation that failed ("read", "write", "flush", ...), if it was an I/O.
    pub fn operation(&self) -> Option<&'static str> {
        self.operation
    }

    /// The byte offset the failed I/O concerned, if one.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// The same error, about `path` (a file, socket or image name).
    pub fn at(mut self, path: impl Into<PathBuf>) -> Error {
        self.path = Some(path.into());
        self
    }

    /// The same error, caused by `source` (an OS or library error), which the
    /// message does not repeat.
    pub fn because(mut self, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
        self.source = Some(Arc::from(source.into()));
        self
    }

    /// The same error, caused by an error another error shares.
    pub fn because_shared(mut self, source: Source) -> Error {
        self.source = Some(source);
        self
    }

    /// The path it concerns, if one.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The message and every cause after it ("cannot bind x: Address in use"):
    /// what users and logs are shown.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }

    /// The caller asked for something that cannot be.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Invalid, message)
    }

    /// Something failed while doing what was asked.
    pub fn failed(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Failed, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `context` said first ("FILE:LINE: export \"x\": ...").
    pub fn context(self, context: impl fmt::Display) -> Error {
        Error { message: format!("{context}: {}", self.message), ..self }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// Image errors the user caused (a missing file, a directory, a bad name) are `Invalid`.
impl From<vdisk_image::Error> for Error {
    fn from(e: vdisk_image::Error) -> Self {
        use vdisk_image::ErrorKind::*;
        match e.kind() {
            InvalidInput | NotFound | ReadOnly | Corrupt => Error::image(ErrorKind::Invalid, &e),
            _ => Error::image(ErrorKind::Failed, &e),
        }
    }
}

impl Error {
    /// An image error as the daemon's, of `kind`: its message with its advice
    /// in vdisk's terms, its path, and its OS error as the cause (so
    /// [`Error::report`] shows "No space left on device" once).
    pub fn image(kind: ErrorKind, e: &vdisk_image::Error) -> Error {
        Error {
            kind,
            message: format!("{}{}", e.message(), advice(e)),
            path: e.file().map(Path::to_path_buf),
            operation: e.operation(),
            offset: e.offset(),
            source: e.os_source().map(|s| s as Source),
        }
    }
}

/// An image error's message and causes with its advice in the terms of
/// vdisk's command line, as one line of text.
pub fn advised(e: &vdisk_image::Error) -> String {
    format!("{}{}", e.report(), advice(e))
}

/// An image error's advice in the terms of vdisk's command line ("" if none).
fn advice(e: &vdisk_image::Error) -> &'static str {
    use vdisk_image::Advice::*;
    match e.advice() {
        Some(CreateImage) => " (create one with `vdisk create IMAGE --size 10G`)",
        Some(ReadOnly) => " (try --readonly)",
        Some(NoDirectIo) => "; serve it without --direct",
        Some(NameBacking) => "; name the backing file with --backing PATH",
        Some(IgnoreBackingMtime) => {
            "; if it still holds the same data, pass --ignore-backing-mtime, or name the right file with --backing PATH"
        }
        Some(CephConfig) => "; name the Ceph configuration with --ceph-conf PATH (or :conf=PATH) and the client with --ceph-id NAME (or :id=NAME)",
        Some(_) | None => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_message_and_the_report_adds_the_causes() {
        let os = std::io::Error::from_raw_os_error(libc::EADDRINUSE);
        let e = Error::invalid("cannot listen on unix socket /x").at("/x").because(os);
        assert_eq!(e.to_string(), "cannot listen on unix socket /x", "the source is not repeated");
        let report = e.report().to_string();
        assert!(report.starts_with("cannot listen on unix socket /x: ") && report.len() > 33, "{report}");
        assert_eq!(e.path(), Some(Path::new("/x")));
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert!(std::error::Error::source(&e).is_some());
        let outer = e.clone().context("export \"d\"");
        assert_eq!(outer.report().to_string(), format!("export \"d\": {report}"));
    }

    #[test]
    fn an_image_error_keeps_its_os_error_as_the_cause_once() {
        let os = std::io::Error::from_raw_os_error(libc::EACCES);
        let text = os.to_string();
        let img =
            vdisk_image::Error::io(os, "cannot open image /x.img").path("/x.img").advise(vdisk_image::Advice::ReadOnly);
        let e = Error::from(img.clone());
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert_eq!(e.to_string(), "cannot open image /x.img (try --readonly)");
        assert_eq!(e.report().to_string(), format!("cannot open image /x.img (try --readonly): {text}"));
        assert_eq!(e.path(), Some(Path::new("/x.img")));
        assert_eq!(advised(&img), format!("cannot open image /x.img: {text} (try --readonly)"));
        let io =
            vdisk_image::Error::io(std::io::Error::from_raw_os_error(libc::EIO), "write failed").op("write").at(4096);
        let e = Error::from(io);
        assert_eq!((e.operation(), e.offset(), e.kind()), (Some("write"), Some(4096), ErrorKind::Failed));
    }
}
