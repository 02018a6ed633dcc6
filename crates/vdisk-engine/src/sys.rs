//! Thin wrappers over the system calls the engine uses. Every unsafe call of
//! the engine lives here, each with the rule that makes it sound.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;

/// The most iovecs one vectored call takes (Linux's UIO_MAXIOV).
pub const IOV_MAX: usize = 1024;

/// A region of memory a vectored call reads into or writes from.
///
/// Holding a `Segment` is a promise made by the engine: the memory stays valid
/// and is touched by nobody else until the call that uses it returns.
#[derive(Clone, Copy)]
pub struct Segment {
    pub ptr: *mut u8,
    pub len: usize,
}

fn iovecs(segs: &[Segment]) -> Vec<libc::iovec> {
    segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect()
}

/// Drops the first `n` bytes from a list of iovecs (after a short transfer).
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    while skip < iov.len() && n >= iov[skip].iov_len {
        n -= iov[skip].iov_len;
        skip += 1;
    }
    iov.drain(..skip);
    if n > 0 {
        let first = &mut iov[0];
        // SAFETY: n < iov_len, so the new base stays inside the same buffer.
        first.iov_base = unsafe { first.iov_base.cast::<u8>().add(n) }.cast();
        first.iov_len -= n;
    }
}

/// Runs one vectored call (`call(iovecs, count, offset)`, returning bytes or
/// -1 with errno) until every byte of `segs` is done, retrying after EINTR and
/// short transfers. Returns the iovecs left when a call moved no bytes (end of
/// file), empty when all is done.
fn vectored_full(
    segs: &[Segment],
    mut offset: u64,
    mut call: impl FnMut(*const libc::iovec, i32, i64) -> isize,
) -> io::Result<Vec<libc::iovec>> {
    let mut iov = iovecs(segs);
    while !iov.is_empty() {
        let r = call(iov.as_ptr(), iov.len().min(IOV_MAX) as i32, offset as i64);
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            break;
        }
        advance(&mut iov, r as usize);
        offset += r as u64;
    }
    Ok(iov)
}

/// Reads the whole of `segs` from `offset`. The image maps reads only inside
/// its files, so reaching the end of a file means it shrank under us (a
/// backing file truncated while served): that is an error (EIO at the edge),
/// never zeros the disk did not hold.
pub fn preadv_full(file: &File, segs: &[Segment], offset: u64) -> io::Result<()> {
    // SAFETY: each iovec points at memory the caller's `Segment`s vouch for
    // (valid, exclusively ours until we return); the kernel writes at most iov_len bytes.
    let rest = vectored_full(segs, offset, |iov, n, at| unsafe { libc::preadv(file.as_raw_fd(), iov, n, at) })?;
    if !rest.is_empty() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ends before the image does (truncated?)"));
    }
    Ok(())
}

/// Writes the whole of `segs` at `offset`; with `dsync` each call is durable on return.
pub fn pwritev_full(file: &File, segs: &[Segment], offset: u64, dsync: bool) -> io::Result<()> {
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    // SAFETY: each iovec points at memory the caller's `Segment`s vouch for; the kernel only reads it.
    let rest =
        vectored_full(segs, offset, |iov, n, at| unsafe { libc::pwritev2(file.as_raw_fd(), iov, n, at, flags) })?;
    if !rest.is_empty() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "the file took no bytes"));
    }
    Ok(())
}

/// One `preadv2(RWF_NOWAIT)`: reads only what is already in the page cache.
/// Returns the bytes read (possibly fewer than asked); EAGAIN when it would block.
pub fn preadv_nowait(file: &File, segs: &[Segment], offset: u64) -> io::Result<usize> {
    let iov = iovecs(segs);
    // SAFETY: as in `preadv_full`: the segments vouch for the memory.
    let r = unsafe {
        libc::preadv2(file.as_raw_fd(), iov.as_ptr(), iov.len().min(IOV_MAX) as i32, offset as i64, libc::RWF_NOWAIT)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// True when the file lives in memory (tmpfs, ramfs, hugetlbfs): its I/O never
/// waits for a device.
pub fn in_memory(file: &File) -> bool {
    const TMPFS: i64 = 0x0102_1994;
    const RAMFS: i64 = 0x8584_58f6;
    const HUGETLBFS: i64 = 0x9584_58f6;
    // SAFETY: statfs is plain data; fstatfs fills it for a valid fd.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open and `st` is a valid out-pointer.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    matches!(st.f_type as i64, TMPFS | RAMFS | HUGETLBFS)
}

/// True when the file lives on a FUSE file system. There an *asynchronous*
/// O_DIRECT write (io_uring) loses its RWF_DSYNC on the way: the kernel sends
/// a plain WRITE and no FSYNC after it (see docs/design.md, "What the kernel
/// carries"), so such writes need an explicit fdatasync.
pub fn on_fuse(file: &File) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    // SAFETY: statfs is plain data; fstatfs fills it for a valid fd.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open and `st` is a valid out-pointer.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    st.f_type as i64 == FUSE_SUPER_MAGIC
}

pub fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    loop {
        // SAFETY: fallocate only reads its integer arguments.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub fn fdatasync(file: &File) -> io::Result<()> {
    file.sync_data()
}

pub fn readahead(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise only reads its integer arguments; it is a hint and its result is ignored.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), offset as i64, len as i64, libc::POSIX_FADV_WILLNEED) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_skips_whole_and_partial_iovecs() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 8];
        let segs = [Segment { ptr: a.as_mut_ptr(), len: 4 }, Segment { ptr: b.as_mut_ptr(), len: 8 }];
        let mut iov = iovecs(&segs);
        advance(&mut iov, 6);
        assert_eq!(iov.len(), 1);
        assert_eq!(iov[0].iov_len, 6);
        assert_eq!(iov[0].iov_base as usize, b.as_ptr() as usize + 2);
    }
}
