//! The outbox of a connection: replies on their way to the client, and the
//! in-flight accounting that bounds a connection's memory.
//!
//! Whoever completes requests sends their replies: the reader (for requests
//! done inline), an engine worker or ring (through the [`Sink`]). If nobody is
//! sending and nothing is queued, the completer sends at once with one
//! non-blocking vectored `sendmsg`; otherwise, or when the socket is full, the
//! replies queue up and the connection's writer thread sends them, blocking as
//! needed. So in the common case a reply costs no thread hand-off, and a client
//! that stops reading only ever blocks its own writer.
//!
//! Every reply is also accounted against the server-wide [`Budget`]: unread
//! from completion until the socket takes it, released then (or when dropped
//! with a broken client). While the writer is blocked on a full socket it
//! says so ([`Budget::sending`]), so the server can cut off a client that
//! takes nothing for `--send-timeout`.
//!
//! A read's reply data is only held while the client takes it. Reads run
//! only while the connection's reads in flight and unsent replies stay under
//! its read window (the reader stops reading the socket past it, so further
//! requests wait in the kernel's receive buffer). The window starts at
//! [`READ_WINDOW`], doubles each time the socket takes replies whole, up to
//! [`MAX_READ_WINDOW`] (so a client that reads keeps enough large reads in
//! flight to cover a slow backend's latency, an RBD image's), and falls back
//! to [`READ_WINDOW`] when the writer parks. And when the socket has taken nothing for
//! `SEND_WAKE` (lib.rs), the writer *parks*: the
//! data of the read replies it could not send is dropped (released from the
//! budget; headers, the export offset and how much was sent are kept), and
//! read again from the image once the socket takes bytes again. NBD lets a
//! read that overlaps a concurrent write return either data; every write
//! acknowledged before the read was received is in the image both times.

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use smallvec::SmallVec;
use vdisk_engine::inflight::Counts;
use vdisk_engine::{Buf, Command, Device, Op, Request, Sink};

use crate::budget::{Account, Budget};
use crate::reply::{Encoder, OutMsg, REQUEST_OVERHEAD};
use crate::stream::Stream;

pub const MAX_INFLIGHT_BYTES: usize = 64 << 20;
/// Reads run only while less than the connection's read window is in flight
/// or unsent (one read always may): what a client that stops reading makes
/// the server read for nothing. The window starts here, and comes back here
/// when the writer parks.
pub const READ_WINDOW: usize = 2 << 20;
/// The most a client that takes its replies may have in flight in reads.
pub const MAX_READ_WINDOW: usize = 16 << 20;

pub struct Outbox {
    state: Mutex<State>,
    changed: Condvar,
    stream: Stream,
    encoder: Encoder,
    batching: bool,
    /// Cookies of reads in flight whose reply must be one chunk (NBD's DF
    /// flag, rarely set): the reply needs it, the engine does not. `df_count`
    /// lets every other read skip the lock.
    df: Mutex<HashMap<u64, usize>>,
    df_count: AtomicUsize,
    budget: Arc<Budget>,
    account: Arc<Account>,
    /// Where dropped read data is read again from.
    device: Arc<Device>,
}

#[derive(Default)]
struct State {
    /// Replies waiting for the writer thread; the first may be partly sent.
    queue: Vec<OutMsg>,
    /// Bytes of `queue[0]` already sent.
    sent: usize,
    /// Someone is sending right now.
    sending: bool,
    /// Requests read and not yet answered, and their cost.
    inflight: Counts,
    /// How much reads may have in flight or unsent (the module doc).
    read_window: usize,
    /// The writer thread is blocked on `changed`.
    writer_waiting: bool,
    /// The reader is blocked on `changed`, over its in-flight budget.
    reader_waiting: bool,
    reader_done: bool,
    /// The client is gone: replies are dropped.
    broken: bool,
    /// Replies were taken by a non-blocking send but some of their bytes still
    /// wait in the stream (TLS ciphertext): the writer must flush them.
    flush_owed: bool,
}

impl Sink for Outbox {
    fn complete(&self, done: Vec<Request>) {
        let mut msgs = Vec::with_capacity(done.len());
        msgs.extend(done.into_iter().map(|r| self.encode(r)));
        self.deliver(msgs);
    }
}

impl Outbox {
    pub fn new(
        stream: Stream,
        encoder: Encoder,
        batching: bool,
        budget: Arc<Budget>,
        account: Arc<Account>,
        device: Arc<Device>,
    ) -> Self {
        Outbox {
            state: Mutex::new(State { read_window: READ_WINDOW, ..State::default() }),
            changed: Condvar::new(),
            stream,
            encoder,
            batching,
            df: Mutex::new(HashMap::new()),
            df_count: AtomicUsize::new(0),
            budget,
            account,
            device,
        }
    }

    /// Notes that the read with this cookie, about to be submitted, has DF set.
    pub fn dont_fragment(&self, cookie: u64) {
        *self.df.lock().unwrap().entry(cookie).or_default() += 1;
        self.df_count.fetch_add(1, Ordering::AcqRel);
    }

    /// The reply to a completed request (DF looked up for reads).
    fn encode(&self, req: Request) -> OutMsg {
        let mut df = false;
        if req.op() == Op::Read && self.df_count.load(Ordering::Acquire) > 0 {
            let mut map = self.df.lock().unwrap();
            if let Some(n) = map.get_mut(&req.tag) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&req.tag);
                }
                self.df_count.fetch_sub(1, Ordering::AcqRel);
                df = true;
            }
        }
        self.encoder.encode(req, df)
    }

    /// Wakes whoever has something to do now; a futex call only when owed.
    fn notify(&self, st: &State) {
        let writer_has_work =
            !st.sending && (!st.queue.is_empty() || st.flush_owed || (st.reader_done && st.inflight.is_idle()));
        if st.reader_waiting || (st.writer_waiting && writer_has_work) {
            self.changed.notify_all();
        }
    }

    /// Sends `msgs` now if the socket is free and takes them; else queues them for the writer.
    pub fn deliver(&self, msgs: Vec<OutMsg>) {
        if msgs.is_empty() {
            return;
        }
        self.budget.completed(&self.account, msgs.iter().map(|m| m.cost).sum());
        let mut st = self.state.lock().unwrap();
        if st.broken {
            self.release(&mut st, &msgs, false);
            self.notify(&st);
            return;
        }
        if st.sending || !st.queue.is_empty() || !self.batching {
            st.queue.extend(msgs);
            self.notify(&st);
            return;
        }
        st.sending = true;
        drop(st);
        let r = send(&self.stream, &msgs, 0, false, &|| {}, &|| true);
        let owed = matches!(r, Ok(Sent::All)) && self.stream.needs_flush();
        let mut st = self.state.lock().unwrap();
        st.sending = false;
        match r {
            Ok(Sent::All) => {
                st.flush_owed |= owed;
                self.release(&mut st, &msgs, true)
            }
            Ok(Sent::Partly { done, skip }) => {
                self.release(&mut st, &msgs[..done], true);
                // The writer finishes the rest, before anything queued meanwhile.
                let mut rest: Vec<OutMsg> = msgs.into_iter().skip(done).collect();
                rest.append(&mut st.queue);
                st.queue = rest;
                st.sent = skip;
            }
            Err(e) => {
                self.fail(&mut st, e);
                self.release(&mut st, &msgs, false);
            }
        }
        self.notify(&st);
    }

    fn fail(&self, st: &mut State, e: io::Error) {
        if !st.broken {
            log::info!("{}: cannot send replies ({e}); dropping the connection", self.stream.peer());
            st.broken = true;
            self.stream.shutdown(Shutdown::Both);
            // A reader waiting for the server-wide budget goes on to its end.
            self.budget.cancel(&self.account);
        }
    }

    /// Replies that left (`sent`) or were dropped: their requests no longer count.
    /// (What a parked reply's dropped data held went back to the budget then.)
    fn release(&self, st: &mut State, msgs: &[OutMsg], sent: bool) {
        let bytes = msgs.iter().map(|m| m.cost).sum::<usize>();
        st.inflight.remove(msgs.len(), bytes);
        if sent && !msgs.is_empty() {
            st.read_window = (st.read_window * 2).min(MAX_READ_WINDOW);
        }
        let held = msgs.iter().map(|m| if m.dropped { REQUEST_OVERHEAD.min(m.cost) } else { m.cost }).sum::<usize>();
        self.budget.release(&self.account, held, held, sent);
    }

    /// Adds a request to the in-flight count. Without `wait`, refuses (false)
    /// when over budget; with it, blocks until replies drain.
    /// A read waits while its window is in flight or unsent.
    pub fn charge(&self, cost: usize, read: bool, wait: bool) -> bool {
        let mut st = self.state.lock().unwrap();
        while !st.inflight.admits(cost, if read { st.read_window } else { MAX_INFLIGHT_BYTES }) {
            if !wait {
                return false;
            }
            st.reader_waiting = true;
            st = self.changed.wait(st).unwrap();
            st.reader_waiting = false;
        }
        st.inflight.add(1, cost);
        true
    }

    /// The reader is done: once nothing is in flight, the writer stops.
    pub fn reader_done(&self) {
        let mut st = self.state.lock().unwrap();
        st.reader_done = true;
        self.notify(&st);
    }

    /// The writer thread: sends what is queued, blocking as needed, until the
    /// reader is done and every request has been answered (or dropped).
    pub fn write_queued(&self) {
        let mut st = self.state.lock().unwrap();
        loop {
            if (st.queue.is_empty() && !st.flush_owed) || st.sending {
                if st.reader_done && st.inflight.is_idle() && !st.sending && !st.flush_owed {
                    return;
                }
                st.writer_waiting = true;
                st = self.changed.wait(st).unwrap();
                st.writer_waiting = false;
                continue;
            }
            // A blocking send below flushes what is owed first.
            st.flush_owed = false;
            if st.queue.is_empty() {
                if st.broken {
                    continue;
                }
                st.sending = true;
                drop(st);
                self.budget.sending(&self.account);
                let r = self.stream.flush_pending();
                self.budget.idle(&self.account);
                st = self.state.lock().unwrap();
                st.sending = false;
                if let Err(e) = r {
                    self.fail(&mut st, e);
                }
                self.notify(&st);
                continue;
            }
            let mut msgs = std::mem::take(&mut st.queue);
            let skip = std::mem::take(&mut st.sent);
            if st.broken {
                self.release(&mut st, &msgs, false);
                continue;
            }
            // Dropped data is read again one reply at a time: send up to the next one.
            if let Some(k) = msgs.iter().skip(1).position(|m| m.dropped) {
                let mut rest = msgs.split_off(k + 1);
                rest.append(&mut st.queue);
                st.queue = rest;
            }
            st.sending = true;
            drop(st);
            let progress = || self.budget.sending(&self.account);
            progress();
            let reloaded = if msgs[0].dropped { self.reload(&mut msgs[0]) } else { Ok(()) };
            // A socket that takes nothing for SEND_WAKE: park if there is read data to drop.
            let droppable = !self.stream.is_tls() && msgs.iter().any(|m| m.read_at.is_some() && !m.dropped);
            let give_up = || droppable;
            let r = reloaded.and_then(|()| {
                if self.batching {
                    send(&self.stream, &msgs, skip, true, &progress, &give_up)
                } else {
                    let mut r = Ok(Sent::All);
                    for i in 0..msgs.len() {
                        r = send(&self.stream, &msgs[i..=i], if i == 0 { skip } else { 0 }, true, &progress, &give_up);
                        if let Ok(Sent::Partly { done, skip }) = r {
                            r = Ok(Sent::Partly { done: done + i, skip });
                        }
                        if !matches!(r, Ok(Sent::All)) {
                            break;
                        }
                    }
                    r
                }
            });
            st = self.state.lock().unwrap();
            st.sending = false;
            match r {
                Ok(Sent::All) => {
                    self.budget.idle(&self.account);
                    self.release(&mut st, &msgs, true);
                }
                Ok(Sent::Partly { done, skip }) => {
                    // Parked: what could not go drops its data and waits for the socket.
                    let mut rest = msgs.split_off(done);
                    self.release(&mut st, &msgs, true);
                    st.read_window = READ_WINDOW;
                    for m in &mut rest {
                        self.drop_data(m);
                    }
                    rest.append(&mut st.queue);
                    st.queue = rest;
                    st.sent = skip;
                    st.sending = true;
                    drop(st);
                    // The stall clock runs on: the watchdog still cuts a client that never reads.
                    let r = wait_writable(&self.stream);
                    st = self.state.lock().unwrap();
                    st.sending = false;
                    if let Err(e) = r {
                        self.fail(&mut st, e);
                    }
                }
                Err(e) => {
                    self.budget.idle(&self.account);
                    self.fail(&mut st, e);
                    self.release(&mut st, &msgs, false);
                }
            }
            self.notify(&st);
        }
    }

    /// Drops the data of a read's reply not yet sent: its bytes go back to the budget.
    fn drop_data(&self, m: &mut OutMsg) {
        let len = m.cost.saturating_sub(REQUEST_OVERHEAD);
        if m.read_at.is_none() || m.dropped || m.data.len() != len || len == 0 {
            return;
        }
        m.data = Buf::new();
        m.dropped = true;
        self.budget.release(&self.account, len, len, false);
    }

    /// Reads a parked reply's data again (the whole range it was read from),
    /// charging it to the budget first.
    fn reload(&self, m: &mut OutMsg) -> io::Result<()> {
        let (Some(at), len) = (m.read_at, m.cost.saturating_sub(REQUEST_OVERHEAD)) else { return Ok(()) };
        if !self.budget.try_charge(len, &self.account) {
            self.budget.charge(len, &self.account);
        }
        self.budget.completed(&self.account, len);
        m.dropped = false;
        let once = Arc::new(Once::default());
        let sink: Arc<dyn Sink> = once.clone();
        self.device.submit(vec![Request::new(Command::new(Op::Read, Buf::new().into()), at, len as u64, 0)], &sink);
        let mut done = once.wait();
        if let Some(e) = &done.error {
            // Part of the reply may be out already: its data cannot become an error now.
            return Err(io::Error::other(format!(
                "reading {len} bytes at offset {at} again for a reply the client had stopped taking: {}",
                e.message()
            )));
        }
        m.data = done.take_buf();
        Ok(())
    }
}

/// Where one request submitted by the writer comes back.
#[derive(Default)]
struct Once {
    done: Mutex<Option<Request>>,
    ready: Condvar,
}

impl Sink for Once {
    fn complete(&self, mut done: Vec<Request>) {
        *self.done.lock().unwrap() = done.pop();
        self.ready.notify_all();
    }
}

impl Once {
    fn wait(&self) -> Request {
        let mut done = self.done.lock().unwrap();
        loop {
            if let Some(r) = done.take() {
                return r;
            }
            done = self.ready.wait(done).unwrap();
        }
    }
}

/// Waits until the socket takes bytes again (or fails: the client left or was cut off).
fn wait_writable(stream: &Stream) -> io::Result<()> {
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    loop {
        // SAFETY: pfd is one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, 5000) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r > 0 {
            if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the client's socket was closed"));
            }
            return Ok(());
        }
    }
}

enum Sent {
    All,
    /// `done` messages went whole, and `skip` bytes of the next one.
    Partly {
        done: usize,
        skip: usize,
    },
}

/// Sends `msgs` (skipping `skip` bytes of the first) with vectored `sendmsg`.
/// Blocking: until all is sent (a send timeout on the socket only makes it
/// report `progress` more often; the server decides when to give up).
/// Non-blocking: until the socket is full.
/// A blocking send that made no progress for a while returns early when
/// `give_up` says so.
fn send(
    stream: &Stream,
    msgs: &[OutMsg],
    skip: usize,
    blocking: bool,
    progress: &dyn Fn(),
    give_up: &dyn Fn() -> bool,
) -> io::Result<Sent> {
    // A batch of replies to a queue of 32 fits on the stack.
    let mut slices: SmallVec<[&[u8]; 64]> = SmallVec::with_capacity(msgs.len() * 2);
    let mut ends: SmallVec<[usize; 32]> = SmallVec::with_capacity(msgs.len());
    let mut total = 0usize;
    for m in msgs {
        for s in m.slices() {
            total += s.len();
            slices.push(s);
        }
        ends.push(total);
    }
    let mut at = skip;
    while at < total {
        match stream.send_from(&slices, at, blocking) {
            Ok(n) => {
                at += n;
                progress();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && blocking && !give_up() => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let done = ends.iter().take_while(|&&end| end <= at).count();
                let start = if done == 0 { 0 } else { ends[done - 1] };
                return Ok(Sent::Partly { done, skip: at - start });
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Sent::All)
}
