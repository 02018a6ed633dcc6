//! Synchronous (write-blocking) mirroring: once a copy job's passes stop
//! gaining on the guest, the guest's writes wait for the target
//! (docs/block-jobs.md).
//!
//! The job puts a [`SyncGate`] on the device ([`vdisk_engine::WriteGate`]):
//! every write that completes on the source is held back from its export's
//! reply. The job takes the ranges held ([`SyncGate::pending`]), copies the
//! dirty granules they meet to the target (from the image, which holds the
//! write's data: the granule was marked before the write was held), and
//! then lets those writes be answered ([`SyncGate::release`]). So a guest
//! gets no write acknowledged that the target lacks, and it cannot dirty
//! the disk faster than the job copies: what was dirty before can only
//! shrink, and the job gets ready.
//!
//! A target that stops answering must not stop the guest: a watchdog opens
//! the gate once a write has been held for [`SYNC_LIMIT`] (everything held
//! is answered, nothing is held from then on) and the job goes on copying
//! in the background, as before the gate ([`Synced::degraded`]).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vdisk_engine::{Device, Held, WriteGate};

/// The longest a guest's write is held for the target before the gate opens.
pub const SYNC_LIMIT: Duration = Duration::from_secs(5);

/// Holds a device's completed writes until the job copied their ranges.
pub struct SyncGate {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Each held write with its number and when it was held, oldest first.
    held: VecDeque<(u64, Instant, Held)>,
    /// The number the next held write gets.
    next: u64,
    /// Nothing is held any more (the job ended, the device stops, or the watchdog fired).
    open: bool,
    /// Why the watchdog opened the gate.
    degraded: Option<String>,
}

impl SyncGate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ranges of the writes held now and the number of the last one
    /// (for [`SyncGate::release`]); waits up to `wait` for one if none is.
    pub fn pending(&self, wait: Duration) -> (Vec<(u64, u64)>, Option<u64>) {
        let mut st = self.lock();
        if st.held.is_empty() && !st.open && !wait.is_zero() {
            st = self.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        let ranges = st.held.iter().map(|(_, _, h)| (h.request.offset, h.request.len)).collect();
        (ranges, st.held.back().map(|(n, _, _)| *n))
    }

    /// Answers the held writes up to number `through` (those the watchdog
    /// answered already are gone).
    pub fn release(&self, through: Option<u64>) {
        let Some(through) = through else { return };
        let mut st = self.lock();
        let n = st.held.iter().take_while(|(k, _, _)| *k <= through).count();
        let out: Vec<Held> = st.held.drain(..n).map(|(_, _, h)| h).collect();
        drop(st);
        answer(out);
    }

    /// Answers everything held and holds nothing from now on; `why`, if
    /// given, is kept as the reason ([`Synced::degraded`]).
    fn open_because(&self, why: Option<String>) {
        let mut st = self.lock();
        st.open = true;
        if st.degraded.is_none() {
            st.degraded = why;
        }
        let out: Vec<Held> = st.held.drain(..).map(|(_, _, h)| h).collect();
        drop(st);
        self.changed.notify_all();
        answer(out);
    }
}

impl WriteGate for SyncGate {
    fn hold(&self, done: &mut Vec<Held>) {
        if !done.iter().any(holds) {
            return;
        }
        let mut st = self.lock();
        if st.open {
            return;
        }
        let (now, mut i) = (Instant::now(), 0);
        while i < done.len() {
            if holds(&done[i]) {
                let n = st.next;
                st.next += 1;
                st.held.push_back((n, now, done.swap_remove(i)));
            } else {
                i += 1;
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    fn open(&self) {
        self.open_because(None);
    }
}

/// A write held back: one that changed the disk, and did so (a failed one is answered at once).
fn holds(h: &Held) -> bool {
    h.request.op().writes() && h.request.error.is_none()
}

fn answer(held: Vec<Held>) {
    if held.is_empty() {
        return;
    }
    for p in vdisk_engine::answer(held) {
        log::error!("a synchronous mirror's held replies: an export's sink {p}");
    }
}

/// A [`SyncGate`] on a device, with its watchdog; taken off when dropped
/// (everything held is answered).
pub struct Synced {
    device: Arc<Device>,
    pub gate: Arc<SyncGate>,
    watchdog: Option<JoinHandle<()>>,
}

impl Synced {
    /// Puts a gate on `device` for the `what` job of export `name`.
    pub fn attach(device: &Arc<Device>, name: &str, what: &'static str) -> Synced {
        let gate = Arc::new(SyncGate { state: Mutex::new(State::default()), changed: Condvar::new() });
        device.set_write_gate(Some(gate.clone()));
        let (watched, export) = (gate.clone(), name.to_owned());
        let watchdog = std::thread::Builder::new()
            .name(format!("{what}-sync"))
            .spawn(move || watch(&watched, &export, what))
            .map_err(|e| log::warn!(export:% = name; "export {name:?}: {what}: no watchdog for held writes ({e})"))
            .ok();
        if watchdog.is_none() {
            // Without it a stuck target could hold a guest's writes forever.
            gate.open_because(Some("no watchdog thread could be started".into()));
        }
        Synced { device: device.clone(), gate, watchdog }
    }

    /// Why the gate opened while the job ran (writes no longer wait for the target).
    pub fn degraded(&self) -> Option<String> {
        self.gate.lock().degraded.clone()
    }
}

impl Drop for Synced {
    fn drop(&mut self) {
        self.device.set_write_gate(None);
        self.gate.open();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}

/// Opens `gate` once a write has been held for [`SYNC_LIMIT`]; returns once it is open.
fn watch(gate: &SyncGate, name: &str, what: &str) {
    let mut st = gate.lock();
    loop {
        if st.open {
            return;
        }
        let left = st.held.front().map_or(SYNC_LIMIT, |(_, at, _)| SYNC_LIMIT.saturating_sub(at.elapsed()));
        if left.is_zero() {
            drop(st);
            let why = format!(
                "the target did not take a guest's write within {} s: writes no longer wait for it, and the job \
                 copies them in the background",
                SYNC_LIMIT.as_secs()
            );
            log::warn!(export:% = name; "export {name:?}: {what}: {why}");
            gate.open_because(Some(why));
            return;
        }
        st = gate.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}
