//! The librados/librbd C functions vdisk calls, loaded at run time with
//! `dlopen("librbd.so.1")` (see docs/design.md, "RBD: loaded, not linked").
//!
//! Declarations follow Ceph 16.2's `rados/librados.h` and `rbd/librbd.h`
//! (LIBRBD 1.16). Every symbol is looked up once, when the library is first
//! needed; a library that lacks one is refused with its name, so a call
//! through the table never reaches a missing function. This module owns the
//! raw types and the table; it never decides what is safe to call when —
//! that is for the callers, at each call, in their `// SAFETY:` lines.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

pub type RadosT = *mut c_void;
pub type IoctxT = *mut c_void;
pub type ImageT = *mut c_void;
pub type CompletionT = *mut c_void;
pub type Callback = Option<unsafe extern "C" fn(CompletionT, *mut c_void)>;
pub type DiffCallback = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// `EVENT_TYPE_EVENTFD` of `rbd_set_image_notification`.
pub const EVENT_TYPE_EVENTFD: c_int = 2;

/// `rbd_image_info_t`.
#[repr(C)]
pub struct ImageInfo {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

/// Declares the table: one typed function pointer per symbol, looked up by name.
macro_rules! table {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The functions of librbd and librados vdisk uses.
        #[allow(non_snake_case)]
        pub struct Lib {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Lib {
            /// Looks every symbol up in `handle`.
            ///
            /// # Safety
            /// `handle` must be a live `dlopen` handle of librbd (whose
            /// dependencies bring librados), never closed afterwards.
            unsafe fn resolve(handle: *mut c_void) -> Result<Lib, String> {
                Ok(Lib {
                    $($name: {
                        let sym = concat!(stringify!($name), "\0");
                        // SAFETY: the handle is live (caller's promise); the name is NUL-terminated.
                        let p = unsafe { libc::dlsym(handle, sym.as_ptr().cast()) };
                        if p.is_null() {
                            return Err(format!(
                                "{} has no {} (vdisk needs librbd 1.16, Ceph 16.2 Pacific, or newer)",
                                LIBRARY,
                                stringify!($name)
                            ));
                        }
                        // SAFETY: the symbol has this C signature in Ceph 16.2's headers
                        // (the declarations above copy them), and the library stays loaded.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(p) }
                    },)*
                })
            }
        }
    };
}

table! {
    rados_create: fn(*mut RadosT, *const c_char) -> c_int;
    rados_conf_read_file: fn(RadosT, *const c_char) -> c_int;
    rados_conf_parse_env: fn(RadosT, *const c_char) -> c_int;
    rados_conf_set: fn(RadosT, *const c_char, *const c_char) -> c_int;
    rados_connect: fn(RadosT) -> c_int;
    rados_shutdown: fn(RadosT);
    rados_ioctx_create: fn(RadosT, *const c_char, *mut IoctxT) -> c_int;
    rados_ioctx_destroy: fn(IoctxT);
    rbd_create: fn(IoctxT, *const c_char, u64, *mut c_int) -> c_int;
    rbd_remove: fn(IoctxT, *const c_char) -> c_int;
    rbd_open: fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    rbd_open_read_only: fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    rbd_close: fn(ImageT) -> c_int;
    rbd_get_size: fn(ImageT, *mut u64) -> c_int;
    rbd_get_features: fn(ImageT, *mut u64) -> c_int;
    rbd_stat: fn(ImageT, *mut ImageInfo, usize) -> c_int;
    rbd_flush: fn(ImageT) -> c_int;
    rbd_snap_create: fn(ImageT, *const c_char) -> c_int;
    rbd_read: fn(ImageT, u64, usize, *mut c_char) -> isize;
    rbd_write: fn(ImageT, u64, usize, *const c_char) -> isize;
    rbd_write_zeroes: fn(ImageT, u64, usize, c_int, c_int) -> isize;
    rbd_diff_iterate2: fn(ImageT, *const c_char, u64, u64, u8, u8, DiffCallback, *mut c_void) -> c_int;
    rbd_set_image_notification: fn(ImageT, c_int, c_int) -> c_int;
    rbd_metadata_get: fn(ImageT, *const c_char, *mut c_char, *mut usize) -> c_int;
    rbd_metadata_set: fn(ImageT, *const c_char, *const c_char) -> c_int;
    rbd_poll_io_events: fn(ImageT, *mut CompletionT, c_int) -> c_int;
    rbd_aio_create_completion: fn(*mut c_void, Callback, *mut CompletionT) -> c_int;
    rbd_aio_release: fn(CompletionT);
    rbd_aio_get_return_value: fn(CompletionT) -> isize;
    rbd_aio_get_arg: fn(CompletionT) -> *mut c_void;
    rbd_aio_wait_for_complete: fn(CompletionT) -> c_int;
    rbd_aio_readv: fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int;
    rbd_aio_writev: fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int;
    rbd_aio_flush: fn(ImageT, CompletionT) -> c_int;
    rbd_aio_discard: fn(ImageT, u64, u64, CompletionT) -> c_int;
    rbd_aio_write_zeroes: fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int;
}

/// The library loaded; librados comes with it as its dependency.
pub const LIBRARY: &str = "librbd.so.1";

/// The table, loading the library the first time. The library is never
/// unloaded: librbd's threads and static destructors must outlive every use.
pub fn lib() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let name = format!("{LIBRARY}\0");
        // SAFETY: a NUL-terminated name; RTLD_NOW resolves everything up front.
        let handle = unsafe { libc::dlopen(name.as_ptr().cast(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                String::from("not found")
            } else {
                // SAFETY: non-null, NUL-terminated (see above).
                unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
            };
            return Err(format!(
                "cannot load {LIBRARY} for RBD images ({why}); install Ceph's client library (Debian/Ubuntu: apt install librbd1)"
            ));
        }
        // SAFETY: a live handle, never closed.
        unsafe { Lib::resolve(handle) }
    })
    .as_ref()
    .map_err(Clone::clone)
}
