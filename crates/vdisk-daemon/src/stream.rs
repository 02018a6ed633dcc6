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

use std::os::unix::fs::FileExt;
use std::path::Path;

use vdisk_engine::{Buf, Command, Op, Request};
use vdisk_image::Format;

use crate::daemon::Live;
use crate::snapshot::{lock_top, QUIESCE_LIMIT};
use crate::{Daemon, Error};

/// How much of the disk one quiesce covers.
pub const CHUNK: u64 = 1 << 20;

/// What a stream did.
#[derive(Clone, Debug)]
pub struct Streamed {
    pub job: u64,
    pub export: String,
    /// Bytes copied from the backing chain into the top.
    pub copied: u64,
}

impl Daemon {
    /// Streams export `name`'s backing chain into its qcow2 top and drops the chain. A job.
    pub fn stream(&self, name: &str) -> Result<Streamed, Error> {
        let job = self.jobs.start("stream", name);
        let r = self.live_change(name, |live| {
            let copied = stream(live, name, &job)?;
            Ok(Streamed { job: job.id, export: name.to_owned(), copied })
        });
        job.finish(&r.as_ref().map_err(|e| e.report().to_string()));
        r
    }
}

fn stream(live: &mut Live, name: &str, job: &crate::jobs::Job) -> Result<u64, Error> {
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
    let size = device.size();
    if !has_backing_link(&top).map_err(failed)? {
        return Err(refuse(format!("{} has no backing file: there is nothing to stream", top.display())));
    }
    let mut runs = Vec::new();
    job.set_total(size);
    let mut copied = 0;
    let mut off = 0;
    while off < size {
        let len = CHUNK.min(size - off);
        let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| failed(e.report().to_string()))?;
        runs.clear();
        device.image().allocation(off, len, usize::MAX, &mut runs).map_err(|e| failed(e.report().to_string()))?;
        let mut at = off;
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
                if let Some(e) = guard.execute(vec![write]).remove(0).error {
                    return Err(failed(format!("writing {n} bytes at {at} to {}: {}", top.display(), e.report())));
                }
                copied += n;
            }
            at += n;
        }
        drop(guard);
        job.add_done(len);
        off += len;
    }
    let guard = device.quiesce(QUIESCE_LIMIT).map_err(|e| failed(e.report().to_string()))?;
    guard.flush().map_err(|e| failed(format!("flushing {}: {}; the chain is as it was", top.display(), e.report())))?;
    clear_backing_link(&top).map_err(|e| failed(format!("{e}; the chain is as it was, stream again")))?;
    let old = device.image();
    lock_top(&*old, &top, libc::LOCK_UN);
    let options = vdisk_image::OpenOptions { format: Some(Format::Qcow2), direct: live.direct, ..Default::default() };
    let swapped = vdisk_image::open(&top, &options)
        .map_err(|e| e.report().to_string())
        .and_then(|o| guard.replace_image(o.image).map_err(|e| e.report().to_string()));
    if let Err(e) = swapped {
        lock_top(&*old, &top, libc::LOCK_EX);
        return Err(failed(format!(
            "{} holds all its data and no longer names a backing file, but could not be reopened ({e}): the export \
             serves on from the old chain (same data); remove and add it again",
            top.display()
        )));
    }
    drop(guard);
    log::info!(export:% = name; "export {name:?}: stream: {copied} bytes copied; {} has no backing file now", top.display());
    Ok(copied)
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
