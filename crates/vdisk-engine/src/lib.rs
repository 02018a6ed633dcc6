//! The engine moves a device's bytes. Each device has its own queue and its own
//! pool of workers, so a busy or stalled disk never holds up another. Exports
//! submit requests in batches; workers take them in batches, map them through
//! the image, merge what is contiguous into single `preadv`/`pwritev` calls,
//! and hand completions back in batches.
//!
//! The engine knows nothing of wire protocols: a request is an [`Op`], a range,
//! a buffer and an opaque tag.
//!
//! Durability: a write completes once it is in the host page cache, unless it
//! carries FUA or the device is in sync mode (then `RWF_DSYNC`, still in
//! parallel). A FLUSH syncs every file of the image and then its metadata, so
//! every write completed before the FLUSH was submitted, on any connection, is
//! durable when the FLUSH completes.

mod plan;
mod queue;
mod request;
mod sys;
mod threads;

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vdisk_image::{Image, Result};

pub use request::{Flags, Op, Request, Sink};

use queue::Queue;

/// How a device's engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Worker threads per device.
    pub workers: usize,
    /// Every write durable before it completes.
    pub sync: bool,
    /// Most requests a worker takes from the queue at once.
    pub batch: usize,
    /// Merge contiguous reads or writes of a batch into one vectored call.
    pub coalesce: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { workers: 16, sync: false, batch: 64, coalesce: true }
    }
}

/// One virtual disk with its queue and workers.
pub struct Device {
    name: String,
    image: Arc<dyn Image>,
    queue: Arc<Queue>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Device {
    /// Starts the workers of a device over `image`.
    pub fn start(name: &str, image: Arc<dyn Image>, config: &EngineConfig) -> std::io::Result<Device> {
        let queue = Arc::new(Queue::new(config.workers.max(1)));
        let mut workers = Vec::with_capacity(config.workers);
        for i in 0..config.workers.max(1) {
            let planner = plan::Planner::new(image.clone(), config.sync, config.coalesce);
            let w = threads::Worker::new(planner, queue.clone(), config.batch);
            workers.push(std::thread::Builder::new().name(format!("{name}-w{i}")).spawn(move || w.run())?);
        }
        Ok(Device { name: name.to_owned(), image, queue, workers: Mutex::new(workers) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.image.size()
    }

    pub fn read_only(&self) -> bool {
        self.image.read_only()
    }

    pub fn image(&self) -> &Arc<dyn Image> {
        &self.image
    }

    /// Queues a batch; each request comes back through `sink` once done.
    pub fn submit(&self, batch: Vec<Request>, sink: &Arc<dyn Sink>) {
        self.queue.push(batch, sink);
    }

    /// Finishes what is queued, stops the workers and makes every write durable.
    /// Submitting after this is a bug: those requests would never complete.
    pub fn shutdown(&self) -> Result<()> {
        self.stop_workers();
        plan::Planner::new(self.image.clone(), false, false).flush()
    }

    fn stop_workers(&self) {
        self.queue.close();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap());
        for w in workers {
            let _ = w.join();
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

#[cfg(test)]
mod tests;
