//! What the file system answers, whatever the transport: the one regular file
//! (node 1) sized to the device, its attributes, and the mapping of FUSE
//! operations onto engine requests. The transports (/dev/fuse reads or ring
//! entries) call [`Session::dispatch`] and send what it returns; they own the
//! bytes, this module owns the meaning.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use vdisk_engine::inflight::InFlight;
use vdisk_engine::{Bounds, Device, Op, Refusal, Request};

use crate::proto::{self, Wire};

/// Largest READ/WRITE we negotiate (and the payload size of every buffer).
pub const MAX_IO: usize = 1 << 20;
/// Test-only opcodes: one whose dispatch panics, one that panics the transport's loop itself.
#[cfg(test)]
pub(crate) const TEST_PANIC: u32 = 0x7e57_0001;
#[cfg(test)]
pub(crate) const TEST_PANIC_IN_LOOP: u32 = 0x7e57_0002;
/// Test-only offsets for the ring's test (which gets only real opcodes from the
/// kernel): a READ here panics in dispatch; one at the other, in the queue's loop.
#[cfg(test)]
pub(crate) const TEST_PANIC_READ_AT: u64 = 0x7_0000;
#[cfg(test)]
pub(crate) const TEST_PANIC_LOOP_AT: u64 = 0x7_8000;
/// Test-only: a classic batch with a READ here panics in its submit, before the engine takes it.
#[cfg(test)]
pub(crate) const TEST_PANIC_SUBMIT_AT: u64 = 0x6_0000;
/// How long the kernel may cache the attributes: they never change.
const ATTR_VALID_SECS: u64 = 3600;

/// What to do with one request.
pub enum Action {
    /// Answer now: an errno (0 for success) and the reply's body.
    Reply(i32, Vec<u8>),
    /// Hand to the engine; the reply is built from the completed request by [`Session::reply_of`].
    Submit(Request),
    /// The kernel expects no answer (FORGET, INTERRUPT).
    Nothing,
}

/// The file system state shared by every thread of one export.
pub struct Session {
    pub device: Arc<Device>,
    uid: u32,
    gid: u32,
    started: u64,
    /// Requests with the engine; stop waits for none.
    pub inflight: InFlight,
    /// The classic transport's requests with the engine, by unique (each counted out once).
    pub owed: crate::owed::Owed,
    /// LSEEKs with the engine, by FUSE `unique`: whether each wants a hole
    /// (SEEK_HOLE) or data (SEEK_DATA). The engine's BLOCK_STATUS does not
    /// carry it; the reply needs it.
    seeks: Mutex<HashMap<u64, bool>>,
}

impl Session {
    pub fn new(device: Arc<Device>) -> Session {
        // SAFETY: getuid cannot fail and touches no memory.
        let uid = unsafe { libc::getuid() };
        // SAFETY: getgid cannot fail and touches no memory.
        let gid = unsafe { libc::getgid() };
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Session {
            device,
            uid,
            gid,
            started,
            inflight: InFlight::new(),
            owed: Default::default(),
            seeks: Mutex::new(HashMap::new()),
        }
    }

    pub fn size(&self) -> u64 {
        self.device.size()
    }

    fn attr(&self) -> proto::Attr {
        let size = self.size();
        proto::Attr {
            ino: proto::ROOT_ID,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            mode: libc::S_IFREG | if self.read_only() { 0o444 } else { 0o644 },
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            blksize: 4096,
            ..Default::default()
        }
    }

    fn attr_out(&self) -> Vec<u8> {
        proto::AttrOut { attr_valid: ATTR_VALID_SECS, attr: self.attr(), ..Default::default() }.bytes().to_vec()
    }

    /// Decides what to do with a request other than INIT. `op` holds the
    /// opcode's fixed argument (and, on /dev/fuse, whatever follows it). A
    /// WRITE comes back as `Submit` with an empty buffer: the transport puts
    /// the data in.
    pub fn dispatch(&self, h: &proto::InHeader, op: &[u8]) -> Action {
        let fail = |errno: i32| Action::Reply(errno, Vec::new());
        let ok = |body: Vec<u8>| Action::Reply(0, body);
        match h.opcode {
            proto::FORGET | proto::BATCH_FORGET | proto::INTERRUPT => Action::Nothing,
            proto::GETATTR => ok(self.attr_out()),
            proto::SETATTR => {
                let Some(s) = proto::SetattrIn::read(op) else { return fail(libc::EINVAL) };
                if s.valid & proto::FATTR_SIZE != 0 && s.size != self.size() {
                    // The file is a disk: its size is the image's.
                    return fail(libc::EPERM);
                }
                ok(self.attr_out())
            }
            proto::LOOKUP => fail(libc::ENOENT),
            proto::OPEN => {
                let Some(o) = proto::OpenIn::read(op) else { return fail(libc::EINVAL) };
                if self.read_only() && (o.flags as i32 & libc::O_ACCMODE) != libc::O_RDONLY {
                    return fail(libc::EROFS);
                }
                let flags = proto::FOPEN_DIRECT_IO | proto::FOPEN_PARALLEL_DIRECT_WRITES;
                ok(proto::OpenOut { fh: 0, open_flags: flags, backing_id: 0 }.bytes().to_vec())
            }
            proto::RELEASE => ok(Vec::new()),
            proto::STATFS => {
                let st = proto::Kstatfs {
                    blocks: self.size() / 4096,
                    bsize: 4096,
                    frsize: 4096,
                    namelen: 255,
                    files: 1,
                    ..Default::default()
                };
                ok(st.bytes().to_vec())
            }
            proto::READ => proto::RwIn::read(op).map_or(fail(libc::EINVAL), |r| self.read(h, &r)),
            proto::WRITE => proto::RwIn::read(op).map_or(fail(libc::EINVAL), |w| self.write(h, &w)),
            proto::FLUSH | proto::FSYNC if self.read_only() => ok(Vec::new()),
            // FSYNC with or without FUSE_FSYNC_FDATASYNC: the engine's flush makes the
            // data and the image's metadata (a COW bitmap) durable, which is all a
            // full fsync adds to a datasync here (the file's attributes never change).
            // FLUSH comes with each close(2); flushing there costs little and keeps
            // a program that writes, closes and expects the data safe.
            proto::FLUSH | proto::FSYNC => Action::Submit(Request::new(Op::Flush, 0, 0, h.unique)),
            proto::FALLOCATE => {
                let Some(f) = proto::FallocateIn::read(op) else { return fail(libc::EINVAL) };
                self.fallocate(h, &f)
            }
            proto::LSEEK => proto::LseekIn::read(op).map_or(fail(libc::EINVAL), |l| self.lseek(h, &l)),
            proto::DESTROY => ok(Vec::new()),
            #[cfg(test)]
            TEST_PANIC => panic!("a test asked request {} to panic", h.unique),
            _ => fail(libc::ENOSYS),
        }
    }

    /// What [`vdisk_engine::validate`] judges this file's requests against:
    /// the device, and reads and writes no longer than we negotiated.
    fn bounds(&self) -> Bounds {
        Bounds { max_data: MAX_IO as u64, ..self.device.bounds() }
    }

    /// Whether the device takes no writes (the one read-only state: the device's).
    pub fn read_only(&self) -> bool {
        self.device.bounds().read_only
    }

    fn read(&self, h: &proto::InHeader, r: &proto::RwIn) -> Action {
        #[cfg(test)]
        if r.offset == TEST_PANIC_READ_AT {
            panic!("a test asked the READ at {} to panic", r.offset);
        }
        let mut len = r.size as u64;
        match vdisk_engine::validate(Op::Read, r.offset, len, &self.bounds()) {
            Ok(()) => {}
            // A read past the end is short, as on any file.
            Err(Refusal::OutOfRange) => len = len.min(self.size().saturating_sub(r.offset)),
            Err(Refusal::TooLong) => return Action::Reply(libc::EINVAL, Vec::new()),
            Err(_) => len = 0,
        }
        if len == 0 {
            return Action::Reply(0, Vec::new());
        }
        Action::Submit(Request::new(Op::Read, r.offset, len, h.unique))
    }

    fn write(&self, h: &proto::InHeader, w: &proto::RwIn) -> Action {
        // With FOPEN_DIRECT_IO the kernel sends no FSYNC after an O_DSYNC or
        // O_SYNC write (nor one with RWF_DSYNC/RWF_SYNC): the flag is only
        // here, in the WRITE's flags (O_SYNC includes the O_DSYNC bit). Such a
        // write is durable before its reply.
        let op = Op::Write { fua: w.flags as i32 & libc::O_DSYNC != 0 };
        let errno = match vdisk_engine::validate(op, w.offset, w.size as u64, &self.bounds()) {
            Ok(()) => return Action::Submit(Request::new(op, w.offset, w.size as u64, h.unique)),
            Err(Refusal::ReadOnly) => libc::EROFS,
            // The file is a disk: it cannot grow.
            Err(Refusal::OutOfRange) => libc::ENOSPC,
            Err(Refusal::TooLong | Refusal::Misaligned) => libc::EINVAL,
            // Nothing to write: done.
            Err(Refusal::Empty) => return Action::Reply(0, proto::WriteOut::default().bytes().to_vec()),
        };
        Action::Reply(errno, Vec::new())
    }

    fn lseek(&self, h: &proto::InHeader, l: &proto::LseekIn) -> Action {
        match l.whence as i32 {
            libc::SEEK_DATA | libc::SEEK_HOLE => {
                let op = Op::BlockStatus { max: 256 };
                let len = self.size().saturating_sub(l.offset);
                if vdisk_engine::validate(op, l.offset, len, &self.bounds()).is_err() {
                    // At or past the end there is neither data nor a hole (lseek(2)).
                    return Action::Reply(libc::ENXIO, Vec::new());
                }
                self.seeks.lock().unwrap().insert(h.unique, l.whence as i32 == libc::SEEK_HOLE);
                Action::Submit(Request::new(op, l.offset, len, h.unique))
            }
            // SEEK_SET/CUR/END never reach the file system.
            _ => Action::Reply(libc::EINVAL, Vec::new()),
        }
    }

    fn fallocate(&self, h: &proto::InHeader, f: &proto::FallocateIn) -> Action {
        use proto::{FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH, FALLOC_FL_ZERO_RANGE as ZERO};
        let size = self.size();
        let end = f.offset.saturating_add(f.length);
        let op = match f.mode {
            m if m == PUNCH | KEEP => Op::Trim { fua: false },
            // ZERO_RANGE keeps the blocks allocated; a punch frees them.
            m if m == ZERO || m == ZERO | KEEP => Op::WriteZeroes { fua: false, no_hole: true, fast_zero: false },
            0 | KEEP => {
                // Plain allocation: a disk's blocks are all there already.
                let errno = if end > size && f.mode == 0 { libc::EFBIG } else { 0 };
                return Action::Reply(errno, Vec::new());
            }
            _ => return Action::Reply(libc::EOPNOTSUPP, Vec::new()),
        };
        let len = match vdisk_engine::validate(op, f.offset, f.length, &self.bounds()) {
            Ok(()) => f.length,
            Err(Refusal::ReadOnly) => return Action::Reply(libc::EROFS, Vec::new()),
            // Past the end: the file cannot grow; with KEEP_SIZE, what lies inside is done.
            Err(Refusal::OutOfRange) if f.mode & KEEP == 0 => return Action::Reply(libc::EFBIG, Vec::new()),
            Err(Refusal::OutOfRange) => end.min(size).saturating_sub(f.offset),
            Err(Refusal::TooLong | Refusal::Misaligned | Refusal::Empty) => 0,
        };
        if len == 0 {
            return Action::Reply(0, Vec::new());
        }
        Action::Submit(Request::new(op, f.offset, len, h.unique))
    }

    /// The reply of a request the engine completed (the FUSE request
    /// `unique`): errno and body. For a READ the body is the request's own
    /// buffer (the transport sends it as it is).
    pub fn reply_of(&self, req: &Request, unique: u64) -> (i32, ReplyBody) {
        let op = req.op();
        let want_hole = match op {
            Op::BlockStatus { .. } => self.seeks.lock().unwrap().remove(&unique).unwrap_or(false),
            _ => false,
        };
        if let Some(e) = &req.error {
            self.device.errors().failed("fuse", req);
            return (e.errno(), ReplyBody::Empty);
        }
        match op {
            Op::Read => (0, ReplyBody::Data),
            Op::Write { .. } => {
                (0, ReplyBody::Out(proto::WriteOut { size: req.len as u32, padding: 0 }.bytes().try_into().unwrap()))
            }
            Op::BlockStatus { .. } => match seek(req, want_hole) {
                Ok(offset) => (0, ReplyBody::Out(proto::LseekOut { offset }.bytes().try_into().unwrap())),
                Err(errno) => (errno, ReplyBody::Empty),
            },
            _ => (0, ReplyBody::Empty),
        }
    }
}

/// SEEK_DATA / SEEK_HOLE from the allocation runs found at the offset. Past
/// the runs looked at, the rest counts as data: a hole may be reported as data,
/// never data as a hole (a sparse copy would lose it).
fn seek(req: &Request, want_hole: bool) -> Result<u64, i32> {
    let end = req.offset + req.len;
    let mut pos = req.offset;
    for run in req.runs() {
        if run.hole == want_hole {
            return Ok(pos);
        }
        pos += run.len;
    }
    match (want_hole, pos >= end) {
        (true, _) => Ok(end),
        (false, true) => Err(libc::ENXIO),
        (false, false) => Ok(pos),
    }
}

pub enum ReplyBody {
    Empty,
    /// The request's buffer.
    Data,
    /// A small fixed reply (`fuse_write_out`, `fuse_lseek_out`).
    Out([u8; 8]),
}

/// Builds the INIT reply and says whether the kernel agreed to the ring transport.
pub fn init_reply(init: &proto::InitIn, want_uring: bool) -> Result<proto::InitOut, String> {
    if init.major != proto::KERNEL_VERSION {
        return Err(format!("the kernel speaks FUSE {}.{}, vdisk speaks 7.x", init.major, init.minor));
    }
    let kernel =
        init.flags as u64 | if init.flags as u64 & proto::INIT_EXT != 0 { (init.flags2 as u64) << 32 } else { 0 };
    let mut want = proto::ASYNC_READ
        | proto::BIG_WRITES
        | proto::ASYNC_DIO
        | proto::PARALLEL_DIROPS
        | proto::MAX_PAGES
        | proto::DIRECT_IO_ALLOW_MMAP
        | proto::INIT_EXT;
    if want_uring {
        if kernel & proto::OVER_IO_URING == 0 {
            return Err("the kernel did not offer FUSE-over-io_uring in FUSE_INIT (needs Linux 6.14+ with \
                        CONFIG_FUSE_IO_URING, and echo Y > /sys/module/fuse/parameters/enable_uring (as root))"
                .into());
        }
        want |= proto::OVER_IO_URING;
    }
    let flags = want & kernel;
    Ok(proto::InitOut {
        major: proto::KERNEL_VERSION,
        minor: init.minor.min(proto::KERNEL_MINOR_VERSION),
        max_readahead: init.max_readahead,
        flags: flags as u32,
        flags2: (flags >> 32) as u32,
        max_background: 256,
        congestion_threshold: 192,
        max_write: MAX_IO as u32,
        time_gran: 1,
        max_pages: (MAX_IO / 4096) as u16,
        ..Default::default()
    })
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
