//! A core worker of the io_uring engine: one thread, one ring, any number of
//! devices (see `core`). Each loop it takes the devices marked ready, round-
//! robin, up to one batch (the device's `batch`) from each, plans and pushes
//! them into the ring, and submits them all with the same `io_uring_enter`
//! that waits for completions; completions are reaped as a batch and
//! delivered per device, grouped by sink. A device with more waiting goes to
//! the back of the ready list, so a flooding neighbour gets one batch per
//! round and a quiet device's requests never wait behind its backlog.
//! The operations themselves (reads, writes, fsyncs, their completions) are
//! in `uring_ops`; this file is the loop, attach/detach and the failure paths.
//!
//! The worker's in-flight table (the engine's one, `flight`, over the ring as
//! its backend, `uring_ops`) owns every request, and with it every buffer and
//! iovec array the kernel may touch, until that operation's completion has
//! been reaped. Files are plain fds, not
//! registered: a shared ring would need a sparse table updated on every
//! attach and detach, for a per-op saving this engine has not needed.
//!
//! Failure, per device: a panic while the worker handles one device's
//! requests (planning, performing, reaping, delivering them), or an injected
//! enter fault naming it, fails THAT device: what the worker holds of it is
//! answered with EIO at once, its operations still in the ring are cancelled
//! (`IORING_OP_ASYNC_CANCEL` by key) and answered with EIO as they are reaped;
//! the worker goes on serving the others. What the kernel has not given back
//! [`ABANDON_WAIT`] after the failure is leaked: the operation's slot stays
//! reserved (its late completion is ignored), its memory and the requests'
//! data are forgotten, never freed, and the requests answered with EIO.
//! Failure of the ring itself (`io_uring_enter` failing for another reason
//! than EINTR or a full completion queue, or a panic outside any device's
//! requests) fails every device on the worker: everything is cancelled and
//! reaped for up to [`ABANDON_WAIT`], the rest leaked with the ring, and the
//! worker, now dead to new devices, answers its devices' requests with EIO
//! until they stop.
//!
//! FLUSH is an `IORING_OP_FSYNC` (datasync) of the written file, not ordered against other
//! operations in the ring: it must cover only writes *completed* before it was
//! submitted, and those are already in the page cache. The image's metadata is
//! synced after the files' fsyncs complete. FUA and sync-mode writes carry
//! `RWF_DSYNC` on their SQE and still run in parallel. Where the kernel may
//! drop that flag (a file on FUSE, see [`crate::sys::on_fuse`]), a durable write is
//! linked to an `IORING_OP_FSYNC` (datasync) of its file, and completes only
//! with that fsync.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use vdisk_image::{Error, Result};

use crate::flight::{Backend, Flight, Lane};
use crate::health::{self, ABANDON_WAIT};
use crate::mailbox::{Command, Inbox, Shared};
use crate::queue::Job;
use crate::ring::Ring;
use crate::uring_ops::{self, DevState, Offload, Uring, UringFlight, CANCEL, DELAY, WAKE};

pub(crate) struct CoreWorker {
    shared: Arc<Shared>,
    pub(crate) f: UringFlight,
    /// Completions taken from the ring; those before `seen` are handled.
    cqes: Vec<(u64, i64)>,
    seen: usize,
    pub(crate) devices: HashMap<u64, DevState>,
    /// Devices whose VDISK_FAULTS rules may inject an enter fault (tests only).
    fault_devs: Vec<u64>,
    /// Devices failed with operations still in the kernel.
    abandoning: Vec<u64>,
    ready: VecDeque<u64>,
    inbox: Inbox,
    /// Taken from the current device's queue, not yet in the ring.
    new: Vec<Job>,
    /// The device whose requests the worker is handling (a panic fails it).
    current: Option<u64>,
    /// Devices touched by the current reap.
    pub(crate) touched: Vec<u64>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    /// The core asked this worker to stop (see [`crate::Core::stop`]); set once it has.
    stop: Option<Arc<crate::mailbox::Detached>>,
}

impl CoreWorker {
    /// Starts a worker thread with its ring, for `shared`.
    pub fn spawn(shared: Arc<Shared>, entries: u32) -> std::io::Result<std::thread::JoinHandle<()>> {
        let ring = IoUring::builder().setup_cqsize(entries * 4).build(entries)?;
        let name = shared.name.clone();
        std::thread::Builder::new().name(name).spawn(move || {
            let _ = shared.thread.set(std::thread::current().id());
            let w = CoreWorker {
                shared,
                f: Flight::new(Uring::new(Ring::new(ring, None))),
                cqes: Vec::new(),
                seen: 0,
                devices: HashMap::new(),
                fault_devs: Vec::new(),
                abandoning: Vec::new(),
                ready: VecDeque::new(),
                inbox: Inbox::default(),
                new: Vec::new(),
                current: None,
                touched: Vec::new(),
                wake_buf: Box::new(0),
                wake_armed: false,
                stop: None,
            };
            w.run()
        })
    }

    fn run(mut self) {
        loop {
            let cause = match catch_unwind(AssertUnwindSafe(|| self.serve())) {
                Ok(Ok(())) => {
                    // Stopped by its core: nothing may stay in the ring that is not answered.
                    self.shared.dead.store(true, Ordering::SeqCst);
                    self.drain_all(format!("its I/O core stopped ({})", self.shared.name));
                    if let Some(stopped) = self.stop.take() {
                        stopped.set();
                    }
                    return self.serve_dead();
                }
                Ok(Err(e)) => format!("its io_uring queue ({}) failed: {e}", self.shared.name),
                Err(p) => {
                    let cause = format!("its requests on {} hit a {}", self.shared.name, health::panic_message(&*p));
                    if let Some(id) = self.current.take() {
                        // One device's handling panicked: it fails, the others go on.
                        if catch_unwind(AssertUnwindSafe(|| self.fail_device(id, cause.clone()))).is_ok() {
                            continue;
                        }
                    }
                    cause
                }
            };
            self.ring_failed(cause);
            return self.serve_dead();
        }
    }

    fn serve(&mut self) -> std::io::Result<()> {
        self.shared.idle.store(false, Ordering::SeqCst);
        if !self.wake_armed {
            self.arm_wake()?;
        }
        loop {
            self.take_inbox();
            if self.stop.is_some() {
                return Ok(());
            }
            self.serve_round()?;
            // About to sleep in the kernel: say so, then look once more so no
            // push is missed. While we sleep a push wakes us through the eventfd.
            let mut wait = self.ready.is_empty();
            if wait {
                self.shared.idle.store(true, Ordering::SeqCst);
                let inbox = self.shared.inbox.lock().unwrap();
                if !inbox.ready.is_empty() || !inbox.commands.is_empty() {
                    wait = false;
                }
            }
            self.inject_enter_faults();
            if wait && !self.abandoning.is_empty() {
                self.f.backend.ring.wait_for(Duration::from_millis(50))?;
            } else {
                self.f.backend.ring.enter(wait)?;
            }
            self.shared.idle.store(false, Ordering::SeqCst);
            self.reap()?;
            self.check_abandoned();
        }
    }

    /// Takes what producers and the control path left: new devices first, then
    /// the devices that became ready, behind those already waiting their turn.
    fn take_inbox(&mut self) {
        {
            let mut inbox = self.shared.inbox.lock().unwrap();
            std::mem::swap(&mut *inbox, &mut self.inbox);
        }
        for c in self.inbox.commands.drain(..) {
            match c {
                Command::Attach { id, planner, queue, attachment, detached, batch } => {
                    if planner.faults.is_some() {
                        self.fault_devs.push(id);
                    }
                    let d = DevState {
                        lane: Lane::new(*planner, Some(queue.clone())),
                        queue,
                        attachment,
                        detached,
                        batch,
                        closed: false,
                        failed_at: None,
                        touched: false,
                        offload: None,
                    };
                    self.devices.insert(id, d);
                }
                Command::Stop { stopped } => self.stop = Some(stopped),
            }
        }
        self.ready.extend(self.inbox.ready.drain(..));
    }

    /// One round-robin pass over the devices ready now: up to one batch each.
    fn serve_round(&mut self) -> std::io::Result<()> {
        for _ in 0..self.ready.len() {
            let Some(id) = self.ready.pop_front() else { break };
            let Some(d) = self.devices.get_mut(&id) else { continue };
            let att = d.attachment.clone();
            // Cleared before the take: a push after it marks the device ready again.
            att.ready.store(false, Ordering::SeqCst);
            self.current = Some(id);
            let open = d.queue.try_take(d.batch, &mut self.new);
            if !self.new.is_empty() {
                d.lane.planner.refresh();
                if crate::blocking_image(&*d.lane.planner.image) {
                    // Switched onto a target that is not a file (a mirror's pivot onto
                    // RBD or NBD): its blocking calls, on the device's own thread.
                    if d.offload.is_none() {
                        let (q, a) = (d.queue.clone(), d.attachment.clone());
                        match Offload::start(&self.shared.name, q, d.lane.planner.clone(), a) {
                            Ok(o) => d.offload = Some(o),
                            Err(e) => d.queue.health().fail(format!("no thread for its blocking calls ({e})")),
                        }
                    }
                    let jobs = std::mem::take(&mut self.new);
                    let sent = match &d.offload {
                        Some(o) => o.send(jobs),
                        None => Err(jobs),
                    };
                    if let Err(mut back) = sent {
                        if !d.failed() {
                            d.queue.health().fail("the thread of its blocking calls is gone".to_owned());
                        }
                        d.queue.fail(&mut back);
                    }
                } else {
                    self.f.start(&mut d.lane, id, &mut self.new)?;
                }
            }
            d.lane.settle();
            d.queue.deliver(&mut d.lane.done);
            if d.queue.has_jobs() && !att.ready.swap(true, Ordering::SeqCst) {
                self.ready.push_back(id);
            }
            d.closed |= !open;
            self.current = None;
            self.maybe_detach(id);
        }
        Ok(())
    }

    /// Lets go of a stopped device once nothing of it is in flight.
    pub(crate) fn maybe_detach(&mut self, id: u64) {
        let Some(d) = self.devices.get(&id) else { return };
        let away = d.offload.as_ref().is_some_and(|o| o.away.load(Ordering::SeqCst) > 0);
        if d.lane.in_flight > 0 || away || !d.lane.done.is_empty() || !(d.closed || d.queue.is_drained()) {
            return;
        }
        let d = self.devices.remove(&id).expect("present");
        self.fault_devs.retain(|&x| x != id);
        self.abandoning.retain(|&x| x != id);
        self.shared.load.fetch_sub(1, Ordering::SeqCst);
        d.detached.set();
    }

    fn arm_wake(&mut self) -> std::io::Result<()> {
        let read = opcode::Read::new(types::Fd(self.shared.efd.fd()), (&mut *self.wake_buf as *mut u64).cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: wake_buf is a heap u64 owned by this worker, which lives as
        // long as the process (or leaks the buffer with the ring).
        unsafe { self.f.backend.ring.push(&read)? };
        self.wake_armed = true;
        Ok(())
    }

    /// Handles every completion there is, then delivers per device.
    fn reap(&mut self) -> std::io::Result<()> {
        self.f.backend.reap(&mut self.cqes);
        while self.seen < self.cqes.len() {
            let (ud, res) = self.cqes[self.seen];
            self.seen += 1;
            match ud {
                WAKE => {
                    self.wake_armed = false;
                    self.arm_wake()?;
                }
                CANCEL | DELAY => {}
                op => {
                    let Some(id) = self.f.device_of(op) else { continue };
                    let Some(d) = self.devices.get_mut(&id) else { continue };
                    if !d.touched {
                        d.touched = true;
                        self.touched.push(id);
                    }
                    self.current = Some(id);
                    self.f.completed(&mut d.lane, op, res);
                    self.current = None;
                }
            }
        }
        self.cqes.clear();
        self.seen = 0;
        while let Some(id) = self.touched.pop() {
            let Some(d) = self.devices.get_mut(&id) else { continue };
            d.touched = false;
            self.current = Some(id);
            // One metadata sync for every durable write of the device this reap finished.
            d.lane.settle();
            d.queue.deliver(&mut d.lane.done);
            self.current = None;
            self.maybe_detach(id);
        }
        Ok(())
    }

    /// Injected `enter#N` faults (tests only): a failing enter fails the device it names.
    fn inject_enter_faults(&mut self) {
        for i in 0..self.fault_devs.len() {
            let id = self.fault_devs[i];
            let Some(d) = self.devices.get(&id) else { continue };
            let fault = d.lane.planner.faults.as_ref().and_then(|f| f.check_enter());
            if let Some(crate::faults::EnterFault::Fail(errno)) = fault {
                let e = std::io::Error::from_raw_os_error(errno);
                let cause = format!("its io_uring queue failed: io_uring_enter: {e} (injected by VDISK_FAULTS)");
                self.fail_device(id, cause);
            }
        }
    }

    /// Fails device `id`: answers what the worker holds of it with EIO and
    /// cancels what it has in the ring (answered as it is reaped).
    fn fail_device(&mut self, id: u64, cause: String) {
        let Some(d) = self.devices.get_mut(&id) else { return };
        d.queue.health().fail(cause);
        d.failed_at.get_or_insert_with(Instant::now);
        let mut held: Vec<Job> = self.new.drain(..).collect();
        held.append(&mut d.lane.done);
        d.lane.owed.clear();
        d.queue.fail(&mut held);
        self.f.cancel_device(&mut d.lane, id);
        d.queue.deliver(&mut d.lane.done);
        if d.lane.in_flight > 0 {
            self.abandoning.push(id);
        }
        // A stopping device may now be done.
        self.maybe_detach(id);
    }

    /// Leaks what failed devices still have in the kernel [`ABANDON_WAIT`] after their failure.
    fn check_abandoned(&mut self) {
        let now = Instant::now();
        for id in std::mem::take(&mut self.abandoning) {
            let Some(d) = self.devices.get_mut(&id) else { continue };
            if d.lane.in_flight == 0 {
                self.maybe_detach(id);
            } else if d.failed_at.is_some_and(|t| now >= t + ABANDON_WAIT) {
                let (held, ops) = self.f.leak_device(&mut d.lane, id);
                uring_ops::leaked(d, held, ops);
                self.maybe_detach(id);
            } else {
                self.abandoning.push(id);
            }
        }
    }

    /// The ring failed: every device fails; what the kernel gives back within
    /// [`ABANDON_WAIT`] is answered and freed, the rest leaked with the ring.
    fn ring_failed(&mut self, cause: String) {
        self.shared.dead.store(true, Ordering::SeqCst);
        self.drain_all(cause);
    }

    /// Every device on the worker fails with `cause`; everything in the ring
    /// is cancelled and reaped for up to [`ABANDON_WAIT`]; what the kernel
    /// has not given back by then is leaked, with the ring.
    fn drain_all(&mut self, cause: String) {
        self.current = None;
        let ids: Vec<u64> = self.devices.keys().copied().collect();
        let _ = catch_unwind(AssertUnwindSafe(|| {
            for &id in &ids {
                self.fail_device(id, cause.clone());
            }
            // Completions taken but not handled: their operations are over.
            let unseen: Vec<(u64, i64)> = self.cqes.drain(self.seen..).collect();
            self.cqes.clear();
            self.seen = 0;
            self.settle_completions(unseen);
            let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(CANCEL);
            // SAFETY: a cancel refers to no memory.
            let _ = unsafe { self.f.backend.ring.push(&cancel) };
            if self.wake_armed {
                self.shared.efd.wake();
            }
            let deadline = Instant::now() + ABANDON_WAIT;
            while (!self.f.ops.is_empty() || self.wake_armed) && Instant::now() < deadline {
                if self.f.backend.ring.wait_for(Duration::from_millis(20)).is_err() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let mut got = Vec::new();
                self.f.backend.reap(&mut got);
                self.settle_completions(got);
            }
        }));
        if !self.f.ops.is_empty() || self.wake_armed {
            log::error!(
                "{}: {} operation(s) still in the kernel {ABANDON_WAIT:?} after its ring failed; their memory and \
                 the ring are leaked, never freed",
                self.shared.name,
                self.f.ops.len()
            );
            for id in ids {
                if let Some(d) = self.devices.get_mut(&id) {
                    let (held, ops) = self.f.leak_device(&mut d.lane, id);
                    uring_ops::leaked(d, held, ops);
                }
            }
            self.f.backend.leaked = true;
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }

    /// After the ring failed: each completion ends its operation; its
    /// requests (of failed devices) are answered once all of theirs are back.
    fn settle_completions(&mut self, cqes: Vec<(u64, i64)>) {
        for (ud, res) in cqes {
            match ud {
                WAKE => self.wake_armed = false,
                CANCEL | DELAY => {}
                op => {
                    let Some(id) = self.f.device_of(op) else { continue };
                    if let Some(d) = self.devices.get_mut(&id) {
                        self.f.completed(&mut d.lane, op, res);
                        d.queue.deliver(&mut d.lane.done);
                    }
                }
            }
        }
    }

    /// A worker whose ring failed: answers its devices' requests with EIO
    /// (their queues do, being failed) and lets each go once it stops.
    fn serve_dead(mut self) {
        // SAFETY: fcntl on the worker's own eventfd, with integer arguments only.
        unsafe { libc::fcntl(self.shared.efd.fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let cause = format!("its io_uring queue ({}) failed earlier", self.shared.name);
        loop {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                self.take_inbox();
                if let Some(stopped) = self.stop.take() {
                    // Dead already: nothing is in its ring.
                    stopped.set();
                }
                let ids: Vec<u64> = self.ready.drain(..).collect();
                let news: Vec<u64> = self.devices.iter().filter(|(_, d)| !d.failed()).map(|(&id, _)| id).collect();
                for id in news {
                    if let Some(d) = self.devices.get(&id) {
                        d.queue.health().fail(cause.clone());
                    }
                }
                for id in ids {
                    let Some(d) = self.devices.get_mut(&id) else { continue };
                    d.attachment.ready.store(false, Ordering::SeqCst);
                    let mut none = Vec::new();
                    d.closed |= !d.queue.try_take(1, &mut none);
                    if d.queue.has_jobs() {
                        self.ready.push_back(id);
                    }
                    self.maybe_detach(id);
                }
            }));
            self.shared.idle.store(true, Ordering::SeqCst);
            let mut pfd = libc::pollfd { fd: self.shared.efd.fd(), events: libc::POLLIN, revents: 0 };
            let timeout = if self.ready.is_empty() { 100 } else { 0 };
            // SAFETY: one valid pollfd on the worker's own eventfd.
            unsafe { libc::poll(&mut pfd, 1, timeout) };
            self.shared.efd.drain();
            self.shared.idle.store(false, Ordering::SeqCst);
        }
    }
}

/// Whether this kernel can run the ring engine.
pub fn probe() -> Result<()> {
    IoUring::new(8).map(|_| ()).map_err(|e| Error::io(e, "io_uring is not available"))
}
