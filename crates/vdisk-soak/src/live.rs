//! Live disk operations inside the crash and power-loss rounds (`vdisk soak
//! --jobs`, issues 25 and 26): while the checked writers run, a driver
//! thread works the export through the server's control socket: snapshots
//! (a qcow2 overlay over the top), streams of the top, commits of the middle
//! layer, each copying job paced with a random `bps` so that the kill or the
//! power cut often lands in the middle of one. A dirty bitmap is kept on the
//! top meanwhile (`--jobs ...,bitmaps`).
//!
//! After the cut the soak, not the server, decides which file to restart on:
//! the top the last answered snapshot named, or the overlay of a snapshot
//! asked for but not answered when its header reads back as an overlay of
//! that top (the header is durable before the swap; writes may have gone to
//! it already). The chain is then what the headers say (`qemu-img info
//! --backing-chain`, which must read it), `qemu-img check` must be clean on
//! every qcow2 layer, the checked writers' judge reads the disk through vdisk,
//! a job the cut interrupted is started again and must finish with the disk
//! reading the same, and the bitmap must be consistent and cover every
//! 512-byte piece that changed since it was added, or be marked
//! inconsistent: never silently short.
//!
//! Mirrors (`--jobs ...,mirror`): `export_mirror` of the live disk to a new
//! raw or qcow2 file beside the images, paced; once ready, half the time
//! `job_pivot` (then the target, with no backing file, is the chain), a
//! quarter `job_cancel`, a quarter it runs on until the cut. A mirror cut
//! before its pivot was asked leaves the export on its chain (the judge reads
//! it; the half-made target is removed). A cut after the pivot was asked and
//! before it was seen done is the one moment the soak cannot know which file
//! the export last wrote: it restarts on the target, and if the judge fails
//! there, on the old chain; one of the two must hold every flushed write.
//!
//! Backup views (`--jobs ...,backup`): `backup_begin` of a view with its
//! scratch file in a directory of its own, with the soak bitmap as the view's
//! bitmap and a new one started beside it (where bitmaps are kept and the
//! bitmap is on the top), a read of part of the view over NBD, then half the
//! time `backup_end`, else reads of the view until the cut. After the cut the
//! scratch directory must be empty (the scratch file never had a name), the
//! judge must find the disk as the writers left it, not the view (scratch
//! data in the disk is data the judge never saw written there), and the
//! bitmaps are judged together: the old one (disabled at the begin) and the
//! new one must, unless one is marked inconsistent, cover every piece that
//! changed since the old one was added.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vdisk_nbd::client::Client as Conn;

use super::churn::Control;
use super::Rng;

/// The name of the bitmap the soak keeps on the top.
const BITMAP: &str = "soak";
/// The bitmap a backup view starts for the next backup (the soak bitmap is then disabled).
const NEXT_BITMAP: &str = "soak-next";
/// The backup view's export name.
const VIEW: &str = "soak-view";
/// Layers (top included) a chain grows to before only commit and stream run.
const MAX_DEPTH: usize = 3;

/// One live disk operation a round may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Snapshot,
    Stream,
    Commit,
    /// `export_mirror` to a new file in the images' directory; pivot, cancel
    /// or neither once ready. [`after_cut`] takes the target as the top when
    /// the pivot was seen done (and tries it first when it was only asked).
    Mirror,
    /// `backup_begin` of a view, a read of it over NBD, `backup_end` or not.
    BackupView,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Snapshot => "snapshot",
            Op::Stream => "stream",
            Op::Commit => "commit",
            Op::Mirror => "mirror",
            Op::BackupView => "backup",
        }
    }
}

/// Refuses a set of operations the rounds cannot run, before any round.
pub fn check_ops(ops: &[Op]) -> Result<(), String> {
    if ops.iter().any(|o| matches!(o, Op::Stream | Op::Commit)) && !ops.contains(&Op::Snapshot) {
        return Err("--jobs stream or commit needs snapshot too: the snapshots make the layers they work on".into());
    }
    Ok(())
}

/// What the live operations did over all rounds.
#[derive(Debug, Clone, Default)]
pub struct LiveStats {
    pub snapshots: u64,
    pub streams: u64,
    pub commits: u64,
    /// Cuts that landed while a snapshot was asked or a job ran.
    pub cuts_mid_job: u64,
    /// Of those, cuts during a snapshot, a stream, a commit, a mirror, a backup view.
    pub cuts_mid: [u64; 5],
    /// Interrupted jobs started again after the restart (each finished).
    pub jobs_restarted: u64,
    /// Restarts on the overlay of a snapshot that was not answered.
    pub unanswered_snapshot_tops: u64,
    /// Bitmaps found consistent after a cut (and covering every change).
    pub bitmaps_consistent: u64,
    /// Bitmaps found marked inconsistent after a cut.
    pub bitmaps_inconsistent: u64,
    /// Bitmaps not on a new top after a cut caught its swap (between the
    /// swap and the new top's first save of them).
    pub bitmaps_lost_at_swap: u64,
    /// Mirrors started, pivoted (seen done), cancelled (seen cancelled).
    pub mirrors: u64,
    pub pivots: u64,
    pub mirrors_cancelled: u64,
    /// Cuts after a pivot was asked and before it was seen done; of those,
    /// restarts the target held every flushed write for.
    pub pivots_unanswered: u64,
    pub unanswered_pivot_on_target: u64,
    /// Of those, restarts on the chain as it was (the pivot had not happened).
    pub pivots_unanswered_on_old: u64,
    /// Backup views begun (answered) and ended (answered); bytes read from views.
    pub backups: u64,
    pub backups_ended: u64,
    pub view_bytes_read: u64,
    /// Bitmap pairs (disabled at a backup's begin, and the new one) judged
    /// together as consistent and covering every change.
    pub bitmap_pairs_covering: u64,
    /// The old bitmap back consistent and disabled, the new one gone (its
    /// add was not saved before the cut): not short in silence, the
    /// checkpoint is visibly missing.
    pub new_bitmaps_lost: u64,
}

impl LiveStats {
    pub fn json(&self) -> Value {
        json!({
            "snapshots": self.snapshots, "streams": self.streams, "commits": self.commits,
            "cuts_mid_job": self.cuts_mid_job, "cuts_mid_snapshot": self.cuts_mid[0],
            "cuts_mid_stream": self.cuts_mid[1], "cuts_mid_commit": self.cuts_mid[2], "jobs_restarted": self.jobs_restarted,
            "unanswered_snapshot_tops": self.unanswered_snapshot_tops,
            "bitmaps_consistent": self.bitmaps_consistent, "bitmaps_inconsistent": self.bitmaps_inconsistent,
            "bitmaps_lost_at_swap": self.bitmaps_lost_at_swap,
            "cuts_mid_mirror": self.cuts_mid[3], "cuts_mid_backup": self.cuts_mid[4],
            "mirrors": self.mirrors, "pivots": self.pivots, "mirrors_cancelled": self.mirrors_cancelled,
            "pivots_unanswered": self.pivots_unanswered, "unanswered_pivot_on_target": self.unanswered_pivot_on_target,
            "unanswered_pivot_on_old": self.pivots_unanswered_on_old,
            "backups": self.backups, "backups_ended": self.backups_ended, "view_bytes_read": self.view_bytes_read,
            "bitmap_pairs_covering": self.bitmap_pairs_covering, "new_bitmaps_lost": self.new_bitmaps_lost,
        })
    }
}

/// One combination's chain, as the soak knows it between rounds.
pub struct Chain {
    /// Where the overlays are made (the power-loss storage, if any).
    images: PathBuf,
    /// The layers, top first, as the headers said after the last restart.
    pub layers: Vec<PathBuf>,
    ops: Vec<Op>,
    bitmaps: bool,
    /// Overlays made so far (they are named after it).
    made: u64,
    /// The job the last cut interrupted, to start again.
    interrupted: Option<Op>,
    /// The bitmap kept on the top: the layer it was added on, and the disk then.
    bitmap: Option<(PathBuf, Vec<u8>)>,
    /// A backup's begin with [`NEXT_BITMAP`] was asked last round (the soak
    /// bitmap may be disabled, and the next one holds the rest).
    next_asked: bool,
    /// The chain before a pivot that was asked and not seen done: where the
    /// judge reads when the target does not hold every flushed write.
    pub fallback: Option<Vec<PathBuf>>,
    /// The backup views' scratch directory (must stay empty).
    scratch: PathBuf,
}

impl Chain {
    /// `layers`: the chain as set up, top first (absolute paths). `scratch`:
    /// the backup views' scratch directory, made here (off the power-cut
    /// storage, which has no directories: a scratch area on other storage,
    /// as `--scratch` allows).
    pub fn new(images: &Path, scratch: &Path, layers: Vec<PathBuf>, ops: &[Op], bitmaps: bool) -> Chain {
        let _ = std::fs::create_dir_all(scratch);
        Chain {
            images: images.to_owned(),
            layers,
            ops: ops.to_vec(),
            bitmaps,
            made: 0,
            interrupted: None,
            bitmap: None,
            next_asked: false,
            fallback: None,
            scratch: scratch.to_owned(),
        }
    }

    pub fn top(&self) -> &Path {
        &self.layers[0]
    }

    /// The target of a pivot asked and not seen done did not hold every
    /// flushed write: the judge reads the chain as it was before the
    /// mirror (which must). False when there is no such chain.
    pub fn fall_back(&mut self, stats: &mut LiveStats) -> Result<bool, String> {
        let Some(old) = self.fallback.take() else { return Ok(false) };
        for l in old.iter().filter(|l| l.extension().is_some_and(|e| e == "qcow2")) {
            qemu_img_check(l)?;
        }
        self.layers = old;
        self.interrupted = None;
        stats.pivots_unanswered_on_old += 1;
        Ok(true)
    }

    /// The judge passed on the top: a pivot asked and not seen done had happened.
    pub fn judged(&mut self, stats: &mut LiveStats) {
        if self.fallback.take().is_some() {
            stats.unanswered_pivot_on_target += 1;
        }
    }

    /// The export's name: the top's file stem, as `vdisk serve` names it.
    pub fn export(&self) -> String {
        export_name(self.top())
    }
}

fn export_name(p: &Path) -> String {
    p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

/// What the driver thread did before the server went away.
#[derive(Default)]
pub struct Drove {
    /// The chain after the answered snapshots and jobs.
    layers: Vec<PathBuf>,
    made: u64,
    /// A snapshot asked for and not answered.
    pending: Option<PathBuf>,
    /// A job started and not seen ended.
    running: Option<Op>,
    done: Vec<Op>,
    /// A mirror started and not seen ended: its target, and whether its pivot was asked.
    mirror: Option<(PathBuf, bool)>,
    /// A backup view asked for and not seen ended.
    backup: bool,
    /// The soak bitmap is on the top the export serves (no snapshot or pivot this round).
    bitmap_on_top: bool,
    /// A backup's begin with [`NEXT_BITMAP`] was asked.
    next_asked: bool,
    mirrors: u64,
    mirrors_cancelled: u64,
    backups: u64,
    backups_ended: u64,
    view_bytes_read: u64,
    /// An error answer (a failure unless the storage lost its power).
    pub error: Option<String>,
    /// The error was answered while the storage had power.
    pub error_while_powered: bool,
}

/// The driver of one round: runs until the control connection breaks.
pub struct Driver(JoinHandle<Drove>);

impl Driver {
    /// `socket`: the server's NBD socket (backup views are read there);
    /// `alive`: whether the images' storage still has power (an error
    /// answered while it has is the round's failure even after the cut).
    pub fn start(
        chain: &Chain,
        control: &Path,
        socket: &Path,
        seed: u64,
        alive: impl Fn() -> bool + Send + 'static,
    ) -> Driver {
        let (control, images, mut ops) = (control.to_owned(), chain.images.clone(), chain.ops.clone());
        let socket = socket.to_owned();
        let scratch = chain.scratch.clone();
        let mut rng = Rng::new(seed);
        // One round in three makes no snapshot: the top stays, and so does
        // the bitmap on it, which the next restart then judges.
        if chain.bitmaps && rng.below(3) == 0 {
            ops.retain(|&o| o != Op::Snapshot);
        }
        let export = chain.export();
        let bitmap_on_top = chain.bitmap.as_ref().is_some_and(|(on, _)| on == chain.top());
        let mut d = Drove { layers: chain.layers.clone(), made: chain.made, bitmap_on_top, ..Default::default() };
        Driver(std::thread::spawn(move || {
            let mut ctl = match Control::connect(&control) {
                Ok(c) => c,
                Err(e) => {
                    d.error = Some(e);
                    return d;
                }
            };
            while let Some(op) = pick(&d, &ops, &mut rng) {
                std::thread::sleep(Duration::from_millis(rng.below(20)));
                let at = Where { export: &export, images: &images, socket: &socket, scratch: &scratch };
                match run_op(&mut ctl, &at, op, &mut d, &mut rng) {
                    Ok(()) => {}
                    Err(Stop::Gone) => break,
                    Err(Stop::Failed(e)) => {
                        d.error = Some(e);
                        d.error_while_powered = alive();
                        break;
                    }
                }
            }
            d
        }))
    }

    pub fn finish(self) -> Result<Drove, String> {
        self.0.join().map_err(|_| "the live-operations driver panicked".to_owned())
    }
}

/// The next operation on the chain `d` holds (None: nothing to do, which
/// only a plan of snapshots alone reaches; it stops at six layers). The
/// chain grows to three layers; there a commit comes twice as often as a
/// stream (a stream drops every layer below, a commit one).
fn pick(d: &Drove, ops: &[Op], rng: &mut Rng) -> Option<Op> {
    let depth = d.layers.len();
    let qcow2_top = d.layers[0].extension().is_some_and(|e| e == "qcow2");
    let offer = |choices: &mut Vec<Op>, op: Op, weight: usize| {
        if ops.contains(&op) {
            choices.extend(std::iter::repeat_n(op, weight));
        }
    };
    let mut choices = Vec::new();
    if depth < MAX_DEPTH {
        offer(&mut choices, Op::Snapshot, 3);
    }
    if depth >= 3 {
        offer(&mut choices, Op::Commit, 2);
    }
    if depth >= 2 && qcow2_top {
        offer(&mut choices, Op::Stream, 1);
    }
    offer(&mut choices, Op::Mirror, 1);
    offer(&mut choices, Op::BackupView, 1);
    if choices.is_empty() && depth < 2 * MAX_DEPTH {
        offer(&mut choices, Op::Snapshot, 1);
    }
    (!choices.is_empty()).then(|| choices[rng.below(choices.len() as u64) as usize])
}

enum Stop {
    /// The control connection broke: the server was killed.
    Gone,
    Failed(String),
}

/// The `result` of an answer, or why not.
fn result(answer: Value, what: &str) -> Result<Value, Stop> {
    match answer.get("error") {
        Some(e) => Err(Stop::Failed(format!("{what}: the server answered {e}"))),
        None => Ok(answer["result"].clone()),
    }
}

/// Where a round's operations work.
struct Where<'a> {
    export: &'a str,
    images: &'a Path,
    /// The server's NBD socket.
    socket: &'a Path,
    /// The backup views' scratch directory.
    scratch: &'a Path,
}

/// Runs `op` on the export; updates `d` as answers come.
fn run_op(ctl: &mut Control, at: &Where, op: Op, d: &mut Drove, rng: &mut Rng) -> Result<(), Stop> {
    let (export, images) = (at.export, at.images);
    // A paced job takes a while (the disk is a few MiB), so cuts land in it.
    let bps = [2u64 << 20, 8 << 20, 32 << 20, 0][rng.below(4) as usize];
    match op {
        Op::Snapshot => {
            d.made += 1;
            let overlay = images.join(format!("snap{}.qcow2", d.made));
            d.pending = Some(overlay.clone());
            let a = ctl.call("export_snapshot", json!({"name": export, "overlay": overlay})).map_err(|_| Stop::Gone)?;
            result(a, &format!("export_snapshot to {}", overlay.display()))?;
            d.pending = None;
            d.layers.insert(0, overlay);
            d.bitmap_on_top = false;
        }
        Op::Stream => job(ctl, "export_stream", json!({"name": export, "bps": bps}), op, d)?,
        Op::Commit => job(ctl, "export_commit", json!({"name": export, "bps": bps}), op, d)?,
        Op::Mirror => {
            // Faster than the others: a pivot comes within the round often enough.
            let bps = [8u64 << 20, 32 << 20, 0][rng.below(3) as usize];
            if !mirror(ctl, export, images, bps, d, rng)? {
                return Ok(());
            }
        }
        Op::BackupView => backup(ctl, at, d, rng)?,
    }
    d.done.push(op);
    Ok(())
}

/// A mirror to a new file: started, then (once ready) pivoted, cancelled, or
/// left running until the cut. Whether it pivoted (the chain is the target).
fn mirror(
    ctl: &mut Control,
    export: &str,
    images: &Path,
    bps: u64,
    d: &mut Drove,
    rng: &mut Rng,
) -> Result<bool, Stop> {
    d.made += 1;
    let qcow2 = rng.below(2) == 0;
    let target = images.join(format!("mirror{}.{}", d.made, if qcow2 { "qcow2" } else { "raw" }));
    let format = if qcow2 { "qcow2" } else { "raw" };
    let params = json!({"name": export, "to": target, "format": format, "bps": bps});
    d.mirror = Some((target.clone(), false));
    d.running = Some(Op::Mirror);
    let a = ctl.call("export_mirror", params.clone()).map_err(|_| Stop::Gone)?;
    let id = result(a, &format!("export_mirror {params}"))?["job"].as_u64().unwrap_or(0);
    d.mirrors += 1;
    let (state, error) = wait_job(ctl, id, &["running"]).map_err(|_| Stop::Gone)?;
    if state != "ready" {
        return Err(Stop::Failed(format!("export_mirror to {} (job {id}) ended {state}: {error}", target.display())));
    }
    // Asks `method` of the ready job and waits for it to end `want`.
    let end = |ctl: &mut Control, method: &str, did: &str, want: &str| -> Result<(), Stop> {
        let a = ctl.call(method, json!({"id": id})).map_err(|_| Stop::Gone)?;
        result(a, &format!("{method} {id} (mirror to {})", target.display()))?;
        let (state, error) = wait_job(ctl, id, &["running", "ready"]).map_err(|_| Stop::Gone)?;
        if state != want {
            let t = target.display();
            return Err(Stop::Failed(format!("mirror to {t} (job {id}) {did}, ended {state}: {error}")));
        }
        Ok(())
    };
    match rng.below(4) {
        0 | 1 => {
            d.mirror = Some((target.clone(), true));
            end(ctl, "job_pivot", "pivoted", "done")?;
            d.mirror = None;
            d.running = None;
            d.layers = vec![target];
            d.bitmap_on_top = false;
            Ok(true)
        }
        2 => {
            end(ctl, "job_cancel", "cancelled", "cancelled")?;
            d.mirror = None;
            d.running = None;
            d.mirrors_cancelled += 1;
            Ok(false)
        }
        // Ready, it keeps following the writes until the cut.
        _ => match wait_job(ctl, id, &["running", "ready"]) {
            Err(_) => Err(Stop::Gone),
            Ok((state, error)) => {
                Err(Stop::Failed(format!("mirror to {} (job {id}) ended {state} by itself: {error}", target.display())))
            }
        },
    }
}

/// An NBD client's error: the server was killed if its control socket no
/// longer answers, else `what` failed on a live server.
fn gone_or(ctl: &mut Control, what: String) -> Stop {
    match ctl.call("server_info", json!({})) {
        Ok(_) => Stop::Failed(what),
        Err(_) => Stop::Gone,
    }
}

/// A backup view: begun (with the soak bitmap and a new one where it is on
/// the top), part of it read over NBD, then ended, or read until the cut.
fn backup(ctl: &mut Control, at: &Where, d: &mut Drove, rng: &mut Rng) -> Result<(), Stop> {
    let mut params = json!({"export": at.export, "view": VIEW, "scratch": at.scratch});
    if d.bitmap_on_top && !d.next_asked {
        params["bitmap"] = json!(BITMAP);
        params["new_bitmap"] = json!(NEXT_BITMAP);
        d.next_asked = true;
    }
    d.backup = true;
    let a = ctl.call("backup_begin", params.clone()).map_err(|_| Stop::Gone)?;
    result(a, &format!("backup_begin {params}"))?;
    d.backups += 1;
    {
        let mut view = Conn::connect(at.socket, VIEW, Duration::from_secs(30))
            .map_err(|e| gone_or(ctl, format!("connecting to the backup view {VIEW:?}: {e}")))?;
        let len = ((64u64 << 10) << rng.below(5)).min(view.size);
        let read = |view: &mut Conn, rng: &mut Rng| {
            let off = rng.below(view.size - len + 1) & !511;
            view.read_all(off, len)
        };
        read(&mut view, rng).map_err(|e| gone_or(ctl, format!("reading the backup view {VIEW:?}: {e}")))?;
        d.view_bytes_read += len;
        if rng.below(2) == 0 {
            // Held open: reads of the view until the cut ends them.
            loop {
                std::thread::sleep(Duration::from_millis(rng.below(20)));
                read(&mut view, rng).map_err(|e| gone_or(ctl, format!("reading the backup view {VIEW:?}: {e}")))?;
                d.view_bytes_read += len;
            }
        }
    }
    let a = ctl.call("backup_end", json!({"view": VIEW})).map_err(|_| Stop::Gone)?;
    result(a, &format!("backup_end {VIEW}"))?;
    d.backup = false;
    d.backups_ended += 1;
    Ok(())
}

/// Starts a copying job and waits for it to end; on `done`, the chain it made.
fn job(ctl: &mut Control, method: &str, params: Value, op: Op, d: &mut Drove) -> Result<(), Stop> {
    let a = ctl.call(method, params.clone()).map_err(|_| Stop::Gone)?;
    let id = result(a, &format!("{method} {params}"))?["job"].as_u64().unwrap_or(0);
    d.running = Some(op);
    let (state, error) = wait_job(ctl, id, &["running"]).map_err(|_| Stop::Gone)?;
    if state != "done" {
        return Err(Stop::Failed(format!("{method} (job {id}) ended {state}: {error}")));
    }
    d.running = None;
    match op {
        Op::Stream => d.layers.truncate(1),
        _ => {
            d.layers.remove(1);
        }
    }
    Ok(())
}

/// Polls `job_list` until job `id` is in none of the states `while_in`: its state and error.
fn wait_job(ctl: &mut Control, id: u64, while_in: &[&str]) -> Result<(String, String), String> {
    loop {
        let a = ctl.call("job_list", json!({}))?;
        let job = a["result"].as_array().and_then(|l| l.iter().find(|j| j["id"] == id).cloned());
        let Some(job) = job else { return Err(format!("job {id} is not in job_list: {a}")) };
        let state = job["state"].as_str().unwrap_or("?").to_owned();
        if !while_in.contains(&state.as_str()) {
            return Ok((state, job["error"].to_string()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// After the cut (the storage back, the server gone): which file is the
/// top, the chain its headers make (`qemu-img info --backing-chain` must
/// read it) and `qemu-img check` of every qcow2 layer. Returns a note for
/// the round's error messages.
pub fn after_cut(chain: &mut Chain, d: Drove, stats: &mut LiveStats) -> Result<String, String> {
    for op in &d.done {
        match op {
            Op::Snapshot => stats.snapshots += 1,
            Op::Stream => stats.streams += 1,
            Op::Commit => stats.commits += 1,
            Op::Mirror => stats.pivots += 1,
            Op::BackupView => {}
        }
    }
    stats.mirrors += d.mirrors;
    stats.mirrors_cancelled += d.mirrors_cancelled;
    stats.backups += d.backups;
    stats.backups_ended += d.backups_ended;
    stats.view_bytes_read += d.view_bytes_read;
    // A snapshot that failed was asked after the storage died, not cut.
    let mid_snapshot = d.pending.is_some() && d.error.is_none();
    let mid_backup = d.backup && d.error.is_none();
    if mid_snapshot || d.running.is_some() || mid_backup {
        stats.cuts_mid_job += 1;
    }
    match (mid_snapshot, d.running) {
        (true, _) => stats.cuts_mid[0] += 1,
        (_, Some(Op::Stream)) => stats.cuts_mid[1] += 1,
        (_, Some(Op::Commit)) => stats.cuts_mid[2] += 1,
        (_, Some(Op::Mirror)) => stats.cuts_mid[3] += 1,
        _ if mid_backup => stats.cuts_mid[4] += 1,
        _ => {}
    }
    // The scratch file never had a name: nothing of it may be left.
    if let Ok(dir) = std::fs::read_dir(&chain.scratch) {
        let left: Vec<String> = dir.flatten().map(|e| e.path().display().to_string()).collect();
        if !left.is_empty() {
            return Err(format!(
                "after the cut the backup scratch directory holds {left:?}: a scratch file had a name"
            ));
        }
    }
    chain.next_asked = d.next_asked;
    chain.made = d.made;
    let mut top = d.layers[0].clone();
    chain.fallback = None;
    if let Some((target, true)) = &d.mirror {
        // The pivot was asked, not seen done: the target if it holds every
        // flushed write (the judge says), else the chain as it was.
        // A target that does not open was not pivoted to (a pivot flushes
        // the target before it switches): the old chain straight away.
        stats.pivots_unanswered += 1;
        let old = backing_chain(&top).map_err(|e| format!("after the cut the chain from {}: {e}", top.display()))?;
        let whole = backing_chain(target).and_then(|l| {
            l.iter().filter(|l| l.extension().is_some_and(|e| e == "qcow2")).try_for_each(|l| qemu_img_check(l))
        });
        if whole.is_ok() && std::fs::metadata(target).is_ok_and(|m| m.len() > 0) {
            chain.fallback = Some(old);
            top = target.clone();
        } else {
            stats.pivots_unanswered_on_old += 1;
        }
    }
    if let Some(p) = &d.pending {
        // The swap comes after the overlay's header is durable: if it reads
        // as an overlay of the top, writes may be in it already.
        match backing_chain(p) {
            Ok(l) if l.get(1) == Some(&top) => {
                top = p.clone();
                stats.unanswered_snapshot_tops += 1;
            }
            _ => {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let layers = backing_chain(&top).map_err(|e| format!("after the cut the chain from {}: {e}", top.display()))?;
    for l in &layers {
        if l.extension().is_some_and(|e| e == "qcow2") {
            qemu_img_check(l)?;
        }
    }
    chain.interrupted = d.running;
    let note = format!(
        "; chain {}{}{}",
        layers.iter().map(|l| l.display().to_string()).collect::<Vec<_>>().join(" <- "),
        d.running.map(|o| format!(", cut during a {}", o.name())).unwrap_or_default(),
        d.pending.as_ref().map(|p| format!(", cut during a snapshot to {}", p.display())).unwrap_or_default(),
    ) + &d
        .mirror
        .as_ref()
        .map(|(t, p)| {
            format!(", cut during a mirror to {}{}", t.display(), if *p { " after its pivot was asked" } else { "" })
        })
        .unwrap_or_default()
        + if mid_backup { ", cut during a backup view" } else { "" };
    chain.layers = layers;
    // Overlays that left the chain (committed or streamed away) are removed.
    if let Ok(dir) = std::fs::read_dir(&chain.images) {
        for e in dir.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            // A layer's own files (a raw layer's bitmap sidecar) are named after it.
            let layer = |l: &PathBuf| l.file_name().is_some_and(|f| name.starts_with(&*f.to_string_lossy()));
            let kept = chain.layers.iter().chain(chain.fallback.iter().flatten()).any(layer);
            if (name.starts_with("snap") || name.starts_with("mirror")) && !kept {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    Ok(note)
}

/// After the judge passed on the restarted server: the bitmap's verdict,
/// the interrupted job started again (it must finish and the disk read the
/// same), a new bitmap on the top.
pub fn after_read(
    chain: &mut Chain,
    control: &Path,
    socket: &Path,
    now: &[u8],
    stats: &mut LiveStats,
) -> Result<(), String> {
    let export = chain.export();
    let mut ctl = Control::connect(control)?;
    if chain.bitmaps {
        check_bitmap(chain, &mut ctl, &export, socket, now, stats)?;
    }
    if let Some(op) = chain.interrupted.take() {
        let depth = chain.layers.len();
        let (method, runs) = match op {
            Op::Commit => ("export_commit", depth >= 3),
            Op::Stream => ("export_stream", depth >= 2),
            _ => ("", false),
        };
        // (A commit or stream the cut caught after its swap has nothing left to do.)
        if runs {
            let a = ctl.call(method, json!({"name": export}))?;
            if let Some(e) = a.get("error") {
                return Err(format!("{method} again after the cut was refused: {e}"));
            }
            let id = a["result"]["job"].as_u64().unwrap_or(0);
            let started = Instant::now();
            let (state, error) = wait_job(&mut ctl, id, &["running"])?;
            if state != "done" {
                return Err(format!("{method} again after the cut ended {state} ({error})"));
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err(format!("{method} again after the cut took {:?}", started.elapsed()));
            }
            let again = Conn::connect(socket, "", Duration::from_secs(30))
                .and_then(|mut c| c.read_all(0, now.len() as u64))
                .map_err(|e| format!("reading the disk after {method} again: {e}"))?;
            if again != now {
                let at = again.iter().zip(now).position(|(a, b)| a != b).unwrap_or(0);
                return Err(format!("{method} again after the cut changed what the disk reads (first at byte {at})"));
            }
            let top = chain.top().to_owned();
            chain.layers = backing_chain(&top).map_err(|e| format!("after {method} again: {e}"))?;
            for l in &chain.layers {
                if l.extension().is_some_and(|e| e == "qcow2") {
                    qemu_img_check(l)?;
                }
            }
            stats.jobs_restarted += 1;
        }
    }
    if chain.bitmaps {
        let a = ctl.call("bitmap_add", json!({"export": export, "name": BITMAP}))?;
        if let Some(e) = a.get("error") {
            return Err(format!("bitmap_add {BITMAP} on {export}: {e}"));
        }
        chain.bitmap = Some((chain.top().to_owned(), now.to_vec()));
    }
    Ok(())
}

/// The bitmap added after the last round: on the same top it must be there,
/// and either marked inconsistent or consistent and dirty over every
/// 512-byte piece that changed since it was added. A backup's begin may have
/// disabled it and started [`NEXT_BITMAP`]: then the two together must cover
/// every change (unless one is marked inconsistent), and a disabled bitmap
/// with no begin asked is an error. Both are removed after.
fn check_bitmap(
    chain: &mut Chain,
    ctl: &mut Control,
    export: &str,
    socket: &Path,
    now: &[u8],
    stats: &mut LiveStats,
) -> Result<(), String> {
    let next_asked = std::mem::take(&mut chain.next_asked);
    let Some((on, then)) = chain.bitmap.take() else { return Ok(()) };
    // A snapshot or pivot since: the bitmap followed the export onto its new top.
    let moved = on != chain.top();
    let a = ctl.call("bitmap_list", json!({"export": export}))?;
    let listed = |name: &str| a["result"].as_array().and_then(|l| l.iter().find(|b| b["name"] == name).cloned());
    if moved && listed(BITMAP).is_none() && listed(NEXT_BITMAP).is_none() {
        stats.bitmaps_lost_at_swap += 1;
        return Ok(());
    }
    let Some(b) = listed(BITMAP) else {
        return Err(format!(
            "bitmap {BITMAP:?} of {} (added, then saved by a clean stop) is gone after the cut: {a}",
            on.display()
        ));
    };
    let next = listed(NEXT_BITMAP);
    if next.is_some() && !next_asked {
        return Err(format!("bitmap {NEXT_BITMAP:?} of {} is there, and no backup asked for it: {a}", on.display()));
    }
    let mut judged = vec![BITMAP];
    if b["inconsistent"] == true || next.as_ref().is_some_and(|n| n["inconsistent"] == true) {
        stats.bitmaps_inconsistent += 1;
    } else if b["enabled"] == true {
        covers(export, socket, &[BITMAP], &then, now, &on)?;
        stats.bitmaps_consistent += 1;
    } else if !next_asked {
        return Err(format!(
            "bitmap {BITMAP:?} of {} came back disabled and consistent, and no backup disabled it: it stopped \
             marking in silence: {a}",
            on.display()
        ));
    } else if next.is_some() {
        judged.push(NEXT_BITMAP);
        covers(export, socket, &judged, &then, now, &on)?;
        stats.bitmap_pairs_covering += 1;
    } else {
        stats.new_bitmaps_lost += 1;
    }
    if next.is_some() && !judged.contains(&NEXT_BITMAP) {
        judged.push(NEXT_BITMAP);
    }
    for name in judged {
        let a = ctl.call("bitmap_remove", json!({"export": export, "name": name}))?;
        if let Some(e) = a.get("error") {
            return Err(format!("bitmap_remove {name} on {export}: {e}"));
        }
    }
    Ok(())
}

/// Every 512-byte piece that differs between `then` and `now` must be dirty
/// in one of `names` (consistent bitmaps of the export, read with `nbdinfo --map`).
fn covers(export: &str, socket: &Path, names: &[&str], then: &[u8], now: &[u8], on: &Path) -> Result<(), String> {
    let uri = format!("nbd+unix:///{export}?socket={}", socket.display());
    let mut dirty: Vec<(u64, u64)> = Vec::new();
    for name in names {
        let out = Command::new("nbdinfo")
            .arg(format!("--map=qemu:dirty-bitmap:{name}"))
            .arg(&uri)
            .output()
            .map_err(|e| format!("cannot run nbdinfo (install libnbd-bin, or leave bitmaps out of --jobs): {e}"))?;
        if !out.status.success() {
            return Err(format!("nbdinfo --map on {uri}: {}", String::from_utf8_lossy(&out.stderr)));
        }
        dirty.extend(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (o, n, fl) = (f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, f.get(2)?.parse::<u32>().ok()?);
            (fl & 1 == 1).then_some((o, n))
        }));
    }
    for (i, (a, b)) in then.chunks(512).zip(now.chunks(512)).enumerate() {
        let at = (i * 512) as u64;
        if a != b && !dirty.iter().any(|&(o, n)| o <= at && at < o + n) {
            return Err(format!(
                "bitmap {} of {} came back consistent but short: bytes [{at}, {}) changed since it was added and \
                 it does not mark them (dirty extents: {dirty:?})",
                names.join(" + "),
                on.display(),
                at + 512
            ));
        }
    }
    Ok(())
}

/// The chain from `top` down, as `qemu-img info --backing-chain` reads it.
fn backing_chain(top: &Path) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain", "--output=json"])
        .arg(top)
        .output()
        .map_err(|e| format!("cannot run qemu-img (install qemu-utils): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img info --backing-chain {}: {}",
            top.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("qemu-img info's JSON: {e}"))?;
    let layers: Vec<PathBuf> = v
        .as_array()
        .map(|l| l.iter().filter_map(|i| i["filename"].as_str().map(PathBuf::from)).collect())
        .unwrap_or_default();
    if layers.is_empty() {
        return Err(format!("qemu-img info --backing-chain {} lists no layer", top.display()));
    }
    Ok(layers)
}

/// `qemu-img check` of one layer: clean or leaks only.
pub fn qemu_img_check(image: &Path) -> Result<(), String> {
    let out = Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(image).output().map_err(|e| {
        format!("cannot run qemu-img check (install qemu-utils, or leave qcow2 out: --format raw,cow): {e}")
    })?;
    match out.status.code() {
        Some(0) | Some(3) => Ok(()),
        _ => Err(format!(
            "qemu-img check {} after the crash ({}):\n{}{}",
            image.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}
