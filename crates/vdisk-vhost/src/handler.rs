//! vdisk's own vhost-user request handler for the blk device: the `vhost`
//! crate parses the messages and calls this; it owns the memory table, the
//! rings, one worker thread per ring (waiting on the ring's kick eventfd), the
//! config space and the inflight buffer (GET/SET_INFLIGHT_FD, see
//! [`crate::inflight`]). One `BlkHandler` lives for one frontend connection.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight, VhostUserLog,
    VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserSharedMsg,
    VhostUserSingleMemoryRegion, VhostUserVirtioFeatures, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Error, GpuBackend, Result, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap, GuestRegionMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use vdisk_engine::wake::EventFd;

use crate::config::{self, CONFIG_LEN, MAX_QUEUE_SIZE, WCE_OFFSET};
use crate::inflight::InflightBuf;
use crate::queue::{Mem, QueueCtx, Shared, Vring};

/// Memory slots offered with CONFIGURE_MEM_SLOTS (ADD/REM_MEM_REG).
const MAX_MEM_SLOTS: u64 = 32;

/// A guest memory region as the frontend's address space has it.
struct Mapping {
    vmm_addr: u64,
    size: u64,
    gpa: u64,
}

/// A ring's worker thread.
struct Worker {
    wake: Arc<EventFd>,
    exit: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Worker {
    fn stop(self) {
        self.exit.store(true, Ordering::SeqCst);
        self.wake.wake();
        let _ = self.thread.join();
    }
}

pub struct BlkHandler {
    shared: Arc<Shared>,
    queues: Vec<Arc<QueueCtx>>,
    workers: Vec<Option<Worker>>,
    mappings: Vec<Mapping>,
    acked_features: u64,
    acked_protocol: u64,
    inflight: Option<Arc<InflightBuf>>,
    name: String,
}

fn bit(b: u32) -> u64 {
    1u64 << b
}

fn io_err(e: impl std::fmt::Display) -> Error {
    Error::ReqHandlerError(io::Error::other(e.to_string()))
}

impl BlkHandler {
    pub fn new(shared: Arc<Shared>, num_queues: u16, name: &str) -> BlkHandler {
        let queues =
            (0..num_queues).map(|_| QueueCtx::new(shared.clone(), Arc::new(Vring::new(MAX_QUEUE_SIZE)))).collect();
        BlkHandler {
            shared,
            queues,
            workers: (0..num_queues).map(|_| None).collect(),
            mappings: Vec::new(),
            acked_features: 0,
            acked_protocol: 0,
            inflight: None,
            name: name.to_owned(),
        }
    }

    /// Stops every worker and waits until no queue has a request in the engine
    /// (the frontend is gone or the export stops).
    pub fn shutdown(&mut self) {
        for w in self.workers.iter_mut() {
            if let Some(w) = w.take() {
                w.stop();
            }
        }
        for q in &self.queues {
            q.vring().lock().queue.set_ready(false);
        }
        self.queues.iter().for_each(|q| q.wait_idle());
    }

    fn queue(&self, index: u32) -> Result<&Arc<QueueCtx>> {
        self.queues.get(index as usize).ok_or(Error::InvalidParam)
    }

    fn vmm_to_gpa(&self, va: u64) -> Result<u64> {
        self.mappings
            .iter()
            .find(|m| va >= m.vmm_addr && va - m.vmm_addr < m.size)
            .map(|m| va - m.vmm_addr + m.gpa)
            .ok_or(Error::InvalidParam)
    }

    fn memory(&self) -> Arc<Mem> {
        self.shared.mem.lock().unwrap().memory().into_inner()
    }

    fn set_memory(&self, mem: Mem) {
        *self.shared.mem.lock().unwrap() = GuestMemoryAtomic::new(mem);
    }

    fn wake(&self, index: usize) {
        if let Some(Some(w)) = self.workers.get(index) {
            w.wake.wake();
        }
    }

    fn stop_worker(&mut self, index: usize) {
        if let Some(w) = self.workers.get_mut(index).and_then(Option::take) {
            w.stop();
        }
    }

    /// Starts ring `index` on its kick eventfd: reconciles it with the
    /// inflight log (heads to resubmit, the next available index), then a
    /// worker serves every kick, and one right away for what is already there.
    fn start_ring(&mut self, index: usize, kick: File) -> Result<()> {
        self.stop_worker(index);
        let mem = self.memory();
        let ctx = self.queue(index as u32)?.clone();
        {
            let mut state = ctx.vring().lock();
            // (virtio-queue judges only a ready queue)
            state.queue.set_ready(true);
            if !state.queue.is_valid(&*mem) {
                state.queue.set_ready(false);
                return Err(Error::InvalidOperation("ring addresses outside guest memory"));
            }
            let size = state.queue.size();
            let used = state.queue.used_idx(&*mem, Ordering::Acquire).map_err(io_err)?.0;
            let state = &mut *state;
            if let Some(log) = state.log.as_mut() {
                let r = log.recover(used, size);
                if let Some(next) = r.next_avail {
                    state.queue.set_next_avail(next);
                }
                state.queue.set_next_used(used);
                if !r.resubmit.is_empty() {
                    log::info!(
                        "{}: queue {index}: {} request(s) in flight at the last backend's end",
                        self.name,
                        r.resubmit.len()
                    );
                }
                ctx.set_resubmit(r.resubmit);
            }
            state.queue.set_ready(true);
            // An interrupt, in case the last backend put requests on the used
            // ring and died (or disconnected) before the guest heard of it:
            // a guest with nothing else in flight would wait forever.
            let _ = state.signal();
        }
        let wake = Arc::new(EventFd::new().map_err(io_err)?);
        let exit = Arc::new(AtomicBool::new(false));
        let thread = {
            let (wake, exit, ctx) = (wake.clone(), exit.clone(), ctx.clone());
            std::thread::Builder::new()
                .name(format!("{}-q{index}", self.name))
                .spawn(move || serve_ring(&ctx, kick, &wake, &exit))
                .map_err(Error::ReqHandlerError)?
        };
        self.workers[index] = Some(Worker { wake, exit, thread });
        self.wake(index);
        Ok(())
    }
}

/// A ring's worker: waits for the kick eventfd (or a wake-up from the handler) and serves the ring.
pub(crate) fn serve_ring(ctx: &Arc<QueueCtx>, mut kick: File, wake: &EventFd, exit: &AtomicBool) {
    const KICK: u64 = 0;
    const WAKE: u64 = 1;
    let Ok(epoll) = Epoll::new() else { return };
    let add = |fd: i32, data: u64| epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, data));
    if add(kick.as_raw_fd(), KICK).is_err() || add(wake.fd(), WAKE).is_err() {
        log::error!("vhost-user-blk: cannot wait for the ring's kicks");
        return;
    }
    let mut events = vec![EpollEvent::default(); 2];
    while !exit.load(Ordering::SeqCst) {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::error!("vhost-user-blk: waiting for kicks: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == KICK {
                let mut b = [0u8; 8];
                let _ = kick.read(&mut b);
            } else {
                wake.drain();
            }
        }
        if exit.load(Ordering::SeqCst) {
            break;
        }
        // The worker's panic edge: one chain's panic is answered IOERR inside
        // (see `queue::parse_guarded`); anything else is logged and the ring
        // is served again at the next kick instead of never again.
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.kick())) {
            let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            log::error!(
                "vhost-user-blk {}: serving a kick panicked: {}; the queue goes on",
                ctx.name(),
                why.as_deref().unwrap_or("a panic without a message")
            );
        }
    }
}

impl VhostUserBackendReqHandlerMut for BlkHandler {
    fn set_owner(&mut self) -> Result<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> Result<()> {
        Ok(())
    }

    fn reset_device(&mut self) -> Result<()> {
        Err(Error::InvalidOperation("reset_device is not supported"))
    }

    fn get_features(&mut self) -> Result<u64> {
        Ok(config::features(self.shared.device.read_only()))
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        if features & !config::features(self.shared.device.read_only()) != 0 {
            return Err(Error::InvalidParam);
        }
        self.acked_features = features;
        // Without FLUSH the guest cannot ask for durability: write through.
        self.shared.writeback.store(config::has(features, VIRTIO_BLK_F_FLUSH), Ordering::Relaxed);
        let event_idx = features & bit(VIRTIO_RING_F_EVENT_IDX) != 0;
        self.shared.event_idx.store(event_idx, Ordering::Relaxed);
        // Without PROTOCOL_FEATURES the rings are enabled at once (no SET_VRING_ENABLE comes).
        let enable = features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0;
        for q in &self.queues {
            let mut s = q.vring().lock();
            s.queue.set_event_idx(event_idx);
            if enable {
                s.enabled = true;
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy_listening.is_some() {
            return Err(Error::InvalidOperation("postcopy is not supported"));
        }
        let mut regions = Vec::new();
        let mut mappings = Vec::new();
        for (r, file) in ctx.iter().zip(files) {
            let region = GuestRegionMmap::new(r.mmap_region(file)?, GuestAddress(r.guest_phys_addr))
                .ok_or(Error::InvalidParam)?;
            regions.push(region);
            mappings.push(Mapping { vmm_addr: r.user_addr, size: r.memory_size, gpa: r.guest_phys_addr });
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(io_err)?;
        self.set_memory(mem);
        log::debug!("{}: memory table of {} region(s)", self.name, mappings.len());
        self.mappings = mappings;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()> {
        let num = u16::try_from(num).map_err(|_| Error::InvalidParam)?;
        if num == 0 || num > MAX_QUEUE_SIZE || !num.is_power_of_two() {
            return Err(Error::InvalidParam);
        }
        self.queue(index)?.vring().lock().queue.set_size(num);
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> Result<()> {
        let (desc, avail, used) = (self.vmm_to_gpa(descriptor)?, self.vmm_to_gpa(available)?, self.vmm_to_gpa(used)?);
        let mem = self.memory();
        let mut s = self.queue(index)?.vring().lock();
        s.queue.try_set_desc_table_address(GuestAddress(desc)).map_err(|_| Error::InvalidParam)?;
        s.queue.try_set_avail_ring_address(GuestAddress(avail)).map_err(|_| Error::InvalidParam)?;
        s.queue.try_set_used_ring_address(GuestAddress(used)).map_err(|_| Error::InvalidParam)?;
        // The used index is the guest's (SET_VRING_BASE only carries the available one).
        if let Ok(idx) = s.queue.used_idx(&*mem, Ordering::Acquire) {
            s.queue.set_next_used(idx.0);
        }
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
        self.queue(index)?.vring().lock().queue.set_next_avail(base as u16);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState> {
        // The frontend stops the ring: no more kicks are served, and the requests
        // already taken are answered before it gets the ring back.
        let ctx = self.queue(index)?.clone();
        self.stop_worker(index as usize);
        ctx.vring().lock().queue.set_ready(false);
        ctx.wait_idle();
        let mut s = ctx.vring().lock();
        s.call = None;
        Ok(VhostUserVringState::new(index, u32::from(s.queue.next_avail())))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        self.queue(u32::from(index))?;
        match fd {
            Some(kick) => self.start_ring(usize::from(index), kick),
            None => Err(Error::InvalidOperation("polling rings (no kick eventfd) are not supported")),
        }
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        let q = self.queue(u32::from(index))?;
        let mut s = q.vring().lock();
        s.call = fd;
        if s.queue.ready() {
            // As at ring start: the guest may owe itself a look at the used ring.
            let _ = s.signal();
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> Result<()> {
        self.queue(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
    }

    fn set_protocol_features(&mut self, features: u64) -> Result<()> {
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(self.queues.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        self.queue(index)?.vring().lock().enabled = enable;
        if enable {
            self.wake(index as usize);
        }
        Ok(())
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> Result<Vec<u8>> {
        let writeback = self.shared.writeback.load(Ordering::Relaxed);
        let space = config::encode(self.shared.device.size(), self.queues.len() as u16, writeback);
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(CONFIG_LEN);
        let end = (offset as usize).saturating_add(size as usize).min(CONFIG_LEN);
        out[..end - start].copy_from_slice(&space[start..end]);
        Ok(out)
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], _flags: VhostUserConfigFlags) -> Result<()> {
        // Only the writeback flag is writable (CONFIG_WCE).
        if offset as usize != WCE_OFFSET || buf.len() != 1 || buf[0] > 1 {
            return Err(Error::InvalidParam);
        }
        self.shared.writeback.store(buf[0] == 1, Ordering::Relaxed);
        Ok(())
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> Result<()> {
        Err(Error::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        Err(Error::InvalidOperation("no shared objects"))
    }

    fn get_inflight_fd(&mut self, inflight: &VhostUserInflight) -> Result<(VhostUserInflight, File)> {
        let (buf, file) =
            InflightBuf::create(inflight.num_queues, inflight.queue_size).map_err(Error::ReqHandlerError)?;
        let reply = VhostUserInflight {
            mmap_size: buf.size(),
            mmap_offset: 0,
            num_queues: inflight.num_queues,
            queue_size: inflight.queue_size,
        };
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> Result<()> {
        let buf =
            InflightBuf::map(file, inflight.mmap_offset, inflight.mmap_size, inflight.num_queues, inflight.queue_size)
                .map_err(Error::ReqHandlerError)?;
        let buf = Arc::new(buf);
        for (i, q) in self.queues.iter().enumerate() {
            q.vring().lock().log = u16::try_from(i).ok().and_then(|i| buf.queue(i));
        }
        self.inflight = Some(buf);
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> Result<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>> {
        if postcopy_listening.is_some() {
            return Err(Error::InvalidOperation("postcopy is not supported"));
        }
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            return Err(Error::InvalidOperation("no free memory slot"));
        }
        let r = GuestRegionMmap::new(region.mmap_region(fd)?, GuestAddress(region.guest_phys_addr))
            .ok_or(Error::InvalidParam)?;
        let mem = self.memory().insert_region(Arc::new(r)).map_err(io_err)?;
        self.set_memory(mem);
        let (size, gpa) = (region.memory_size, region.guest_phys_addr);
        log::debug!("{}: memory region added: {size:#x} bytes at {gpa:#x}", self.name);
        self.mappings.push(Mapping {
            vmm_addr: region.user_addr,
            size: region.memory_size,
            gpa: region.guest_phys_addr,
        });
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> Result<()> {
        let (mem, _) =
            self.memory().remove_region(GuestAddress(region.guest_phys_addr), region.memory_size).map_err(io_err)?;
        self.set_memory(mem);
        self.mappings.retain(|m| m.gpa != region.guest_phys_addr);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> Result<Option<File>> {
        Err(Error::InvalidOperation("device state transfer is not supported"))
    }

    fn check_device_state(&mut self) -> Result<()> {
        Err(Error::InvalidOperation("device state transfer is not supported"))
    }

    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
        Err(Error::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> Result<()> {
        Err(Error::InvalidOperation("dirty logging is not supported"))
    }
}

impl Drop for BlkHandler {
    fn drop(&mut self) {
        self.shutdown();
    }
}
