//! `stream`: copies what an export's backing chain holds into its qcow2 top
//! while it serves, then drops the top's backing link (docs/block-jobs.md).
//!
//! The copy goes chunk by chunk, each under a short quiesce of the device:
//! with no guest request in flight or admitted, a run the top does not hold
//! yet is read through the chain and written to the top, so a guest write
//! that landed first (the run is then the top's) is never overwritten with
//! older data. When every run is the top's: quiesce, flush, clear the
//! header's backing link (durable only after the data it exposes is), reopen
//! the top on its own and swap. Killed midway, the chain is as it was plus
//! copied runs (the same data): it opens and reads the same; stream again.
//!
//! It is a job on its own thread ([`crate::jobs::Jobs::spawn`]): checked
//! under the daemon's change lock when it starts, it copies without that
//! lock (adds, removes and other exports' changes go on), looks at `cancel`
//! between chunks (a cancelled stream leaves the chain as it was: the runs
//! copied hold the same data) and paces its own I/O to its `--bps`; only the
//! final swap takes the change lock again, and fails, changing nothing, when
//! the export was removed or replaced meanwhile.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use vdisk_engine::{Buf, Command, Device, Op, Request};
use vdisk_image::Format;

use crate::bitmaps::{swap_top, ExportBitmaps};
use crate::chain;
use crate::daemon::Live;
use crate::jobs::Job;
use crate::snapshot::QUIESCE_LIMIT;
use crate::{Daemon, Error, ErrorKind};

/// How much of the disk one quiesce covers.
pub const CHUNK: u64 = 1 << 20;

/// A job that was started: it runs on, `job_list` follows it.
#[derive(Clone, Debug)]
pub struct Started {
    pub job: u64,
    pub export: String,
}

/// What a stream works on, checked when it starts.
struct Plan {
    device: Arc<Device>,
    top: PathBuf,
    direct: bool,
}

impl Daemon {
    /// Starts streaming export `name`'s backing chain into its qcow2 top, as
    /// a job on its own thread limited to `bps` bytes per second of its own
    /// I/O (0: none). Everything that can be refused is refused here, before
    /// the job starts; the answer comes at once.
    pub fn stream(self: &Arc<Self>, name: &str, bps: u64) -> Result<Started, Error> {
        let daemon = Arc::downgrade(self);
        self.live_change(name, |live| {
            let plan = check(live, name)?;
            let export = name.to_owned();
            let job = self.jobs.spawn("stream", name, bps, move |job: &Job| {
                let r = run(&daemon, &export, plan, job);
                if let Err(e) = &r {
                    log::warn!(export:% = export; "export {export:?}: stream failed: {}", e.report());
                }
                r.map_err(|e| e.report().to_string())
            })?;
            Ok(Started { job: job.id, export: name.to_owned() })
        })
    }
}

/// Everything a stream refuses, before anything changes.
fn check(live: &Live, name: &str) -> Result<Plan, Error> {
    let refuse = |why: String| Error::invalid(format!("stream of export {name:?}: {why}"));
    let failed = |why: String| Error::failed(format!("stream of export {name:?}: {why}"));
    let device = live.device.clone();
    if device.read_only() {
        return Err(refuse("it is served read-only: its top cannot take the backing data".into()));
    }
    if live.format != "qcow2" {
        return Err(refuse(format!(
            "its top is {}: only a qcow2 top can drop its backing file (a COW overlay always has one)",
            live.format
        )));
    }
    if live.spec.backing.is_some() {
        return Err(refuse("it was added with --backing: stream needs the chain its header names".into()));
    }
    let top =
        std::path::absolute(&live.spec.image).map_err(|e| refuse(format!("{}: {e}", live.spec.image.display())))?;
    if !has_backing_link(&top).map_err(failed)? {
        return Err(refuse(format!("{} has no backing file: there is nothing to stream", top.display())));
    }
    Ok(Plan { device, top, direct: live.direct })
}

/// The stream job: the copy without the change lock, then the swap under it.
fn run(daemon: &Weak<Daemon>, name: &str, plan: Plan, job: &Job) -> Result<(), Error> {
    let failed = |why: String| Error::failed(format!("stream of export {name:?}: {why}"));
    let gone = || {
        failed(
            "the export was removed (or replaced) while the stream ran: nothing was changed (the runs copied so far \
             hold the same data)"
                .into(),
        )
    };
    let Plan { device, top, direct } = plan;
    let size = device.size();
    job.set_total(size);
    let mut runs = Vec::new();
    let mut copied = 0;
    let mut off = 0;
    while off < size {
        if job.cancelled() {
            log::info!(export:% = name; "export {name:?}: stream cancelled after {copied} bytes; the chain is as it was");
            return Ok(());
        }
        if !daemon.upgrade().is_some_and(|d| d.serves(name, &device)) {
            return Err(gone());
        }
        let len = CHUNK.min(size - off);
        let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| failed(e.report().to_string()))?;
        runs.clear();
        device.image().allocation(off, len, usize::MAX, &mut runs).map_err(|e| failed(e.report().to_string()))?;
        let mut at = off;
        let mut here = 0;
        for run in &runs {
            if at >= off + len {
                break;
            }
            let n = run.len.min(off + len - at);
            if run.depth >= 2 {
                let read = guard.execute(vec![Request::new(Op::Read, at, n, 0)]).remove(0);
                if let Some(e) = read.error {
                    return Err(failed(format!("reading {n} bytes at {at} from the backing chain: {}", e.report())));
                }
                let data = Buf::from_slice(read.buf());
                let write = Request::new(Command::Write { data: data.into(), fua: false }, at, n, 0);
                // The disk reads the same: the export's dirty bitmaps stay as they are.
                if let Some(e) = guard.execute_unchanged(vec![write]).remove(0).error {
                    return Err(failed(format!("writing {n} bytes at {at} to {}: {}", top.display(), e.report())));
                }
                here += n;
            }
            at += n;
        }
        drop(guard);
        copied += here;
        job.add_done(len);
        off += len;
        // Outside the quiesce: the guest is never held for the pace.
        job.pace(here);
    }
    if swap_at_end(daemon, name, &device, job, gone, |bitmaps| finish(&device, &top, direct, name, bitmaps))? {
        log::info!(export:% = name;
            "export {name:?}: stream: {copied} bytes copied; {} has no backing file now", top.display());
    }
    Ok(())
}

/// The end of a job that changes export `name`'s chain once its copy is
/// done (stream, commit): under the change lock, `swap`, unless the job was
/// cancelled meanwhile (Ok(false)); `gone()` when the server or the export
/// went away, or the export no longer serves `device`.
pub(crate) fn swap_at_end(
    daemon: &Weak<Daemon>,
    name: &str,
    device: &Arc<Device>,
    job: &Job,
    gone: impl Fn() -> Error,
    swap: impl FnOnce(Option<&ExportBitmaps>) -> Result<(), Error>,
) -> Result<bool, Error> {
    let daemon = daemon.upgrade().ok_or_else(&gone)?;
    let swapped = daemon.live_change(name, |live| {
        if !Arc::ptr_eq(&live.device, device) {
            return Err(gone());
        }
        if job.cancelled() {
            return Ok(false);
        }
        swap(live.bitmaps.as_deref())?;
        Ok(true)
    });
    match swapped {
        Err(e) if e.kind() == ErrorKind::NotFound => Err(gone()),
        r => r,
    }
}

/// Under the change lock, every run the top's: quiesce, flush, drop the link, reopen the top alone, swap.
fn finish(device: &Device, top: &Path, direct: bool, name: &str, bitmaps: Option<&ExportBitmaps>) -> Result<(), Error> {
    let failed = |why: String| Error::failed(format!("stream of export {name:?}: {why}"));
    let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| failed(e.report().to_string()))?;
    guard.flush().map_err(|e| failed(format!("flushing {}: {}; the chain is as it was", top.display(), e.report())))?;
    clear_backing_link(top).map_err(|e| failed(format!("{e}; the chain is as it was, stream again")))?;
    let old = device.image();
    chain::relock(&*old, top, libc::LOCK_UN);
    let options = vdisk_image::OpenOptions { format: Some(Format::Qcow2), direct, ..Default::default() };
    let swapped = swap_top(bitmaps, top, || {
        vdisk_image::open(top, &options)
            .map_err(|e| e.report().to_string())
            .and_then(|o| guard.replace_image(o.image).map_err(|e| e.report().to_string()))
    });
    if let Err(e) = swapped {
        chain::relock(&*old, top, libc::LOCK_EX);
        return Err(failed(format!(
            "{} holds all its data and no longer names a backing file, but could not be reopened ({e}): the export \
             serves on from the old chain (same data); remove and add it again",
            top.display()
        )));
    }
    drop(guard);
    Ok(())
}

/// Clears a qcow2 header's backing file offset and length (bytes 8..20), durably.
fn clear_backing_link(path: &Path) -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    f.write_all_at(&[0u8; 12], 8).map_err(|e| format!("cannot write the header of {}: {e}", path.display()))?;
    f.sync_all().map_err(|e| format!("cannot sync {}: {e}", path.display()))
}

/// A qcow2 header names a backing file (its offset, bytes 8..16, is not 0).
fn has_backing_link(path: &Path) -> Result<bool, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut at = [0u8; 8];
    f.read_exact_at(&mut at, 8).map_err(|e| format!("cannot read the header of {}: {e}", path.display()))?;
    Ok(u64::from_be_bytes(at) != 0)
}
