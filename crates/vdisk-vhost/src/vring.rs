//! One virtqueue as the backend holds it: virtio-queue's split `Queue` (ring
//! addresses, indexes, EVENT_IDX), the call eventfd, whether the frontend
//! enabled it, and its part of the inflight buffer. Everything sits behind
//! one lock, so taking heads and marking them in flight, and returning heads
//! and clearing them, are each one step for anyone else holding the lock.

use std::fs::File;
use std::io::Write;
use std::sync::{Mutex, MutexGuard};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use crate::inflight::QueueLog;

/// The guest's memory, as the frontend shared it.
pub type Mem = GuestMemoryMmap<()>;

pub struct Vring {
    state: Mutex<RingState>,
}

pub struct RingState {
    pub queue: Queue,
    pub call: Option<File>,
    /// SET_VRING_ENABLE (rings start enabled when PROTOCOL_FEATURES is not negotiated).
    pub enabled: bool,
    /// This ring's inflight log, when the frontend gave a buffer.
    pub log: Option<QueueLog>,
}

impl Vring {
    pub fn new(max_size: u16) -> Vring {
        let queue = Queue::new(max_size).expect("a power-of-two queue size");
        Vring { state: Mutex::new(RingState { queue, call: None, enabled: false, log: None }) }
    }

    pub fn lock(&self) -> MutexGuard<'_, RingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RingState {
    /// Whether chains may be taken: addresses valid, started and enabled.
    pub fn serving(&self) -> bool {
        self.queue.ready() && self.enabled
    }

    /// Returns `head` to the guest with `len` bytes written, keeping the
    /// inflight log in step (see `inflight`: last_batch_head before the used
    /// index moves, the flag and the header's used_idx after).
    pub fn add_used(&mut self, mem: &Mem, head: u16, len: u32) -> Result<(), virtio_queue::Error> {
        if let Some(log) = &self.log {
            log.returning(head);
        }
        self.queue.add_used(mem, head, len)?;
        if let Some(log) = &self.log {
            log.returned(head, self.queue.next_used());
        }
        Ok(())
    }

    /// Whether the guest wants an interrupt for what was just returned.
    pub fn needs_notification(&mut self, mem: &Mem) -> bool {
        self.queue.needs_notification(mem).unwrap_or(true)
    }

    /// Writes the call eventfd.
    pub fn signal(&self) -> std::io::Result<()> {
        match &self.call {
            Some(f) => (&*f).write_all(&1u64.to_ne_bytes()),
            None => Ok(()),
        }
    }
}
