//! NBD wire-protocol tests for `vdisk serve`.
//!
//! A deliberately small raw client (big-endian, per NetworkBlockDevice/nbd
//! `doc/proto.md`) talks to the real binary over its Unix socket, so every
//! byte the server sends or expects is checked, including the error paths that
//! well-behaved clients (qemu, libnbd) never take. The client sits at the top
//! of the file; the tests, grouped as handshake, transmission, errors and
//! robustness, follow it.

mod common;

use common::{create_image, Server, TempDir};
use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Wire constants (doc/proto.md, "Values")
// ---------------------------------------------------------------------------

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake and client flags.
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;
const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_FLAG_ERROR: u32 = 1 << 31;
const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;

// NBD_INFO types.
const INFO_EXPORT: u16 = 0;
const INFO_NAME: u16 = 1;
const INFO_DESCRIPTION: u16 = 2;
const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
const TF_HAS_FLAGS: u16 = 1 << 0;
const TF_READ_ONLY: u16 = 1 << 1;
const TF_SEND_FLUSH: u16 = 1 << 2;
const TF_SEND_FUA: u16 = 1 << 3;
const TF_SEND_TRIM: u16 = 1 << 5;
const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
const TF_SEND_DF: u16 = 1 << 7;
const TF_CAN_MULTI_CONN: u16 = 1 << 8;
const TF_SEND_CACHE: u16 = 1 << 10;
const TF_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands.
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_CACHE: u16 = 5;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
const CMD_FLAG_FUA: u16 = 1 << 0;
const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
const CMD_FLAG_DF: u16 = 1 << 2;
const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply chunks.
const REPLY_FLAG_DONE: u16 = 1 << 0;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

// base:allocation status flags.
const STATE_HOLE: u32 = 1 << 0;
const STATE_ZERO: u32 = 1 << 1;

// Transmission errors.
const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;

const BASE_ALLOCATION: &str = "base:allocation";
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Every test disk is this big unless it says otherwise.
const DISK_SIZE: u64 = 16 * MIB;
/// The largest payload the server advertises (NBD_INFO_BLOCK_SIZE maximum).
const MAX_PAYLOAD: u32 = 32 << 20;
/// No single socket operation in these tests should ever take this long.
const IO_TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// The raw client
// ---------------------------------------------------------------------------

/// Reads big-endian fields out of a reply payload, panicking on short data.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        assert!(self.0.len() >= n, "payload too short: need {n} bytes, have {}", self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().unwrap())
    }

    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().unwrap())
    }

    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take(8).try_into().unwrap())
    }

    fn string(&mut self, n: usize) -> String {
        String::from_utf8(self.take(n).to_vec()).expect("string is not UTF-8")
    }

    fn rest(&mut self) -> &'a [u8] {
        self.take(self.0.len())
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One reply to an option during the handshake.
#[derive(Debug)]
struct OptReply {
    typ: u32,
    data: Vec<u8>,
}

/// What NBD_OPT_INFO / NBD_OPT_GO (or NBD_OPT_EXPORT_NAME) told us about an export.
#[derive(Debug, Default)]
struct ExportInfo {
    size: u64,
    flags: u16,
    name: Option<String>,
    description: Option<String>,
    /// Minimum, preferred and maximum block size.
    block_size: Option<[u32; 3]>,
}

/// A request whose reply has not arrived yet; enough to decode that reply.
#[derive(Debug, Clone, Copy)]
struct Pending {
    typ: u16,
    offset: u64,
    len: u32,
}

/// One structured reply chunk.
#[derive(Debug)]
struct Chunk {
    flags: u16,
    typ: u16,
    payload: Vec<u8>,
}

/// A complete reply: one simple reply, or every chunk up to the one flagged DONE.
#[derive(Debug)]
struct Reply {
    cookie: u64,
    /// The first nonzero error of the reply, or 0.
    error: u32,
    /// Whether it came as a simple reply.
    simple: bool,
    /// For a successful READ: the data, reassembled from its chunks.
    data: Vec<u8>,
    /// For a structured reply: every chunk, in arrival order.
    chunks: Vec<Chunk>,
}

impl Reply {
    fn assert_ok(&self, what: &str) {
        assert_eq!(self.error, 0, "{what} failed with error {}: {self:?}", self.error);
    }

    /// The payload chunks (not NONE, not errors).
    fn content_chunks(&self) -> Vec<&Chunk> {
        self.chunks.iter().filter(|c| c.typ == REPLY_TYPE_OFFSET_DATA || c.typ == REPLY_TYPE_OFFSET_HOLE).collect()
    }

    /// The single BLOCK_STATUS chunk: context id and (length, flags) descriptors.
    fn block_status(&self) -> (u32, Vec<(u32, u32)>) {
        assert!(!self.simple, "BLOCK_STATUS answered with a simple reply");
        let chunks: Vec<&Chunk> = self.chunks.iter().filter(|c| c.typ == REPLY_TYPE_BLOCK_STATUS).collect();
        assert_eq!(chunks.len(), 1, "want exactly one BLOCK_STATUS chunk (one context): {:?}", self.chunks);
        let payload = &chunks[0].payload;
        assert!(
            payload.len() >= 12 && payload.len() % 8 == 4,
            "BLOCK_STATUS chunk length {} is not 4 + 8n (n > 0)",
            payload.len()
        );
        let mut cur = Cursor(payload);
        let id = cur.u32();
        let mut descriptors = Vec::new();
        while !cur.is_empty() {
            let len = cur.u32();
            let flags = cur.u32();
            assert_ne!(len, 0, "zero-length block status descriptor");
            descriptors.push((len, flags));
        }
        (id, descriptors)
    }
}

/// A raw NBD client over a Unix socket.
struct Client {
    sock: UnixStream,
    structured: bool,
    next_cookie: u64,
    pending: HashMap<u64, Pending>,
    partial: HashMap<u64, Vec<Chunk>>,
}

impl Client {
    // --- connection and handshake ---------------------------------------

    /// Connects and reads the server's greeting; sends nothing yet.
    fn connect(path: &Path) -> Client {
        let sock = UnixStream::connect(path).unwrap_or_else(|e| panic!("connect {}: {e}", path.display()));
        sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        sock.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        let mut c = Client {
            sock,
            structured: false,
            // High bits set so a server that truncates cookies is caught.
            next_cookie: 0xc0c0_0000_0000_0001,
            pending: HashMap::new(),
            partial: HashMap::new(),
        };
        let greeting = c.bytes(18).expect("read greeting");
        let mut cur = Cursor(&greeting);
        assert_eq!(cur.u64(), NBDMAGIC, "greeting magic");
        assert_eq!(cur.u64(), IHAVEOPT, "greeting IHAVEOPT");
        assert_eq!(cur.u16(), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, "handshake flags");
        c
    }

    /// Connects and sends client flags FIXED_NEWSTYLE | NO_ZEROES: ready for options.
    fn handshake(path: &Path) -> Client {
        let mut c = Client::connect(path);
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        c
    }

    /// Handshake and NBD_OPT_GO on `export`, simple replies.
    fn open(path: &Path, export: &str) -> (Client, ExportInfo) {
        let mut c = Client::handshake(path);
        let info = c.go(export, &[]).unwrap_or_else(|e| panic!("GO {export:?} failed: {e:#x}"));
        (c, info)
    }

    /// Handshake with structured replies and base:allocation, then NBD_OPT_GO.
    /// Returns the client, the export and the base:allocation context id.
    fn open_structured(path: &Path, export: &str) -> (Client, ExportInfo, u32) {
        let mut c = Client::handshake(path);
        c.structured_reply();
        let id = c.set_base_allocation(export);
        let info = c.go(export, &[]).unwrap_or_else(|e| panic!("GO {export:?} failed: {e:#x}"));
        (c, info, id)
    }

    fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("send to server");
    }

    fn bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0; n];
        self.sock.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn send_client_flags(&mut self, flags: u32) {
        self.send(&flags.to_be_bytes());
    }

    fn send_option(&mut self, opt: u32, data: &[u8]) {
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&opt.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(data);
        self.send(&msg);
    }

    /// Reads one option reply and checks that it answers `opt`.
    fn recv_option_reply(&mut self, opt: u32) -> OptReply {
        let head = self.bytes(20).unwrap_or_else(|e| panic!("reading reply to option {opt}: {e}"));
        let mut cur = Cursor(&head);
        assert_eq!(cur.u64(), OPT_REPLY_MAGIC, "option reply magic");
        assert_eq!(cur.u32(), opt, "option reply names the wrong option");
        let typ = cur.u32();
        let len = cur.u32() as usize;
        let data = self.bytes(len).expect("read option reply data");
        OptReply { typ, data }
    }

    /// Sends an option and collects every reply up to the final ACK or error.
    fn option(&mut self, opt: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(opt, data);
        let mut replies = Vec::new();
        loop {
            let r = self.recv_option_reply(opt);
            let last = r.typ == REP_ACK || r.typ & REP_FLAG_ERROR != 0;
            replies.push(r);
            if last {
                return replies;
            }
        }
    }

    /// NBD_OPT_INFO or NBD_OPT_GO; `Err` carries the error reply type.
    fn info_or_go(&mut self, opt: u32, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        let mut data = Vec::new();
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            data.extend_from_slice(&r.to_be_bytes());
        }
        let replies = self.option(opt, &data);
        let (last, infos) = replies.split_last().unwrap();
        if last.typ != REP_ACK {
            return Err(last.typ);
        }
        assert!(last.data.is_empty(), "ACK with data");
        let mut info = ExportInfo::default();
        let mut saw_export = false;
        for r in infos {
            assert_eq!(r.typ, REP_INFO, "unexpected reply {:#x} before ACK", r.typ);
            let mut cur = Cursor(&r.data);
            match cur.u16() {
                INFO_EXPORT => {
                    assert_eq!(r.data.len(), 12, "NBD_INFO_EXPORT length");
                    info.size = cur.u64();
                    info.flags = cur.u16();
                    saw_export = true;
                }
                INFO_NAME => info.name = Some(cur.string(r.data.len() - 2)),
                INFO_DESCRIPTION => info.description = Some(cur.string(r.data.len() - 2)),
                INFO_BLOCK_SIZE => {
                    assert_eq!(r.data.len(), 14, "NBD_INFO_BLOCK_SIZE length");
                    info.block_size = Some([cur.u32(), cur.u32(), cur.u32()]);
                }
                _ => {} // Unknown information: clients must ignore it.
            }
        }
        assert!(saw_export, "success without NBD_INFO_EXPORT");
        Ok(info)
    }

    fn info(&mut self, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        self.info_or_go(OPT_INFO, export, requests)
    }

    /// NBD_OPT_GO; on success the client is in transmission.
    fn go(&mut self, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        self.info_or_go(OPT_GO, export, requests)
    }

    fn structured_reply(&mut self) {
        let replies = self.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(replies.len(), 1, "STRUCTURED_REPLY: {replies:?}");
        assert_eq!(replies[0].typ, REP_ACK, "STRUCTURED_REPLY not acknowledged");
        self.structured = true;
    }

    /// NBD_OPT_LIST_META_CONTEXT or NBD_OPT_SET_META_CONTEXT: the (id, name)
    /// pairs, or the error reply type.
    fn meta_context(&mut self, opt: u32, export: &str, queries: &[&str]) -> Result<Vec<(u32, String)>, u32> {
        let mut data = Vec::new();
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            data.extend_from_slice(&(q.len() as u32).to_be_bytes());
            data.extend_from_slice(q.as_bytes());
        }
        let replies = self.option(opt, &data);
        let (last, contexts) = replies.split_last().unwrap();
        if last.typ != REP_ACK {
            return Err(last.typ);
        }
        Ok(contexts
            .iter()
            .map(|r| {
                assert_eq!(r.typ, REP_META_CONTEXT, "unexpected reply {:#x} before ACK", r.typ);
                let mut cur = Cursor(&r.data);
                let id = cur.u32();
                (id, cur.string(r.data.len() - 4))
            })
            .collect())
    }

    /// Selects base:allocation on `export` and returns its context id.
    fn set_base_allocation(&mut self, export: &str) -> u32 {
        let contexts = self
            .meta_context(OPT_SET_META_CONTEXT, export, &[BASE_ALLOCATION])
            .unwrap_or_else(|e| panic!("SET_META_CONTEXT failed: {e:#x}"));
        assert_eq!(contexts.len(), 1, "SET_META_CONTEXT replies: {contexts:?}");
        assert_eq!(contexts[0].1, BASE_ALLOCATION);
        contexts[0].0
    }

    // --- transmission -----------------------------------------------------

    /// Encodes a request header followed by `payload` (which may be shorter
    /// than `len`, to cut a WRITE short) and registers it as awaiting its
    /// reply, without sending it; returns its cookie and its bytes.
    fn encode_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> (u64, Vec<u8>) {
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
    fn send_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> u64 {
        let (cookie, msg) = self.encode_request(flags, typ, offset, len, payload);
        self.send(&msg);
        cookie
    }

    /// Reads replies until one request is complete; `Err` if the stream ends.
    /// Protocol violations panic.
    fn try_recv(&mut self) -> io::Result<Reply> {
        loop {
            let magic = u32::from_be_bytes(self.bytes(4)?.try_into().unwrap());
            match magic {
                SIMPLE_REPLY_MAGIC => {
                    let head = self.bytes(12)?;
                    let mut cur = Cursor(&head);
                    let error = cur.u32();
                    let cookie = cur.u64();
                    let req = self
                        .pending
                        .remove(&cookie)
                        .unwrap_or_else(|| panic!("simple reply for unknown cookie {cookie:#x}"));
                    assert!(!self.partial.contains_key(&cookie), "simple reply after chunks for cookie {cookie:#x}");
                    let data =
                        if error == 0 && req.typ == CMD_READ { self.bytes(req.len as usize)? } else { Vec::new() };
                    return Ok(Reply { cookie, error, simple: true, data, chunks: Vec::new() });
                }
                STRUCTURED_REPLY_MAGIC => {
                    assert!(self.structured, "structured reply chunk without NBD_OPT_STRUCTURED_REPLY");
                    let head = self.bytes(16)?;
                    let mut cur = Cursor(&head);
                    let flags = cur.u16();
                    let typ = cur.u16();
                    let cookie = cur.u64();
                    let len = cur.u32() as usize;
                    let payload = self.bytes(len)?;
                    assert!(self.pending.contains_key(&cookie), "chunk for unknown cookie {cookie:#x}");
                    self.partial.entry(cookie).or_default().push(Chunk { flags, typ, payload });
                    if flags & REPLY_FLAG_DONE != 0 {
                        let req = self.pending.remove(&cookie).unwrap();
                        let chunks = self.partial.remove(&cookie).unwrap();
                        return Ok(assemble(cookie, req, chunks));
                    }
                }
                other => panic!("bad reply magic {other:#010x}"),
            }
        }
    }

    fn recv(&mut self) -> Reply {
        self.try_recv().expect("server closed the connection or timed out instead of replying")
    }

    /// Sends one request and waits for its reply.
    fn call(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> Reply {
        let cookie = self.send_request(flags, typ, offset, len, payload);
        let reply = self.recv();
        assert_eq!(reply.cookie, cookie, "reply cookie");
        reply
    }

    fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let r = self.call(0, CMD_READ, offset, len, &[]);
        r.assert_ok("READ");
        assert_eq!(r.data.len(), len as usize);
        r.data
    }

    fn write(&mut self, offset: u64, data: &[u8], flags: u16) {
        self.call(flags, CMD_WRITE, offset, data.len() as u32, data).assert_ok("WRITE");
    }

    /// A valid READ still works: the stream is in sync after whatever came before.
    fn assert_alive(&mut self) {
        let r = self.call(0, CMD_READ, 0, 4096, &[]);
        r.assert_ok("READ after the error (is the stream out of sync?)");
        assert_eq!(r.data.len(), 4096);
    }

    /// NBD_OPT_ABORT during negotiation: ACK, then the server closes.
    fn disconnect_in_negotiation(mut self) {
        self.send_option(OPT_ABORT, &[]);
        assert_eq!(self.recv_option_reply(OPT_ABORT).typ, REP_ACK, "ABORT reply");
        let stray = self.expect_closed("after NBD_OPT_ABORT");
        assert!(stray.is_empty(), "server sent {stray:02x?} after the ACK to ABORT");
    }

    /// NBD_CMD_DISC, then the server must close without sending anything.
    fn disconnect(mut self) {
        self.send_request(0, CMD_DISC, 0, 0, &[]);
        let stray = self.expect_closed("after NBD_CMD_DISC");
        assert!(stray.is_empty(), "server sent {} bytes after NBD_CMD_DISC", stray.len());
    }

    /// Waits for the server to close the connection; returns whatever it sent first.
    fn expect_closed(mut self, what: &str) -> Vec<u8> {
        let mut stray = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        loop {
            match self.sock.read(&mut buf) {
                Ok(0) => return stray,
                Ok(n) => stray.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return stray,
                Err(e) => panic!("{what}: expected the server to close the connection, got: {e}"),
            }
        }
    }
}

/// Builds a [`Reply`] from the chunks of one structured reply, checking them
/// against the request as the spec demands.
fn assemble(cookie: u64, req: Pending, chunks: Vec<Chunk>) -> Reply {
    let mut error = 0;
    let mut covered = vec![false; if req.typ == CMD_READ { req.len as usize } else { 0 }];
    let mut data = vec![0u8; covered.len()];
    let end = req.offset + req.len as u64;
    let mut claim = |off: u64, n: u64, bytes: Option<&[u8]>| {
        assert!(req.typ == CMD_READ, "content chunk in reply to command {}", req.typ);
        assert!(off >= req.offset && off + n <= end, "chunk [{off}, +{n}) outside request [{}, {end})", req.offset);
        let start = (off - req.offset) as usize;
        for (i, c) in covered[start..start + n as usize].iter_mut().enumerate() {
            assert!(!*c, "byte {} covered by two chunks", off + i as u64);
            *c = true;
        }
        if let Some(bytes) = bytes {
            data[start..start + bytes.len()].copy_from_slice(bytes);
        }
    };
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        assert_eq!(chunk.flags & REPLY_FLAG_DONE != 0, last, "DONE must be on the last chunk only");
        assert_eq!(chunk.flags & !REPLY_FLAG_DONE, 0, "unknown chunk flags {:#x}", chunk.flags);
        let mut cur = Cursor(&chunk.payload);
        match chunk.typ {
            REPLY_TYPE_NONE => {
                assert!(last, "NONE chunk before the last one");
                assert!(chunk.payload.is_empty(), "NONE chunk with payload");
            }
            REPLY_TYPE_OFFSET_DATA => {
                assert!(chunk.payload.len() > 8, "OFFSET_DATA chunk of length {}", chunk.payload.len());
                let off = cur.u64();
                let bytes = cur.rest();
                claim(off, bytes.len() as u64, Some(bytes));
            }
            REPLY_TYPE_OFFSET_HOLE => {
                assert_eq!(chunk.payload.len(), 12, "OFFSET_HOLE chunk length");
                let off = cur.u64();
                let n = cur.u32();
                assert_ne!(n, 0, "empty hole chunk");
                claim(off, n as u64, None);
            }
            REPLY_TYPE_BLOCK_STATUS => {
                assert_eq!(req.typ, CMD_BLOCK_STATUS, "BLOCK_STATUS chunk for command {}", req.typ)
            }
            REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                let e = cur.u32();
                assert_ne!(e, 0, "error chunk with error 0");
                let msg_len = cur.u16() as usize;
                let _msg = cur.string(msg_len);
                if chunk.typ == REPLY_TYPE_ERROR_OFFSET {
                    let off = cur.u64();
                    assert!(off >= req.offset && off < end.max(req.offset + 1), "ERROR_OFFSET {off} outside request");
                }
                assert!(cur.is_empty(), "trailing bytes in error chunk");
                if error == 0 {
                    error = e;
                }
            }
            other => panic!("unknown chunk type {other}"),
        }
    }
    if error == 0 && req.typ == CMD_READ {
        if let Some(hole) = covered.iter().position(|c| !c) {
            panic!("successful READ reply left byte {} uncovered", req.offset + hole as u64);
        }
    }
    if error != 0 {
        data.clear();
    }
    Reply { cookie, error, simple: false, data, chunks }
}

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

/// A running server over images in a temporary directory.
struct Fixture {
    // Field order matters: the server stops before its directory goes.
    server: Server,
    _dir: TempDir,
}

impl Fixture {
    /// Serves one fresh sparse 16 MiB image, exported as "disk".
    fn new(tag: &str, extra: &[&str]) -> Fixture {
        Fixture::with_images(tag, &[("disk", "16M")], extra)
    }

    /// Serves fresh sparse images `(stem, size)`, in this order.
    fn with_images(tag: &str, images: &[(&str, &str)], extra: &[&str]) -> Fixture {
        let dir = TempDir::new(tag);
        let paths: Vec<PathBuf> = images
            .iter()
            .map(|(stem, size)| {
                let p = dir.path(&format!("{stem}.img"));
                create_image(&p, size);
                p
            })
            .collect();
        let mut args: Vec<&str> = paths.iter().map(|p| p.to_str().unwrap()).collect();
        args.extend_from_slice(extra);
        let server = Server::start(&dir, &args);
        Fixture { server, _dir: dir }
    }

    fn sock(&self) -> &Path {
        &self.server.socket
    }

    /// Stops the server and checks it exits cleanly.
    fn stop(self) {
        self.server.stop();
    }
}

/// A recognisable, offset-dependent byte pattern.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (seed.wrapping_mul(31).wrapping_add(i * 7 + i / 251) % 251) as u8 + 1).collect()
}

fn is_zero(data: &[u8]) -> bool {
    data.iter().all(|&b| b == 0)
}

// ---------------------------------------------------------------------------
// Handshake and options
// ---------------------------------------------------------------------------

#[test]
fn list_returns_every_export_then_ack() {
    let fx = Fixture::with_images("list", &[("alpha", "1M"), ("beta", "2M")], &[]);
    let mut c = Client::handshake(fx.sock());
    let replies = c.option(OPT_LIST, &[]);
    let (last, servers) = replies.split_last().unwrap();
    assert_eq!(last.typ, REP_ACK, "LIST must end with ACK: {replies:?}");
    let mut names: Vec<String> = servers
        .iter()
        .map(|r| {
            assert_eq!(r.typ, REP_SERVER, "LIST reply type");
            let mut cur = Cursor(&r.data);
            let n = cur.u32() as usize;
            assert!(n + 4 <= r.data.len(), "REP_SERVER name length {n} beyond reply");
            cur.string(n)
        })
        .collect();
    names.sort();
    assert_eq!(names, ["alpha", "beta"]);
    // Negotiation goes on.
    let info = c.go("beta", &[]).expect("GO after LIST");
    assert_eq!(info.size, 2 * MIB);
    c.disconnect();
    fx.stop();
}

#[test]
fn list_with_data_is_invalid() {
    let fx = Fixture::new("list-data", &[]);
    let mut c = Client::handshake(fx.sock());
    let replies = c.option(OPT_LIST, &[0, 0, 0, 4]);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].typ, REP_ERR_INVALID);
    c.go("disk", &[]).expect("GO after a rejected LIST");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn info_reports_export_and_requested_information() {
    let fx = Fixture::new("info", &[]);
    let mut c = Client::handshake(fx.sock());

    // NBD_INFO_EXPORT comes even when nothing is requested.
    let plain = c.info("disk", &[]).expect("INFO");
    assert_eq!(plain.size, DISK_SIZE);
    assert_ne!(plain.flags & TF_HAS_FLAGS, 0);

    // An information type the server does not know (99) is ignored.
    let info = c.info("disk", &[99, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]).expect("INFO with requests");
    assert_eq!(info.size, DISK_SIZE);
    assert_eq!(info.flags, plain.flags, "same export, same flags");
    assert_eq!(info.name.as_deref(), Some("disk"), "NBD_INFO_NAME");
    assert!(info.description.is_some(), "NBD_INFO_DESCRIPTION was requested but not sent");
    assert_eq!(info.block_size, Some([1, 4096, MAX_PAYLOAD]), "NBD_INFO_BLOCK_SIZE");

    // INFO does not leave negotiation: GO still works and gives the same answer.
    let go = c.go("disk", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]).expect("GO after INFO");
    assert_eq!((go.size, go.flags), (info.size, info.flags));
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn go_reports_requested_information_and_enters_transmission() {
    let fx = Fixture::new("go", &[]);
    let mut c = Client::handshake(fx.sock());
    let info = c.go("disk", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]).expect("GO");
    assert_eq!(info.size, DISK_SIZE);
    assert_eq!(info.name.as_deref(), Some("disk"));
    assert!(info.description.is_some(), "NBD_INFO_DESCRIPTION was requested but not sent");
    assert_eq!(info.block_size, Some([1, 4096, MAX_PAYLOAD]));
    let data = pattern(1, 4096);
    c.write(8192, &data, 0);
    assert_eq!(c.read(8192, 4096), data);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_export_is_err_unknown() {
    let fx = Fixture::new("unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    assert_eq!(c.info("nosuch", &[]).unwrap_err(), REP_ERR_UNKNOWN, "INFO of an unknown export");
    assert_eq!(c.go("nosuch", &[INFO_NAME]).unwrap_err(), REP_ERR_UNKNOWN, "GO to an unknown export");
    c.go("disk", &[]).expect("GO after a failed GO");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn empty_name_selects_the_first_image() {
    let fx = Fixture::with_images("default", &[("first", "1M"), ("second", "2M")], &[]);
    let mut c = Client::handshake(fx.sock());
    let info = c.info("", &[INFO_NAME]).expect("INFO of the default export");
    assert_eq!(info.size, MIB, "default export is the first image");
    assert_eq!(info.name.as_deref(), Some("first"), "canonical name of the default export");

    let info = c.go("", &[]).expect("GO to the default export");
    assert_eq!(info.size, MIB);
    let data = pattern(2, 512);
    c.write(MIB - 512, &data, 0);
    c.disconnect();

    // The same bytes are visible through the explicit name.
    let (mut named, _) = Client::open(fx.sock(), "first");
    assert_eq!(named.read(MIB - 512, 512), data);
    named.disconnect();
    fx.stop();
}

#[test]
fn transmission_flags_of_a_writable_export() {
    let fx = Fixture::new("flags", &[]);
    let want = TF_HAS_FLAGS
        | TF_SEND_FLUSH
        | TF_SEND_FUA
        | TF_SEND_TRIM
        | TF_SEND_WRITE_ZEROES
        | TF_SEND_FAST_ZERO
        | TF_SEND_CACHE
        | TF_CAN_MULTI_CONN;
    let mut c = Client::handshake(fx.sock());
    let before = c.info("disk", &[]).expect("INFO").flags;
    assert_eq!(before & want, want, "flags {before:#06x} lack {:#06x}", want & !before);
    assert_eq!(before & TF_READ_ONLY, 0, "READ_ONLY on a writable export");
    assert_eq!(before & TF_SEND_DF, 0, "SEND_DF must be clear without structured replies");

    c.structured_reply();
    let after = c.go("disk", &[]).expect("GO").flags;
    assert_eq!(after & want, want, "flags {after:#06x} lack {:#06x}", want & !after);
    assert_ne!(after & TF_SEND_DF, 0, "SEND_DF once structured replies are negotiated");
    c.disconnect();
    fx.stop();
}

#[test]
fn transmission_flags_of_a_readonly_export() {
    let fx = Fixture::new("flags-ro", &["--readonly"]);
    let (c, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_HAS_FLAGS, 0, "HAS_FLAGS");
    assert_ne!(info.flags & TF_READ_ONLY, 0, "READ_ONLY with --readonly: {:#06x}", info.flags);
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_reply_is_acknowledged() {
    let fx = Fixture::new("structured", &[]);
    let mut c = Client::handshake(fx.sock());
    // The option takes no data.
    let replies = c.option(OPT_STRUCTURED_REPLY, &[0; 4]);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].typ, REP_ERR_INVALID, "STRUCTURED_REPLY with data");
    c.structured_reply();
    c.go("disk", &[]).expect("GO");
    // A READ now comes as chunks.
    let r = c.call(0, CMD_READ, 0, 4096, &[]);
    r.assert_ok("structured READ");
    assert!(!r.simple, "READ answered with a simple reply after STRUCTURED_REPLY");
    c.disconnect();
    fx.stop();
}

#[test]
fn set_meta_context_before_structured_reply_is_invalid() {
    let fx = Fixture::new("meta-early", &[]);
    let mut c = Client::handshake(fx.sock());
    let r = c.meta_context(OPT_SET_META_CONTEXT, "disk", &[BASE_ALLOCATION]);
    assert_eq!(r.unwrap_err(), REP_ERR_INVALID);
    c.go("disk", &[]).expect("GO after the rejected option");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn set_meta_context_selects_base_allocation() {
    let fx = Fixture::new("meta-set", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_SET_META_CONTEXT, "disk", &[BASE_ALLOCATION]).expect("SET_META_CONTEXT");
    assert_eq!(contexts.len(), 1, "{contexts:?}");
    assert_eq!(contexts[0].1, BASE_ALLOCATION);
    let id = contexts[0].0;
    c.go("disk", &[]).expect("GO");
    let (got, _) = c.call(0, CMD_BLOCK_STATUS, 0, 4096, &[]).block_status();
    assert_eq!(got, id, "BLOCK_STATUS context id");
    c.disconnect();
    fx.stop();
}

#[test]
fn list_meta_context_with_base_query_lists_base_allocation() {
    let fx = Fixture::new("meta-list", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_LIST_META_CONTEXT, "disk", &["base:"]).expect("LIST_META_CONTEXT");
    assert!(contexts.iter().any(|(_, n)| n == BASE_ALLOCATION), "base: query listed {contexts:?}");
    assert!(contexts.iter().all(|(_, n)| n.starts_with("base:")), "base: query listed {contexts:?}");
    c.go("disk", &[]).expect("GO after LIST_META_CONTEXT");
    c.disconnect();
    fx.stop();
}

#[test]
fn list_meta_context_without_queries_lists_base_allocation() {
    let fx = Fixture::new("meta-list-all", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_LIST_META_CONTEXT, "disk", &[]).expect("LIST_META_CONTEXT");
    assert!(contexts.iter().any(|(_, n)| n == BASE_ALLOCATION), "listed {contexts:?}");
    c.disconnect_in_negotiation();
    fx.stop();
}

#[test]
fn set_meta_context_ignores_unknown_contexts() {
    let fx = Fixture::new("meta-unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    // Unknown namespaces must be ignored: nothing selected, still ACK.
    let contexts = c.meta_context(OPT_SET_META_CONTEXT, "disk", &["x-nosuch:thing"]).expect("SET_META_CONTEXT");
    assert!(contexts.is_empty(), "selected {contexts:?}");
    // A query whose length runs past the option data is invalid.
    let mut bad = 4u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"disk");
    bad.extend_from_slice(&1u32.to_be_bytes());
    bad.extend_from_slice(&100u32.to_be_bytes());
    bad.extend_from_slice(b"base:");
    let replies = c.option(OPT_SET_META_CONTEXT, &bad);
    assert_eq!(replies.last().unwrap().typ, REP_ERR_INVALID, "{replies:?}");
    // Nothing is selected, so BLOCK_STATUS is refused.
    c.go("disk", &[]).expect("GO");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_option_is_unsupported_and_negotiation_continues() {
    let fx = Fixture::new("unknown-opt", &[]);
    let mut c = Client::handshake(fx.sock());
    // 99 is unassigned; 11 (EXTENDED_HEADERS) is what newer libnbd asks for.
    for (opt, data) in [(99, &b"some option data"[..]), (11, &[][..])] {
        let replies = c.option(opt, data);
        assert_eq!(replies.len(), 1, "option {opt}: {replies:?}");
        assert_eq!(replies[0].typ, REP_ERR_UNSUP, "option {opt}");
    }
    c.go("disk", &[]).expect("GO after an unknown option");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_without_zeroes() {
    let fx = Fixture::new("export-name", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = c.bytes(10).expect("EXPORT_NAME reply");
    let mut cur = Cursor(&reply);
    assert_eq!(cur.u64(), DISK_SIZE);
    assert_ne!(cur.u16() & TF_HAS_FLAGS, 0);
    // No 124 zero bytes: if they came, this reply would start with them and
    // fail on its magic.
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_with_zeroes() {
    let fx = Fixture::new("export-name-zeroes", &[]);
    let mut c = Client::connect(fx.sock());
    c.send_client_flags(FLAG_C_FIXED_NEWSTYLE);
    c.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = c.bytes(10 + 124).expect("EXPORT_NAME reply with zeroes");
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), DISK_SIZE);
    assert!(is_zero(&reply[10..]), "the 124 reserved bytes are not zero");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_with_unknown_name_closes() {
    let fx = Fixture::new("export-name-unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_EXPORT_NAME, b"nosuch");
    let stray = c.expect_closed("EXPORT_NAME of an unknown export");
    assert!(stray.is_empty(), "server sent {stray:02x?} before closing");
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn abort_is_acknowledged_and_closes() {
    let fx = Fixture::new("abort", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_ABORT, &[]);
    let r = c.recv_option_reply(OPT_ABORT);
    assert_eq!(r.typ, REP_ACK, "ABORT reply");
    assert!(r.data.is_empty());
    let stray = c.expect_closed("after OPT_ABORT");
    assert!(stray.is_empty(), "server sent {stray:02x?} after the ACK to ABORT");
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn bad_client_flags_close_only_that_connection() {
    let fx = Fixture::new("bad-flags", &[]);
    for flags in [1 << 31, FLAG_C_FIXED_NEWSTYLE | 1 << 2] {
        let mut c = Client::connect(fx.sock());
        c.send_client_flags(flags);
        let stray = c.expect_closed(&format!("client flags {flags:#x}"));
        assert!(stray.is_empty(), "server sent {stray:02x?} after bad client flags {flags:#x}");
    }
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn bad_option_magic_closes_only_that_connection() {
    let fx = Fixture::new("bad-opt-magic", &[]);
    let mut c = Client::handshake(fx.sock());
    let mut msg = 0x0123_4567_89ab_cdef_u64.to_be_bytes().to_vec();
    msg.extend_from_slice(&OPT_LIST.to_be_bytes());
    msg.extend_from_slice(&0u32.to_be_bytes());
    c.send(&msg);
    c.expect_closed("bad option magic");
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn client_closing_mid_handshake_leaves_server_working() {
    let fx = Fixture::new("mid-handshake", &[]);
    // Before the greeting is read.
    drop(UnixStream::connect(fx.sock()).unwrap());
    // After the greeting, before the client flags.
    drop(Client::connect(fx.sock()));
    // Half the client flags.
    Client::connect(fx.sock()).send(&[0, 0]);
    // Half an option header.
    Client::handshake(fx.sock()).send(&IHAVEOPT.to_be_bytes()[..6]);
    // An option header promising more data than is sent.
    let mut c = Client::handshake(fx.sock());
    let mut msg = IHAVEOPT.to_be_bytes().to_vec();
    msg.extend_from_slice(&OPT_GO.to_be_bytes());
    msg.extend_from_slice(&100u32.to_be_bytes());
    msg.extend_from_slice(&[0, 0, 0, 4, b'd']);
    c.send(&msg);
    drop(c);
    // An option sent, its reply never read.
    Client::handshake(fx.sock()).send_option(OPT_LIST, &[]);

    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Transmission
// ---------------------------------------------------------------------------

#[test]
fn read_write_round_trip() {
    let fx = Fixture::new("rw", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // Unaligned on purpose: the minimum block size is 1.
    let data = pattern(3, 10_000);
    c.write(12_345, &data, 0);
    assert_eq!(c.read(12_345, 10_000), data);
    let around = c.read(12_000, 11_000);
    assert!(is_zero(&around[..345]), "bytes before the write changed");
    assert_eq!(&around[345..10_345], &data[..]);
    assert!(is_zero(&around[10_345..]), "bytes after the write changed");
    // The last byte of the disk.
    c.write(DISK_SIZE - 1, &[0xab], 0);
    assert_eq!(c.read(DISK_SIZE - 1, 1), [0xab]);
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_write_round_trip() {
    let fx = Fixture::new("rw-structured", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let data = pattern(4, 300 * KIB as usize);
    c.write(MIB + 7, &data, 0);
    assert_eq!(c.read(MIB + 7, data.len() as u32), data);
    // Data and hole in one read.
    let mixed = c.read(MIB - 4096, 4096 + 7 + data.len() as u32 + 4096);
    assert!(is_zero(&mixed[..4096 + 7]));
    assert_eq!(&mixed[4096 + 7..4096 + 7 + data.len()], &data[..]);
    assert!(is_zero(&mixed[4096 + 7 + data.len()..]));
    c.disconnect();
    fx.stop();
}

#[test]
fn write_with_fua_and_flush() {
    let fx = Fixture::new("fua", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(5, 64 * KIB as usize);
    c.write(2 * MIB, &data, CMD_FLAG_FUA);
    c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    c.write(3 * MIB, &data, 0);
    c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    assert_eq!(c.read(2 * MIB, data.len() as u32), data);
    assert_eq!(c.read(3 * MIB, data.len() as u32), data);
    c.disconnect();
    fx.stop();
}

#[test]
fn trim_then_read_is_zeros() {
    let fx = Fixture::new("trim", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(6, 256 * KIB as usize);
    c.write(MIB, &data, 0);
    c.call(0, CMD_TRIM, MIB, 128 * KIB as u32, &[]).assert_ok("TRIM");
    c.call(CMD_FLAG_FUA, CMD_TRIM, MIB + 128 * KIB, 64 * KIB as u32, &[]).assert_ok("TRIM with FUA");
    let back = c.read(MIB, data.len() as u32);
    assert!(is_zero(&back[..192 * KIB as usize]), "trimmed range does not read as zeros");
    assert_eq!(&back[192 * KIB as usize..], &data[192 * KIB as usize..], "data after the trim changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn write_zeroes_reads_back_zeros() {
    let fx = Fixture::new("write-zeroes", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let len = 64 * KIB as u32;
    for (i, flags) in [0, CMD_FLAG_NO_HOLE, CMD_FLAG_FAST_ZERO, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE].into_iter().enumerate()
    {
        let off = (i as u64 + 1) * MIB + 100;
        let data = pattern(7 + i as u64, len as usize + 200);
        c.write(off - 100, &data, 0);
        c.call(flags, CMD_WRITE_ZEROES, off, len, &[]).assert_ok(&format!("WRITE_ZEROES flags {flags:#x}"));
        let back = c.read(off - 100, len + 200);
        assert_eq!(&back[..100], &data[..100], "flags {flags:#x}: bytes before changed");
        assert!(is_zero(&back[100..100 + len as usize]), "flags {flags:#x}: not zeros");
        assert_eq!(&back[100 + len as usize..], &data[100 + len as usize..], "flags {flags:#x}: bytes after changed");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn cache_succeeds() {
    let fx = Fixture::new("cache", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.write(0, &pattern(8, 4096), 0);
    c.call(0, CMD_CACHE, 0, MIB as u32, &[]).assert_ok("CACHE");
    assert_eq!(c.read(0, 4096), pattern(8, 4096));
    c.disconnect();
    fx.stop();
}

/// Checks that `descriptors` answer a request of `len` bytes without
/// REQ_ONE (the first N-1 end inside it, the last reaches its end) and
/// returns the status of each byte of the request.
fn status_map(descriptors: &[(u32, u32)], len: u64) -> Vec<u32> {
    let mut map = Vec::with_capacity(len as usize);
    for (i, &(n, flags)) in descriptors.iter().enumerate() {
        assert!((map.len() as u64) < len, "descriptor {i} starts beyond the request: {descriptors:?}");
        assert_eq!(flags & !(STATE_HOLE | STATE_ZERO), 0, "unknown base:allocation flags {flags:#x}");
        let take = (n as u64).min(len - map.len() as u64);
        map.resize(map.len() + take as usize, flags);
    }
    assert_eq!(map.len() as u64, len, "descriptors cover only {} of {len} bytes: {descriptors:?}", map.len());
    map
}

#[test]
fn block_status_reports_holes_and_data() {
    let fx = Fixture::new("block-status", &[]);
    let (mut c, info, id) = Client::open_structured(fx.sock(), "disk");

    // A fresh sparse image is one hole that reads as zeros.
    let r = c.call(0, CMD_BLOCK_STATUS, 0, info.size as u32, &[]);
    r.assert_ok("BLOCK_STATUS");
    let (got, desc) = r.block_status();
    assert_eq!(got, id, "context id");
    let map = status_map(&desc, info.size);
    assert!(map.iter().all(|&f| f == STATE_HOLE | STATE_ZERO), "fresh image not all HOLE|ZERO: {desc:?}");

    // Written data is reported as data.
    let data = pattern(9, 64 * KIB as usize);
    c.write(4 * MIB, &data, 0);
    let r = c.call(0, CMD_BLOCK_STATUS, 0, 8 * MIB as u32, &[]);
    r.assert_ok("BLOCK_STATUS");
    let (got, desc) = r.block_status();
    assert_eq!(got, id);
    let map = status_map(&desc, 8 * MIB);
    let written = 4 * MIB as usize..(4 * MIB + 64 * KIB) as usize;
    assert!(map[written].iter().all(|&f| f == 0), "written range not reported as data (0): {desc:?}");
    assert!(map[..MIB as usize].iter().all(|&f| f == STATE_HOLE | STATE_ZERO), "untouched range not a hole: {desc:?}");

    // A request starting inside the data.
    let r = c.call(0, CMD_BLOCK_STATUS, 4 * MIB + 4096, 8192, &[]);
    let (_, desc) = r.block_status();
    assert!(status_map(&desc, 8192).iter().all(|&f| f == 0), "{desc:?}");
    c.disconnect();
    fx.stop();
}

#[test]
fn block_status_with_req_one_returns_one_descriptor() {
    let fx = Fixture::new("block-status-one", &[]);
    let (mut c, _, id) = Client::open_structured(fx.sock(), "disk");
    c.write(MIB, &pattern(10, 64 * KIB as usize), 0);
    for (offset, len, want) in
        [(0, 4 * MIB, STATE_HOLE | STATE_ZERO), (MIB, 4 * MIB, 0), (0, 4096, STATE_HOLE | STATE_ZERO)]
    {
        let r = c.call(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, offset, len as u32, &[]);
        r.assert_ok("BLOCK_STATUS with REQ_ONE");
        let (got, desc) = r.block_status();
        assert_eq!(got, id);
        assert_eq!(desc.len(), 1, "REQ_ONE at {offset}: {desc:?}");
        assert!(desc[0].0 as u64 <= len, "REQ_ONE descriptor longer than the request: {desc:?}");
        assert_eq!(desc[0].1, want, "REQ_ONE at {offset}: {desc:?}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_of_a_hole() {
    let fx = Fixture::new("read-hole", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let r = c.call(0, CMD_READ, 2 * MIB, 256 * KIB as u32, &[]);
    r.assert_ok("READ of a hole");
    assert!(!r.simple);
    assert!(!r.content_chunks().is_empty(), "no content chunk: {:?}", r.chunks);
    assert_ne!(r.chunks.last().unwrap().flags & REPLY_FLAG_DONE, 0, "last chunk lacks DONE");
    assert!(is_zero(&r.data), "hole does not read as zeros");
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_with_df_is_one_chunk() {
    let fx = Fixture::new("read-df", &[]);
    let (mut c, info, _) = Client::open_structured(fx.sock(), "disk");
    assert_ne!(info.flags & TF_SEND_DF, 0);
    let data = pattern(11, 8192);
    c.write(MIB + 8192, &data, 0);
    // A hole, data, and a mixture of both (which must come as OFFSET_DATA).
    for (offset, len) in [(0, 64 * KIB), (MIB + 8192, 8192), (MIB, 64 * KIB)] {
        let r = c.call(CMD_FLAG_DF, CMD_READ, offset, len as u32, &[]);
        r.assert_ok("READ with DF");
        assert_eq!(r.content_chunks().len(), 1, "DF read at {offset}: {:?}", r.chunks);
        assert_eq!(r.chunks.len(), 1, "DF read at {offset} should be a single chunk: {:?}", r.chunks);
        assert_eq!(r.chunks[0].flags, REPLY_FLAG_DONE);
        let mut want = vec![0u8; len as usize];
        let lo = (MIB + 8192).max(offset);
        let hi = (MIB + 16384).min(offset + len);
        if lo < hi {
            want[(lo - offset) as usize..(hi - offset) as usize]
                .copy_from_slice(&data[(lo - MIB - 8192) as usize..(hi - MIB - 8192) as usize]);
            assert_eq!(r.chunks[0].typ, REPLY_TYPE_OFFSET_DATA, "DF read over data must be OFFSET_DATA");
        }
        assert_eq!(r.data, want, "DF read at {offset}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn fua_is_accepted_on_every_command() {
    // proto.md, command flags: FUA "is valid for all commands, provided
    // NBD_FLAG_SEND_FUA has been negotiated, in which case the server MUST
    // accept all commands with this bit set (even by ignoring the bit)".
    let fx = Fixture::new("fua-all", &[]);
    let mut refused = Vec::new();
    let (mut c, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_SEND_FUA, 0);
    c.write(0, &pattern(16, 4096), 0);
    for (name, typ, len) in [("READ", CMD_READ, 4096), ("FLUSH", CMD_FLUSH, 0), ("CACHE", CMD_CACHE, 4096)] {
        let r = c.call(CMD_FLAG_FUA, typ, 0, len, &[]);
        if r.error != 0 {
            refused.push(format!("{name}|FUA: error {}", r.error));
        } else if typ == CMD_READ {
            assert_eq!(r.data, pattern(16, 4096));
        }
    }
    c.disconnect();

    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    for (name, flags, typ) in [("BLOCK_STATUS", 0, CMD_BLOCK_STATUS), ("READ|DF", CMD_FLAG_DF, CMD_READ)] {
        let r = c.call(flags | CMD_FLAG_FUA, typ, 0, 4096, &[]);
        if r.error != 0 {
            refused.push(format!("{name}|FUA (structured): error {}", r.error));
        }
    }
    c.disconnect();
    fx.stop();
    assert!(refused.is_empty(), "commands refused with FUA set: {refused:#?}");
}

#[test]
fn writes_of_many_sizes_in_one_burst() {
    // Many WRITEs in one send: payloads that straddle the server's read
    // buffer, and payloads on both sides of any "read it directly" threshold.
    let fx = Fixture::new("burst", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let sizes =
        [1usize, 511, 4096, 200 << 10, 256 << 10, (256 << 10) + 1, (512 << 10) - 28, 512 << 10, (1 << 20) + 3, 5 << 20];
    let mut burst = Vec::new();
    let mut placed = Vec::new();
    let mut offset = 4096u64;
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(200 + i as u64, n);
        burst.extend_from_slice(&c.encode_request(0, CMD_WRITE, offset, n as u32, &data).1);
        placed.push((offset, data));
        offset += n as u64 + 1234;
    }
    c.send(&burst);
    for _ in 0..sizes.len() {
        c.recv().assert_ok("WRITE in a burst");
    }
    for (offset, data) in placed {
        assert_eq!(c.read(offset, data.len() as u32), data, "{}-byte WRITE at {offset}", data.len());
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn requests_trickled_in_small_pieces() {
    let fx = Fixture::new("trickle", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    for (i, size) in [10usize << 10, 300 << 10].into_iter().enumerate() {
        let data = pattern(17 + i as u64, size);
        let offset = MIB * (i as u64 + 1);
        let (cookie, msg) = c.encode_request(0, CMD_WRITE, offset, size as u32, &data);
        // The header a byte at a time, then the payload in uneven pieces;
        // short pauses let the server see each piece on its own.
        let mut at = 0;
        for step in [1; 28].into_iter().chain([5, 1000, 70_000, 1, 200_000]) {
            let end = (at + step).min(msg.len());
            c.send(&msg[at..end]);
            at = end;
            std::thread::sleep(Duration::from_millis(1));
        }
        c.send(&msg[at..]);
        let r = c.recv();
        assert_eq!(r.cookie, cookie);
        r.assert_ok("trickled WRITE");
        assert_eq!(c.read(offset, size as u32), data, "{size}-byte trickled WRITE");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn maximum_payload_read_and_write() {
    let fx = Fixture::with_images("max-payload", &[("disk", "64M")], &[]);
    let data = pattern(18, MAX_PAYLOAD as usize);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.write(MIB + 1, &data, 0);
    assert!(c.read(MIB + 1, MAX_PAYLOAD) == data, "32 MiB read back differs");
    c.disconnect();
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    assert!(c.read(MIB + 1, MAX_PAYLOAD) == data, "32 MiB structured read differs");
    c.disconnect();
    fx.stop();
}

#[test]
fn large_commands_without_payload_succeed() {
    // TRIM, WRITE_ZEROES, CACHE and BLOCK_STATUS carry no payload: their
    // length is not bound by the 32 MiB maximum payload.
    let fx = Fixture::with_images("large-no-payload", &[("disk", "64M")], &[]);
    let (mut c, info, _) = Client::open_structured(fx.sock(), "disk");
    let len = 48 * MIB as u32;
    for i in 0..8 {
        c.write(i * 8 * MIB, &pattern(300 + i, 4096), 0);
    }
    c.call(0, CMD_WRITE_ZEROES, 0, len, &[]).assert_ok("48 MiB WRITE_ZEROES");
    c.call(0, CMD_TRIM, 8 * MIB, len, &[]).assert_ok("48 MiB TRIM");
    c.call(0, CMD_CACHE, 0, len, &[]).assert_ok("48 MiB CACHE");
    let r = c.call(0, CMD_BLOCK_STATUS, 0, info.size as u32, &[]);
    r.assert_ok("64 MiB BLOCK_STATUS");
    let (_, desc) = r.block_status();
    assert!(desc.iter().take(desc.len() - 1).map(|d| d.0 as u64).sum::<u64>() < info.size, "{desc:?}");
    // WRITE_ZEROES covered [0, 48 MiB), TRIM [8, 56 MiB); 56 MiB is untouched.
    for i in 0..7 {
        assert!(is_zero(&c.read(i * 8 * MIB, 4096)), "block at {} MiB not zeroed", i * 8);
    }
    assert_eq!(c.read(56 * MIB, 4096), pattern(307, 4096), "block at 56 MiB changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn writes_are_visible_on_other_connections_to_the_export() {
    // CAN_MULTI_CONN: what one connection wrote (and was told is done) the
    // others read.
    let fx = Fixture::new("multi-conn", &[]);
    let (mut a, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_CAN_MULTI_CONN, 0);
    let (mut b, _) = Client::open(fx.sock(), "disk");
    for i in 0..16 {
        let data = pattern(400 + i, 8192);
        a.write(i * 8192, &data, if i % 2 == 0 { CMD_FLAG_FUA } else { 0 });
        assert_eq!(b.read(i * 8192, 8192), data, "block {i} written on A, read on B");
    }
    a.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    a.disconnect();
    b.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Errors: each gets an error reply and the connection goes on
// ---------------------------------------------------------------------------

/// Sends one request that must fail with one of `errors`, then checks the
/// stream is still in sync.
fn expect_error(c: &mut Client, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8], errors: &[u32]) -> Reply {
    let r = c.call(flags, typ, offset, len, payload);
    assert!(
        errors.contains(&r.error),
        "command {typ} flags {flags:#x} offset {offset} len {len}: got error {}, want one of {errors:?}",
        r.error
    );
    assert!(r.data.is_empty(), "error reply carried data");
    c.assert_alive();
    r
}

#[test]
fn read_past_the_end_is_einval() {
    let fx = Fixture::new("err-read-end", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, DISK_SIZE - 512, 1024, &[], &[EINVAL]);
    expect_error(&mut c, 0, CMD_READ, DISK_SIZE, 1, &[], &[EINVAL]);
    expect_error(&mut c, 0, CMD_READ, u64::MAX - 100, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn write_past_the_end_is_enospc() {
    let fx = Fixture::new("err-write-end", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(12, 1024);
    expect_error(&mut c, 0, CMD_WRITE, DISK_SIZE - 512, 1024, &data, &[ENOSPC]);
    expect_error(&mut c, 0, CMD_WRITE, u64::MAX - 100, 1024, &data, &[ENOSPC]);
    // Nothing of the failed write landed.
    assert!(is_zero(&c.read(DISK_SIZE - 512, 512)));
    c.disconnect();
    fx.stop();
}

#[test]
fn zero_length_read_is_einval() {
    let fx = Fixture::new("err-read-zero", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, 0, 0, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn oversized_read_is_rejected() {
    let fx = Fixture::new("err-read-big", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, 0, MAX_PAYLOAD + 1, &[], &[EINVAL, EOVERFLOW]);
    expect_error(&mut c, 0, CMD_READ, 0, u32::MAX, &[], &[EINVAL, EOVERFLOW]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_command_is_einval() {
    let fx = Fixture::new("err-cmd", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, 42, 0, 0, &[], &[EINVAL]);
    expect_error(&mut c, 0, 42, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_command_flags_are_einval() {
    let fx = Fixture::new("err-flags", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0x8000, CMD_READ, 0, 4096, &[], &[EINVAL]);
    expect_error(&mut c, 0x8000, CMD_FLUSH, 0, 0, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn write_to_readonly_export_is_eperm_and_payload_is_consumed() {
    let fx = Fixture::new("err-ro-write", &["--readonly"]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // A payload of zeros: if the server took it for requests it would see a
    // bad magic and close, and the READ after it would fail.
    expect_error(&mut c, 0, CMD_WRITE, 0, MIB as u32, &vec![0; MIB as usize], &[EPERM]);
    expect_error(&mut c, CMD_FLAG_FUA, CMD_WRITE, 4096, 100, &[0; 100], &[EPERM]);
    assert!(is_zero(&c.read(0, 8192)), "the read-only export changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn trim_and_write_zeroes_on_readonly_export_are_eperm() {
    let fx = Fixture::new("err-ro-trim", &["--readonly"]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_TRIM, 0, 4096, &[], &[EPERM]);
    expect_error(&mut c, 0, CMD_WRITE_ZEROES, 0, 4096, &[], &[EPERM]);
    c.disconnect();
    fx.stop();
}

#[test]
fn block_status_without_meta_context_is_einval() {
    let fx = Fixture::new("err-bs", &[]);
    // With structured replies but no context selected.
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    c.go("disk", &[]).expect("GO");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    // Without structured replies at all.
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn df_without_structured_replies_is_einval() {
    let fx = Fixture::new("err-df", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, CMD_FLAG_DF, CMD_READ, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn oversized_write_gets_an_error_and_the_stream_stays_in_sync() {
    let fx = Fixture::new("err-write-big", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let len = MAX_PAYLOAD + 4096;
    let cookie = c.send_request(0, CMD_WRITE, 0, len, &[]);
    // The payload goes from another thread, so an early error reply cannot
    // deadlock us against a server that reads it only after replying.
    let mut w = c.sock.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&pattern(13, len as usize)));
    match c.try_recv() {
        Ok(r) => {
            assert_eq!(r.cookie, cookie);
            assert_ne!(r.error, 0, "a {len}-byte WRITE succeeded");
            writer.join().unwrap().expect("server stopped reading the payload of the rejected WRITE");
            c.assert_alive();
            assert!(is_zero(&c.read(0, 4096)), "the rejected WRITE changed the disk");
            c.disconnect();
        }
        Err(e) => {
            let _ = writer.join();
            eprintln!("NOTE: the server closed the connection on a {len}-byte WRITE ({e})");
            let (mut c, _) = Client::open(fx.sock(), "disk");
            c.assert_alive();
            c.disconnect();
        }
    }
    fx.stop();
}

#[test]
fn structured_read_error_is_an_error_chunk_with_done() {
    let fx = Fixture::new("err-structured", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let r = expect_error(&mut c, 0, CMD_READ, DISK_SIZE - 512, 1024, &[], &[EINVAL]);
    assert!(!r.simple, "READ error came as a simple reply in structured mode");
    let last = r.chunks.last().unwrap();
    assert_eq!(last.typ, REPLY_TYPE_ERROR, "{:?}", r.chunks);
    assert_ne!(last.flags & REPLY_FLAG_DONE, 0, "error chunk lacks DONE");
    assert!(r.content_chunks().is_empty(), "content with the error: {:?}", r.chunks);
    c.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let fx = Fixture::new("bad-magic", &[]);
    let (mut keeper, _) = Client::open(fx.sock(), "disk");
    let (mut bad, _) = Client::open(fx.sock(), "disk");
    keeper.write(0, &pattern(14, 4096), 0);
    bad.assert_alive();
    let mut msg = 0xdead_beef_u32.to_be_bytes().to_vec();
    msg.extend_from_slice(&[0; 24]);
    bad.send(&msg);
    let stray = bad.expect_closed("bad request magic");
    assert!(stray.is_empty(), "server sent {stray:02x?} before closing");
    assert_eq!(keeper.read(0, 4096), pattern(14, 4096));
    keeper.disconnect();
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn pipelined_requests_all_get_matching_replies() {
    const N: u64 = 256;
    const LEN: u32 = 4096;
    let fx = Fixture::new("pipeline", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // Cookie -> is it a READ.
    let mut outstanding = HashMap::new();
    for i in 0..N {
        outstanding.insert(c.send_request(0, CMD_WRITE, i * 8192, LEN, &pattern(i, LEN as usize)), false);
    }
    for i in 0..N {
        outstanding.insert(c.send_request(0, CMD_READ, i * 8192, LEN, &[]), true);
    }
    assert_eq!(outstanding.len() as u64, 2 * N, "cookies are not distinct");
    for _ in 0..2 * N {
        let r = c.recv();
        r.assert_ok("pipelined request");
        let is_read = outstanding
            .remove(&r.cookie)
            .unwrap_or_else(|| panic!("reply for cookie {:#x} that was never sent or already answered", r.cookie));
        // A READ sent before a WRITE was acknowledged may or may not see it,
        // so only the length is checked here, the contents below.
        assert_eq!(r.data.len(), if is_read { LEN as usize } else { 0 });
    }
    assert!(outstanding.is_empty());
    // Every write is acknowledged now: all the data must be there.
    for i in 0..N {
        assert_eq!(c.read(i * 8192, LEN), pattern(i, LEN as usize), "block {i}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn disc_closes_after_answering_outstanding_requests() {
    let fx = Fixture::new("disc", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(15, 64 * KIB as usize);
    // A WRITE and the DISC right behind it: the WRITE must still be answered.
    let cookie = c.send_request(0, CMD_WRITE, 0, data.len() as u32, &data);
    c.send_request(0, CMD_DISC, 0, 0, &[]);
    let r = c.recv();
    assert_eq!(r.cookie, cookie);
    r.assert_ok("WRITE before DISC");
    let stray = c.expect_closed("after NBD_CMD_DISC");
    assert!(stray.is_empty(), "server sent {} bytes after NBD_CMD_DISC", stray.len());

    let (mut c, _) = Client::open(fx.sock(), "disk");
    assert_eq!(c.read(0, data.len() as u32), data);
    c.disconnect();
    fx.stop();
}

/// (open fds, threads) of process `pid`. io_uring's kernel workers
/// (`iou-wrk-*`, `iou-sqp-*`) are not counted: the kernel starts them on
/// demand and retires them on its own timer, so they say nothing of leaks.
fn resources(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd").count();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("read /proc/PID/task")
        .map_while(Result::ok)
        .filter(|t| !std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().starts_with("iou-"))
        .count();
    (fds, threads)
}

/// Thread names of process `pid`, for failure messages.
fn thread_names(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map_while(Result::ok)
        .map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().trim().to_owned())
        .collect();
    v.sort();
    v
}

fn fd_listing(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .map_while(Result::ok)
        .map(|e| format!("{} -> {:?}", e.file_name().to_string_lossy(), std::fs::read_link(e.path()).ok()))
        .collect();
    v.sort();
    v
}

/// Polls until two samples 50 ms apart agree (at most 2 s).
fn settled_resources(pid: u32) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut last = resources(pid);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = resources(pid);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// One connection of the leak test, abandoned in one of several ways.
fn abandoned_connection(sock: &Path, kind: usize) {
    match kind {
        // Before reading the greeting.
        0 => drop(UnixStream::connect(sock).unwrap()),
        // Mid-handshake: client flags, half an option header.
        1 => {
            let mut c = Client::handshake(sock);
            c.send(&IHAVEOPT.to_be_bytes()[..5]);
        }
        // After GO, in the middle of a WRITE's payload.
        2 => {
            let (mut c, _) = Client::open(sock, "disk");
            c.send_request(0, CMD_WRITE, 0, 64 * KIB as u32, &[7; 1000]);
        }
        // After GO, with a READ whose reply is never read.
        3 => {
            let (mut c, _) = Client::open(sock, "disk");
            c.send_request(0, CMD_READ, 0, MIB as u32, &[]);
        }
        // A normal session.
        _ => {
            let (mut c, _) = Client::open(sock, "disk");
            c.write(8192, &[1; 512], 0);
            c.read(8192, 512);
            c.disconnect();
        }
    }
}

#[test]
fn no_fd_or_thread_leaks_after_many_connections() {
    let fx = Fixture::new("leaks", &[]);
    let pid = fx.server.child.id();

    let (mut warm, _) = Client::open(fx.sock(), "disk");
    warm.write(0, &[1; 4096], 0);
    warm.read(0, 4096);
    warm.disconnect();
    let (base_fds, base_threads) = settled_resources(pid);
    let (base_fd_list, base_thread_list) = (fd_listing(pid), thread_names(pid));

    // 200 connections abandoned in various ways, in batches during which a
    // few more sit idle in mid-negotiation.
    for batch in 0..10 {
        let mut held = Vec::new();
        for i in 0..20 {
            abandoned_connection(fx.sock(), (batch * 20 + i) % 5);
            if i % 4 == 0 {
                held.push(Client::handshake(fx.sock()));
            }
        }
        drop(held);
    }

    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut fds, mut threads) = resources(pid);
    while (fds > base_fds || threads > base_threads) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        (fds, threads) = resources(pid);
    }
    assert!(
        fds <= base_fds && threads <= base_threads,
        "after 200 connections: {fds} fds / {threads} threads, baseline {base_fds} / {base_threads}\n\
         fds then: {base_fd_list:#?}\nfds now: {:#?}\nthreads then: {base_thread_list:?}\nthreads now: {:?}",
        fd_listing(pid),
        thread_names(pid),
    );
    // And it still serves.
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn two_exports_serve_two_clients_at_once() {
    let fx = Fixture::with_images("two", &[("one", "16M"), ("two", "16M")], &[]);
    let start = Arc::new(Barrier::new(2));
    let sock = fx.sock().to_path_buf();
    let (s1, b1) = (sock.clone(), start.clone());
    let writer = std::thread::spawn(move || {
        let (mut c, _) = Client::open(&s1, "one");
        b1.wait();
        for i in 0..64 {
            let data = pattern(100 + i, 64 * KIB as usize);
            c.write(i * 64 * KIB, &data, 0);
            assert_eq!(c.read(i * 64 * KIB, data.len() as u32), data, "export one, block {i}");
        }
        c.disconnect();
    });
    let (s2, b2) = (sock, start);
    let reader = std::thread::spawn(move || {
        let (mut c, _) = Client::open(&s2, "two");
        b2.wait();
        for i in 0..64 {
            assert!(
                is_zero(&c.read(i * 64 * KIB, 64 * KIB as u32)),
                "export two, block {i}: writes leaked across exports"
            );
        }
        c.disconnect();
    });
    writer.join().expect("writer on export one");
    reader.join().expect("reader on export two");

    let (mut one, _) = Client::open(fx.sock(), "one");
    let (mut two, _) = Client::open(fx.sock(), "two");
    assert_eq!(one.read(63 * 64 * KIB, 64 * KIB as u32), pattern(163, 64 * KIB as usize));
    assert!(is_zero(&two.read(0, 4 * MIB as u32)), "export two changed");
    one.disconnect();
    two.disconnect();
    fx.stop();
}

#[test]
fn sigterm_with_clients_connected_stops_cleanly() {
    let fx = Fixture::new("sigterm", &[]);
    let (mut idle, _) = Client::open(fx.sock(), "disk");
    idle.assert_alive();
    let negotiating = Client::handshake(fx.sock());
    let (mut busy, _) = Client::open(fx.sock(), "disk");
    let data = pattern(19, 64 * KIB as usize);
    let cookie = busy.send_request(0, CMD_WRITE, 0, data.len() as u32, &data);
    // stop() asserts exit status 0 and that the socket file is gone.
    fx.stop();
    // The outstanding WRITE was answered before the connection closed.
    let r = busy.try_recv().expect("reply to the WRITE in flight at SIGTERM");
    assert_eq!(r.cookie, cookie);
    r.assert_ok("WRITE in flight at SIGTERM");
    busy.expect_closed("after SIGTERM");
    idle.expect_closed("after SIGTERM");
    negotiating.expect_closed("after SIGTERM");
}
