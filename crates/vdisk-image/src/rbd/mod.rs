//! Images on Ceph RBD: `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=NAME][:KEY=VALUE...]`,
//! qemu's spelling.
//!
//! What it owns: the cluster connection (librados), the one `rbd_image_t` of
//! the image that every worker and export shares, what an RBD name means,
//! and the limits that keep connecting from hanging. What it must never do:
//! move request data itself (the engine submits librbd AIO through
//! [`RbdImage`]'s `aio_*` calls and drains their completions), or keep a
//! cluster handle it could not finish opening.
//!
//! Connecting: librados waits forever for a monitor by default. Here the
//! monitor and its operations time out (`client_mount_timeout`,
//! `rados_mon_op_timeout`) and the whole open (connect, pool, image) runs
//! under a deadline ([`OPEN_DEADLINE`]), so a wrong address or a cluster
//! without a working OSD fails with one line instead of a hang. OSD
//! operations themselves never time out: once open, a request to an OSD that
//! is down waits until it is back, as on a slow disk.

mod bitmaps;
pub mod ffi;
mod spec;

use std::ffi::{c_int, c_void, CString};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

pub use bitmaps::METADATA_KEY;
pub use spec::{ConnectOptions, Spec};

use crate::{map_one_to_one, Advice, Allocation, Error, ErrorKind, Extent, Image, ImageBase, Result, Storage};
use ffi::{lib, CompletionT, ImageT, IoctxT, Lib, RadosT};

/// How long opening an image (connect, pool, image) may take before it is
/// given up with an error.
pub const OPEN_DEADLINE: Duration = Duration::from_secs(20);
/// The monitor timeouts set on every connection, in seconds.
const MON_TIMEOUT: &str = "10";

/// True when `name` is an RBD image name (`rbd:...`) rather than a path.
pub fn is_rbd(name: &Path) -> bool {
    name.as_os_str().as_encoded_bytes().starts_with(b"rbd:")
}

/// A connection to the cluster with the image's pool open. Closed on drop.
struct Conn {
    lib: &'static Lib,
    rados: RadosT,
    ioctx: IoctxT,
}

// SAFETY: librados handles may be used from any thread (librados is thread-safe);
// `Conn` only closes them in `drop`, which runs once.
unsafe impl Send for Conn {}
// SAFETY: as above: every call vdisk makes through a shared `Conn` is thread-safe in librados.
unsafe impl Sync for Conn {}

impl Drop for Conn {
    fn drop(&mut self) {
        if !self.ioctx.is_null() {
            // SAFETY: the pool handle came from a successful create and is released once, first.
            unsafe { (self.lib.rados_ioctx_destroy)(self.ioctx) };
        }
        // SAFETY: the cluster handle came from a successful create and is released once, last.
        unsafe { (self.lib.rados_shutdown)(self.rados) };
    }
}

fn cstr(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} {s:?} contains a NUL byte")))
}

fn os_err(rc: i64) -> std::io::Error {
    std::io::Error::from_raw_os_error((-rc) as i32)
}

impl Conn {
    /// Connects to the cluster and opens the pool. Blocking; bounded by the
    /// monitor timeouts (the caller adds the overall deadline).
    fn connect(spec: &Spec) -> Result<Conn> {
        let lib = lib().map_err(|e| Error::new(ErrorKind::Unsupported, e))?;
        let id = spec.options.id.as_deref().map(|i| cstr(i, "ceph id")).transpose()?;
        let mut rados: RadosT = std::ptr::null_mut();
        // SAFETY: `rados` is a valid out-pointer; `id` is null or NUL-terminated and outlives the call.
        let rc = unsafe { (lib.rados_create)(&mut rados, id.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot create a Ceph client for {spec}")));
        }
        let mut conn = Conn { lib, rados, ioctx: std::ptr::null_mut() };
        conn.configure(spec)?;
        // SAFETY: a live, configured handle.
        let rc = unsafe { (lib.rados_connect)(conn.rados) };
        if rc < 0 {
            let e = os_err(rc.into());
            let hint = if rc == -libc::ETIMEDOUT {
                "no monitor answered; check `mon host` in the Ceph configuration and that the cluster is up".to_owned()
            } else {
                "check the Ceph configuration, the client id and its keyring".to_owned()
            };
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("cannot connect to the Ceph cluster for {spec}: {e} ({hint})"),
            )
            .advise(Advice::CephConfig));
        }
        conn.open_pool(&spec.pool)?;
        Ok(conn)
    }

    /// Reads the Ceph configuration (the spec's file or librados's own search),
    /// CEPH_ARGS, then vdisk's settings and the spec's own options.
    fn configure(&self, spec: &Spec) -> Result<()> {
        let conf = spec.options.conf.as_ref().map(|p| cstr(&p.display().to_string(), "ceph conf path")).transpose()?;
        if let Some(path) = &spec.options.conf {
            if !path.is_file() {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("Ceph configuration {} does not exist", path.display()),
                )
                .advise(Advice::CephConfig));
            }
        }
        // SAFETY: a live handle; the path is null (librados's own search: $CEPH_CONF,
        // /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf) or NUL-terminated.
        let rc = unsafe {
            (self.lib.rados_conf_read_file)(self.rados, conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        };
        if rc < 0 {
            let which = spec
                .options
                .conf
                .as_ref()
                .map_or("found in $CEPH_CONF or /etc/ceph/ceph.conf".into(), |p| p.display().to_string());
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("cannot read the Ceph configuration {which}: {}", os_err(rc.into())),
            )
            .advise(Advice::CephConfig));
        }
        // SAFETY: a live handle; null means CEPH_ARGS.
        unsafe { (self.lib.rados_conf_parse_env)(self.rados, std::ptr::null()) };
        let mut settings: Vec<(String, String)> = vec![
            ("client_mount_timeout".into(), MON_TIMEOUT.into()),
            ("rados_mon_op_timeout".into(), MON_TIMEOUT.into()),
            // librbd's own log goes nowhere unless asked for.
            ("log_to_stderr".into(), "false".into()),
            ("err_to_stderr".into(), "false".into()),
        ];
        settings.extend(spec.options.extra.iter().cloned());
        for (k, v) in &settings {
            let (ck, cv) = (cstr(k, "ceph option")?, cstr(v, "ceph option value")?);
            // SAFETY: a live handle and NUL-terminated strings that outlive the call.
            let rc = unsafe { (self.lib.rados_conf_set)(self.rados, ck.as_ptr(), cv.as_ptr()) };
            if rc < 0 {
                return Err(Error::invalid(format!("Ceph option {k}={v} is not accepted: {}", os_err(rc.into()))));
            }
        }
        Ok(())
    }

    /// Opens the pool's I/O context on a connected handle.
    fn open_pool(&mut self, name: &str) -> Result<()> {
        let pool = cstr(name, "pool name")?;
        // SAFETY: a connected handle, a NUL-terminated name and a valid out-pointer.
        let rc = unsafe { (self.lib.rados_ioctx_create)(self.rados, pool.as_ptr(), &mut self.ioctx) };
        if rc < 0 {
            self.ioctx = std::ptr::null_mut();
            let msg = if rc == -libc::ENOENT {
                format!("pool {:?} does not exist in the Ceph cluster (see `ceph osd pool ls`)", name)
            } else {
                format!("cannot open pool {:?}: {}", name, os_err(rc.into()))
            };
            return Err(Error::new(if rc == -libc::ENOENT { ErrorKind::NotFound } else { ErrorKind::Io }, msg));
        }
        Ok(())
    }
}

/// Runs `f` on its own thread and gives up after [`OPEN_DEADLINE`]: librados
/// has calls (an OSD op while opening an image) that no setting bounds. A
/// call given up on keeps its thread; the caller reports the error (and the
/// command line exits).
fn with_deadline<T: Send + 'static>(what: String, f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("rbd-open".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error::io(e, "cannot start a thread to open an RBD image"))?;
    match rx.recv_timeout(OPEN_DEADLINE) {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{what}: no answer from the Ceph cluster in {} s (are its monitors and OSDs up? `ceph -s`)",
                OPEN_DEADLINE.as_secs()
            ),
        )),
    }
}

/// What `vdisk info` shows of an RBD image.
#[derive(Debug, Clone)]
pub struct RbdInfo {
    pub size: u64,
    pub object_size: u64,
    pub objects: u64,
    pub features: u64,
    /// Bytes of objects that exist (from the object map), when cheap to know.
    pub allocated: Option<u64>,
}

/// An RBD image (or snapshot) open for I/O. One per served image: its
/// `rbd_image_t` is shared by every worker and export (librbd's calls on one
/// image are thread-safe).
pub struct RbdImage {
    spec: Spec,
    /// Path `rbd:pool/image[@snap]`, for messages and [`Image::file_path`]; no
    /// files: its one target is itself ([`Image::target`] 0, `Storage::Rbd`).
    base: ImageBase,
    conn: Conn,
    /// The open image; null once [`RbdImage::close`]d.
    image: AtomicPtr<c_void>,
    features: u64,
    /// The generation of the bitmaps last read or written (rbd/bitmaps.rs).
    bitmap_generation: AtomicU64,
}

// SAFETY: an `rbd_image_t` may be used from many threads at once (librbd serialises
// internally); it is closed only in `drop`.
unsafe impl Send for RbdImage {}
// SAFETY: see `Send`.
unsafe impl Sync for RbdImage {}

impl Drop for RbdImage {
    fn drop(&mut self) {
        self.close();
    }
}

/// The feature bit of RBD's fast-diff (object map kept exact enough for diffs).
const FEATURE_FAST_DIFF: u64 = 1 << 4;

impl RbdImage {
    /// Opens `spec` (read-only when asked or when it names a snapshot), within
    /// [`OPEN_DEADLINE`].
    pub fn open(spec: &Spec, read_only: bool) -> Result<RbdImage> {
        let spec2 = spec.clone();
        with_deadline(format!("cannot open {spec}"), move || Self::open_now(spec2, read_only))
    }

    fn open_now(spec: Spec, read_only: bool) -> Result<RbdImage> {
        let read_only = read_only || spec.snap.is_some();
        let conn = Conn::connect(&spec)?;
        let lib = conn.lib;
        let name = cstr(&spec.image, "image name")?;
        let snap = spec.snap.as_deref().map(|s| cstr(s, "snapshot name")).transpose()?;
        let snap_ptr = snap.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        let mut image: ImageT = std::ptr::null_mut();
        let open = if read_only { lib.rbd_open_read_only } else { lib.rbd_open };
        // SAFETY: an open pool, NUL-terminated names (snapshot may be null) and a valid out-pointer.
        let rc = unsafe { open(conn.ioctx, name.as_ptr(), &mut image, snap_ptr) };
        if rc < 0 {
            let msg = match (rc, &spec.snap) {
                (r, None) if r == -libc::ENOENT => format!(
                    "RBD image {:?} does not exist in pool {:?} (see `rbd ls {}`)",
                    spec.image, spec.pool, spec.pool
                ),
                (r, Some(s)) if r == -libc::ENOENT => format!(
                    "RBD image {}/{} or its snapshot {s:?} does not exist (see `rbd snap ls {}/{}`)",
                    spec.pool, spec.image, spec.pool, spec.image
                ),
                _ => format!("cannot open RBD image {spec}: {}", os_err(rc.into())),
            };
            let kind = if rc == -libc::ENOENT { ErrorKind::NotFound } else { ErrorKind::Io };
            let e = Error::new(kind, msg);
            return Err(if rc == -libc::ENOENT && spec.snap.is_none() { e.advise(Advice::CreateImage) } else { e });
        }
        // From here on a failure closes the image (drop).
        let mut img = RbdImage {
            base: ImageBase::new(PathBuf::from(spec.to_string()), 0, read_only, Vec::new()),
            spec,
            conn,
            image: AtomicPtr::new(image),
            features: 0,
            bitmap_generation: AtomicU64::new(0),
        };
        // SAFETY: an open image and a valid out-pointer.
        let rc = unsafe { (lib.rbd_get_size)(image, &mut img.base.size) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot read the size of {}", img.spec)));
        }
        // SAFETY: as above.
        unsafe { (lib.rbd_get_features)(image, &mut img.features) };
        Ok(img)
    }

    /// Creates a new image of `size` bytes with the cluster's default features.
    pub fn create(spec: &Spec, size: u64) -> Result<()> {
        if spec.snap.is_some() {
            return Err(Error::invalid(format!("{spec} names a snapshot: create the image, then `rbd snap create`")));
        }
        let spec = spec.clone();
        with_deadline(format!("cannot create {spec}"), move || {
            let conn = Conn::connect(&spec)?;
            let name = cstr(&spec.image, "image name")?;
            let mut order: c_int = 0;
            // SAFETY: an open pool, a NUL-terminated name and a valid out-pointer (0: default object size).
            let rc = unsafe { (conn.lib.rbd_create)(conn.ioctx, name.as_ptr(), size, &mut order) };
            match rc {
                0 => Ok(()),
                r if r == -libc::EEXIST => Err(Error::invalid(format!(
                    "RBD image {spec} already exists; remove it first (`rbd rm {}/{}`) or pick another name",
                    spec.pool, spec.image
                ))
                .caused_by(os_err(r.into()))),
                r => Err(Error::io(os_err(r.into()), format!("cannot create RBD image {spec}"))),
            }
        })
    }

    /// Removes image `spec` (closed by every client), within [`OPEN_DEADLINE`]:
    /// a mirror's partial target when the mirror is cancelled.
    pub fn remove(spec: &Spec) -> Result<()> {
        let spec = spec.clone();
        with_deadline(format!("cannot remove {spec}"), move || {
            let conn = Conn::connect(&spec)?;
            let name = cstr(&spec.image, "image name")?;
            // SAFETY: an open pool and a NUL-terminated name.
            let rc = unsafe { (conn.lib.rbd_remove)(conn.ioctx, name.as_ptr()) };
            if rc < 0 {
                return Err(Error::io(os_err(rc.into()), format!("cannot remove RBD image {spec}")));
            }
            Ok(())
        })
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// The open handle, or an error once closed.
    fn img(&self) -> std::io::Result<ImageT> {
        let p = self.image.load(Ordering::Acquire);
        if p.is_null() {
            return Err(std::io::Error::from_raw_os_error(libc::ESHUTDOWN));
        }
        Ok(p)
    }

    /// Closes the image now (flushing it and releasing its exclusive lock, so
    /// the next client need not wait for the lock to time out); later calls
    /// fail with ESHUTDOWN. Call it only once nothing is in flight and nothing
    /// more will be submitted (the engine's shutdown). Idempotent; `drop` does it too.
    pub fn close(&self) {
        let p = self.image.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: the handle came from a successful open and is closed once (the swap
            // above hands it to one caller); nothing is in flight (the caller's promise).
            unsafe { (self.conn.lib.rbd_close)(p) };
        }
    }

    /// Size, object layout, features and (with fast-diff) allocated bytes.
    pub fn info(&self) -> Result<RbdInfo> {
        let mut st = std::mem::MaybeUninit::<ffi::ImageInfo>::zeroed();
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        // SAFETY: an open image; `st` is a writable rbd_image_info_t of the size passed.
        let rc = unsafe { (self.conn.lib.rbd_stat)(img, st.as_mut_ptr(), std::mem::size_of::<ffi::ImageInfo>()) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot stat {}", self.spec)));
        }
        // SAFETY: zero-initialised plain data, filled by rbd_stat.
        let st = unsafe { st.assume_init() };
        let allocated = if self.features & FEATURE_FAST_DIFF != 0 {
            let mut runs = Vec::new();
            self.diff(0, self.base.size, &mut runs).ok().map(|()| runs.iter().map(|(_, l)| l).sum())
        } else {
            None
        };
        Ok(RbdInfo {
            size: st.size,
            object_size: st.obj_size,
            objects: st.num_objs,
            features: self.features,
            allocated,
        })
    }

    /// The allocated runs (offset, len) within [offset, offset+len), whole objects, from the object map.
    fn diff(&self, offset: u64, len: u64, out: &mut Vec<(u64, u64)>) -> Result<()> {
        unsafe extern "C" fn cb(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `&mut Vec` passed below, alive for the whole call.
            let out = unsafe { &mut *(arg as *mut Vec<(u64, u64)>) };
            if exists != 0 {
                out.push((off, len as u64));
            }
            0
        }
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        // SAFETY: an open image; the callback only touches `out`, which outlives this
        // synchronous call; null fromsnap means "since the image was created".
        let rc = unsafe {
            (self.conn.lib.rbd_diff_iterate2)(
                img,
                std::ptr::null(),
                offset,
                len,
                1,
                1,
                cb,
                (out as *mut Vec<(u64, u64)>).cast(),
            )
        };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot map {} at {offset}", self.spec)));
        }
        Ok(())
    }

    /// Makes completions of this image's AIO signal `fd` (an eventfd); they are
    /// then collected with [`RbdImage::poll_completions`].
    pub fn notify_completions(&self, fd: RawFd) -> Result<()> {
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        // SAFETY: an open image; the eventfd is the caller's and outlives the image's I/O.
        let rc = unsafe { (self.conn.lib.rbd_set_image_notification)(img, fd, ffi::EVENT_TYPE_EVENTFD) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot watch completions of {}", self.spec)));
        }
        Ok(())
    }

    fn completion(&self, key: u64) -> std::io::Result<CompletionT> {
        unsafe extern "C" fn nothing(_: CompletionT, _: *mut c_void) {}
        let mut c: CompletionT = std::ptr::null_mut();
        // SAFETY: the argument is an integer carried as a pointer, never dereferenced;
        // the callback does nothing (completions are collected by polling).
        let rc =
            unsafe { (self.conn.lib.rbd_aio_create_completion)(key as usize as *mut c_void, Some(nothing), &mut c) };
        if rc < 0 {
            return Err(os_err(rc.into()));
        }
        Ok(c)
    }

    /// Releases `c` when a submission failed, and turns the failure into an error.
    fn submitted(&self, c: CompletionT, rc: c_int) -> std::io::Result<()> {
        if rc < 0 {
            // SAFETY: librbd refused the operation, so it never took `c`; we release it once.
            unsafe { (self.conn.lib.rbd_aio_release)(c) };
            return Err(os_err(rc.into()));
        }
        Ok(())
    }

    /// Starts a vectored read at `offset`; its completion carries `key`.
    ///
    /// # Safety
    /// The memory the iovecs point at must stay valid, and untouched by
    /// anyone else, until the completion carrying `key` has been collected.
    pub unsafe fn aio_readv(&self, iov: &[libc::iovec], offset: u64, key: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let c = self.completion(key)?;
        // SAFETY: an open image; the iovecs are read during the call (librbd copies them)
        // and the memory they name is the caller's promise above.
        let rc = unsafe { (self.conn.lib.rbd_aio_readv)(img, iov.as_ptr(), iov.len() as c_int, offset, c) };
        self.submitted(c, rc)
    }

    /// Starts a vectored write at `offset`; its completion carries `key`.
    ///
    /// # Safety
    /// As for [`RbdImage::aio_readv`].
    pub unsafe fn aio_writev(&self, iov: &[libc::iovec], offset: u64, key: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let c = self.completion(key)?;
        // SAFETY: as in `aio_readv`; librbd only reads the memory.
        let rc = unsafe { (self.conn.lib.rbd_aio_writev)(img, iov.as_ptr(), iov.len() as c_int, offset, c) };
        self.submitted(c, rc)
    }

    /// Starts a flush of every write completed before it; its completion carries `key`.
    pub fn aio_flush(&self, key: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let c = self.completion(key)?;
        // SAFETY: an open image and a fresh completion; a flush touches no caller memory.
        let rc = unsafe { (self.conn.lib.rbd_aio_flush)(img, c) };
        self.submitted(c, rc)
    }

    /// Starts a discard (TRIM) of a range.
    pub fn aio_discard(&self, offset: u64, len: u64, key: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let c = self.completion(key)?;
        // SAFETY: as for `aio_flush`.
        let rc = unsafe { (self.conn.lib.rbd_aio_discard)(img, offset, len, c) };
        self.submitted(c, rc)
    }

    /// Starts making a range read as zeros.
    pub fn aio_write_zeroes(&self, offset: u64, len: u64, key: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let c = self.completion(key)?;
        // SAFETY: as for `aio_flush`; zero flags and op flags are 0 (defaults).
        let rc = unsafe { (self.conn.lib.rbd_aio_write_zeroes)(img, offset, len as usize, c, 0, 0) };
        self.submitted(c, rc)
    }

    /// Collects up to `max` finished operations as (key, result): the bytes
    /// moved or 0, or a negative errno. Releases their completions.
    pub fn poll_completions(&self, max: usize, out: &mut Vec<(u64, i64)>) -> usize {
        let Ok(img) = self.img() else { return 0 };
        let mut comps: Vec<CompletionT> = vec![std::ptr::null_mut(); max.max(1)];
        // SAFETY: an open image and room for `comps.len()` completion pointers.
        let n = unsafe { (self.conn.lib.rbd_poll_io_events)(img, comps.as_mut_ptr(), comps.len() as c_int) };
        let n = n.max(0) as usize;
        for &c in &comps[..n] {
            // Each is a finished completion created by `completion`, handed to us once by
            // rbd_poll_io_events: read, then released, and never touched again.
            // SAFETY: a live, finished completion (above).
            let key = unsafe { (self.conn.lib.rbd_aio_get_arg)(c) } as usize as u64;
            // SAFETY: as above.
            let r = unsafe { (self.conn.lib.rbd_aio_get_return_value)(c) } as i64;
            // SAFETY: as above; released exactly once, after its last use.
            unsafe { (self.conn.lib.rbd_aio_release)(c) };
            out.push((key, r));
        }
        n
    }

    /// A blocking read of `buf.len()` bytes at `offset` (a COW overlay's copy-up
    /// or merge). librbd's synchronous calls bypass the completion eventfd.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: an open image; `rest` is writable memory of the length passed, borrowed
            // for this synchronous call only.
            let n =
                unsafe { (self.conn.lib.rbd_read)(img, offset + done as u64, rest.len(), rest.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(os_err(n as i64));
            }
            if n == 0 {
                // Past the end of the image: reads as zeros, like a file's tail.
                rest.fill(0);
                break;
            }
            done += n as usize;
        }
        Ok(())
    }

    /// A blocking write of `buf` at `offset` (a mirror's copy into this image).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let img = self.img()?;
        let mut done = 0;
        while done < buf.len() {
            let rest = &buf[done..];
            // SAFETY: an open image; `rest` is readable memory of the length passed, borrowed
            // for this synchronous call only.
            let n = unsafe { (self.conn.lib.rbd_write)(img, offset + done as u64, rest.len(), rest.as_ptr().cast()) };
            if n < 0 {
                return Err(os_err(n as i64));
            }
            if n == 0 {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// A blocking write of zeros over `len` bytes at `offset` (librbd
    /// deallocates whole objects where it can).
    pub fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let img = self.img()?;
        // SAFETY: an open image; zero flags and op flags are 0 (defaults).
        let n = unsafe { (self.conn.lib.rbd_write_zeroes)(img, offset, len as usize, 0, 0) };
        if n < 0 {
            return Err(os_err(n as i64));
        }
        Ok(())
    }

    /// A blocking flush (shutdown).
    pub fn flush(&self) -> Result<()> {
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        // SAFETY: an open image.
        let rc = unsafe { (self.conn.lib.rbd_flush)(img) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("flush of {}", self.spec)));
        }
        Ok(())
    }

    /// Makes the RBD snapshot `name` of the image as it is now (what was
    /// written before is in it; flush first for what librbd's cache holds).
    /// An existing name is refused with EEXIST as its cause.
    pub fn snap_create(&self, name: &str) -> Result<()> {
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        let c =
            std::ffi::CString::new(name).map_err(|_| Error::invalid(format!("snapshot name {name:?} holds a NUL")))?;
        // SAFETY: an open image and a NUL-terminated name that outlives the call.
        let rc = unsafe { (self.conn.lib.rbd_snap_create)(img, c.as_ptr()) };
        if rc < 0 {
            return Err(Error::io(os_err(rc.into()), format!("cannot make snapshot {name:?} of {}", self.spec)));
        }
        Ok(())
    }

    /// An error of an operation on this image, with where it happened.
    pub fn error(&self, what: &str, offset: u64, len: u64, errno: i64) -> Error {
        Error::io(os_err(errno.min(-1)), format!("{what} of {len} bytes at offset {offset} of {}", self.spec))
    }
}

impl crate::BlockTarget for RbdImage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        RbdImage::read_at(self, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        RbdImage::write_at(self, buf, offset)
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        RbdImage::write_zeroes_at(self, offset, len)
    }

    fn sync(&self) -> std::io::Result<()> {
        self.flush().map_err(|e| std::io::Error::from_raw_os_error(e.errno().max(1)))
    }
}

impl Image for RbdImage {
    fn format(&self) -> &'static str {
        "rbd"
    }

    fn base(&self) -> &ImageBase {
        &self.base
    }

    /// One target, the image itself.
    fn target(&self, i: usize) -> Option<Storage<'_>> {
        (i == 0).then_some(Storage::Rbd(self))
    }

    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        map_one_to_one(offset, len, out)
    }

    /// With fast-diff, the object map says which objects exist (whole objects:
    /// an allocated run may read as zeros). Without it, everything is data,
    /// which is always a correct answer and costs no OSD round trip.
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Allocation>) -> Result<()> {
        let end = offset + len;
        if self.features & FEATURE_FAST_DIFF == 0 {
            out.push(Allocation { len, hole: false, zero: false, depth: 1 });
            return Ok(());
        }
        let mut runs = Vec::new();
        self.diff(offset, len, &mut runs)?;
        runs.sort_unstable();
        let mut pos = offset;
        let mut n = 0;
        for (o, l) in runs {
            let (s, e) = (o.max(pos), (o + l).min(end));
            if e <= s {
                continue;
            }
            if s > pos && n < max {
                out.push(Allocation { len: s - pos, hole: true, zero: true, depth: 1 });
                n += 1;
            }
            if n < max {
                out.push(Allocation { len: e - s, hole: false, zero: false, depth: 1 });
                n += 1;
            }
            pos = e;
            if n >= max {
                return Ok(());
            }
        }
        if pos < end && n < max {
            out.push(Allocation { len: end - pos, hole: true, zero: true, depth: 1 });
        }
        Ok(())
    }

    /// The image's dirty bitmaps, in its RBD metadata (rbd/bitmaps.rs); a
    /// snapshot has none (the metadata is the image's, not the snapshot's).
    fn bitmap_store(&self) -> Option<&dyn crate::bitmap::BitmapStore> {
        self.spec.snap.is_none().then_some(self as &dyn crate::bitmap::BitmapStore)
    }
}
