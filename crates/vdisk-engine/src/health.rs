//! A device's health: serving, until something in its engine fails for good —
//! a worker panics or meets an error it cannot recover from (`io_uring_enter`
//! failing for another reason than EINTR or a full completion queue), or a
//! sink panics while taking its completions. From then on the device is
//! *failed*, with the first cause, for the rest of its life: every request
//! still held or submitted later completes at once with EIO through its sink,
//! and one error line names the device and the cause. Removing the export and
//! adding it again starts a new, healthy device.
//!
//! This module owns that state and the two ways a request is answered once
//! it holds: [`failed`] (its data is ours again) and [`leaked`] (the kernel
//! or librbd may still touch its data: the data is forgotten, never freed,
//! and the request goes back with an empty buffer).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use vdisk_image::Error;

use crate::Request;

/// How long a failed device's operations may stay in the kernel (or librbd)
/// before they are leaked.
pub(crate) const ABANDON_WAIT: Duration = Duration::from_secs(2);

pub(crate) struct Health {
    device: String,
    failed: AtomicBool,
    cause: OnceLock<String>,
}

impl Health {
    pub fn new(device: &str) -> Health {
        Health { device: device.to_owned(), failed: AtomicBool::new(false), cause: OnceLock::new() }
    }

    /// Marks the device failed (the first cause is kept) and says so, once.
    pub fn fail(&self, cause: impl Into<String>) {
        let cause = cause.into();
        if self.cause.set(cause.clone()).is_ok() {
            self.failed.store(true, Ordering::Release);
            let name = &self.device;
            log::error!(
                export:% = name;
                "export {name:?} failed: {cause}; its requests now fail with EIO (remove the export and add it \
                 again to serve it anew)"
            );
        }
    }

    /// One load: checked on every batch, so it must stay cheap.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The cause, naming the device, once failed.
    pub fn failure(&self) -> Option<String> {
        self.is_failed().then(|| format!("device {:?} failed: {}", self.device, self.cause.get().expect("set first")))
    }

    /// The error failed requests complete with (EIO, naming the device and the cause).
    pub fn error(&self) -> Error {
        let what = self.failure().unwrap_or_else(|| format!("device {:?} failed", self.device));
        Error::io(std::io::Error::from_raw_os_error(libc::EIO), what)
    }
}

/// Answers `req` with `e` unless it failed already (then its own error stays).
pub(crate) fn failed(req: &mut Request, e: &Error) {
    req.error.get_or_insert_with(|| e.clone());
}

/// Like [`failed`], for a request whose data the kernel (or librbd) may still
/// read or write: the data is forgotten, never freed nor reused, and the
/// request goes back with an empty buffer in its place.
pub(crate) fn leaked(req: &mut Request, e: &Error) {
    if let Some(data) = req.cmd.data_mut() {
        std::mem::forget(std::mem::take(data));
    }
    failed(req, e);
}

/// What a panic said, for the failure's cause.
pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".to_owned()
    }
}
