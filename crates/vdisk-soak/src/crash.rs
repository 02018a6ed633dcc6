//! Crash rounds: several connections write generation-tagged blocks with
//! FLUSH and FUA mixed in, the server is killed with SIGKILL at a random
//! moment, restarted, and the whole disk is read back and judged
//! (`check::verify`). The record of what was acknowledged and what a
//! completed FLUSH covered lives here, in the soak process, never in the
//! server.
//!
//! Power-loss rounds (`--power-loss`) put the images on a
//! [`power::Storage`] mounted by this process: a FUSE file system
//! that keeps only what was fsynced. The power is cut (the storage dies
//! first, at a random moment or when a random FSYNC arrives; then the server
//! is killed), the storage comes back with only its durable state, or with a
//! random part of the unsynced writes too, and the server restarts on that.
//! There, only flushed, FUA and `--sync` writes must survive, on every image.
//!
//! What must survive: every write acknowledged before a FLUSH that
//! completed, every acknowledged FUA write, every acknowledged write in
//! `--sync` mode. On a raw image every acknowledged write survives a process
//! crash (it is in the host page cache once acknowledged; the server holds
//! no written data of its own), and the round checks that too. A COW
//! overlay's unflushed writes may be lost (their bitmap bits may not have
//! reached the file), never invented; so may a qcow2 overlay's (their L2
//! entries), and after every kill `qemu-img check` must find no corruption
//! in it (leaked clusters are allowed).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::check::{self, BlockLog};
use super::live::{self, LiveStats};
use super::power;
use super::server::Served;
use super::Rng;
use vdisk_nbd::client::{Client as Conn, Cmd, FUA};

/// Blocks are 1000 bytes: not sector-aligned, so neighbours share sectors.
const BS: usize = 1000;
/// With `--direct`, blocks are 4 KiB, so writes take the O_DIRECT path.
const DIRECT_BS: usize = 4096;
const DISK: usize = 4 << 20;
const CONNECTIONS: usize = 4;
const DEPTH: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Cow,
    Qcow2,
}

impl Format {
    /// The `--format` value that serves it.
    fn arg(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Cow => "cow",
            Format::Qcow2 => "qcow2",
        }
    }
}

/// How a round ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// SIGKILL; the host's page cache keeps everything written.
    Kill,
    /// Power cut: only what was fsynced survives.
    PowerLoss,
    /// Power cut: what was fsynced survives, and a random part of the rest.
    PowerLossPartial,
    /// Alternating between the two kinds of power cut.
    PowerLossMixed,
}

/// One cell of the matrix: an image that lives through many rounds.
struct Combo {
    format: Format,
    engine: String,
    sync: bool,
    /// `--direct` (power-loss rounds only: tmpfs has no O_DIRECT).
    direct: bool,
    /// Block size: BS, or DIRECT_BS with `--direct`.
    bs: usize,
    dir: PathBuf,
    /// The power-loss storage the images live on, if any.
    storage: Option<power::Storage>,
    image: PathBuf,
    /// The COW overlay's backing file and its bytes (never to change).
    base: Option<(PathBuf, Vec<u8>)>,
    /// The disk as read after the last round.
    prior: Vec<u8>,
    /// Next generation per block, across rounds.
    gens: Vec<u64>,
    /// With `--jobs`: the chain the live operations change.
    live: Option<live::Chain>,
}

impl Combo {
    fn name(&self) -> String {
        let mode = if self.sync {
            "/sync"
        } else if self.direct {
            "/direct"
        } else {
            ""
        };
        format!("{:?}/{}{mode}", self.format, self.engine).to_lowercase()
    }

    /// The file the server is started on: the top of the chain.
    fn top(&self) -> &Path {
        self.live.as_ref().map_or(&self.image, |l| l.top())
    }

    /// The `--format` of the top.
    fn top_format(&self) -> &'static str {
        match &self.live {
            Some(l) if l.top().extension().is_some_and(|e| e == "qcow2") => "qcow2",
            // A mirror's raw target, under any combination.
            Some(l) if l.top().extension().is_some_and(|e| e == "raw") => "raw",
            _ => self.format.arg(),
        }
    }
}

/// What the rounds cycle through, and what they run beside the writers.
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub formats: &'a [Format],
    pub engines: &'a [String],
    pub ending: Ending,
    pub jobs: &'a Jobs,
}

/// What `--jobs` asks the rounds to run beside the writers.
#[derive(Debug, Clone, Default)]
pub struct Jobs {
    pub ops: Vec<live::Op>,
    /// Keep a dirty bitmap on the top through the rounds.
    pub bitmaps: bool,
}

#[derive(Default, Debug, Clone)]
pub struct CrashReport {
    pub rounds: usize,
    pub writes_sent: u64,
    pub writes_acked: u64,
    pub flushes: u64,
    /// Blocks that had to hold a particular generation after a round, summed over rounds.
    pub checked_blocks: u64,
    /// Power cuts made when an FSYNC arrived (the others came at a random moment).
    pub cuts_at_fsync: u64,
    pub elapsed: Duration,
    /// What the live operations (`--jobs`) did.
    pub live: LiveStats,
}

/// What the connections of one round share.
struct Round {
    salt: u64,
    /// Block size of this combination.
    bs: usize,
    sync: bool,
    gens: Vec<u64>,
    busy: Vec<bool>,
    logs: Vec<BlockLog>,
    /// Last acknowledged generation per block.
    acked: Vec<u64>,
    /// Every acknowledgement of a write, in the order they arrived.
    acks: Vec<(usize, u64)>,
    /// `acks[..covered]` are durable: a FLUSH sent after them completed.
    covered: usize,
    sent: u64,
    done: u64,
    flushes: u64,
}

/// What one in-flight request was.
enum Sent {
    Write { block: usize, gen: u64, fua: bool },
    Flush { upto: usize },
}

impl Round {
    fn pick(&mut self, rng: &mut Rng) -> (Cmd, u16, Sent, u64) {
        let r = rng.below(1000);
        if r < 40 {
            return (Cmd::Flush, 0, Sent::Flush { upto: self.acks.len() }, 0);
        }
        let nblocks = self.logs.len();
        let mut block = rng.below(nblocks as u64) as usize;
        while self.busy[block] {
            block = rng.below(nblocks as u64) as usize;
        }
        self.busy[block] = true;
        self.gens[block] += 1;
        let gen = self.gens[block];
        let cmd = match r {
            40..=99 => Cmd::Zero,
            100..=139 => Cmd::Trim,
            _ => Cmd::Write,
        };
        let fua = rng.below(20) == 0;
        self.logs[block].attempts.push((gen, cmd != Cmd::Write));
        self.sent += 1;
        (cmd, if fua { FUA } else { 0 }, Sent::Write { block, gen, fua }, (block * self.bs) as u64)
    }

    fn acknowledged(&mut self, sent: Sent) {
        match sent {
            Sent::Write { block, gen, fua } => {
                self.busy[block] = false;
                self.acked[block] = gen;
                self.acks.push((block, gen));
                self.done += 1;
                if fua || self.sync {
                    let f = &mut self.logs[block].floor;
                    *f = (*f).max(gen);
                }
            }
            Sent::Flush { upto } => {
                self.flushes += 1;
                for &(block, gen) in self.acks.get(self.covered..upto).unwrap_or(&[]) {
                    let f = &mut self.logs[block].floor;
                    *f = (*f).max(gen);
                }
                self.covered = self.covered.max(upto);
            }
        }
    }
}

/// One connection's writer: keeps DEPTH requests in flight until the server
/// goes away. Returns an error only for what a live server must never do
/// (an error reply, a malformed reply).
fn writer(
    socket: &Path,
    round: &Mutex<Round>,
    connected: &AtomicUsize,
    seed: u64,
    power: Option<&power::Probe>,
) -> Result<(), String> {
    let mut conn = Conn::connect(socket, "", Duration::from_secs(30)).map_err(|e| format!("connect: {e}"))?;
    connected.fetch_add(1, Ordering::SeqCst);
    let mut rng = Rng::new(seed);
    let mut inflight: HashMap<u64, Sent> = HashMap::new();
    let (salt, bs) = {
        let r = round.lock().unwrap();
        (r.salt, r.bs)
    };
    let mut payload = vec![0u8; bs];
    let gone = |e: std::io::Error| -> Result<(), String> {
        if e.kind() == std::io::ErrorKind::InvalidData {
            Err(format!("malformed reply: {e}"))
        } else {
            Ok(()) // The server was killed.
        }
    };
    loop {
        while conn.in_flight() < DEPTH {
            let (cmd, flags, sent, offset) = round.lock().unwrap().pick(&mut rng);
            let r = match (&sent, cmd) {
                (Sent::Flush { .. }, _) => conn.send(Cmd::Flush, 0, 0, 0, &[]),
                (Sent::Write { block, gen, .. }, Cmd::Write) => {
                    check::content(salt, *block as u64, *gen, &mut payload);
                    conn.send(cmd, flags, offset, bs as u32, &payload)
                }
                _ => conn.send(cmd, flags, offset, bs as u32, &[]),
            };
            match r {
                Ok(cookie) => {
                    inflight.insert(cookie, sent);
                }
                Err(e) => return gone(e),
            }
        }
        let reply = match conn.recv() {
            Ok(r) => r,
            Err(e) => return gone(e),
        };
        let sent = inflight.remove(&reply.cookie).ok_or("reply to a request never sent")?;
        if reply.error != 0 {
            if power.is_some_and(|p| p.is_dead()) {
                // The storage lost power: errors from here on are expected, and never acknowledge anything.
                return Ok(());
            }
            let what = match sent {
                Sent::Flush { .. } => "FLUSH".to_owned(),
                Sent::Write { block, gen, .. } => format!("write of block {block} generation {gen}"),
            };
            return Err(format!("{what} failed with NBD error {}", reply.error));
        }
        round.lock().unwrap().acknowledged(sent);
    }
}

fn setup(
    root: &Path,
    format: Format,
    engine: &str,
    (sync, direct): (bool, bool),
    power: bool,
    salt: u64,
    jobs: &Jobs,
) -> Result<Combo, String> {
    let mode = if sync {
        "-sync"
    } else if direct {
        "-direct"
    } else {
        ""
    };
    let tag = format!("{format:?}-{engine}{mode}").to_lowercase();
    let dir = root.join(tag);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let storage = if power {
        let mnt = dir.join("mnt");
        let s = power::Storage::mount(&mnt)
            .map_err(|e| format!("cannot mount the power-loss storage on {}: {e}", mnt.display()))?;
        Some(s)
    } else {
        None
    };
    // The server's socket and log stay in `dir`; the images go on the storage.
    let images = storage.as_ref().map_or(dir.clone(), |s| s.mountpoint().to_owned());
    let mut bytes = vec![0u8; DISK];
    check::content(salt, u64::MAX, 0, &mut bytes);
    let write = |p: &Path, b: &[u8]| std::fs::write(p, b).map_err(|e| format!("cannot write {}: {e}", p.display()));
    let (image, base) = match format {
        Format::Raw => {
            let image = images.join("crash.img");
            write(&image, &bytes)?;
            (image, None)
        }
        Format::Cow | Format::Qcow2 => {
            let base = images.join("base.img");
            write(&base, &bytes)?;
            let image = create_overlay(&images, &base, format, (sync, direct))?;
            (image, Some((base, bytes.clone())))
        }
    };
    if let Some(s) = &storage {
        s.sync_all();
    }
    let bs = if direct { DIRECT_BS } else { BS };
    let nblocks = DISK / bs - 10;
    let live = (!jobs.ops.is_empty() || jobs.bitmaps).then(|| {
        let mut layers = vec![image.clone()];
        layers.extend(base.as_ref().map(|(b, _)| b.clone()));
        live::Chain::new(&images, &dir.join("scratch"), layers, &jobs.ops, jobs.bitmaps)
    });
    Ok(Combo {
        format,
        engine: engine.to_owned(),
        sync,
        direct,
        bs,
        dir,
        storage,
        image,
        base,
        prior: bytes,
        gens: vec![0; nblocks],
        live,
    })
}

/// An overlay of `format` (cow or qcow2) over `base`, made by `vdisk create`.
fn create_overlay(images: &Path, base: &Path, format: Format, (sync, direct): (bool, bool)) -> Result<PathBuf, String> {
    let (image, fmt) =
        if format == Format::Cow { (images.join("crash.cow"), "cow") } else { (images.join("crash.qcow2"), "qcow2") };
    let _ = std::fs::remove_file(&image);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // qcow2 with --sync gets 512-byte clusters: many L2 tables and refcount
    // blocks, and a refcount table that has to move as the file grows.
    // With --direct, 4 KiB clusters: every (4 KiB) block is a whole
    // cluster, written into a cluster of its own without a fill, and
    // new clusters keep coming for many rounds (with the default 64 KiB
    // the 4 MiB disk is all allocated after a round or two, and the
    // order of data and L2 entries is no longer put to the test).
    let mut args = vec!["create", "--format", fmt];
    if format == Format::Qcow2 && sync {
        args.extend(["--cluster-size", "512"]);
    } else if format == Format::Qcow2 && direct {
        args.extend(["--cluster-size", "4096"]);
    }
    let out = std::process::Command::new(exe)
        .args(args)
        .arg("--backing")
        .arg(base)
        .arg(&image)
        .output()
        .map_err(|e| format!("cannot run vdisk create: {e}"))?;
    if !out.status.success() {
        return Err(format!("vdisk create --backing failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(image)
}

/// Runs one round on `combo`; returns what it checked.
fn round(c: &mut Combo, salt: u64, partial: bool, rng: &mut Rng, report: &mut CrashReport) -> Result<(), String> {
    let control = c.dir.join("soak-ctl.sock");
    let control_arg = control.to_string_lossy().into_owned();
    let mut args = vec!["--engine", c.engine.as_str(), "--format", c.top_format()];
    if c.live.is_some() {
        args.extend(["--control", control_arg.as_str()]);
    }
    if c.sync {
        args.push("--sync");
    }
    if c.direct {
        args.push("--direct");
    }
    let probe = c.storage.as_ref().map(|s| s.probe());
    if let Some(s) = &c.storage {
        // Half the rounds the storage answers OPEN with FOPEN_DIRECT_IO, as
        // libfuse's direct_io does: then no RWF_DSYNC write brings an FSYNC.
        s.set_direct_io(rng.below(2) == 0);
    }
    let server = Served::start(&c.dir, &[c.top().to_owned()], &args)?;
    let nblocks = c.gens.len();
    let state = Arc::new(Mutex::new(Round {
        salt,
        bs: c.bs,
        sync: c.sync,
        gens: std::mem::take(&mut c.gens),
        busy: vec![false; nblocks],
        logs: vec![BlockLog::default(); nblocks],
        acked: vec![0; nblocks],
        acks: Vec::new(),
        covered: 0,
        sent: 0,
        done: 0,
        flushes: 0,
    }));
    let connected = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..CONNECTIONS)
        .map(|i| {
            let (socket, state, connected) = (server.socket.clone(), state.clone(), connected.clone());
            let seed = rng.next() ^ i as u64;
            let probe = probe.clone();
            std::thread::spawn(move || writer(&socket, &state, &connected, seed, probe.as_ref()))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while connected.load(Ordering::SeqCst) < CONNECTIONS && threads.iter().any(|t| !t.is_finished()) {
        if Instant::now() > deadline {
            return Err(format!("the writers could not connect within 30 s{}", server.log_tail()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let driver = c.live.as_ref().map(|l| {
        let probe = probe.clone();
        live::Driver::start(l, &control, &server.socket, rng.next(), move || {
            probe.as_ref().is_none_or(|p| !p.is_dead())
        })
    });
    let (tail, alive) = end_round(c, &server, partial, rng, report);
    let dead = c.storage.as_ref().is_some_and(|s| s.is_dead());
    server.kill();
    let drove = driver.map(live::Driver::finish).transpose()?;
    for t in threads {
        t.join().map_err(|_| "a writer thread panicked".to_owned())?.map_err(|e| format!("{e}{tail}"))?;
    }
    if !alive {
        return Err(format!("the server died before it was killed{tail}"));
    }
    let failed = drove.as_ref().filter(|d| !dead || d.error_while_powered);
    if let Some(e) = failed.and_then(|d| d.error.as_ref()) {
        return Err(format!("a live operation failed: {e}{tail}"));
    }
    let mut st = Arc::try_unwrap(state).ok().expect("writers are done").into_inner().unwrap();
    if let Some(s) = c.storage.as_mut() {
        s.restart().map_err(|e| format!("cannot bring the storage back: {e}"))?;
    }
    c.gens = std::mem::take(&mut st.gens);
    let mut note = String::new();
    if let (Some(chain), Some(d)) = (c.live.as_mut(), drove) {
        note = live::after_cut(chain, d, &mut report.live)?;
    } else if c.format == Format::Qcow2 {
        qemu_img_check(&c.image)?;
    }
    // A raw image still its own chain (with --jobs: no snapshot became its
    // top this round) got every write of the round.
    let raw_alone = c.live.as_ref().is_none_or(|l| l.layers.len() == 1 && l.top() == c.image);
    if c.storage.is_none() && c.format == Format::Raw && raw_alone {
        // What was acknowledged is in the page cache, which a process crash leaves alone.
        for (log, &acked) in st.logs.iter_mut().zip(&st.acked) {
            log.floor = log.floor.max(acked);
        }
    }
    let now = read_back(c, salt, &st.logs, &mut report.live).map_err(|e| format!("{e}{note}"))?;
    c.prior = now;
    report.writes_sent += st.sent;
    report.writes_acked += st.done;
    report.flushes += st.flushes;
    report.checked_blocks += st.logs.iter().filter(|l| l.floor > 0).count() as u64;
    Ok(())
}

/// Waits a few milliseconds to 200 ms into the writing, then ends the round:
/// the power cut (storage first) if the images are on the power-loss
/// storage, which half the time comes instead with one of the first FSYNCs
/// it sees, when the most data is waiting for it; the caller then kills the
/// server. Returns the server's log tail and whether it was still alive.
fn end_round(c: &Combo, server: &Served, partial: bool, rng: &mut Rng, report: &mut CrashReport) -> (String, bool) {
    let survival = if partial { power::Survival::Random(rng.next()) } else { power::Survival::Nothing };
    let probe = c.storage.as_ref().map(|s| s.probe());
    if let Some(s) = c.storage.as_ref().filter(|_| rng.below(2) == 0) {
        // A qcow2 metadata round syncs up to four times (data, refcounts, L2
        // tables, the rest): its cut waits for one of more FSYNCs, or the
        // round would end before a FLUSH or FUA write had a chance to be acknowledged.
        let span = if c.format == Format::Qcow2 { 32 } else { 8 };
        s.cut_at_fsync(1 + rng.below(span), survival);
    }
    // With live operations, up to 600 ms: long enough for a snapshot and a
    // paced job to start (and often end) before the cut.
    let span = if c.live.is_some() { 597_000 } else { 197_000 };
    let wait = Duration::from_micros(3_000 + rng.below(span));
    let started = Instant::now();
    while started.elapsed() < wait && !probe.as_ref().is_some_and(|p| p.is_dead()) {
        std::thread::sleep(Duration::from_micros(500));
    }
    let tail = server.log_tail();
    let alive = std::fs::metadata(format!("/proc/{}", server.pid())).is_ok();
    if let Some(s) = &c.storage {
        if s.is_dead() {
            report.cuts_at_fsync += 1;
        }
        s.cut(survival);
    }
    (tail, alive)
}

/// Restarts the server on what survived, reads the whole disk back and
/// judges it against `logs`; the backing file of an overlay must not have changed.
fn read_back(c: &mut Combo, salt: u64, logs: &[BlockLog], stats: &mut LiveStats) -> Result<Vec<u8>, String> {
    let control = c.dir.join("soak-ctl.sock");
    let control_arg = control.to_string_lossy().into_owned();
    let mut args = vec!["--engine", c.engine.as_str()];
    if c.live.is_some() {
        args.extend(["--control", control_arg.as_str()]);
    }
    let (server, now, judged) = loop {
        let server = match Served::start(&c.dir, &[c.top().to_owned()], &args) {
            Ok(s) => s,
            // A mirror's target after an unanswered pivot that does not serve
            // was not pivoted to: the old chain.
            Err(e) => {
                let fell_back = match c.live.as_mut() {
                    Some(chain) => chain.fall_back(stats)?,
                    None => false,
                };
                if fell_back {
                    continue;
                }
                return Err(e);
            }
        };
        let now = Conn::connect(&server.socket, "", Duration::from_secs(30))
            .and_then(|mut conn| conn.read_all(0, DISK as u64))
            .map_err(|e| format!("reading the disk back after the crash: {e}{}", server.log_tail()))?;
        let judged = check::verify(salt, c.bs, &c.prior, &now, logs);
        // Cut after a mirror's pivot was asked, before it was seen done: the
        // target was tried first; without every flushed write, the old chain.
        if let Some(chain) = c.live.as_mut() {
            if judged.is_ok() {
                chain.judged(stats);
            } else if chain.fall_back(stats)? {
                server.stop()?;
                continue;
            }
        }
        break (server, now, judged);
    };
    if let (Ok(()), Some(chain)) = (&judged, c.live.as_mut()) {
        live::after_read(chain, &control, &server.socket, &now, stats)
            .map_err(|e| format!("{e}{}", server.log_tail()))?;
    }
    server.stop()?;
    judged?;
    if let Some((base, bytes)) = c.base.as_ref().filter(|_| c.live.is_none()) {
        if std::fs::read(base).map_err(|e| e.to_string())? != *bytes {
            return Err(format!("the backing file {} changed", base.display()));
        }
    }
    Ok(now)
}

/// `qemu-img check` on a qcow2 image just after a crash: exit 0 (clean) or 3
/// (leaked clusters only) pass; corruption or a failed check is the round's error.
fn qemu_img_check(image: &Path) -> Result<(), String> {
    live::qemu_img_check(image)
}

/// Runs `rounds` crash rounds over every combination of `formats`, `engines`
/// and sync mode (normal, `--sync`), one after the other, in `root`.
/// With power loss, `--direct` is a third mode beside normal and `--sync`.
pub fn run(root: &Path, rounds: usize, m: &Matrix, seed: u64, progress: bool) -> Result<CrashReport, String> {
    let Matrix { formats, engines, ending, jobs } = *m;
    let started = Instant::now();
    let mut rng = Rng::new(seed);
    let salt = rng.next();
    let power = ending != Ending::Kill;
    let modes: &[(bool, bool)] =
        if power { &[(false, false), (true, false), (false, true)] } else { &[(false, false), (true, false)] };
    let mut combos = Vec::new();
    for &format in formats {
        for engine in engines {
            for &mode in modes {
                combos.push(setup(root, format, engine, mode, power, salt, jobs)?);
            }
        }
    }
    let mut report = CrashReport::default();
    for i in 0..rounds {
        let n = combos.len();
        let c = &mut combos[i % n];
        let partial = match ending {
            Ending::PowerLossPartial => true,
            Ending::PowerLossMixed => (i / n) % 2 == 1,
            Ending::Kill | Ending::PowerLoss => false,
        };
        let what = if partial {
            ", power cut, some unsynced writes kept"
        } else if power {
            ", power cut"
        } else {
            ""
        };
        round(c, salt, partial, &mut rng, &mut report)
            .map_err(|e| format!("crash round {i} ({}{what}): {e}", c.name()))?;
        report.rounds += 1;
        if progress && (report.rounds % 50 == 0 || report.rounds == rounds) {
            eprintln!(
                "crash: {}/{rounds} rounds, {} writes acknowledged, {} flushes, all verified ({:.0?})",
                report.rounds,
                report.writes_acked,
                report.flushes,
                started.elapsed()
            );
        }
    }
    for mut c in combos {
        drop(c.storage.take());
        let _ = std::fs::remove_dir_all(&c.dir);
    }
    report.elapsed = started.elapsed();
    Ok(report)
}
