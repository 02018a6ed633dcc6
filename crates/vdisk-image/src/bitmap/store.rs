//! Where bitmaps persist: one interface over qcow2's own bitmaps (qemu's
//! format, `qcow2::bitmaps`) and vdisk's sidecar file (`bitmap::sidecar`).
//!
//! A store is used for a session: [`BitmapStore::open_session`] returns the
//! bitmaps kept and, for a read-write session, marks them in use on disk, so
//! that a crash leaves them marked; [`BitmapStore::save`] writes the whole
//! set back (data, additions, removals), with `close` clearing the in-use
//! marks (a clean close). A bitmap found in use when a session begins was
//! not saved by a clean close: it is loaded as `inconsistent`, stays marked
//! on disk, and must be refused for incremental use (removed and started
//! again by the user).

use std::sync::Arc;

use super::DirtyBitmap;
use crate::Result;

/// A bitmap as a store keeps it. Enabled or not is the bitmap's own state
/// (qcow2's `auto` flag).
#[derive(Debug, Clone)]
pub struct StoredBitmap {
    pub name: String,
    pub map: Arc<DirtyBitmap>,
    /// Found in use (the image or sidecar was not closed cleanly): its bits
    /// may be short, so it must never drive an incremental backup.
    pub inconsistent: bool,
}

impl StoredBitmap {
    pub fn new(name: impl Into<String>, map: DirtyBitmap) -> Self {
        StoredBitmap { name: name.into(), map: Arc::new(map), inconsistent: false }
    }
}

/// Checks a bitmap name given by a user: qemu's rules (1..=1023 bytes, UTF-8).
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 1023 {
        return Err(crate::Error::invalid(format!("bitmap name {name:?} must be 1 to 1023 bytes long")));
    }
    Ok(())
}

/// Where a disk's bitmaps persist.
pub trait BitmapStore: Send + Sync {
    /// The bitmaps kept. For a read-write session, marks every one in use
    /// on disk before returning (the ones already marked come back
    /// `inconsistent`).
    fn open_session(&self) -> Result<Vec<StoredBitmap>>;

    /// Writes `set` as the whole set kept (bitmaps not in it are removed).
    /// `close`: the session ends cleanly, consistent bitmaps are no longer
    /// marked in use; otherwise every bitmap stays marked (a checkpoint).
    fn save(&self, set: &[StoredBitmap], close: bool) -> Result<()>;
}
