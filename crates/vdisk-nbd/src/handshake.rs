//! The fixed-newstyle handshake: option haggling until the client picks an
//! export (OPT_GO / OPT_EXPORT_NAME) or leaves. Errors the client can recover
//! from get an option error reply; a broken stream ends the connection.
//!
//! It also enforces the server's [`Policy`]: with TLS required, nothing but
//! STARTTLS and ABORT is answered before TLS is up, so a plain client learns no
//! export name and reaches no data; export listing and the default export ("")
//! can be switched off. An export with an allow list ([`crate::allow`]) exists
//! only for the clients on it: any other client gets the answers an unknown
//! name gets (NBD_REP_ERR_UNKNOWN, a hang-up for NBD_OPT_EXPORT_NAME) and does
//! not see the name in NBD_OPT_LIST.

use std::io::{self, Read, Write};
use std::sync::Arc;

use crate::allow::PeerIdentity;
use crate::meta::{self, Selected, ServedBitmaps};
use crate::proto::*;
use crate::tls::{Tls, TlsMode};
use crate::Export;

/// A client connection the handshake can run on: a byte stream that can be
/// upgraded to TLS in place (after which every byte goes through TLS).
pub trait Transport: Read + Write {
    fn start_tls(&mut self, tls: &Tls) -> io::Result<()>;
    /// Who the client proved to be in the TLS handshake (None: no TLS, or anonymous).
    fn peer_identity(&self) -> Option<PeerIdentity> {
        None
    }
}

/// What clients may do during the handshake.
#[derive(Clone)]
pub struct Policy {
    /// TLS offered (or required); `None`: STARTTLS is refused (NBD_REP_ERR_POLICY).
    pub tls: Option<Arc<Tls>>,
    /// Answer NBD_OPT_LIST with the export names (off: NBD_REP_ERR_POLICY).
    pub list: bool,
    /// The empty export name selects the first export.
    pub default_export: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { tls: None, list: true, default_export: true }
    }
}

/// The biggest option payload we accept; larger ones close the connection.
const MAX_OPTION_LEN: u32 = 64 << 10;

/// What the client and server agreed on.
#[derive(Debug, Clone)]
pub struct Negotiated {
    pub export: usize,
    pub structured: bool,
    /// The meta contexts the client selected for this export (see [`meta`]),
    /// in id order; block status is refused while there are none.
    pub contexts: Vec<Selected>,
    pub transmission_flags: u16,
}

/// Why a handshake ended without a transmission phase.
#[derive(Debug)]
pub enum HandshakeEnd {
    /// The client aborted (NBD_OPT_ABORT) or closed cleanly between options.
    Aborted,
    /// The client broke the protocol; the message says how.
    Violation(String),
    Io(io::Error),
}

impl From<io::Error> for HandshakeEnd {
    fn from(e: io::Error) -> Self {
        HandshakeEnd::Io(e)
    }
}

pub fn transmission_flags(export: &Export, structured: bool) -> u16 {
    let mut f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_SEND_CACHE | TF_CAN_MULTI_CONN;
    if export.device.read_only() {
        f |= TF_READ_ONLY;
    } else {
        f |= TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
    }
    if structured {
        f |= TF_SEND_DF;
    }
    f
}

struct Haggle<'a, S> {
    s: &'a mut S,
    exports: &'a [Export],
    structured: bool,
    no_zeroes: bool,
    /// The bitmaps each export serves, index for index with `exports` (may be shorter: none).
    bitmaps: &'a [ServedBitmaps],
    /// (export index, contexts) chosen by the last OPT_SET_META_CONTEXT.
    meta: Option<(usize, Vec<Selected>)>,
    shutting_down: &'a dyn Fn() -> bool,
    policy: &'a Policy,
    tls_up: bool,
    /// What TLS proved about the client, for the exports' allow lists.
    identity: Option<PeerIdentity>,
}

/// Runs the handshake on `s`. On success the stream is positioned at the first request.
pub fn handshake<S: Transport>(
    s: &mut S,
    exports: &[Export],
    policy: &Policy,
    shutting_down: &dyn Fn() -> bool,
) -> Result<Negotiated, HandshakeEnd> {
    handshake_with_bitmaps(s, exports, &[], policy, shutting_down)
}

/// [`handshake`], offering `qemu:dirty-bitmap:NAME` contexts for the
/// bitmaps `bitmaps[i]` of export `i`.
pub fn handshake_with_bitmaps<S: Transport>(
    s: &mut S,
    exports: &[Export],
    bitmaps: &[ServedBitmaps],
    policy: &Policy,
    shutting_down: &dyn Fn() -> bool,
) -> Result<Negotiated, HandshakeEnd> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;
    let client = read_u32(s)?;
    if client & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeEnd::Violation(format!("unknown client flags {client:#x}")));
    }
    let mut h = Haggle {
        s,
        exports,
        structured: false,
        no_zeroes: client & FLAG_C_NO_ZEROES != 0,
        bitmaps,
        meta: None,
        shutting_down,
        policy,
        tls_up: false,
        identity: None,
    };
    loop {
        let mut head = [0u8; 16];
        match h.s.read_exact(&mut head) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(HandshakeEnd::Aborted),
            r => r?,
        }
        let magic = u64::from_be_bytes(head[0..8].try_into().unwrap());
        let opt = u32::from_be_bytes(head[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(head[12..16].try_into().unwrap());
        if magic != IHAVEOPT {
            return Err(HandshakeEnd::Violation(format!("bad option magic {magic:#x}")));
        }
        if len > MAX_OPTION_LEN {
            return Err(HandshakeEnd::Violation(format!("option {opt} claims {len} bytes of data")));
        }
        let mut data = vec![0u8; len as usize];
        h.s.read_exact(&mut data)?;
        if (h.shutting_down)() && opt != OPT_ABORT {
            h.reply(opt, REP_ERR_SHUTDOWN, b"the server is shutting down")?;
            continue;
        }
        if let Some(done) = h.option(opt, &data)? {
            return Ok(done);
        }
    }
}

impl<S: Transport> Haggle<'_, S> {
    /// Handles one option; returns the agreement when it starts transmission.
    fn option(&mut self, opt: u32, data: &[u8]) -> Result<Option<Negotiated>, HandshakeEnd> {
        let tls_required = self.policy.tls.as_ref().is_some_and(|t| t.mode == TlsMode::Require) && !self.tls_up;
        if tls_required && opt != OPT_STARTTLS && opt != OPT_ABORT {
            if opt == OPT_EXPORT_NAME {
                // It cannot be refused with a reply: the spec says to hang up.
                return Err(HandshakeEnd::Violation(
                    "NBD_OPT_EXPORT_NAME without TLS, which this server requires".into(),
                ));
            }
            self.reply(opt, REP_ERR_TLS_REQD, b"this server requires TLS: send NBD_OPT_STARTTLS first")?;
            return Ok(None);
        }
        match opt {
            OPT_STARTTLS => {
                self.start_tls(data)?;
                Ok(None)
            }
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(data);
                let Some(idx) = self.find(&name) else {
                    return Err(HandshakeEnd::Violation(format!("NBD_OPT_EXPORT_NAME for unknown export {name:?}")));
                };
                let done = self.agree(idx);
                let mut out = Vec::with_capacity(134);
                out.extend_from_slice(&self.exports[idx].device.size().to_be_bytes());
                out.extend_from_slice(&done.transmission_flags.to_be_bytes());
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                self.s.write_all(&out)?;
                Ok(Some(done))
            }
            OPT_ABORT => {
                let _ = self.reply(opt, REP_ACK, &[]);
                Err(HandshakeEnd::Aborted)
            }
            OPT_LIST => {
                if !self.policy.list {
                    self.reply(opt, REP_ERR_POLICY, b"this server does not list its exports")?;
                    return Ok(None);
                }
                if !data.is_empty() {
                    self.reply(opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    return Ok(None);
                }
                let (exports, who) = (self.exports, self.identity.clone());
                for e in exports.iter().filter(|e| e.allow.admits(who.as_ref())) {
                    let mut d = Vec::with_capacity(4 + e.name.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    self.reply(opt, REP_SERVER, &d)?;
                }
                self.reply(opt, REP_ACK, &[])?;
                Ok(None)
            }
            OPT_INFO | OPT_GO => self.info_or_go(opt, data),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply(opt, REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data")?;
                } else {
                    self.structured = true;
                    self.reply(opt, REP_ACK, &[])?;
                }
                Ok(None)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(opt, data)?;
                Ok(None)
            }
            _ => {
                self.reply(opt, REP_ERR_UNSUP, format!("option {opt} is not supported").as_bytes())?;
                Ok(None)
            }
        }
    }

    fn start_tls(&mut self, data: &[u8]) -> Result<(), HandshakeEnd> {
        let Some(tls) = self.policy.tls.clone() else {
            self.reply(OPT_STARTTLS, REP_ERR_POLICY, b"TLS is not enabled on this server")?;
            return Ok(());
        };
        if self.tls_up {
            self.reply(OPT_STARTTLS, REP_ERR_INVALID, b"TLS is already on")?;
            return Ok(());
        }
        if !data.is_empty() {
            self.reply(OPT_STARTTLS, REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data")?;
            return Ok(());
        }
        self.reply(OPT_STARTTLS, REP_ACK, &[])?;
        self.s.start_tls(&tls).map_err(|e| HandshakeEnd::Violation(format!("TLS handshake failed: {e}")))?;
        self.tls_up = true;
        self.identity = self.s.peer_identity();
        // Nothing agreed in the clear carries over into the TLS session.
        self.structured = false;
        self.meta = None;
        match &self.identity {
            Some(who) => log::debug!("TLS session established: {who}"),
            None => log::debug!("TLS session established (anonymous client)"),
        }
        Ok(())
    }

    fn info_or_go(&mut self, opt: u32, data: &[u8]) -> Result<Option<Negotiated>, HandshakeEnd> {
        let mut r = Cursor(data);
        let parsed = (|| {
            let name = r.string()?;
            let n = r.u16()? as usize;
            let wants: Vec<u16> = (0..n).map(|_| r.u16()).collect::<Option<_>>()?;
            r.0.is_empty().then_some((name, wants))
        })();
        let Some((name, wants)) = parsed else {
            self.reply(opt, REP_ERR_INVALID, b"malformed NBD_OPT_INFO/GO data")?;
            return Ok(None);
        };
        let Some(idx) = self.find(&name) else {
            self.reply(opt, REP_ERR_UNKNOWN, format!("no export named {name:?}").as_bytes())?;
            return Ok(None);
        };
        let export = &self.exports[idx];
        let flags = transmission_flags(export, self.structured);
        let mut info = Vec::with_capacity(12);
        info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        info.extend_from_slice(&export.device.size().to_be_bytes());
        info.extend_from_slice(&flags.to_be_bytes());
        self.reply(opt, REP_INFO, &info)?;
        for want in wants {
            let mut d = want.to_be_bytes().to_vec();
            match want {
                INFO_NAME => d.extend_from_slice(export.name.as_bytes()),
                INFO_DESCRIPTION => d.extend_from_slice(export.description.as_bytes()),
                INFO_BLOCK_SIZE => {
                    for v in [MIN_BLOCK, PREFERRED_BLOCK, MAX_REQUEST] {
                        d.extend_from_slice(&v.to_be_bytes());
                    }
                }
                _ => continue,
            }
            self.reply(opt, REP_INFO, &d)?;
        }
        self.reply(opt, REP_ACK, &[])?;
        Ok((opt == OPT_GO).then(|| self.agree(idx)))
    }

    fn meta_context(&mut self, opt: u32, data: &[u8]) -> io::Result<()> {
        if !self.structured {
            return self.reply(opt, REP_ERR_INVALID, b"negotiate NBD_OPT_STRUCTURED_REPLY first");
        }
        let Some((name, queries)) = meta::parse(data) else {
            return self.reply(opt, REP_ERR_INVALID, b"malformed meta context data");
        };
        let Some(idx) = self.find(&name) else {
            return self.reply(opt, REP_ERR_UNKNOWN, format!("no export named {name:?}").as_bytes());
        };
        let set = opt == OPT_SET_META_CONTEXT;
        if set {
            self.meta = None;
        }
        let offered = meta::offered(self.bitmaps.get(idx).map_or(&[][..], |b| &b[..]));
        let chosen = meta::matching(&offered, &queries, !set);
        for c in &chosen {
            // LIST names contexts without giving them ids.
            let mut d = if set { c.id } else { 0 }.to_be_bytes().to_vec();
            d.extend_from_slice(c.context.name().as_bytes());
            self.reply(opt, REP_META_CONTEXT, &d)?;
        }
        if set {
            self.meta = Some((idx, chosen));
        }
        self.reply(opt, REP_ACK, &[])
    }

    fn agree(&self, export: usize) -> Negotiated {
        Negotiated {
            export,
            structured: self.structured,
            contexts: self.meta.as_ref().filter(|(i, _)| *i == export).map_or_else(Vec::new, |(_, c)| c.clone()),
            transmission_flags: transmission_flags(&self.exports[export], self.structured),
        }
    }

    /// The export a client names; "" is the first one (unless the policy says
    /// no). An export whose allow list does not admit this client is not found.
    fn find(&self, name: &str) -> Option<usize> {
        let idx = if name.is_empty() && !self.exports.is_empty() && self.policy.default_export {
            0
        } else {
            self.exports.iter().position(|e| e.name == name)?
        };
        let export = &self.exports[idx];
        if !export.allow.admits(self.identity.as_ref()) {
            let who = self.identity.as_ref().map_or_else(|| "an anonymous client".to_owned(), |w| w.to_string());
            log::info!(export:% = export.name; "{who} is not on the allow list of export {:?}; answered as for an unknown export", export.name);
            return None;
        }
        Some(idx)
    }

    fn reply(&mut self, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(20 + data.len());
        out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&opt.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
        self.s.write_all(&out)
    }
}

fn read_u32<S: Read>(s: &mut S) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// Reads big-endian fields from option data; `None` when the data runs out.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        if n > 4096 {
            return None;
        }
        self.take(n).map(|b| String::from_utf8_lossy(b).into_owned())
    }
}
