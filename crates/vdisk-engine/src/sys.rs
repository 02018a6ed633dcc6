//! Thin wrappers over the system calls the engine uses, each with the rule
//! that makes it sound. Those that take [`Segment`]s (raw memory) are
//! `unsafe fn`: the caller vouches for the memory. The other unsafe code of
//! the engine is the ring submission (`submit`, `uring`), the buffer pool
//! (`buf`) and lent memory (`lent`).

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;

use smallvec::SmallVec;

/// The most iovecs one vectored call takes (Linux's UIO_MAXIOV).
pub const IOV_MAX: usize = 1024;

/// A region of memory a vectored call reads into or writes from: an address
/// and a length, nothing more. Making one is safe; passing it to a call is
/// not (see the `# Safety` of each function that takes segments).
#[derive(Clone, Copy)]
pub struct Segment {
    pub ptr: *mut u8,
    pub len: usize,
}

/// The iovecs of `segs`; up to 8 need no allocation (a call of one request's data).
fn iovecs(segs: &[Segment]) -> SmallVec<[libc::iovec; 8]> {
    segs.iter().map(|s| libc::iovec { iov_base: s.ptr.cast(), iov_len: s.len }).collect()
}

/// A run's segments: one or a few without allocation, more on the heap.
pub type Segments = SmallVec<[Segment; 2]>;

/// The segments left after the first `n` bytes of `segs` (after a short transfer).
pub fn skip(segs: &[Segment], mut n: usize) -> Segments {
    let mut out = Segments::with_capacity(segs.len());
    for s in segs {
        if n >= s.len {
            n -= s.len;
            continue;
        }
        out.push(Segment { ptr: s.ptr.wrapping_add(n), len: s.len - n });
        n = 0;
    }
    out
}

/// Runs one vectored call (`call(iovecs, count, offset)`, returning bytes or
/// -1 with errno) until every byte of `segs` is done, retrying after EINTR and
/// short transfers. Returns the bytes left when a call moved none (end of
/// file), 0 when all is done. The iovecs are built once and advanced in
/// place: a call that does it all (the usual case) costs no more allocation.
fn vectored_full(
    segs: &[Segment],
    mut offset: u64,
    mut call: impl FnMut(*const libc::iovec, i32, i64) -> isize,
) -> io::Result<usize> {
    let mut iov = iovecs(segs);
    let mut first = 0;
    while first < iov.len() {
        let live = &iov[first..];
        let r = call(live.as_ptr(), live.len().min(IOV_MAX) as i32, offset as i64);
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
        offset += r as u64;
        let mut n = r as usize;
        while n > 0 && first < iov.len() {
            let v = &mut iov[first];
            if n < v.iov_len {
                v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
                v.iov_len -= n;
                break;
            }
            n -= v.iov_len;
            first += 1;
        }
    }
    Ok(iov[first..].iter().map(|v| v.iov_len).sum())
}

/// Reads the whole of `segs` from `offset`. The image maps reads only inside
/// its files, so reaching the end of a file means it shrank under us (a
/// backing file truncated while served): that is an error (EIO at the edge),
/// never zeros the disk did not hold.
///
/// # Safety
/// Every segment must be valid for writes of its length, and touched by
/// nothing else in this process, until this returns.
pub unsafe fn preadv_full(file: &File, segs: &[Segment], offset: u64) -> io::Result<()> {
    // SAFETY: each iovec points at memory the caller vouches for (above); the
    // kernel writes at most iov_len bytes.
    let rest = vectored_full(segs, offset, |iov, n, at| unsafe { libc::preadv(file.as_raw_fd(), iov, n, at) })?;
    if rest > 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ends before the image does (truncated?)"));
    }
    Ok(())
}

/// Writes the whole of `segs` at `offset`; with `dsync` each call is durable on return.
///
/// # Safety
/// Every segment must be valid for reads of its length until this returns.
pub unsafe fn pwritev_full(file: &File, segs: &[Segment], offset: u64, dsync: bool) -> io::Result<()> {
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    // SAFETY: each iovec points at memory the caller vouches for (above); the kernel only reads it.
    let rest =
        vectored_full(segs, offset, |iov, n, at| unsafe { libc::pwritev2(file.as_raw_fd(), iov, n, at, flags) })?;
    if rest > 0 {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "the file took no bytes"));
    }
    Ok(())
}

/// One `preadv2(RWF_NOWAIT)`: reads only what is already in the page cache.
/// Returns the bytes read (possibly fewer than asked); EAGAIN when it would block.
///
/// # Safety
/// As for [`preadv_full`].
pub unsafe fn preadv_nowait(file: &File, segs: &[Segment], offset: u64) -> io::Result<usize> {
    let iov = iovecs(segs);
    // SAFETY: the caller vouches for the memory (above).
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

/// True when the file lives on a FUSE file system. There `RWF_DSYNC` may
/// never reach the file system as an FSYNC: not after an *asynchronous*
/// O_DIRECT write (io_uring), and not after any write when the file system
/// answered the open with FOPEN_DIRECT_IO (see docs/design.md, "What the
/// kernel carries"), so durable writes need an explicit fdatasync.
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
    fn vectored_calls_resume_after_short_transfers() {
        let (mut a, mut b) = ([0u8; 4], [0u8; 8]);
        let segs = [Segment { ptr: a.as_mut_ptr(), len: 4 }, Segment { ptr: b.as_mut_ptr(), len: 8 }];
        // Each call moves at most 3 bytes: the iovecs it sees start where the last one stopped.
        let mut seen = Vec::new();
        let left = vectored_full(&segs, 100, |iov, n, at| {
            // SAFETY: `vectored_full` passes `n` live iovecs built from `segs`.
            let first = unsafe { *iov };
            seen.push((first.iov_base as usize, first.iov_len, n, at));
            (first.iov_len.min(3)) as isize
        })
        .unwrap();
        assert_eq!(left, 0);
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        let want = [(pa, 4, 2, 100), (pa + 3, 1, 2, 103), (pb, 8, 1, 104), (pb + 3, 5, 1, 107), (pb + 6, 2, 1, 110)];
        assert_eq!(seen, want);
        // A call that moves nothing (end of file) leaves the rest.
        let left = vectored_full(&segs, 0, |_, _, _| 0).unwrap();
        assert_eq!(left, 12);
    }

    #[test]
    fn skip_drops_whole_and_partial_segments() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 8];
        let segs = [Segment { ptr: a.as_mut_ptr(), len: 4 }, Segment { ptr: b.as_mut_ptr(), len: 8 }];
        let rest = skip(&segs, 6);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].len, 6);
        assert_eq!(rest[0].ptr as usize, b.as_ptr() as usize + 2);
        assert!(skip(&segs, 12).is_empty());
    }
}
