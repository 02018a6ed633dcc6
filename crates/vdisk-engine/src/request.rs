//! What an export hands the engine, and what comes back. A request owns its
//! data from submission to completion: the engine reads into it or writes
//! from it, and gives it back inside the completed request.
//!
//! The request is typed by operation: each [`Command`] variant carries only
//! its own fields — a read's or write's [`Data`] (a buffer of its own or
//! memory the export lends), FUA for what writes, the zeroing mode for
//! WRITE_ZEROES, the most runs and the runs found for BLOCK_STATUS — so no
//! request can hold a buffer it has no use for, or both a buffer and lent
//! memory. [`Op`] is the same operation without what it owns: a plain `Copy`
//! value exports decide on (and validate) before the data is there, and
//! what the engine matches on. Nothing of an export's wire format rides
//! along: an export that needs more to build its reply keeps it itself,
//! keyed by the request's opaque `tag`.

use vdisk_image::{Allocation, Error};

use crate::sys::Segment;
use crate::{Buf, Lent};

/// The operations every export maps its own commands onto, each with its own
/// parameters and without its data (see [`Command`] for the request's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Fill the request's data with `len` bytes.
    Read,
    /// Write the request's data; with `fua`, durable before completion.
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
    /// Report allocation of the range, at most `max` runs.
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

    /// True for the data transfers (read, write): the ones with [`Data`].
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

/// Where a read's or write's bytes live.
#[derive(Debug)]
pub enum Data {
    /// A buffer the request owns: a write's data, or what a read fills. A
    /// read's buffer is used when it has exactly the request's `len` bytes;
    /// otherwise (an empty one, typically) the engine allocates its own.
    Buf(Buf),
    /// Memory the export lends (a VM guest's), exactly the request's `len` bytes.
    Lent(Lent),
}

impl Default for Data {
    /// An empty buffer: what a read starts with when the engine is to allocate.
    fn default() -> Self {
        Data::Buf(Buf::new())
    }
}

impl From<Buf> for Data {
    fn from(buf: Buf) -> Self {
        Data::Buf(buf)
    }
}

impl From<Lent> for Data {
    fn from(lent: Lent) -> Self {
        Data::Lent(lent)
    }
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::Buf(b) => b.len(),
            Data::Lent(l) => l.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The owned buffer; None for lent memory (never a slice: see [`Lent`]).
    pub fn as_buf(&self) -> Option<&Buf> {
        match self {
            Data::Buf(b) => Some(b),
            Data::Lent(_) => None,
        }
    }

    /// Bytes `[at, at + len)` as a segment for a vectored call. Panics outside the data.
    pub(crate) fn segment(&mut self, at: usize, len: usize) -> Segment {
        match self {
            Data::Buf(b) => Segment { ptr: b[at..at + len].as_mut_ptr(), len },
            Data::Lent(l) => l.segment(at, len),
        }
    }

    /// Zeroes bytes `[at, at + len)` (a read of a hole). Panics outside the data.
    pub(crate) fn zero(&mut self, at: usize, len: usize) {
        match self {
            Data::Buf(b) => b[at..at + len].fill(0),
            Data::Lent(l) => l.zero(at, len),
        }
    }
}

/// A request's operation with its own fields: [`Op`] plus what the request
/// owns (a read's or write's data, the runs BLOCK_STATUS found).
#[derive(Debug)]
pub enum Command {
    /// Fill `data` with the request's `len` bytes.
    Read { data: Data },
    /// Write `data` (the request's `len` bytes); with `fua`, durable before completion.
    Write { data: Data, fua: bool },
    /// See [`Op::Flush`]: the request's range means nothing.
    Flush,
    /// See [`Op::Trim`].
    Trim { fua: bool },
    /// See [`Op::WriteZeroes`].
    WriteZeroes { fua: bool, no_hole: bool, fast_zero: bool },
    /// See [`Op::Cache`].
    Cache,
    /// Report allocation of the range into `runs` (filled by the engine), at most `max` of them.
    BlockStatus { max: usize, runs: Vec<Allocation> },
}

impl Command {
    /// `op` with `data` for a read or a write. The other operations carry no
    /// data: `data` is dropped (pass `Data::default()`).
    pub fn new(op: Op, data: Data) -> Command {
        match op {
            Op::Read => Command::Read { data },
            Op::Write { fua } => Command::Write { data, fua },
            Op::Flush => Command::Flush,
            Op::Trim { fua } => Command::Trim { fua },
            Op::WriteZeroes { fua, no_hole, fast_zero } => Command::WriteZeroes { fua, no_hole, fast_zero },
            Op::Cache => Command::Cache,
            Op::BlockStatus { max } => Command::BlockStatus { max, runs: Vec::new() },
        }
    }

    /// The operation and its parameters, without what the request owns.
    #[inline]
    pub fn op(&self) -> Op {
        match *self {
            Command::Read { .. } => Op::Read,
            Command::Write { fua, .. } => Op::Write { fua },
            Command::Flush => Op::Flush,
            Command::Trim { fua } => Op::Trim { fua },
            Command::WriteZeroes { fua, no_hole, fast_zero } => Op::WriteZeroes { fua, no_hole, fast_zero },
            Command::Cache => Op::Cache,
            Command::BlockStatus { max, .. } => Op::BlockStatus { max },
        }
    }

    /// A read's or write's data.
    pub fn data(&self) -> Option<&Data> {
        match self {
            Command::Read { data } | Command::Write { data, .. } => Some(data),
            _ => None,
        }
    }

    /// A read's or write's data, to fill in or take back.
    pub fn data_mut(&mut self) -> Option<&mut Data> {
        match self {
            Command::Read { data } | Command::Write { data, .. } => Some(data),
            _ => None,
        }
    }
}

/// An operation with no data yet: a read into a buffer the engine allocates,
/// or a write whose data the export puts in afterwards ([`Command::data_mut`]).
impl From<Op> for Command {
    fn from(op: Op) -> Self {
        Command::new(op, Data::default())
    }
}

/// One request in flight. `tag` is the export's own: the engine never looks at it.
#[derive(Debug)]
pub struct Request {
    pub cmd: Command,
    pub offset: u64,
    /// The range's length; a read's or write's data has exactly this many bytes.
    pub len: u64,
    pub tag: u64,
    /// Set by the engine when the request failed.
    pub error: Option<Error>,
}

impl Request {
    pub fn new(cmd: impl Into<Command>, offset: u64, len: u64, tag: u64) -> Self {
        Request { cmd: cmd.into(), offset, len, tag, error: None }
    }

    /// The operation and its parameters (a `Copy` value, cheap to match on).
    #[inline]
    pub fn op(&self) -> Op {
        self.cmd.op()
    }

    /// The bytes of a read's or write's own buffer (a read's, once completed);
    /// empty for lent memory and for the other operations.
    pub fn buf(&self) -> &[u8] {
        match self.cmd.data() {
            Some(Data::Buf(b)) => b,
            _ => &[],
        }
    }

    /// Takes a read's or write's own buffer out of the request (empty for
    /// lent memory and the other operations).
    pub fn take_buf(&mut self) -> Buf {
        match self.cmd.data_mut() {
            Some(Data::Buf(b)) => std::mem::take(b),
            _ => Buf::new(),
        }
    }

    /// The runs a BLOCK_STATUS found; empty for the other operations.
    pub fn runs(&self) -> &[Allocation] {
        match &self.cmd {
            Command::BlockStatus { runs, .. } => runs,
            _ => &[],
        }
    }
}

/// Where completed requests go. A sink receives them in batches, in whatever
/// order they finished; it must not block for long (it runs on a worker).
pub trait Sink: Send + Sync {
    fn complete(&self, done: Vec<Request>);
}
