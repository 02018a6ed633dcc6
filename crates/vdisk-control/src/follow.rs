//! The client side of `vdisk ctl ... --wait` (the binary calls it): follows
//! a job of the server (`job_list`) until it ends, with a progress line as
//! qemu-img prints one (on a terminal one line on stderr redrawn in place;
//! otherwise a line about every 10%), and turns its outcome into the exit
//! status: 0 done, 1 failed (with the job's error) or cancelled. Any verb
//! that starts a job calls [`wait`] with its id.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use serde_json::Value;
use vdisk_daemon::size::one_decimal;
use vdisk_daemon::Error;

/// How often the job table is read.
const POLL: Duration = Duration::from_millis(200);

/// The progress line of a job record of `job_list` ("starting" until the
/// job knows how much it has to do).
pub fn progress_line(j: &Value) -> String {
    let (done, total) = (j["done"].as_u64().unwrap_or(0), j["total"].as_u64().unwrap_or(0));
    let (what, export) = (j["type"].as_str().unwrap_or("job"), j["export"].as_str().unwrap_or("?"));
    if total == 0 && done == 0 {
        return format!("{what} {export}: starting");
    }
    let pct = if total > 0 { done as f64 * 100.0 / total as f64 } else { 0.0 };
    format!(
        "{what} {export}: {pct:.1}% ({} of {}, {}/s)",
        one_decimal(done),
        one_decimal(total),
        one_decimal(j["rate"].as_u64().unwrap_or(0)),
    )
}

/// Waits for job `id` to end (or, `until_ready`, to be ready: a mirror that
/// waits for `pivot`), reading the job table with `jobs` (the `job_list`
/// answer); prints its progress (not with `json`) and its outcome.
pub fn wait(jobs: impl Fn() -> Result<Value, Error>, id: u64, json: bool, until_ready: bool) -> Result<(), Error> {
    let tty = !json && std::io::stderr().is_terminal();
    let mut shown_tenth = None;
    let mut err = std::io::stderr();
    loop {
        let list = jobs()?;
        let job =
            list.as_array().and_then(|l| l.iter().find(|j| j["id"].as_u64() == Some(id))).cloned().ok_or_else(
                || Error::failed(format!("job {id} is not in the server's job table (`vdisk ctl jobs`)")),
            )?;
        let state = job["state"].as_str().unwrap_or("");
        let line = progress_line(&job);
        if !json {
            let (done, total) = (job["done"].as_u64().unwrap_or(0), job["total"].as_u64().unwrap_or(0));
            let tenth = (done * 10).checked_div(total).unwrap_or(0);
            if tty {
                let _ = write!(err, "\r{line}\x1b[K");
            } else if shown_tenth != Some(tenth) && matches!(state, "running" | "ready") {
                let _ = writeln!(err, "{line}");
                shown_tenth = Some(tenth);
            }
        }
        let what = format!("job {id} ({} of export {})", job["type"].as_str().unwrap_or("?"), job["export"]);
        let end = |out: &str| {
            if tty {
                let _ = writeln!(std::io::stderr());
            }
            if json {
                let _ = writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&job).unwrap_or_default());
            } else if !out.is_empty() {
                let _ = writeln!(std::io::stdout(), "{out}");
            }
        };
        match state {
            "done" => {
                end(&format!("{what}: done, {line}"));
                return Ok(());
            }
            "ready" if until_ready => {
                end(&format!(
                    "{what}: ready, {line}; the target follows the export's writes until `vdisk ctl pivot {id}` \
                     switches the export to it or `vdisk ctl cancel {id}` leaves it as it is"
                ));
                return Ok(());
            }
            "failed" => {
                end("");
                let why = job["error"].as_str().unwrap_or("no reason given");
                return Err(Error::failed(format!("{what} failed: {why}")));
            }
            "cancelled" => {
                end("");
                return Err(Error::failed(format!("{what} was cancelled: the export serves as before the job")));
            }
            _ => std::thread::sleep(POLL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_line_reads_like_qemu_imgs() {
        let j = serde_json::json!({"type": "stream", "export": "disk", "done": 15099494, "total": 33554432,
            "rate": 12897484, "state": "running"});
        assert_eq!(progress_line(&j), "stream disk: 45.0% (14.4 MiB of 32.0 MiB, 12.3 MiB/s)");
        let j = serde_json::json!({"type": "mirror", "export": "disk", "done": 0, "total": 0, "rate": 0});
        assert_eq!(progress_line(&j), "mirror disk: starting");
    }
}
