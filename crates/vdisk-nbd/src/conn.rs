//! The transmission phase of one connection.
//!
//! The connection's thread is the reader: one `read` into a large buffer, every
//! complete request in it validated once and handed to the device as one
//! batch. What the engine can finish without waiting for a device (data in
//! memory) it finishes right there, and the reader sends those replies itself;
//! the rest completes on the engine's workers, which send their replies through
//! the [`Outbox`].
//!
//! Memory per connection is bounded: requests in flight (read but not yet
//! replied to) may hold at most [`MAX_INFLIGHT_BYTES`], and a read runs only
//! while less than the connection's read window (2 MiB, growing to 16 MiB
//! while the client takes its replies whole: the outbox) is in flight or
//! unsent; past that the reader stops reading until the client takes its replies. All connections together
//! hold at most the server's [`Budget`]; a request it does not admit yet
//! waits the same way, after the pending batch went to the engine.

use std::io::{self, Read};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use vdisk_engine::{Bounds, Buf, Command, Device, Op, Refusal, Request, Sink};

use crate::budget::{Account, Budget};
use crate::handshake::Negotiated;
#[cfg(test)]
use crate::meta::{Context, Selected};
use crate::outbox::Outbox;
pub use crate::outbox::MAX_INFLIGHT_BYTES;
use crate::proto::*;
use crate::reply::{cost, refusal, Encoder, MAX_EXTENTS, REQUEST_OVERHEAD};
use crate::stream::Stream;

const READ_BUFFER: usize = 512 << 10;
/// Payloads bigger than this are read straight into their request's buffer.
const DIRECT_PAYLOAD: usize = READ_BUFFER / 2;

/// What the edge decided about one request: the engine's operation, and
/// DF (a structured read's reply in one chunk), which only the reply needs.
pub(crate) struct Valid {
    pub(crate) op: Op,
    pub(crate) dont_fragment: bool,
}

/// Checks a request once, against the export and what was negotiated. The
/// error is the errno the NBD spec names for the case.
pub(crate) fn validate(h: &RequestHeader, neg: &Negotiated, size: u64, read_only: bool) -> Result<Valid, u32> {
    let flag = |f: u16| h.flags & f != 0;
    let fua = flag(CMD_FLAG_FUA);
    let (op, allowed) = match h.kind {
        CMD_READ => (Op::Read, CMD_FLAG_DF),
        CMD_WRITE => (Op::Write { fua }, 0),
        CMD_FLUSH => (Op::Flush, 0),
        CMD_TRIM => (Op::Trim { fua }, 0),
        CMD_WRITE_ZEROES => (
            Op::WriteZeroes { fua, no_hole: flag(CMD_FLAG_NO_HOLE), fast_zero: flag(CMD_FLAG_FAST_ZERO) },
            CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        ),
        CMD_CACHE => (Op::Cache, 0),
        CMD_BLOCK_STATUS => {
            (Op::BlockStatus { max: if flag(CMD_FLAG_REQ_ONE) { 1 } else { MAX_EXTENTS } }, CMD_FLAG_REQ_ONE)
        }
        _ => return Err(EINVAL),
    };
    // FUA is valid on every command once SEND_FUA is advertised (it is, always);
    // where nothing is written it means nothing.
    if h.flags & !(allowed | CMD_FLAG_FUA) != 0 {
        return Err(EINVAL);
    }
    if h.flags & CMD_FLAG_DF != 0 && !neg.structured {
        return Err(EINVAL);
    }
    if matches!(op, Op::BlockStatus { .. }) && neg.contexts.is_empty() {
        return Err(EINVAL);
    }
    if op == Op::Flush && (h.offset != 0 || h.len != 0) {
        return Err(EINVAL);
    }
    // Range, length and read-only: the engine's one check, mapped to the spec's errnos.
    let bounds = Bounds { max_data: MAX_REQUEST as u64, ..Bounds::new(size, read_only) };
    match vdisk_engine::validate(op, h.offset, h.len as u64, &bounds) {
        Ok(()) => Ok(Valid { op, dont_fragment: flag(CMD_FLAG_DF) }),
        Err(Refusal::ReadOnly) => Err(EPERM),
        Err(Refusal::TooLong) if op == Op::Read && neg.structured => Err(EOVERFLOW),
        Err(Refusal::OutOfRange) if matches!(op, Op::Write { .. } | Op::WriteZeroes { .. }) && h.len > 0 => Err(ENOSPC),
        Err(Refusal::TooLong | Refusal::Misaligned | Refusal::OutOfRange | Refusal::Empty) => Err(EINVAL),
    }
}

/// Serves requests on `stream` until the client disconnects, sends DISC, breaks
/// the protocol, or the server shuts the socket's read side. Every request
/// read is answered (or the client is gone) before this returns.
///
/// Without `batching` (an ablation for benchmarks), each request is submitted
/// on its own, nothing runs inline, and each reply is sent with its own write.
pub fn transmission(
    stream: Stream,
    device: Arc<Device>,
    neg: Negotiated,
    batching: bool,
    budget: Arc<Budget>,
    account: Arc<Account>,
) -> io::Result<()> {
    let encoder =
        Encoder { structured: neg.structured, contexts: neg.contexts.clone().into(), errors: device.errors().clone() };
    let outbox =
        Arc::new(Outbox::new(stream.try_clone()?, encoder, batching, budget.clone(), account.clone(), device.clone()));
    let writer = {
        let outbox = outbox.clone();
        let shut = stream.try_clone()?;
        std::thread::Builder::new().name("nbd-writer".into()).spawn(move || {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| outbox.write_queued())) {
                log::error!(
                    "nbd {}: the reply writer panicked: {}; closing the connection",
                    shut.peer(),
                    panic_text(&*p)
                );
                shut.shutdown(std::net::Shutdown::Both);
            }
        })?
    };
    let mut reader = Reader {
        stream,
        device: &device,
        neg: &neg,
        outbox: &outbox,
        batching,
        batch: Vec::new(),
        budget: &budget,
        account: &account,
        gone: false,
    };
    // The connection's panic edge: a panic while reading or submitting ends
    // this connection (the socket is shut, so the client sees the end at once)
    // and nothing else; what was read is still answered below.
    let result = match catch_unwind(AssertUnwindSafe(|| reader.run())) {
        Ok(r) => r,
        Err(p) => {
            reader.stream.shutdown(std::net::Shutdown::Both);
            Err(io::Error::other(Panicked(panic_text(&*p))))
        }
    };
    // Requests already charged to the outbox must finish, even when the
    // stream broke mid-payload: until they do, the writer (and this
    // connection's threads and socket) would wait for them forever.
    reader.submit();
    outbox.reader_done();
    let _ = writer.join();
    reader.stream.close();
    result
}

/// A request type that panics the reader (tests of the panic edge only).
#[cfg(test)]
pub(crate) const TEST_PANIC_CMD: u16 = 0x7e57;

/// A connection ended by a panic (the message); [`crate::Server`] logs it as an error.
#[derive(Debug)]
pub(crate) struct Panicked(pub(crate) String);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a panic while serving it: {}", self.0)
    }
}

impl std::error::Error for Panicked {}

/// What a panic said.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_owned(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_owned(),
    }
}

struct Reader<'a> {
    stream: Stream,
    device: &'a Device,
    neg: &'a Negotiated,
    outbox: &'a Arc<Outbox>,
    batching: bool,
    batch: Vec<Request>,
    budget: &'a Budget,
    account: &'a Arc<Account>,
    /// The client is gone (found waiting for the budget): what it sent still
    /// runs, except what only makes a reply (reads), which nobody would get.
    gone: bool,
}

impl Reader<'_> {
    /// Hands the pending batch to the device; sends what it finished inline.
    fn submit(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let sink: Arc<dyn Sink> = self.outbox.clone();
        // The next batch is likely as long as this one: no growing it request by request.
        let next = Vec::with_capacity(self.batch.len());
        let batch = std::mem::replace(&mut self.batch, next);
        if self.batching {
            let mut done = Vec::with_capacity(batch.len());
            self.device.submit_inline(batch, &sink, &mut done);
            self.outbox.complete(done);
        } else {
            self.device.submit(batch, &sink);
        }
    }

    /// Charges a request against the connection's in-flight bound and the
    /// server's budget, submitting what is pending first if it has to wait
    /// (those requests must be able to finish).
    fn charge(&mut self, cost: usize, read: bool) {
        if !self.outbox.charge(cost, read, false) {
            self.submit();
            self.outbox.charge(cost, read, true);
        }
        if !self.budget.try_charge(cost, self.account) {
            self.submit();
            self.gone |= !self.budget.charge(cost, self.account);
        }
    }

    fn run(&mut self) -> io::Result<()> {
        let mut rbuf = vec![0u8; READ_BUFFER];
        let (mut start, mut end) = (0usize, 0usize);
        loop {
            let stop = self.take_requests(&rbuf[..end], &mut start)?;
            self.submit();
            if stop {
                return Ok(());
            }
            rbuf.copy_within(start..end, 0);
            end -= start;
            start = 0;
            match self.stream.read(&mut rbuf[end..]) {
                Ok(0) => return Ok(()),
                Ok(n) => end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes every complete request in `buf` from `*start` on (a large
    /// payload is read straight off the socket), moving `*start` past them.
    /// True when the connection ends: DISC, or the client left mid-payload.
    fn take_requests(&mut self, buf: &[u8], start: &mut usize) -> io::Result<bool> {
        let (size, read_only) = (self.device.size(), self.device.read_only());
        while buf.len() - *start >= REQUEST_HEADER {
            let h = RequestHeader::parse(buf[*start..*start + REQUEST_HEADER].try_into().unwrap());
            if h.magic != REQUEST_MAGIC {
                self.submit();
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {:#x}", h.magic)));
            }
            if h.kind == CMD_DISC {
                return Ok(true);
            }
            #[cfg(test)]
            if h.kind == TEST_PANIC_CMD {
                panic!("a test asked this connection to panic");
            }
            let payload = h.payload_len();
            let avail = buf.len() - *start - REQUEST_HEADER;
            if payload > avail && payload <= DIRECT_PAYLOAD {
                break; // the rest of this request is still on its way
            }
            *start += REQUEST_HEADER;
            let verdict = validate(&h, self.neg, size, read_only);
            let from_buf = payload.min(avail);
            let data = self.payload(verdict.is_ok(), payload, &buf[*start..*start + from_buf])?;
            *start += from_buf;
            let Some(data) = data else {
                return Ok(true); // the client left mid-payload: nothing to answer
            };
            self.accept(&h, verdict, data);
        }
        Ok(false)
    }

    /// A request's payload of `len` bytes: `have` (from the read buffer), the
    /// rest straight off the socket; a refused request's is read and dropped
    /// (empty). None when the client left before all of it came.
    fn payload(&mut self, keep: bool, len: usize, have: &[u8]) -> io::Result<Option<Buf>> {
        let mut data = Buf::new();
        if keep && len > 0 {
            // Every byte is about to be overwritten: a pooled buffer needs no zeroing.
            data = Buf::for_io(len);
            data[..have.len()].copy_from_slice(have);
        }
        if len > have.len() {
            let rest = len - have.len();
            let got = if keep {
                self.stream.read_all(&mut data[have.len()..])?
            } else {
                io::copy(&mut (&mut self.stream).take(rest as u64), &mut io::sink())? as usize
            };
            if got < rest {
                return Ok(None);
            }
        }
        Ok(Some(data))
    }

    /// Answers a request the edge refused, or adds it to the batch.
    fn accept(&mut self, h: &RequestHeader, verdict: Result<Valid, u32>, data: Buf) {
        let v = match verdict {
            Ok(v) => v,
            Err(errno) => {
                self.charge(REQUEST_OVERHEAD, false);
                self.outbox.deliver(vec![refusal(self.neg.structured, h.kind, h.cookie, errno)]);
                return;
            }
        };
        if self.gone && matches!(v.op, Op::Read | Op::Cache | Op::BlockStatus { .. }) {
            return;
        }
        let req = Request::new(Command::new(v.op, data.into()), h.offset, h.len as u64, h.cookie);
        if v.dont_fragment {
            self.outbox.dont_fragment(h.cookie);
        }
        self.charge(cost(v.op, req.len), v.op == Op::Read);
        self.batch.push(req);
        if !self.batching {
            self.submit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn neg(structured: bool, meta: bool) -> Negotiated {
        let contexts = if meta { vec![Selected { id: 1, context: Context::BaseAllocation }] } else { Vec::new() };
        Negotiated { export: 0, structured, contexts, transmission_flags: 0 }
    }

    fn hdr(kind: u16, flags: u16, offset: u64, len: u32) -> RequestHeader {
        RequestHeader { magic: REQUEST_MAGIC, flags, kind, cookie: 1, offset, len }
    }

    #[test]
    fn validation_names_the_spec_errno() {
        let n = neg(false, false);
        let v = |h| validate(&h, &n, 1 << 20, false).err();
        assert_eq!(v(hdr(CMD_READ, 0, 0, 4096)), None);
        assert_eq!(v(hdr(CMD_READ, 0, 1 << 20, 1)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_WRITE, 0, 1 << 20, 1)), Some(ENOSPC));
        assert_eq!(v(hdr(CMD_READ, 0, 0, 0)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_READ, 0, u64::MAX, 2)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_READ, 0, 0, MAX_REQUEST + 1)), Some(EINVAL));
        assert_eq!(v(hdr(42, 0, 0, 1)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_WRITE, 0x8000, 0, 1)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_READ, CMD_FLAG_DF, 0, 1)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_BLOCK_STATUS, 0, 0, 1)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_FLUSH, 0, 0, 0)), None);
        assert_eq!(validate(&hdr(CMD_TRIM, 0, 0, 1), &n, 1 << 20, true).err(), Some(EPERM));
        let s = neg(true, true);
        assert_eq!(validate(&hdr(CMD_READ, 0, 0, MAX_REQUEST + 1), &s, u64::MAX, false).err(), Some(EOVERFLOW));
        assert!(validate(&hdr(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1), &s, 1 << 20, false).is_ok());
        // Each refusal of the engine's check, as the spec names it.
        assert_eq!(v(hdr(CMD_WRITE, 0, 0, 0)), Some(EINVAL), "an empty write");
        assert_eq!(v(hdr(CMD_WRITE, 0, 2 << 20, 0)), Some(EINVAL), "an empty write past the end");
        assert_eq!(v(hdr(CMD_WRITE, 0, u64::MAX, 1)), Some(ENOSPC), "a write overflowing the offset");
        assert_eq!(v(hdr(CMD_WRITE_ZEROES, 0, 1 << 20, 1)), Some(ENOSPC));
        assert_eq!(v(hdr(CMD_TRIM, 0, 1 << 20, 1)), Some(EINVAL), "a trim past the end");
        assert_eq!(v(hdr(CMD_CACHE, 0, (1 << 20) - 1, 2)), Some(EINVAL));
        assert_eq!(v(hdr(CMD_WRITE, 0, 0, MAX_REQUEST + 1)), Some(EINVAL), "a write too long");
        assert_eq!(v(hdr(CMD_FLUSH, 0, 0, 1)), Some(EINVAL), "a flush with a range");
        let big = |h| validate(&h, &n, 1 << 40, false).err();
        assert_eq!(big(hdr(CMD_TRIM, 0, 0, u32::MAX)), None, "trims are not limited to 32 MiB");
        assert_eq!(big(hdr(CMD_WRITE_ZEROES, 0, (1 << 40) - 4096, 4096)), None, "up to the very end");
        let ro = |h| validate(&h, &n, 1 << 20, true).err();
        assert_eq!(ro(hdr(CMD_WRITE, 0, 1 << 30, MAX_REQUEST + 1)), Some(EPERM), "read-only is named first");
        assert_eq!(ro(hdr(CMD_WRITE_ZEROES, 0, 0, 0)), Some(EPERM));
        assert_eq!(ro(hdr(CMD_READ, 0, 0, 4096)), None);
        assert_eq!(ro(hdr(CMD_FLUSH, 0, 0, 0)), None);
    }
}
