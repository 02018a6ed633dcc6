//! `vdisk ctl snapshot` and `vdisk ctl jobs`: their answers as text.

use serde_json::Value;
use vdisk_daemon::size::human;

/// What a snapshot made, in a line.
pub fn snapshot_text(r: &Value) -> String {
    format!(
        "export {}: now served from {} ({}) over {} ({}), job {}\n",
        r["name"],
        r["overlay"].as_str().unwrap_or("?"),
        r["format"].as_str().unwrap_or("?"),
        r["backing"].as_str().unwrap_or("?"),
        r["backing_format"].as_str().unwrap_or("?"),
        r["job"],
    )
}

/// What a stream did, in a line.
pub fn stream_text(r: &Value) -> String {
    format!(
        "export {}: {} copied from the backing chain; its top has no backing file now, job {}\n",
        r["name"],
        human(r["copied"].as_u64().unwrap_or(0)),
        r["job"]
    )
}

/// The job table; a failed job's error on a line of its own beneath.
pub fn table(jobs: &[Value]) -> String {
    let header = ["ID", "TYPE", "EXPORT", "DONE", "TOTAL", "STATE"];
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                j["id"].to_string(),
                j["type"].as_str().unwrap_or("").to_owned(),
                j["export"].as_str().unwrap_or("").to_owned(),
                human(j["done"].as_u64().unwrap_or(0)),
                human(j["total"].as_u64().unwrap_or(0)),
                j["state"].as_str().unwrap_or("").to_owned(),
            ]
        })
        .collect();
    let mut out = vdisk_control::stats::render(&header, &rows);
    for j in jobs {
        if let Some(e) = j["error"].as_str() {
            out.push_str(&format!("job {}: {e}\n", j["id"]));
        }
    }
    out
}
