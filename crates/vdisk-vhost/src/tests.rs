//! The request path against malformed and valid chains, on a mock split
//! queue in real (anonymous) guest memory and a real device over a raw file:
//! every malformed chain gets IOERR or UNSUPP (or, without a status byte,
//! an empty used entry) and the queue goes on serving the chains after it.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use vdisk_engine::{Device, EngineConfig};
use vdisk_image::{Image, RawImage};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use crate::parse::{S_IOERR, S_OK, S_UNSUPP};
use crate::queue::{QueueCtx, Shared, Vring};

thread_local! {
    /// Set on the thread that kicks: the next chain it judges panics.
    pub(crate) static PANIC_NEXT_PARSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

const MEM: usize = 1 << 20;
const QSIZE: u16 = 64;
const DISK: u64 = 1 << 20;

/// Where test buffers live in guest memory (after the rings).
const HDRS: u64 = 0x10000;
const STATUS: u64 = 0x18000;
const DATA: u64 = 0x20000;

struct Rig {
    gm: GuestMemoryAtomic<GuestMemoryMmap<()>>,
    vring: Arc<Vring>,
    ctx: Arc<QueueCtx>,
    shared: Arc<Shared>,
    used_addr: GuestAddress,
    avail_addr: GuestAddress,
    next_desc: u16,
    chains: u16,
    dir: PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One descriptor of a chain: guest address, length, device-writable.
type D = (u64, u32, bool);

impl Rig {
    fn new(tag: &str, read_only: bool) -> Rig {
        Self::with(tag, read_only, true)
    }

    fn with(tag: &str, read_only: bool, zero_copy: bool) -> Rig {
        let dir = std::env::temp_dir().join(format!("vdisk-vhost-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let _ = std::fs::remove_file(&path);
        RawImage::create(&path, DISK, None).unwrap();
        let image: Arc<dyn Image> = Arc::new(RawImage::open(&path, read_only).unwrap());
        let device = Arc::new(Device::start(tag, image, &EngineConfig::default()).unwrap());
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        let gm = GuestMemoryAtomic::new(mem);
        let (desc, avail, used) = {
            let guard = gm.memory();
            let mock = MockSplitQueue::new(&*guard, QSIZE);
            (mock.desc_table_addr(), mock.avail_addr(), mock.used_addr())
        };
        let vring = Arc::new(Vring::new(QSIZE));
        {
            let mut s = vring.lock();
            s.queue.set_size(QSIZE);
            s.queue.try_set_desc_table_address(desc).unwrap();
            s.queue.try_set_avail_ring_address(avail).unwrap();
            s.queue.try_set_used_ring_address(used).unwrap();
            s.queue.set_ready(true);
            s.enabled = true;
        }
        let shared = Arc::new(Shared {
            device,
            mem: Mutex::new(gm.clone()),
            writeback: AtomicBool::new(true),
            event_idx: AtomicBool::new(false),
            serial: *b"vdisk-test-serial-01",
            zero_copy,
        });
        let ctx = QueueCtx::new(shared.clone(), vring.clone());
        Rig { gm, vring, ctx, shared, used_addr: used, avail_addr: avail, next_desc: 0, chains: 0, dir }
    }

    fn ctx_shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    fn mem(&self) -> impl std::ops::Deref<Target = GuestMemoryMmap<()>> {
        self.gm.memory()
    }

    /// Writes a request header for chain `n` and returns its address.
    fn header(&self, n: u16, kind: u32, sector: u64) -> u64 {
        let at = HDRS + u64::from(n) * 16;
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem().write_slice(&h, GuestAddress(at)).unwrap();
        at
    }

    fn status_of(n: u16) -> u64 {
        STATUS + u64::from(n)
    }

    /// Makes a chain available; returns its head.
    fn offer(&mut self, descs: &[D]) -> u16 {
        let head = self.next_desc;
        let mem = self.mem();
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let idx = head + i as u16;
            let last = i + 1 == descs.len();
            let flags = if write { VRING_DESC_F_WRITE } else { 0 } | if last { 0 } else { VRING_DESC_F_NEXT };
            let d = Descriptor::new(addr, len, flags as u16, if last { 0 } else { idx + 1 });
            let at = GuestAddress(idx as u64 * 16);
            mem.write_obj(RawDescriptor::from(d), at).unwrap();
        }
        // avail ring entry and index
        let slot = self.avail_addr.0 + 4 + 2 * u64::from(self.chains % QSIZE);
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.chains += 1;
        mem.write_obj(self.chains, GuestAddress(self.avail_addr.0 + 2)).unwrap();
        self.next_desc += descs.len() as u16;
        head
    }

    /// Kicks the queue and waits for the engine; returns the used entries (head, len) so far.
    fn kick(&self) -> Vec<(u32, u32)> {
        self.ctx.kick();
        self.ctx.wait_idle();
        let mem = self.mem();
        let n: u16 = mem.read_obj(GuestAddress(self.used_addr.0 + 2)).unwrap();
        (0..n)
            .map(|i| {
                let at = self.used_addr.0 + 4 + 8 * u64::from(i);
                (mem.read_obj(GuestAddress(at)).unwrap(), mem.read_obj(GuestAddress(at + 4)).unwrap())
            })
            .collect()
    }

    fn status(&self, n: u16) -> u8 {
        self.mem().read_obj(GuestAddress(Self::status_of(n))).unwrap()
    }
}

fn len_of(used: &[(u32, u32)], head: u16) -> u32 {
    used.iter().find(|u| u.0 == u32::from(head)).unwrap_or_else(|| panic!("chain {head} not used: {used:?}")).1
}

#[test]
fn malformed_chains_get_an_error_and_the_queue_goes_on() {
    let mut rig = Rig::new("malformed", false);
    let st = |n| (Rig::status_of(n), 1, true);
    // Fill the status bytes with a marker so untouched ones show.
    rig.mem().write_slice(&[0xee; 64], GuestAddress(STATUS)).unwrap();

    let h0 = rig.header(0, VIRTIO_BLK_T_IN, 0);
    let short = rig.offer(&[(h0, 8, false), st(0)]); // header too short
    let h1 = rig.header(1, VIRTIO_BLK_T_IN, 0);
    let wrong_dir = rig.offer(&[(h1, 16, false), (DATA, 512, true), (DATA, 512, false), st(1)]);
    let h2 = rig.header(2, VIRTIO_BLK_T_IN, 0);
    let outside = rig.offer(&[(h2, 16, false), (MEM as u64 - 256, 512, true), st(2)]);
    let h3 = rig.header(3, VIRTIO_BLK_T_OUT, 0);
    let no_status = rig.offer(&[(h3, 16, false), (DATA, 512, false)]);
    let h4 = rig.header(4, 99, 0);
    let unknown = rig.offer(&[(h4, 16, false), st(4)]);
    let h5 = rig.header(5, VIRTIO_BLK_T_IN, DISK / 512);
    let past_end = rig.offer(&[(h5, 16, false), (DATA, 512, true), st(5)]);
    let h6 = rig.header(6, VIRTIO_BLK_T_OUT, 0);
    let odd_len = rig.offer(&[(h6, 16, false), (DATA, 100, false), st(6)]);
    let h7 = rig.header(7, VIRTIO_BLK_T_DISCARD, 0);
    let range = HDRS + 0x1000;
    let mut r = [0u8; 16];
    r[8..12].copy_from_slice(&8u32.to_le_bytes());
    r[12..16].copy_from_slice(&1u32.to_le_bytes()); // unmap flag: not for DISCARD
    rig.mem().write_slice(&r, GuestAddress(range)).unwrap();
    let bad_discard = rig.offer(&[(h7, 16, false), (range, 16, false), st(7)]);
    // Then valid ones: a write of a pattern, GET_ID, a read back.
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    rig.mem().write_slice(&pattern, GuestAddress(DATA)).unwrap();
    let h8 = rig.header(8, VIRTIO_BLK_T_OUT, 8);
    let write = rig.offer(&[(h8, 16, false), (DATA, 1024, false), (DATA + 1024, 3072, false), st(8)]);
    let h11 = rig.header(11, VIRTIO_BLK_T_IN, 0);
    let status_outside = rig.offer(&[(h11, 16, false), (DATA + 0x9000, 512, true), (MEM as u64 + 4096, 1, true)]);
    let h9 = rig.header(9, VIRTIO_BLK_T_GET_ID, 0);
    let get_id = rig.offer(&[(h9, 16, false), (DATA + 0x8000, 20, true), st(9)]);

    let used = rig.kick();
    for (n, head, want) in [
        (0, short, S_IOERR),
        (1, wrong_dir, S_IOERR),
        (2, outside, S_IOERR),
        (4, unknown, S_UNSUPP),
        (5, past_end, S_IOERR),
        (6, odd_len, S_IOERR),
        (7, bad_discard, S_UNSUPP),
        (8, write, S_OK),
        (9, get_id, S_OK),
    ] {
        assert_eq!(rig.status(n), want, "status of chain {n}");
        assert!(len_of(&used, head) >= 1, "chain {n} used with its status byte");
    }
    assert_eq!(len_of(&used, no_status), 0, "a chain without a status byte is returned empty");
    assert_eq!(len_of(&used, status_outside), 0, "a status byte outside guest memory is not written elsewhere");
    let mut data = [0u8; 512];
    rig.mem().read_slice(&mut data, GuestAddress(DATA + 0x9000)).unwrap();
    assert!(data.iter().all(|&b| b == 0), "nothing written into the data of a chain whose status is missing");
    assert_eq!(len_of(&used, get_id), 21);
    let mut id = [0u8; 20];
    rig.mem().read_slice(&mut id, GuestAddress(DATA + 0x8000)).unwrap();
    assert_eq!(&id, b"vdisk-test-serial-01");

    // The queue goes on: a read (split across two descriptors) of what was written.
    let h10 = rig.header(10, VIRTIO_BLK_T_IN, 8);
    let read = rig.offer(&[(h10, 16, false), (DATA + 0x10000, 512, true), (DATA + 0x10200, 3584, true), st(10)]);
    let used = rig.kick();
    assert_eq!(rig.status(10), S_OK);
    assert_eq!(len_of(&used, read), 4096 + 1);
    let mut back = vec![0u8; 4096];
    rig.mem().read_slice(&mut back, GuestAddress(DATA + 0x10000)).unwrap();
    assert!(back == pattern, "read back what was written");
}

#[test]
fn read_only_device_refuses_writes_and_zeroing() {
    let mut rig = Rig::new("ro", true);
    let st = |n| (Rig::status_of(n), 1, true);
    let h0 = rig.header(0, VIRTIO_BLK_T_OUT, 0);
    rig.offer(&[(h0, 16, false), (DATA, 512, false), st(0)]);
    let h1 = rig.header(1, VIRTIO_BLK_T_WRITE_ZEROES, 0);
    let range = HDRS + 0x1000;
    let mut r = [0u8; 16];
    r[8..12].copy_from_slice(&8u32.to_le_bytes());
    rig.mem().write_slice(&r, GuestAddress(range)).unwrap();
    rig.offer(&[(h1, 16, false), (range, 16, false), st(1)]);
    let h2 = rig.header(2, VIRTIO_BLK_T_IN, 0);
    rig.offer(&[(h2, 16, false), (DATA, 512, true), st(2)]);
    let h3 = rig.header(3, VIRTIO_BLK_T_FLUSH, 0);
    rig.offer(&[(h3, 16, false), st(3)]);
    let used = rig.kick();
    assert_eq!(used.len(), 4);
    assert_eq!([rig.status(0), rig.status(1), rig.status(2), rig.status(3)], [S_IOERR, S_IOERR, S_OK, S_OK]);
}

#[test]
fn write_zeroes_and_discard_reach_the_device() {
    let mut rig = Rig::new("zero", false);
    let st = |n| (Rig::status_of(n), 1, true);
    rig.mem().write_slice(&[0xabu8; 8192], GuestAddress(DATA)).unwrap();
    let h0 = rig.header(0, VIRTIO_BLK_T_OUT, 0);
    rig.offer(&[(h0, 16, false), (DATA, 8192, false), st(0)]);
    rig.kick();
    assert_eq!(rig.status(0), S_OK);
    for (n, kind, flags) in [(1u16, VIRTIO_BLK_T_WRITE_ZEROES, 0u32), (2, VIRTIO_BLK_T_DISCARD, 0)] {
        let range = HDRS + 0x1000 + u64::from(n) * 16;
        let mut r = [0u8; 16];
        r[0..8].copy_from_slice(&(u64::from(n) * 4 - 4).to_le_bytes()); // sectors 0..4, 4..8
        r[8..12].copy_from_slice(&4u32.to_le_bytes());
        r[12..16].copy_from_slice(&flags.to_le_bytes());
        rig.mem().write_slice(&r, GuestAddress(range)).unwrap();
        let h = rig.header(n, kind, 0);
        rig.offer(&[(h, 16, false), (range, 16, false), st(n)]);
    }
    rig.kick();
    assert_eq!([rig.status(1), rig.status(2)], [S_OK, S_OK]);
    let h3 = rig.header(3, VIRTIO_BLK_T_IN, 0);
    rig.offer(&[(h3, 16, false), (DATA + 0x10000, 8192, true), st(3)]);
    rig.kick();
    let mut back = vec![0u8; 8192];
    rig.mem().read_slice(&mut back, GuestAddress(DATA + 0x10000)).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0), "zeroed and discarded sectors read as zeros on a raw file");
    assert!(back[4096..].iter().all(|&b| b == 0xab));
}

#[test]
fn copies_when_descriptors_are_not_whole_sectors_or_zero_copy_is_off() {
    for zero_copy in [true, false] {
        let mut rig = Rig::with(&format!("copy-{zero_copy}"), false, zero_copy);
        let st = |n| (Rig::status_of(n), 1, true);
        let pattern: Vec<u8> = (0..2048u32).map(|i| (i * 13 + 1) as u8).collect();
        rig.mem().write_slice(&pattern, GuestAddress(DATA)).unwrap();
        // 2048 bytes in pieces of 256, 768, 1024: sector multiples only in total.
        let h0 = rig.header(0, VIRTIO_BLK_T_OUT, 3);
        rig.offer(&[(h0, 16, false), (DATA, 256, false), (DATA + 256, 768, false), (DATA + 1024, 1024, false), st(0)]);
        rig.kick();
        assert_eq!(rig.status(0), S_OK);
        let h1 = rig.header(1, VIRTIO_BLK_T_IN, 3);
        let back = DATA + 0x10000;
        rig.offer(&[(h1, 16, false), (back, 1000, true), (back + 1000, 1048, true), st(1)]);
        let used = rig.kick();
        assert_eq!(rig.status(1), S_OK);
        assert_eq!(used.last().unwrap().1, 2049);
        let mut got = vec![0u8; 2048];
        rig.mem().read_slice(&mut got, GuestAddress(back)).unwrap();
        assert!(got == pattern, "zero_copy={zero_copy}");
    }
}

#[test]
fn the_guest_switches_the_write_cache_through_the_config() {
    use crate::handler::BlkHandler;
    use vhost::vhost_user::message::VhostUserConfigFlags;
    use vhost::vhost_user::VhostUserBackendReqHandlerMut;
    let rig = Rig::new("wce", false);
    let mut h = BlkHandler::new(rig.ctx_shared(), 2, "wce");
    let f = VhostUserConfigFlags::empty();
    let cfg = h.get_config(0, 60, f).unwrap();
    assert_eq!(u64::from_le_bytes(cfg[0..8].try_into().unwrap()), DISK / 512);
    assert_eq!(u16::from_le_bytes(cfg[34..36].try_into().unwrap()), 2, "num_queues");
    assert_eq!(cfg[32], 1, "writeback at start");
    h.set_config(32, &[0], f).unwrap();
    assert_eq!(h.get_config(32, 1, f).unwrap(), vec![0]);
    assert!(h.set_config(0, &[1], f).is_err(), "only wce is writable");
    assert!(h.set_config(32, &[2], f).is_err());
    assert_eq!(h.get_config(56, 8, f).unwrap(), vec![1, 0, 0, 0, 0, 0, 0, 0], "past the end reads as zeros");
    // Without FLUSH negotiated the device writes through.
    h.set_config(32, &[1], f).unwrap();
    h.set_features(0).unwrap();
    assert_eq!(h.get_config(32, 1, f).unwrap(), vec![0]);
    assert_eq!(h.get_queue_num().unwrap(), 2);
    assert!(h.set_features(1 << 63).is_err(), "features never offered are refused");
}

/// The inflight log follows the ring: heads are flagged while the engine has
/// them and cleared once on the used ring, with the header's used index in step.
#[test]
fn heads_are_in_flight_from_pop_to_the_used_ring() {
    use crate::inflight::InflightBuf;
    let mut rig = Rig::new("inflight", false);
    let buf = Arc::new(InflightBuf::anonymous(1, QSIZE));
    {
        let mut s = rig.vring.lock();
        let mut log = buf.queue(0).unwrap();
        assert_eq!(log.recover(0, QSIZE).next_avail, None, "a fresh buffer");
        s.log = Some(log);
    }
    let st = |n| (Rig::status_of(n), 1, true);
    for n in 0..3u16 {
        let h = rig.header(n, VIRTIO_BLK_T_OUT, u64::from(n) * 8);
        rig.offer(&[(h, 16, false), (DATA, 4096, false), st(n)]);
    }
    let used = rig.kick();
    assert_eq!(used.len(), 3);
    let mut again = buf.queue(0).unwrap();
    let r = again.recover(3, QSIZE);
    assert_eq!(r.resubmit, Vec::<u16>::new(), "nothing is left in flight once answered");
    assert_eq!(r.next_avail, Some(3));
}

/// A backend that took three writes and died before answering them: the next
/// one, on the same inflight buffer, serves them before the available ring,
/// and the guest gets every one back exactly once.
#[test]
fn heads_left_in_flight_are_resubmitted_first() {
    use crate::inflight::InflightBuf;
    let mut rig = Rig::new("resubmit", false);
    let buf = Arc::new(InflightBuf::anonymous(1, QSIZE));
    let st = |n| (Rig::status_of(n), 1, true);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 11 + 5) as u8).collect();
    rig.mem().write_slice(&pattern, GuestAddress(DATA)).unwrap();
    let mut heads = Vec::new();
    for n in 0..3u16 {
        let h = rig.header(n, VIRTIO_BLK_T_OUT, u64::from(n) * 8);
        heads.push(rig.offer(&[(h, 16, false), (DATA, 4096, false), st(n)]));
    }
    // The dead backend: took all three (flagged in the log), answered none.
    let mut dead = buf.queue(0).unwrap();
    dead.recover(0, QSIZE);
    for &h in heads.iter().rev() {
        dead.mark(h);
    }
    // A fourth request came after the death.
    let h3 = rig.header(3, VIRTIO_BLK_T_IN, 16);
    let read = rig.offer(&[(h3, 16, false), (DATA + 0x8000, 4096, true), st(3)]);
    rig.mem().write_slice(&[0xee; 4], GuestAddress(STATUS)).unwrap();
    // The new backend starts the ring as the handler does.
    {
        let mut s = rig.vring.lock();
        let mut log = buf.queue(0).unwrap();
        let r = log.recover(0, QSIZE);
        assert_eq!(r.resubmit, heads.iter().rev().copied().collect::<Vec<_>>(), "oldest counter first");
        assert_eq!(r.next_avail, Some(3));
        s.queue.set_next_avail(3);
        s.log = Some(log);
        rig.ctx.set_resubmit(r.resubmit);
    }
    let used = rig.kick();
    assert_eq!(used.len(), 4, "{used:?}");
    for n in 0..4 {
        assert_eq!(rig.status(n), S_OK, "request {n}");
    }
    assert_eq!(len_of(&used, read), 4097);
    // The resubmitted write reached the disk.
    let h4 = rig.header(4, VIRTIO_BLK_T_IN, 16);
    rig.offer(&[(h4, 16, false), (DATA + 0x8000, 4096, true), st(4)]);
    assert_eq!(rig.kick().len(), 5);
    let mut got = vec![0u8; 4096];
    rig.mem().read_slice(&mut got, GuestAddress(DATA + 0x8000)).unwrap();
    assert!(got == pattern, "the resubmitted write at sector 16 is on the disk");
    let r = buf.queue(0).unwrap().recover(5, QSIZE);
    assert!(r.resubmit.is_empty(), "{r:?}");
}

/// Random descriptor tables (random addresses in and out of guest memory,
/// lengths, directions, NEXT and INDIRECT flags, loops) with random headers:
/// the parser never panics, and every chain the guest offers comes back on
/// the used ring.
#[test]
fn random_chains_never_panic_and_always_come_back() {
    let mut rig = Rig::new("random", false);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let kinds = [
        VIRTIO_BLK_T_IN,
        VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_FLUSH,
        VIRTIO_BLK_T_GET_ID,
        VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_WRITE_ZEROES,
        7,
    ];
    let mut offered = 0u16;
    let mut answered = [0usize; 3];
    for _round in 0..300 {
        // Headers and discard ranges, valid-looking and not, in the header area.
        for n in 0..32u16 {
            let kind = kinds[rand(kinds.len() as u64) as usize];
            rig.header(n, kind, rand(DISK / 512 + 16));
        }
        let mut junk = [0u8; 256];
        junk.iter_mut().for_each(|b| *b = rand(256) as u8);
        rig.mem().write_slice(&junk, GuestAddress(HDRS + 0x1000)).unwrap();
        let mem = rig.mem();
        // Chains of four (header, two data, status) with each field sometimes garbled.
        for i in 0..QSIZE {
            let d = random_descriptor(i, &mut rand);
            mem.write_obj(RawDescriptor::from(d), GuestAddress(u64::from(i) * 16)).unwrap();
        }
        drop(mem);
        let count = 1 + rand(8) as u16;
        for _ in 0..count {
            let head = if rand(4) == 0 { rand(QSIZE as u64) as u16 } else { 4 * rand(QSIZE as u64 / 4) as u16 };
            let slot = rig.avail_addr.0 + 4 + 2 * u64::from(rig.chains % QSIZE);
            rig.mem().write_obj(head, GuestAddress(slot)).unwrap();
            rig.chains = rig.chains.wrapping_add(1);
        }
        rig.mem().write_obj(rig.chains, GuestAddress(rig.avail_addr.0 + 2)).unwrap();
        offered = offered.wrapping_add(count);
        rig.ctx.kick();
        rig.ctx.wait_idle();
        let used: u16 = rig.mem().read_obj(GuestAddress(rig.used_addr.0 + 2)).unwrap();
        assert_eq!(used, offered, "every offered chain is returned");
        for i in 0..count {
            let at = rig.used_addr.0 + 4 + 8 * u64::from(used.wrapping_sub(count - i) % QSIZE);
            let len: u32 = rig.mem().read_obj(GuestAddress(at + 4)).unwrap();
            answered[match len {
                0 => 0,
                1 => 1,
                _ => 2,
            }] += 1;
        }
    }
    eprintln!("random chains: {answered:?} (no status, status only, data + status)");
    assert!(answered.iter().all(|&n| n > 0), "each kind of outcome happened: {answered:?}");
}

/// Descriptor `i` of a table of four-descriptor chains (header, two data,
/// status), each field sometimes garbled: addresses in and out of guest
/// memory, odd lengths, flipped directions, NEXT, INDIRECT, loops.
fn random_descriptor(i: u16, rand: &mut impl FnMut(u64) -> u64) -> Descriptor {
    let lens = [0u32, 1, 8, 16, 17, 512, 1000, 1024, 4096, 65536];
    let pos = i % 4;
    let write_data = rand(2) == 0;
    let (mut addr, mut len, mut write, mut next) = match pos {
        0 => (HDRS + 16 * rand(32), 16, false, true),
        1 | 2 => (DATA + 512 * rand(1024), 512 * (1 + rand(8) as u32), write_data, true),
        _ => (STATUS + u64::from(i), 1, true, false),
    };
    if rand(8) == 0 {
        addr = match rand(3) {
            0 => HDRS + 0x1000 + rand(240),
            1 => MEM as u64 - rand(1024),
            _ => rand(MEM as u64 + 0x10000),
        };
    }
    if rand(8) == 0 {
        len = if rand(4) == 0 { rand(1 << 20) as u32 } else { lens[rand(lens.len() as u64) as usize] };
    }
    if rand(8) == 0 {
        write = !write;
    }
    if rand(10) == 0 {
        next = !next;
    }
    let mut flags = 0u16;
    if next {
        flags |= VRING_DESC_F_NEXT as u16;
    }
    if write {
        flags |= VRING_DESC_F_WRITE as u16;
    }
    if rand(40) == 0 {
        flags |= virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    }
    let to = if rand(10) == 0 { rand(QSIZE as u64 + 4) as u16 } else { i + 1 };
    Descriptor::new(addr, len, flags, to)
}

/// The memory table (SET_MEM_TABLE) and single regions (ADD/REM_MEM_REG) as
/// the handler keeps them: ring addresses are translated from the frontend's
/// address space, and only inside a region it was given.
#[test]
fn memory_regions_translate_ring_addresses() {
    use crate::handler::BlkHandler;
    use vhost::vhost_user::message::{VhostUserMemoryRegion, VhostUserSingleMemoryRegion, VhostUserVringAddrFlags};
    use vhost::vhost_user::VhostUserBackendReqHandlerMut;
    let rig = Rig::new("memtable", false);
    let file = |name: &str| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(rig.dir.join(name))
            .unwrap();
        f.set_len(1 << 20).unwrap();
        f
    };
    let mut h = BlkHandler::new(rig.ctx_shared(), 1, "memtable");
    let va = 0x7f00_0000_0000u64;
    let flags = VhostUserVringAddrFlags::empty;
    h.set_mem_table(&[VhostUserMemoryRegion::new(0, 1 << 20, va, 0)], vec![file("a")], None).unwrap();
    h.set_vring_num(0, 64).unwrap();
    assert!(h.set_vring_num(0, 100).is_err(), "not a power of two");
    h.set_vring_addr(0, flags(), va + 0x1000, va + 0x3000, va + 0x2000, 0).unwrap();
    assert!(h.set_vring_addr(0, flags(), va + (2 << 20), va, va, 0).is_err(), "outside every region");
    // A second region at 1 MiB, then gone again.
    let va2 = 0x7f00_1000_0000u64;
    h.add_mem_region(&VhostUserSingleMemoryRegion::new(1 << 20, 1 << 20, va2, 0), file("b"), None).unwrap();
    h.set_vring_addr(0, flags(), va2, va2 + 0x2000, va2 + 0x1000, 0).unwrap();
    h.remove_mem_region(&VhostUserSingleMemoryRegion::new(1 << 20, 1 << 20, va2, 0)).unwrap();
    assert!(h.set_vring_addr(0, flags(), va2, va2 + 0x2000, va2 + 0x1000, 0).is_err(), "the region is gone");
    h.set_vring_addr(0, flags(), va + 0x1000, va + 0x3000, va + 0x2000, 0).unwrap();
}

#[test]
fn a_chain_that_panics_gets_ioerr_and_the_queue_goes_on() {
    let mut rig = Rig::new("panic", false);
    let h0 = rig.header(0, VIRTIO_BLK_T_IN, 0);
    let bad = rig.offer(&[(h0, 16, false), (DATA, 512, true), (Rig::status_of(0), 1, true)]);
    let h1 = rig.header(1, VIRTIO_BLK_T_IN, 8);
    let good = rig.offer(&[(h1, 16, false), (DATA + 4096, 4096, true), (Rig::status_of(1), 1, true)]);
    rig.mem().write_obj(0xffu8, GuestAddress(Rig::status_of(0))).unwrap();
    PANIC_NEXT_PARSE.with(|p| p.set(true));
    let used = rig.kick();
    assert_eq!(rig.status(0), S_IOERR, "the chain that panicked");
    assert_eq!(len_of(&used, bad), 1, "IOERR: the status byte only");
    assert_eq!(rig.status(1), S_OK, "the chain after it");
    assert_eq!(len_of(&used, good), 4097);
    // And the next kick is served as ever.
    let h2 = rig.header(2, VIRTIO_BLK_T_IN, 16);
    let next = rig.offer(&[(h2, 16, false), (DATA + 8192, 512, true), (Rig::status_of(2), 1, true)]);
    let used = rig.kick();
    assert_eq!(rig.status(2), S_OK);
    assert_eq!(len_of(&used, next), 513);
}

extern "C" fn ignore(_: libc::c_int) {}

/// A ring's worker waits for kicks in epoll_wait, which a signal (a handler
/// without SA_RESTART here; a stop and continue of the process in life) ends
/// with EINTR: the worker must wait again and serve the next kick.
#[test]
fn a_ring_worker_waits_again_after_signals_without_sa_restart() {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    use std::os::unix::thread::JoinHandleExt;
    use std::time::{Duration, Instant};

    // SAFETY: sigaction is plain data; all zero is a valid (empty) value.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = ignore as *const () as usize;
    sa.sa_flags = 0; // no SA_RESTART: epoll_wait fails with EINTR
                     // SAFETY: a handler that does nothing for SIGURG, which nothing else here uses.
    assert_eq!(unsafe { libc::sigaction(libc::SIGURG, &sa, std::ptr::null_mut()) }, 0);
    let mut rig = Rig::new("eintr", false);
    // SAFETY: eventfd only reads its arguments; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: fd was just created and is owned by nobody else.
    let kick = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut kicker = kick.try_clone().unwrap();
    let wake = Arc::new(vdisk_engine::wake::EventFd::new().unwrap());
    let exit = Arc::new(AtomicBool::new(false));
    let worker = {
        let (ctx, wake, exit) = (rig.ctx.clone(), wake.clone(), exit.clone());
        std::thread::spawn(move || crate::handler::serve_ring(&ctx, kick, &wake, &exit))
    };
    for _ in 0..50 {
        // SAFETY: the worker is alive (joined only below); SIGURG has a handler.
        unsafe { libc::pthread_kill(worker.as_pthread_t(), libc::SIGURG) };
        std::thread::sleep(Duration::from_millis(1));
    }
    let h = rig.header(0, VIRTIO_BLK_T_IN, 0);
    rig.mem().write_obj(0xffu8, GuestAddress(Rig::status_of(0))).unwrap();
    rig.offer(&[(h, 16, false), (DATA, 512, true), (Rig::status_of(0), 1, true)]);
    kicker.write_all(&1u64.to_ne_bytes()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.status(0) == 0xff {
        assert!(Instant::now() < deadline, "the worker never served the kick after the signals");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(rig.status(0), S_OK);
    exit.store(true, std::sync::atomic::Ordering::SeqCst);
    wake.wake();
    worker.join().unwrap();
}
