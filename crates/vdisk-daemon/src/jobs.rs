//! The daemon's job table: every live disk operation (snapshot now; commit,
//! stream and mirror to come, see docs/block-jobs.md) is a job with an id,
//! its type and export, bytes done of a total, a state and, once failed, its
//! error. `vdisk ctl jobs` lists them. A job that ended stays listed (the
//! last [`KEPT`] of them) so its outcome can be read after the fact.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How many ended jobs the table keeps.
pub const KEPT: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    Done,
    Failed,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
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
}

impl Job {
    pub fn set_total(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }

    pub fn add_done(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Ends the job with `result` (its error, if any, is what `jobs` shows).
    pub fn finish<T, E: std::fmt::Display>(&self, result: &Result<T, E>) {
        let (state, error) = match result {
            Ok(_) => (JobState::Done, None),
            Err(e) => (JobState::Failed, Some(e.to_string())),
        };
        *self.end.lock().unwrap() = Some((state, error, self.started.elapsed()));
    }

    fn info(&self) -> JobInfo {
        let end = self.end.lock().unwrap().clone();
        let (state, error, elapsed) = end.unwrap_or((JobState::Running, None, self.started.elapsed()));
        JobInfo {
            id: self.id,
            kind: self.kind,
            export: self.export.clone(),
            done: self.done.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
            state,
            error,
            elapsed,
        }
    }

    fn ended(&self) -> bool {
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
}
