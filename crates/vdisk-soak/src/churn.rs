//! The many-exports mode of the load (`vdisk soak --exports N` with N over
//! [`BUSY`]): beside the exports the load's connections work on, the other
//! N - BUSY exports are small sparse files added through the server's control
//! socket while the load runs, then removed and added again in batches until
//! the load ends. Each of them is probed after every add: its block 0 must
//! still hold the generation last written there (a removal flushes, an add
//! serves the same file again), then a new generation is written (no FUA)
//! and read back, four exports at a time. At the end every one is probed once more and removed.
//! This module owns those files, the control connection and the probes.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vdisk_nbd::client::{Client as Conn, Cmd};

use super::check;
use super::Rng;

/// Exports the load's connections are spread over at most; the rest churn.
pub const BUSY: usize = 16;
/// Size of each churned export.
const SIZE: u64 = 1 << 20;
const BLOCK: usize = 4096;
/// Exports removed and added again per cycle.
const BATCH: usize = 16;
/// Remove-and-add cycles done however short the load.
const MIN_CYCLES: usize = 4;
/// Probes run at once.
const PROBERS: usize = 4;
/// Control requests sent ahead of their answers.
const WINDOW: usize = 64;

/// Raises this process's soft descriptor limit to its hard limit before the
/// server is started (it inherits it): each export holds a few descriptors, so
/// a thousand exports pass the usual soft limit of 1024. Returns the limit.
pub fn raise_fd_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed to it.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 && r.rlim_cur < r.rlim_max {
        let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
        // SAFETY: setrlimit only reads the struct passed to it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            r = raised;
        }
    }
    r.rlim_cur
}

/// What the churn did, for the report.
#[derive(Default)]
pub struct ChurnReport {
    pub exports: usize,
    /// Seconds the first add of every export took (pipelined on one connection).
    pub first_add_seconds: f64,
    pub adds: u64,
    pub removes: u64,
    pub probes: u64,
    pub errors: Vec<String>,
    pub error_count: u64,
}

impl ChurnReport {
    fn fail(&mut self, msg: String) {
        self.error_count += 1;
        if self.errors.len() < 5 {
            self.errors.push(msg);
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "exports": self.exports, "first_add_seconds": self.first_add_seconds, "adds": self.adds,
            "removes": self.removes, "probes": self.probes, "errors": self.error_count,
            "error_messages": self.errors,
        })
    }
}

/// The churn running beside the load; [`Churn::finish`] ends it.
pub struct Churn {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<ChurnReport>,
}

impl Churn {
    /// Makes `count` sparse files in `dir`/churn and starts adding them to the
    /// server at `control` (NBD on `socket`) on a thread of its own.
    pub fn start(dir: &Path, control: &Path, socket: &Path, count: usize, seed: u64) -> Result<Churn, String> {
        let sub = dir.join("churn");
        std::fs::create_dir_all(&sub).map_err(|e| format!("cannot create {}: {e}", sub.display()))?;
        let mut files = Vec::with_capacity(count);
        for i in 0..count {
            let p = sub.join(format!("churn{i}.img"));
            let f = std::fs::File::create(&p).map_err(|e| format!("cannot create {}: {e}", p.display()))?;
            f.set_len(SIZE).map_err(|e| format!("cannot size {}: {e}", p.display()))?;
            files.push(p);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (control, socket, stop2) = (control.to_owned(), socket.to_owned(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("churn".into())
            .spawn(move || {
                let mut state = State {
                    files,
                    gen: vec![0; count],
                    salt: Rng::new(seed).next(),
                    socket,
                    report: ChurnReport { exports: count, ..Default::default() },
                };
                state.run(&control, &stop2, seed);
                let _ = std::fs::remove_dir_all(&sub);
                state.report
            })
            .map_err(|e| format!("cannot start the churn thread: {e}"))?;
        Ok(Churn { stop, thread })
    }

    /// Asks the churn to end (it first finishes its first round of adds and
    /// probes and [`MIN_CYCLES`] cycles), waits for it, and returns what it did.
    pub fn finish(self) -> ChurnReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_else(|_| {
            let mut r = ChurnReport::default();
            r.fail("the churn thread panicked".into());
            r
        })
    }
}

struct State {
    files: Vec<PathBuf>,
    /// The generation last written to each export's block 0 (0: zeros).
    gen: Vec<u64>,
    salt: u64,
    socket: PathBuf,
    report: ChurnReport,
}

fn name(i: usize) -> String {
    format!("churn{i}")
}

impl State {
    fn run(&mut self, control: &Path, stop: &AtomicBool, seed: u64) {
        let mut ctl = match Control::connect(control) {
            Ok(c) => c,
            Err(e) => return self.report.fail(e),
        };
        let all: Vec<usize> = (0..self.files.len()).collect();
        let t0 = Instant::now();
        if !self.add(&mut ctl, &all) {
            return;
        }
        self.report.first_add_seconds = t0.elapsed().as_secs_f64();
        self.probe(&all);
        let mut rng = Rng::new(seed ^ 0xc4u64);
        let mut cycles = 0;
        while (cycles < MIN_CYCLES || !stop.load(Ordering::Relaxed)) && self.report.error_count == 0 {
            cycles += 1;
            let batch: Vec<usize> = (0..BATCH.min(all.len())).map(|_| rng.below(all.len() as u64) as usize).collect();
            let mut batch = batch;
            batch.sort_unstable();
            batch.dedup();
            if !self.remove(&mut ctl, &batch) || !self.add(&mut ctl, &batch) {
                return;
            }
            self.probe(&batch);
        }
        self.probe(&all);
        self.remove(&mut ctl, &all);
    }

    /// Adds the exports `which`; false (and the failure recorded) if any add failed.
    fn add(&mut self, ctl: &mut Control, which: &[usize]) -> bool {
        let reqs: Vec<Value> = which
            .iter()
            .map(|&i| json!({"method": "export_add", "params": {"image": self.files[i], "name": name(i)}}))
            .collect();
        match ctl.pipelined(&reqs) {
            Ok(answers) => {
                self.report.adds += which.len() as u64;
                self.judge(which, answers, "export_add")
            }
            Err(e) => {
                self.report.fail(e);
                false
            }
        }
    }

    /// Removes the exports `which` (a probe's connection that the server has
    /// not yet seen go makes a removal answer "in use": tried again for 10 s).
    fn remove(&mut self, ctl: &mut Control, which: &[usize]) -> bool {
        let mut left = which.to_vec();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let reqs: Vec<Value> =
                left.iter().map(|&i| json!({"method": "export_remove", "params": {"name": name(i)}})).collect();
            let answers = match ctl.pipelined(&reqs) {
                Ok(a) => a,
                Err(e) => {
                    self.report.fail(e);
                    return false;
                }
            };
            let mut busy = Vec::new();
            let mut rest = Vec::new();
            for (&i, a) in left.iter().zip(answers) {
                if a.get("error").and_then(|e| e["code"].as_i64()) == Some(-32003) && Instant::now() < deadline {
                    busy.push(i);
                } else {
                    rest.push((i, a));
                }
            }
            let (idx, ans): (Vec<usize>, Vec<Value>) = rest.into_iter().unzip();
            self.report.removes += idx.len() as u64;
            if !self.judge(&idx, ans, "export_remove") {
                return false;
            }
            if busy.is_empty() {
                return true;
            }
            left = busy;
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn judge(&mut self, which: &[usize], answers: Vec<Value>, method: &str) -> bool {
        let mut ok = true;
        for (&i, a) in which.iter().zip(answers) {
            if let Some(e) = a.get("error") {
                self.report.fail(format!("{method} of {} ({}): {e}", name(i), self.files[i].display()));
                ok = false;
            }
        }
        ok
    }

    /// Probes the exports `which`, [`PROBERS`] at a time.
    fn probe(&mut self, which: &[usize]) {
        let (socket, salt, gen) = (&self.socket, self.salt, &self.gen);
        let results: Vec<(usize, Result<(), String>)> = std::thread::scope(|sc| {
            let workers: Vec<_> = (0..PROBERS)
                .map(|k| {
                    sc.spawn(move || {
                        which
                            .iter()
                            .skip(k)
                            .step_by(PROBERS)
                            .map(|&i| (i, probe(socket, salt, i, gen[i])))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
        });
        for (i, r) in results {
            self.report.probes += 1;
            match r {
                Ok(()) => self.gen[i] += 1,
                Err(e) => self.report.fail(format!("export {}: {e}", name(i))),
            }
        }
    }
}

/// Connects to export `i`, checks block 0 holds generation `gen` (0: zeros),
/// writes generation `gen + 1` (no FUA: a removal's flush must keep it) and
/// reads it back.
fn probe(socket: &Path, salt: u64, i: usize, gen: u64) -> Result<(), String> {
    let mut conn = Conn::connect(socket, &name(i), Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let mut want = vec![0u8; BLOCK];
    let got = conn.call(Cmd::Read, 0, 0, BLOCK as u32, &[]).map_err(|e| e.to_string())?;
    if gen > 0 {
        check::content(salt, i as u64, gen, &mut want);
    }
    if got != want {
        return Err(format!("block 0 does not hold generation {gen} written before"));
    }
    check::content(salt, i as u64, gen + 1, &mut want);
    conn.call(Cmd::Write, 0, 0, BLOCK as u32, &want).map_err(|e| e.to_string())?;
    let got = conn.call(Cmd::Read, 0, 0, BLOCK as u32, &[]).map_err(|e| e.to_string())?;
    conn.disconnect();
    if got != want {
        return Err(format!("block 0 does not read back generation {} just written", gen + 1));
    }
    Ok(())
}

/// One control connection, requests pipelined (answers come in order).
pub(crate) struct Control {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    next_id: u64,
}

impl Control {
    pub(crate) fn connect(path: &Path) -> Result<Control, String> {
        let s = UnixStream::connect(path).map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
        let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
        let r = s.try_clone().map_err(|e| format!("control socket: {e}"))?;
        Ok(Control { writer: s, reader: BufReader::new(r), next_id: 0 })
    }

    /// Sends one request and returns its answer (`result` or `error` in it).
    pub(crate) fn call(&mut self, method: &str, params: Value) -> Result<Value, String> {
        let mut answers = self.pipelined(&[json!({"method": method, "params": params})])?;
        Ok(answers.pop().unwrap_or(Value::Null))
    }

    /// Sends `reqs` (method and params), at most [`WINDOW`] ahead of the
    /// answers; returns every answer in order.
    fn pipelined(&mut self, reqs: &[Value]) -> Result<Vec<Value>, String> {
        let mut answers = Vec::with_capacity(reqs.len());
        let mut sent = 0;
        let mut line = String::new();
        while answers.len() < reqs.len() {
            let mut out = Vec::new();
            while sent < reqs.len() && sent - answers.len() < WINDOW {
                let mut r = reqs[sent].clone();
                r["jsonrpc"] = "2.0".into();
                r["id"] = self.next_id.into();
                self.next_id += 1;
                out.extend_from_slice(r.to_string().as_bytes());
                out.push(b'\n');
                sent += 1;
            }
            self.writer.write_all(&out).map_err(|e| format!("writing to the control socket: {e}"))?;
            line.clear();
            match self.reader.read_line(&mut line) {
                Ok(0) => return Err("the server closed the control connection".into()),
                Ok(_) => answers.push(
                    serde_json::from_str(&line)
                        .map_err(|e| format!("the control socket's answer is not JSON ({e}): {line:?}"))?,
                ),
                Err(e) => return Err(format!("reading the control socket: {e}")),
            }
        }
        Ok(answers)
    }
}
