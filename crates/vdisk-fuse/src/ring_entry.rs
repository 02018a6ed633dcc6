//! The FUSE-over-io_uring entry layout (uapi `fuse.h`, `fuse-io-uring.rst`)
//! and the only place that builds its SQEs.
//!
//! An entry is two buffers the kernel keeps pointers to from REGISTER until
//! the connection ends: a 288-byte header (in/out header, the opcode's fixed
//! argument, and the entry info with `commit_id` and `payload_sz`) and a
//! payload buffer of at least max_write bytes. The commands travel in SQE128
//! entries whose 80-byte command area holds a [`CmdReq`].

use std::os::fd::RawFd;

use io_uring::squeue::Entry128;

pub const IN_OUT_HEADER_SZ: usize = 128;
pub const OP_IN_OUT_SZ: usize = 128;

/// `enum fuse_uring_cmd`.
pub const CMD_REGISTER: u32 = 1;
pub const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EntInOut {
    pub flags: u64,
    /// Echoed back in the COMMIT_AND_FETCH of this entry.
    pub commit_id: u64,
    /// Bytes of the payload buffer in use, in either direction.
    pub payload_sz: u32,
    pub padding: u32,
    pub reserved: u64,
}

/// `struct fuse_uring_req_header`: an entry's header buffer.
#[repr(C, align(8))]
pub struct Header {
    /// `fuse_in_header` from the kernel, `fuse_out_header` back.
    pub in_out: [u8; IN_OUT_HEADER_SZ],
    /// The opcode's fixed argument (e.g. `fuse_read_in`).
    pub op_in: [u8; OP_IN_OUT_SZ],
    pub ent: EntInOut,
}

const _: () = assert!(size_of::<Header>() == 288);

impl Header {
    pub fn new() -> Header {
        Header { in_out: [0; IN_OUT_HEADER_SZ], op_in: [0; OP_IN_OUT_SZ], ent: EntInOut::default() }
    }
}

/// `struct fuse_uring_cmd_req`, the start of the SQE's 80-byte command area.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CmdReq {
    flags: u64,
    commit_id: u64,
    qid: u16,
    padding: [u8; 6],
}

/// A 128-byte SQE as the kernel lays out an IORING_OP_URING_CMD
/// (`struct io_uring_sqe` with the big command area).
#[repr(C)]
struct Sqe128 {
    opcode: u8,
    flags: u8,
    ioprio: u16,
    fd: i32,
    cmd_op: u32,
    pad1: u32,
    addr: u64,
    len: u32,
    uring_cmd_flags: u32,
    user_data: u64,
    buf_index: u16,
    personality: u16,
    file_index: u32,
    cmd: CmdReq,
    cmd_rest: [u8; 80 - size_of::<CmdReq>()],
}

const _: () = assert!(size_of::<Sqe128>() == 128 && size_of::<Entry128>() == 128);
const _: () = assert!(std::mem::offset_of!(Sqe128, len) == 24 && std::mem::offset_of!(Sqe128, cmd) == 48);

fn build(fd: RawFd, cmd_op: u32, addr: u64, len: u32, cmd: CmdReq, user_data: u64) -> Entry128 {
    let sqe = Sqe128 {
        opcode: io_uring::opcode::UringCmd80::CODE,
        flags: 0,
        ioprio: 0,
        fd,
        cmd_op,
        pad1: 0,
        addr,
        len,
        uring_cmd_flags: 0,
        user_data,
        buf_index: 0,
        personality: 0,
        file_index: 0,
        cmd,
        cmd_rest: [0; 80 - size_of::<CmdReq>()],
    };
    // SAFETY: Entry128 is #[repr(C)] around the kernel's 128-byte SQE (a
    // 64-byte io_uring_sqe then the rest of the command area), every bit
    // pattern of which is a valid value; Sqe128 is that same layout (sizes and
    // offsets asserted above) with every byte initialised.
    unsafe { std::mem::transmute::<Sqe128, Entry128>(sqe) }
}

/// REGISTER an entry on queue `qid`: `iovs` points at two iovecs (header,
/// payload) that must stay valid until the command is issued; the kernel
/// insists on `len` = 2. The CQE arrives when a request is in the entry.
pub fn register(fd: RawFd, qid: u16, iovs: *const libc::iovec, user_data: u64) -> Entry128 {
    build(fd, CMD_REGISTER, iovs as u64, 2, CmdReq { qid, ..Default::default() }, user_data)
}

/// COMMIT_AND_FETCH: the reply is in the entry's buffers; take the next request.
pub fn commit_and_fetch(fd: RawFd, qid: u16, commit_id: u64, user_data: u64) -> Entry128 {
    build(fd, CMD_COMMIT_AND_FETCH, 0, 0, CmdReq { qid, commit_id, ..Default::default() }, user_data)
}
