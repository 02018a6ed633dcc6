//! The FUSE export: a device as one regular file, mounted on a file PATH, so
//! the host kernel can use it through a loop device where there is no NBD
//! client or ublk. It speaks the FUSE protocol itself (no libfuse), over
//! classic /dev/fuse reads and writes or over FUSE-over-io_uring.
//!
//! Like every export, it never touches the image's files: reads, writes,
//! flushes, punches and zeroing go to the device's engine in batches.
//!
//! Modules: `proto` (the wire structs), `session` (what each operation does),
//! `classic` and `ring` (the two transports), `ring_entry` (the ring's entry
//! layout and SQEs), `mount` (the mount point), `edge` (a panic becomes -EIO).

mod classic;
mod edge;
mod error;
mod mount;
mod owed;
pub mod proto;
mod ring;
mod ring_entry;
mod session;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vdisk_engine::inflight::InFlight;
use vdisk_engine::Device;

pub use crate::error::{Error, ErrorKind};
use crate::proto::Wire;
use crate::session::Session;

/// How to serve.
#[derive(Debug, Clone)]
pub struct Options {
    /// FUSE-over-io_uring instead of /dev/fuse reads.
    pub uring: bool,
    /// Threads reading /dev/fuse (classic transport).
    pub readers: usize,
}

impl Default for Options {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        Options { uring: false, readers: cpus.clamp(2, 8) }
    }
}

/// A mounted export; [`FuseExport::stop`] unmounts it.
pub struct FuseExport {
    path: PathBuf,
    created: bool,
    session: Arc<Session>,
    threads: Vec<JoinHandle<()>>,
    /// The threads still running, so a stop waits for them without polling.
    running: Arc<InFlight>,
    wakers: Vec<Arc<ring::RingSink>>,
    give_up: Arc<AtomicBool>,
    stopped: bool,
    /// What start found worth telling (a stale mount cleared), for the banner.
    pub notes: Vec<String>,
    pub transport: &'static str,
}

/// Mounts `device` as the file `path` and starts serving it.
pub fn start(path: &Path, device: Arc<Device>, opts: &Options) -> Result<FuseExport, Error> {
    if opts.uring {
        ring::check_enabled()?;
    }
    let prepared = mount::prepare(path)?;
    let mut notes = Vec::new();
    if prepared.was_stale {
        let line = format!("{} was a stale FUSE mount (its server is gone); unmounted it", path.display());
        log::warn!("{line}");
        notes.push(format!("vdisk: {line}"));
    }
    let session = Arc::new(Session::new(device));
    let dev = mount::open_dev()?;
    let mut export = FuseExport {
        path: path.to_owned(),
        created: prepared.created,
        session: session.clone(),
        threads: Vec::new(),
        running: Arc::new(InFlight::new()),
        wakers: Vec::new(),
        give_up: Arc::new(AtomicBool::new(false)),
        stopped: false,
        notes,
        transport: if opts.uring { "FUSE-over-io_uring" } else { "/dev/fuse" },
    };
    if let Err(e) = mount::mount(path, &dev, session.read_only()) {
        export.stopped = true;
        export.remove_created();
        return Err(e);
    }
    // From here on, dropping `export` unmounts.
    let dev = Arc::new(dev);
    export.handshake(&dev, opts)?;
    Ok(export)
}

impl FuseExport {
    fn handshake(&mut self, dev: &Arc<OwnedFd>, opts: &Options) -> Result<(), Error> {
        let file = |m: String| Error::new(ErrorKind::File, m);
        let what = |e: std::io::Error| file(format!("{}: FUSE_INIT failed", self.path.display())).because(e);
        let (h, init) = classic::read_init(dev).map_err(what)?;
        let reply = session::init_reply(&init, opts.uring);
        let sink = classic::FdSink { fd: dev.try_clone().map_err(what)?, session: self.session.clone() };
        match &reply {
            Ok(out) => sink.send(h.unique, 0, out.bytes()),
            Err(_) => sink.send(h.unique, libc::EPROTO, &[]),
        }
        let reply = reply.map_err(|e| file(format!("{}: {e}", self.path.display())))?;
        log::info!(
            "fuse: kernel protocol 7.{}, max_write {} KiB, flags {:#x}",
            init.minor,
            reply.max_write >> 10,
            reply.flags as u64 | (reply.flags2 as u64) << 32
        );
        if opts.uring {
            self.start_rings(dev)?;
        }
        let readers = if opts.uring { 1 } else { opts.readers.max(1) };
        for i in 0..readers {
            let fd = if i == 0 { dev.try_clone() } else { mount::clone_dev(dev) }
                .map_err(|e| file(format!("{}: cannot clone /dev/fuse", self.path.display())).because(e))?;
            let reader = classic::Reader::new(fd, self.session.clone())
                .map_err(|e| file(self.path.display().to_string()).because(e))?;
            let running = Running::start(&self.running);
            let t = std::thread::Builder::new()
                .name(format!("fuse-rd{i}"))
                .spawn(move || {
                    let _running = running;
                    reader.run()
                })
                .map_err(|e| Error::other("cannot start a FUSE thread").because(e))?;
            self.threads.push(t);
        }
        Ok(())
    }

    fn start_rings(&mut self, dev: &Arc<OwnedFd>) -> Result<(), Error> {
        let queues = ring::queue_count();
        let depth = ring::depth(queues);
        log::info!("fuse: {queues} ring queue(s) of {depth} entries");
        for qid in 0..queues {
            let (tx, rx) = std::sync::mpsc::channel();
            let (dev, session, give_up) = (dev.clone(), self.session.clone(), self.give_up.clone());
            let running = Running::start(&self.running);
            let t = std::thread::Builder::new()
                .name(format!("fuse-q{qid}"))
                .spawn(move || {
                    let _running = running;
                    match ring::Queue::start(qid as u16, depth, dev, session, give_up) {
                        Ok((q, sink)) => {
                            let _ = tx.send(Ok(sink));
                            q.run();
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })
                .map_err(|e| Error::other("cannot start a FUSE ring thread").because(e))?;
            self.threads.push(t);
            match rx.recv() {
                Ok(Ok(sink)) => self.wakers.push(sink),
                Ok(Err(e)) => {
                    let hint = if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                        " (FUSE-over-io_uring is off: echo Y > /sys/module/fuse/parameters/enable_uring (as root))"
                    } else {
                        ""
                    };
                    return Err(Error::new(
                        ErrorKind::Ring,
                        format!("{}: registering ring queue {qid} with the kernel failed{hint}", self.path.display()),
                    )
                    .because(e));
                }
                Err(_) => return Err(Error::other("a FUSE ring thread died while starting")),
            }
        }
        Ok(())
    }

    fn remove_created(&self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Unmounts (lazily), lets the threads answer what they took and end,
    /// and removes the file if vdisk created it. A loop device still using
    /// the file keeps the file system alive: then the connection is aborted.
    pub fn stop(mut self) -> Result<(), Error> {
        self.shut()
    }

    fn shut(&mut self) -> Result<(), Error> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let mut result = Ok(());
        match mount::unmount(&self.path) {
            Ok(false) => {}
            Ok(true) => log::warn!(
                "{} was still in use (a loop device? detach it first with losetup -d); its I/O now fails",
                self.path.display()
            ),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => {
                let (p, q) = (self.path.display(), self.path.display());
                result = Err(Error::other(format!("cannot unmount {p} (try: umount -l {q})")).because(e))
            }
        }
        let threads = std::mem::take(&mut self.threads);
        if !self.running.wait_idle_timeout(Duration::from_secs(10)) {
            log::warn!("FUSE threads of {} did not end; leaving them", self.path.display());
            self.give_up.store(true, Ordering::Release);
            self.wakers.iter().for_each(|w| w.wake());
        }
        for t in threads {
            if t.is_finished() {
                let _ = t.join();
            }
        }
        // Requests the engine still holds are answered (into a closed connection) before the device stops.
        self.session.inflight.wait_idle_timeout(Duration::from_secs(10));
        self.remove_created();
        result
    }
}

/// Counts a FUSE thread as running until it ends (returns or panics).
struct Running(Arc<InFlight>);

impl Running {
    fn start(threads: &Arc<InFlight>) -> Running {
        threads.begin(1, 0);
        Running(threads.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.end(1, 0);
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if let Err(e) = self.shut() {
            log::warn!("{}", vdisk_image::Report(&e));
        }
    }
}

#[cfg(test)]
mod tests;
