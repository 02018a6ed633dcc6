//! Reply encoding: a completed request becomes the bytes of its NBD reply, as
//! header bytes plus slices of the request's own buffer (no copy of the data).

use std::sync::Arc;

use smallvec::{smallvec, SmallVec};
use vdisk_engine::{Buf, ErrorLog, Op, Request};
use vdisk_image::{Error, ErrorKind};

use crate::proto::*;

/// What a request costs beyond its data, for the in-flight bound.
pub const REQUEST_OVERHEAD: usize = 256;
/// Holes in read replies are found at this granularity.
const HOLE_GRANULE: usize = 64 << 10;
/// Most block-status descriptors in one reply.
pub const MAX_EXTENTS: usize = 2048;

/// One reply: header bytes and payload bytes, sent as `parts` in order. A
/// simple reply, or a read's reply in one chunk, allocates nothing of its own.
pub struct OutMsg {
    pub head: Head,
    pub data: Buf,
    pub parts: SmallVec<[Part; 2]>,
    /// What was charged against the connection's in-flight bound.
    pub cost: usize,
    /// A read's reply: the export offset `data` was read from, so the data
    /// can be dropped while the client takes nothing and read again later.
    pub read_at: Option<u64>,
    /// `data` was dropped (its bytes released from the budget): read it again before sending.
    pub dropped: bool,
}

#[derive(Clone, Copy)]
pub enum Part {
    Head(usize, usize),
    Data(usize, usize),
}

impl OutMsg {
    pub fn header_only(head: Head, cost: usize) -> OutMsg {
        let n = head.len();
        OutMsg { head, data: Buf::new(), parts: smallvec![Part::Head(0, n)], cost, read_at: None, dropped: false }
    }

    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(|p| match *p {
            Part::Head(a, b) => &self.head[a..b],
            Part::Data(a, b) => &self.data[a..b],
        })
    }
}

/// What a request costs against the in-flight bound.
pub fn cost(op: Op, len: u64) -> usize {
    REQUEST_OVERHEAD + if op.is_data() { len as usize } else { 0 }
}

fn wire_errno(e: &Error) -> u32 {
    match e.kind() {
        ErrorKind::InvalidInput => EINVAL,
        ErrorKind::ReadOnly => EPERM,
        ErrorKind::NoSpace => ENOSPC,
        ErrorKind::Unsupported => ENOTSUP,
        ErrorKind::NotFound | ErrorKind::Corrupt | ErrorKind::Io => EIO,
        _ => EIO,
    }
}

/// How replies are shaped on this connection, and where failed requests are
/// reported (the device's rate-limited log).
#[derive(Clone)]
pub struct Encoder {
    pub structured: bool,
    /// The meta contexts selected, each answering block status with a chunk.
    pub contexts: Arc<[crate::meta::Selected]>,
    pub errors: Arc<ErrorLog>,
}

/// An error reply for a request refused at the edge.
pub fn refusal(structured: bool, kind: u16, cookie: u64, errno: u32) -> OutMsg {
    let mut head = Head::new();
    if structured && matches!(kind, CMD_READ | CMD_BLOCK_STATUS) {
        error_chunk(&mut head, cookie, errno, "invalid request");
    } else {
        simple_reply(&mut head, errno, cookie);
    }
    OutMsg::header_only(head, REQUEST_OVERHEAD)
}

impl Encoder {
    /// The reply to a completed request; `dont_fragment`: a structured read
    /// goes in one chunk (the client's DF flag).
    pub fn encode(&self, mut req: Request, dont_fragment: bool) -> OutMsg {
        let op = req.op();
        let cost = cost(op, req.len);
        let cookie = req.tag;
        let mut head = Head::new();
        if let Some(e) = &req.error {
            self.errors.failed("nbd", &req);
            if self.structured && matches!(op, Op::Read | Op::BlockStatus { .. }) {
                error_chunk(&mut head, cookie, wire_errno(e), e.message());
            } else {
                simple_reply(&mut head, wire_errno(e), cookie);
            }
            return OutMsg::header_only(head, cost);
        }
        match op {
            Op::Read if self.structured => encode_structured_read(req, cost, dont_fragment),
            Op::Read => {
                simple_reply(&mut head, 0, cookie);
                let (at, data) = (req.offset, req.take_buf());
                let parts = smallvec![Part::Head(0, head.len()), Part::Data(0, data.len())];
                OutMsg { parts, head, data, cost, read_at: Some(at), dropped: false }
            }
            Op::BlockStatus { max } => {
                // REQ_ONE is the only way a request asks for one run.
                let one = max == 1;
                let max = if one { 1 } else { MAX_EXTENTS };
                let range = (req.offset, req.len);
                crate::meta::encode_block_status(&mut head, cookie, &self.contexts, range, req.runs(), max);
                OutMsg::header_only(head, cost)
            }
            _ => {
                simple_reply(&mut head, 0, cookie);
                OutMsg::header_only(head, cost)
            }
        }
    }
}

/// True when every byte is zero; checks 256 bytes at a time so it vectorizes.
fn is_zero(b: &[u8]) -> bool {
    let mut chunks = b.chunks_exact(256);
    chunks.by_ref().all(|c| c.iter().fold(0u8, |a, &x| a | x) == 0) && chunks.remainder().iter().all(|&x| x == 0)
}

/// OFFSET_DATA and OFFSET_HOLE chunks: all-zero granules travel as holes.
fn encode_structured_read(mut req: Request, cost: usize, dont_fragment: bool) -> OutMsg {
    let (cookie, offset, buf) = (req.tag, req.offset, req.take_buf());
    let mut runs: SmallVec<[(bool, usize, usize); 1]> = SmallVec::new();
    if dont_fragment {
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
    let mut head = Head::with_capacity(28 * runs.len());
    let mut parts = SmallVec::with_capacity(2 * runs.len());
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
    OutMsg { head, data: buf, parts, cost, read_at: Some(offset), dropped: false }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdisk_engine::Command;

    #[test]
    fn structured_reads_send_zero_granules_as_holes() {
        let mut buf = Buf::zeroed(3 * HOLE_GRANULE);
        buf[HOLE_GRANULE + 7] = 1;
        let req = Request::new(Command::Read { data: buf.into() }, 4096, 3 * HOLE_GRANULE as u64, 5);
        let m = encode_structured_read(req, 0, false);
        // hole, data, hole: three chunks, two header-only.
        let kinds: Vec<&str> = m.parts.iter().map(|p| if matches!(p, Part::Head(..)) { "h" } else { "d" }).collect();
        assert_eq!(kinds, ["h", "h", "d", "h"]);
        let whole = Request::new(Command::Read { data: Buf::zeroed(4096).into() }, 0, 4096, 5);
        assert_eq!(encode_structured_read(whole, 0, false).parts.len(), 1);
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
