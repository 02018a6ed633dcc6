//! A submission helper for io_uring: queue an entry, submitting what is
//! already queued when the submission queue is full. The FUSE ring queues
//! (128-byte SQEs) use it; the engine's rings have their own (`ring::Ring`),
//! which also makes room in a full completion queue. The submission retries
//! EINTR; any other error is the caller's.

use io_uring::{squeue, IoUring};

/// Queues `entry` on `ring`, submitting first while the submission queue is full.
///
/// # Safety
/// Every buffer, iovec array and fd `entry` refers to must stay valid, and be
/// touched by nobody else, until its completion has been reaped (or, for one
/// that is cancelled, until the cancellation's completion has been).
pub unsafe fn push<S: squeue::EntryMarker, C: io_uring::cqueue::EntryMarker>(
    ring: &mut IoUring<S, C>,
    entry: &S,
) -> std::io::Result<()> {
    loop {
        // SAFETY: the caller's contract above is `SubmissionQueue::push`'s.
        if unsafe { ring.submission().push(entry) }.is_ok() {
            return Ok(());
        }
        match ring.submit() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => {
                r?;
            }
        }
    }
}
