//! The daemon's job table: every live disk operation (snapshot, stream,
//! commit, mirror; docs/block-jobs.md) is a job with an id, its type and
//! export, bytes done of a total, a state and, once failed, its error.
//! `vdisk ctl jobs` lists them. A job that ended stays listed (the last
//! [`KEPT`] of them) so its outcome can be read after the fact.
//!
//! A copying job runs on its own thread ([`Jobs::spawn`]); one export has at
//! most one running job. The thread looks at [`Job::cancelled`] and
//! [`Job::pivot_requested`] between chunks, paces its own I/O with
//! [`Job::pace`] (the job's `--bps`), and says when it is [`JobState::Ready`]
//! (a mirror whose copy has caught up, waiting for `pivot` or `cancel`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, ErrorKind};

/// How many ended jobs the table keeps.
pub const KEPT: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    /// Caught up (a mirror, an active commit): waiting for `pivot` or `cancel`.
    Ready,
    Done,
    Failed,
    /// Stopped by `cancel`: the export serves as before the job.
    Cancelled,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Ready => "ready",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// A job as `jobs` lists it.
#[derive(Clone, Debug)]
pub struct JobInfo {
    pub id: u64,
    /// "snapshot" (later "commit", "stream", "mirror").
    pub kind: &'static str,
    pub export: String,
    pub done: u64,
    pub total: u64,
    pub state: JobState,
    pub error: Option<String>,
    /// Since it started, or how long it ran.
    pub elapsed: Duration,
    /// Bytes done per second, on average since it started.
    pub rate: u64,
    /// Its own I/O limit in bytes per second (0: none).
    pub bps: u64,
    /// The guest's writes wait for the job's target (a synchronous mirror).
    pub synchronous: bool,
}

/// One job's live record, updated by whoever runs it.
pub struct Job {
    pub id: u64,
    pub kind: &'static str,
    pub export: String,
    started: Instant,
    done: AtomicU64,
    total: AtomicU64,
    end: Mutex<Option<(JobState, Option<String>, Duration)>>,
    ready: AtomicBool,
    synchronous: AtomicBool,
    cancel: AtomicBool,
    pivot: AtomicBool,
    /// Why `pivot` is refused, for a job that cannot pivot (set before it is ready).
    no_pivot: Mutex<Option<String>>,
    /// The job's own I/O limit in bytes per second (0: none) and its pacing.
    bps: AtomicU64,
    paced: Mutex<Pacer>,
}

/// When the job's I/O so far may have ended at its `bps`.
#[derive(Default)]
struct Pacer {
    since: Option<Instant>,
    bytes: u64,
}

impl Job {
    pub fn set_total(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }

    pub fn add_done(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Says whether the job has caught up and waits for `pivot` or `cancel`.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Says whether the guest's writes now wait for the job's target.
    pub fn set_synchronous(&self, on: bool) {
        self.synchronous.store(on, Ordering::Release);
    }

    /// Asks the job to stop and leave the export as it was.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// Asks a ready job to switch the export to what it made.
    pub fn request_pivot(&self) {
        self.pivot.store(true, Ordering::Release);
    }

    pub fn pivot_requested(&self) -> bool {
        self.pivot.load(Ordering::Acquire)
    }

    /// Says, before the job is ready, that it cannot pivot, and `why` (what
    /// a `pivot` of it is answered).
    pub fn refuse_pivot(&self, why: String) {
        *self.no_pivot.lock().unwrap() = Some(why);
    }

    /// Why the job cannot pivot, if it cannot.
    pub fn pivot_refused(&self) -> Option<String> {
        self.no_pivot.lock().unwrap().clone()
    }

    /// Sets the job's own I/O limit (bytes per second, 0 for none).
    pub fn set_bps(&self, bps: u64) {
        self.bps.store(bps, Ordering::Relaxed);
        *self.paced.lock().unwrap() = Pacer::default();
    }

    pub fn bps(&self) -> u64 {
        self.bps.load(Ordering::Relaxed)
    }

    /// Counts `bytes` of the job's I/O against its `bps` and sleeps as long
    /// as it is ahead of that rate (in steps, waking early on `cancel`).
    pub fn pace(&self, bytes: u64) {
        let Some(due) = self.count(bytes) else { return };
        while !self.cancelled() {
            let now = Instant::now();
            if now >= due {
                break;
            }
            std::thread::sleep((due - now).min(Duration::from_millis(50)));
        }
    }

    /// Counts `bytes` of the job's I/O against its `bps`: when the job's I/O
    /// so far may have ended at that rate (None with no limit).
    pub fn count(&self, bytes: u64) -> Option<Instant> {
        let bps = self.bps();
        if bps == 0 {
            return None;
        }
        let mut p = self.paced.lock().unwrap();
        let since = *p.since.get_or_insert_with(Instant::now);
        p.bytes += bytes;
        Some(since + Duration::from_secs_f64(p.bytes as f64 / bps as f64))
    }

    /// Ends the job with `result` (its error, if any, is what `jobs` shows);
    /// a job that ends well after `cancel` ends cancelled.
    pub fn finish<T, E: std::fmt::Display>(&self, result: &Result<T, E>) {
        let (state, error) = match result {
            Ok(_) if self.cancelled() => (JobState::Cancelled, None),
            Ok(_) => (JobState::Done, None),
            Err(e) => (JobState::Failed, Some(e.to_string())),
        };
        *self.end.lock().unwrap() = Some((state, error, self.started.elapsed()));
    }

    /// The job as `jobs` lists it.
    pub fn info(&self) -> JobInfo {
        let end = self.end.lock().unwrap().clone();
        let synchronous = end.is_none() && self.synchronous.load(Ordering::Acquire);
        let running = if self.ready.load(Ordering::Acquire) { JobState::Ready } else { JobState::Running };
        let (state, error, elapsed) = end.unwrap_or((running, None, self.started.elapsed()));
        let done = self.done.load(Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        JobInfo {
            id: self.id,
            kind: self.kind,
            export: self.export.clone(),
            done,
            rate: if secs > 0.0 { (done as f64 / secs) as u64 } else { 0 },
            bps: self.bps(),
            total: self.total.load(Ordering::Relaxed),
            state,
            error,
            elapsed,
            synchronous,
        }
    }

    pub fn ended(&self) -> bool {
        self.end.lock().unwrap().is_some()
    }
}

/// Every job of the daemon, oldest first.
#[derive(Default)]
pub struct Jobs {
    next: AtomicU64,
    list: Mutex<Vec<Arc<Job>>>,
}

impl Jobs {
    /// Records a new running job of `kind` on `export`.
    pub fn start(&self, kind: &'static str, export: &str) -> Arc<Job> {
        let job = Arc::new(Job {
            id: self.next.fetch_add(1, Ordering::Relaxed) + 1,
            kind,
            export: export.to_owned(),
            started: Instant::now(),
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
            end: Mutex::new(None),
            ready: AtomicBool::new(false),
            synchronous: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            pivot: AtomicBool::new(false),
            no_pivot: Mutex::new(None),
            bps: AtomicU64::new(0),
            paced: Mutex::new(Pacer::default()),
        });
        let mut list = self.list.lock().unwrap();
        let ended = list.iter().filter(|j| j.ended()).count();
        if ended >= KEPT {
            let mut drop = ended + 1 - KEPT;
            list.retain(|j| {
                let gone = drop > 0 && j.ended();
                drop -= gone as usize;
                !gone
            });
        }
        list.push(job.clone());
        job
    }

    pub fn list(&self) -> Vec<JobInfo> {
        self.list.lock().unwrap().iter().map(|j| j.info()).collect()
    }

    /// The job numbered `id`, running or ended.
    pub fn get(&self, id: u64) -> Option<Arc<Job>> {
        self.list.lock().unwrap().iter().find(|j| j.id == id).cloned()
    }

    /// The job running on `export`, if any.
    pub fn running_on(&self, export: &str) -> Option<Arc<Job>> {
        self.list.lock().unwrap().iter().find(|j| j.export == export && !j.ended()).cloned()
    }

    /// A running job on `export` other than job `id`: what a job that does
    /// not copy (a snapshot) checks, since it changes the chain a copy reads.
    pub fn other_running_on(&self, export: &str, id: u64) -> Option<Arc<Job>> {
        self.list.lock().unwrap().iter().find(|j| j.export == export && j.id != id && !j.ended()).cloned()
    }

    /// Refuses while `export` has a running job (one export has one at a
    /// time): the refusal a `kind` job gets when it would start.
    pub fn check_free(&self, kind: &str, export: &str) -> Result<(), Error> {
        free(&self.list.lock().unwrap(), kind, export)
    }

    /// Starts `work` as a job of `kind` on `export`, on a thread of its own
    /// (`job-ID`), limited to `bps` bytes per second of its own I/O (0: none);
    /// its result ends the job. Refused while `export` has a running job
    /// ([`Jobs::check_free`]).
    pub fn spawn<E: std::fmt::Display>(
        &self,
        kind: &'static str,
        export: &str,
        bps: u64,
        work: impl FnOnce(&Job) -> Result<(), E> + Send + 'static,
    ) -> Result<Arc<Job>, Error> {
        // Checked and recorded under one lock, so two starts cannot both pass.
        let job = {
            let list = self.list.lock().unwrap();
            free(&list, kind, export)?;
            drop(list);
            self.start(kind, export)
        };
        job.set_bps(bps);
        let run = job.clone();
        std::thread::Builder::new()
            .name(format!("job-{}", job.id))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&run)));
                match r {
                    Ok(r) => run.finish(&r),
                    Err(_) => run.finish::<(), _>(&Err("the job panicked (a bug: see the log); the export serves on")),
                }
            })
            .map_err(|e| {
                job.finish::<(), _>(&Err(format!("cannot start a thread: {e}")));
                Error::failed(format!("{kind} of export {export:?}: cannot start a thread for the job: {e}"))
            })?;
        Ok(job)
    }
}

/// Refuses a `kind` job on `export` if `list` has a running job on it.
fn free(list: &[Arc<Job>], kind: &str, export: &str) -> Result<(), Error> {
    match list.iter().find(|j| j.export == export && !j.ended()) {
        Some(j) => Err(Error::new(
            ErrorKind::Busy,
            format!(
                "{kind} of export {export:?}: it has a running job ({} {}): wait for it or cancel it first",
                j.kind, j.id
            ),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_are_listed_with_their_outcome_and_old_ones_dropped() {
        let jobs = Jobs::default();
        let a = jobs.start("snapshot", "d0");
        a.set_total(10);
        a.add_done(10);
        a.finish::<(), String>(&Ok(()));
        let b = jobs.start("snapshot", "d1");
        b.finish::<(), String>(&Err("overlay exists".into()));
        let l = jobs.list();
        assert_eq!((l[0].id, l[0].state, l[0].done, l[0].total), (1, JobState::Done, 10, 10));
        assert_eq!((l[1].state, l[1].error.as_deref()), (JobState::Failed, Some("overlay exists")));
        let running = jobs.start("snapshot", "d2");
        for _ in 0..KEPT + 5 {
            jobs.start("snapshot", "x").finish::<(), String>(&Ok(()));
        }
        let l = jobs.list();
        assert_eq!(l.len(), KEPT + 1);
        assert!(l.iter().any(|j| j.id == running.id), "a running job is never dropped");
    }

    #[test]
    fn a_spawned_job_runs_alone_on_its_export_and_can_be_cancelled() {
        let jobs = Jobs::default();
        let job = jobs
            .spawn("mirror", "d0", 0, |job: &Job| {
                job.set_ready(true);
                while !job.cancelled() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok::<(), String>(())
            })
            .unwrap();
        let second = jobs.spawn("stream", "d0", 0, |_: &Job| Ok::<(), String>(()));
        let refused = second.err().unwrap();
        assert_eq!(refused.kind(), ErrorKind::Busy);
        assert_eq!(refused.to_string(), jobs.check_free("stream", "d0").unwrap_err().to_string());
        assert!(refused.to_string().starts_with("stream of export \"d0\": it has a running job (mirror "));
        assert!(jobs.check_free("stream", "d1").is_ok());
        while jobs.get(job.id).unwrap().info().state != JobState::Ready {
            std::thread::sleep(Duration::from_millis(5));
        }
        job.cancel();
        while !job.ended() {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(job.info().state, JobState::Cancelled);
        assert!(jobs.running_on("d0").is_none());
    }

    #[test]
    fn pacing_holds_a_job_to_its_bps() {
        let jobs = Jobs::default();
        let job = jobs.start("mirror", "d0");
        job.set_bps(10 << 20);
        let t = Instant::now();
        for _ in 0..3 {
            job.pace(1 << 20);
        }
        // 3 MiB at 10 MiB/s: not before 0.3 s (a lower bound, not a timing).
        assert!(t.elapsed() >= Duration::from_millis(290), "{:?}", t.elapsed());
    }
}
