//! The mount point: preparing the file PATH (creating it, clearing a stale
//! mount a killed server left behind), mount(2) of a "fuse.vdisk" file system
//! whose root is a regular file, lazy unmount, and the /dev/fuse descriptors
//! (the session's and its clones).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, ErrorKind};
use crate::proto;

fn cstr(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// What [`prepare`] found at PATH.
pub struct Prepared {
    /// vdisk made the file (and removes it at exit).
    pub created: bool,
    /// A stale FUSE mount was there and has been unmounted.
    pub was_stale: bool,
}

/// Makes PATH a regular file to mount on: clears a stale FUSE mount (its
/// server gone: stat fails with ENOTCONN), creates the file if missing.
pub fn prepare(path: &Path) -> Result<Prepared, Error> {
    let file = |m: String| Error::new(ErrorKind::File, m);
    let mut was_stale = false;
    match std::fs::metadata(path) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            detach(path).map_err(|e| {
                let (p, q) = (path.display(), path.display());
                Error::other(format!("{p} is a stale FUSE mount and cannot be unmounted (try: umount -l {q})"))
                    .because(e)
            })?;
            was_stale = true;
        }
        _ => {}
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            Err(file(format!("{}: is a directory; the disk is exported as a file, give a file path", path.display())))
        }
        Ok(_) => Ok(Prepared { created: false, was_stale }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
                file(format!("{}: cannot create the file (does its directory exist?)", path.display())).because(e)
            })?;
            Ok(Prepared { created: true, was_stale })
        }
        Err(e) => Err(file(path.display().to_string()).because(e)),
    }
}

/// Opens /dev/fuse for a new session.
pub fn open_dev() -> Result<OwnedFd, Error> {
    let dev = c"/dev/fuse";
    // SAFETY: a valid NUL-terminated path; the fd returned is ours.
    let fd = check(unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) }).map_err(|e| {
        Error::other("cannot open /dev/fuse (load the module: modprobe fuse; FUSE needs root)").because(e)
    })?;
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new /dev/fuse descriptor attached to `session`'s connection, so another
/// thread can read requests (and must answer them on this descriptor).
pub fn clone_dev(session: &OwnedFd) -> io::Result<OwnedFd> {
    let fd = open_dev().map_err(io::Error::other)?;
    let mut src = session.as_raw_fd() as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the session fd) through the pointer.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), proto::DEV_IOC_CLONE as _, &mut src) })?;
    Ok(fd)
}

/// Mounts the file system served on `fd` at the file `path`.
pub fn mount(path: &Path, fd: &OwnedFd, read_only: bool) -> Result<(), Error> {
    let target = cstr(path).map_err(|e| Error::new(ErrorKind::File, path.display().to_string()).because(e))?;
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    // SAFETY: getgid cannot fail and touches no memory.
    let gid = unsafe { libc::getgid() };
    let opts =
        format!("fd={},rootmode=100000,user_id={uid},group_id={gid},allow_other,default_permissions", fd.as_raw_fd());
    let opts = CString::new(opts).expect("no NUL in options");
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
    let r =
        unsafe { libc::mount(c"vdisk".as_ptr(), target.as_ptr(), c"fuse.vdisk".as_ptr(), flags, opts.as_ptr().cast()) };
    check(r).map(|_| ()).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::EPERM) { " (mounting needs root: run vdisk as root)" } else { "" };
        Error::other(format!("cannot mount FUSE on {}{hint}", path.display())).because(e)
    })
}

/// Lazily unmounts `path` (MNT_DETACH): gone from the tree now, the file
/// system ends when its last user (an open file, a loop device) lets go.
pub fn detach(path: &Path) -> io::Result<()> {
    let target = cstr(path)?;
    // SAFETY: a valid NUL-terminated path.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }).map(|_| ())
}

/// Unmounts `path` now if nothing uses it. If something does (an open file,
/// a loop device), aborts the connection first (MNT_FORCE: its users get
/// errors from then on) and detaches it. Returns whether it had to force.
pub fn unmount(path: &Path) -> io::Result<bool> {
    let target = cstr(path)?;
    // SAFETY: a valid NUL-terminated path.
    match check(unsafe { libc::umount2(target.as_ptr(), 0) }) {
        Ok(_) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            // SAFETY: as above. MNT_FORCE aborts the FUSE connection even though the unmount itself fails.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_FORCE) };
            detach(path).map(|()| true)
        }
        Err(e) => Err(e),
    }
}
