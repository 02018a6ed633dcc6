//! The server-wide memory budget: bytes all connections together may hold in
//! request and reply buffers, and who waits when it runs out.
//!
//! Each connection has an [`Account`]: bytes it holds (requests read and not
//! yet answered, replies not yet taken by the socket), how many of those are
//! unread replies, and how much the socket has taken from it (evidence that
//! the client reads). The reader charges a request before handing it on; the
//! outbox releases it once the reply left (or was dropped with the client).
//!
//! Admission, for a request of `cost` bytes while `used` bytes are held:
//! - below half the budget, anyone (each connection still within its own
//!   per-connection bound);
//! - in the upper half, only connections that take their replies: none of
//!   theirs waits unread, and what they would hold is at most what their
//!   socket has taken so far (so a new client's share grows like TCP's slow
//!   start: each round of replies taken doubles it);
//! - never past the budget (one request always runs when nothing is held).
//!
//! A connection that cannot be admitted stops reading (backpressure) and waits
//! in a queue; whenever bytes are released, the queue is served holding the
//! fewest unread replies first (then: whose socket took the most), so those
//! holding the most wait longest. The
//! budget never drops data: a waiting connection whose client goes away is
//! let through (its request still runs, its reply is dropped); of what it
//! sent after, writes still run and reads are skipped.
//!
//! What frees the budget when clients stop reading is the outbox: a writer
//! whose socket takes nothing for 100 ms drops the data of its unsent read
//! replies and reads it again when the socket drains (outbox.rs). The
//! server's send watchdog (lib.rs) is the final cut: a client that takes no
//! byte of its replies for `--send-timeout` is disconnected, and while
//! others wait for the budget, after a sixth of it.
//!
//! It must never block while holding a connection's lock, and never takes one.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A waiter's place in the queue: (unread replies, taken by its socket reversed, held).
type Rank = (usize, std::cmp::Reverse<u64>, usize);

/// The budget shared by every connection of a server.
pub struct Budget {
    max: usize,
    used: AtomicUsize,
    /// Connections in `waiters`, read without the lock by releasers.
    waiting: AtomicUsize,
    waiters: Mutex<Vec<Arc<Account>>>,
    /// Zero of the clocks in [`Account::busy_since`].
    epoch: Instant,
}

/// One connection's standing against the budget.
#[derive(Default)]
pub struct Account {
    /// Bytes charged and not yet released.
    held: AtomicUsize,
    /// Of those, replies completed and not yet taken by the socket.
    unread: AtomicUsize,
    /// Reply bytes the socket has taken, ever.
    sent: AtomicU64,
    /// Milliseconds (since the budget's epoch, plus one) at which the writer
    /// last got a byte out while blocked sending; 0 when it is not sending.
    busy_since: AtomicU64,
    gate: Mutex<Gate>,
    opened: Condvar,
}

#[derive(Default)]
struct Gate {
    /// Bytes this connection waits for (0: not waiting).
    want: usize,
    granted: bool,
    /// The client is gone: stop waiting.
    cancelled: bool,
}

impl Budget {
    pub fn new(max: usize) -> Budget {
        Budget {
            max: max.max(1),
            used: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            waiters: Mutex::new(Vec::new()),
            epoch: Instant::now(),
        }
    }

    /// The budget in bytes.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Bytes held now by every connection together.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn admits(&self, used: usize, cost: usize, a: &Account) -> bool {
        if used == 0 {
            return true;
        }
        if used + cost > self.max {
            return false;
        }
        if used + cost <= self.max / 2 {
            return true;
        }
        a.unread.load(Ordering::Acquire) == 0
            && (a.held.load(Ordering::Acquire) + cost) as u64 <= a.sent.load(Ordering::Acquire)
    }

    /// Adds `cost` to the budget if `a` may have it now.
    fn try_add(&self, cost: usize, a: &Account) -> bool {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            if !self.admits(used, cost, a) {
                return false;
            }
            match self.used.compare_exchange_weak(used, used + cost, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    a.held.fetch_add(cost, Ordering::AcqRel);
                    return true;
                }
                Err(now) => used = now,
            }
        }
    }

    /// Charges `cost` to connection `a` if it is admitted now; false if it must wait.
    pub fn try_charge(&self, cost: usize, a: &Account) -> bool {
        self.try_add(cost, a)
    }

    /// Charges `cost`, waiting (in the queue) until it is admitted or the
    /// connection is cancelled; then it is charged anyway, so the request read
    /// still runs to its end, and false says: read no more from this client.
    pub fn charge(&self, cost: usize, a: &Arc<Account>) -> bool {
        {
            let mut waiters = self.waiters.lock().unwrap();
            self.waiting.fetch_add(1, Ordering::SeqCst);
            if self.try_add(cost, a) {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                return true;
            }
            let mut gate = a.gate.lock().unwrap();
            if gate.cancelled {
                drop(gate);
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                drop(waiters);
                self.force(cost, a);
                return false;
            }
            gate.want = cost;
            gate.granted = false;
            waiters.push(a.clone());
        }
        let mut gate = a.gate.lock().unwrap();
        while !gate.granted && !gate.cancelled {
            gate = a.opened.wait(gate).unwrap();
        }
        if gate.granted {
            gate.want = 0;
            return true;
        }
        drop(gate);
        // Cancelled: leave the queue (unless a grant took it out first), then
        // see whether that grant charged it.
        let mut waiters = self.waiters.lock().unwrap();
        let before = waiters.len();
        waiters.retain(|w| !Arc::ptr_eq(w, a));
        if waiters.len() < before {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        let mut gate = a.gate.lock().unwrap();
        drop(waiters);
        if !gate.granted {
            self.force(cost, a);
        }
        gate.want = 0;
        false
    }

    /// Connections waiting for the budget now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    fn force(&self, cost: usize, a: &Account) {
        self.used.fetch_add(cost, Ordering::AcqRel);
        a.held.fetch_add(cost, Ordering::AcqRel);
    }

    /// Replies worth `bytes` of `a` were completed: they are unread until released.
    pub fn completed(&self, a: &Account, bytes: usize) {
        a.unread.fetch_add(bytes, Ordering::AcqRel);
    }

    /// `bytes` charged to `a` are free again: `replied` of them were replies
    /// (passed to [`Budget::completed`]); `sent` says the socket took them (else dropped).
    pub fn release(&self, a: &Account, bytes: usize, replied: usize, sent: bool) {
        if bytes == 0 {
            return;
        }
        a.unread.fetch_sub(replied, Ordering::AcqRel);
        if sent {
            a.sent.fetch_add(replied as u64, Ordering::AcqRel);
        }
        a.held.fetch_sub(bytes, Ordering::AcqRel);
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.grant();
        }
    }

    /// Lets in waiting connections while the budget admits them, fewest unread replies first.
    fn grant(&self) {
        let mut waiters = self.waiters.lock().unwrap();
        loop {
            // Fewest unread replies first; among equals, the one whose socket
            // has taken the most (a client that reads), then the one holding
            // least, then the newest: clients that never took a byte and wait
            // longest are the likeliest never to read.
            let mut best: Option<(usize, Rank)> = None;
            for (i, w) in waiters.iter().enumerate() {
                let want = w.gate.lock().unwrap().want;
                let rank = (
                    w.unread.load(Ordering::Acquire),
                    std::cmp::Reverse(w.sent.load(Ordering::Acquire)),
                    w.held.load(Ordering::Acquire),
                );
                if best.as_ref().is_some_and(|(_, r)| *r < rank) || !self.admits(self.used(), want, w) {
                    continue;
                }
                best = Some((i, rank));
            }
            let Some((i, _)) = best else { return };
            let w = waiters.remove(i);
            let mut gate = w.gate.lock().unwrap();
            if gate.cancelled {
                // It charges itself (over the budget) and leaves: not a grant.
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            if !self.try_add(gate.want, &w) {
                // Raced a fast-path charge; put it back and stop for now.
                drop(gate);
                waiters.push(w);
                return;
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            gate.granted = true;
            w.opened.notify_all();
        }
    }

    /// Connection `a` lost its client: a wait for the budget ends now.
    pub fn cancel(&self, a: &Account) {
        let mut gate = a.gate.lock().unwrap();
        gate.cancelled = true;
        a.opened.notify_all();
    }

    /// The writer of `a` starts a blocking send, or got bytes out during one.
    pub fn sending(&self, a: &Account) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        a.busy_since.store(now, Ordering::Release);
    }

    /// The writer of `a` is no longer blocked sending.
    pub fn idle(&self, a: &Account) {
        a.busy_since.store(0, Ordering::Release);
    }

    /// How long the writer of `a` has been blocked without getting a byte out.
    pub fn stalled_ms(&self, a: &Account) -> u64 {
        match a.busy_since.load(Ordering::Acquire) {
            0 => 0,
            t => (self.epoch.elapsed().as_millis() as u64 + 1).saturating_sub(t),
        }
    }
}

impl Account {
    pub fn new() -> Arc<Account> {
        Arc::new(Account::default())
    }

    /// Bytes this connection holds against the budget.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upper_half_is_for_clients_that_read() {
        let b = Arc::new(Budget::new(100));
        let (reader, hog) = (Account::new(), Account::new());
        assert!(b.try_charge(40, &hog));
        b.completed(&hog, 40);
        assert!(!b.try_charge(20, &hog), "past half, with unread replies: wait");
        assert!(!b.try_charge(20, &reader), "past half, never having read: wait");
        b.release(&reader, 0, 0, true);
        reader.sent.store(1000, Ordering::Release);
        assert!(b.try_charge(20, &reader), "a client that takes its replies gets the upper half");
        assert!(!b.try_charge(50, &reader), "never past the budget");
        // A waiter is let in when bytes come back; a cancelled one is let through.
        let (b2, hog2) = (b.clone(), hog.clone());
        let t = std::thread::spawn(move || assert!(b2.charge(30, &hog2)));
        while b.waiting.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        b.completed(&reader, 20);
        b.release(&reader, 20, 20, true);
        b.release(&hog, 40, 40, true);
        t.join().unwrap();
        assert_eq!((b.used(), hog.held()), (30, 30));
        let b3 = b.clone();
        let r2 = reader.clone();
        reader.sent.store(1000, Ordering::Release);
        assert!(b.try_charge(60, &reader));
        let t = std::thread::spawn(move || assert!(!b3.charge(50, &r2)));
        while b.waiting.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        b.cancel(&reader);
        t.join().unwrap();
        assert_eq!(b.used(), 140, "a cancelled wait is charged anyway: its request still runs");
    }
}
