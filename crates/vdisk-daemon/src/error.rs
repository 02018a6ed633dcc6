//! The daemon's one error type: what kind of refusal or failure (which the
//! control socket maps to a JSON-RPC code and the command line to an exit
//! code) and a message for people that says what, where and what to do.

use std::fmt;

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

/// A refusal or failure of the daemon: its kind and the message.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
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
        Error { kind: self.kind, message: format!("{context}: {}", self.message) }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Image errors the user caused (a missing file, a directory, a bad name) are `Invalid`.
impl From<vdisk_image::Error> for Error {
    fn from(e: vdisk_image::Error) -> Self {
        use vdisk_image::ErrorKind::*;
        match e.kind() {
            InvalidInput | NotFound | ReadOnly | Corrupt => Error::invalid(advised(&e)),
            _ => Error::failed(advised(&e)),
        }
    }
}

/// An image error's message with its advice in the terms of vdisk's command line.
pub fn advised(e: &vdisk_image::Error) -> String {
    use vdisk_image::Advice::*;
    let advice = match e.advice() {
        Some(CreateImage) => " (create one with `vdisk create IMAGE --size 10G`)",
        Some(ReadOnly) => " (try --readonly)",
        Some(NoDirectIo) => "; serve it without --direct",
        Some(NameBacking) => "; name the backing file with --backing PATH",
        Some(IgnoreBackingMtime) => {
            "; if it still holds the same data, pass --ignore-backing-mtime, or name the right file with --backing PATH"
        }
        Some(CephConfig) => "; name the Ceph configuration with --ceph-conf PATH (or :conf=PATH) and the client with --ceph-id NAME (or :id=NAME)",
        Some(_) | None => "",
    };
    format!("{e}{advice}")
}
