//! [`Session::dispatch`] and [`Session::reply_of`] as the pure functions they
//! are: every opcode the file system handles, arguments too short, sizes too
//! big, a read-only device, offsets at and past the end, and opcodes it does
//! not know, each against the action or errno it must give. Nothing is
//! mounted; the device (a raw file, one worker) is only there for its size
//! and read-only state, and no request is submitted to it.

use std::sync::Arc;

use vdisk_engine::{Command, Device, EngineConfig, EngineKind, Op, Request};
use vdisk_image::{Allocation, Error, ErrorKind, Image, RawImage};

use super::{Action, ReplyBody, Session, MAX_IO};
use crate::proto::{self, Wire};

const SIZE: u64 = 1 << 20;

struct Rig {
    session: Session,
    dir: std::path::PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.session.device.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A session over a device of [`SIZE`] bytes on a raw file.
fn rig(tag: &str, read_only: bool) -> Rig {
    let dir = std::env::temp_dir().join(format!("vdisk-fuse-dispatch-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    let _ = std::fs::remove_file(&path);
    RawImage::create(&path, SIZE, None).unwrap();
    let image: Arc<dyn Image> = Arc::new(RawImage::open(&path, read_only).unwrap());
    let config = EngineConfig { kind: EngineKind::Threads, workers: 1, ..EngineConfig::default() };
    let device = Arc::new(Device::start(tag, image, &config).unwrap());
    Rig { session: Session::new(device), dir }
}

fn header(opcode: u32, unique: u64) -> proto::InHeader {
    proto::InHeader { opcode, unique, nodeid: proto::ROOT_ID, ..Default::default() }
}

impl Rig {
    fn dispatch(&self, opcode: u32, arg: &[u8]) -> Action {
        self.session.dispatch(&header(opcode, 42), arg)
    }

    /// The errno and body of an immediate reply; panics on anything else.
    fn reply(&self, opcode: u32, arg: &[u8]) -> (i32, Vec<u8>) {
        match self.dispatch(opcode, arg) {
            Action::Reply(errno, body) => (errno, body),
            Action::Submit(r) => panic!("opcode {opcode}: submitted {r:?}, wanted a reply"),
            Action::Nothing => panic!("opcode {opcode}: no answer, wanted a reply"),
        }
    }

    fn errno(&self, opcode: u32, arg: &[u8]) -> i32 {
        self.reply(opcode, arg).0
    }

    /// The request handed to the engine; panics on anything else.
    fn submit(&self, opcode: u32, arg: &[u8]) -> Request {
        match self.dispatch(opcode, arg) {
            Action::Submit(r) => {
                assert_eq!(r.tag, 42, "the request carries the FUSE unique");
                r
            }
            Action::Reply(errno, body) => {
                panic!("opcode {opcode}: replied {errno} ({} bytes), wanted a submit", body.len())
            }
            Action::Nothing => panic!("opcode {opcode}: no answer, wanted a submit"),
        }
    }
}

fn rw(offset: u64, size: u32, flags: u32) -> Vec<u8> {
    proto::RwIn { offset, size, flags, ..Default::default() }.bytes().to_vec()
}

fn falloc(offset: u64, length: u64, mode: u32) -> Vec<u8> {
    proto::FallocateIn { offset, length, mode, ..Default::default() }.bytes().to_vec()
}

fn lseek(offset: u64, whence: i32) -> Vec<u8> {
    proto::LseekIn { offset, whence: whence as u32, ..Default::default() }.bytes().to_vec()
}

fn open(flags: i32) -> Vec<u8> {
    proto::OpenIn { flags: flags as u32, open_flags: 0 }.bytes().to_vec()
}

fn setattr(valid: u32, size: u64) -> Vec<u8> {
    proto::SetattrIn { valid, size, ..Default::default() }.bytes().to_vec()
}

fn attr_of(body: &[u8]) -> proto::Attr {
    proto::AttrOut::read(body).expect("an attr_out body").attr
}

#[test]
fn forget_and_interrupt_get_no_answer() {
    let r = rig("noanswer", false);
    for op in [proto::FORGET, proto::BATCH_FORGET, proto::INTERRUPT] {
        assert!(matches!(r.dispatch(op, &[]), Action::Nothing), "opcode {op}");
    }
}

#[test]
fn attributes_describe_one_file_the_size_of_the_device() {
    let (rw_, ro) = (rig("attr-rw", false), rig("attr-ro", true));
    let (errno, body) = rw_.reply(proto::GETATTR, &[]);
    let a = attr_of(&body);
    assert_eq!((errno, a.ino, a.size, a.blocks, a.nlink), (0, proto::ROOT_ID, SIZE, SIZE / 512, 1));
    assert_eq!(a.mode, libc::S_IFREG | 0o644);
    assert_eq!(attr_of(&ro.reply(proto::GETATTR, &[]).1).mode, libc::S_IFREG | 0o444, "read-only: no write bits");

    // SETATTR: only a size change is refused (the file is a disk).
    assert_eq!(rw_.errno(proto::SETATTR, &setattr(proto::FATTR_SIZE, SIZE + 4096)), libc::EPERM);
    assert_eq!(rw_.errno(proto::SETATTR, &setattr(proto::FATTR_SIZE, 0)), libc::EPERM, "truncation");
    let (errno, body) = rw_.reply(proto::SETATTR, &setattr(proto::FATTR_SIZE, SIZE));
    assert_eq!((errno, attr_of(&body).size), (0, SIZE), "the same size is no change");
    assert_eq!(rw_.errno(proto::SETATTR, &setattr(0, 12345)), 0, "a size without FATTR_SIZE is ignored");
    assert_eq!(rw_.errno(proto::SETATTR, &[0; 8]), libc::EINVAL, "an argument too short");

    assert_eq!(rw_.errno(proto::LOOKUP, b"name\0"), libc::ENOENT, "there is nothing but the file");
    let (errno, body) = rw_.reply(proto::STATFS, &[]);
    let st = proto::Kstatfs::read(&body).unwrap();
    assert_eq!((errno, st.blocks, st.bsize, st.files), (0, SIZE / 4096, 4096, 1));
    for op in [proto::RELEASE, proto::DESTROY] {
        assert_eq!(rw_.reply(op, &[]), (0, Vec::new()), "opcode {op}");
    }
}

#[test]
fn open_refuses_writing_a_read_only_device() {
    let (rw_, ro) = (rig("open-rw", false), rig("open-ro", true));
    let (errno, body) = rw_.reply(proto::OPEN, &open(libc::O_RDWR));
    let out = proto::OpenOut::read(&body).unwrap();
    assert_eq!(errno, 0);
    assert_eq!(out.open_flags, proto::FOPEN_DIRECT_IO | proto::FOPEN_PARALLEL_DIRECT_WRITES);
    assert_eq!(ro.errno(proto::OPEN, &open(libc::O_RDONLY)), 0);
    assert_eq!(ro.errno(proto::OPEN, &open(libc::O_RDWR)), libc::EROFS);
    assert_eq!(ro.errno(proto::OPEN, &open(libc::O_WRONLY)), libc::EROFS);
    assert_eq!(rw_.errno(proto::OPEN, &[0; 4]), libc::EINVAL, "an argument too short");
}

#[test]
fn reads_inside_the_file_go_to_the_engine_and_past_the_end_are_short() {
    let r = rig("read", false);
    let req = r.submit(proto::READ, &rw(4096, 8192, 0));
    assert_eq!((req.op(), req.offset, req.len), (Op::Read, 4096, 8192));
    let req = r.submit(proto::READ, &rw(0, MAX_IO as u32, 0));
    assert_eq!(req.len, MAX_IO as u64, "the largest read negotiated");
    // Across the end: short, up to the end.
    let req = r.submit(proto::READ, &rw(SIZE - 512, 4096, 0));
    assert_eq!((req.offset, req.len), (SIZE - 512, 512));
    // At or past the end, or of nothing: an empty reply (end of file), not an error.
    for (offset, size) in [(SIZE, 4096), (SIZE + 1, 1), (u64::MAX, 4096), (u64::MAX - 10, 100), (0, 0)] {
        assert_eq!(r.reply(proto::READ, &rw(offset, size, 0)), (0, Vec::new()), "read {size} at {offset}");
    }
    assert_eq!(r.errno(proto::READ, &rw(0, MAX_IO as u32 + 4096, 0)), libc::EINVAL, "longer than negotiated");
    assert_eq!(r.errno(proto::READ, &[0; 16]), libc::EINVAL, "an argument too short");
    // A read-only device reads.
    let ro = rig("read-ro", true);
    assert_eq!(ro.submit(proto::READ, &rw(0, 4096, 0)).len, 4096);
}

#[test]
fn writes_are_checked_against_the_end_and_read_only() {
    let r = rig("write", false);
    let req = r.submit(proto::WRITE, &rw(8192, 4096, 0));
    assert_eq!((req.op(), req.offset, req.len), (Op::Write { fua: false }, 8192, 4096));
    assert!(req.buf().is_empty(), "the transport puts the data in");
    assert_eq!(r.submit(proto::WRITE, &rw(SIZE - 4096, 4096, 0)).offset, SIZE - 4096, "up to the very end");
    // O_DSYNC (and O_SYNC, which includes it) travel only here: the write is durable.
    assert_eq!(r.submit(proto::WRITE, &rw(0, 512, libc::O_DSYNC as u32)).op(), Op::Write { fua: true });
    assert_eq!(r.submit(proto::WRITE, &rw(0, 512, libc::O_SYNC as u32)).op(), Op::Write { fua: true });
    // The file cannot grow.
    for (offset, size) in [(SIZE - 512, 1024), (SIZE, 1), (SIZE + 4096, 0), (u64::MAX, 4096), (u64::MAX - 10, 100)] {
        assert_eq!(r.errno(proto::WRITE, &rw(offset, size, 0)), libc::ENOSPC, "write {size} at {offset}");
    }
    // Nothing to write: done at once, with a write_out of 0 bytes.
    let (errno, body) = r.reply(proto::WRITE, &rw(SIZE, 0, 0));
    assert_eq!((errno, proto::WriteOut::read(&body).map(|w| w.size)), (0, Some(0)));
    assert_eq!(r.errno(proto::WRITE, &rw(0, MAX_IO as u32 + 1, 0)), libc::EINVAL, "longer than negotiated");
    assert_eq!(r.errno(proto::WRITE, &[0; 39]), libc::EINVAL, "an argument too short");
    let ro = rig("write-ro", true);
    for (offset, size) in [(0, 4096), (SIZE, 4096), (0, 0)] {
        assert_eq!(ro.errno(proto::WRITE, &rw(offset, size, 0)), libc::EROFS, "read-only first: {size} at {offset}");
    }
}

#[test]
fn flush_and_fsync_go_to_the_engine_unless_read_only() {
    let (r, ro) = (rig("flush", false), rig("flush-ro", true));
    for op in [proto::FLUSH, proto::FSYNC] {
        let req = r.submit(op, &[0; 24]);
        assert_eq!((req.op(), req.offset, req.len), (Op::Flush, 0, 0), "opcode {op}");
        assert_eq!(ro.reply(op, &[0; 24]), (0, Vec::new()), "opcode {op}: nothing to make durable");
    }
}

#[test]
fn fallocate_maps_punch_and_zero_and_refuses_the_rest() {
    use proto::{FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH, FALLOC_FL_ZERO_RANGE as ZERO};
    let r = rig("falloc", false);
    let req = r.submit(proto::FALLOCATE, &falloc(4096, 8192, PUNCH | KEEP));
    assert_eq!((req.op(), req.offset, req.len), (Op::Trim { fua: false }, 4096, 8192));
    let zero = Op::WriteZeroes { fua: false, no_hole: true, fast_zero: false };
    for mode in [ZERO, ZERO | KEEP] {
        let req = r.submit(proto::FALLOCATE, &falloc(0, 4096, mode));
        assert_eq!((req.op(), req.offset, req.len), (zero, 0, 4096), "mode {mode:#x}");
    }
    // Past the end: with KEEP_SIZE, what lies inside; without, the file cannot grow.
    let req = r.submit(proto::FALLOCATE, &falloc(SIZE - 4096, 65536, PUNCH | KEEP));
    assert_eq!((req.offset, req.len), (SIZE - 4096, 4096));
    assert_eq!(r.reply(proto::FALLOCATE, &falloc(SIZE + 4096, 4096, PUNCH | KEEP)), (0, Vec::new()));
    assert_eq!(r.reply(proto::FALLOCATE, &falloc(u64::MAX, 4096, ZERO | KEEP)), (0, Vec::new()));
    assert_eq!(r.errno(proto::FALLOCATE, &falloc(SIZE - 4096, 65536, ZERO)), libc::EFBIG);
    assert_eq!(r.errno(proto::FALLOCATE, &falloc(1, u64::MAX, ZERO)), libc::EFBIG, "an overflowing range");
    assert_eq!(r.reply(proto::FALLOCATE, &falloc(0, 0, ZERO)), (0, Vec::new()), "an empty range");
    // Plain allocation: every block of a disk is there already.
    assert_eq!(r.errno(proto::FALLOCATE, &falloc(0, SIZE, 0)), 0);
    assert_eq!(r.errno(proto::FALLOCATE, &falloc(0, SIZE + 1, KEEP)), 0);
    assert_eq!(r.errno(proto::FALLOCATE, &falloc(0, SIZE + 1, 0)), libc::EFBIG);
    // Modes it does not do: collapse, insert, unshare, punch without KEEP_SIZE.
    for mode in [0x08, 0x20, 0x40, PUNCH] {
        assert_eq!(r.errno(proto::FALLOCATE, &falloc(0, 4096, mode)), libc::EOPNOTSUPP, "mode {mode:#x}");
    }
    assert_eq!(r.errno(proto::FALLOCATE, &[0; 31]), libc::EINVAL, "an argument too short");
    let ro = rig("falloc-ro", true);
    for mode in [PUNCH | KEEP, ZERO, ZERO | KEEP] {
        assert_eq!(ro.errno(proto::FALLOCATE, &falloc(0, 4096, mode)), libc::EROFS, "mode {mode:#x}");
        assert_eq!(ro.errno(proto::FALLOCATE, &falloc(SIZE * 2, 4096, mode)), libc::EROFS, "read-only first");
    }
    assert_eq!(ro.errno(proto::FALLOCATE, &falloc(0, 4096, KEEP)), 0, "allocating writes nothing");
}

#[test]
fn lseek_data_and_hole_ask_the_engine_for_allocation() {
    let r = rig("lseek", false);
    for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
        let req = r.submit(proto::LSEEK, &lseek(4096, whence));
        assert!(matches!(req.op(), Op::BlockStatus { .. }), "whence {whence}");
        assert_eq!((req.offset, req.len), (4096, SIZE - 4096), "whence {whence}: to the end");
        for offset in [SIZE, SIZE + 1, u64::MAX] {
            assert_eq!(r.errno(proto::LSEEK, &lseek(offset, whence)), libc::ENXIO, "whence {whence} at {offset}");
        }
    }
    for whence in [libc::SEEK_SET, libc::SEEK_CUR, libc::SEEK_END, 99] {
        assert_eq!(r.errno(proto::LSEEK, &lseek(0, whence)), libc::EINVAL, "whence {whence}");
    }
    assert_eq!(r.errno(proto::LSEEK, &[0; 8]), libc::EINVAL, "an argument too short");
}

#[test]
fn opcodes_it_does_not_know_are_enosys() {
    let r = rig("unknown", false);
    // MKNOD, MKDIR, UNLINK, RENAME, LINK, SETXATTR, GETXATTR, OPENDIR, READDIR, CREATE, IOCTL, POLL, COPY_FILE_RANGE, ...
    for op in [8, 9, 10, 12, 13, 21, 22, 27, 28, 35, 39, 40, 47, 4096, u32::MAX] {
        assert_eq!(r.reply(op, &[0; 64]), (libc::ENOSYS, Vec::new()), "opcode {op}");
    }
}

/// The reply of a completed request: an error's errno; a write's count; a
/// seek's offset from the runs the engine found.
#[test]
fn replies_of_completed_requests() {
    let r = rig("replies", false);
    let s = &r.session;
    let done = |op: Op, offset: u64, len: u64| Request::new(op, offset, len, 7);
    let mut failed = done(Op::Read, 0, 4096);
    failed.error = Some(Error::new(ErrorKind::Io, "the disk failed"));
    assert!(matches!(s.reply_of(&failed, 7), (libc::EIO, ReplyBody::Empty)));
    failed.error = Some(Error::new(ErrorKind::ReadOnly, "read-only"));
    assert!(matches!(s.reply_of(&failed, 7), (libc::EPERM, ReplyBody::Empty)));
    assert!(matches!(s.reply_of(&done(Op::Read, 0, 4096), 7), (0, ReplyBody::Data)));
    match s.reply_of(&done(Op::WRITE, 0, 12288), 7) {
        (0, ReplyBody::Out(b)) => assert_eq!(proto::WriteOut::read(&b).unwrap().size, 12288),
        (errno, _) => panic!("a write's reply: errno {errno}"),
    }
    assert!(matches!(s.reply_of(&done(Op::Flush, 0, 0), 7), (0, ReplyBody::Empty)));

    // LSEEK: the session remembers which whence each unique asked for.
    let run = |len, hole| Allocation { len, hole, zero: hole, depth: 1 };
    let seek = |unique: u64, whence: i32, offset: u64, runs: Vec<Allocation>| {
        let Action::Submit(mut req) = s.dispatch(&header(proto::LSEEK, unique), &lseek(offset, whence)) else {
            panic!("LSEEK at {offset} was not submitted");
        };
        if let Command::BlockStatus { runs: found, .. } = &mut req.cmd {
            *found = runs;
        }
        match s.reply_of(&req, unique) {
            (0, ReplyBody::Out(b)) => Ok(proto::LseekOut::read(&b).unwrap().offset),
            (errno, _) => Err(errno),
        }
    };
    let (data, hole) = (libc::SEEK_DATA, libc::SEEK_HOLE);
    assert_eq!(seek(1, data, 0, vec![run(8192, true), run(4096, false)]), Ok(8192));
    assert_eq!(seek(2, hole, 0, vec![run(8192, false), run(4096, true)]), Ok(8192));
    assert_eq!(seek(3, hole, 4096, vec![run(SIZE - 4096, false)]), Ok(SIZE), "no hole: the end of the file");
    assert_eq!(seek(4, data, 4096, vec![run(SIZE - 4096, true)]), Err(libc::ENXIO), "only holes to the end");
    assert_eq!(seek(5, data, 0, vec![run(4096, true)]), Ok(4096), "past the runs looked at counts as data");
}

/// INIT (answered by the transports, before any dispatch): the version, the
/// flags both sides have, and the ring only when the kernel offers it.
#[test]
fn init_takes_the_flags_both_sides_have() {
    use super::init_reply;
    let init = |major, minor, flags: u64| proto::InitIn {
        major,
        minor,
        max_readahead: 1 << 17,
        flags: flags as u32,
        flags2: (flags >> 32) as u32,
        ..Default::default()
    };
    let kernel = proto::ASYNC_READ | proto::BIG_WRITES | proto::INIT_EXT | proto::OVER_IO_URING | (1 << 3);
    let out = init_reply(&init(7, 99, kernel), false).unwrap();
    let flags = out.flags as u64 | (out.flags2 as u64) << 32;
    assert_eq!(flags, proto::ASYNC_READ | proto::BIG_WRITES | proto::INIT_EXT, "ours and the kernel's only");
    assert_eq!((out.major, out.minor, out.max_readahead), (7, proto::KERNEL_MINOR_VERSION, 1 << 17));
    assert_eq!((out.max_write, out.max_pages as usize), (MAX_IO as u32, MAX_IO / 4096));
    assert_eq!(init_reply(&init(7, 31, kernel), false).unwrap().minor, 31, "the lower minor");
    let ring = init_reply(&init(7, 45, kernel), true).unwrap();
    assert_ne!((ring.flags2 as u64) << 32 & proto::OVER_IO_URING, 0, "the ring, offered and wanted");
    assert!(init_reply(&init(7, 45, kernel & !proto::OVER_IO_URING), true).is_err(), "the ring, not offered");
    // Without INIT_EXT the kernel's flags2 mean nothing.
    let old = init_reply(&init(7, 45, (proto::ASYNC_READ | proto::OVER_IO_URING) & !proto::INIT_EXT), false).unwrap();
    assert_eq!((old.flags as u64, old.flags2), (proto::ASYNC_READ, 0));
    assert!(init_reply(&init(8, 0, kernel), false).is_err(), "another major version");
}
