//! A small NBD client over a unix socket, for the soak and the tests: the one
//! client of the protocol outside the server (constants from [`crate::proto`]).
//!
//! It never panics on what the server sends: a reply that breaks the protocol
//! (a bad magic, an unknown cookie, structured chunks that overlap or leave a
//! successful read uncovered) is an `io::Error` of kind `InvalidData`. Callers
//! that must control every byte (tests sending malformed requests) use the raw
//! layer: [`Client::send_raw`], [`Client::encode_request`], [`Client::send_option`].
//! Replies are simple or structured, many requests may be in flight, and
//! reads go straight to the socket (no buffering), so a caller may read the
//! socket itself after any complete reply.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::proto::*;

/// NBD_CMD_FLAG_FUA.
pub use crate::proto::CMD_FLAG_FUA as FUA;

/// The commands the soak sends (their NBD command numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cmd {
    Read = CMD_READ as isize,
    Write = CMD_WRITE as isize,
    Flush = CMD_FLUSH as isize,
    Trim = CMD_TRIM as isize,
    Zero = CMD_WRITE_ZEROES as isize,
}

fn broken(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Fails with `InvalidData` and the message when the condition does not hold.
macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(broken(format!($($msg)+)));
        }
    };
}

/// Reads big-endian fields; a short buffer is an `InvalidData` error.
pub struct Cursor<'a>(pub &'a [u8]);

impl<'a> Cursor<'a> {
    pub fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        check!(self.0.len() >= n, "payload too short: need {n} bytes, have {}", self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    pub fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }

    pub fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }

    pub fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }

    pub fn string(&mut self, n: usize) -> io::Result<String> {
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| broken("string is not UTF-8"))
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One reply to an option during the handshake.
#[derive(Debug)]
pub struct OptReply {
    pub typ: u32,
    pub data: Vec<u8>,
}

/// A request whose reply has not arrived yet; enough to decode that reply.
#[derive(Debug, Clone, Copy)]
pub struct Pending {
    pub typ: u16,
    pub offset: u64,
    pub len: u32,
}

/// One structured reply chunk.
#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub typ: u16,
    pub payload: Vec<u8>,
}

/// A complete reply: one simple reply, or every chunk up to the one flagged DONE.
#[derive(Debug)]
pub struct Reply {
    pub cookie: u64,
    /// NBD error (an errno): the first nonzero one of the reply, or 0.
    pub error: u32,
    /// Whether it came as a simple reply.
    pub simple: bool,
    /// For a successful READ: the data, reassembled from its chunks.
    pub data: Vec<u8>,
    /// For a structured reply: every chunk, in arrival order.
    pub chunks: Vec<Chunk>,
}

/// One connection.
pub struct Client {
    pub sock: UnixStream,
    /// The handshake flags of the server's greeting.
    pub handshake_flags: u16,
    /// The export's size, once NBD_OPT_GO told it.
    pub size: u64,
    /// Structured replies were negotiated.
    pub structured: bool,
    pub next_cookie: u64,
    pub pending: HashMap<u64, Pending>,
    /// Chunks of structured replies not yet DONE.
    pub partial: HashMap<u64, Vec<Chunk>>,
}

impl Client {
    /// Connects to `socket` and reads the server's greeting; sends nothing
    /// yet. Every read and write waits at most `timeout`.
    pub fn greet(socket: &Path, timeout: Duration) -> io::Result<Client> {
        let sock = UnixStream::connect(socket)?;
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        let mut c = Client {
            sock,
            handshake_flags: 0,
            size: 0,
            structured: false,
            next_cookie: 1,
            pending: HashMap::new(),
            partial: HashMap::new(),
        };
        let greeting = c.bytes(18)?;
        let mut cur = Cursor(&greeting);
        check!(cur.u64()? == NBDMAGIC && cur.u64()? == IHAVEOPT, "not an NBD fixed-newstyle server");
        c.handshake_flags = cur.u16()?;
        Ok(c)
    }

    /// Connects and negotiates `export` with NBD_OPT_GO (simple replies):
    /// ready for requests, with [`Client::size`] set.
    pub fn connect(socket: &Path, export: &str, timeout: Duration) -> io::Result<Client> {
        let mut c = Client::greet(socket, timeout)?;
        c.send_raw(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
        match c.go(export, &[])? {
            Ok(infos) => {
                for info in infos {
                    let mut cur = Cursor(&info);
                    if cur.u16()? == INFO_EXPORT {
                        c.size = cur.u64()?;
                    }
                }
                Ok(c)
            }
            Err(t) => Err(broken(format!("export {export:?} refused (option reply {t:#x})"))),
        }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.sock.write_all(bytes)
    }

    /// Exactly `n` bytes from the socket.
    pub fn bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0; n];
        self.sock.read_exact(&mut buf)?;
        Ok(buf)
    }

    // --- options --------------------------------------------------------

    pub fn send_option(&mut self, opt: u32, data: &[u8]) -> io::Result<()> {
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&opt.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(data);
        self.send_raw(&msg)
    }

    /// Reads one option reply and checks that it answers `opt`.
    pub fn recv_option_reply(&mut self, opt: u32) -> io::Result<OptReply> {
        let head = self.bytes(20)?;
        let mut cur = Cursor(&head);
        check!(cur.u64()? == OPT_REPLY_MAGIC, "bad option reply magic");
        let answers = cur.u32()?;
        check!(answers == opt, "option reply names option {answers}, not {opt}");
        let typ = cur.u32()?;
        let len = cur.u32()? as usize;
        let data = self.bytes(len)?;
        Ok(OptReply { typ, data })
    }

    /// Sends an option and collects every reply up to the final ACK or error.
    pub fn option(&mut self, opt: u32, data: &[u8]) -> io::Result<Vec<OptReply>> {
        self.send_option(opt, data)?;
        let mut replies = Vec::new();
        loop {
            let r = self.recv_option_reply(opt)?;
            let last = r.typ == REP_ACK || r.typ & REP_FLAG_ERROR != 0;
            replies.push(r);
            if last {
                return Ok(replies);
            }
        }
    }

    /// NBD_OPT_INFO or NBD_OPT_GO asking for `requests`: the payloads of the
    /// NBD_REP_INFO replies, or the error reply type.
    pub fn info_or_go(&mut self, opt: u32, export: &str, requests: &[u16]) -> io::Result<Result<Vec<Vec<u8>>, u32>> {
        let mut data = Vec::new();
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            data.extend_from_slice(&r.to_be_bytes());
        }
        let mut replies = self.option(opt, &data)?;
        let last = replies.pop().expect("option() returns at least the last reply");
        if last.typ != REP_ACK {
            return Ok(Err(last.typ));
        }
        check!(last.data.is_empty(), "ACK with data");
        let mut infos = Vec::new();
        for r in replies {
            check!(r.typ == REP_INFO, "unexpected reply {:#x} before ACK", r.typ);
            infos.push(r.data);
        }
        Ok(Ok(infos))
    }

    /// NBD_OPT_GO; on success the client is in transmission.
    pub fn go(&mut self, export: &str, requests: &[u16]) -> io::Result<Result<Vec<Vec<u8>>, u32>> {
        self.info_or_go(OPT_GO, export, requests)
    }

    // --- transmission ---------------------------------------------------

    /// Encodes a request header followed by `payload` (which may be shorter
    /// than `len`, to cut a WRITE short) and registers it as awaiting its
    /// reply, without sending it; returns its cookie and its bytes.
    pub fn encode_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> (u64, Vec<u8>) {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut msg = Vec::with_capacity(28 + payload.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&typ.to_be_bytes());
        msg.extend_from_slice(&cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(payload);
        if typ != CMD_DISC {
            self.pending.insert(cookie, Pending { typ, offset, len });
        }
        (cookie, msg)
    }

    /// Sends one request (see [`Client::encode_request`]); returns its cookie.
    pub fn send_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<u64> {
        let (cookie, msg) = self.encode_request(flags, typ, offset, len, payload);
        self.send_raw(&msg)?;
        Ok(cookie)
    }

    /// Sends one of the soak's commands (with `payload` for a WRITE); returns its cookie.
    pub fn send(&mut self, cmd: Cmd, flags: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<u64> {
        self.send_request(flags, cmd as u16, offset, len, payload)
    }

    /// Waits for the next complete reply, whichever request it answers.
    pub fn recv(&mut self) -> io::Result<Reply> {
        loop {
            let magic = u32::from_be_bytes(self.bytes(4)?.try_into().unwrap());
            match magic {
                SIMPLE_REPLY_MAGIC => {
                    let head = self.bytes(12)?;
                    let mut cur = Cursor(&head);
                    let (error, cookie) = (cur.u32()?, cur.u64()?);
                    let req = self.pending.remove(&cookie);
                    let req = req.ok_or_else(|| broken(format!("simple reply for unknown cookie {cookie:#x}")))?;
                    check!(!self.partial.contains_key(&cookie), "simple reply after chunks for cookie {cookie:#x}");
                    let data =
                        if error == 0 && req.typ == CMD_READ { self.bytes(req.len as usize)? } else { Vec::new() };
                    return Ok(Reply { cookie, error, simple: true, data, chunks: Vec::new() });
                }
                STRUCTURED_REPLY_MAGIC => {
                    check!(self.structured, "structured reply chunk without NBD_OPT_STRUCTURED_REPLY");
                    let head = self.bytes(16)?;
                    let mut cur = Cursor(&head);
                    let (flags, typ, cookie, len) = (cur.u16()?, cur.u16()?, cur.u64()?, cur.u32()? as usize);
                    let payload = self.bytes(len)?;
                    check!(self.pending.contains_key(&cookie), "chunk for unknown cookie {cookie:#x}");
                    self.partial.entry(cookie).or_default().push(Chunk { flags, typ, payload });
                    if flags & REPLY_FLAG_DONE != 0 {
                        let req = self.pending.remove(&cookie).expect("checked above");
                        let chunks = self.partial.remove(&cookie).unwrap_or_default();
                        return assemble(cookie, req, chunks);
                    }
                }
                other => return Err(broken(format!("bad reply magic {other:#010x}"))),
            }
        }
    }

    /// Requests sent whose replies have not come yet.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// One of the soak's commands and its reply; an NBD error is an
    /// `io::Error` carrying the errno. Returns a READ's data.
    pub fn call(&mut self, cmd: Cmd, flags: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<Vec<u8>> {
        let cookie = self.send(cmd, flags, offset, len, payload)?;
        let r = self.recv()?;
        check!(r.cookie == cookie, "reply for another request");
        if r.error != 0 {
            return Err(io::Error::from_raw_os_error(r.error as i32));
        }
        Ok(r.data)
    }

    /// Reads `len` bytes at `offset` in requests of at most 4 MiB.
    pub fn read_all(&mut self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(len as usize);
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(4 << 20) as u32;
            out.extend_from_slice(&self.call(Cmd::Read, 0, at, n, &[])?);
            at += n as u64;
        }
        Ok(out)
    }

    /// NBD_CMD_DISC: the polite goodbye (whatever the server does next).
    pub fn disconnect(mut self) {
        let _ = self.send_request(0, CMD_DISC, 0, 0, &[]);
    }
}

/// Builds a [`Reply`] from the chunks of one structured reply, checking them
/// against the request as the spec demands.
pub fn assemble(cookie: u64, req: Pending, chunks: Vec<Chunk>) -> io::Result<Reply> {
    let mut error = 0;
    let read = req.typ == CMD_READ;
    let mut covered = vec![false; if read { req.len as usize } else { 0 }];
    let mut data = vec![0u8; covered.len()];
    let end = req.offset + req.len as u64;
    let mut claim = |off: u64, n: u64, bytes: Option<&[u8]>| -> io::Result<()> {
        check!(read, "content chunk in reply to command {}", req.typ);
        check!(off >= req.offset && off + n <= end, "chunk [{off}, +{n}) outside request [{}, {end})", req.offset);
        let start = (off - req.offset) as usize;
        for (i, c) in covered[start..start + n as usize].iter_mut().enumerate() {
            check!(!*c, "byte {} covered by two chunks", off + i as u64);
            *c = true;
        }
        if let Some(bytes) = bytes {
            data[start..start + bytes.len()].copy_from_slice(bytes);
        }
        Ok(())
    };
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        check!((chunk.flags & REPLY_FLAG_DONE != 0) == last, "DONE must be on the last chunk only");
        check!(chunk.flags & !REPLY_FLAG_DONE == 0, "unknown chunk flags {:#x}", chunk.flags);
        let mut cur = Cursor(&chunk.payload);
        match chunk.typ {
            REPLY_TYPE_NONE => {
                check!(last, "NONE chunk before the last one");
                check!(chunk.payload.is_empty(), "NONE chunk with payload");
            }
            REPLY_TYPE_OFFSET_DATA => {
                check!(chunk.payload.len() > 8, "OFFSET_DATA chunk of length {}", chunk.payload.len());
                let off = cur.u64()?;
                let bytes = cur.rest();
                claim(off, bytes.len() as u64, Some(bytes))?;
            }
            REPLY_TYPE_OFFSET_HOLE => {
                check!(chunk.payload.len() == 12, "OFFSET_HOLE chunk length {}", chunk.payload.len());
                let off = cur.u64()?;
                let n = cur.u32()?;
                check!(n != 0, "empty hole chunk");
                claim(off, n as u64, None)?;
            }
            REPLY_TYPE_BLOCK_STATUS => {
                check!(req.typ == CMD_BLOCK_STATUS, "BLOCK_STATUS chunk for command {}", req.typ);
            }
            REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                let e = cur.u32()?;
                check!(e != 0, "error chunk with error 0");
                let msg_len = cur.u16()? as usize;
                cur.string(msg_len)?;
                if chunk.typ == REPLY_TYPE_ERROR_OFFSET {
                    let off = cur.u64()?;
                    check!(off >= req.offset && off < end.max(req.offset + 1), "ERROR_OFFSET {off} outside request");
                }
                check!(cur.is_empty(), "trailing bytes in error chunk");
                if error == 0 {
                    error = e;
                }
            }
            other => return Err(broken(format!("unknown chunk type {other}"))),
        }
    }
    if error == 0 && read {
        if let Some(hole) = covered.iter().position(|c| !c) {
            return Err(broken(format!("successful READ reply left byte {} uncovered", req.offset + hole as u64)));
        }
    }
    if error != 0 {
        data.clear();
    }
    Ok(Reply { cookie, error, simple: false, data, chunks })
}
