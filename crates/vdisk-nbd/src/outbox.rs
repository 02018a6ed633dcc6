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

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use smallvec::SmallVec;
use vdisk_engine::inflight::Counts;
use vdisk_engine::{Op, Request, Sink};

use crate::budget::{Account, Budget};
use crate::reply::{Encoder, OutMsg};
use crate::stream::Stream;

pub const MAX_INFLIGHT_BYTES: usize = 64 << 20;

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
    pub fn new(stream: Stream, encoder: Encoder, batching: bool, budget: Arc<Budget>, account: Arc<Account>) -> Self {
        Outbox {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stream,
            encoder,
            batching,
            df: Mutex::new(HashMap::new()),
            df_count: AtomicUsize::new(0),
            budget,
            account,
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
        let r = send(&self.stream, &msgs, 0, false, &|| {});
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
    fn release(&self, st: &mut State, msgs: &[OutMsg], sent: bool) {
        let bytes = msgs.iter().map(|m| m.cost).sum::<usize>();
        st.inflight.remove(msgs.len(), bytes);
        self.budget.release(&self.account, bytes, bytes, sent);
    }

    /// Adds a request to the in-flight count. Without `wait`, refuses (false)
    /// when over budget; with it, blocks until replies drain.
    pub fn charge(&self, cost: usize, wait: bool) -> bool {
        let mut st = self.state.lock().unwrap();
        while !st.inflight.admits(cost, MAX_INFLIGHT_BYTES) {
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
            let msgs = std::mem::take(&mut st.queue);
            let skip = std::mem::take(&mut st.sent);
            if st.broken {
                self.release(&mut st, &msgs, false);
                continue;
            }
            st.sending = true;
            drop(st);
            let progress = || self.budget.sending(&self.account);
            progress();
            let r = if self.batching {
                send(&self.stream, &msgs, skip, true, &progress).map(|_| ())
            } else {
                (0..msgs.len()).try_for_each(|i| {
                    send(&self.stream, &msgs[i..=i], if i == 0 { skip } else { 0 }, true, &progress).map(|_| ())
                })
            };
            self.budget.idle(&self.account);
            st = self.state.lock().unwrap();
            st.sending = false;
            let sent = r.is_ok();
            if let Err(e) = r {
                self.fail(&mut st, e);
            }
            self.release(&mut st, &msgs, sent);
            self.notify(&st);
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
fn send(stream: &Stream, msgs: &[OutMsg], skip: usize, blocking: bool, progress: &dyn Fn()) -> io::Result<Sent> {
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
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && blocking => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && !blocking => {
                let done = ends.iter().take_while(|&&end| end <= at).count();
                let start = if done == 0 { 0 } else { ends[done - 1] };
                return Ok(Sent::Partly { done, skip: at - start });
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Sent::All)
}
