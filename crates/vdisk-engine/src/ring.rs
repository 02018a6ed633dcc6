//! One engine ring and its every `io_uring_enter`. This is where the ring
//! worker's blocking calls are, and where they are made never to die of what
//! a healthy process meets:
//! - EINTR (the process was stopped and continued, a debugger or `strace -p`
//!   attached, a cgroup froze it): the call is made again; nothing is logged;
//! - EBUSY or EAGAIN (the completion queue is full and the kernel holds
//!   overflowed completions, or it is short of memory for a moment): the
//!   completions are moved out of the ring into `backlog`, which makes room,
//!   and the call is made again (after a short pause when there was nothing
//!   to move);
//! - anything else is returned: the worker fails the device.
//!
//! Completions are taken out only through [`Ring::completions`], which hands
//! the backlog first, so none is lost or seen twice.

use std::time::Duration;

use io_uring::{squeue, types, IoUring};

use crate::faults::{EnterFault, Faults};

pub(crate) struct Ring {
    pub ring: IoUring,
    /// Completions moved out of the ring to make room (see the module's notes).
    backlog: Vec<(u64, i32)>,
    faults: Option<std::sync::Arc<Faults>>,
}

/// True for the errors of `io_uring_enter` that mean "reap, then call again".
fn full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN))
}

fn interrupted(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINTR)
}

impl Ring {
    pub fn new(ring: IoUring, faults: Option<std::sync::Arc<Faults>>) -> Ring {
        Ring { ring, backlog: Vec::new(), faults }
    }

    /// An injected result for this enter (tests only), if any.
    fn injected(&self) -> Option<std::io::Error> {
        match self.faults.as_ref()?.check_enter()? {
            EnterFault::Interrupt => Some(std::io::Error::from_raw_os_error(libc::EINTR)),
            EnterFault::Fail(errno) => Some(std::io::Error::other(format!(
                "io_uring_enter: {} (injected by VDISK_FAULTS)",
                std::io::Error::from_raw_os_error(errno)
            ))),
        }
    }

    /// Submits what is queued and, with `wait`, waits for at least one
    /// completion (or returns at once when the backlog already holds some).
    pub fn enter(&mut self, wait: bool) -> std::io::Result<()> {
        loop {
            if wait && !self.backlog.is_empty() {
                // Completions are waiting already: submit without sleeping.
                return self.enter(false);
            }
            let r = match self.injected() {
                Some(e) => Err(e),
                None => self.ring.submit_and_wait(usize::from(wait)),
            };
            match r {
                Ok(_) => return Ok(()),
                Err(e) if interrupted(&e) => continue,
                Err(e) if full(&e) => self.make_room(),
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits up to `limit` for a completion (submitting what is queued).
    /// Ok(false) when the time ran out or a signal came first.
    pub fn wait_for(&mut self, limit: Duration) -> std::io::Result<bool> {
        if !self.backlog.is_empty() {
            return Ok(true);
        }
        let ts = types::Timespec::from(limit);
        let args = types::SubmitArgs::new().timespec(&ts);
        let r = match self.injected() {
            Some(e) => Err(e),
            None => self.ring.submitter().submit_with_args(1, &args),
        };
        match r {
            Ok(_) => Ok(true),
            Err(e) if interrupted(&e) || e.raw_os_error() == Some(libc::ETIME) => Ok(false),
            Err(e) if full(&e) => {
                self.make_room();
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }

    /// Moves the completions out of the ring into the backlog; pauses
    /// briefly when there were none (the kernel is short of memory).
    fn make_room(&mut self) {
        let before = self.backlog.len();
        self.backlog.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        if self.backlog.len() == before {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Appends every completion there is (the backlog first) to `out`.
    pub fn completions(&mut self, out: &mut Vec<(u64, i32)>) {
        out.append(&mut self.backlog);
        out.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
    }

    /// Queues one SQE, submitting first while the submission queue is full.
    ///
    /// # Safety
    /// Every buffer, iovec array and fd the entry refers to must stay valid and
    /// untouched by anyone else until its completion is reaped. The callers
    /// guarantee it by keeping the owner (the request and the `OpKind` holding
    /// the iovecs, or the eventfd buffer) in the in-flight table until then,
    /// or by leaking it when the ring cannot be reaped.
    pub unsafe fn push(&mut self, entry: &squeue::Entry) -> std::io::Result<()> {
        loop {
            // SAFETY: the caller's contract above is `SubmissionQueue::push`'s.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            self.enter(false)?;
        }
    }

    /// Free slots in the submission queue.
    pub fn room(&mut self) -> usize {
        let sq = self.ring.submission();
        sq.capacity() - sq.len()
    }
}
