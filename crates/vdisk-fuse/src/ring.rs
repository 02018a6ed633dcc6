//! The FUSE-over-io_uring transport: one queue per possible CPU (the kernel
//! sends a request to the queue of the CPU it was issued on), each a thread
//! with its own SQE128 ring and [`depth`] entries.
//!
//! A queue thread waits on its ring only. Requests arrive as completions of
//! the entries' REGISTER/COMMIT_AND_FETCH commands; the thread hands those
//! that need the device to the engine in one batch per wake-up. The engine's
//! completions reach the thread through [`RingSink`]: a list plus an eventfd
//! the ring has a read pending on. The reply is written into the entry's own
//! buffers and committed with the fetch of the next request.
//!
//! The payload buffer of an entry is a pooled [`Buf`]: a READ or WRITE lends
//! it to the engine as the request's buffer, so data is never copied. An
//! entry's buffers stay allocated as long as the kernel may write to them.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use io_uring::{cqueue, opcode, squeue::Entry128, types, IoUring};
use vdisk_engine::wake::EventFd;
use vdisk_engine::{Buf, Op, Request, Sink};

use crate::edge;
use crate::error::{Error, ErrorKind};
use crate::proto::{self, Wire};
use crate::ring_entry::{self, Header};
use crate::session::{Action, ReplyBody, Session, MAX_IO};

/// Entries per queue: 128 in all, spread over the queues, 8 to 64 each. A
/// request waits for an entry of its own CPU's queue, so with few CPUs each
/// queue needs to hold a whole queue depth; with many, each sees a share.
pub fn depth(queues: usize) -> usize {
    (128 / queues.max(1)).clamp(8, 64)
}
const WAKE: u64 = u64::MAX;

/// Completions on their way back to a queue's thread.
pub struct RingSink {
    done: Mutex<Vec<Request>>,
    efd: EventFd,
}

impl Sink for RingSink {
    fn complete(&self, done: Vec<Request>) {
        self.done.lock().unwrap().extend(done);
        self.wake();
    }
}

impl RingSink {
    pub fn wake(&self) {
        self.efd.wake();
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// A command is with the kernel, waiting for a request.
    Waiting,
    /// A request is in the entry; we (or the engine) are answering it.
    Busy,
    /// The kernel gave the entry back for good (connection ended).
    Dead,
}

struct Slot {
    /// Owned; the kernel writes here while the entry is Waiting.
    header: *mut Header,
    payload: Option<Buf>,
    payload_ptr: *const u8,
    /// The two iovecs REGISTER pointed at (kept, since issue may read them late).
    iovs: *mut [libc::iovec; 2],
    state: State,
    unique: u64,
}

/// One queue: its ring, its entries and its thread's state.
pub struct Queue {
    qid: u16,
    fd: RawFd,
    /// Keeps the session descriptor open while the ring uses it.
    _dev: Arc<OwnedFd>,
    ring: IoUring<Entry128, cqueue::Entry>,
    slots: Vec<Slot>,
    sink: Arc<RingSink>,
    dyn_sink: Arc<dyn Sink>,
    session: Arc<Session>,
    /// Where the eventfd read lands; leaked, since a cancelled read may still be settling at exit.
    efd_buf: &'static mut u64,
    efd_armed: bool,
    give_up: Arc<AtomicBool>,
    /// Completions reaped and not yet handled: first those reaped while
    /// starting (once the last queue registers, the kernel may hand an entry a
    /// request before `start` returns). A field, not a local, so that a panic
    /// of the loop loses none of them.
    cqes: VecDeque<(u64, i32)>,
    /// Requests taken for the engine and not yet submitted (a field for the same reason).
    batch: Vec<Request>,
    /// The loop panicked once: from then on every request of this queue gets EIO.
    failed: bool,
}

// SAFETY: the raw pointers are owned allocations used only by the thread that runs the queue.
unsafe impl Send for Queue {}

impl Queue {
    /// Builds the ring and entries of queue `qid` and registers them. An error
    /// here (EOPNOTSUPP: enable_uring is off) means the transport is unusable.
    pub fn start(
        qid: u16,
        depth: usize,
        dev: Arc<OwnedFd>,
        session: Arc<Session>,
        give_up: Arc<AtomicBool>,
    ) -> io::Result<(Queue, Arc<RingSink>)> {
        let ring = IoUring::<Entry128, cqueue::Entry>::builder().build((depth as u32 * 2 + 2).next_power_of_two())?;
        let sink = Arc::new(RingSink { done: Mutex::new(Vec::new()), efd: EventFd::new()? });
        let slots = (0..depth)
            .map(|_| {
                let mut payload = Buf::for_io(MAX_IO);
                payload.set_len(payload.capacity());
                let header = Box::into_raw(Box::new(Header::new()));
                let iovs = Box::into_raw(Box::new([
                    libc::iovec { iov_base: header.cast(), iov_len: size_of::<Header>() },
                    libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() },
                ]));
                Slot {
                    header,
                    payload_ptr: payload.as_ptr(),
                    payload: Some(payload),
                    iovs,
                    state: State::Waiting,
                    unique: 0,
                }
            })
            .collect();
        let mut q = Queue {
            qid,
            fd: dev.as_raw_fd(),
            _dev: dev,
            ring,
            slots,
            dyn_sink: sink.clone(),
            sink: sink.clone(),
            session,
            efd_buf: Box::leak(Box::new(0u64)),
            efd_armed: false,
            give_up,
            cqes: VecDeque::new(),
            batch: Vec::new(),
            failed: false,
        };
        for i in 0..depth {
            let sqe = ring_entry::register(q.fd, qid, q.slots[i].iovs.cast(), i as u64);
            // SAFETY: the entry's header, payload and iovecs are freed only once the
            // kernel has given the entry back (Dead), else leaked (see Drop).
            unsafe { q.push(&sqe)? };
        }
        q.arm_wake()?;
        q.ring.submit()?;
        // A REGISTER that works stays in the kernel until a request arrives in
        // its entry; one that fails completes at once. Registering this queue's
        // first entry may make the ring ready (every queue has one), and the
        // kernel then sends requests waiting for that at once: those
        // completions must be served, not dropped with the check (dropping one
        // left its caller, a `stat`, waiting forever in the kernel).
        let reaped: Vec<(u64, i32)> = q.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        let failed: Vec<(u64, i32)> = reaped.iter().copied().filter(|&(ud, res)| ud != WAKE && res < 0).collect();
        q.cqes = reaped.into();
        if let Some(&(_, res)) = failed.first() {
            // Entries that did register stay Waiting, so Drop leaks rather than frees them.
            for (i, _) in &failed {
                q.slots[*i as usize].state = State::Dead;
            }
            return Err(io::Error::from_raw_os_error(-res));
        }
        Ok((q, sink))
    }

    /// Queues one SQE on this queue's ring.
    ///
    /// # Safety
    /// Every buffer the SQE points at must outlive the command: an entry's
    /// buffers (freed only once the entry is Dead, else leaked) or the leaked
    /// eventfd word.
    unsafe fn push(&mut self, sqe: &Entry128) -> io::Result<()> {
        // SAFETY: the caller's contract above is `submit::push`'s.
        unsafe { vdisk_engine::submit::push(&mut self.ring, sqe) }
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        let read = opcode::Read::new(types::Fd(self.sink.efd.fd()), (self.efd_buf as *mut u64).cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: the read lands in the leaked eventfd word, valid for ever.
        unsafe { self.push(&read.into())? };
        self.efd_armed = true;
        Ok(())
    }

    /// Serves until every entry is gone (the connection ended) or the stop
    /// gives up waiting. The thread's panic edge: a panic of one request is
    /// answered EIO where it happens (see [`Queue::take_guarded`]); one of the
    /// loop itself answers what it held EIO and the loop goes on in a failed
    /// mode where every request of this queue gets EIO, never silence.
    pub fn run(mut self) {
        loop {
            match edge::guard(|| self.serve()) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => {
                    log::error!("fuse ring queue {}: {e}", self.qid);
                    return;
                }
                Err(why) => {
                    log::error!(
                        "fuse {} ring queue {}: the queue's loop panicked: {why}; every request of this queue now gets EIO",
                        self.session.device.name(),
                        self.qid
                    );
                    self.failed = true;
                    if let Err(e) = self.recover() {
                        log::error!("fuse ring queue {}: {e}", self.qid);
                        return;
                    }
                }
            }
        }
    }

    /// After a panic of the loop: requests taken and not submitted get their
    /// entry's payload back, and every entry holding a request that is still
    /// ours to answer is committed with EIO. (An entry whose payload went to
    /// the engine is answered when the engine completes it, or never: it is
    /// not recommitted without its buffer.)
    fn recover(&mut self) -> io::Result<()> {
        for mut req in std::mem::take(&mut self.batch) {
            let i = req.tag as usize;
            if req.op().is_data() {
                let mut buf = req.take_buf();
                if buf.as_ptr() != self.slots[i].payload_ptr {
                    log::error!("fuse ring: an entry's payload buffer was replaced; stopping at once");
                    std::process::abort();
                }
                buf.set_len(buf.capacity());
                self.slots[i].payload = Some(buf);
            }
        }
        for i in 0..self.slots.len() {
            if self.slots[i].state == State::Busy && self.slots[i].payload.is_some() {
                self.reply(i, libc::EIO, &[])?;
            }
        }
        Ok(())
    }

    fn serve(&mut self) -> io::Result<()> {
        let mut done = Vec::new();
        while self.slots.iter().any(|s| s.state != State::Dead) {
            if self.give_up.load(Ordering::Acquire) {
                return Ok(());
            }
            if self.cqes.is_empty() {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => {}
                    // A stopped and continued process (a debugger, a cgroup freeze): wait again.
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    // The completion queue is full (EBUSY) or the kernel is short of
                    // memory (EAGAIN): reap what is there, then submit again.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                        if self.ring.completion().is_empty() {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    Err(e) => return Err(e),
                }
                let reaped: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
                self.cqes.extend(reaped);
            }
            while let Some((ud, res)) = self.cqes.pop_front() {
                if ud == WAKE {
                    self.efd_armed = false;
                    let finished = std::mem::take(&mut *self.sink.done.lock().unwrap());
                    for req in finished {
                        self.finish_guarded(req)?;
                    }
                    continue;
                }
                let i = ud as usize;
                if res < 0 {
                    if res != -libc::ENOTCONN && res != -libc::ECANCELED {
                        log::debug!("fuse ring queue {} entry {i}: {}", self.qid, io::Error::from_raw_os_error(-res));
                    }
                    self.slots[i].state = State::Dead;
                    continue;
                }
                self.take_guarded(i)?;
            }
            #[cfg(test)]
            if self.batch.iter().any(|r| r.offset == crate::session::TEST_PANIC_LOOP_AT) {
                panic!("a test asked the ring queue's loop to panic");
            }
            if !self.batch.is_empty() {
                self.session.inflight.begin(self.batch.len(), 0);
                let batch = std::mem::take(&mut self.batch);
                self.session.device.submit_inline(batch, &self.dyn_sink, &mut done);
                for req in done.drain(..) {
                    self.finish_guarded(req)?;
                }
            }
            if !self.efd_armed {
                self.arm_wake()?;
            }
        }
        Ok(())
    }

    /// [`Queue::take`] at the panic edge: a request whose dispatch panics gets
    /// EIO (its entry still holds its payload) and the queue goes on.
    fn take_guarded(&mut self, i: usize) -> io::Result<()> {
        match edge::guard(|| self.take(i)) {
            Ok(r) => r,
            Err(why) => self.answer_panic(i, "deciding", &why),
        }
    }

    /// [`Queue::finish`] at the panic edge: a reply that panics becomes EIO.
    fn finish_guarded(&mut self, req: Request) -> io::Result<()> {
        let i = req.tag as usize;
        match edge::guard(|| self.finish(req)) {
            Ok(r) => r,
            Err(why) => self.answer_panic(i, "answering", &why),
        }
    }

    /// Entry `i`'s request panicked: EIO if the entry is still ours to commit.
    /// An entry whose payload the panic took is left Busy: recommitting it
    /// would let the kernel write into memory it no longer owns.
    fn answer_panic(&mut self, i: usize, doing: &str, why: &str) -> io::Result<()> {
        let (name, unique) = (self.session.device.name().to_owned(), self.slots[i].unique);
        let slot = &self.slots[i];
        if slot.state != State::Busy || slot.payload.is_none() {
            log::error!("fuse {name} ring queue {}: {doing} request {unique} panicked: {why}", self.qid);
            return Ok(());
        }
        log::error!("fuse {name} ring queue {}: {doing} request {unique} panicked: {why}; it gets EIO", self.qid);
        self.reply(i, libc::EIO, &[])
    }

    /// A request arrived in entry `i`: answer it now or queue it for the engine.
    fn take(&mut self, i: usize) -> io::Result<()> {
        let slot = &mut self.slots[i];
        slot.state = State::Busy;
        // SAFETY: the entry is Busy: the kernel wrote it before posting the CQE
        // and does not touch it until we commit.
        let (h, op, ent) = unsafe {
            let hdr = &*slot.header;
            (proto::InHeader::read(&hdr.in_out).expect("sized"), hdr.op_in, hdr.ent)
        };
        slot.unique = h.unique;
        if self.failed {
            return self.reply(i, libc::EIO, &[]);
        }
        match self.session.dispatch(&h, &op) {
            Action::Reply(errno, body) => self.reply(i, errno, &body),
            Action::Nothing => self.reply(i, 0, &[]),
            Action::Submit(mut req) => {
                req.tag = i as u64;
                let (op, len) = (req.op(), req.len);
                if let Some(data) = req.cmd.data_mut() {
                    if op != Op::Read && ent.payload_sz as u64 != len {
                        return self.reply(i, libc::EINVAL, &[]);
                    }
                    let mut buf = slot.payload.take().expect("an idle entry has its payload");
                    buf.set_len(len as usize);
                    *data = buf.into();
                }
                self.batch.push(req);
                Ok(())
            }
        }
    }

    /// The engine finished the request of entry `req.tag`.
    fn finish(&mut self, mut req: Request) -> io::Result<()> {
        self.session.inflight.end(1, 0);
        let i = req.tag as usize;
        let mut body_len = 0;
        if req.op().is_data() {
            let mut buf = req.take_buf();
            if buf.as_ptr() != self.slots[i].payload_ptr {
                // The kernel holds this entry's payload address: had the engine
                // swapped buffers, the registered one would be back in the pool.
                log::error!("fuse ring: the engine replaced an entry's payload buffer; stopping at once");
                std::process::abort();
            }
            buf.set_len(buf.capacity());
            body_len = req.len as usize;
            self.slots[i].payload = Some(buf);
        }
        let (errno, body) = self.session.reply_of(&req, self.slots[i].unique);
        match body {
            // A READ's data is already in the payload: the engine read into it.
            ReplyBody::Data => self.commit(i, errno, body_len),
            ReplyBody::Out(b) => self.reply(i, errno, &b),
            ReplyBody::Empty => self.reply(i, errno, &[]),
        }
    }

    /// Copies `body` into the entry's payload and commits.
    fn reply(&mut self, i: usize, errno: i32, body: &[u8]) -> io::Result<()> {
        let payload = self.slots[i].payload.as_mut().expect("an answered entry has its payload");
        payload[..body.len()].copy_from_slice(body);
        self.commit(i, errno, body.len())
    }

    /// Writes the out header and payload size, then COMMIT_AND_FETCH.
    fn commit(&mut self, i: usize, errno: i32, payload_len: usize) -> io::Result<()> {
        let slot = &mut self.slots[i];
        let out = proto::OutHeader { len: (16 + payload_len) as u32, error: -errno, unique: slot.unique };
        // SAFETY: the entry is Busy (the kernel is not using it) and the header is ours.
        unsafe {
            let hdr = &mut *slot.header;
            hdr.in_out[..16].copy_from_slice(out.bytes());
            hdr.ent.payload_sz = payload_len as u32;
        }
        slot.state = State::Waiting;
        let sqe = ring_entry::commit_and_fetch(self.fd, self.qid, slot.unique, i as u64);
        // SAFETY: the entry's buffers outlive the command (freed only once Dead, else leaked).
        unsafe { self.push(&sqe) }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let all_dead = self.slots.iter().all(|s| s.state == State::Dead);
        for s in self.slots.drain(..) {
            if all_dead {
                // SAFETY: allocated by Box::into_raw in `start`; the kernel let go of every entry.
                drop(unsafe { Box::from_raw(s.header) });
                // SAFETY: as above, for the entry's iovecs.
                drop(unsafe { Box::from_raw(s.iovs) });
            } else {
                // The kernel may still write to these: leak them rather than free them under it.
                std::mem::forget(s.payload);
            }
        }
    }
}

/// The queues the kernel expects: one per possible CPU.
pub fn queue_count() -> usize {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let max = s.trim().split(',').filter_map(|r| r.rsplit('-').next()?.parse::<usize>().ok()).max();
    max.map(|m| m + 1).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// Why the ring transport cannot run here, if it cannot: one line with the fix.
pub fn check_enabled() -> Result<(), Error> {
    const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";
    match std::fs::read_to_string(PARAM) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => Ok(()),
        Ok(_) => Err(Error::new(
            ErrorKind::RingOff,
            format!("FUSE-over-io_uring is off ({PARAM} is N); turn it on with: echo Y > {PARAM} (as root)"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::RingMissing,
            format!(
                "this kernel has no FUSE-over-io_uring ({PARAM} is missing; needs Linux 6.14+ built \
                 with CONFIG_FUSE_IO_URING, then echo Y > {PARAM} (as root))"
            ),
        )),
    }
}
