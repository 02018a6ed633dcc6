//! `vdisk soak`: runs this binary's own `vdisk serve` through what production
//! will do to it, and says whether it held: crash rounds (SIGKILL at random
//! moments while several clients write, restart, every block judged) and a
//! load of many clients over several exports with latency percentiles.
//! The soak is a client of the server and nothing more: it owns the record of
//! what was acknowledged, and never reaches into the server's files while
//! the server runs.

mod check;
mod churn;
mod crash;
mod live;
mod load;
mod power;
mod server;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use vdisk_daemon::size::parse_size;
use vdisk_daemon::Error;

/// The engines `vdisk serve --engine` takes.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Uring,
    Threads,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SoakFormat {
    Raw,
    Cow,
    /// A qcow2 overlay over a raw base; `qemu-img check` judges it after every kill.
    Qcow2,
}

/// Live disk operations the crash rounds run beside the writers (`--jobs`).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SoakJob {
    /// `export_snapshot`: a new qcow2 overlay over the top, up to three layers.
    Snapshot,
    /// `export_stream` of the top (paced with a random --bps).
    Stream,
    /// `export_commit` of the middle layer into the one below (paced).
    Commit,
    /// A dirty bitmap on the top through the rounds (judged after every cut).
    Bitmaps,
    /// `export_mirror` to a new raw or qcow2 file (paced); once ready: pivot, cancel, or cut.
    Mirror,
    /// `backup_begin` of a view (with the bitmap and a new one under bitmaps), read over NBD, ended or cut.
    Backup,
}

/// What ends a crash round.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PowerLoss {
    /// SIGKILL only: the host keeps every write (the default).
    Off,
    /// The storage loses every write it was not asked to fsync.
    Drop,
    /// The storage keeps what was fsynced and a random part of the rest.
    Partial,
    /// Alternate drop and partial rounds.
    Mixed,
}

/// Stress `vdisk serve` as production will: crash rounds and a many-client load.
#[derive(Args)]
#[command(
    about = "Stress `vdisk serve`: SIGKILL crash rounds (every acknowledged, flushed write must survive) and a \
             many-client load with latency percentiles",
    after_help = "Each crash round starts `vdisk serve` on a small image, has 4 connections write
generation-tagged 1000-byte blocks with FLUSH, FUA, WRITE_ZEROES and TRIM mixed in,
kills the server with SIGKILL 3-200 ms in, restarts it and reads the whole disk: every
write acknowledged before a completed FLUSH (or with FUA, or under --sync) must be there,
and no sector may hold data never written to it. Rounds cycle through raw images, COW
and qcow2 overlays (checked with qemu-img check after each round), each engine, with
and without --sync.

With --power-loss (only in a build with the powercut feature: `cargo build --release
--features powercut`) the images live on a FUSE file system this process mounts (needs
/dev/fuse and root) that keeps only what was fsynced: each round cuts its power at a
random moment or when an FSYNC arrives (the storage dies first, then the server), then
restarts the server on what the storage made durable (drop), or on that plus a random
part of the unsynced writes, torn at 512-byte boundaries (partial). Only flushed, FUA
and --sync writes must survive then. Rounds cycle through normal, --sync and --direct;
half of them the storage answers OPEN with FOPEN_DIRECT_IO.

The load serves --exports sparse images from one server to --connections clients,
each in a region of its own, with mixed reads, writes, flushes, trims and zeroes; every
read is checked as it comes, and every region again after a restart. Latency
percentiles per command are printed. Exit status 0 only when nothing was lost and no
request failed.

With --jobs the crash rounds also work the disk live through the server's control
socket while the writers run: snapshots (qcow2 overlays, the chain grows to three
layers), streams of the top and commits of the middle layer, paced with a random --bps
so the cut often lands mid-job, and (bitmaps) a dirty bitmap on the top. After each
cut the soak restarts on the newest top whose header reads back (the overlay of an
unanswered snapshot counts), `qemu-img info --backing-chain` must read the chain and
`qemu-img check` pass on every qcow2 layer, the judge reads the disk, an interrupted
job is started again and must finish with the disk unchanged, and the bitmap must be
marked inconsistent or cover every 512-byte piece changed since it was added. Mirrors
(mirror) go to a new raw or qcow2 file; once ready they pivot, are cancelled or run to
the cut; after a cut the soak restarts on the target only when the pivot was seen done,
or (asked, not seen done) when the target holds every flushed write, else on the old
chain. Backup views (backup) begin with the bitmap as the view's and a new bitmap beside
it, are read over NBD, and end or are cut: the disk must hold no scratch data, the
scratch directory must be empty, and the old and new bitmaps together must cover every
change unless one is marked inconsistent. Formats raw and qcow2 only (qemu-img cannot
read a COW layer).

Examples:
  vdisk soak                                  2000 rounds, then 60 s of load per engine
  vdisk soak --rounds 60 --seconds 0 --format raw,qcow2 --jobs snapshot,stream,commit,bitmaps
  vdisk soak --rounds 60 --seconds 0 --format raw,qcow2 --jobs snapshot,mirror,backup,bitmaps
  vdisk soak --rounds 100 --seconds 0         crash rounds only
  vdisk soak --rounds 60 --seconds 0 --power-loss mixed    power cuts
  vdisk soak --rounds 0 --seconds 300 --engine uring --json
  vdisk soak --rounds 0 --seconds 20 --exports 1000 --export-size 32M    16 loaded, 984 added and removed"
)]
pub struct SoakArgs {
    /// Crash rounds (0: none).
    #[arg(long, default_value_t = 2000)]
    pub rounds: usize,
    /// Seconds of load, per engine (0: none).
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Client connections during the load.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub connections: u16,
    /// Exports on the load's server. The load's connections are spread over the first 16; any
    /// beyond those are 1 MiB sparse files added through the server's control socket while the
    /// load runs, then removed and added again 16 at a time until it ends, each probed after
    /// every add (its last write still there, a new one written and read back), all removed at
    /// the end.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=20000))]
    pub exports: u16,
    /// Size of each load export (K/M/G suffixes).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub export_size: u64,
    /// Engines to soak, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["uring", "threads"])]
    pub engine: Vec<EngineArg>,
    /// Image formats for the crash rounds, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["raw", "cow", "qcow2"])]
    pub format: Vec<SoakFormat>,
    /// End crash rounds with a power cut of the images' storage instead of a SIGKILL alone
    /// (needs a build with the `powercut` feature: test machinery, not in a release build).
    #[arg(long, value_enum, default_value = "off")]
    pub power_loss: PowerLoss,
    /// Live disk operations to run during the crash rounds, comma-separated (snapshot, stream, commit,
    /// mirror, backup, bitmaps; stream and commit need snapshot). Formats raw and qcow2 only.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub jobs: Vec<SoakJob>,
    /// Directory for the images (default: a new one under $TMPDIR, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Seed for every random choice (default: from the clock); printed, so a failure can be replayed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// xorshift64*: small, deterministic from a seed, good enough to pick blocks and moments.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn engine_name(e: EngineArg) -> &'static str {
    match e {
        EngineArg::Uring => "uring",
        EngineArg::Threads => "threads",
    }
}

pub fn run(a: SoakArgs) -> Result<(), Error> {
    #[cfg(not(feature = "powercut"))]
    if a.power_loss != PowerLoss::Off {
        return Err(Error::invalid(power::NOT_BUILT));
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let jobs = jobs_plan(&a)?;
    let (dir, temporary) = match &a.dir {
        Some(d) => (d.clone(), false),
        None => (std::env::temp_dir().join(format!("vdisk-soak-{}", std::process::id())), true),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::invalid(format!("cannot create {}: {e} (pick another with --dir)", dir.display())))?;
    // Absolute: the overlays' headers name their backing files by these paths.
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    let engines: Vec<String> = a.engine.iter().map(|&e| engine_name(e).to_owned()).collect();
    if !a.json {
        eprintln!(
            "vdisk soak: seed {seed} (--seed {seed} repeats the random choices; timing still varies), images in {}",
            dir.display()
        );
    }
    let mut json = serde_json::json!({ "seed": seed });
    let keep = |msg: String| Error::failed(format!("{msg}\n(the images are kept in {} for inspection)", dir.display()));
    if a.rounds > 0 {
        json["crash"] = crash_phase(&a, &dir, &engines, seed, &jobs).map_err(keep)?;
    }
    let mut failed = Vec::new();
    if a.seconds > 0 {
        let mut runs = Vec::new();
        for (i, engine) in engines.iter().enumerate() {
            let (run, error) = load_phase(&a, &dir, engine, seed ^ (i as u64 + 1)).map_err(keep)?;
            runs.push(run);
            failed.extend(error);
        }
        json["load"] = serde_json::Value::Array(runs);
    }
    if a.json {
        println!("{json}");
    }
    if !failed.is_empty() {
        return Err(keep(failed.join("\n")));
    }
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// `--jobs` as the crash rounds take it; refused before anything starts
/// when the rounds cannot run it.
fn jobs_plan(a: &SoakArgs) -> Result<crash::Jobs, Error> {
    let ops: Vec<live::Op> = a
        .jobs
        .iter()
        .filter_map(|j| match j {
            SoakJob::Snapshot => Some(live::Op::Snapshot),
            SoakJob::Stream => Some(live::Op::Stream),
            SoakJob::Commit => Some(live::Op::Commit),
            SoakJob::Mirror => Some(live::Op::Mirror),
            SoakJob::Backup => Some(live::Op::BackupView),
            SoakJob::Bitmaps => None,
        })
        .collect();
    live::check_ops(&ops).map_err(Error::invalid)?;
    let plan = crash::Jobs { ops, bitmaps: a.jobs.contains(&SoakJob::Bitmaps) };
    if (plan.bitmaps || !plan.ops.is_empty()) && a.format.contains(&SoakFormat::Cow) {
        return Err(Error::invalid(
            "--jobs runs on raw and qcow2 images only (qemu-img, which checks the chain after every cut, cannot \
             read a COW layer): add --format raw,qcow2",
        ));
    }
    Ok(plan)
}

/// The crash rounds; their summary for the JSON report.
fn crash_phase(
    a: &SoakArgs,
    dir: &std::path::Path,
    engines: &[String],
    seed: u64,
    jobs: &crash::Jobs,
) -> Result<serde_json::Value, String> {
    let formats: Vec<crash::Format> = a
        .format
        .iter()
        .map(|f| match f {
            SoakFormat::Raw => crash::Format::Raw,
            SoakFormat::Cow => crash::Format::Cow,
            SoakFormat::Qcow2 => crash::Format::Qcow2,
        })
        .collect();
    let ending = match a.power_loss {
        PowerLoss::Off => crash::Ending::Kill,
        PowerLoss::Drop => crash::Ending::PowerLoss,
        PowerLoss::Partial => crash::Ending::PowerLossPartial,
        PowerLoss::Mixed => crash::Ending::PowerLossMixed,
    };
    let matrix = crash::Matrix { formats: &formats, engines, ending, jobs };
    let r = crash::run(dir, a.rounds, &matrix, seed, !a.json)?;
    if !a.json {
        println!(
            "crash: {} rounds in {:.1} s: {} writes sent, {} acknowledged, {} flushes; every round verified \
             ({} blocks whose surviving generation was pinned)",
            r.rounds,
            r.elapsed.as_secs_f64(),
            r.writes_sent,
            r.writes_acked,
            r.flushes,
            r.checked_blocks
        );
        if jobs.bitmaps || !jobs.ops.is_empty() {
            let l = &r.live;
            println!(
                "  live operations: {} snapshots, {} streams, {} commits done; {} cuts mid-job ({} in a snapshot, {} in a \
                 stream, {} in a commit), {} jobs started \
                 again and finished, {} restarts on an unanswered snapshot's overlay; bitmaps after a cut: {} \
                 consistent and covering, {} marked inconsistent, {} lost to a cut mid-swap",
                l.snapshots,
                l.streams,
                l.commits,
                l.cuts_mid_job,
                l.cuts_mid[0],
                l.cuts_mid[1],
                l.cuts_mid[2],
                l.jobs_restarted,
                l.unanswered_snapshot_tops,
                l.bitmaps_consistent,
                l.bitmaps_inconsistent,
                l.bitmaps_lost_at_swap
            );
            if jobs.ops.iter().any(|o| matches!(o, live::Op::Mirror | live::Op::BackupView)) {
                println!(
                    "  mirrors: {} started, {} pivoted, {} cancelled, {} cuts mid-mirror ({} after a pivot was asked: \
                     {} restarted on the target, {} on the old chain); backup views: {} begun, {} ended, {} cuts \
                     mid-backup, {} bytes of views read; bitmap pairs covering: {}, new bitmaps lost: {}",
                    l.mirrors,
                    l.pivots,
                    l.mirrors_cancelled,
                    l.cuts_mid[3],
                    l.pivots_unanswered,
                    l.unanswered_pivot_on_target,
                    l.pivots_unanswered_on_old,
                    l.backups,
                    l.backups_ended,
                    l.cuts_mid[4],
                    l.view_bytes_read,
                    l.bitmap_pairs_covering,
                    l.new_bitmaps_lost
                );
            }
        }
    }
    Ok(serde_json::json!({
        "rounds": r.rounds, "seconds": r.elapsed.as_secs_f64(), "writes_sent": r.writes_sent,
        "writes_acked": r.writes_acked, "flushes": r.flushes, "pinned_blocks": r.checked_blocks,
        "cuts_at_fsync": r.cuts_at_fsync, "live": r.live.json(),
    }))
}

/// The load run on one engine: its JSON report, and the failure to report if it saw errors.
fn load_phase(
    a: &SoakArgs,
    dir: &std::path::Path,
    engine: &str,
    seed: u64,
) -> Result<(serde_json::Value, Option<String>), String> {
    let cfg = load::LoadConfig {
        dir,
        engine,
        connections: a.connections as usize,
        exports: (a.exports as usize).min(churn::BUSY),
        export_size: a.export_size,
        duration: Duration::from_secs(a.seconds),
        seed,
        churn: (a.exports as usize).saturating_sub(churn::BUSY),
    };
    let r = load::run(&cfg)?;
    let requests: u64 = r.latency.iter().map(|(_, h)| h.len()).sum();
    if !a.json {
        print_load(a, engine, &r, requests);
    }
    let mut latency = serde_json::Map::new();
    for (cmd, h) in &r.latency {
        latency.insert(
            format!("{cmd:?}").to_lowercase(),
            serde_json::json!({
                "count": h.len(), "p50": h.value_at_quantile(0.5), "p99": h.value_at_quantile(0.99),
                "p999": h.value_at_quantile(0.999), "max": h.max(),
            }),
        );
    }
    let run = serde_json::json!({
        "engine": engine, "seconds": r.seconds, "connections": a.connections, "exports": a.exports,
        "requests": requests, "bytes": r.bytes, "errors": r.error_count, "error_messages": r.errors,
        "verified_blocks": r.verified_blocks, "latency_us": latency,
        "churn": r.churn.as_ref().map(|c| c.json()),
    });
    let failed = (r.error_count > 0)
        .then(|| format!("load ({engine}): {} errors, first: {}", r.error_count, r.errors.join("; ")));
    Ok((run, failed))
}

/// The load run's summary and latency table, for people.
fn print_load(a: &SoakArgs, engine: &str, r: &load::LoadReport, requests: u64) {
    println!(
        "load ({engine}): {} connections over {} exports for {:.1} s: {requests} requests ({:.0}/s), \
         {:.0} MiB/s of data, {} errors, {} blocks verified after a restart",
        a.connections,
        a.exports.min(churn::BUSY as u16),
        r.seconds,
        requests as f64 / r.seconds,
        r.bytes as f64 / r.seconds / (1 << 20) as f64,
        r.error_count,
        r.verified_blocks
    );
    if let Some(c) = &r.churn {
        println!(
            "  beside them {} exports through the control socket: all added in {:.1} s; {} adds, {} removes, {} \
             probes (each: its last write read back, a new one written and read back), {} errors",
            c.exports, c.first_add_seconds, c.adds, c.removes, c.probes, c.error_count
        );
    }
    println!("  {:<7} {:>9} {:>9} {:>9} {:>10} {:>9}", "command", "count", "p50 µs", "p99 µs", "p99.9 µs", "max µs");
    for (cmd, h) in &r.latency {
        println!(
            "  {:<7} {:>9} {:>9} {:>9} {:>10} {:>9}",
            format!("{cmd:?}").to_lowercase(),
            h.len(),
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        );
    }
}
