//! The one way a thread sleeping in `io_uring_enter` is woken from outside:
//! an eventfd the ring keeps a read armed on. The engine's ring workers and the
//! FUSE ring queues both use it, and the vhost-user-blk ring workers wait on
//! it beside their kick eventfd (epoll), draining it with [`EventFd::drain`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// An eventfd counter.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; it returns a new fd or -1 (checked).
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh, valid descriptor owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter: a read armed on it completes.
    pub fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own; a failure
        // (the counter saturated) still leaves it readable, which is all we need.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter, after a wait (epoll) said it was readable; never
    /// blocks then. Returns false if nothing was there to read.
    pub fn drain(&self) -> bool {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own.
        let got = unsafe { libc::read(self.0.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        got == 8
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
