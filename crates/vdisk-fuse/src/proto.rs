//! The FUSE wire format: the structs of the kernel's uapi `fuse.h` this export
//! speaks, written out as `#[repr(C)]` types, and the opcodes and flags it uses.
//! Everything here is plain data; nothing does I/O.
//!
//! All structs are little more than integers laid out as the kernel lays them
//! out (64-bit aligned, explicit padding), so [`Wire`] can read them from and
//! write them to byte buffers.

/// Protocol version we speak: 7.x, answering with the lower of ours and the kernel's minor.
pub const KERNEL_VERSION: u32 = 7;
pub const KERNEL_MINOR_VERSION: u32 = 45;
/// Node id of the root inode, the one file of this file system.
pub const ROOT_ID: u64 = 1;

// Opcodes (enum fuse_opcode).
pub const LOOKUP: u32 = 1;
pub const FORGET: u32 = 2;
pub const GETATTR: u32 = 3;
pub const SETATTR: u32 = 4;
pub const OPEN: u32 = 14;
pub const READ: u32 = 15;
pub const WRITE: u32 = 16;
pub const STATFS: u32 = 17;
pub const RELEASE: u32 = 18;
pub const FSYNC: u32 = 20;
pub const FLUSH: u32 = 25;
pub const INIT: u32 = 26;
pub const INTERRUPT: u32 = 36;
pub const DESTROY: u32 = 38;
pub const BATCH_FORGET: u32 = 42;
pub const FALLOCATE: u32 = 43;
pub const LSEEK: u32 = 46;

// INIT flags (the upper 32 travel in `flags2`, with INIT_EXT set).
pub const ASYNC_READ: u64 = 1 << 0;
pub const BIG_WRITES: u64 = 1 << 5;
pub const ASYNC_DIO: u64 = 1 << 15;
pub const PARALLEL_DIROPS: u64 = 1 << 18;
pub const MAX_PAGES: u64 = 1 << 22;
pub const INIT_EXT: u64 = 1 << 30;
/// Shared mmap of a FOPEN_DIRECT_IO file (Linux 6.6+): the kernel keeps the
/// page cache coherent with the direct I/O around it.
pub const DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
pub const OVER_IO_URING: u64 = 1 << 41;

// OPEN reply flags.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

// SETATTR `valid` bits.
pub const FATTR_SIZE: u32 = 1 << 3;

// FALLOCATE modes (linux/falloc.h).
pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// `_IOR(229, 0, uint32_t)`: a new /dev/fuse fd joins an existing session.
pub const DEV_IOC_CLONE: u64 = (2 << 30) | (4 << 16) | (229 << 8);

/// Types that are the kernel's structs byte for byte: integers only, no
/// padding the compiler chose (every gap is a named field).
///
/// # Safety
/// Implement only for `#[repr(C)]` structs of integer fields (and arrays of
/// them) without implicit padding: every bit pattern is then a valid value.
pub unsafe trait Wire: Copy + Sized {
    /// Reads the struct from the start of `b`; `None` if `b` is too short.
    fn read(b: &[u8]) -> Option<Self> {
        if b.len() < size_of::<Self>() {
            return None;
        }
        // SAFETY: `b` holds at least size_of::<Self>() bytes, the read is
        // unaligned-safe, and every bit pattern is a valid Self (trait contract).
        Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<Self>()) })
    }

    /// The struct's bytes.
    fn bytes(&self) -> &[u8] {
        // SAFETY: Self has no implicit padding (trait contract), so all
        // size_of::<Self>() bytes behind the reference are initialised.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), size_of::<Self>()) }
    }
}

macro_rules! wire {
    ($($name:ident = $size:expr;)*) => {
        $(
            // SAFETY: a #[repr(C)] struct of integers whose size is asserted
            // below to be the sum of its fields (no implicit padding).
            unsafe impl Wire for $name {}
            const _: () = assert!(size_of::<$name>() == $size);
        )*
    };
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub flags2: u32,
    pub unused: [u32; 11],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    pub map_alignment: u16,
    pub flags2: u32,
    pub max_stack_depth: u32,
    pub request_timeout: u16,
    pub unused: [u16; 11],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: Attr,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: Attr,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SetattrIn {
    pub valid: u32,
    pub padding: u32,
    pub fh: u64,
    pub size: u64,
    pub lock_owner: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub unused4: u32,
    pub uid: u32,
    pub gid: u32,
    pub unused5: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}

/// READ and WRITE share this layout (`fuse_read_in`, `fuse_write_in`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RwIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub rw_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteOut {
    pub size: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Kstatfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LseekIn {
    pub fh: u64,
    pub offset: u64,
    pub whence: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LseekOut {
    pub offset: u64,
}

wire! {
    InHeader = 40;
    OutHeader = 16;
    InitIn = 64;
    InitOut = 64;
    Attr = 88;
    AttrOut = 104;
    EntryOut = 128;
    SetattrIn = 88;
    OpenIn = 8;
    OpenOut = 16;
    RwIn = 40;
    WriteOut = 8;
    FallocateIn = 32;
    Kstatfs = 80;
    LseekIn = 24;
    LseekOut = 8;
}

/// Bytes of the header a WRITE request carries before its data on /dev/fuse.
pub const WRITE_HEADER: usize = size_of::<InHeader>() + size_of::<RwIn>();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_read_back_what_they_write() {
        let h = InHeader { len: 80, opcode: WRITE, unique: 7, nodeid: ROOT_ID, ..Default::default() };
        let back = InHeader::read(h.bytes()).unwrap();
        assert_eq!((back.len, back.opcode, back.unique, back.nodeid), (80, WRITE, 7, 1));
        assert!(InHeader::read(&h.bytes()[..39]).is_none());
        assert_eq!(std::mem::offset_of!(InitOut, max_pages), 28);
        assert_eq!(std::mem::offset_of!(InitOut, flags2), 32);
        assert_eq!(std::mem::offset_of!(AttrOut, attr), 16);
        assert_eq!(DEV_IOC_CLONE, 0x8004_e500);
    }
}
