//! Load: many connections over several exports of one server, each
//! connection working in a region of its own with reads, writes, FLUSHes,
//! TRIMs and WRITE_ZEROES, a few requests in flight, for a fixed time. Every
//! read is checked against the connection's model at once; at the end the
//! server is stopped, started again and every region read back and checked
//! (no lost writes). Latencies go into one histogram per command.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::check;
use super::churn::{Churn, ChurnReport};
use super::server::Served;
use super::Rng;
use vdisk_nbd::client::{Client as Conn, Cmd, Reply, FUA};

const BLOCK: usize = 4096;
const DEPTH: usize = 4;
const MAX_BLOCKS: u64 = 32;
pub const COMMANDS: [Cmd; 5] = [Cmd::Read, Cmd::Write, Cmd::Flush, Cmd::Trim, Cmd::Zero];

pub struct LoadConfig<'a> {
    pub dir: &'a Path,
    pub engine: &'a str,
    pub connections: usize,
    pub exports: usize,
    pub export_size: u64,
    pub duration: Duration,
    pub seed: u64,
    /// Exports added, removed and added again through the control socket meanwhile (soak/churn.rs).
    pub churn: usize,
}

/// What a block must read as.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Generation g (0: zeros, as a fresh image reads).
    Gen(u64),
    /// Trimmed: zeros, or still generation g (TRIM is advisory).
    ZeroOr(u64),
}

pub struct LoadReport {
    pub seconds: f64,
    /// Latency per command, in microseconds.
    pub latency: Vec<(Cmd, Histogram<u64>)>,
    pub bytes: u64,
    pub errors: Vec<String>,
    pub error_count: u64,
    pub verified_blocks: u64,
    pub churn: Option<ChurnReport>,
}

struct Worker {
    export: usize,
    /// First block of this connection's region, in the export.
    first: u64,
    want: Vec<Want>,
    busy: Vec<bool>,
    gen: u64,
    salt: u64,
}

/// What one in-flight request was.
struct Sent {
    cmd: Cmd,
    at: Instant,
    start: usize,
    n: usize,
    gen: u64,
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid histogram bounds")
}

impl Worker {
    fn expected(&self, want: Want, block: u64, buf: &mut [u8]) {
        match want {
            Want::Gen(0) | Want::ZeroOr(_) => buf.fill(0),
            Want::Gen(g) => check::content(self.salt, block, g, buf),
        }
    }

    /// Compares data read from region blocks `start..start+n` with the model.
    fn verify(&self, start: usize, data: &[u8], what: &str) -> Result<(), String> {
        let mut want = vec![0u8; BLOCK];
        for (i, got) in data.chunks(BLOCK).enumerate() {
            let b = start + i;
            let abs = self.first + b as u64;
            self.expected(self.want[b], abs, &mut want);
            let ok = got == &want[..]
                || matches!(self.want[b], Want::ZeroOr(g) if g > 0 && { self.expected(Want::Gen(g), abs, &mut want); got == &want[..] });
            if !ok {
                return Err(format!(
                    "{what}: export {} block {abs} does not hold what was written (got {:02x?}...)",
                    self.export,
                    &got[..8]
                ));
            }
        }
        Ok(())
    }

    /// Picks a free range and a command for it.
    fn pick(&mut self, rng: &mut Rng) -> Option<(Cmd, usize, usize)> {
        let r = rng.below(100);
        let cmd = match r {
            0..=44 => Cmd::Read,
            45..=79 => Cmd::Write,
            80..=84 => Cmd::Flush,
            85..=91 => Cmd::Trim,
            _ => Cmd::Zero,
        };
        if cmd == Cmd::Flush {
            return Some((cmd, 0, 0));
        }
        let n = 1 + rng.below(MAX_BLOCKS.min(self.want.len() as u64)) as usize;
        let start = rng.below((self.want.len() - n + 1) as u64) as usize;
        if self.busy[start..start + n].iter().any(|&b| b) {
            return None;
        }
        Some((cmd, start, n))
    }
}

#[derive(Default)]
struct Outcome {
    latency: Vec<Histogram<u64>>,
    bytes: u64,
    errors: Vec<String>,
    error_count: u64,
}

fn fail(out: &mut Outcome, msg: String) {
    out.error_count += 1;
    if out.errors.len() < 5 {
        out.errors.push(msg);
    }
}

/// One connection's life; what went wrong is in `out`.
fn drive(socket: &Path, w: &mut Worker, seed: u64, stop: &AtomicBool, out: &mut Outcome) {
    let export = format!("load{}", w.export);
    let mut conn = match Conn::connect(socket, &export, Duration::from_secs(60)) {
        Ok(c) => c,
        Err(e) => return fail(out, format!("connect to {export}: {e}")),
    };
    let mut rng = Rng::new(seed);
    let mut inflight: std::collections::HashMap<u64, Sent> = std::collections::HashMap::new();
    let mut payload = vec![0u8; MAX_BLOCKS as usize * BLOCK];
    let mut stopping = false;
    loop {
        if !stopping && stop.load(Ordering::Relaxed) {
            stopping = true;
        }
        while !stopping && conn.in_flight() < DEPTH {
            let Some((cmd, start, n)) = w.pick(&mut rng) else { break };
            match send(&mut conn, w, &mut rng, &mut payload, (cmd, start, n)) {
                Ok((cookie, sent)) => {
                    inflight.insert(cookie, sent);
                }
                Err(e) => return fail(out, format!("{export}: sending {cmd:?}: {e}")),
            }
        }
        if conn.in_flight() == 0 {
            if stopping {
                break;
            }
            continue;
        }
        let reply = match conn.recv() {
            Ok(r) => r,
            Err(e) => return fail(out, format!("{export}: waiting for a reply: {e}")),
        };
        let Some(s) = inflight.remove(&reply.cookie) else {
            fail(out, format!("{export}: reply to a request never sent"));
            break;
        };
        settle(w, out, &export, s, &reply);
    }
    if let Err(e) = conn.call(Cmd::Flush, 0, 0, 0, &[]) {
        fail(out, format!("{export}: final FLUSH: {e}"));
    }
    conn.disconnect();
}

/// Sends one request the worker picked (`n` blocks at block `start` of its
/// region); marks its blocks busy. Returns its cookie and what to check on reply.
fn send(
    conn: &mut Conn,
    w: &mut Worker,
    rng: &mut Rng,
    payload: &mut [u8],
    (cmd, start, n): (Cmd, usize, usize),
) -> std::io::Result<(u64, Sent)> {
    let offset = (w.first + start as u64) * BLOCK as u64;
    let len = (n * BLOCK) as u32;
    let mut gen = 0;
    let cookie = match cmd {
        Cmd::Flush => conn.send(cmd, 0, 0, 0, &[]),
        Cmd::Write => {
            w.gen += 1;
            gen = w.gen;
            for (i, chunk) in payload[..n * BLOCK].chunks_mut(BLOCK).enumerate() {
                check::content(w.salt, w.first + (start + i) as u64, gen, chunk);
            }
            let fua = if rng.below(10) == 0 { FUA } else { 0 };
            conn.send(cmd, fua, offset, len, &payload[..n * BLOCK])
        }
        _ => conn.send(cmd, 0, offset, len, &[]),
    }?;
    w.busy[start..start + n].iter_mut().for_each(|b| *b = true);
    Ok((cookie, Sent { cmd, at: Instant::now(), start, n, gen }))
}

/// Accounts for the reply to `s`: its latency, its data checked (reads), and
/// what its blocks must read as from now on (writes, zeroes, trims).
fn settle(w: &mut Worker, out: &mut Outcome, export: &str, s: Sent, reply: &Reply) {
    let micros = s.at.elapsed().as_micros().max(1) as u64;
    let idx = COMMANDS.iter().position(|&c| c == s.cmd).unwrap();
    let _ = out.latency[idx].record(micros);
    w.busy[s.start..s.start + s.n].iter_mut().for_each(|b| *b = false);
    if reply.error != 0 {
        return fail(out, format!("{export}: {:?} of {} blocks failed with NBD error {}", s.cmd, s.n, reply.error));
    }
    let blocks = s.start..s.start + s.n;
    match s.cmd {
        Cmd::Read => {
            out.bytes += reply.data.len() as u64;
            if let Err(e) = w.verify(s.start, &reply.data, "read during the load") {
                fail(out, e);
            }
        }
        Cmd::Write => {
            out.bytes += (s.n * BLOCK) as u64;
            w.want[blocks].iter_mut().for_each(|b| *b = Want::Gen(s.gen));
        }
        Cmd::Zero => w.want[blocks].iter_mut().for_each(|b| *b = Want::Gen(0)),
        Cmd::Trim => w.want[blocks].iter_mut().for_each(|b| {
            *b = match *b {
                Want::Gen(g) | Want::ZeroOr(g) => Want::ZeroOr(g),
            }
        }),
        Cmd::Flush => {}
    }
}

/// Runs the load against a fresh server over `exports` new sparse images.
pub fn run(cfg: &LoadConfig) -> Result<LoadReport, String> {
    let exports = cfg.exports.max(1);
    let images: Vec<PathBuf> = (0..exports).map(|i| cfg.dir.join(format!("load{i}.img"))).collect();
    for p in &images {
        let f = std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))?;
        f.set_len(cfg.export_size).map_err(|e| format!("cannot size {}: {e}", p.display()))?;
    }
    let per_export = cfg.connections.div_ceil(exports) as u64;
    let region = cfg.export_size / BLOCK as u64 / per_export;
    if region < MAX_BLOCKS {
        return Err(format!(
            "{} connections need exports of at least {} bytes",
            cfg.connections,
            per_export * MAX_BLOCKS * BLOCK as u64
        ));
    }
    let control = cfg.dir.join("soak-ctl.sock");
    let control_arg = control.to_string_lossy().into_owned();
    let mut extra = vec!["--engine", cfg.engine];
    if cfg.churn > 0 {
        extra.extend(["--control", control_arg.as_str()]);
    }
    if cfg.churn > 0 {
        super::churn::raise_fd_limit();
    }
    let server = Served::start(cfg.dir, &images, &extra)?;
    let churn = match cfg.churn {
        0 => None,
        n => Some(Churn::start(cfg.dir, &control, &server.socket, n, cfg.seed)?),
    };
    let started = Instant::now();
    let outcomes = load(cfg, &server.socket, region);
    let churn = churn.map(Churn::finish);
    let seconds = started.elapsed().as_secs_f64();
    server.stop()?;
    let mut report = LoadReport {
        seconds,
        latency: COMMANDS.iter().map(|&c| (c, new_histogram())).collect(),
        bytes: 0,
        errors: Vec::new(),
        error_count: 0,
        verified_blocks: 0,
        churn: None,
    };
    for (o, _) in &outcomes {
        for (h, oh) in report.latency.iter_mut().zip(&o.latency) {
            h.1.add(oh).expect("same histogram bounds");
        }
        report.bytes += o.bytes;
        report.error_count += o.error_count;
        report.errors.extend(o.errors.iter().cloned());
    }
    if let Some(c) = &churn {
        report.error_count += c.error_count;
        report.errors.extend(c.errors.iter().cloned());
    }
    report.churn = churn;
    verify_after_restart(cfg, &images, &outcomes, &mut report)?;
    for p in &images {
        let _ = std::fs::remove_file(p);
    }
    Ok(report)
}

/// `cfg.connections` connections, each over its own `region` of blocks of
/// one export, for `cfg.duration`; what each saw and its worker's state.
fn load(cfg: &LoadConfig, socket: &Path, region: u64) -> Vec<(Outcome, Worker)> {
    let exports = cfg.exports.max(1);
    let mut rng = Rng::new(cfg.seed);
    let salt = rng.next();
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..cfg.connections)
        .map(|i| {
            let export = i % exports;
            let first = (i / exports) as u64 * region;
            let mut w = Worker {
                export,
                first,
                want: vec![Want::Gen(0); region as usize],
                busy: vec![false; region as usize],
                gen: 0,
                salt: salt ^ export as u64,
            };
            let (socket, stop, seed) = (socket.to_owned(), stop.clone(), rng.next());
            std::thread::Builder::new()
                .name(format!("load{i}"))
                .spawn(move || {
                    let mut out =
                        Outcome { latency: COMMANDS.iter().map(|_| new_histogram()).collect(), ..Default::default() };
                    drive(&socket, &mut w, seed, &stop, &mut out);
                    (out, w)
                })
                .expect("spawn a load thread")
        })
        .collect();
    std::thread::sleep(cfg.duration);
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().map(|t| t.join().expect("load thread panicked")).collect()
}

/// No lost writes: a new server over the same images, every region read back.
fn verify_after_restart(
    cfg: &LoadConfig,
    images: &[PathBuf],
    outcomes: &[(Outcome, Worker)],
    report: &mut LoadReport,
) -> Result<(), String> {
    let server = Served::start(cfg.dir, images, &["--engine", cfg.engine])?;
    for (_, w) in outcomes {
        let read = Conn::connect(&server.socket, &format!("load{}", w.export), Duration::from_secs(60))
            .and_then(|mut c| c.read_all(w.first * BLOCK as u64, w.want.len() as u64 * BLOCK as u64));
        match read {
            Ok(data) => match w.verify(0, &data, "after a restart") {
                Ok(()) => report.verified_blocks += w.want.len() as u64,
                Err(e) => {
                    report.error_count += 1;
                    report.errors.push(e);
                }
            },
            Err(e) => return Err(format!("reading export load{} back: {e}{}", w.export, server.log_tail())),
        }
    }
    server.stop()
}
