//! `commit`: merges layers of an export's chain into a lower one while it
//! serves (docs/block-jobs.md). For layers below the live top (the guest
//! never writes them, so no dirty map is needed): a job reads, through a
//! chain opened read-only at `--top`, every run that a layer above `--base`
//! holds, and writes it into `--base` (opened writable on its own, through
//! vdisk-image); flushes the base; then, under the change lock and a
//! quiesce, rewrites the backing link of the layer just above `--top` to
//! name the base (durably), reopens the shortened chain and swaps it in;
//! `--delete` then removes the dropped layers' files.
//!
//! Crash safety is the order of durable steps: the data is in the base and
//! durable before any link names the base in the dropped layers' place;
//! the link is durable before the swap; files go only after the swap. Killed
//! during the copy, the chain is as it was (the base holds, beneath the
//! layers that still mask them, runs with the same data): commit again. A
//! raw base's mtime is put back after each chunk's writes, so a COW overlay
//! over it (whose header records it) still opens. A cancelled commit stops
//! between chunks and leaves the chain as it was.
//!
//! When `--top` is the live top, the commit is an active commit (a mirror
//! into the base), [`Daemon::active_commit`].

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::SystemTime;

use vdisk_engine::Device;
use vdisk_image::{Format, Image, OpenOptions};

use crate::bitmaps::{swap_top, ExportBitmaps};
use crate::chain::{self, chain_of, same_file, Layer};
use crate::daemon::Live;
use crate::jobs::Job;
use crate::snapshot::{check_source, QUIESCE_LIMIT};
use crate::stream::{swap_at_end, Started, CHUNK};
use crate::{Daemon, Error};

/// What `commit` was asked.
#[derive(Clone, Debug, Default)]
pub struct CommitRequest {
    /// The highest layer merged; default: the layer just below the live top.
    pub top: Option<PathBuf>,
    /// The layer merged into; default: the bottom of the chain.
    pub base: Option<PathBuf>,
    /// Remove the dropped layers' files once the new chain serves.
    pub delete: bool,
    /// The job's own I/O limit in bytes per second (0: none).
    pub bps: u64,
    /// Commit the live top itself (`--top` may not be given then): an active commit.
    pub active: bool,
}

/// What a commit of layers below the live top works on, checked.
struct Plan {
    device: Arc<Device>,
    /// The live top first, the bottom last.
    chain: Vec<Layer>,
    /// Indexes in `chain`: the highest layer merged, and the base.
    top: usize,
    base: usize,
    delete: bool,
    direct: bool,
    /// Where the files opened must lie (a control request's image roots).
    roots: Option<Arc<vdisk_image::files::Roots>>,
}

/// What the check decided.
enum Decided {
    Below(Plan),
    /// `--top` is the live top: an active commit, into `--base` if given.
    Active(Option<PathBuf>),
}

impl Daemon {
    /// Starts a commit of export `name` as a job; refuses, before anything
    /// changes, an RBD or raw export, a read-only one, a `--top` or `--base`
    /// not in its chain, a base above the top.
    pub fn commit(self: &Arc<Self>, name: &str, req: &CommitRequest) -> Result<Started, Error> {
        let daemon = Arc::downgrade(self);
        let decided = self.live_change(name, |live| {
            let plan = match check(live, name, req)? {
                Decided::Below(plan) => plan,
                Decided::Active(base) => return Ok(Err(base)),
            };
            let export = name.to_owned();
            let job = self.jobs.spawn("commit", name, req.bps, move |job: &Job| {
                let r = run(&daemon, &export, plan, job);
                if let Err(e) = &r {
                    log::warn!(export:% = export; "export {export:?}: commit failed: {}", e.report());
                }
                r.map_err(|e| e.report().to_string())
            })?;
            Ok(Ok(Started { job: job.id, export: name.to_owned() }))
        })?;
        match decided {
            Ok(started) => Ok(started),
            Err(base) => {
                let job = self.active_commit(name, base, req.delete, req.bps)?;
                Ok(Started { job, export: name.to_owned() })
            }
        }
    }
}

fn check(live: &Live, name: &str, req: &CommitRequest) -> Result<Decided, Error> {
    let refuse = |why: String| Error::invalid(format!("commit of export {name:?}: {why}"));
    let device = check_source(
        live,
        "commit",
        name,
        "it is an RBD image: RBD images have no chain of overlays to merge (flatten a clone with `rbd flatten`)",
        Some("it is served read-only: its chain is not to be changed"),
    )?;
    let format = match live.format {
        "qcow2" => Format::Qcow2,
        "cow" => Format::Cow,
        f => {
            return Err(refuse(format!(
                "its image {} is {f}, which has no backing chain: there is nothing to commit",
                live.spec.image.display()
            )))
        }
    };
    let live_top =
        std::path::absolute(&live.spec.image).map_err(|e| refuse(format!("{}: {e}", live.spec.image.display())))?;
    let chain = chain_of(&live_top, format).map_err(|e| refuse(format!("cannot read its chain: {e}")))?;
    let names = || chain.iter().map(|l| l.path.display().to_string()).collect::<Vec<_>>().join(" <- ");
    let find = |p: &Path, what: &str| {
        chain.iter().position(|l| same_file(&l.path, p)).ok_or_else(|| {
            refuse(format!("{what} {} is not a layer of its chain ({}, the live top first)", p.display(), names()))
        })
    };
    if req.active && req.top.is_some() {
        return Err(refuse("give --top or --active, not both (--active commits the live top)".into()));
    }
    if req.active || req.top.as_deref().is_some_and(|p| same_file(p, &live_top)) {
        // The live top: an active commit, which checks its base itself.
        return Ok(Decided::Active(req.base.clone()));
    }
    let base = match &req.base {
        Some(p) => find(p, "--base")?,
        None => chain.len() - 1,
    };
    let top = match &req.top {
        Some(p) => find(p, "--top")?,
        None if chain.len() < 3 => {
            return Err(refuse(format!(
                "its chain ({}) has no layer between the live top and the base: commit the live top itself with \
                 --active (or --top {})",
                names(),
                live_top.display()
            )))
        }
        None => 1,
    };
    if base <= top {
        return Err(refuse(format!(
            "the base {} is not below the top {} in its chain ({}, the live top first)",
            chain[base].path.display(),
            chain[top].path.display(),
            names()
        )));
    }
    if matches!(chain[base].format, Format::Rbd) {
        return Err(refuse(format!(
            "the base {} is an RBD image: vdisk does not write into an RBD base",
            chain[base].path.display()
        )));
    }
    let above = &chain[top - 1];
    if above.format == Format::Cow && chain[base].format != Format::Raw {
        return Err(refuse(format!(
            "{} is a COW overlay, whose backing file must be raw, and the base {} is {}",
            above.path.display(),
            chain[base].path.display(),
            chain[base].format.name()
        )));
    }
    if live.roots.is_some() {
        for l in &chain[top..=base] {
            vdisk_image::files::confined(live.roots.clone(), || vdisk_image::files::check_confined(&l.path))
                .map_err(|e| refuse(format!("{} is not beneath the image roots: {}", l.path.display(), e.report())))?;
        }
    }
    let (delete, direct, roots) = (req.delete, live.direct, live.roots.clone());
    Ok(Decided::Below(Plan { device, chain, top, base, delete, direct, roots }))
}

/// The commit job: the copy without the change lock, then the swap under it.
fn run(daemon: &Weak<Daemon>, name: &str, plan: Plan, job: &Job) -> Result<(), Error> {
    let failed = |why: String| Error::failed(format!("commit of export {name:?}: {why}"));
    let gone = || {
        failed(
            "the export was removed (or replaced) while the commit ran: its chain was not changed (commit again)"
                .into(),
        )
    };
    let Plan { device, chain, top, base, delete, direct, roots } = plan;
    let (top_layer, base_layer) = (&chain[top], &chain[base]);
    let size = device.size();
    job.set_total(size);
    let read_options =
        OpenOptions { format: Some(top_layer.format), read_only: true, roots: roots.clone(), ..Default::default() };
    let reader = vdisk_image::open(&top_layer.path, &read_options)
        .map_err(|e| failed(format!("cannot open the chain at {}: {}", top_layer.path.display(), e.report())))?
        .image;
    // The base is locked shared by the chains that read it (the served one,
    // `reader`); they let go while it is open for writing.
    let served = device.image();
    let readers: [&dyn Image; 2] = [&*served, &*reader];
    let relock = |op: i32| readers.iter().for_each(|image| chain::relock(*image, &base_layer.path, op));
    relock(libc::LOCK_UN);
    let write_options = OpenOptions { format: Some(base_layer.format), roots, ..Default::default() };
    let writer = vdisk_image::open(&base_layer.path, &write_options);
    let writer = match writer {
        Ok(o) => o.image,
        Err(e) => {
            relock(libc::LOCK_SH);
            return Err(failed(format!(
                "cannot open the base {} for writing: {}",
                base_layer.path.display(),
                e.report()
            )));
        }
    };
    let copied = copy(&*reader, &*writer, base - top, size, job, &base_layer.path, || {
        daemon.upgrade().is_some_and(|d| d.serves(name, &device))
    });
    let flushed = copied.and_then(|n| {
        // VDISK_BREAK=commit-link-first (a test build only): the base is not
        // made durable before the link above is rewritten to expose it.
        if vdisk_image::breakage::active(vdisk_image::breakage::Breakage::CommitLinkFirst) {
            return Ok(n);
        }
        chain::flush(&*writer).map(|()| n)
    });
    let mtime_back = keep_mtime(&base_layer.path, base_layer.format);
    drop(writer);
    mtime_back();
    relock(libc::LOCK_SH);
    drop(reader);
    let copied = match flushed {
        Ok(Some(n)) => n,
        Ok(None) if job.cancelled() => {
            log::info!(export:% = name; "export {name:?}: commit cancelled; the chain is as it was");
            return Ok(());
        }
        Ok(None) => return Err(gone()),
        Err(e) => return Err(failed(format!("{e}; the chain is as it was, commit again"))),
    };
    let swap = |bitmaps: Option<&ExportBitmaps>| swap(&device, &chain, (top, base), direct, name, bitmaps);
    if !swap_at_end(daemon, name, &device, job, gone, swap)? {
        return Ok(());
    }
    log::info!(export:% = name; "export {name:?}: commit: {copied} bytes of {} merged into {}; {} now backs onto it",
        chain[top..base].iter().map(|l| l.path.display().to_string()).collect::<Vec<_>>().join(", "),
        base_layer.path.display(), chain[top - 1].path.display());
    if delete {
        let mut errors = Vec::new();
        for l in &chain[top..base] {
            if let Err(e) = std::fs::remove_file(&l.path) {
                errors.push(format!("{}: {e}", l.path.display()));
            }
        }
        if !errors.is_empty() {
            return Err(failed(format!(
                "the commit is done and the new chain serves, but --delete could not remove {}",
                errors.join("; ")
            )));
        }
    }
    Ok(())
}

/// Puts a raw base's mtime back as it was when called (a COW overlay over
/// it records it); a no-op for the other formats.
fn keep_mtime(path: &Path, format: Format) -> impl Fn() {
    let was: Option<SystemTime> =
        if format == Format::Raw { std::fs::metadata(path).and_then(|m| m.modified()).ok() } else { None };
    let path = path.to_owned();
    move || {
        if let Some(t) = was {
            if let Err(e) = std::fs::File::options().write(true).open(&path).and_then(|f| f.set_modified(t)) {
                log::warn!("{}: cannot put its mtime back: {e}", path.display());
            }
        }
    }
}

/// Copies every run a layer above the base holds (depth 1 to `above`,
/// counted from the top) from `reader` into `writer`, chunk by chunk;
/// Some(bytes copied), or None when cancelled or `serving` says the export
/// went away.
fn copy(
    reader: &dyn Image,
    writer: &dyn Image,
    above: usize,
    size: u64,
    job: &Job,
    base: &Path,
    serving: impl Fn() -> bool,
) -> Result<Option<u64>, String> {
    let mut runs = Vec::new();
    let mut buf = Vec::new();
    let mut extents = Vec::new();
    let zeros = vec![0u8; CHUNK as usize];
    let (mut off, mut copied) = (0u64, 0u64);
    while off < size {
        if job.cancelled() || !serving() {
            return Ok(None);
        }
        let len = CHUNK.min(size - off);
        let mtime_back = keep_mtime(base, if writer.format() == "raw" { Format::Raw } else { Format::Qcow2 });
        runs.clear();
        reader.allocation(off, len, usize::MAX, &mut runs).map_err(|e| e.report().to_string())?;
        let (mut at, mut here) = (off, 0u64);
        for run in &runs {
            if at >= off + len {
                break;
            }
            let n = run.len.min(off + len - at);
            if run.depth >= 1 && (run.depth as usize) <= above {
                if run.zero {
                    chain::write(writer, at, &zeros[..n as usize], &mut extents)?;
                } else {
                    buf.resize(n as usize, 0);
                    chain::read(reader, at, &mut buf, &mut extents)?;
                    chain::write(writer, at, &buf, &mut extents)?;
                }
                here += n;
            }
            at += n;
        }
        if here > 0 {
            mtime_back();
        }
        copied += here;
        job.add_done(len);
        off += len;
        job.pace(here);
    }
    Ok(Some(copied))
}

/// Under the change lock: quiesce, flush, rewrite the link of the layer
/// above the top to name the base (durably), reopen the live top's chain
/// and swap. If the new chain cannot be served, the old link is written back.
fn swap(
    device: &Device,
    chain: &[Layer],
    (top, base): (usize, usize),
    direct: bool,
    name: &str,
    bitmaps: Option<&ExportBitmaps>,
) -> Result<(), Error> {
    let failed = |why: String| Error::failed(format!("commit of export {name:?}: {why}"));
    let (above, base_layer, live) = (&chain[top - 1], &chain[base], &chain[0]);
    let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| failed(e.report().to_string()))?;
    guard
        .flush()
        .map_err(|e| failed(format!("flushing {}: {}; the chain is as it was", live.path.display(), e.report())))?;
    let old = relink(above, base_layer).map_err(|e| failed(format!("{e}; the chain is as it was, commit again")))?;
    let served = device.image();
    chain::relock(&*served, &live.path, libc::LOCK_UN);
    let options = OpenOptions { format: Some(live.format), direct, ..Default::default() };
    let swapped = swap_top(bitmaps, &live.path, || {
        vdisk_image::open(&live.path, &options)
            .map_err(|e| e.report().to_string())
            .and_then(|o| guard.replace_image(o.image).map_err(|e| e.report().to_string()))
    });
    if let Err(e) = swapped {
        let back = restore(&above.path, &old);
        chain::relock(&*served, &live.path, libc::LOCK_EX);
        let back = match back {
            Ok(()) => "its link was put back: the chain is as it was (the base holds the merged data too)".to_owned(),
            Err(b) => format!(
                "and its link could not be put back ({b}): {} names {} now, whose data is the same",
                above.path.display(),
                base_layer.path.display()
            ),
        };
        return Err(failed(format!(
            "the new chain cannot be served ({e}); the export serves on from the old one; {back}"
        )));
    }
    drop(guard);
    Ok(())
}

/// Rewrites `layer`'s backing link to name `base`, durably; returns the
/// header bytes it replaced (for [`restore`]).
fn relink(layer: &Layer, base: &Layer) -> Result<Vec<u8>, String> {
    let path = &layer.path;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let name = base.path.as_os_str().as_encoded_bytes();
    let (old, new) = match layer.format {
        Format::Qcow2 => qcow2_relinked(&f, path, name, base.format.name())?,
        Format::Cow => {
            let mtime = std::fs::metadata(&base.path).map_err(|e| format!("{}: {e}", base.path.display()))?.mtime();
            cow_relinked(&f, path, name, mtime as u32)?
        }
        f => return Err(format!("{} is {}, which has no backing link", path.display(), f.name())),
    };
    f.write_all_at(&new, 0)
        .and_then(|()| f.sync_all())
        .map_err(|e| format!("cannot write the header of {}: {e}", path.display()))?;
    Ok(old)
}

/// Writes `old` header bytes back at the start of `path`, durably.
fn restore(path: &Path, old: &[u8]) -> Result<(), String> {
    let f = std::fs::OpenOptions::new().write(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all_at(old, 0).and_then(|()| f.sync_all()).map_err(|e| format!("{}: {e}", path.display()))
}

/// A qcow2 header (its first cluster) naming `name` in `format` as its
/// backing file: the extensions kept but the backing format's, which is
/// written anew, the name after them. Returns (old, new) bytes.
fn qcow2_relinked(f: &std::fs::File, path: &Path, name: &[u8], format: &str) -> Result<(Vec<u8>, Vec<u8>), String> {
    const EXT_END: u32 = 0;
    const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
    let mut head = vec![0u8; 4096];
    let n = f.read_at(&mut head, 0).map_err(|e| format!("cannot read the header of {}: {e}", path.display()))?;
    head.truncate(n);
    let h = vdisk_image::qcow2::parse_header(&head).map_err(|e| format!("{}: {}", path.display(), e.report()))?;
    let cs = h.cluster_size() as usize;
    let mut old = vec![0u8; cs];
    let n = f.read_at(&mut old, 0).map_err(|e| format!("cannot read the header of {}: {e}", path.display()))?;
    old.truncate(n);
    if name.len() > 1023 {
        return Err(format!("the base's path is longer than qcow2's 1023 bytes: {}", String::from_utf8_lossy(name)));
    }
    let hlen = (h.header_length as usize).min(old.len());
    let be32 = |at: usize| u32::from_be_bytes(old[at..at + 4].try_into().unwrap());
    let push = |b: &mut Vec<u8>, ty: u32, data: &[u8]| {
        b.extend_from_slice(&ty.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        b.resize(b.len().div_ceil(8) * 8, 0);
    };
    let mut b = old[..hlen].to_vec();
    let mut at = hlen;
    while at + 8 <= old.len() {
        let (ty, len) = (be32(at), be32(at + 4) as usize);
        if ty == EXT_END || len > old.len() - at - 8 {
            break;
        }
        if ty != EXT_BACKING_FORMAT {
            push(&mut b, ty, &old[at + 8..at + 8 + len]);
        }
        at += 8 + len.div_ceil(8) * 8;
    }
    push(&mut b, EXT_BACKING_FORMAT, format.as_bytes());
    push(&mut b, EXT_END, &[]);
    let name_at = b.len() as u64;
    b.extend_from_slice(name);
    if b.len() > cs {
        return Err(format!(
            "{}: its header, extensions and the base's name do not fit in its first cluster",
            path.display()
        ));
    }
    b[8..16].copy_from_slice(&name_at.to_be_bytes());
    b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
    old.truncate(b.len().max(hlen));
    Ok((old, b))
}

/// A COW v3 header naming `name` as its backing file, with its mtime.
fn cow_relinked(f: &std::fs::File, path: &Path, name: &[u8], mtime: u32) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut old = vec![0u8; vdisk_image::cow::HEADER_LEN];
    f.read_exact_at(&mut old, 0).map_err(|e| format!("cannot read the header of {}: {e}", path.display()))?;
    let h = vdisk_image::cow::parse_header(&old).map_err(|e| format!("{}: {}", path.display(), e.report()))?;
    if h.layout != vdisk_image::cow::Layout::Packed {
        return Err(format!("{} has the old unpacked COW header, which vdisk does not rewrite", path.display()));
    }
    if name.len() >= vdisk_image::cow::HEADER_LEN - 32 {
        return Err(format!("the base's path is longer than a COW header holds: {}", String::from_utf8_lossy(name)));
    }
    let mut b = old.clone();
    b[8..12].copy_from_slice(&mtime.to_be_bytes());
    b[32..].fill(0);
    b[32..32 + name.len()].copy_from_slice(name);
    Ok((old, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relinked_qcow2_header_names_the_new_base_keeps_the_rest_and_can_be_put_back() {
        let dir = std::env::temp_dir().join(format!("vdisk-relink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (old_base, new_base, layer) = (dir.join("a.raw"), dir.join("new-base.qcow2"), dir.join("l.qcow2"));
        std::fs::write(&old_base, vec![0u8; 1 << 20]).unwrap();
        crate::chain::tests::new_qcow2(&layer, Some(&old_base));
        let header = |p: &Path| {
            let mut b = vec![0u8; 1 << 16];
            let n = std::fs::File::open(p).unwrap().read_at(&mut b, 0).unwrap();
            vdisk_image::qcow2::parse_header(&b[..n]).unwrap()
        };
        let before = header(&layer);
        let l = Layer { path: layer.clone(), format: Format::Qcow2 };
        let old = relink(&l, &Layer { path: new_base.clone(), format: Format::Qcow2 }).unwrap();
        let after = header(&layer);
        assert_eq!(after.backing.as_deref(), Some(new_base.as_os_str().as_encoded_bytes()));
        assert_eq!(after.backing_format.as_deref(), Some("qcow2"));
        assert_eq!(
            (after.size, after.l1_table_offset, after.refcount_table_offset),
            (before.size, before.l1_table_offset, before.refcount_table_offset)
        );
        restore(&layer, &old).unwrap();
        assert_eq!(header(&layer), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
