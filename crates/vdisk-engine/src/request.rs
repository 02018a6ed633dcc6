//! What an export hands the engine, and what comes back. A request owns its
//! buffer from submission to completion: the engine reads into it or writes
//! from it, and gives it back inside the completed request.
//!
//! The operation is typed: each [`Op`] carries only the parameters that mean
//! something for it (FUA for what writes, the zeroing mode for WRITE_ZEROES,
//! the most runs for BLOCK_STATUS). Nothing of an export's wire format rides
//! along: an export that needs more to build its reply keeps it itself, keyed
//! by the request's opaque `tag`.

use vdisk_image::{Allocation, Error};

use crate::{Buf, Lent};

/// The operations every export maps its own commands onto, each with its own parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Fill [`Request::buf`] with `len` bytes.
    Read,
    /// Write [`Request::buf`]; with `fua`, durable before completion.
    Write { fua: bool },
    /// Every write completed before this was submitted becomes durable.
    Flush,
    /// The range may be deallocated; reading it afterwards is unspecified by NBD,
    /// but on a raw file it reads as zeros.
    Trim { fua: bool },
    /// The range must read as zeros afterwards. `no_hole`: it must stay
    /// allocated; `fast_zero`: fail with `Unsupported` rather than be slow.
    WriteZeroes { fua: bool, no_hole: bool, fast_zero: bool },
    /// Prefetch the range into the host cache.
    Cache,
    /// Report allocation of the range into [`Request::status`], at most `max` runs.
    BlockStatus { max: usize },
}

impl Op {
    /// A plain write.
    pub const WRITE: Op = Op::Write { fua: false };

    /// The operation's name, without its parameters (for messages).
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "Read",
            Op::Write { .. } => "Write",
            Op::Flush => "Flush",
            Op::Trim { .. } => "Trim",
            Op::WriteZeroes { .. } => "WriteZeroes",
            Op::Cache => "Cache",
            Op::BlockStatus { .. } => "BlockStatus",
        }
    }

    /// True for the data transfers (read, write): the ones with a buffer.
    pub fn is_data(self) -> bool {
        matches!(self, Op::Read | Op::Write { .. })
    }

    /// True for what changes the disk (write, trim, write zeroes).
    pub fn writes(self) -> bool {
        matches!(self, Op::Write { .. } | Op::Trim { .. } | Op::WriteZeroes { .. })
    }

    /// True when the caller asked for it to be durable before completion (FUA).
    pub fn fua(self) -> bool {
        matches!(self, Op::Write { fua: true } | Op::Trim { fua: true } | Op::WriteZeroes { fua: true, .. })
    }
}

/// One request in flight. `tag` is the export's own: the engine never looks at it.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    /// Read: filled by the engine (must be `len` bytes). Write: the data. Others: empty.
    pub buf: Buf,
    /// Read or write in memory the export lends instead (a VM guest's), of
    /// exactly `len` bytes; `buf` then stays empty.
    pub lent: Option<Lent>,
    /// BlockStatus: the runs found, at most its `max`. Others: empty.
    pub status: Vec<Allocation>,
    pub tag: u64,
    /// Set by the engine when the request failed.
    pub error: Option<Error>,
}

impl Request {
    pub fn new(op: Op, offset: u64, len: u64, tag: u64) -> Self {
        Request { op, offset, len, buf: Buf::new(), lent: None, status: Vec::new(), tag, error: None }
    }
}

/// Where completed requests go. A sink receives them in batches, in whatever
/// order they finished; it must not block for long (it runs on a worker).
pub trait Sink: Send + Sync {
    fn complete(&self, done: Vec<Request>);
}
