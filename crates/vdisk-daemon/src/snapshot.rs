//! `snapshot`: a new overlay over an export's current top, made and switched
//! to while the export serves (docs/block-jobs.md). Everything that can be
//! refused is checked before anything changes; then, under a quiesce of the
//! device (requests in flight finish, new ones wait): flush the old top,
//! create the overlay naming it as its backing (under a name of its own,
//! renamed into place once synced), open the new chain (the
//! overlay read-write, the old top read-only beneath it) and swap it in. If
//! creating or opening fails, the overlay is removed and the old top serves
//! on: nothing changed. A snapshot is a job of the job table (instant: it
//! holds no copy).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdisk_engine::Device;
use vdisk_image::qcow2::{CreateOptions, DEFAULT_CLUSTER_BITS};
use vdisk_image::{CowImage, Format, Qcow2Image};

use crate::bitmaps::swap_top;
use crate::chain;
use crate::daemon::Live;
use crate::spec::ImageFormat;
use crate::{Daemon, Error, ErrorKind};

pub use crate::views::QUIESCE_LIMIT;

/// The format of a snapshot's new overlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OverlayFormat {
    #[default]
    Qcow2,
    Cow,
}

impl OverlayFormat {
    pub fn from_name(name: &str) -> Option<OverlayFormat> {
        match name {
            "qcow2" => Some(OverlayFormat::Qcow2),
            "cow" => Some(OverlayFormat::Cow),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OverlayFormat::Qcow2 => "qcow2",
            OverlayFormat::Cow => "cow",
        }
    }
}

/// What a snapshot made.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub job: u64,
    pub export: String,
    /// The new top, served now.
    pub overlay: PathBuf,
    pub format: OverlayFormat,
    /// The old top, read-only beneath it from now on.
    pub backing: PathBuf,
    pub backing_format: &'static str,
}

impl Daemon {
    /// Makes `overlay` (a new file) the top of export `name`, over its current
    /// top, while it serves. A job of the job table, failed or done.
    pub fn snapshot(&self, name: &str, overlay: &Path, format: OverlayFormat) -> Result<Snapshot, Error> {
        let job = self.jobs.start("snapshot", name);
        let r = self.live_change(name, |live| {
            if let Some(j) = self.jobs.other_running_on(name, job.id) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "snapshot of export {name:?}: job {} ({}) runs on it and reads its chain: wait for it or \
                         cancel it (`vdisk ctl cancel {}`)",
                        j.id, j.kind, j.id
                    ),
                ));
            }
            snapshot(live, name, overlay, format, job.id)
        });
        job.finish(&r.as_ref().map_err(|e| e.report().to_string()));
        r
    }

    /// Makes the RBD snapshot `snap` of RBD export `name`'s image while it
    /// serves: requests in flight finish and librbd's cache is flushed first,
    /// so the snapshot holds every write acknowledged before it; the export
    /// goes on serving the image. The job's id and the image's spec.
    pub fn rbd_snapshot(&self, name: &str, snap: &str) -> Result<(u64, String), Error> {
        let job = self.jobs.start("snapshot", name);
        let r = self.live_change(name, |live| {
            let refuse = |why: String| Error::invalid(format!("RBD snapshot of export {name:?}: {why}"));
            let device = live.device.clone();
            if device.kind() != vdisk_engine::EngineKind::Rbd {
                return Err(refuse(format!(
                    "{} is not an RBD image: give --overlay PATH for a new top over it",
                    live.spec.image.display()
                )));
            }
            if device.read_only() {
                return Err(refuse("it is served read-only (an RBD snapshot, or --readonly): it never changes".into()));
            }
            if snap.is_empty() || snap.len() > 255 || snap.contains(['@', '/']) || snap.chars().any(char::is_control) {
                return Err(refuse(format!("{snap:?} cannot name a snapshot: 1 to 255 characters, no '@' or '/'")));
            }
            if let Some(why) = device.failure() {
                return Err(Error::failed(format!("RBD snapshot of export {name:?}: its device failed ({why})")));
            }
            let failed = |e: vdisk_image::Error| Error::from(e).context(format!("RBD snapshot of export {name:?}"));
            let guard = device.quiesce(QUIESCE_LIMIT).map_err(failed)?;
            guard.flush().map_err(failed)?;
            let image = device.image();
            let Some(vdisk_image::Storage::Rbd(rbd)) = image.target(0) else {
                return Err(refuse("its image has no RBD target".into()));
            };
            rbd.snap_create(snap).map_err(|e| match e.os_error() {
                Some(libc::EEXIST) => Error::new(
                    ErrorKind::Exists,
                    format!("RBD snapshot of export {name:?}: {}@{snap} exists already: name a new one", rbd.spec()),
                ),
                _ => failed(e),
            })?;
            log::info!(export:% = name; "export {name:?}: RBD snapshot {}@{snap} made", rbd.spec());
            Ok(rbd.spec().to_string())
        });
        job.finish(&r.as_ref().map(|_| ()).map_err(|e| e.report().to_string()));
        r.map(|spec| (job.id, spec))
    }

    /// Every job, running and ended (the last [`crate::jobs::KEPT`]), oldest first.
    pub fn jobs(&self) -> Vec<crate::jobs::JobInfo> {
        self.jobs.list()
    }

    /// Asks job `id` to stop and leave its export as it was; the job ends
    /// `cancelled` at its next chunk. Refused for a job that has ended.
    pub fn job_cancel(&self, id: u64) -> Result<crate::jobs::JobInfo, Error> {
        let job = self.job(id)?;
        let info = job.info();
        if job.ended() {
            return Err(Error::invalid(format!(
                "job {id} ({} of export {:?}) has ended already ({}): there is nothing to cancel",
                job.kind,
                job.export,
                info.state.name()
            )));
        }
        job.cancel();
        log::info!(export:% = job.export; "job {id} ({} of export {:?}): cancel asked", job.kind, job.export);
        Ok(job.info())
    }

    /// Asks job `id` to switch its export to what it made. Only a ready
    /// mirror or commit pivots (a commit of the live top: an active commit).
    pub fn job_pivot(&self, id: u64) -> Result<crate::jobs::JobInfo, Error> {
        let job = self.job(id)?;
        let info = job.info();
        if !matches!(job.kind, "mirror" | "commit") {
            return Err(Error::invalid(format!(
                "job {id} is a {} of export {:?}: only a mirror or an active commit pivots (a {} switches the \
                 export by itself when it ends)",
                job.kind, job.export, job.kind
            )));
        }
        if info.state != crate::jobs::JobState::Ready {
            return Err(Error::invalid(format!(
                "job {id} ({} of export {:?}) is {}, not ready: it pivots once its copy has caught up (`vdisk ctl \
                 jobs` shows its state)",
                job.kind,
                job.export,
                info.state.name()
            )));
        }
        if let Some(why) = job.pivot_refused() {
            return Err(Error::invalid(format!(
                "job {id} ({} of export {:?}) cannot pivot: {why}",
                job.kind, job.export
            )));
        }
        job.request_pivot();
        log::info!(export:% = job.export; "job {id} ({} of export {:?}): pivot asked", job.kind, job.export);
        Ok(job.info())
    }

    fn job(&self, id: u64) -> Result<std::sync::Arc<crate::jobs::Job>, Error> {
        self.jobs.get(id).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("no job {id} (`vdisk ctl jobs` lists them; ended ones are kept a while)"),
            )
        })
    }
}

/// What a live operation `what` on export `name` refuses of its source before
/// anything changes, `rbd` saying why for an RBD image: a device that failed
/// and, for one that changes the chain (`changes`: why a read-only export is
/// refused), a read-only export or one added with `--backing` or
/// `--ignore-backing-mtime`. Its device.
pub(crate) fn check_source(
    live: &Live,
    what: &str,
    name: &str,
    rbd: &str,
    changes: Option<&str>,
) -> Result<Arc<Device>, Error> {
    let refuse = |why: &str| Error::invalid(format!("{what} of export {name:?}: {why}"));
    let device = live.device.clone();
    if vdisk_image::rbd::is_rbd(&live.spec.image) || device.kind() == vdisk_engine::EngineKind::Rbd {
        return Err(refuse(rbd));
    }
    if served_remotely(live) {
        return Err(refuse(&format!(
            "it is served from the NBD export {} (a mirror pivoted onto it), which has no image files here: mirror \
             it to a file (with --pivot) first",
            live.spec.image.display()
        )));
    }
    if let Some(read_only) = changes {
        if device.read_only() {
            return Err(refuse(read_only));
        }
        if live.spec.backing.is_some() || live.spec.ignore_backing_mtime {
            return Err(refuse(
                "it was added with --backing or --ignore-backing-mtime: the new chain is opened by the names its \
                 headers hold, which would not be the chain it serves now",
            ));
        }
    }
    if let Some(why) = device.failure() {
        return Err(Error::failed(format!("{what} of export {name:?}: its device failed ({why})")));
    }
    Ok(device)
}

/// The export is served from another server's NBD export (a mirror's pivot onto it).
pub(crate) fn served_remotely(live: &Live) -> bool {
    crate::formats::nbd_uri(&live.spec.image).is_some()
}

fn snapshot(live: &mut Live, name: &str, overlay: &Path, format: OverlayFormat, job: u64) -> Result<Snapshot, Error> {
    let refuse = |why: String| Error::invalid(format!("snapshot of export {name:?}: {why}"));
    if !overlay.is_absolute() {
        return Err(refuse(format!("the overlay {} must be an absolute path", overlay.display())));
    }
    if overlay.symlink_metadata().is_ok() {
        return Err(Error::new(
            ErrorKind::Exists,
            format!("snapshot of export {name:?}: {} exists already: name a new file", overlay.display()),
        ));
    }
    if live.roots.is_some() {
        let dir = overlay.parent().unwrap_or(Path::new("/"));
        vdisk_image::files::confined(live.roots.clone(), || vdisk_image::files::check_confined(dir)).map_err(|e| {
            refuse(format!(
                "the overlay {} is not beneath the image roots (--image-root): {}",
                overlay.display(),
                e.report()
            ))
        })?;
    }
    let device = check_source(
        live,
        "snapshot",
        name,
        "it is an RBD image: its snapshots are RBD snapshots (`vdisk ctl snapshot EXPORT --rbd-snap NAME`)",
        Some("it is served read-only: its image never changes, so there is nothing to snapshot (copy the file)"),
    )?;
    let top =
        std::path::absolute(&live.spec.image).map_err(|e| refuse(format!("{}: {e}", live.spec.image.display())))?;
    let top_format = live.format;
    if format == OverlayFormat::Cow && top_format != "raw" {
        return Err(refuse(format!(
            "a COW overlay's backing file must be raw, and the export's top {} is {top_format}: use --format qcow2",
            top.display()
        )));
    }
    let guard = device
        .quiesce(QUIESCE_LIMIT)
        .map_err(|e| Error::failed(format!("snapshot of export {name:?}: {}", e.report())))?;
    guard.flush().map_err(|e| {
        Error::failed(format!(
            "snapshot of export {name:?}: flushing {} failed, nothing changed: {}",
            top.display(),
            e.report()
        ))
    })?;
    // The overlay appears under its name only whole: made (and synced) under
    // a name of its own beside it, then renamed into place and the directory
    // synced. A power cut while it is made then leaves no file at `overlay`
    // whose header reads as an overlay of the top over torn metadata (the
    // power-loss rounds of `vdisk soak --jobs snapshot` found one: the header
    // kept, its refcount block not), which an operator could not tell from
    // an overlay the export had switched to.
    let staging = staging_path(overlay);
    let _ = std::fs::remove_file(&staging);
    let made = match format {
        OverlayFormat::Qcow2 => {
            let o = CreateOptions {
                size: device.size(),
                cluster_bits: DEFAULT_CLUSTER_BITS,
                backing: Some((&top, top_format)),
            };
            Qcow2Image::create(&staging, &o)
        }
        OverlayFormat::Cow => CowImage::create(&staging, &top),
    };
    let made = made.map_err(|e| e.report().to_string()).and_then(|()| publish(&staging, overlay));
    if let Err(e) = made {
        let _ = std::fs::remove_file(&staging);
        return Err(Error::failed(format!(
            "snapshot of export {name:?}: cannot create {}, nothing changed: {e}",
            overlay.display()
        ))
        .at(overlay));
    }
    let forced = match format {
        OverlayFormat::Qcow2 => Format::Qcow2,
        OverlayFormat::Cow => Format::Cow,
    };
    // The old top stays open (it serves until the swap) with its exclusive
    // lock; beneath the overlay it is opened again read-only, which takes a
    // shared one: the old lock becomes shared first (it is written no more).
    let old = device.image();
    let relock = |op: i32| chain::relock(&*old, &top, op);
    relock(libc::LOCK_SH);
    let options = vdisk_image::OpenOptions { format: Some(forced), direct: live.direct, ..Default::default() };
    let swapped = swap_top(live.bitmaps.as_deref(), overlay, || {
        vdisk_image::open(overlay, &options)
            .map_err(|e| e.report().to_string())
            .and_then(|opened| guard.replace_image(opened.image).map_err(|e| e.report().to_string()))
    });
    if let Err(e) = swapped {
        relock(libc::LOCK_EX);
        let _ = std::fs::remove_file(overlay);
        return Err(Error::failed(format!(
            "snapshot of export {name:?}: the new chain {} over {} cannot be served ({e}); the overlay was removed \
             and nothing changed",
            overlay.display(),
            top.display()
        )));
    }
    drop(guard);
    live.spec.image = overlay.to_owned();
    live.spec.format = match format {
        OverlayFormat::Qcow2 => ImageFormat::Qcow2,
        OverlayFormat::Cow => ImageFormat::Cow,
    };
    live.format = device.image().format();
    log::info!(export:% = name; "export {name:?}: snapshot: now served from {} ({}) over {} ({top_format})",
        overlay.display(), format.name(), top.display());
    Ok(Snapshot {
        job,
        export: name.to_owned(),
        overlay: overlay.to_owned(),
        format,
        backing: top,
        backing_format: top_format,
    })
}

/// Where a snapshot's overlay is made before it is renamed into place.
fn staging_path(overlay: &Path) -> PathBuf {
    let mut name = overlay.file_name().unwrap_or_default().to_owned();
    name.push(".vdisk-new");
    overlay.with_file_name(name)
}

/// Renames the synced `staging` file to `overlay` and syncs their directory.
fn publish(staging: &Path, overlay: &Path) -> Result<(), String> {
    std::fs::rename(staging, overlay)
        .map_err(|e| format!("cannot rename {} to {}: {e}", staging.display(), overlay.display()))?;
    let dir = overlay.parent().unwrap_or(Path::new("/"));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| {
        let _ = std::fs::remove_file(overlay);
        format!("cannot sync {}: {e}", dir.display())
    })
}
