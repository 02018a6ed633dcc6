//! The dirty maps a device marks with every write it completes: the enabled
//! dirty bitmaps of incremental backup and the maps of copy jobs (mirror,
//! active commit). See docs/block-jobs.md.
//!
//! A WRITE, TRIM or WRITE_ZEROES range is marked once its data has reached
//! the image and before it is acknowledged ([`crate::plan::Planner`] calls
//! [`Observers::record`] where it tells the image the write is done), failed
//! ones too: part of a failed write may be in the files. Marking before the
//! data lands could lose a write to a copy pass that takes the bit in
//! between (see [`DirtyBitmap::record_write`]).
//!
//! The list is replaced whole when a map is added or removed; a write reads
//! it under a read lock (no allocation, no write to shared memory unless a
//! bit changes).

use std::sync::{Arc, RwLock};

use vdisk_image::bitmap::DirtyBitmap;

/// A device's write observers.
#[derive(Default)]
pub struct Observers {
    list: RwLock<Arc<[Arc<DirtyBitmap>]>>,
}

impl Observers {
    /// Marks `len` bytes at `offset` in every map (those disabled ignore it).
    #[inline]
    pub fn record(&self, offset: u64, len: u64) {
        let list = self.list.read().unwrap_or_else(|e| e.into_inner());
        for map in list.iter() {
            map.record_write(offset, len);
        }
    }

    /// Adds `map` (once: adding it again does nothing).
    pub fn add(&self, map: Arc<DirtyBitmap>) {
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        if !list.iter().any(|m| Arc::ptr_eq(m, &map)) {
            *list = list.iter().cloned().chain(std::iter::once(map)).collect();
        }
    }

    /// Removes `map`; true if it was there.
    pub fn remove(&self, map: &Arc<DirtyBitmap>) -> bool {
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        let before = list.len();
        *list = list.iter().filter(|m| !Arc::ptr_eq(m, map)).cloned().collect();
        list.len() != before
    }

    /// The maps now observed.
    pub fn list(&self) -> Vec<Arc<DirtyBitmap>> {
        self.list.read().unwrap_or_else(|e| e.into_inner()).to_vec()
    }
}
