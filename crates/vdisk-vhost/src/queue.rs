//! One virtqueue's request path. On a kick the queue's worker drains every
//! available chain, parses each, submits all valid ones to the engine as one
//! batch and answers the malformed ones at once. Completions come back in
//! batches on engine threads: their data is copied to the guest, status bytes
//! written, all of them put on the used ring under one lock, and the guest is
//! notified once per batch (or not at all, when EVENT_IDX says it need not be).
//!
//! Requests in flight are counted, so a stopping queue can wait for them.
//!
//! Zero copy: when every data descriptor of a read or write lies within one
//! guest memory region and is a whole number of sectors, each becomes an
//! engine request whose data is the guest's memory, lent as a `Lent`
//! (consecutive offsets; the engine merges them into one vectored call), and
//! the virtio request completes when all of them have. The memory stays mapped
//! while a request holds its `Arc` of the guest memory, and is never a Rust
//! reference while the engine has it. Otherwise the data is copied.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vdisk_engine::inflight::InFlight;
use vdisk_engine::slab::Slab;
use vdisk_engine::{Buf, Command, Data, Device, Lent, Op, Request, Sink};
use virtio_queue::{Queue, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestRegionMmap,
};

use crate::config::{ID_BYTES, SECTOR};
use crate::parse::{self, Action, Limits, Parsed, Seg, S_IOERR, S_OK};

pub type Gm = GuestMemoryAtomic<Mem>;
pub use crate::vring::{Mem, Vring};

/// What every queue of a device shares.
pub struct Shared {
    pub device: Arc<Device>,
    pub mem: Mutex<Gm>,
    pub writeback: AtomicBool,
    pub event_idx: AtomicBool,
    pub serial: [u8; ID_BYTES],
    /// Let the engine read into and write from guest memory directly.
    pub zero_copy: bool,
}

impl Shared {
    fn limits(&self) -> Limits {
        Limits {
            size: self.device.size(),
            read_only: self.device.read_only(),
            writeback: self.writeback.load(Ordering::Relaxed),
        }
    }
}

/// A request the engine holds.
struct Pending {
    head: u16,
    status: Option<GuestAddress>,
    /// The guest memory the request's addresses refer to (kept mapped while in flight).
    mem: Arc<Mem>,
    /// Read data goes here on completion.
    read_into: Vec<Seg>,
    /// Bytes of data the device writes into the chain on success (before the status byte).
    written: u32,
    /// Engine requests still out for this virtio request.
    parts: usize,
    failed: bool,
}

pub struct QueueCtx {
    shared: Arc<Shared>,
    vring: Arc<Vring>,
    /// Heads a previous backend took and never answered (inflight log), oldest
    /// first: served at the next kick, before the available ring.
    resubmit: Mutex<Vec<u16>>,
    /// Pending requests; the engine tag is the slot.
    pending: Mutex<Slab<Pending>>,
    /// Virtio requests with the engine.
    inflight: InFlight,
}

impl QueueCtx {
    pub fn new(shared: Arc<Shared>, vring: Arc<Vring>) -> Arc<QueueCtx> {
        Arc::new(QueueCtx {
            shared,
            vring,
            resubmit: Mutex::new(Vec::new()),
            pending: Mutex::new(Slab::default()),
            inflight: InFlight::new(),
        })
    }

    /// The device's name, for the log.
    pub fn name(&self) -> &str {
        self.shared.device.name()
    }

    pub fn vring(&self) -> &Arc<Vring> {
        &self.vring
    }

    /// Heads to serve again before the available ring (see [`QueueCtx::resubmit`]).
    pub fn set_resubmit(&self, heads: Vec<u16>) {
        *self.resubmit.lock().unwrap_or_else(|e| e.into_inner()) = heads;
    }

    /// Serves a kick: drains the queue (again while the guest keeps adding,
    /// with EVENT_IDX), submits one batch, answers what needs no engine.
    /// Heads left in flight by a previous backend go first.
    pub fn kick(self: &Arc<Self>) {
        let mem: Arc<Mem> = self.shared.mem.lock().unwrap_or_else(|e| e.into_inner()).memory().into_inner();
        let limits = self.shared.limits();
        let event_idx = self.shared.event_idx.load(Ordering::Relaxed);
        let mut parsed = Vec::new();
        {
            let mut state = self.vring.lock();
            if !state.serving() {
                return;
            }
            let resubmit = std::mem::take(&mut *self.resubmit.lock().unwrap_or_else(|e| e.into_inner()));
            if !resubmit.is_empty() {
                log::info!(
                    "vhost-user-blk: submitting {} request(s) a previous backend left in flight",
                    resubmit.len()
                );
                resubmit_chains(&mem, &state.queue, &resubmit, &limits, &mut parsed);
            }
            let state = &mut *state;
            loop {
                if event_idx {
                    let _ = state.queue.disable_notification(&*mem);
                }
                while let Some(chain) = state.queue.pop_descriptor_chain(&*mem) {
                    if let Some(log) = state.log.as_mut() {
                        log.mark(chain.head_index());
                    }
                    parsed.push(parse_guarded(chain, &limits));
                }
                if !event_idx || !state.queue.enable_notification(&*mem).unwrap_or(false) {
                    break;
                }
            }
            // Counted under the ring's lock: a stop that marked the queue not
            // ready before this drain sees nothing; one after it sees these.
            let engine = parsed.iter().filter(|p| matches!(p.action, Action::Io { .. })).count();
            self.inflight.begin(engine, 0);
        }
        self.dispatch(parsed, &mem);
    }

    /// Submits the engine's part of a drained batch and answers the rest.
    fn dispatch(self: &Arc<Self>, parsed: Vec<Parsed>, mem: &Arc<Mem>) {
        let mut batch = Vec::new();
        let mut answered = Vec::new();
        let mut failed_io = 0;
        {
            let mut slab = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            for p in parsed {
                match p.action {
                    Action::Answer(s) => answered.push(self.answer(mem, p.head, p.status, s, 0)),
                    Action::GetId { segs } => {
                        let (s, n) = match parse::write_id(&**mem, &segs, &self.shared.serial) {
                            Some(n) => (S_OK, n),
                            None => (S_IOERR, 0),
                        };
                        answered.push(self.answer(mem, p.head, p.status, s, n));
                    }
                    Action::Io { op, offset, len, segs } => {
                        let read = op == Op::Read;
                        let lent = if self.shared.zero_copy && op.is_data() { lend(mem, &segs) } else { None };
                        let mut pending = Pending {
                            head: p.head,
                            status: p.status,
                            mem: mem.clone(),
                            written: if read { len as u32 } else { 0 },
                            read_into: Vec::new(),
                            parts: 1,
                            failed: false,
                        };
                        if let Some(pieces) = lent {
                            pending.parts = pieces.len();
                            let slot = slab.insert(pending) as u64;
                            let mut at = offset;
                            for piece in pieces {
                                let n = piece.len() as u64;
                                batch.push(Request::new(Command::new(op, piece.into()), at, n, slot));
                                at += n;
                            }
                            continue;
                        }
                        let mut data = Data::default();
                        if matches!(op, Op::Write { .. }) {
                            match copy_in(mem, &segs, len) {
                                Some(buf) => data = buf.into(),
                                None => {
                                    failed_io += 1;
                                    answered.push(self.answer(mem, p.head, p.status, S_IOERR, 0));
                                    continue;
                                }
                            }
                        }
                        let mut req = Request::new(Command::new(op, data), offset, len, 0);
                        if read {
                            pending.read_into = segs;
                        }
                        req.tag = slab.insert(pending) as u64;
                        batch.push(req);
                    }
                }
            }
        }
        if !batch.is_empty() {
            let sink: Arc<dyn Sink> = self.clone();
            let mut done = Vec::new();
            self.shared.device.submit_inline(batch, &sink, &mut done);
            if !done.is_empty() {
                self.complete(done);
            }
        }
        self.publish(mem, &answered);
        self.release(failed_io);
    }

    /// Writes a status byte now; returns the used-ring entry.
    fn answer(&self, mem: &Mem, head: u16, status: Option<GuestAddress>, s: u8, written: u32) -> (u16, u32) {
        match status {
            Some(at) if mem.write_obj(s, at).is_ok() => (head, written + 1),
            _ => (head, 0),
        }
    }

    /// Puts finished chains on the used ring and notifies the guest once.
    fn publish(&self, mem: &Mem, used: &[(u16, u32)]) {
        if used.is_empty() {
            return;
        }
        let mut state = self.vring.lock();
        for &(head, len) in used {
            if let Err(e) = state.add_used(mem, head, len) {
                log::warn!("vhost-user-blk: cannot return descriptor {head} to the guest: {e}");
            }
        }
        if state.needs_notification(mem) {
            if let Err(e) = state.signal() {
                log::warn!("vhost-user-blk: cannot notify the guest: {e}");
            }
        }
    }

    fn release(&self, n: usize) {
        self.inflight.end(n, 0);
    }

    /// Waits until the engine holds no request of this queue.
    pub fn wait_idle(&self) {
        self.inflight.wait_idle();
    }
}

impl Sink for QueueCtx {
    fn complete(&self, done: Vec<Request>) {
        let mut used = Vec::with_capacity(done.len());
        let mut mem = None;
        {
            let mut slab = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            for req in done {
                let slot = req.tag as usize;
                let Some(p) = slab.get_mut(slot) else { continue };
                if req.error.is_some() {
                    self.shared.device.errors().failed("vhost-user-blk", &req);
                    p.failed = true;
                } else if !p.read_into.is_empty() && !copy_out(&p.mem, &p.read_into, req.buf()) {
                    p.failed = true;
                }
                // Lent guest memory is let go of here, before the guest sees the request done.
                drop(req);
                p.parts -= 1;
                if p.parts > 0 {
                    continue;
                }
                let p = slab.remove(slot).expect("slot is taken");
                let (s, written) = if p.failed { (S_IOERR, 0) } else { (S_OK, p.written) };
                used.push(self.answer(&p.mem, p.head, p.status, s, written));
                mem = Some(p.mem);
            }
        }
        if let Some(mem) = mem {
            self.publish(&mem, &used);
        }
        self.release(used.len());
    }
}

/// The guest memory of `segs` lent to the engine, one piece per segment, when
/// each lies in one memory region and is a whole number of sectors (so no two
/// engine requests share a sector); None otherwise.
fn lend(mem: &Arc<Mem>, segs: &[Seg]) -> Option<Vec<Lent>> {
    let mut bufs = Vec::with_capacity(segs.len());
    for &(addr, n) in segs {
        if !u64::from(n).is_multiple_of(SECTOR) {
            return None;
        }
        let slice = GuestMemoryBackend::get_slice(&**mem, addr, n as usize).ok()?;
        let ptr = NonNull::new(slice.ptr_guard_mut().as_ptr())?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = mem.clone();
        // SAFETY: `ptr` is the host mapping of `n` bytes of guest memory inside one
        // region of `mem`; the mapping lives as long as `mem`, which the Lent holds.
        // While the engine has the request, nothing in this process touches those
        // bytes (the parser is done with them and the status byte is elsewhere);
        // the guest may, which `Lent` allows: it never makes a reference to them.
        bufs.push(unsafe { Lent::new(ptr, n as usize, owner) });
    }
    Some(bufs)
}

/// Copies a write's data out of guest memory.
fn copy_in(mem: &Mem, segs: &[Seg], len: u64) -> Option<Buf> {
    let mut buf = Buf::for_io(len as usize);
    let mut at = 0;
    for &(addr, n) in segs {
        mem.read_slice(&mut buf[at..at + n as usize], addr).ok()?;
        at += n as usize;
    }
    Some(buf)
}

/// Copies a read's data into guest memory.
fn copy_out(mem: &Mem, segs: &[Seg], buf: &[u8]) -> bool {
    let mut at = 0;
    for &(addr, n) in segs {
        if mem.write_slice(&buf[at..at + n as usize], addr).is_err() {
            return false;
        }
        at += n as usize;
    }
    true
}

/// Parses the chains of `heads` (taken by a previous backend, still in the
/// descriptor table since the guest never got them back). virtio-queue makes
/// chains only from an available ring, so a scratch one is used: the guest's
/// memory plus one private page past its end holding an available ring that
/// lists `heads`, read through a copy of the queue (same descriptor table).
/// The chains' data is checked against that memory; the real guest memory is
/// used for every access after parsing, so a descriptor pointing at the
/// scratch page only fails there (IOERR), as any bad address does.
fn resubmit_chains(mem: &Arc<Mem>, queue: &Queue, heads: &[u16], limits: &Limits, out: &mut Vec<Parsed>) {
    let size = usize::from(queue.size());
    let ring_bytes = (6 + 2 * size).next_multiple_of(4);
    let used_bytes = 6 + 8 * size;
    let Some(end) = mem.last_addr().checked_add(1) else { return };
    let at = GuestAddress(end.0.next_multiple_of(4096));
    let region = match vm_memory::MmapRegion::new((ring_bytes + used_bytes).next_multiple_of(4096))
        .ok()
        .and_then(|r| GuestRegionMmap::new(r, at))
    {
        Some(r) => Arc::new(r),
        None => return,
    };
    let Ok(scratch) = (**mem).insert_region(region) else { return };
    let _ = scratch.write_obj(heads.len() as u16, at.unchecked_add(2));
    for (i, &h) in heads.iter().enumerate() {
        let _ = scratch.write_obj(h, at.unchecked_add(4 + 2 * i as u64));
    }
    let mut q = match Queue::new(queue.max_size()) {
        Ok(q) => q,
        Err(_) => return,
    };
    q.set_size(queue.size());
    let _ = q.try_set_desc_table_address(GuestAddress(queue.desc_table()));
    let _ = q.try_set_avail_ring_address(at);
    let _ = q.try_set_used_ring_address(at.unchecked_add(ring_bytes as u64));
    q.set_ready(true);
    for &h in heads {
        match q.pop_descriptor_chain(&scratch) {
            Some(chain) => out.push(parse_guarded(chain, limits)),
            None => log::warn!("vhost-user-blk: head {h} left in flight cannot be read again"),
        }
    }
}

/// One chain's panic edge: a panic while judging a chain answers it IOERR (in
/// its last device-writable byte, where a virtio-blk status goes) with one
/// error line, and the queue goes on with the next chain. (The fuzzer calls
/// [`parse::parse`] itself, so it still sees every panic.)
fn parse_guarded<M>(chain: virtio_queue::DescriptorChain<M>, limits: &Limits) -> Parsed
where
    M: std::ops::Deref + Clone,
    M::Target: vm_memory::GuestMemory,
{
    let head = chain.head_index();
    let status = chain
        .clone()
        .last()
        .filter(|d| d.is_write_only() && d.len() > 0)
        .and_then(|d| d.addr().checked_add(u64::from(d.len()) - 1));
    let judged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        #[cfg(test)]
        if crate::tests::PANIC_NEXT_PARSE.with(|p| p.replace(false)) {
            panic!("a test asked this chain to panic");
        }
        parse::parse(chain, limits)
    }));
    judged.unwrap_or_else(|p| {
        let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
        log::error!(
            "vhost-user-blk: judging request {head} panicked: {}; it gets IOERR",
            why.as_deref().unwrap_or("a panic without a message")
        );
        Parsed { head, status, action: Action::Answer(S_IOERR) }
    })
}
