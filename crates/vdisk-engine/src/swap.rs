//! Quiesce and swap: changing the image under a running device (a snapshot's
//! new overlay, the end of a commit or mirror). This module owns the device's
//! current image ([`Slot`]: the image and what the planners derive from its
//! files, with a generation) and the [`Quiesced`] guard.
//!
//! [`Device::quiesce`] holds the queue (requests pushed meanwhile wait in it,
//! no worker takes them; the inline path queues instead of running) and waits,
//! bounded, until nothing the workers took or the inline path runs is in
//! flight. While the guard lives, [`Quiesced::flush`] syncs the image and
//! [`Quiesced::replace_image`] installs a new one of the same size; dropping
//! the guard lets the held requests go, in the order they came. A worker's
//! planner looks at the generation each time it takes requests
//! (the planner's `refresh`): it can only change while nothing is in
//! flight, so no request ever spans two images.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use vdisk_image::{Error, ErrorKind, Image, Result};

use crate::zero::ZeroLadder;
use crate::{sys, Device, EngineKind, Inline};

/// What a device serves now, and what its planners derive from its files.
pub(crate) struct Current {
    pub image: Arc<dyn Image>,
    pub zeros: Arc<ZeroLadder>,
    pub inline: Inline,
    /// The written file is on FUSE (see [`crate::plan::Planner::dsync_unreliable`]).
    pub dsync_unreliable: bool,
}

impl Current {
    pub fn new(image: Arc<dyn Image>, kind: EngineKind, inline_allowed: bool) -> Current {
        let inline = if !inline_allowed
            || !image.direct_files().is_empty()
            || kind == EngineKind::Rbd
            || crate::blocking_image(&*image)
        {
            Inline::Never
        } else if image.files().iter().all(sys::in_memory) {
            Inline::All
        } else {
            Inline::CachedReads
        };
        Current {
            zeros: Arc::new(ZeroLadder::new(image.files().len())),
            dsync_unreliable: image.files().first().is_some_and(sys::on_fuse),
            image,
            inline,
        }
    }
}

/// A device's current image, replaced whole; `generation` counts replacements.
pub(crate) struct Slot {
    current: RwLock<Arc<Current>>,
    generation: AtomicU64,
}

impl Slot {
    pub fn new(current: Current) -> Slot {
        Slot { current: RwLock::new(Arc::new(current)), generation: AtomicU64::new(0) }
    }

    pub fn get(&self) -> Arc<Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The current image and its generation, read together.
    pub fn get_with_generation(&self) -> (Arc<Current>, u64) {
        let cur = self.current.read().unwrap_or_else(|e| e.into_inner());
        (cur.clone(), self.generation.load(Ordering::Acquire))
    }

    fn set(&self, new: Current) {
        let mut cur = self.current.write().unwrap_or_else(|e| e.into_inner());
        *cur = Arc::new(new);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// A quiesced device: nothing in flight, new requests held in its queue until dropped.
pub struct Quiesced<'a> {
    dev: &'a Device,
}

impl Device {
    /// Holds new requests in the queue and waits until every request in
    /// flight has completed, for at most `limit`; past it the hold is lifted
    /// again and the error says so (nothing changed). An RBD device cannot be
    /// quiesced for a swap (its loop holds the image's event channel).
    pub fn quiesce(&self, limit: Duration) -> Result<Quiesced<'_>> {
        if let Some(why) = self.failure() {
            return Err(Error::new(ErrorKind::Io, format!("{why}: it cannot be quiesced")));
        }
        self.queue.hold();
        let guard = Quiesced { dev: self };
        let deadline = Instant::now() + limit;
        while self.queue.in_flight() > 0 {
            if Instant::now() >= deadline {
                let n = self.queue.in_flight();
                drop(guard);
                let e = std::io::Error::from_raw_os_error(libc::ETIMEDOUT);
                let what = format!(
                    "device {:?}: {n} request(s) still in flight after {limit:?}; nothing was changed (try again, \
                     or check the storage under it)",
                    self.name
                );
                return Err(Error::io(e, what));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(guard)
    }
}

impl Quiesced<'_> {
    /// Makes every write the device completed durable in its current image.
    pub fn flush(&self) -> Result<()> {
        let cur = self.dev.slot.get();
        crate::flush_image(&cur.image)
    }

    /// Performs `batch` on the current image in this thread, now, ahead of
    /// the held requests (a job's own reads and writes that no guest request
    /// may come between: stream's copy of a run the top does not hold yet).
    /// Returns the requests, each with its error if it failed.
    pub fn execute(&self, mut batch: Vec<crate::Request>) -> Vec<crate::Request> {
        self.dev.execute_now(&mut batch, true);
        batch
    }

    /// [`QuiesceGuard::execute`] for writes that change nothing the disk
    /// reads (stream's copy of backing data into the top): the device's dirty
    /// maps are not marked, so an incremental backup does not copy them again.
    pub fn execute_unchanged(&self, mut batch: Vec<crate::Request>) -> Vec<crate::Request> {
        self.dev.execute_now(&mut batch, false);
        batch
    }

    /// Serves `new` from now on (the held requests and all later ones). It
    /// must have the device's size; an RBD engine's device is refused (an
    /// RBD image or NBD export on a file engine is served with its blocking
    /// calls, `Storage::blocking`). The
    /// old image is dropped once nothing holds it (its files closed).
    pub fn replace_image(&self, new: Arc<dyn Image>) -> Result<()> {
        let dev = self.dev;
        let old = dev.slot.get();
        if new.size() != old.image.size() {
            return Err(Error::invalid(format!(
                "device {:?}: the new image is {} bytes, the device {}: a swap cannot change the size",
                dev.name,
                new.size(),
                old.image.size()
            )));
        }
        if dev.kind == EngineKind::Rbd {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("device {:?}: the RBD engine's image cannot be swapped under a running device", dev.name),
            ));
        }
        dev.slot.set(Current::new(new, dev.kind, dev.inline_allowed));
        Ok(())
    }
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.dev.queue.release();
    }
}
