//! The soak's own NBD client: fixed-newstyle handshake with NBD_OPT_GO, simple
//! replies only, many requests in flight on one connection. Small on purpose:
//! it drives the server hard and reports what happened; judging the bytes is
//! the callers' business. It never panics on what the server sends: a broken
//! reply is an `io::Error` the soak reports.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vdisk_nbd::proto::{
    CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, IHAVEOPT, INFO_EXPORT, NBDMAGIC, OPT_GO,
    OPT_REPLY_MAGIC, REP_ACK, REP_INFO, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC,
};

/// NBD_CMD_FLAG_FUA.
pub use vdisk_nbd::proto::CMD_FLAG_FUA as FUA;

/// The commands the soak sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cmd {
    Read = CMD_READ as isize,
    Write = CMD_WRITE as isize,
    Flush = CMD_FLUSH as isize,
    Trim = CMD_TRIM as isize,
    Zero = CMD_WRITE_ZEROES as isize,
}

/// One answered request.
pub struct Reply {
    pub cookie: u64,
    /// NBD error (an errno), 0 for success.
    pub error: u32,
    /// A successful READ's data.
    pub data: Vec<u8>,
}

/// One connection in transmission phase.
pub struct Conn {
    rd: BufReader<UnixStream>,
    wr: UnixStream,
    pub size: u64,
    next_cookie: u64,
    /// Cookie → length of a READ still waiting for its reply (0 for other commands).
    pending: HashMap<u64, u32>,
}

fn broken(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

impl Conn {
    /// Connects to `socket` and negotiates `export` with NBD_OPT_GO. Every
    /// read waits at most `timeout`: a server that stops answering is an error.
    pub fn connect(socket: &Path, export: &str, timeout: Duration) -> io::Result<Conn> {
        let sock = UnixStream::connect(socket)?;
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        let mut c = Conn {
            rd: BufReader::with_capacity(256 << 10, sock.try_clone()?),
            wr: sock,
            size: 0,
            next_cookie: 1,
            pending: HashMap::new(),
        };
        let mut greeting = [0u8; 18];
        c.rd.read_exact(&mut greeting)?;
        if be_u64(&greeting) != NBDMAGIC || be_u64(&greeting[8..]) != IHAVEOPT {
            return Err(broken("not an NBD fixed-newstyle server"));
        }
        // Client flags FIXED_NEWSTYLE | NO_ZEROES, then GO with no information requests.
        let mut msg = 3u32.to_be_bytes().to_vec();
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&OPT_GO.to_be_bytes());
        msg.extend_from_slice(&(4 + export.len() as u32 + 2).to_be_bytes());
        msg.extend_from_slice(&(export.len() as u32).to_be_bytes());
        msg.extend_from_slice(export.as_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        c.wr.write_all(&msg)?;
        loop {
            let mut head = [0u8; 20];
            c.rd.read_exact(&mut head)?;
            if be_u64(&head) != OPT_REPLY_MAGIC {
                return Err(broken("bad option reply magic"));
            }
            let (typ, len) = (be_u32(&head[12..]), be_u32(&head[16..]));
            let mut data = vec![0u8; len as usize];
            c.rd.read_exact(&mut data)?;
            match typ {
                REP_ACK => break,
                REP_INFO if data.len() >= 10 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    c.size = be_u64(&data[2..]);
                }
                REP_INFO => {}
                t => return Err(broken(format!("export {export:?} refused (option reply {t:#x})"))),
            }
        }
        Ok(c)
    }

    /// Sends one request (with `payload` for a WRITE); returns its cookie.
    pub fn send(&mut self, cmd: Cmd, flags: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<u64> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut msg = Vec::with_capacity(28 + payload.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&(cmd as u16).to_be_bytes());
        msg.extend_from_slice(&cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(payload);
        self.wr.write_all(&msg)?;
        self.pending.insert(cookie, if cmd == Cmd::Read { len } else { 0 });
        Ok(cookie)
    }

    /// Waits for the next reply, whichever request it answers.
    pub fn recv(&mut self) -> io::Result<Reply> {
        let mut head = [0u8; 16];
        self.rd.read_exact(&mut head)?;
        if be_u32(&head) != SIMPLE_REPLY_MAGIC {
            return Err(broken(format!("bad reply magic {:#x}", be_u32(&head))));
        }
        let (error, cookie) = (be_u32(&head[4..]), be_u64(&head[8..]));
        let read_len =
            self.pending.remove(&cookie).ok_or_else(|| broken(format!("reply to unknown cookie {cookie}")))?;
        let mut data = Vec::new();
        if error == 0 && read_len > 0 {
            data.resize(read_len as usize, 0);
            self.rd.read_exact(&mut data)?;
        }
        Ok(Reply { cookie, error, data })
    }

    /// Requests sent whose replies have not come yet.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// One request and its reply; an NBD error is an `io::Error` carrying the errno.
    pub fn call(&mut self, cmd: Cmd, flags: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<Vec<u8>> {
        let cookie = self.send(cmd, flags, offset, len, payload)?;
        let r = self.recv()?;
        if r.cookie != cookie {
            return Err(broken("reply for another request"));
        }
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

    /// NBD_CMD_DISC: the polite goodbye.
    pub fn disconnect(mut self) {
        let mut msg = REQUEST_MAGIC.to_be_bytes().to_vec();
        msg.extend_from_slice(&[0, 0, 0, 2]);
        msg.extend_from_slice(&[0; 20]);
        let _ = self.wr.write_all(&msg);
    }
}
