//! The classic transport: threads reading /dev/fuse (each its own cloned
//! descriptor, since a reply must go back on the descriptor its request came
//! from) and answering with one `writev` per reply.
//!
//! A reader reads with two iovecs, 80 bytes then a 1 MiB pooled buffer: a
//! WRITE's header is exactly 80 bytes, so its data lands 4 KiB-aligned in a
//! buffer the engine takes as it is (no copy; writes up to 64 KiB are copied
//! into a buffer of their size instead, so small writes in flight do not each
//! hold 1 MiB). A reader keeps reading until
//! nothing is waiting (the descriptor is non-blocking), then hands the whole
//! batch to the engine and waits in poll(2). Completions are answered by the
//! engine thread that finished them, through [`FdSink`].

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use vdisk_engine::{Buf, Op, Request, Sink};

use crate::edge;
use crate::proto::{self, Wire};
use crate::session::{Action, ReplyBody, Session, MAX_IO};

/// Most requests a reader hands the engine at once.
const BATCH: usize = 64;
/// WRITE data up to this size is copied out of the reader's 1 MiB buffer (a
/// 4 KiB write would otherwise hold a whole 1 MiB buffer while in flight);
/// larger writes take the buffer itself.
const COPY_MAX: usize = 64 << 10;

/// Answers on one /dev/fuse descriptor.
pub struct FdSink {
    pub fd: OwnedFd,
    pub session: Arc<Session>,
}

impl FdSink {
    /// Sends one reply; a request the kernel gave up on (interrupted, or the
    /// connection aborted) is not an error worth more than a debug line.
    pub fn send(&self, unique: u64, errno: i32, body: &[u8]) {
        let h = proto::OutHeader { len: (16 + body.len()) as u32, error: -errno, unique };
        let iov = [
            libc::iovec { iov_base: h.bytes().as_ptr() as *mut _, iov_len: 16 },
            libc::iovec { iov_base: body.as_ptr() as *mut _, iov_len: body.len() },
        ];
        let n = if body.is_empty() { 1 } else { 2 };
        loop {
            // SAFETY: both iovecs point at live buffers of the given lengths; the
            // kernel only reads them.
            let r = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), n) };
            if r >= 0 {
                return;
            }
            let e = io::Error::last_os_error();
            // A lost reply would leave the caller waiting in the kernel for ever.
            if e.kind() != io::ErrorKind::Interrupted {
                log::debug!("fuse: reply to request {unique}: {e}");
                return;
            }
        }
    }

    fn answer(&self, req: &Request) {
        let (errno, body) = self.session.reply_of(req, req.tag);
        match body {
            ReplyBody::Empty => self.send(req.tag, errno, &[]),
            ReplyBody::Data => self.send(req.tag, errno, &req.buf()[..req.len as usize]),
            ReplyBody::Out(b) => self.send(req.tag, errno, &b),
        }
    }
}

impl Sink for FdSink {
    fn complete(&self, done: Vec<Request>) {
        // Ended already (a submit that panicked answered it EIO): not again.
        let settled = self.session.owed.settle(&self.session.inflight, done.iter().map(|r| r.tag));
        for (req, _) in done.iter().zip(&settled.owed).filter(|(_, owed)| **owed) {
            if let Err(why) = edge::guard(|| self.answer(req)) {
                log::error!(
                    "fuse {}: answering request {} panicked: {why}; it gets EIO",
                    self.session.device.name(),
                    req.tag
                );
                self.send(req.tag, libc::EIO, &[]);
            }
        }
        // The buffers go first, then the count (a stop waits for it).
        drop(done);
        drop(settled);
    }
}

/// What a reader's read returned.
enum Got {
    Request(usize),
    /// Nothing waiting right now.
    Empty,
    /// The file system is gone (unmounted or aborted).
    Gone,
}

/// One reader thread's state.
pub struct Reader {
    sink: Arc<FdSink>,
    dyn_sink: Arc<dyn Sink>,
    head: [u8; proto::WRITE_HEADER],
    payload: Buf,
    /// The loop itself panicked once: from then on every request gets EIO.
    failed: bool,
    /// The request being decided, answered EIO if the loop panics on it.
    current: Option<u64>,
}

fn fresh_payload() -> Buf {
    let mut b = Buf::for_io(MAX_IO);
    b.set_len(b.capacity());
    b
}

impl Reader {
    pub fn new(fd: OwnedFd, session: Arc<Session>) -> io::Result<Reader> {
        // SAFETY: F_GETFL on a descriptor we own; it touches no memory.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: F_SETFL on a descriptor we own; it touches no memory.
        if fl < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let sink = Arc::new(FdSink { fd, session });
        Ok(Reader {
            dyn_sink: sink.clone(),
            sink,
            head: [0; proto::WRITE_HEADER],
            payload: fresh_payload(),
            failed: false,
            current: None,
        })
    }

    fn read(&mut self) -> Got {
        loop {
            let iov = [
                libc::iovec { iov_base: self.head.as_mut_ptr().cast(), iov_len: self.head.len() },
                libc::iovec { iov_base: self.payload.as_mut_ptr().cast(), iov_len: self.payload.len() },
            ];
            // SAFETY: both iovecs are buffers we own, writable for their lengths.
            let n = unsafe { libc::readv(self.sink.fd.as_raw_fd(), iov.as_ptr(), 2) };
            if n > 0 {
                return Got::Request(n as usize);
            }
            if n == 0 {
                return Got::Gone; // never from /dev/fuse; the end of a test's socket
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EAGAIN) => return Got::Empty,
                // Interrupted by a signal, or the request was interrupted before we read it.
                Some(libc::EINTR) | Some(libc::ENOENT) => continue,
                Some(libc::ENODEV) => return Got::Gone,
                _ => {
                    log::warn!("fuse: reading /dev/fuse: {}", io::Error::last_os_error());
                    return Got::Gone;
                }
            }
        }
    }

    /// Waits for a request. EINTR (a stopped and continued process) just
    /// returns: the caller reads again, and waits again if nothing came.
    fn wait(&self) {
        let mut p = libc::pollfd { fd: self.sink.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, -1) };
    }

    /// Serves requests until the file system goes away. The thread's panic
    /// edge: a panic deciding one request answers it EIO (in [`Reader::serve`]);
    /// one in the loop itself is logged and the loop starts again in a
    /// failed mode where every request gets EIO, so no caller ever waits for ever.
    pub fn run(mut self) {
        let name = self.sink.session.device.name().to_owned();
        while let Err(why) = edge::guard(|| self.serve()) {
            log::error!("fuse {name}: the /dev/fuse reader panicked: {why}; every request now gets EIO");
            self.failed = true;
            if let Some(unique) = self.current.take() {
                self.sink.send(unique, libc::EIO, &[]);
            }
        }
    }

    /// Decides what to do with the request just read (`n` bytes, header `h`).
    fn decide(&mut self, session: &Session, h: &proto::InHeader, n: usize) -> Action {
        if self.failed {
            return Action::Reply(libc::EIO, Vec::new());
        }
        #[cfg(test)]
        if h.opcode == crate::session::TEST_PANIC_IN_LOOP {
            panic!("a test asked the reader loop to panic");
        }
        if h.opcode == proto::WRITE && n >= proto::WRITE_HEADER {
            let action = session.dispatch(h, &self.head[40..]);
            match action {
                Action::Submit(mut req) if matches!(req.op(), Op::Write { .. }) => {
                    let data = n - proto::WRITE_HEADER;
                    if data as u64 != req.len {
                        Action::Reply(libc::EINVAL, Vec::new())
                    } else {
                        let buf = if data <= COPY_MAX {
                            Buf::from_slice(&self.payload[..data])
                        } else {
                            let mut buf = std::mem::replace(&mut self.payload, fresh_payload());
                            buf.set_len(data);
                            buf
                        };
                        if let Some(into) = req.cmd.data_mut() {
                            *into = buf.into();
                        }
                        Action::Submit(req)
                    }
                }
                other => other,
            }
        } else {
            let mut all = self.head[..n.min(proto::WRITE_HEADER)].to_vec();
            if n > proto::WRITE_HEADER {
                all.extend_from_slice(&self.payload[..n - proto::WRITE_HEADER]);
            }
            session.dispatch(h, &all[40..])
        }
    }

    fn serve(&mut self) {
        let session = self.sink.session.clone();
        let mut batch: Vec<Request> = Vec::new();
        let mut done: Vec<Request> = Vec::new();
        loop {
            let n = match self.read() {
                Got::Request(n) => n,
                Got::Empty => {
                    self.submit(&mut batch, &mut done);
                    self.wait();
                    continue;
                }
                Got::Gone => break,
            };
            let Some(h) = proto::InHeader::read(&self.head[..n.min(proto::WRITE_HEADER)]) else {
                log::warn!("fuse: short request of {n} bytes");
                continue;
            };
            self.current = Some(h.unique);
            let action = match h.opcode {
                // The loop's own test fault is not one request's: it must reach the edge.
                #[cfg(test)]
                crate::session::TEST_PANIC_IN_LOOP => self.decide(&session, &h, n),
                _ => edge::guard(|| self.decide(&session, &h, n)).unwrap_or_else(|why| {
                    log::error!(
                        "fuse {}: request {} (opcode {}) panicked: {why}; it gets EIO",
                        session.device.name(),
                        h.unique,
                        h.opcode
                    );
                    Action::Reply(libc::EIO, Vec::new())
                }),
            };
            self.current = None;
            match action {
                Action::Reply(errno, body) => self.sink.send(h.unique, errno, &body),
                Action::Submit(req) => {
                    batch.push(req);
                    if batch.len() >= BATCH {
                        self.submit(&mut batch, &mut done);
                    }
                }
                Action::Nothing => {}
            }
        }
        self.submit(&mut batch, &mut done);
    }

    fn submit(&self, batch: &mut Vec<Request>, done: &mut Vec<Request>) {
        if batch.is_empty() {
            return;
        }
        let session = &self.sink.session;
        // Counted in until each is answered; the guard ends what a panic leaves.
        let begun = session.owed.begin(&session.inflight, batch.iter().map(|r| r.tag).collect());
        #[cfg(test)]
        let test_panic = batch.iter().any(|r| r.offset == crate::session::TEST_PANIC_SUBMIT_AT);
        let submitted = edge::guard(|| {
            #[cfg(test)]
            if test_panic {
                batch.clear();
                panic!("a test asked a submit to panic");
            }
            session.device.submit_inline(std::mem::take(batch), &self.dyn_sink, done)
        });
        if let Err(why) = submitted {
            // Those not answered yet get EIO now and are counted out; should
            // the engine still finish one, its completion is dropped (owed.rs).
            done.clear();
            let unanswered = begun.abandon();
            log::error!(
                "fuse {}: submitting {} request(s) panicked: {why}; they get EIO",
                session.device.name(),
                unanswered.len()
            );
            for unique in unanswered {
                self.sink.send(unique, libc::EIO, &[]);
            }
            return;
        }
        begun.handed_over();
        if !done.is_empty() {
            self.sink.complete(std::mem::take(done));
        }
    }
}

/// Reads FUSE_INIT (the first request after mount) with a blocking read on the session descriptor.
pub fn read_init(fd: &OwnedFd) -> io::Result<(proto::InHeader, proto::InitIn)> {
    let mut buf = vec![0u8; MAX_IO + proto::WRITE_HEADER];
    loop {
        // SAFETY: `buf` is ours and writable for its length.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let n = n as usize;
        let h = proto::InHeader::read(&buf[..n]).ok_or_else(|| io::Error::other("short FUSE request"))?;
        if h.opcode != proto::INIT {
            return Err(io::Error::other(format!("expected FUSE_INIT first, got opcode {}", h.opcode)));
        }
        // Older kernels send a shorter fuse_init_in: the rest reads as zero.
        let mut arg = [0u8; size_of::<proto::InitIn>()];
        let have = (n - 40).min(arg.len());
        arg[..have].copy_from_slice(&buf[40..40 + have]);
        return Ok((h, proto::InitIn::read(&arg).expect("sized")));
    }
}
