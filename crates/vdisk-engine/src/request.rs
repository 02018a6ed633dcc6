//! What an export hands the engine, and what comes back. A request owns its
//! buffer from submission to completion: the engine reads into it or writes
//! from it, and gives it back inside the completed request.

use vdisk_image::{Allocation, Error};

use crate::Buf;

/// The operations every export maps its own commands onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// Every write completed before this was submitted becomes durable.
    Flush,
    /// The range may be deallocated; reading it afterwards is unspecified by NBD,
    /// but on a raw file it reads as zeros.
    Trim,
    /// The range must read as zeros afterwards.
    WriteZeroes,
    /// Prefetch the range into the host cache.
    Cache,
    /// Report allocation of the range into [`Request::status`].
    BlockStatus,
}

/// Modifiers of a request; exports translate their wire flags into these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flags {
    /// Durable before completion (NBD FUA).
    pub fua: bool,
    /// WRITE_ZEROES must leave the range allocated.
    pub no_hole: bool,
    /// WRITE_ZEROES must fail with `Unsupported` rather than be slow.
    pub fast_zero: bool,
}

/// One request in flight. `tag` is the export's own: the engine never looks at it.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    pub flags: Flags,
    /// Read: filled by the engine (must be `len` bytes). Write: the data.
    pub buf: Buf,
    /// BlockStatus: the runs found, at most `max_status` of them.
    pub status: Vec<Allocation>,
    pub max_status: usize,
    pub tag: u64,
    /// The export's own flags for this request, carried untouched.
    pub wire_flags: u16,
    /// Set by the engine when the request failed.
    pub error: Option<Error>,
}

impl Request {
    pub fn new(op: Op, offset: u64, len: u64, tag: u64) -> Self {
        Request {
            op,
            offset,
            len,
            flags: Flags::default(),
            buf: Buf::new(),
            status: Vec::new(),
            max_status: 0,
            tag,
            wire_flags: 0,
            error: None,
        }
    }
}

/// Where completed requests go. A sink receives them in batches, in whatever
/// order they finished; it must not block for long (it runs on a worker).
pub trait Sink: Send + Sync {
    fn complete(&self, done: Vec<Request>);
}
