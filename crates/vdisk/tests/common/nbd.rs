//! The tests' side of the one NBD client (`vdisk_nbd::client`, shared with the
//! soak), for tests that must control every byte: that client wrapped so a
//! broken reply panics, checks of option and reply contents, and a fixture
//! serving fresh images. Shared by protocol.rs and abuse.rs.

use super::{create_image, Server, TempDir};
use std::io::{self, ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

// ---------------------------------------------------------------------------
// Wire constants: the server's own table (vdisk_nbd::proto, doc/proto.md
// "Values"), shared with the client.
// ---------------------------------------------------------------------------

pub use vdisk_nbd::client::{Chunk, OptReply, Reply};
pub use vdisk_nbd::proto::*;

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

/// Checks of a reply's contents.
pub trait ReplyExt {
    fn assert_ok(&self, what: &str);
    /// The payload chunks (not NONE, not errors).
    fn content_chunks(&self) -> Vec<&Chunk>;
    /// The single BLOCK_STATUS chunk: context id and (length, flags) descriptors.
    fn block_status(&self) -> (u32, Vec<(u32, u32)>);
}

impl ReplyExt for Reply {
    fn assert_ok(&self, what: &str) {
        assert_eq!(self.error, 0, "{what} failed with error {}: {self:?}", self.error);
    }

    fn content_chunks(&self) -> Vec<&Chunk> {
        self.chunks.iter().filter(|c| c.typ == REPLY_TYPE_OFFSET_DATA || c.typ == REPLY_TYPE_OFFSET_HOLE).collect()
    }

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

/// The shared client (`vdisk_nbd::client::Client`, reached through `Deref`)
/// with the tests' conveniences: a broken reply or a failed send panics.
pub struct Client(pub vdisk_nbd::client::Client);

impl std::ops::Deref for Client {
    type Target = vdisk_nbd::client::Client;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Client {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Client {
    // --- connection and handshake ---------------------------------------

    /// Connects and reads the server's greeting; sends nothing yet.
    pub fn connect(path: &Path) -> Client {
        let mut c = vdisk_nbd::client::Client::greet(path, IO_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect {} and read the greeting: {e}", path.display()));
        assert_eq!(c.handshake_flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, "handshake flags");
        // High bits set so a server that truncates cookies is caught.
        c.next_cookie = 0xc0c0_0000_0000_0001;
        Client(c)
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
        self.0.send_raw(bytes).expect("send to server");
    }

    pub fn send_client_flags(&mut self, flags: u32) {
        self.send(&flags.to_be_bytes());
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        self.0.send_option(opt, data).expect("send an option");
    }

    /// Reads one option reply and checks that it answers `opt`.
    pub fn recv_option_reply(&mut self, opt: u32) -> OptReply {
        self.0.recv_option_reply(opt).unwrap_or_else(|e| panic!("reading reply to option {opt}: {e}"))
    }

    /// Sends an option and collects every reply up to the final ACK or error.
    pub fn option(&mut self, opt: u32, data: &[u8]) -> Vec<OptReply> {
        self.0.option(opt, data).unwrap_or_else(|e| panic!("option {opt}: {e}"))
    }

    /// NBD_OPT_INFO or NBD_OPT_GO; `Err` carries the error reply type.
    pub fn info_or_go(&mut self, opt: u32, export: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        let infos = self.0.info_or_go(opt, export, requests).unwrap_or_else(|e| panic!("option {opt}: {e}"))?;
        let mut info = ExportInfo::default();
        let mut saw_export = false;
        for data in infos {
            let mut cur = Cursor(&data);
            match cur.u16() {
                INFO_EXPORT => {
                    assert_eq!(data.len(), 12, "NBD_INFO_EXPORT length");
                    info.size = cur.u64();
                    info.flags = cur.u16();
                    saw_export = true;
                }
                INFO_NAME => info.name = Some(cur.string(data.len() - 2)),
                INFO_DESCRIPTION => info.description = Some(cur.string(data.len() - 2)),
                INFO_BLOCK_SIZE => {
                    assert_eq!(data.len(), 14, "NBD_INFO_BLOCK_SIZE length");
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

    /// Sends one request (see `vdisk_nbd::client::Client::encode_request`); returns its cookie.
    pub fn send_request(&mut self, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8]) -> u64 {
        self.0.send_request(flags, typ, offset, len, payload).expect("send to server")
    }

    /// Reads replies until one request is complete; `Err` if the stream ends.
    /// Protocol violations panic.
    pub fn try_recv(&mut self) -> io::Result<Reply> {
        match self.0.recv() {
            Err(e) if e.kind() == ErrorKind::InvalidData => panic!("{e}"),
            r => r,
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
