//! A deliberately small raw NBD client (big-endian, per NetworkBlockDevice/nbd
//! `doc/proto.md`) for tests that must control every byte: the wire
//! constants, the client, reply checking and a fixture serving fresh images.
//! Shared by protocol.rs and abuse.rs.

use super::{create_image, Server, TempDir};
use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

// ---------------------------------------------------------------------------
// Wire constants: the server's own table (vdisk_nbd::proto, doc/proto.md
// "Values"), shared with the soak client, plus the few the server never sends.
// ---------------------------------------------------------------------------

pub use vdisk_nbd::proto::*;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

pub const BASE_ALLOCATION: &str = META_BASE_ALLOCATION;
pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
/// Every test disk is this big unless it says otherwise.
pub const DISK_SIZE: u64 = 16 * MIB;
/// The largest payload the server advertises (NBD_INFO_BLOCK_SIZE maximum).
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// No single socket operation in these tests should ever take this long.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// The raw client
// ---------------------------------------------------------------------------

/// Reads big-endian fields out of a reply payload, panicking on short data.
pub struct Cursor<'a>(pub &'a [u8]);

impl<'a> Cursor<'a> {
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        assert!(self.0.len() >= n, "payload too short: need {n} bytes, have {}", self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().unwrap())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().unwrap())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take(8).try_into().unwrap())
    }

    pub fn string(&mut self, n: usize) -> String {
        String::from_utf8(self.take(n).to_vec()).expect("string is not UTF-8")
    }

    pub fn rest(&mut self) -> &'a [u8] {
        self.take(self.0.len())
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

/// What NBD_OPT_INFO / NBD_OPT_GO (or NBD_OPT_EXPORT_NAME) told us about an export.
#[derive(Debug, Default)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    pub name: Option<String>,
    pub description: Option<String>,
    /// Minimum, preferred and maximum block size.
    pub block_size: Option<[u32; 3]>,
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
    /// The first nonzero error of the reply, or 0.
    pub error: u32,
    /// Whether it came as a simple reply.
    pub simple: bool,
    /// For a successful READ: the data, reassembled from its chunks.
    pub data: Vec<u8>,
    /// For a structured reply: every chunk, in arrival order.
    pub chunks: Vec<Chunk>,
}

impl Reply {
    pub fn assert_ok(&self, what: &str) {
        assert_eq!(self.error, 0, "{what} failed with error {}: {self:?}", self.error);
    }

    /// The payload chunks (not NONE, not errors).
    pub fn content_chunks(&self) -> Vec<&Chunk> {
        self.chunks.iter().filter(|c| c.typ == REPLY_TYPE_OFFSET_DATA || c.typ == REPLY_TYPE_OFFSET_HOLE).collect()
    }

    /// The single BLOCK_STATUS chunk: context id and (length, flags) descriptors.
    pub fn block_status(&self) -> (u32, Vec<(u32, u32)>) {
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
pub struct Client {
    pub sock: UnixStream,
    pub structured: bool,
    pub next_cookie: u64,
    pub pending: HashMap<u64, Pending>,
    pub partial: HashMap<u64, Vec<Chunk>>,
}

impl Client {
    // --- connection and handshake ---------------------------------------

    /// Connects and reads the server's greeting; sends nothing yet.
    pub fn connect(path: &Path) -> Client {
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
    pub fn handshake(path: &Path) -> Client {
        let mut c = Client::connect(path);
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        c
    }

    /// Handshake and NBD_OPT_GO on `export`, simple replies.
    pub fn open(path: &Path, export: &str) -> (Client, ExportInfo) {
        let mut c = Client::handshake(path);
        let info = c.go(export, &[]).unwrap_or_else(|e| panic!("GO {export:?} failed: {e:#x}"));
        (c, info)
    }

    /// Handshake with structured replies and base:allocation, then NBD_OPT_GO.
    /// Returns the client, the export and the base:allocation context id.
    pub fn open_structured(path: &Path, export: &str) -> (Client, ExportInfo, u32) {
        let mut c = Client::handshake(path);
        c.structured_reply();
        let id = c.set_base_allocation(export);
        let info = c.go(export, &[]).unwrap_or_else(|e| panic!("GO {export:?} failed: {e:#x}"));
        (c, info, id)
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("send to server");
    }

    pub fn bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0; n];
        self.sock.read_exact(&mut buf)?;
        Ok(buf)
    }

    pub fn send_client_flags(&mut self, flags: u32) {
        self.send(&flags.to_be_bytes());
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&opt.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(data);
        self.send(&msg);
    }

    /// Reads one option reply and checks that it answers `opt`.
    pub fn recv_option_reply(&mut self, opt: u32) -> OptReply {
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
    pub fn option(&mut self, opt: u32, data: &[u8]) -> Vec<OptReply> {
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
    pub fn info_or_go(&mut self, opt: u32, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
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

    pub fn info(&mut self, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        self.info_or_go(OPT_INFO, export, requests)
    }

    /// NBD_OPT_GO; on success the client is in transmission.
    pub fn go(&mut self, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        self.info_or_go(OPT_GO, export, requests)
    }

    pub fn structured_reply(&mut self) {
        let replies = self.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(replies.len(), 1, "STRUCTURED_REPLY: {replies:?}");
        assert_eq!(replies[0].typ, REP_ACK, "STRUCTURED_REPLY not acknowledged");
        self.structured = true;
    }

    /// NBD_OPT_LIST_META_CONTEXT or NBD_OPT_SET_META_CONTEXT: the (id, name)
    /// pairs, or the error reply type.
    pub fn meta_context(&mut self, opt: u32, export: &str, queries: &[&str]) -> Result<Vec<(u32, String)>, u32> {
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
    pub fn set_base_allocation(&mut self, export: &str) -> u32 {
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
    pub fn send_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> u64 {
        let (cookie, msg) = self.encode_request(flags, typ, offset, len, payload);
        self.send(&msg);
        cookie
    }

    /// Reads replies until one request is complete; `Err` if the stream ends.
    /// Protocol violations panic.
    pub fn try_recv(&mut self) -> io::Result<Reply> {
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

    pub fn recv(&mut self) -> Reply {
        self.try_recv().expect("server closed the connection or timed out instead of replying")
    }

    /// Sends one request and waits for its reply.
    pub fn call(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> Reply {
        let cookie = self.send_request(flags, typ, offset, len, payload);
        let reply = self.recv();
        assert_eq!(reply.cookie, cookie, "reply cookie");
        reply
    }

    pub fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let r = self.call(0, CMD_READ, offset, len, &[]);
        r.assert_ok("READ");
        assert_eq!(r.data.len(), len as usize);
        r.data
    }

    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) {
        self.call(flags, CMD_WRITE, offset, data.len() as u32, data).assert_ok("WRITE");
    }

    /// A valid READ still works: the stream is in sync after whatever came before.
    pub fn assert_alive(&mut self) {
        let r = self.call(0, CMD_READ, 0, 4096, &[]);
        r.assert_ok("READ after the error (is the stream out of sync?)");
        assert_eq!(r.data.len(), 4096);
    }

    /// NBD_OPT_ABORT during negotiation: ACK, then the server closes.
    pub fn disconnect_in_negotiation(mut self) {
        self.send_option(OPT_ABORT, &[]);
        assert_eq!(self.recv_option_reply(OPT_ABORT).typ, REP_ACK, "ABORT reply");
        let stray = self.expect_closed("after NBD_OPT_ABORT");
        assert!(stray.is_empty(), "server sent {stray:02x?} after the ACK to ABORT");
    }

    /// NBD_CMD_DISC, then the server must close without sending anything.
    pub fn disconnect(mut self) {
        self.send_request(0, CMD_DISC, 0, 0, &[]);
        let stray = self.expect_closed("after NBD_CMD_DISC");
        assert!(stray.is_empty(), "server sent {} bytes after NBD_CMD_DISC", stray.len());
    }

    /// Waits for the server to close the connection; returns whatever it sent first.
    pub fn expect_closed(mut self, what: &str) -> Vec<u8> {
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
pub fn assemble(cookie: u64, req: Pending, chunks: Vec<Chunk>) -> Reply {
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
pub struct Fixture {
    // Field order matters: the server stops before its directory goes.
    pub server: Server,
    pub _dir: TempDir,
}

impl Fixture {
    /// Serves one fresh sparse 16 MiB image, exported as "disk".
    pub fn new(tag: &str, extra: &[&str]) -> Fixture {
        Fixture::with_images(tag, &[("disk", "16M")], extra)
    }

    /// Serves fresh sparse images `(stem, size)`, in this order.
    pub fn with_images(tag: &str, images: &[(&str, &str)], extra: &[&str]) -> Fixture {
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

    pub fn sock(&self) -> &Path {
        &self.server.socket
    }

    /// Stops the server and checks it exits cleanly.
    pub fn stop(self) {
        self.server.stop();
    }
}

/// A recognisable, offset-dependent byte pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (seed.wrapping_mul(31).wrapping_add(i * 7 + i / 251) % 251) as u8 + 1).collect()
}

pub fn is_zero(data: &[u8]) -> bool {
    data.iter().all(|&b| b == 0)
}
