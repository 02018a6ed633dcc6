//! The device as rust-vmm's vhost-user-backend sees it: features, config
//! space, one worker thread per queue, and the hooks that route kicks to
//! [`QueueCtx`]. One `BlkBackend` lives for one frontend connection.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::VhostUserBackend;
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::config::{self, CONFIG_LEN, MAX_QUEUE_SIZE, WCE_OFFSET};
use crate::queue::{Gm, QueueCtx, Shared, Vring};

#[derive(Clone)]
pub struct BlkBackend {
    pub shared: Arc<Shared>,
    pub queues: Arc<Vec<Arc<QueueCtx>>>,
}

impl BlkBackend {
    pub fn new(shared: Arc<Shared>, num_queues: u16) -> BlkBackend {
        let queues = (0..num_queues).map(|_| QueueCtx::new(shared.clone())).collect();
        BlkBackend { shared, queues: Arc::new(queues) }
    }

    /// Waits until no queue has a request in the engine.
    pub fn wait_idle(&self) {
        self.queues.iter().for_each(|q| q.wait_idle());
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.queues.len()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE as usize
    }

    fn features(&self) -> u64 {
        config::features(self.shared.device.read_only())
    }

    fn acked_features(&self, features: u64) {
        // Without FLUSH the guest cannot ask for durability: write through.
        self.shared.writeback.store(config::has(features, VIRTIO_BLK_F_FLUSH), Ordering::Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.shared.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let writeback = self.shared.writeback.load(Ordering::Relaxed);
        let space = config::encode(self.shared.device.size(), self.queues.len() as u16, writeback);
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(CONFIG_LEN);
        let end = (offset as usize).saturating_add(size as usize).min(CONFIG_LEN);
        out[..end - start].copy_from_slice(&space[start..end]);
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Only the writeback flag is writable (CONFIG_WCE).
        if offset as usize != WCE_OFFSET || buf.len() != 1 || buf[0] > 1 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "only the wce byte of the config is writable"));
        }
        self.shared.writeback.store(buf[0] == 1, Ordering::Relaxed);
        Ok(())
    }

    fn update_memory(&self, mem: Gm) -> io::Result<()> {
        *self.shared.mem.lock().unwrap() = mem;
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // One worker thread per queue.
        (0..self.queues.len()).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, index: u32) -> io::Result<()> {
        // Requests already taken from the ring are answered before it is handed back.
        if let Some(q) = self.queues.get(index as usize) {
            q.wait_idle();
        }
        Ok(())
    }

    fn handle_event(&self, device_event: u16, evset: EventSet, vrings: &[Vring], thread: usize) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event {evset:?} on queue {device_event}")));
        }
        // `vrings` are this thread's rings and `device_event` indexes them;
        // with one queue per thread (`queues_per_thread`) the queue is the thread's.
        if let (Some(q), Some(vring)) = (self.queues.get(thread), vrings.get(device_event as usize)) {
            q.kick(vring);
        }
        Ok(())
    }
}
