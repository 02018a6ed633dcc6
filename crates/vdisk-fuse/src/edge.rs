//! The panic edge of the FUSE threads. A panic while one request is decided
//! or answered becomes -EIO for that request and one error line; the thread
//! goes on with the next request. It never swallows a panic silently.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a panic said, for the log.
pub(crate) fn panic_text(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Runs `f`; a panic comes back as `Err` with its message.
///
/// Unwind safety: callers only pass work on one request; what a panic
/// leaves half done is that request's, and the caller answers it with EIO.
pub(crate) fn guard<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| panic_text(&*p))
}
