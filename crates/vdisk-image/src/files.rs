//! Opening the files of an image. Every image file, backing file and format
//! probe opens through [`open`], so two rules hold for all of them:
//!
//! - **An open never blocks and never touches a device.** The path is opened
//!   with `O_PATH` first (no read, no side effect: a FIFO does not wait for a
//!   writer, a device driver's `open` does not run), the file type is read
//!   from that descriptor, and anything but a regular file or a block device
//!   is refused with a message naming it. Only then is the very same file
//!   (through `/proc/self/fd`) opened for I/O.
//! - **Inside [`confined`], a path must resolve beneath one of the [`Roots`].**
//!   It is resolved with openat2(2) and `RESOLVE_BENEATH |
//!   RESOLVE_NO_MAGICLINKS` relative to a descriptor of the root directory,
//!   so `..`, a symlink pointing out and an absolute path outside are refused
//!   by the kernel, not by string checks that a rename could race.
//!
//! The confinement is per thread: whoever opens an image for an untrusted
//! caller (the daemon's control socket) wraps the whole open, backing chain
//! included, in [`confined`]. This module never decides who is trusted.

use std::cell::RefCell;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use crate::{Advice, Error, ErrorKind, Result};

/// Directories that untrusted requests may name files beneath.
pub struct Roots {
    /// Each root's canonical path and an `O_PATH` descriptor of it.
    dirs: Vec<(PathBuf, OwnedFd)>,
}

impl Roots {
    /// Opens each directory (resolved once, now: symlinks in a root's own
    /// path are the operator's choice).
    pub fn open(dirs: &[PathBuf]) -> Result<Roots> {
        let mut out = Vec::new();
        for d in dirs {
            let canonical = d.canonicalize().map_err(|e| {
                Error::io(e, format!("image root {} cannot be used (give an existing directory)", d.display()))
            })?;
            let fd = open_path(&canonical, libc::O_DIRECTORY)
                .map_err(|e| Error::io(e, format!("image root {} is not a directory", d.display())))?;
            out.push((canonical, fd));
        }
        Ok(Roots { dirs: out })
    }

    /// The roots, as messages name them: "/srv/images, /var/lib/vm".
    pub fn describe(&self) -> String {
        self.dirs.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|(p, _)| p.as_path())
    }

    /// `path` resolved beneath a root, opened `O_PATH` with `extra` flags.
    /// A relative path is taken from the current directory, as an open would.
    fn resolve(&self, path: &Path, extra: i32) -> Result<OwnedFd> {
        let outside = || {
            Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} is outside the image roots ({}): only files beneath them may be added through the \
                     control socket or a config reload",
                    path.display(),
                    self.describe()
                ),
            )
        };
        let full = std::path::absolute(path).map_err(|e| Error::io(e, format!("cannot resolve {}", path.display())))?;
        let mut first_err = None;
        for (root, fd) in &self.dirs {
            let Ok(rel) = full.strip_prefix(root) else { continue };
            let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
            match openat2_beneath(fd, rel, libc::O_PATH | libc::O_CLOEXEC | extra) {
                Ok(f) => return Ok(f),
                // EXDEV: `..` or a symlink led out of the root.
                Err(e) if e.raw_os_error() == Some(libc::EXDEV) || e.raw_os_error() == Some(libc::ELOOP) => {
                    first_err.get_or_insert_with(outside);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    return Err(Error::io(
                        e,
                        "image roots need openat2(2) (Linux 5.6 or later); this kernel lacks it".to_owned(),
                    ));
                }
                Err(e) => {
                    first_err.get_or_insert_with(|| Error::io(e, format!("cannot open {}", path.display())));
                }
            }
        }
        Err(first_err.unwrap_or_else(outside))
    }

    /// Checks that a path the server will create or bind (a FUSE file, a
    /// vhost-user socket) lies beneath a root: its directory must resolve
    /// beneath one, and its last component must be a plain name. Returns the
    /// path through the resolved directory.
    pub fn check_new(&self, path: &Path) -> Result<PathBuf> {
        let name = match path.components().next_back() {
            Some(Component::Normal(n)) => n.to_owned(),
            _ => return Err(Error::invalid(format!("{} does not end in a file name", path.display()))),
        };
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let dir = self.resolve(parent, libc::O_DIRECTORY).map_err(|e| match e.kind() {
            ErrorKind::InvalidInput => Error::invalid(format!(
                "{} is outside the image roots ({}): files the server creates for a control-socket request \
                 must be beneath them too",
                path.display(),
                self.describe()
            )),
            _ => e,
        })?;
        let real = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .map_err(|e| Error::io(e, format!("cannot resolve the directory of {}", path.display())))?;
        Ok(real.join(name))
    }
}

thread_local! {
    static CONFINED: RefCell<Option<Arc<Roots>>> = const { RefCell::new(None) };
}

/// Runs `f` with every [`open`] on this thread confined beneath `roots`
/// (none: unconfined), then restores what was before.
pub fn confined<T>(roots: Option<Arc<Roots>>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Arc<Roots>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CONFINED.with(|c| *c.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(CONFINED.with(|c| std::mem::replace(&mut *c.borrow_mut(), roots)));
    f()
}

/// Inside [`confined`], refuses `path` unless it resolves beneath the roots
/// (for a file another library opens by name: a Ceph configuration); outside, Ok.
pub fn check_confined(path: &Path) -> Result<()> {
    match CONFINED.with(|c| c.borrow().clone()) {
        Some(roots) => roots.resolve(path, 0).map(drop),
        None => Ok(()),
    }
}

/// Opens `path` (`what` names it in messages: "image", "backing file") for
/// reading, and writing if `write`: never blocking, only a regular file or a
/// block device, beneath the roots when confined (module doc).
pub fn open(path: &Path, write: bool, what: &str) -> Result<File> {
    open_checked(path, write, what).map_err(|e| e.op("open").path(path))
}

fn open_checked(path: &Path, write: bool, what: &str) -> Result<File> {
    let probe = match CONFINED.with(|c| c.borrow().clone()) {
        Some(roots) => roots.resolve(path, 0)?,
        None => open_path(path, 0).map_err(|e| Error::io(e, format!("cannot open {what} {}", path.display())))?,
    };
    check_type(&probe, path, what)?;
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", probe.as_raw_fd()))
        .and_then(|f| clear_nonblock(&f).map(|()| f))
        .map_err(|e| {
            let proc = if Path::new("/proc/self/fd").exists() { "" } else { " (through /proc/self/fd: mount /proc)" };
            let e = Error::io(e, format!("cannot open {what} {}{proc}", path.display()));
            if write {
                e.advise(Advice::ReadOnly)
            } else {
                e
            }
        })
}

/// Refuses anything but a regular file or a block device, by the type of the
/// file `fd` is (not of whatever the path names by now).
fn check_type(fd: &OwnedFd, path: &Path, what: &str) -> Result<()> {
    // SAFETY: `fd` is an open descriptor we own for the duration of the call;
    // dup gives an independent one that the File below owns and closes.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(Error::io(io::Error::last_os_error(), format!("cannot open {what} {}", path.display())));
    }
    // SAFETY: `dup` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(dup) };
    let meta = file.metadata().map_err(|e| Error::io(e, format!("cannot stat {what} {}", path.display())))?;
    let t = meta.file_type();
    if t.is_file() || t.is_block_device() {
        return Ok(());
    }
    let kind = if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a unix socket"
    } else if t.is_char_device() {
        "a character device"
    } else {
        "not a regular file"
    };
    let e = Error::invalid(format!(
        "{what} {} is {kind}, not a disk image: give a regular file or a block device",
        path.display()
    ));
    Err(if t.is_dir() { e.advise(Advice::CreateImage) } else { e })
}

/// `open(path, O_PATH | extra)`: never blocks and runs no driver code.
fn open_path(path: &Path, extra: i32) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC | extra) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// openat2(dir, rel, flags) with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS.
fn openat2_beneath(dir: &OwnedFd, rel: &Path, flags: i32) -> io::Result<OwnedFd> {
    let c = CString::new(rel.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: open_how is plain data; all zeros is valid before we fill it.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: `dir` is an open directory descriptor, `c` a NUL-terminated
        // string and `how` a valid open_how whose size we pass; all outlive the call.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: the kernel returned a new descriptor nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        let e = io::Error::last_os_error();
        // EAGAIN: a rename raced the lookup (the kernel asks to retry).
        if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) {
            return Err(e);
        }
    }
}

fn clear_nonblock(f: &File) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own only read and change its status flags.
    let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vdisk-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("root/sub")).unwrap();
        std::fs::write(d.join("root/sub/in.img"), [0u8; 512]).unwrap();
        std::fs::write(d.join("out.img"), [0u8; 512]).unwrap();
        d
    }

    #[test]
    fn fifos_sockets_and_char_devices_are_refused_without_blocking() {
        let d = dir("types");
        let fifo = d.join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let sock = d.join("sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        for (p, kind) in [(&fifo, "FIFO"), (&sock, "unix socket"), (&PathBuf::from("/dev/zero"), "character device")] {
            let e = open(p, false, "image").unwrap_err().to_string();
            assert!(e.contains(kind) && e.contains("not a disk image"), "{e}");
        }
        assert!(open(&d.join("root/sub/in.img"), true, "image").is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn confined_opens_stay_beneath_the_roots() {
        let d = dir("roots");
        let root = d.join("root");
        symlink(d.join("out.img"), root.join("link.img")).unwrap();
        symlink("sub/in.img", root.join("inner.img")).unwrap();
        let roots = Arc::new(Roots::open(std::slice::from_ref(&root)).unwrap());
        confined(Some(roots.clone()), || {
            assert!(open(&root.join("sub/in.img"), false, "image").is_ok());
            assert!(open(&root.join("inner.img"), false, "image").is_ok(), "a symlink inside stays inside");
            for p in [d.join("out.img"), root.join("../out.img"), root.join("link.img"), PathBuf::from("/etc/passwd")] {
                let e = open(&p, false, "image").unwrap_err().to_string();
                assert!(e.contains("outside the image roots") && e.contains(&roots.describe()), "{p:?}: {e}");
            }
            assert!(roots.check_new(&root.join("sub/new.sock")).is_ok());
            assert!(roots.check_new(&d.join("new.sock")).is_err());
        });
        assert!(open(&d.join("out.img"), false, "image").is_ok(), "unconfined again");
        let _ = std::fs::remove_dir_all(&d);
    }
}
