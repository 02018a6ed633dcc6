//! `mirror` and active `commit`: one copy loop with two kinds of target
//! (docs/block-jobs.md). A job on its own thread attaches a dirty map to the
//! device's write observers, marks what the source holds, then pass after
//! pass takes and clears dirty runs ([`DirtyBitmap::take_next`]), reads them
//! from the live image and writes them to the target. Once what is dirty is
//! small the job is *ready*; it keeps copying what the guest dirties until
//! it pivots (quiesce, copy the last dirty runs, flush the target, open it,
//! swap, and the export's spec names it) or is cancelled (detach; the export
//! serves as before, the target is left as it is).
//!
//! The copy reads the image without quiescing ([`crate::chain::read`]): the
//! device marks a write after its data has reached the image, so a take that
//! comes first leaves the granule dirty again for the next pass, and a take
//! that comes after reads the new data. Only the last pass, under the quiesce
//! of the pivot, must see nothing in flight, and it does.
//!
//! A mirror writes a new raw or qcow2 file (an existing one with
//! `existing`), an NBD export of the same size, or an RBD image the job
//! makes at the export's size (an existing one at least that large with
//! `existing`). A pivot onto a file opens it as the export opens images; a
//! pivot onto NBD or RBD serves from the job's own connection or handle
//! ([`target::Target::into_served`]; the file engines perform its I/O with
//! blocking calls). The source may be an RBD export too, without pivot (its
//! device cannot be swapped), or an export served from NBD. A mirror to NBD
//! or RBD (or of an RBD export) cancelled once ready copies what is still
//! dirty and flushes the target (it then holds the disk as the export read
//! at that moment); cancelled before ready, an
//! RBD image the job made is removed. An active commit writes the
//! chain's base (the bottom, or a named layer) opened on its own, copying
//! only runs held above it; its pivot reopens the chain from the base.

pub mod sync;
pub mod target;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use vdisk_engine::{Device, Observers};
use vdisk_image::bitmap::DirtyBitmap;
use vdisk_image::qcow2::{CreateOptions, DEFAULT_CLUSTER_BITS};
use vdisk_image::rbd::Spec;
use vdisk_image::{Format, Image, Qcow2Image, RbdImage};
use vdisk_nbd::remote::{Remote, Uri};

use crate::bitmaps::swap_top;
use crate::daemon::{Changer, Live};
use crate::jobs::{Job, Jobs};
use crate::snapshot::{check_source, served_remotely, QUIESCE_LIMIT};
use crate::spec::ImageFormat;
use crate::{chain, formats};
use crate::{Daemon, Error, ErrorKind};
use sync::{SyncGate, Synced};
use target::{ImageTarget, NbdTarget, RbdTarget, Target};

/// The most one copy takes at a time.
pub const CHUNK: u64 = 1 << 20;
/// The finest granularity of a copy job's dirty map: a guest's 4K write
/// dirties 4K, so copying it is no more work than the write was.
pub const GRANULARITY: u64 = 4 << 10;
/// The most bits a copy job's dirty map has (8 MiB of memory): a disk larger
/// than 256 GiB gets coarser granules.
const MAX_BITS: u64 = 1 << 26;
/// A job is ready once no more than this is dirty after a pass (with the
/// guest's writes waiting for the target, see [`sync`])...
pub const READY_BELOW: u64 = 1 << 20;
/// ...or, once a stuck target made writes stop waiting for it, when passes
/// stop shrinking what is dirty and it is no more than this: the pivot
/// copies it under its quiesce.
pub const READY_STALLED: u64 = 64 << 20;

/// The granularity of a copy job's dirty map over a disk of `size` bytes.
pub fn granularity(size: u64) -> u64 {
    (size / MAX_BITS).next_power_of_two().max(GRANULARITY)
}

/// Why a copy job refuses an RBD export.
const RBD_COPY: &str =
    "it is an RBD image: its device cannot be swapped, and the copy reads files (use `rbd migration`)";

/// Where a mirror writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MirrorTarget {
    /// A new image file (an existing one with [`MirrorOptions::existing`]).
    File(PathBuf),
    /// An NBD export: `nbd://HOST[:PORT]/NAME` or `nbd+unix:///NAME?socket=PATH`.
    Nbd(String),
    /// An RBD image: `rbd:POOL/IMAGE[:conf=PATH][:id=NAME]`.
    Rbd(String),
}

impl MirrorTarget {
    /// An NBD URI, or a file path.
    pub fn parse(s: &str) -> MirrorTarget {
        if Uri::is_nbd(s) {
            MirrorTarget::Nbd(s.to_owned())
        } else if vdisk_image::rbd::is_rbd(Path::new(s)) {
            MirrorTarget::Rbd(s.to_owned())
        } else {
            MirrorTarget::File(PathBuf::from(s))
        }
    }
}

/// The format of a mirror's new file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TargetFormat {
    #[default]
    Raw,
    Qcow2,
}

impl TargetFormat {
    pub fn from_name(name: &str) -> Option<TargetFormat> {
        match name {
            "raw" => Some(TargetFormat::Raw),
            "qcow2" => Some(TargetFormat::Qcow2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TargetFormat::Raw => "raw",
            TargetFormat::Qcow2 => "qcow2",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct MirrorOptions {
    pub format: TargetFormat,
    /// Switch the export to the target as soon as the job is ready.
    pub pivot: bool,
    /// The job's own I/O limit in bytes per second (0: none).
    pub bps: u64,
    /// Write into an existing file (of the export's size) instead of a new one.
    pub existing: bool,
}

/// Detaches a copy job's dirty map from the device on every way out.
struct Attached {
    observers: Arc<Observers>,
    map: Arc<DirtyBitmap>,
}

impl Attached {
    fn new(device: &Device) -> Result<Attached, Error> {
        let map = DirtyBitmap::new(device.size(), granularity(device.size()))
            .map_err(|e| Error::failed(e.report().to_string()))?;
        let map = Arc::new(map);
        let observers = device.write_observers().clone();
        observers.add(map.clone());
        Ok(Attached { observers, map })
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.observers.remove(&self.map);
    }
}

/// What the job's end does with the target.
enum Pivot {
    /// Serve the file from now on.
    Mirror { path: PathBuf, format: TargetFormat },
    /// Serve the chain from `base` on; `delete` the layers above it after.
    Commit { base: PathBuf, base_format: Format, above: Vec<PathBuf>, delete: bool },
    /// Serve the target itself, named `.0` (an NBD URI, an `rbd:` image),
    /// through the job's own connection to it.
    Served(String),
    /// No pivot (an RBD source): why, for `job_pivot`'s refusal.
    None(String),
}

/// One running copy job.
struct Copy {
    name: String,
    device: Arc<Device>,
    changer: Changer,
    attached: Attached,
    target: Option<Box<dyn Target>>,
    /// The target reads as zeros where nothing was written: zero runs of the source are skipped.
    fresh: bool,
    /// Which runs of the source to mark: those held at a depth below this (0: every run).
    below_depth: u32,
    pivot: Pivot,
    auto_pivot: bool,
    /// The job said it is ready.
    ready: bool,
    /// An RBD image the job made: removed if it is cancelled before ready.
    made_rbd: Option<Spec>,
    /// The old chain's lock on the base to take back if an active commit ends without pivot.
    relock: Option<PathBuf>,
    buf: Vec<u8>,
    extents: Vec<vdisk_image::Extent>,
    what: &'static str,
    /// Bytes copied so far, and to copy (what was dirty, as it grew).
    done: u64,
    total: u64,
    /// Where a synchronous step copies the next dirty run not held for (see `sync_step`).
    cursor: u64,
    /// When that copy may go on at the job's `bps` (None: now).
    due: Option<std::time::Instant>,
    /// A synchronous sweep from offset 0 found nothing dirty besides the held writes.
    clean: bool,
    /// What was dirty when last counted, and when (counting reads the whole map).
    counted: Option<(std::time::Instant, u64)>,
}

impl Daemon {
    /// Starts mirroring export `name` to `target`; returns the job's id. The
    /// target is made (or opened, or connected to) before this returns, so
    /// what is refused changes nothing.
    pub fn mirror(&self, name: &str, target: MirrorTarget, o: MirrorOptions) -> Result<u64, Error> {
        let refuse = |why: String| Error::invalid(format!("mirror of export {name:?}: {why}"));
        self.jobs.check_free("mirror", name)?;
        // An NBD target is reached before the change lock is taken: a slow
        // server holds up this request only.
        let mut remote = match &target {
            MirrorTarget::Nbd(uri) if o.format != TargetFormat::Raw => {
                return Err(refuse(format!(
                    "the NBD target {uri} is written as the disk's bytes: --format {} applies to a new file only",
                    o.format.name()
                )));
            }
            MirrorTarget::Nbd(uri) => {
                let roots = self.live_change(name, |live| Ok(live.roots.clone()))?;
                Some(connect(name, uri, roots)?)
            }
            MirrorTarget::File(_) | MirrorTarget::Rbd(_) => None,
        };
        // So is an RBD target (made or opened within the client's deadlines).
        let mut rbd = match &target {
            MirrorTarget::Rbd(s) => Some(self.rbd_target(name, s, &o)?),
            _ => None,
        };
        let made_rbd = rbd.as_ref().and_then(|(t, made)| made.then(|| t.0.spec().clone()));
        let started = self.live_change(name, |live| {
            let rbd_source = vdisk_image::rbd::is_rbd(&live.spec.image)
                || live.device.kind() == vdisk_engine::EngineKind::Rbd;
            // An RBD export, or one served from an NBD export: the copy reads it through its device's image.
            let device = if rbd_source || served_remotely(live) {
                if rbd_source && o.pivot {
                    return Err(refuse(format!(
                        "--pivot is not supported: the export is the RBD image {} and its device cannot be swapped; \
                         mirror without --pivot (once ready, `cancel` ends the mirror with the target holding the disk)",
                        live.spec.image.display()
                    )));
                }
                if let Some(why) = live.device.failure() {
                    return Err(Error::failed(format!("mirror of export {name:?}: its device failed ({why})")));
                }
                live.device.clone()
            } else {
                check_source(live, "mirror", name, RBD_COPY, None)?
            };
            let no_swap = || {
                format!(
                    "it mirrors the RBD export {} (its device cannot be swapped)",
                    live.spec.image.display()
                )
            };
            let served = |name: &str| if rbd_source { Pivot::None(no_swap()) } else { Pivot::Served(name.to_owned()) };
            match &target {
                MirrorTarget::Rbd(s) => {
                    let (t, made) = rbd.take().expect("opened before");
                    let t: Box<dyn Target> = Box::new(t);
                    Ok((device, t, served(s), made))
                }
                MirrorTarget::Nbd(uri) => {
                    let remote = remote.take().expect("connected before");
                    if remote.size != device.size() {
                        return Err(refuse(format!(
                            "the NBD target {uri} is {} bytes and the export {}: they must be the same size",
                            remote.size,
                            device.size()
                        )));
                    }
                    let t: Box<dyn Target> = Box::new(NbdTarget { remote, uri: uri.clone() });
                    Ok((device, t, served(uri), false))
                }
                MirrorTarget::File(path) => {
                    let (t, fresh) = open_file_target(live, name, path, &o, device.size())?;
                    let pivot = if rbd_source {
                        Pivot::None(no_swap())
                    } else {
                        Pivot::Mirror { path: path.clone(), format: o.format }
                    };
                    Ok((device, t, pivot, fresh))
                }
            }
        });
        let (device, made, pivot, fresh) = match started {
            Ok(s) => s,
            Err(e) => {
                // Refused: an RBD image made for it is removed again (dropped: closed first).
                drop(rbd);
                if let Some(spec) = &made_rbd {
                    remove_made(name, spec);
                }
                return Err(e);
            }
        };
        let copy = Copy {
            fresh,
            auto_pivot: o.pivot,
            made_rbd,
            ..Copy::new(name, "mirror", device, self.changer(), made, pivot)?
        };
        copy.start(&self.jobs, o.bps)
    }

    /// Makes (or, with `existing`, opens) the RBD image `target` names for a
    /// mirror of export `name`; true when the job made it. The export's Ceph
    /// configuration and client id apply where `target` names none (then
    /// librados's own defaults: $CEPH_CONF, /etc/ceph/ceph.conf).
    fn rbd_target(&self, name: &str, target: &str, o: &MirrorOptions) -> Result<(RbdTarget, bool), Error> {
        let refuse = |why: String| Error::invalid(format!("mirror of export {name:?}: {why}"));
        if o.format != TargetFormat::Raw {
            return Err(refuse(format!(
                "the RBD target {target} is written as the disk's bytes: --format {} applies to a new file only",
                o.format.name()
            )));
        }
        let (size, defaults, roots) =
            self.live_change(name, |live| Ok((live.device.size(), live.spec.ceph(), live.roots.clone())))?;
        let spec = Spec::parse(target, &defaults).map_err(|e| refuse(e.report().to_string()))?;
        if spec.snap.is_some() {
            return Err(refuse(format!("the RBD target {target} names a snapshot, which cannot be written")));
        }
        if let (Some(roots), Some(conf)) = (roots, &spec.options.conf) {
            vdisk_image::files::confined(Some(roots), || vdisk_image::files::check_confined(conf))
                .map_err(|e| refuse(e.report().to_string()))?;
        }
        if !o.existing {
            RbdImage::create(&spec, size).map_err(|e| {
                if e.os_error() == Some(libc::EEXIST) {
                    return Error::new(
                        ErrorKind::Exists,
                        format!("mirror of export {name:?}: {}; or write into it with --existing", e.message()),
                    );
                }
                Error::failed(format!("mirror of export {name:?}: cannot make the target: {}", e.report()))
            })?;
        }
        let image = match RbdImage::open(&spec, false) {
            Ok(i) => i,
            Err(e) => {
                if !o.existing {
                    remove_made(name, &spec);
                }
                return Err(
                    Error::failed(format!("mirror of export {name:?}: cannot open the target {spec}")).because(e)
                );
            }
        };
        if image.size() < size {
            return Err(refuse(format!(
                "the RBD image {spec} is {} bytes, smaller than the export ({size} bytes): grow it (`rbd resize \
                 --size {size}B {}/{}`) or name another",
                image.size(),
                spec.pool,
                spec.image
            )));
        }
        if o.pivot && image.size() != size {
            return Err(refuse(format!(
                "the RBD image {spec} is {} bytes and the export {size}: --pivot serves the export from it, which \
                 needs the same size (mirror without --pivot, or into an image of the export's size)",
                image.size()
            )));
        }
        Ok((RbdTarget(image), !o.existing))
    }

    /// Starts an active commit of export `name`'s live top (and every layer
    /// above `base`) into `base` (the bottom of its chain by default); with
    /// `delete` the layers above the base are removed after the pivot.
    /// Returns the job's id.
    pub fn active_commit(&self, name: &str, base: Option<PathBuf>, delete: bool, bps: u64) -> Result<u64, Error> {
        let refuse = |why: String| Error::invalid(format!("commit of export {name:?}: {why}"));
        self.jobs.check_free("commit", name)?;
        let (device, made, pivot, below, relock) = self.live_change(name, |live| {
            let chain_kept = Some("it is served read-only: its chain never changes");
            let device = check_source(live, "commit", name, RBD_COPY, chain_kept)?;
            let top = std::path::absolute(&live.spec.image)
                .map_err(|e| refuse(format!("{}: {e}", live.spec.image.display())))?;
            let format = Format::from_name(live.format).unwrap_or(Format::Raw);
            let chain = chain::chain_of(&top, format).map_err(refuse)?;
            if let Some(l) = chain.iter().find(|l| l.format == Format::Rbd) {
                return Err(refuse(format!(
                    "{} is an RBD backing image: a commit into RBD is not supported",
                    l.path.display()
                )));
            }
            if chain.len() < 2 {
                return Err(refuse(format!(
                    "{} is {}, with no backing file: there is nothing to commit",
                    top.display(),
                    chain[0].format.name()
                )));
            }
            let at = match &base {
                None => chain.len() - 1,
                Some(b) => {
                    let want =
                        std::fs::canonicalize(b).map_err(|e| refuse(format!("the base {}: {e}", b.display())))?;
                    let found = chain.iter().position(|l| std::fs::canonicalize(&l.path).is_ok_and(|c| c == want));
                    match found {
                        Some(0) => {
                            return Err(refuse(format!("{} is the top itself: name a layer below it", b.display())))
                        }
                        Some(i) => i,
                        None => {
                            let names: Vec<String> = chain.iter().map(|l| l.path.display().to_string()).collect();
                            return Err(refuse(format!(
                                "{} is not in the export's chain ({})",
                                b.display(),
                                names.join(" <- ")
                            )));
                        }
                    }
                }
            };
            let chain::Layer { path: base_path, format: base_format } = chain[at].clone();
            if !matches!(base_format, Format::Raw | Format::Qcow2) {
                return Err(refuse(format!(
                    "the base {} is {}: only a raw or qcow2 base can take the layers above it",
                    base_path.display(),
                    base_format.name()
                )));
            }
            // The chain holds the base open read-only (a shared lock for
            // qcow2); the job opens it read-write on its own, so it unlocks it.
            chain::relock(&*device.image(), &base_path, libc::LOCK_UN);
            let options = vdisk_image::OpenOptions { format: Some(base_format), ..Default::default() };
            let opened = vdisk_image::open(&base_path, &options).map_err(|e| {
                chain::relock(&*device.image(), &base_path, libc::LOCK_SH);
                Error::failed(format!(
                    "commit of export {name:?}: cannot open the base {} read-write",
                    base_path.display()
                ))
                .because(e)
            })?;
            let t: Box<dyn Target> = Box::new(ImageTarget::new(opened.image, &base_path));
            let above = chain[..at].iter().map(|l| l.path.clone()).collect();
            let pivot = Pivot::Commit { base: base_path.clone(), base_format, above, delete };
            Ok((device, t, pivot, at as u32 + 1, base_path))
        })?;
        let copy = Copy {
            below_depth: below,
            auto_pivot: true,
            relock: Some(relock),
            ..Copy::new(name, "commit", device, self.changer(), made, pivot)?
        };
        copy.start(&self.jobs, bps)
    }
}

/// Removes the RBD image `spec` a mirror of export `name` made (closed by now).
fn remove_made(name: &str, spec: &Spec) {
    match RbdImage::remove(spec) {
        Ok(()) => log::info!(export:% = name; "export {name:?}: mirror: removed the partial target {spec}"),
        Err(e) => log::warn!(export:% = name; "export {name:?}: mirror: cannot remove the partial target {spec}: {}",
            e.report()),
    }
}

/// Opens the NBD export `uri` as a mirror's target; with image `roots`, its
/// unix socket and the files its TLS credentials name must lie beneath them.
fn connect(name: &str, uri: &str, roots: Option<Arc<vdisk_image::files::Roots>>) -> Result<Remote, Error> {
    let refuse = |why: String| Error::invalid(format!("mirror of export {name:?}: {why}"));
    let (_, remote) = vdisk_image::files::confined(roots, || formats::connect_nbd(uri)).map_err(refuse)?;
    let remote = remote
        .map_err(|e| Error::failed(format!("mirror of export {name:?}: cannot open the NBD target {uri}: {e}")))?;
    if remote.flags & vdisk_nbd::proto::TF_READ_ONLY != 0 {
        return Err(refuse(format!("the NBD target {uri} is read-only")));
    }
    Ok(remote)
}

/// Makes (or, with `existing`, opens) a mirror's target file; true when it is new (reads as zeros).
fn open_file_target(
    live: &Live,
    name: &str,
    path: &Path,
    o: &MirrorOptions,
    size: u64,
) -> Result<(Box<dyn Target>, bool), Error> {
    let refuse = |why: String| Error::invalid(format!("mirror of export {name:?}: {why}"));
    if !path.is_absolute() {
        return Err(refuse(format!("the target {} must be an absolute path", path.display())));
    }
    if live.roots.is_some() {
        let dir = path.parent().unwrap_or(Path::new("/"));
        vdisk_image::files::confined(live.roots.clone(), || vdisk_image::files::check_confined(dir)).map_err(|e| {
            refuse(format!("the target {} is not beneath the image roots: {}", path.display(), e.report()))
        })?;
    }
    // Not a file the export reads: its top or any layer beneath it.
    if let Ok(t) = std::fs::metadata(path) {
        let image = live.device.image();
        let mine = image.files().iter().any(|f| chain::is_file(f, &t));
        if mine {
            return Err(refuse(format!("the target {} is a file of the image the export serves", path.display())));
        }
    }
    let forced = match o.format {
        TargetFormat::Raw => Format::Raw,
        TargetFormat::Qcow2 => Format::Qcow2,
    };
    let exists = path.symlink_metadata().is_ok();
    if exists && !o.existing {
        return Err(Error::new(
            ErrorKind::Exists,
            format!(
                "mirror of export {name:?}: {} exists already: name a new file, or write into it with --existing",
                path.display()
            ),
        ));
    }
    if !exists {
        let made = match o.format {
            TargetFormat::Raw => std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .and_then(|f| f.set_len(size))
                .map_err(|e| format!("{e}")),
            TargetFormat::Qcow2 => {
                let c = CreateOptions { size, cluster_bits: DEFAULT_CLUSTER_BITS, backing: None };
                Qcow2Image::create(path, &c).map_err(|e| e.report().to_string())
            }
        };
        if let Err(e) = made {
            let _ = std::fs::remove_file(path);
            return Err(Error::failed(format!("mirror of export {name:?}: cannot create {}: {e}", path.display())));
        }
    }
    let options = vdisk_image::OpenOptions { format: Some(forced), ..Default::default() };
    let opened = vdisk_image::open(path, &options);
    let image = match opened {
        Ok(o) if o.image.size() == size => o.image,
        Ok(o) => {
            return Err(refuse(format!(
                "the target {} is {} bytes and the export {size}: they must be the same size",
                path.display(),
                o.image.size()
            )))
        }
        Err(e) => {
            if !exists {
                let _ = std::fs::remove_file(path);
            }
            return Err(Error::failed(format!("mirror of export {name:?}: cannot open {}", path.display())).because(e));
        }
    };
    Ok((Box::new(ImageTarget::new(image, path)), !exists))
}

impl Copy {
    /// A `what` job ("mirror", "commit") of export `name` copying to
    /// `target`, its dirty map attached; every run of the source marked, no
    /// pivot by itself and no lock to take back unless set after.
    fn new(
        name: &str,
        what: &'static str,
        device: Arc<Device>,
        changer: Changer,
        target: Box<dyn Target>,
        pivot: Pivot,
    ) -> Result<Copy, Error> {
        Ok(Copy {
            name: name.to_owned(),
            attached: Attached::new(&device)?,
            device,
            changer,
            target: Some(target),
            fresh: false,
            below_depth: 0,
            pivot,
            auto_pivot: false,
            ready: false,
            made_rbd: None,
            relock: None,
            buf: Vec::new(),
            extents: Vec::new(),
            what,
            done: 0,
            total: 0,
            cursor: 0,
            due: None,
            clean: false,
            counted: None,
        })
    }

    /// Runs the copy as a job of `jobs`; its id. Refused (another job took
    /// the export meanwhile), the target is left as it is and the old chain
    /// takes its lock on the base back.
    fn start(self, jobs: &Jobs, bps: u64) -> Result<u64, Error> {
        let (name, what, described) = (self.name.clone(), self.what, self.target_described());
        let back = self.relock.clone().map(|base| (self.device.clone(), base));
        let made_rbd = self.made_rbd.clone();
        let spawned = jobs.spawn(what, &name, bps, move |job: &Job| self.run(job).map_err(|e| e.report().to_string()));
        let job = spawned.map_err(|e| {
            if let Some((device, base)) = &back {
                chain::relock(&*device.image(), base, libc::LOCK_SH);
            }
            // The job (and the target it held open) was dropped: an RBD image it made goes too.
            if let Some(spec) = &made_rbd {
                remove_made(&name, spec);
                return Error::new(
                    e.kind(),
                    format!("{}; the RBD image {described} made for it was removed", e.message()),
                );
            }
            Error::new(e.kind(), format!("{}; the target {described} was left as it is", e.message()))
        })?;
        log::info!(export:% = name; "export {name:?}: {what} job {} to {described} started", job.id);
        Ok(job.id)
    }

    fn target_described(&self) -> String {
        self.target.as_deref().map(|t| t.describe()).unwrap_or_default()
    }

    fn failed(&self, why: impl std::fmt::Display) -> Error {
        Error::failed(format!("{} of export {:?}: {why}", self.what, self.name))
    }

    fn target(&mut self) -> &mut dyn Target {
        self.target.as_deref_mut().expect("the target is open until the pivot")
    }

    /// The job: mark, copy pass after pass, then pivot or stop.
    fn run(mut self, job: &Job) -> Result<(), Error> {
        if let Pivot::None(why) = &self.pivot {
            job.refuse_pivot(format!(
                "{why}; once ready the target holds the disk: `vdisk ctl cancel {}` ends the mirror",
                job.id
            ));
        }
        let mut r = self.copy_until_done(job);
        if matches!(r, Ok(false)) && self.ready && matches!(self.pivot, Pivot::None(_) | Pivot::Served(_)) {
            // Cancelled once ready, an NBD or RBD target (or any of an RBD source) is the result.
            r = self.last_sweep(job).map(|()| false);
        }
        if !self.ready && !matches!(r, Ok(true)) {
            if let Some(spec) = self.made_rbd.take() {
                self.target = None;
                remove_made(&self.name, &spec);
            }
        }
        if self.relock.is_some() && !matches!(r, Ok(true)) {
            // No pivot: the old chain goes on reading the base; take its lock back.
            self.target = None;
            let base = self.relock.take().expect("checked");
            chain::relock(&*self.device.image(), &base, libc::LOCK_SH);
        }
        match &r {
            Ok(false) => {
                let left = match &self.pivot {
                    Pivot::Commit { base, .. } => {
                        format!("{} holds part of the layers above it (the chain reads the same)", base.display())
                    }
                    Pivot::None(_) | Pivot::Served(_) if self.ready => {
                        format!("{} holds the disk as the export read when it was cancelled", self.target_described())
                    }
                    _ if self.target.is_none() => "the partial target was removed".into(),
                    _ => "the target was left as it is".into(),
                };
                log::info!(export:% = self.name; "export {:?}: {} cancelled: it serves as before; {left}",
                    self.name, self.what);
            }
            Ok(true) => {}
            Err(e) => log::warn!(export:% = self.name; "export {:?}: {} failed: {}",
                self.name, self.what, e.report()),
        }
        r.map(|_| ())
    }

    /// Ok(true) once pivoted, Ok(false) once cancelled. Passes copy what is
    /// dirty until they stop gaining on the guest (or little is left); then
    /// the guest's writes wait for the target ([`sync`]) and the job is
    /// ready once what was dirty before is copied.
    fn copy_until_done(&mut self, job: &Job) -> Result<bool, Error> {
        self.buf = vec![0u8; CHUNK as usize];
        if !self.mark_source(job)? {
            return Ok(false);
        }
        let map = self.attached.map.clone();
        self.total = map.dirty_bytes();
        job.set_total(self.total);
        let mut last_dirty = u64::MAX;
        let mut synced: Option<Synced> = None;
        loop {
            if job.cancelled() {
                return Ok(false);
            }
            if !self.changer.serves(&self.name, &self.device) {
                return Err(
                    self.failed("the export was removed or replaced (or the server is stopping) while the job ran")
                );
            }
            let gate = synced.as_ref().filter(|s| s.degraded().is_none()).map(|s| s.gate.clone());
            let copied = match &gate {
                Some(gate) => self.sync_step(job, gate)?,
                None => self.pass(job)?,
            };
            if job.cancelled() {
                return Ok(false);
            }
            let (dirty, fresh) = if gate.is_some() { self.dirty_held(&map) } else { (map.dirty_bytes(), true) };
            if fresh {
                // Only a fresh count: a stale one would count again what was copied since.
                self.total = self.total.max(self.done + dirty);
                job.set_total(self.total);
            }
            if synced.is_none() && (dirty <= READY_BELOW || dirty >= last_dirty) {
                synced = Some(Synced::attach(&self.device, &self.name, self.what));
                job.set_synchronous(true);
                log::info!(export:% = self.name; "export {:?}: {} job {}: the guest's writes now wait for the \
                    target ({dirty} bytes dirty still to copy)", self.name, self.what, job.id);
            }
            let degraded = synced.as_ref().is_some_and(|s| s.degraded().is_some());
            if degraded {
                job.set_synchronous(false);
            }
            let caught_up = match (&synced, degraded) {
                (Some(_), false) => dirty <= READY_BELOW,
                _ => dirty <= READY_BELOW || (dirty >= last_dirty && dirty <= READY_STALLED),
            };
            if !self.ready && caught_up {
                self.ready = true;
                job.set_ready(true);
                log::info!(export:% = self.name; "export {:?}: {} job {} is ready ({dirty} bytes dirty)",
                    self.name, self.what, job.id);
            }
            last_dirty = dirty;
            // A mirror of an RBD export never pivots: `job_pivot` refuses it (see `run`).
            let pivots = !matches!(self.pivot, Pivot::None(_));
            if self.ready && pivots && (self.auto_pivot || job.pivot_requested()) {
                self.pivot(job)?;
                return Ok(true);
            }
            if gate.is_none() && (copied == 0 || self.ready) {
                std::thread::sleep(Duration::from_millis(if copied == 0 { 20 } else { 5 }));
            }
        }
    }

    /// One step with the guest's writes held: copies the dirty granules
    /// the held writes meet and lets those writes be answered, then one run
    /// of what else is dirty (at the job's `bps`). Waits briefly for a write
    /// when there is nothing else to do. Returns the bytes copied.
    fn sync_step(&mut self, job: &Job, gate: &SyncGate) -> Result<u64, Error> {
        let map = self.attached.map.clone();
        let now = std::time::Instant::now();
        let paced = self.due.filter(|&d| d > now);
        let idle = Duration::from_millis(20);
        let wait = match paced {
            Some(d) => (d - now).min(idle),
            None if self.clean => idle,
            None => Duration::ZERO,
        };
        let (mut ranges, through) = gate.pending(wait);
        ranges.sort_unstable();
        let mut copied = 0;
        let mut held = || -> Result<(), Error> {
            for &(off, len) in &ranges {
                while let Some((o, l)) = map.take_within(off, len, CHUNK) {
                    self.copy_taken(job, o, l)?;
                    copied += l;
                }
            }
            Ok(())
        };
        let r = held();
        // Copied or not, the writes are on the source: answered (a failure ends the job).
        gate.release(through);
        r?;
        if paced.is_some_and(|d| d > std::time::Instant::now()) {
            return Ok(copied);
        }
        match map.take_next(self.cursor, CHUNK) {
            Some((off, len)) => {
                self.copy_taken(job, off, len)?;
                self.due = job.count(len);
                self.cursor = off + len;
                self.clean = false;
                Ok(copied + len)
            }
            // Nothing from the cursor on: clean if the sweep began at 0, else sweep again from 0.
            None => {
                self.clean = self.cursor == 0;
                self.cursor = 0;
                Ok(copied)
            }
        }
    }

    /// What is dirty besides the held writes, while they are held, and
    /// whether that was counted just now: none once a sweep found nothing;
    /// else counted at most every 100 ms (a count reads the whole map, up to
    /// 8 MiB, and steps come as fast as the guest writes).
    fn dirty_held(&mut self, map: &DirtyBitmap) -> (u64, bool) {
        if self.clean {
            return (0, true);
        }
        let now = std::time::Instant::now();
        match self.counted {
            Some((at, n)) if now.duration_since(at) < Duration::from_millis(100) => (n, false),
            _ => {
                let n = map.dirty_bytes();
                self.counted = Some((now, n));
                (n, true)
            }
        }
    }

    /// Marks what the source holds that the target must get; Ok(false) if
    /// the job was cancelled meanwhile (a large chain takes a while to map).
    fn mark_source(&mut self, job: &Job) -> Result<bool, Error> {
        let image = self.device.image();
        let map = &self.attached.map;
        let size = image.size();
        let mut runs = Vec::new();
        let mut off = 0;
        while off < size {
            if job.cancelled() {
                return Ok(false);
            }
            runs.clear();
            image
                .allocation(off, size - off, 1024, &mut runs)
                .map_err(|e| self.failed(format!("reading the source's allocation: {}", e.report())))?;
            if runs.is_empty() {
                return Err(self.failed(format!("the source's allocation at {off} is empty")));
            }
            for run in &runs {
                let wanted = if self.below_depth > 0 {
                    run.depth >= 1 && run.depth < self.below_depth
                } else {
                    !(self.fresh && run.zero)
                };
                if wanted {
                    map.set(off, run.len);
                }
                off += run.len;
            }
        }
        Ok(true)
    }

    /// Takes and copies every dirty run once; the bytes copied.
    fn pass(&mut self, job: &Job) -> Result<u64, Error> {
        let map = self.attached.map.clone();
        let mut from = 0;
        let mut copied = 0;
        while let Some((off, len)) = map.take_next(from, CHUNK) {
            self.copy_taken(job, off, len)?;
            job.pace(len);
            copied += len;
            from = off + len;
            if job.cancelled() {
                break;
            }
        }
        Ok(copied)
    }

    /// Copies a run taken from the dirty map and counts it; a run that
    /// fails is marked dirty again.
    fn copy_taken(&mut self, job: &Job, off: u64, len: u64) -> Result<(), Error> {
        if let Err(e) = self.copy_run(off, len) {
            self.attached.map.set(off, len);
            return Err(e);
        }
        job.add_done(len);
        self.done += len;
        Ok(())
    }

    fn copy_run(&mut self, off: u64, len: u64) -> Result<(), Error> {
        let image = self.device.image();
        let mut buf = std::mem::take(&mut self.buf);
        let data = &mut buf[..len as usize];
        let r = chain::read(&*image, off, data, &mut self.extents).map_err(|e| self.failed(e)).and_then(|()| {
            let w = if data.iter().all(|&b| b == 0) {
                self.target().zero(off, len)
            } else {
                self.target().write(off, data)
            };
            w.map_err(|e| self.failed(format!("{e}; the export serves on unchanged")))
        });
        self.buf = buf;
        r
    }

    /// A cancelled mirror with no pivot, once ready: copies what is dirty
    /// (one sweep over the disk) and flushes the target.
    fn last_sweep(&mut self, job: &Job) -> Result<(), Error> {
        let map = self.attached.map.clone();
        let mut from = 0;
        while let Some((off, len)) = map.take_next(from, CHUNK) {
            self.copy_taken(job, off, len)?;
            from = off + len;
        }
        self.total = self.total.max(self.done);
        job.set_total(self.total);
        let flushed = self.target().flush();
        flushed.map_err(|e| self.failed(format!("{e}; the export serves on unchanged")))
    }

    /// Quiesce, copy the last dirty runs, flush, open the target and swap.
    fn pivot(&mut self, job: &Job) -> Result<(), Error> {
        let name = self.name.clone();
        let changer = self.changer.clone();
        changer.live_change(&name, |live| {
            if !Arc::ptr_eq(&live.device, &self.device) {
                return Err(self.failed("the export was replaced while the job ran"));
            }
            let device = self.device.clone();
            let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| self.failed(e.report()))?;
            let map = self.attached.map.clone();
            while let Some((off, len)) = map.take_next(0, CHUNK) {
                self.copy_taken(job, off, len)?;
            }
            self.total = self.total.max(self.done);
            job.set_total(self.total);
            let flushed = self.target().flush();
            flushed.map_err(|e| self.failed(format!("{e}; the export serves on unchanged")))?;
            let described = self.target().describe();
            let target = self.target.take().expect("the target is open until the pivot");
            let (path, format, spec_format) = match &self.pivot {
                Pivot::Mirror { path, format: TargetFormat::Raw } => (path.clone(), Format::Raw, ImageFormat::Raw),
                Pivot::Mirror { path, format: TargetFormat::Qcow2 } => {
                    (path.clone(), Format::Qcow2, ImageFormat::Qcow2)
                }
                Pivot::Commit { base, base_format, .. } => {
                    let f = if *base_format == Format::Qcow2 { ImageFormat::Qcow2 } else { ImageFormat::Raw };
                    (base.clone(), *base_format, f)
                }
                Pivot::Served(name) => (PathBuf::from(name), Format::Raw, ImageFormat::Auto),
                Pivot::None(_) => unreachable!("no pivot: `job_pivot` refuses it"),
            };
            let swapped = swap_top(live.bitmaps.as_deref(), &path, || {
                let opened = match &self.pivot {
                    // The job's own connection (NBD) or handle (RBD) serves from now on.
                    Pivot::Served(_) => target.into_served(device.size()).map_err(|e| e.to_string()),
                    _ => {
                        drop(target);
                        let read_only = device.read_only();
                        let options = vdisk_image::OpenOptions {
                            format: Some(format),
                            direct: live.direct,
                            read_only,
                            ..Default::default()
                        };
                        vdisk_image::open(&path, &options).map(|o| o.image).map_err(|e| e.report().to_string())
                    }
                };
                opened.and_then(|image| guard.replace_image(image).map_err(|e| e.report().to_string()))
            });
            if let Err(e) = swapped {
                return Err(self.failed(format!(
                    "{described} holds the disk, but could not be served ({e}): the export serves on from its old \
                     image"
                )));
            }
            drop(guard);
            self.relock = None;
            live.spec.image = path.clone();
            live.spec.format = spec_format;
            live.spec.backing = None;
            live.spec.ignore_backing_mtime = false;
            live.format = device.image().format();
            log::info!(export:% = name; "export {name:?}: {} job {}: now served from {described}", self.what, job.id);
            Ok(())
        })?;
        if let Pivot::Commit { above, delete: true, .. } = &self.pivot {
            for p in above {
                if let Err(e) = std::fs::remove_file(p) {
                    log::warn!(export:% = name; "export {name:?}: commit: cannot remove {}: {e}", p.display());
                }
            }
        }
        Ok(())
    }
}
