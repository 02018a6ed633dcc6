//! `backup begin` and `backup end`: point-in-time backup views (fleecing,
//! issue 26; the design: docs/block-jobs.md "Incremental backup").
//!
//! Begin checks everything that can be refused first (unknown export or
//! bitmap, an inconsistent bitmap, a view name in use, a backup of a view, a
//! second backup of one export): a refusal changes nothing. Then, under a
//! quiesce of the export's device: flush, wrap the image in copy-before-write
//! (vdisk_image::cbw) with a scratch file, freeze a copy of bitmap B for the
//! view, start B2 and disable B (libvirt's checkpoint rule: B keeps what
//! changed between the two checkpoints, B2 what changes from now on), swap
//! the wrapper in; release. The view VIEW then becomes a read-only NBD
//! export serving the frozen disk, with B's frozen copy as its
//! `qemu:dirty-bitmap:B`. Should anything after the quiesce fail, what was
//! done is undone.
//!
//! End (and the removal or stop of the export: `daemon`) is `views::end`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_engine::{Device, EngineConfig, EngineKind};
use vdisk_image::bitmap::DirtyBitmap;
use vdisk_image::cbw::{Cbw, DEFAULT_GRANULE};
use vdisk_image::Image;
use vdisk_nbd::Export;

use crate::bitmaps::{BitmapOp, ExportBitmaps};
use crate::daemon::Live;
use crate::views::{self, BackupInfo, View, QUIESCE_LIMIT};
use crate::{Daemon, Error, ErrorKind, Ticket};

/// What `backup begin` asks for.
#[derive(Clone, Debug, Default)]
pub struct BackupRequest {
    pub export: String,
    /// The view's export name.
    pub view: String,
    /// The bitmap the view serves, frozen as it is now.
    pub bitmap: Option<String>,
    /// A bitmap started (empty) for the next incremental backup.
    pub new_bitmap: Option<String>,
    /// Where the scratch file goes (default: the image's directory).
    pub scratch: Option<PathBuf>,
}

impl Daemon {
    /// Begins a backup of `r.export`: see the module doc.
    pub fn backup_begin(&self, r: &BackupRequest, ticket: &Ticket) -> Result<BackupInfo, Error> {
        let export = r.export.as_str();
        if let Some(of) = self.views.export_of(export) {
            return Err(Error::invalid(format!(
                "{export:?} is a backup view (of export {of:?}): a view cannot be backed up; back up export {of:?}"
            )));
        }
        self.live_change_unchecked(export, |live| {
            let _committing = ticket.go_ahead()?;
            self.begin(live, r)
        })
    }

    /// Ends backup view `view`: its export goes, the scratch data with it.
    pub fn backup_end(&self, view: &str, ticket: &Ticket) -> Result<BackupInfo, Error> {
        let _change = self.changes_lock()?;
        let _committing = ticket.go_ahead()?;
        let Some(v) = self.views.take(view) else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("no backup view {view:?} (`vdisk ctl backup list` shows them)"),
            ));
        };
        let info = BackupInfo { copied_bytes: v.cbw.cbw().copied_bytes(), ..v.info.clone() };
        views::end(v, self.nbd(), false)?;
        Ok(info)
    }

    /// The backups in progress.
    pub fn backup_list(&self) -> Vec<BackupInfo> {
        self.views.list()
    }

    fn begin(&self, live: &mut Live, r: &BackupRequest) -> Result<BackupInfo, Error> {
        let (export, view) = (r.export.as_str(), r.view.as_str());
        let refuse = |why: String| Error::invalid(format!("backup of export {export:?}: {why}; nothing was changed"));
        crate::spec::check_name(view)?;
        if self.name_in_use(view) {
            return Err(Error::new(
                ErrorKind::Exists,
                format!(
                    "backup of export {export:?}: the name {view:?} is in use (an export or view): pick another --name"
                ),
            ));
        }
        // A job would swap the image out from under the view.
        self.jobs.check_free("backup", export).map_err(|e| {
            Error::new(
                e.kind(),
                format!("{} (it would swap the image out from under the view); nothing was changed", e.message()),
            )
        })?;
        if let Some(other) = self.views.view_of(export) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "backup of export {export:?}: a backup of it is running already (view {other:?}); end it first \
                     (`vdisk ctl backup end {other}`)"
                ),
            ));
        }
        let device = live.device.clone();
        if device.kind() == EngineKind::Rbd || vdisk_image::rbd::is_rbd(&live.spec.image) {
            return Err(refuse("it is an RBD image, which copy-before-write does not cover yet".into()));
        }
        if let Some(why) = device.failure() {
            return Err(Error::failed(format!("backup of export {export:?}: its device failed ({why})")));
        }
        let bitmaps = match (&r.bitmap, &r.new_bitmap) {
            (None, None) => None,
            _ => Some(self.bitmaps_of(export)?),
        };
        let frozen_from = match (&r.bitmap, &bitmaps) {
            (Some(b), Some(set)) => Some(usable_bitmap(set, export, b)?),
            _ => None,
        };
        if let (Some(b2), Some(set)) = (&r.new_bitmap, &bitmaps) {
            vdisk_image::bitmap::store::check_name(b2).map_err(|e| refuse(e.message().to_owned()))?;
            if set.list().iter().any(|b| &b.name == b2) {
                return Err(Error::new(
                    ErrorKind::Exists,
                    format!("backup of export {export:?}: it has a bitmap {b2:?} already: pick another --new-bitmap"),
                ));
            }
            if r.bitmap.as_ref() == Some(b2) {
                return Err(refuse("--bitmap and --new-bitmap must differ".into()));
            }
        }
        let scratch = self.scratch_dir(live, r)?;

        // From here on, changes: each undone should a later step fail.
        let guard = device
            .quiesce(QUIESCE_LIMIT)
            .map_err(|e| Error::failed(format!("backup of export {export:?}: {}", e.report())))?;
        guard.flush().map_err(|e| {
            Error::failed(format!("backup of export {export:?}: the flush failed, nothing changed: {}", e.report()))
        })?;
        let plain = device.image();
        let (cbw, view_image) = Cbw::wrap(plain.clone(), &scratch, DEFAULT_GRANULE).map_err(|e| {
            Error::failed(format!("backup of export {export:?}: nothing changed: {}", e.report())).at(&scratch)
        })?;
        let frozen = frozen_from.map(|(name, map)| {
            let copy = map.duplicate();
            copy.set_enabled(false);
            (name, Arc::new(copy))
        });
        let undo_bitmaps = |set: &ExportBitmaps, added: bool, disabled: bool| {
            if added {
                let _ = set.change(r.new_bitmap.as_deref().unwrap_or_default(), &BitmapOp::Remove);
            }
            if disabled {
                let _ = set.change(r.bitmap.as_deref().unwrap_or_default(), &BitmapOp::Enable);
            }
            self.nbd().set_bitmaps(export, set.served());
        };
        let (mut added, mut disabled) = (false, false);
        if let (Some(set), Some(b2)) = (&bitmaps, &r.new_bitmap) {
            let granularity = frozen.as_ref().map(|(_, m)| m.granularity());
            set.change(b2, &BitmapOp::Add { granularity, disabled: false })?;
            added = true;
            if let Some(b) = &r.bitmap {
                if let Err(e) = set.change(b, &BitmapOp::Disable) {
                    undo_bitmaps(set, added, false);
                    return Err(e);
                }
                disabled = true;
            }
            self.nbd().set_bitmaps(export, set.served());
        }
        if let Err(e) = guard.replace_image(cbw.clone()) {
            if let Some(set) = &bitmaps {
                undo_bitmaps(set, added, disabled);
            }
            return Err(Error::failed(format!("backup of export {export:?}: nothing changed: {}", e.report())));
        }
        drop(guard);

        let put_back = |why: Error| -> Error {
            if let Ok(g) = device.quiesce(QUIESCE_LIMIT) {
                cbw.cbw().detach();
                let _ = g.replace_image(plain.clone());
            }
            cbw.cbw().discard_scratch();
            if let Some(set) = &bitmaps {
                undo_bitmaps(set, added, disabled);
            }
            why
        };
        let config = EngineConfig { kind: EngineKind::Threads, inline: false, ..self.settings().engine.clone() };
        let view_image: Arc<dyn Image> = view_image;
        let view_device = match Device::start(view, view_image, &config) {
            Ok(d) => Arc::new(d),
            Err(e) => {
                return Err(put_back(
                    Error::failed(format!("backup of export {export:?}: cannot start the view's device")).because(e),
                ))
            }
        };
        let allow = match self.allow_list_of(view, &live.spec.allow) {
            Ok(a) => a,
            Err(e) => {
                let _ = view_device.shutdown();
                return Err(put_back(e));
            }
        };
        let description = format!("backup view of export {export:?}, frozen at its start");
        let e = Export { name: view.to_owned(), description, device: view_device.clone(), allow };
        if self.nbd().add_export(e).is_err() {
            let _ = view_device.shutdown();
            return Err(put_back(Error::new(
                ErrorKind::Exists,
                format!("backup of export {export:?}: {view:?} is already served over NBD: pick another --name"),
            )));
        }
        if let Some((name, map)) = &frozen {
            self.nbd().set_bitmaps(view, vec![(name.clone(), map.clone())]);
        }
        let info = BackupInfo {
            view: view.to_owned(),
            export: export.to_owned(),
            bitmap: r.bitmap.clone(),
            new_bitmap: r.new_bitmap.clone(),
            scratch_dir: scratch,
            copied_bytes: 0,
        };
        log::info!(export:% = export; "export {export:?}: backup view {view:?} begun{}{} (scratch in {})",
            r.bitmap.as_ref().map(|b| format!(", serving bitmap {b:?} frozen")).unwrap_or_default(),
            r.new_bitmap.as_ref().map(|b| format!(", new bitmap {b:?}")).unwrap_or_default(),
            info.scratch_dir.display());
        self.views.push(View { info: info.clone(), cbw, device: view_device, live: device });
        Ok(info)
    }

    /// Where the scratch file goes: `--scratch DIR`, else the image's own
    /// directory; beneath the image roots when there are any.
    fn scratch_dir(&self, live: &Live, r: &BackupRequest) -> Result<PathBuf, Error> {
        let export = &r.export;
        let dir = match &r.scratch {
            Some(d) if !d.is_absolute() => {
                return Err(Error::invalid(format!(
                    "backup of export {export:?}: the scratch directory {} must be an absolute path",
                    d.display()
                )))
            }
            Some(d) => d.clone(),
            None => std::path::absolute(&live.spec.image)
                .ok()
                .and_then(|p| p.parent().map(Path::to_owned))
                .unwrap_or_else(|| PathBuf::from("/")),
        };
        if live.roots.is_some() {
            vdisk_image::files::confined(live.roots.clone(), || vdisk_image::files::check_confined(&dir)).map_err(
                |e| {
                    Error::invalid(format!(
                        "backup of export {export:?}: the scratch directory {} is not beneath the image roots \
                         (--image-root): {}",
                        dir.display(),
                        e.report()
                    ))
                },
            )?;
        }
        if !dir.is_dir() {
            return Err(Error::invalid(format!(
                "backup of export {export:?}: the scratch directory {} is not a directory: give an existing one \
                 (--scratch DIR)",
                dir.display()
            ))
            .at(&dir));
        }
        Ok(dir)
    }
}

/// Bitmap `name` of the export, if it exists and is consistent.
fn usable_bitmap(set: &ExportBitmaps, export: &str, name: &str) -> Result<(String, Arc<DirtyBitmap>), Error> {
    let Some(info) = set.list().into_iter().find(|b| b.name == name) else {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "backup of export {export:?}: it has no bitmap {name:?} (`vdisk ctl bitmap list {export}` shows \
                 them); nothing was changed"
            ),
        ));
    };
    if info.inconsistent {
        return Err(Error::invalid(format!(
            "backup of export {export:?}: bitmap {name:?} is inconsistent (the image was not closed cleanly) and \
             cannot say what changed: take a full backup (without --bitmap) and start a new bitmap \
             (--new-bitmap); nothing was changed"
        )));
    }
    let map = set.served().into_iter().find(|(n, _)| n == name).map(|(_, m)| m);
    map.map(|m| (name.to_owned(), m)).ok_or_else(|| Error::failed(format!("bitmap {name:?} is not served")))
}
