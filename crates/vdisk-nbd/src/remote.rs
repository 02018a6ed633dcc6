//! A small NBD client for another server's export: the target of a mirror
//! (vdisk-daemon `mirror`), and the disk an export serves from once a
//! mirror pivots onto it ([`RemoteDisk`]). It connects over TCP (`nbd://HOST[:PORT]/NAME`)
//! or a unix socket (`nbd+unix:///NAME?socket=PATH`), does the fixed newstyle
//! handshake with NBD_OPT_GO (after NBD_OPT_STARTTLS for an `nbds` URI: X.509
//! with rustls, as libnbd's `tls-certificates`, or TLS-PSK with OpenSSL, as
//! its `tls-psk-file`; no structured replies), and sends one
//! request at a time with simple replies: WRITE, FLUSH (when the export
//! offers it), WRITE_ZEROES (when offered; written zeros otherwise), READ.
//! Every socket operation has a timeout, so a server that goes away fails
//! the caller instead of hanging it. Wire constants come from [`crate::proto`];
//! it shares nothing with the server side.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::proto::*;

/// How long one socket operation may take before the target counts as gone.
pub const TIMEOUT: Duration = Duration::from_secs(60);
/// The largest request sent (the protocol's usual 32 MiB limit).
const MAX_CHUNK: u64 = 32 << 20;

/// Where an NBD URI points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// A parsed `nbd://`, `nbds://`, `nbd+unix://` or `nbds+unix://` URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uri {
    pub address: Address,
    pub export: String,
    /// TLS (NBD_OPT_STARTTLS) for an `nbds` URI.
    pub tls: Option<UriTls>,
}

/// How an `nbds` URI's connection proves the server (libnbd's query parameters).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UriTls {
    /// `tls-certificates=DIR`: `ca-cert.pem`, the CA the server's certificate
    /// must come from, and `client-cert.pem` with `client-key.pem` if the
    /// server asks the client for one (qemu's and libnbd's layout).
    pub certificates: Option<PathBuf>,
    /// `tls-hostname=NAME`: the name the server's certificate must carry
    /// (by default the URI's host; `localhost` over a unix socket).
    pub hostname: Option<String>,
    /// `tls-psk-file=FILE`: pre-shared keys (psktool's `username:hexkey`
    /// lines) instead of certificates, for the URI's user (`nbds://USER@...`,
    /// or `tls-username=USER`).
    pub psk_file: Option<PathBuf>,
    pub username: Option<String>,
}

impl Uri {
    /// True when `s` looks like an NBD URI (and is no file name).
    pub fn is_nbd(s: &str) -> bool {
        ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"].iter().any(|p| s.starts_with(p))
    }

    /// Parses `nbd[s]://HOST[:PORT][/NAME]` (port 10809 by default) or
    /// `nbd[s]+unix:///[NAME]?socket=PATH`; an `nbds` URI may add
    /// `tls-certificates=DIR` and `tls-hostname=NAME` to its query.
    pub fn parse(s: &str) -> Result<Uri, String> {
        let bad = |why: &str| {
            format!(
                "{s:?} is not an NBD URI ({why}): use nbd://HOST[:PORT]/NAME or nbd+unix:///NAME?socket=PATH \
                 (nbds:// and nbds+unix:// for TLS, with ?tls-certificates=DIR)"
            )
        };
        let (scheme, rest) = s.split_once("://").ok_or_else(|| bad("no scheme"))?;
        let (unix, tls) = match scheme {
            "nbd" => (false, false),
            "nbds" => (false, true),
            "nbd+unix" => (true, false),
            "nbds+unix" => (true, true),
            _ => return Err(bad("it starts with none of nbd://, nbds://, nbd+unix://, nbds+unix://")),
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut socket = None;
        let mut t = UriTls::default();
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            match k {
                "socket" if unix && !v.is_empty() => socket = Some(PathBuf::from(v)),
                "tls-certificates" if tls && !v.is_empty() => t.certificates = Some(PathBuf::from(v)),
                "tls-hostname" if tls && !v.is_empty() => t.hostname = Some(v.to_owned()),
                "tls-psk-file" if tls && !v.is_empty() => t.psk_file = Some(PathBuf::from(v)),
                "tls-username" if tls && !v.is_empty() => t.username = Some(v.to_owned()),
                k if k.starts_with("tls-") && !tls => return Err(bad(&format!("{k} needs an nbds URI"))),
                k => return Err(bad(&format!("the query parameter {k:?} is not known here"))),
            }
        }
        // The user of a PSK key: `USER@` before the host (or before `/` for a unix socket).
        let rest = match rest.split_once('/').map(|(a, _)| a).unwrap_or(rest).split_once('@') {
            Some((user, _)) => {
                if t.username.is_none() && !user.is_empty() {
                    t.username = Some(user.to_owned());
                }
                &rest[user.len() + 1..]
            }
            None => rest,
        };
        let tls = tls.then_some(t);
        if unix {
            let export = rest.strip_prefix('/').unwrap_or(rest).to_owned();
            let socket = socket.ok_or_else(|| bad("no ?socket=PATH"))?;
            return Ok(Uri { address: Address::Unix(socket), export, tls });
        }
        let (hostport, export) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = if let Some(h) = hostport.strip_prefix('[') {
            let (h, p) = h.split_once(']').ok_or_else(|| bad("an unclosed [ in the host"))?;
            (h.to_owned(), p.strip_prefix(':'))
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (hostport.to_owned(), None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = match port {
            None => 10809,
            Some(p) => p.parse().map_err(|_| bad("the port is not a number"))?,
        };
        Ok(Uri { address: Address::Tcp { host, port }, export: export.to_owned(), tls })
    }

    /// The name the server's certificate must carry.
    fn tls_hostname(&self, t: &UriTls) -> String {
        match (&t.hostname, &self.address) {
            (Some(h), _) => h.clone(),
            (None, Address::Tcp { host, .. }) => host.clone(),
            (None, Address::Unix(_)) => "localhost".to_owned(),
        }
    }
}

trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// Connects to the first address of `host` that answers within [`TIMEOUT`] each.
fn connect_tcp(host: &str, port: u16) -> io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, TIMEOUT.min(Duration::from_secs(10))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// An open export of a remote server, in transmission.
pub struct Remote {
    sock: Box<dyn Conn>,
    /// The export's size in bytes.
    pub size: u64,
    /// Its transmission flags (`TF_*`).
    pub flags: u16,
    cookie: u64,
    /// The handshake is over: requests (and NBD_CMD_DISC at the end) may go.
    open: bool,
}

fn broken(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().unwrap())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

impl Remote {
    /// Connects to `uri`'s server and opens its export (NBD_OPT_GO).
    pub fn open(uri: &Uri) -> io::Result<Remote> {
        let sock: Box<dyn Conn> = match &uri.address {
            Address::Tcp { host, port } => {
                let s = connect_tcp(host, *port)?;
                s.set_read_timeout(Some(TIMEOUT))?;
                s.set_write_timeout(Some(TIMEOUT))?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
            Address::Unix(path) => {
                let s = UnixStream::connect(path)?;
                s.set_read_timeout(Some(TIMEOUT))?;
                s.set_write_timeout(Some(TIMEOUT))?;
                Box::new(s)
            }
        };
        let mut me = Remote { sock, size: 0, flags: 0, cookie: 0, open: false };
        me.handshake(uri)?;
        Ok(me)
    }

    /// NBD_OPT_STARTTLS, then the TLS handshake: the connection goes on encrypted.
    fn start_tls(&mut self, uri: &Uri, t: &UriTls) -> io::Result<()> {
        if let Some(file) = &t.psk_file {
            return self.start_tls_psk(file, t.username.as_deref());
        }
        let config = crate::tls::client_config(t.certificates.as_deref()).map_err(io::Error::other)?;
        let name = uri.tls_hostname(t);
        let server_name = rustls::pki_types::ServerName::try_from(name.clone())
            .map_err(|e| io::Error::other(format!("{name:?} is not a name a certificate can carry: {e}")))?;
        self.starttls()?;
        let conn = rustls::ClientConnection::new(config, server_name).map_err(io::Error::other)?;
        let plain = std::mem::replace(&mut self.sock, Box::new(io::Cursor::new(Vec::new())));
        let mut tls = rustls::StreamOwned::new(conn, plain);
        while tls.conn.is_handshaking() {
            tls.conn
                .complete_io(&mut tls.sock)
                .map_err(|e| io::Error::new(e.kind(), format!("the TLS handshake with the server failed: {e}")))?;
        }
        self.sock = Box::new(tls);
        Ok(())
    }

    /// NBD_OPT_STARTTLS, then a TLS-PSK handshake as `username`.
    #[cfg(feature = "psk")]
    fn start_tls_psk(&mut self, file: &Path, username: Option<&str>) -> io::Result<()> {
        let username = username.ok_or_else(|| {
            io::Error::other("tls-psk-file needs the key's user: nbds://USER@HOST/NAME, or ?tls-username=USER")
        })?;
        self.starttls()?;
        let plain = std::mem::replace(&mut self.sock, Box::new(io::Cursor::new(Vec::new())));
        self.sock = Box::new(crate::psk::connect(plain, file, username)?);
        Ok(())
    }

    #[cfg(not(feature = "psk"))]
    fn start_tls_psk(&mut self, _file: &Path, _username: Option<&str>) -> io::Result<()> {
        Err(io::Error::other("this vdisk was built without TLS-PSK (the `psk` feature): use tls-certificates"))
    }

    /// NBD_OPT_STARTTLS: Ok once the server said the TLS handshake may start.
    fn starttls(&mut self) -> io::Result<()> {
        self.send_opt(OPT_STARTTLS, &[])?;
        let (typ, body) = self.opt_reply(OPT_STARTTLS)?;
        if typ != REP_ACK {
            let why = String::from_utf8_lossy(&body).into_owned();
            return Err(io::Error::other(format!(
                "the server does not offer TLS (NBD_OPT_STARTTLS answered {typ:#x}{}): use an nbd:// URI",
                if why.is_empty() { String::new() } else { format!(": {why}") }
            )));
        }
        Ok(())
    }

    /// Sends option `opt` with `data`.
    fn send_opt(&mut self, opt: u32, data: &[u8]) -> io::Result<()> {
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&opt.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(data);
        self.sock.write_all(&msg)
    }

    /// One reply to option `opt`: its type and body.
    fn opt_reply(&mut self, opt: u32) -> io::Result<(u32, Vec<u8>)> {
        let head = self.read_n(20)?;
        if u64_at(&head, 0) != OPT_REPLY_MAGIC || u32_at(&head, 8) != opt {
            return Err(broken("the server's option reply is malformed"));
        }
        let (typ, len) = (u32_at(&head, 12), u32_at(&head, 16) as usize);
        if len > 1 << 20 {
            return Err(broken(format!("the server's option reply is {len} bytes long")));
        }
        Ok((typ, self.read_n(len)?))
    }

    fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.sock.read_exact(&mut b)?;
        Ok(b)
    }

    fn handshake(&mut self, uri: &Uri) -> io::Result<()> {
        let export = uri.export.as_str();
        let hello = self.read_n(18)?;
        if u64_at(&hello, 0) != NBDMAGIC || u64_at(&hello, 8) != IHAVEOPT {
            return Err(broken("the server does not speak newstyle NBD (bad greeting magic)"));
        }
        let server = u16_at(&hello, 16);
        if server & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(broken("the server does not offer fixed newstyle negotiation"));
        }
        let mut client = FLAG_C_FIXED_NEWSTYLE;
        if server & FLAG_NO_ZEROES != 0 {
            client |= FLAG_C_NO_ZEROES;
        }
        self.sock.write_all(&client.to_be_bytes())?;
        if let Some(t) = &uri.tls {
            self.start_tls(uri, t)?;
        }
        let mut data = Vec::with_capacity(6 + export.len());
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        self.send_opt(OPT_GO, &data)?;
        let mut have_export = false;
        loop {
            let (typ, body) = self.opt_reply(OPT_GO)?;
            match typ {
                REP_ACK if have_export => {
                    self.open = true;
                    return Ok(());
                }
                REP_ACK => return Err(broken("the server ended NBD_OPT_GO without the export's size")),
                REP_INFO if body.len() >= 12 && u16_at(&body, 0) == INFO_EXPORT => {
                    self.size = u64_at(&body, 2);
                    self.flags = u16_at(&body, 10);
                    have_export = true;
                }
                REP_INFO => {}
                t if t & REP_FLAG_ERROR != 0 => {
                    let why = String::from_utf8_lossy(&body).into_owned();
                    let what = match t {
                        REP_ERR_UNKNOWN => "no such export",
                        REP_ERR_TLS_REQD => "the server requires TLS (use nbds://...?tls-certificates=DIR)",
                        REP_ERR_POLICY => "the server refuses this client",
                        REP_ERR_UNSUP => "the server does not support NBD_OPT_GO",
                        _ => "the server refused the export",
                    };
                    let e =
                        format!("{what} {export:?}{}", if why.is_empty() { String::new() } else { format!(": {why}") });
                    return Err(io::Error::other(e));
                }
                _ => {}
            }
        }
    }

    /// Sends one request and waits for its simple reply.
    fn request(&mut self, typ: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<()> {
        self.cookie += 1;
        let mut msg = Vec::with_capacity(REQUEST_HEADER + payload.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        msg.extend_from_slice(&typ.to_be_bytes());
        msg.extend_from_slice(&self.cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(payload);
        self.sock.write_all(&msg)?;
        let reply = self.read_n(16)?;
        if u32_at(&reply, 0) != SIMPLE_REPLY_MAGIC || u64_at(&reply, 8) != self.cookie {
            return Err(broken("the server's reply is malformed (magic or cookie)"));
        }
        match u32_at(&reply, 4) {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e as i32)),
        }
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        for (i, chunk) in data.chunks(MAX_CHUNK as usize).enumerate() {
            self.request(CMD_WRITE, offset + (i as u64) * MAX_CHUNK, chunk.len() as u32, chunk)?;
        }
        Ok(())
    }

    /// Makes `len` bytes at `offset` read as zeros (WRITE_ZEROES, or written zeros).
    pub fn zero(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let mut at = 0;
        if self.flags & TF_SEND_WRITE_ZEROES != 0 {
            while at < len {
                let n = (len - at).min(MAX_CHUNK);
                self.request(CMD_WRITE_ZEROES, offset + at, n as u32, &[])?;
                at += n;
            }
            return Ok(());
        }
        let zeros = vec![0u8; len.min(1 << 20) as usize];
        while at < len {
            let n = (len - at).min(zeros.len() as u64);
            self.write(offset + at, &zeros[..n as usize])?;
            at += n;
        }
        Ok(())
    }

    /// Makes every write durable (a no-op on an export that offers no FLUSH).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.flags & TF_SEND_FLUSH != 0 {
            self.request(CMD_FLUSH, 0, 0, &[])?;
        }
        Ok(())
    }

    /// Reads `len` bytes at `offset`.
    pub fn read(&mut self, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        self.cookie += 1;
        let mut msg = Vec::with_capacity(REQUEST_HEADER);
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        msg.extend_from_slice(&CMD_READ.to_be_bytes());
        msg.extend_from_slice(&self.cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        self.sock.write_all(&msg)?;
        let reply = self.read_n(16)?;
        if u32_at(&reply, 0) != SIMPLE_REPLY_MAGIC || u64_at(&reply, 8) != self.cookie {
            return Err(broken("the server's reply is malformed (magic or cookie)"));
        }
        match u32_at(&reply, 4) {
            0 => self.read_n(len as usize),
            e => Err(io::Error::from_raw_os_error(e as i32)),
        }
    }
}

/// A remote export as a disk to serve from ([`vdisk_image::BlockTarget`]):
/// what a mirror's pivot onto an NBD target switches its export to. Each
/// call takes an idle connection (or opens one), so the engine's threads
/// reach the server in parallel; a connection that failed is dropped (its
/// stream may be out of step). A server that does not offer multi-conn
/// gets one connection, so that a FLUSH covers every write it answered.
pub struct RemoteDisk {
    uri: Uri,
    multi_conn: bool,
    idle: std::sync::Mutex<Vec<Remote>>,
    /// Connections open now (idle or in use): at most one without multi-conn.
    open: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

impl RemoteDisk {
    /// The export `first` has open (at `uri`), reached through `first` and more like it.
    pub fn new(uri: Uri, first: Remote) -> RemoteDisk {
        RemoteDisk {
            uri,
            multi_conn: first.flags & TF_CAN_MULTI_CONN != 0,
            idle: std::sync::Mutex::new(vec![first]),
            open: std::sync::Mutex::new(1),
            freed: std::sync::Condvar::new(),
        }
    }

    /// Runs `f` on a connection of its own.
    fn with<T>(&self, f: impl FnOnce(&mut Remote) -> io::Result<T>) -> io::Result<T> {
        let mut conn = loop {
            if let Some(c) = self.idle.lock().unwrap().pop() {
                break c;
            }
            let mut open = self.open.lock().unwrap();
            if self.multi_conn || *open == 0 {
                *open += 1;
                drop(open);
                match Remote::open(&self.uri) {
                    Ok(c) => break c,
                    Err(e) => {
                        *self.open.lock().unwrap() -= 1;
                        return Err(e);
                    }
                }
            }
            // The one connection is in use: wait until it is back (or gone).
            let _ = self.freed.wait_timeout(open, Duration::from_millis(50)).unwrap();
        };
        let r = f(&mut conn);
        if r.is_ok() {
            self.idle.lock().unwrap().push(conn);
        } else {
            drop(conn);
            *self.open.lock().unwrap() -= 1;
        }
        self.freed.notify_one();
        r
    }
}

impl vdisk_image::BlockTarget for RemoteDisk {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        for (i, chunk) in buf.chunks_mut(MAX_CHUNK as usize).enumerate() {
            let at = offset + (i as u64) * MAX_CHUNK;
            let data = self.with(|c| c.read(at, chunk.len() as u32))?;
            chunk.copy_from_slice(&data);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.with(|c| c.write(offset, buf))
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.with(|c| c.zero(offset, len))
    }

    /// With multi-conn a FLUSH on any connection covers them all; without,
    /// there is only one.
    fn sync(&self) -> io::Result<()> {
        self.with(|c| c.flush())
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        // NBD_CMD_DISC: the server closes when it has answered what it took.
        let mut msg = Vec::with_capacity(REQUEST_HEADER);
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        msg.extend_from_slice(&CMD_DISC.to_be_bytes());
        msg.extend_from_slice(&[0u8; 20]);
        let _ = self.sock.write_all(&msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_or_say_why_not() {
        let u = Uri::parse("nbd://127.0.0.1:10810/disk").unwrap();
        assert_eq!(u.address, Address::Tcp { host: "127.0.0.1".into(), port: 10810 });
        assert_eq!(u.export, "disk");
        let u = Uri::parse("nbd://[::1]/x").unwrap();
        assert_eq!(u.address, Address::Tcp { host: "::1".into(), port: 10809 });
        let u = Uri::parse("nbd+unix:///d?socket=/run/a.sock").unwrap();
        assert_eq!((u.address, u.export.as_str()), (Address::Unix("/run/a.sock".into()), "d"));
        assert!(Uri::parse("nbd+unix:///d").unwrap_err().contains("socket=PATH"));
        assert!(Uri::parse("nbd://:5/d").unwrap_err().contains("no host"));
        assert!(Uri::parse("nbd://h:x/d").unwrap_err().contains("port"));
        assert!(Uri::is_nbd("nbd://h/d") && !Uri::is_nbd("/tmp/nbd://x"));
        assert!(Uri::parse("nbd://h/d").unwrap().tls.is_none());
        let u = Uri::parse("nbds+unix:///d?socket=/run/a.sock&tls-certificates=/pki&tls-hostname=far").unwrap();
        let t = u.tls.clone().unwrap();
        assert_eq!((t.certificates.as_deref(), t.hostname.as_deref()), (Some(Path::new("/pki")), Some("far")));
        assert_eq!(u.address, Address::Unix("/run/a.sock".into()));
        let u = Uri::parse("nbds://10.0.0.1:10810/disk?tls-certificates=/pki").unwrap();
        assert_eq!((u.export.as_str(), u.tls_hostname(u.tls.as_ref().unwrap()).as_str()), ("disk", "10.0.0.1"));
        assert!(Uri::is_nbd("nbds://h/d") && Uri::is_nbd("nbds+unix:///d?socket=/s"));
        assert!(Uri::parse("nbd://h/d?tls-certificates=/pki").unwrap_err().contains("needs an nbds URI"));
        assert!(Uri::parse("nbds://h/d?bogus=1").unwrap_err().contains("\"bogus\" is not known"));
        let u = Uri::parse("nbds+unix://alice@/disk?socket=/s&tls-psk-file=/k/keys.psk").unwrap();
        let t = u.tls.unwrap();
        assert_eq!((u.export.as_str(), t.username.as_deref()), ("disk", Some("alice")));
        assert_eq!(t.psk_file.as_deref(), Some(Path::new("/k/keys.psk")));
        let u = Uri::parse("nbds://bob@far:10810/d?tls-psk-file=/k").unwrap();
        assert_eq!(u.address, Address::Tcp { host: "far".into(), port: 10810 });
        assert_eq!(u.tls.unwrap().username.as_deref(), Some("bob"));
    }
}
