//! Inflight I/O tracking (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD): a buffer
//! shared with the frontend that outlives the backend process, recording which
//! descriptor heads were taken from each ring and not yet returned. QEMU asks
//! for it once (GET_INFLIGHT_FD), keeps it, and hands it to every backend that
//! connects later (SET_INFLIGHT_FD); a backend started after a crash resubmits
//! the heads it finds in flight, oldest first.
//!
//! The layout is QEMU's for split rings ("Inflight I/O tracking" in
//! docs/interop/vhost-user.rst), per queue, little-endian:
//!
//! ```text
//! header (16 bytes): u64 features, u16 version, u16 desc_num,
//!                    u16 last_batch_head, u16 used_idx
//! desc_num entries (16 bytes each): u8 inflight, 5 bytes padding,
//!                    u16 next, u64 counter
//! ```
//!
//! Each queue's region is rounded up to 64 bytes; the queues follow each other.
//!
//! The protocol per head: at pop, `counter` gets the next value of a rising
//! counter, then `inflight` becomes 1. To return a head: `last_batch_head`
//! names it, the used ring entry and the used index are written, `inflight`
//! becomes 0, and the header's `used_idx` follows the ring's. A backend that
//! died between the used index and the header's `used_idx` left them
//! different: the head in `last_batch_head` had reached the guest, so its flag
//! is cleared at recovery. Every head still flagged then was taken and never
//! answered; the ring's next available index is the used index plus their
//! number.

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

/// Each queue's region is a multiple of this.
pub const ALIGN: usize = 64;
const HEADER: usize = 16;
const ENTRY: usize = 16;
/// The header's version once a backend has initialized the region.
const VERSION: u16 = 1;

// Field offsets in the header and in an entry.
const H_VERSION: usize = 8;
const H_DESC_NUM: usize = 10;
const H_LAST_BATCH_HEAD: usize = 12;
const H_USED_IDX: usize = 14;
const E_INFLIGHT: usize = 0;
const E_COUNTER: usize = 8;

/// Bytes of one queue's region for a ring of `queue_size` descriptors.
pub fn queue_bytes(queue_size: u16) -> usize {
    (HEADER + ENTRY * usize::from(queue_size)).next_multiple_of(ALIGN)
}

/// The whole shared buffer, mapped.
pub struct InflightBuf {
    region: MmapRegion<()>,
    num_queues: u16,
    queue_size: u16,
}

impl InflightBuf {
    /// A new, zeroed buffer in a memfd for `num_queues` rings of `queue_size`;
    /// returns it with the file to hand to the frontend.
    pub fn create(num_queues: u16, queue_size: u16) -> io::Result<(InflightBuf, File)> {
        if num_queues == 0 || queue_size == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an inflight buffer for no queue"));
        }
        let size = usize::from(num_queues) * queue_bytes(queue_size);
        // SAFETY: memfd_create reads a NUL-terminated name (a C string literal)
        // and takes no other pointer; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"vdisk-vhost-inflight".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(size as u64)?;
        let buf = Self::map(file.try_clone()?, 0, size as u64, num_queues, queue_size)?;
        Ok((buf, file))
    }

    /// Maps a buffer the frontend passed (SET_INFLIGHT_FD).
    pub fn map(file: File, offset: u64, size: u64, num_queues: u16, queue_size: u16) -> io::Result<InflightBuf> {
        let need = usize::from(num_queues) * queue_bytes(queue_size);
        if num_queues == 0 || queue_size == 0 || (size as usize) < need {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("inflight buffer of {size} bytes for {num_queues} queues of {queue_size}"),
            ));
        }
        let region = MmapRegion::from_file(FileOffset::new(file, offset), need).map_err(io::Error::other)?;
        Ok(InflightBuf { region, num_queues, queue_size })
    }

    /// An anonymous buffer (tests).
    pub fn anonymous(num_queues: u16, queue_size: u16) -> InflightBuf {
        let size = usize::from(num_queues) * queue_bytes(queue_size);
        InflightBuf { region: MmapRegion::new(size).expect("anonymous mapping"), num_queues, queue_size }
    }

    pub fn size(&self) -> u64 {
        self.region.size() as u64
    }

    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// The log of queue `index`, if the buffer has one.
    pub fn queue(self: &Arc<Self>, index: u16) -> Option<QueueLog> {
        (index < self.num_queues).then(|| QueueLog {
            buf: self.clone(),
            base: usize::from(index) * queue_bytes(self.queue_size),
            desc_num: self.queue_size,
            counter: 0,
        })
    }
}

/// What a ring starts with after [`QueueLog::recover`].
#[derive(Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Heads to submit again, oldest first.
    pub resubmit: Vec<u16>,
    /// The ring's next available index (None: a fresh buffer, keep SET_VRING_BASE's).
    pub next_avail: Option<u16>,
}

/// One queue's part of the buffer. Used under the ring's lock.
pub struct QueueLog {
    buf: Arc<InflightBuf>,
    base: usize,
    desc_num: u16,
    counter: u64,
}

impl QueueLog {
    fn store<T: vm_memory::AtomicAccess>(&self, at: usize, v: T, order: Ordering) {
        let s = self.buf.region.as_volatile_slice();
        s.store(v, self.base + at, order).expect("inflight field inside the mapping");
    }

    fn load<T: vm_memory::AtomicAccess>(&self, at: usize) -> T {
        let s = self.buf.region.as_volatile_slice();
        s.load(self.base + at, Ordering::Acquire).expect("inflight field inside the mapping")
    }

    fn entry(head: u16) -> usize {
        HEADER + usize::from(head) * ENTRY
    }

    /// At ring start, with the ring's used index as the guest sees it:
    /// initializes a fresh region, or reconciles the header with the ring and
    /// returns the heads still in flight, oldest counter first.
    pub fn recover(&mut self, used_idx: u16, ring_size: u16) -> Recovery {
        // Never index past what the buffer holds, whatever the ring's size.
        let n = self.desc_num.min(ring_size);
        if self.load::<u16>(H_VERSION) != VERSION {
            self.store(H_DESC_NUM, self.desc_num, Ordering::Relaxed);
            self.store(H_LAST_BATCH_HEAD, 0u16, Ordering::Relaxed);
            self.store(H_USED_IDX, used_idx, Ordering::Relaxed);
            for head in 0..self.desc_num {
                self.store(Self::entry(head) + E_INFLIGHT, 0u8, Ordering::Relaxed);
            }
            self.store(H_VERSION, VERSION, Ordering::Release);
            self.counter = 0;
            return Recovery { resubmit: Vec::new(), next_avail: None };
        }
        if self.load::<u16>(H_USED_IDX) != used_idx {
            // The last returned head reached the used ring, its flag may not have been cleared.
            let last = self.load::<u16>(H_LAST_BATCH_HEAD);
            if last < self.desc_num {
                self.store(Self::entry(last) + E_INFLIGHT, 0u8, Ordering::Release);
            }
            self.store(H_USED_IDX, used_idx, Ordering::Release);
        }
        let mut pending: Vec<(u64, u16)> = (0..n)
            .filter(|&h| self.load::<u8>(Self::entry(h) + E_INFLIGHT) == 1)
            .map(|h| (self.load::<u64>(Self::entry(h) + E_COUNTER), h))
            .collect();
        pending.sort_unstable();
        self.counter = pending.last().map_or(0, |&(c, _)| c + 1);
        let next_avail = used_idx.wrapping_add(pending.len() as u16);
        Recovery { resubmit: pending.into_iter().map(|(_, h)| h).collect(), next_avail: Some(next_avail) }
    }

    /// A head was taken from the available ring.
    pub fn mark(&mut self, head: u16) {
        if head >= self.desc_num {
            return;
        }
        let e = Self::entry(head);
        self.store(e + E_COUNTER, self.counter, Ordering::Relaxed);
        self.store(e + E_INFLIGHT, 1u8, Ordering::Release);
        self.counter += 1;
    }

    /// Before `head`'s used entry and the used index are written.
    pub fn returning(&self, head: u16) {
        self.store(H_LAST_BATCH_HEAD, head, Ordering::SeqCst);
    }

    /// After the used index became `used_idx` with `head` in it.
    pub fn returned(&self, head: u16, used_idx: u16) {
        if head < self.desc_num {
            self.store(Self::entry(head) + E_INFLIGHT, 0u8, Ordering::SeqCst);
        }
        self.store(H_USED_IDX, used_idx, Ordering::SeqCst);
    }

    /// Whether `head` is flagged (tests).
    #[cfg(test)]
    pub fn is_marked(&self, head: u16) -> bool {
        self.load::<u8>(Self::entry(head) + E_INFLIGHT) == 1
    }

    #[cfg(test)]
    pub fn header(&self) -> (u16, u16, u16, u16) {
        (self.load(H_VERSION), self.load(H_DESC_NUM), self.load(H_LAST_BATCH_HEAD), self.load(H_USED_IDX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(qs: u16) -> QueueLog {
        Arc::new(InflightBuf::anonymous(2, qs)).queue(1).unwrap()
    }

    #[test]
    fn sizes_follow_qemus_layout() {
        assert_eq!(queue_bytes(128), 16 + 128 * 16 + 48);
        assert_eq!(queue_bytes(256) % ALIGN, 0);
        let (buf, file) = InflightBuf::create(4, 128).unwrap();
        assert_eq!(buf.size(), 4 * queue_bytes(128) as u64);
        assert_eq!(file.metadata().unwrap().len(), buf.size());
        assert!(InflightBuf::map(file, 0, 100, 4, 128).is_err(), "a buffer too small is refused");
    }

    #[test]
    fn a_fresh_region_is_initialized_and_resubmits_nothing() {
        let mut l = log(8);
        let r = l.recover(5, 8);
        assert_eq!(r, Recovery { resubmit: vec![], next_avail: None });
        assert_eq!(l.header(), (VERSION, 8, 0, 5));
    }

    #[test]
    fn in_flight_heads_come_back_oldest_first() {
        let mut l = log(8);
        l.recover(0, 8);
        // Popped 6, 1, 4, 3; 1 answered.
        for h in [6, 1, 4, 3] {
            l.mark(h);
        }
        l.returning(1);
        l.returned(1, 1);
        assert!(l.is_marked(6) && !l.is_marked(1) && l.is_marked(4));
        // A new backend on the same buffer.
        let mut again = QueueLog { buf: l.buf.clone(), base: l.base, desc_num: 8, counter: 0 };
        let r = again.recover(1, 8);
        assert_eq!(r.resubmit, vec![6, 4, 3]);
        assert_eq!(r.next_avail, Some(4), "used 1 + 3 in flight");
        // New pops count on from the oldest resubmitted ones.
        again.mark(2);
        let mut third = QueueLog { buf: l.buf.clone(), base: l.base, desc_num: 8, counter: 0 };
        assert_eq!(third.recover(1, 8).resubmit, vec![6, 4, 3, 2]);
    }

    #[test]
    fn a_head_on_the_used_ring_but_still_flagged_is_cleared() {
        let mut l = log(8);
        l.recover(10, 8);
        l.mark(2);
        l.mark(5);
        // Died after the used index moved (10 -> 11 with head 5) but before the flag cleared.
        l.returning(5);
        let mut again = QueueLog { buf: l.buf.clone(), base: l.base, desc_num: 8, counter: 0 };
        let r = again.recover(11, 8);
        assert_eq!(r.resubmit, vec![2]);
        assert_eq!(r.next_avail, Some(12));
        assert_eq!(again.header().3, 11, "the header follows the ring");
        assert!(!again.is_marked(5));
    }

    #[test]
    fn died_before_the_used_index_moved_resubmits_the_head() {
        let mut l = log(8);
        l.recover(0xffff, 8);
        l.mark(7);
        l.returning(7);
        // The used index never moved: 7 is resubmitted; indexes wrap.
        let mut again = QueueLog { buf: l.buf.clone(), base: l.base, desc_num: 8, counter: 0 };
        let r = again.recover(0xffff, 8);
        assert_eq!(r.resubmit, vec![7]);
        assert_eq!(r.next_avail, Some(0));
    }

    #[test]
    fn queues_do_not_overlap() {
        let buf = Arc::new(InflightBuf::anonymous(2, 4));
        let mut a = buf.queue(0).unwrap();
        let mut b = buf.queue(1).unwrap();
        assert!(buf.queue(2).is_none());
        a.recover(0, 4);
        b.recover(0, 4);
        a.mark(3);
        assert!(!b.is_marked(3) && !b.is_marked(0));
        b.mark(0);
        assert_eq!(a.recover(0, 4).resubmit, vec![3]);
        assert_eq!(b.recover(0, 4).resubmit, vec![0]);
    }
}
