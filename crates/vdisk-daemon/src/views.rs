//! The backup views of a running daemon (issue 26): which view belongs to
//! which export, and how a view ends. `backup` begins them; the daemon ends
//! an export's views when the export is removed or the server stops, so this
//! module sits below `daemon` and knows nothing of it.
//!
//! A view is an NBD export of its own (read-only, on the thread engine: its
//! image pins what it reads, see vdisk_image::cbw) over the frozen disk, while
//! the export's device serves the copy-before-write wrapper. Ending one:
//! the view leaves the NBD server (its clients are disconnected) and its
//! device stops; copying stops; then, under a quiesce of the export's device,
//! the plain image is put back; the scratch file (unlinked from the start)
//! is truncated so its space is freed at once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vdisk_engine::Device;
use vdisk_image::cbw::CbwImage;
use vdisk_nbd::Server;

use crate::Error;

/// How long a live disk operation (a snapshot, a swap or pivot, beginning or
/// ending a backup) waits for the export's requests in flight to finish.
pub const QUIESCE_LIMIT: Duration = Duration::from_secs(10);

/// A backup as `backup_list` shows it.
#[derive(Clone, Debug)]
pub struct BackupInfo {
    pub view: String,
    pub export: String,
    /// The frozen bitmap the view serves as `qemu:dirty-bitmap:NAME`.
    pub bitmap: Option<String>,
    /// The bitmap started for the next backup.
    pub new_bitmap: Option<String>,
    /// Where the scratch file lies (it has no name: unlinked from the start).
    pub scratch_dir: PathBuf,
    /// Bytes of the disk copied before the guest overwrote them.
    pub copied_bytes: u64,
}

/// One backup in progress.
pub(crate) struct View {
    pub info: BackupInfo,
    /// The wrapper the export's device serves.
    pub cbw: Arc<CbwImage>,
    /// The view's own device.
    pub device: Arc<Device>,
    /// The export's device.
    pub live: Arc<Device>,
}

/// Every backup in progress.
#[derive(Default)]
pub(crate) struct Views {
    list: Mutex<Vec<View>>,
}

impl Views {
    /// The export a view `name` belongs to, if there is such a view.
    pub fn export_of(&self, name: &str) -> Option<String> {
        self.list.lock().unwrap().iter().find(|v| v.info.view == name).map(|v| v.info.export.clone())
    }

    /// The view of export `export`, if it has a backup running.
    pub fn view_of(&self, export: &str) -> Option<String> {
        self.list.lock().unwrap().iter().find(|v| v.info.export == export).map(|v| v.info.view.clone())
    }

    pub fn push(&self, v: View) {
        self.list.lock().unwrap().push(v);
    }

    /// Takes view `name` out of the table.
    pub fn take(&self, name: &str) -> Option<View> {
        let mut list = self.list.lock().unwrap();
        let at = list.iter().position(|v| v.info.view == name)?;
        Some(list.remove(at))
    }

    /// Takes the views of export `export` (all of them with None).
    pub fn take_of(&self, export: Option<&str>) -> Vec<View> {
        let mut list = self.list.lock().unwrap();
        let (taken, kept) =
            std::mem::take(&mut *list).into_iter().partition(|v| export.is_none_or(|e| v.info.export == e));
        *list = kept;
        taken
    }

    pub fn list(&self) -> Vec<BackupInfo> {
        let list = self.list.lock().unwrap();
        list.iter().map(|v| BackupInfo { copied_bytes: v.cbw.cbw().copied_bytes(), ..v.info.clone() }).collect()
    }
}

/// Ends a backup: the view's NBD export and device go, then (unless
/// `stopping`: the export's device stops next anyway) the plain image
/// is put back under the export's device. The scratch space is freed.
pub(crate) fn end(view: View, nbd: &Server, stopping: bool) -> Result<(), Error> {
    let name = &view.info.view;
    let export = &view.info.export;
    nbd.remove_export(name);
    nbd.disconnect(name);
    nbd.set_bitmaps(name, Vec::new());
    if let Err(e) = view.device.shutdown() {
        log::warn!(export:% = export; "backup view {name:?}: its device stopped with an error: {}", e.report());
    }
    // Nothing reads the view any more: writes stop copying at once, whatever follows.
    view.cbw.cbw().detach();
    let restored = if stopping { Ok(()) } else { put_back(&view) };
    view.cbw.cbw().discard_scratch();
    log::info!(export:% = export; "backup view {name:?} of export {export:?} ended");
    restored
}

/// Under a quiesce of the export's device: serve the plain image again. Should
/// that fail, the wrapper stays, detached: it passes every request through.
fn put_back(view: &View) -> Result<(), Error> {
    let (name, export) = (&view.info.view, &view.info.export);
    let fail = |why: String| {
        Error::failed(format!(
            "end of backup view {name:?} of export {export:?}: the view is gone, but the export's image could not \
             be unwrapped ({why}); it no longer copies anything and is unwrapped when the export is removed"
        ))
    };
    let guard = view.live.quiesce(QUIESCE_LIMIT).map_err(|e| fail(e.report().to_string()))?;
    let current = view.live.image();
    // The wrapper, unless something swapped it out meanwhile (nothing should: live changes are refused).
    if std::ptr::addr_eq(Arc::as_ptr(&current), Arc::as_ptr(&view.cbw)) {
        guard.replace_image(view.cbw.cbw().inner().clone()).map_err(|e| fail(e.report().to_string()))?;
    }
    Ok(())
}
