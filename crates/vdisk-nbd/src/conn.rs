//! The transmission phase of one connection.
//!
//! The connection's thread is the reader: one `read` into a large buffer, every
//! complete request in it validated once and submitted to the device as one
//! batch. Completions arrive from the engine's workers into the [`Outbox`];
//! a writer thread sends everything waiting with one vectored write.
//!
//! Memory per connection is bounded: requests in flight (submitted but not yet
//! replied to) may hold at most [`MAX_INFLIGHT_BYTES`]; past that the reader
//! stops reading until the client takes its replies.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Condvar, Mutex};

use vdisk_engine::{Device, Flags, Op, Request, Sink};
use vdisk_image::{Allocation, Error, ErrorKind};

use crate::handshake::Negotiated;
use crate::proto::*;
use crate::stream::Stream;

const READ_BUFFER: usize = 512 << 10;
/// Payloads bigger than this are read straight into their request's buffer.
const DIRECT_PAYLOAD: usize = READ_BUFFER / 2;
pub const MAX_INFLIGHT_BYTES: usize = 64 << 20;
/// What a request costs beyond its data, for the in-flight bound.
const REQUEST_OVERHEAD: usize = 256;
/// Holes in read replies are found at this granularity.
const HOLE_GRANULE: usize = 64 << 10;
/// Most block-status descriptors in one reply.
const MAX_EXTENTS: usize = 2048;

/// Replies waiting to be sent, and the in-flight accounting that bounds them.
struct Outbox {
    state: Mutex<OutState>,
    changed: Condvar,
    structured: bool,
    allocation_context: u32,
}

#[derive(Default)]
struct OutState {
    msgs: Vec<OutMsg>,
    inflight: usize,
    inflight_bytes: usize,
    reader_done: bool,
}

/// One reply: header bytes and payload bytes, sent as `parts` in order.
struct OutMsg {
    head: Vec<u8>,
    data: Vec<u8>,
    parts: Vec<Part>,
    cost: usize,
}

#[derive(Clone, Copy)]
enum Part {
    Head(usize, usize),
    Data(usize, usize),
}

impl OutMsg {
    fn header_only(head: Vec<u8>, cost: usize) -> OutMsg {
        let n = head.len();
        OutMsg { head, data: Vec::new(), parts: vec![Part::Head(0, n)], cost }
    }
}

fn cost(op: Op, len: u64) -> usize {
    REQUEST_OVERHEAD + if matches!(op, Op::Read | Op::Write) { len as usize } else { 0 }
}

fn wire_errno(e: &Error) -> u32 {
    match e.kind() {
        ErrorKind::InvalidInput => EINVAL,
        ErrorKind::ReadOnly => EPERM,
        ErrorKind::NoSpace => ENOSPC,
        ErrorKind::Unsupported => ENOTSUP,
        ErrorKind::NotFound | ErrorKind::Corrupt | ErrorKind::Io => EIO,
    }
}

impl Sink for Outbox {
    fn complete(&self, done: Vec<Request>) {
        let msgs: Vec<OutMsg> = done.into_iter().map(|r| self.encode(r)).collect();
        let mut st = self.state.lock().unwrap();
        st.msgs.extend(msgs);
        drop(st);
        self.changed.notify_all();
    }
}

impl Outbox {
    fn encode(&self, req: Request) -> OutMsg {
        let cost = cost(req.op, req.len);
        let cookie = req.tag;
        let mut head = Vec::with_capacity(32);
        if let Some(e) = &req.error {
            if e.kind() != ErrorKind::Unsupported {
                log::warn!("{:?} of {} bytes at {} failed: {e}", req.op, req.len, req.offset);
            }
            if self.structured && matches!(req.op, Op::Read | Op::BlockStatus) {
                error_chunk(&mut head, cookie, wire_errno(e), e.message());
            } else {
                simple_reply(&mut head, wire_errno(e), cookie);
            }
            return OutMsg::header_only(head, cost);
        }
        match req.op {
            Op::Read if self.structured => encode_structured_read(req, cost),
            Op::Read => {
                simple_reply(&mut head, 0, cookie);
                let n = req.buf.len();
                OutMsg { parts: vec![Part::Head(0, head.len()), Part::Data(0, n)], head, data: req.buf, cost }
            }
            Op::BlockStatus => {
                let one = req.wire_flags & CMD_FLAG_REQ_ONE != 0;
                encode_block_status(&mut head, cookie, self.allocation_context, req.len, &req.status, one);
                OutMsg::header_only(head, cost)
            }
            _ => {
                simple_reply(&mut head, 0, cookie);
                OutMsg::header_only(head, cost)
            }
        }
    }

    /// Adds a request to the in-flight count. Without `wait`, refuses (false)
    /// when over budget; with it, blocks until replies drain.
    fn charge(&self, cost: usize, wait: bool) -> bool {
        let mut st = self.state.lock().unwrap();
        while st.inflight > 0 && st.inflight_bytes + cost > MAX_INFLIGHT_BYTES {
            if !wait {
                return false;
            }
            st = self.changed.wait(st).unwrap();
        }
        st.inflight += 1;
        st.inflight_bytes += cost;
        true
    }

    fn push(&self, msg: OutMsg) {
        self.state.lock().unwrap().msgs.push(msg);
        self.changed.notify_all();
    }
}

/// True when every byte is zero; checks 256 bytes at a time so it vectorizes.
fn is_zero(b: &[u8]) -> bool {
    let mut chunks = b.chunks_exact(256);
    chunks.by_ref().all(|c| c.iter().fold(0u8, |a, &x| a | x) == 0) && chunks.remainder().iter().all(|&x| x == 0)
}

/// OFFSET_DATA and OFFSET_HOLE chunks: all-zero granules travel as holes.
fn encode_structured_read(req: Request, cost: usize) -> OutMsg {
    let (cookie, offset, buf) = (req.tag, req.offset, req.buf);
    let mut runs: Vec<(bool, usize, usize)> = Vec::new();
    if req.wire_flags & CMD_FLAG_DF != 0 {
        runs.push((false, 0, buf.len()));
    } else {
        let mut at = 0;
        while at < buf.len() {
            let end = (at + HOLE_GRANULE).min(buf.len());
            let zero = is_zero(&buf[at..end]);
            match runs.last_mut() {
                Some(last) if last.0 == zero => last.2 = end,
                _ => runs.push((zero, at, end)),
            }
            at = end;
        }
    }
    let mut head = Vec::with_capacity(32 * runs.len());
    let mut parts = Vec::with_capacity(2 * runs.len());
    let last = runs.len() - 1;
    for (i, &(zero, start, end)) in runs.iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        let h0 = head.len();
        let len = end - start;
        if zero {
            chunk_header(&mut head, flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12);
            head.extend_from_slice(&(offset + start as u64).to_be_bytes());
            head.extend_from_slice(&(len as u32).to_be_bytes());
            parts.push(Part::Head(h0, head.len()));
        } else {
            chunk_header(&mut head, flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + len as u32);
            head.extend_from_slice(&(offset + start as u64).to_be_bytes());
            parts.push(Part::Head(h0, head.len()));
            parts.push(Part::Data(start, end));
        }
    }
    OutMsg { head, data: buf, parts, cost }
}

fn encode_block_status(out: &mut Vec<u8>, cookie: u64, context: u32, len: u64, runs: &[Allocation], one: bool) {
    let mut descs: Vec<(u32, u32)> = Vec::new();
    let mut left = len;
    for r in runs {
        if left == 0 {
            break;
        }
        let n = r.len.min(left);
        left -= n;
        let flags = if r.hole { STATE_HOLE } else { 0 } | if r.zero { STATE_ZERO } else { 0 };
        match descs.last_mut() {
            Some(d) if d.1 == flags => d.0 += n as u32,
            _ => descs.push((n as u32, flags)),
        }
    }
    if descs.is_empty() {
        descs.push((len as u32, 0));
    }
    descs.truncate(if one { 1 } else { MAX_EXTENTS });
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, 4 + 8 * descs.len() as u32);
    out.extend_from_slice(&context.to_be_bytes());
    for (n, f) in descs {
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&f.to_be_bytes());
    }
}

/// What the edge decided about one request.
struct Valid {
    op: Op,
    flags: Flags,
}

/// Checks a request once, against the export and what was negotiated. The
/// error is the errno the NBD spec names for the case.
fn validate(h: &RequestHeader, neg: &Negotiated, size: u64, read_only: bool) -> Result<Valid, u32> {
    let (op, allowed) = match h.kind {
        CMD_READ => (Op::Read, CMD_FLAG_DF),
        CMD_WRITE => (Op::Write, CMD_FLAG_FUA),
        CMD_FLUSH => (Op::Flush, 0),
        CMD_TRIM => (Op::Trim, CMD_FLAG_FUA),
        CMD_WRITE_ZEROES => (Op::WriteZeroes, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO),
        CMD_CACHE => (Op::Cache, 0),
        CMD_BLOCK_STATUS => (Op::BlockStatus, CMD_FLAG_REQ_ONE),
        _ => return Err(EINVAL),
    };
    if h.flags & !allowed != 0 {
        return Err(EINVAL);
    }
    if h.flags & CMD_FLAG_DF != 0 && !neg.structured {
        return Err(EINVAL);
    }
    let writes = matches!(op, Op::Write | Op::Trim | Op::WriteZeroes);
    if writes && read_only {
        return Err(EPERM);
    }
    if op == Op::BlockStatus && neg.allocation_context.is_none() {
        return Err(EINVAL);
    }
    if op == Op::Flush {
        return if h.offset == 0 && h.len == 0 { Ok(Valid { op, flags: Flags::default() }) } else { Err(EINVAL) };
    }
    if matches!(op, Op::Read | Op::Write) && h.len > MAX_REQUEST {
        return Err(if op == Op::Read && neg.structured { EOVERFLOW } else { EINVAL });
    }
    let in_range = h.len > 0 && h.offset.checked_add(h.len as u64).is_some_and(|end| end <= size);
    if !in_range {
        return Err(if matches!(op, Op::Write | Op::WriteZeroes) && h.len > 0 { ENOSPC } else { EINVAL });
    }
    let flags = Flags {
        fua: h.flags & CMD_FLAG_FUA != 0,
        no_hole: h.flags & CMD_FLAG_NO_HOLE != 0,
        fast_zero: h.flags & CMD_FLAG_FAST_ZERO != 0,
    };
    Ok(Valid { op, flags })
}

/// Serves requests on `stream` until the client disconnects, sends DISC, breaks
/// the protocol, or the server shuts the socket's read side. Every request
/// read is answered (or the client is gone) before this returns.
///
/// Without `batching` (an ablation for benchmarks), each request is submitted
/// on its own and each reply sent with its own write.
pub fn transmission(stream: Stream, device: Arc<Device>, neg: Negotiated, batching: bool) -> io::Result<()> {
    let outbox = Arc::new(Outbox {
        state: Mutex::new(OutState::default()),
        changed: Condvar::new(),
        structured: neg.structured,
        allocation_context: neg.allocation_context.unwrap_or(0),
    });
    let writer = {
        let outbox = outbox.clone();
        let stream = stream.try_clone()?;
        std::thread::Builder::new().name("nbd-writer".into()).spawn(move || write_replies(stream, &outbox, batching))?
    };
    let result = read_requests(stream, &device, &neg, &outbox, batching);
    outbox.state.lock().unwrap().reader_done = true;
    outbox.changed.notify_all();
    let _ = writer.join();
    result
}

fn read_requests(
    mut stream: Stream,
    device: &Device,
    neg: &Negotiated,
    outbox: &Arc<Outbox>,
    batching: bool,
) -> io::Result<()> {
    let sink: Arc<dyn Sink> = outbox.clone();
    let (size, read_only) = (device.size(), device.read_only());
    let mut rbuf = vec![0u8; READ_BUFFER];
    let (mut start, mut end) = (0usize, 0usize);
    let mut batch: Vec<Request> = Vec::new();
    loop {
        let mut stop = false;
        while end - start >= REQUEST_HEADER {
            let h = RequestHeader::parse(rbuf[start..start + REQUEST_HEADER].try_into().unwrap());
            if h.magic != REQUEST_MAGIC {
                device.submit(std::mem::take(&mut batch), &sink);
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {:#x}", h.magic)));
            }
            if h.kind == CMD_DISC {
                stop = true;
                break;
            }
            let payload = h.payload_len();
            let avail = end - start - REQUEST_HEADER;
            if payload > avail && payload <= DIRECT_PAYLOAD {
                break; // the rest of this request is still on its way
            }
            start += REQUEST_HEADER;
            let verdict = validate(&h, neg, size, read_only);
            // The payload: from the buffer, or straight off the socket when large.
            let mut data = Vec::new();
            let from_buf = payload.min(avail);
            if verdict.is_ok() && payload > 0 {
                data.reserve_exact(payload);
                data.extend_from_slice(&rbuf[start..start + from_buf]);
            }
            start += from_buf;
            if payload > from_buf {
                let rest = (payload - from_buf) as u64;
                let got = if verdict.is_ok() {
                    (&mut stream).take(rest).read_to_end(&mut data)? as u64
                } else {
                    io::copy(&mut (&mut stream).take(rest), &mut io::sink())?
                };
                if got < rest {
                    stop = true;
                    break; // the client left mid-payload: nothing to answer
                }
            }
            let v = match verdict {
                Ok(v) => v,
                Err(errno) => {
                    if !outbox.charge(REQUEST_OVERHEAD, false) {
                        device.submit(std::mem::take(&mut batch), &sink);
                        outbox.charge(REQUEST_OVERHEAD, true);
                    }
                    let mut head = Vec::with_capacity(32);
                    if neg.structured && matches!(h.kind, CMD_READ | CMD_BLOCK_STATUS) {
                        error_chunk(&mut head, h.cookie, errno, "invalid request");
                    } else {
                        simple_reply(&mut head, errno, h.cookie);
                    }
                    outbox.push(OutMsg::header_only(head, REQUEST_OVERHEAD));
                    continue;
                }
            };
            let mut req = Request::new(v.op, h.offset, h.len as u64, h.cookie);
            req.flags = v.flags;
            req.wire_flags = h.flags;
            req.buf = data;
            if v.op == Op::BlockStatus {
                req.max_status = if h.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
            }
            let c = cost(v.op, req.len);
            if !outbox.charge(c, false) {
                device.submit(std::mem::take(&mut batch), &sink);
                outbox.charge(c, true);
            }
            batch.push(req);
            if !batching {
                device.submit(std::mem::take(&mut batch), &sink);
            }
        }
        device.submit(std::mem::take(&mut batch), &sink);
        if stop {
            return Ok(());
        }
        rbuf.copy_within(start..end, 0);
        end -= start;
        start = 0;
        match stream.read(&mut rbuf[end..]) {
            Ok(0) => return Ok(()),
            Ok(n) => end += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Sends whatever replies are waiting with one vectored write, until the reader
/// is done and nothing is in flight. After a send error it keeps draining (the
/// client is gone) so that the reader and the engine never wait on it.
fn write_replies(mut stream: Stream, outbox: &Outbox, batching: bool) {
    let mut broken = false;
    loop {
        let msgs = {
            let mut st = outbox.state.lock().unwrap();
            while st.msgs.is_empty() && !(st.reader_done && st.inflight == 0) {
                st = outbox.changed.wait(st).unwrap();
            }
            if st.msgs.is_empty() {
                return;
            }
            std::mem::take(&mut st.msgs)
        };
        if !broken {
            let sent = if batching {
                send_all(&mut stream, &msgs)
            } else {
                msgs.iter().try_for_each(|m| send_all(&mut stream, std::slice::from_ref(m)))
            };
            if let Err(e) = sent {
                log::info!("{}: cannot send replies ({e}); dropping the connection", stream.peer());
                stream.shutdown(Shutdown::Both);
                broken = true;
            }
        }
        let freed: usize = msgs.iter().map(|m| m.cost).sum();
        let mut st = outbox.state.lock().unwrap();
        st.inflight -= msgs.len();
        st.inflight_bytes -= freed;
        drop(st);
        outbox.changed.notify_all();
    }
}

fn send_all(stream: &mut Stream, msgs: &[OutMsg]) -> io::Result<()> {
    let mut slices: Vec<IoSlice> = Vec::with_capacity(msgs.len() * 2);
    for m in msgs {
        for p in &m.parts {
            slices.push(IoSlice::new(match *p {
                Part::Head(a, b) => &m.head[a..b],
                Part::Data(a, b) => &m.data[a..b],
            }));
        }
    }
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = rest.len().min(1024);
        match stream.write_vectored(&rest[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut rest, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn neg(structured: bool, meta: bool) -> Negotiated {
        Negotiated { export: 0, structured, allocation_context: meta.then_some(1), transmission_flags: 0 }
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
    }

    #[test]
    fn structured_reads_send_zero_granules_as_holes() {
        let mut req = Request::new(Op::Read, 4096, 3 * HOLE_GRANULE as u64, 5);
        req.buf = vec![0u8; 3 * HOLE_GRANULE];
        req.buf[HOLE_GRANULE + 7] = 1;
        let m = encode_structured_read(req, 0);
        // hole, data, hole: three chunks, two header-only.
        let kinds: Vec<&str> = m.parts.iter().map(|p| if matches!(p, Part::Head(..)) { "h" } else { "d" }).collect();
        assert_eq!(kinds, ["h", "h", "d", "h"]);
        let mut whole = Request::new(Op::Read, 0, 4096, 5);
        whole.buf = vec![0u8; 4096];
        assert_eq!(encode_structured_read(whole, 0).parts.len(), 1);
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[0u8; 4099]));
        let mut b = vec![0u8; 4099];
        b[4098] = 1;
        assert!(!is_zero(&b));
        b[4098] = 0;
        b[5] = 1;
        assert!(!is_zero(&b));
    }
}
