//! The control socket's answers as text for people: what `vdisk ctl` prints
//! without `--json`. Beside `json`, which makes those answers from the
//! daemon's types, so the shape of an answer and its text live in one crate.

use serde_json::Value;
use vdisk_daemon::size::human;

/// The answer to `method` for people (what `vdisk ctl` prints without `--json`).
pub fn human_output(method: &str, r: &Value) -> String {
    match method {
        "export_add" => {
            let notes: Vec<&str> = r["notes"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            notes.join("\n") + "\n"
        }
        "export_remove" => format!("removed export {}\n", r["name"]),
        "export_list" => list_table(r.as_array().map(Vec::as_slice).unwrap_or_default()),
        "export_stats" => crate::stats::table(r.as_array().map(Vec::as_slice).unwrap_or(std::slice::from_ref(r))),
        "export_set_qos" => format!("export {}: qos {}\n", r["name"], qos_text(&r["qos"])),
        "server_info" => {
            let fields = r.as_object().into_iter().flatten();
            fields.map(|(k, v)| format!("{k}: {}\n", v.as_str().map_or_else(|| v.to_string(), str::to_owned))).collect()
        }
        "config_reload" => reload_text(r),
        m if m.starts_with("bitmap_") => bitmap_text(m, r).unwrap_or_default(),
        "export_snapshot" => snapshot_text(r),
        "export_stream" | "export_commit" => started_text(r),
        "export_mirror" => format!(
            "mirror job {} of export {} to {} started{}\n",
            r["job"],
            r["name"].as_str().unwrap_or_default(),
            r["to"].as_str().unwrap_or_default(),
            if r["pivot"] == true { " (it pivots once ready)" } else { "" }
        ),
        "job_list" => jobs_table(r.as_array().map(Vec::as_slice).unwrap_or_default()),
        "job_cancel" => {
            format!("job {}: cancel asked; it stops at its next chunk (`vdisk ctl jobs` shows it)\n", r["id"])
        }
        "job_pivot" => format!("job {}: pivot asked (`vdisk ctl jobs` shows when it is done)\n", r["id"]),
        m if m.starts_with("backup_") => crate::backup::text(m, r),
        _ => serde_json::to_string_pretty(r).unwrap_or_default() + "\n",
    }
}

fn reload_text(r: &Value) -> String {
    let names = |k: &str| -> String {
        let v: Vec<&str> = r[k].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        if v.is_empty() {
            "-".into()
        } else {
            v.join(", ")
        }
    };
    let mut out = format!("reloaded {}\n", r["config"].as_str().unwrap_or("?"));
    for (label, key) in [("added", "added"), ("removed", "removed"), ("qos changed", "qos_changed")] {
        out += &format!("  {label}: {}\n", names(key));
    }
    for k in r["kept"].as_array().into_iter().flatten() {
        out += &format!("  kept {}: {}\n", k["name"], k["reason"].as_str().unwrap_or(""));
    }
    if r["server_changed"] == true {
        out += "  [server] changed: takes effect at the next restart\n";
    }
    out
}

fn qos_text(q: &Value) -> String {
    let parts: Vec<String> = ["iops", "bps", "read_bps", "write_bps"]
        .iter()
        .filter_map(|k| {
            let v = q[k].as_u64().filter(|v| *v > 0)?;
            Some(if *k == "iops" { format!("{v} iops") } else { format!("{} {k}", human(v)) })
        })
        .collect();
    if parts.is_empty() {
        "unlimited".into()
    } else {
        parts.join(", ")
    }
}

fn list_table(exports: &[Value]) -> String {
    let header = ["NAME", "STATE", "SIZE", "FORMAT", "MODE", "CONNS", "QOS", "TRANSPORTS", "IMAGE"];
    let rows: Vec<Vec<String>> = exports
        .iter()
        .map(|e| {
            let transports: Vec<String> = e["transports"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| match t["path"].as_str() {
                    Some(p) => format!("{}:{p}", t["type"].as_str().unwrap_or("")),
                    None => t["type"].as_str().unwrap_or("").to_owned(),
                })
                .collect();
            vec![
                e["name"].as_str().unwrap_or("").to_owned(),
                e["state"].as_str().unwrap_or("").to_owned(),
                human(e["size"].as_u64().unwrap_or(0)),
                e["format"].as_str().unwrap_or("").to_owned(),
                if e["readonly"].as_bool().unwrap_or(false) { "ro" } else { "rw" }.to_owned(),
                e["connections"].to_string(),
                qos_text(&e["qos"]),
                transports.join(","),
                e["image"].as_str().unwrap_or("").to_owned(),
            ]
        })
        .collect();
    let mut out = crate::stats::render(&header, &rows);
    for e in exports {
        if let Some(why) = e["failure"].as_str() {
            out.push_str(&format!("{}: {why}\n", e["name"].as_str().unwrap_or("")));
        }
    }
    out
}

/// What a snapshot made, in a line.
fn snapshot_text(r: &Value) -> String {
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

/// A job that was started (stream, commit), in a line: its id and how to follow it.
fn started_text(r: &Value) -> String {
    format!(
        "export {}: {} started as job {}; follow it with `vdisk ctl jobs`, or start it with --wait\n",
        r["name"],
        r["type"].as_str().unwrap_or("job"),
        r["job"]
    )
}

/// Bytes per second for people ("12.3 MiB/s").
pub fn rate(bytes_per_sec: u64) -> String {
    format!("{}/s", human(bytes_per_sec))
}

/// The job table; a failed job's error on a line of its own beneath.
fn jobs_table(jobs: &[Value]) -> String {
    let header = ["ID", "TYPE", "EXPORT", "DONE", "TOTAL", "RATE", "BPS", "STATE"];
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                j["id"].to_string(),
                j["type"].as_str().unwrap_or("").to_owned(),
                j["export"].as_str().unwrap_or("").to_owned(),
                human(j["done"].as_u64().unwrap_or(0)),
                human(j["total"].as_u64().unwrap_or(0)),
                rate(j["rate"].as_u64().unwrap_or(0)),
                match j["bps"].as_u64().unwrap_or(0) {
                    0 => "-".to_owned(),
                    b => rate(b),
                },
                match (j["state"].as_str().unwrap_or(""), j["synchronous"].as_bool() == Some(true)) {
                    (state, true) => format!("{state}, sync"),
                    (state, false) => state.to_owned(),
                },
            ]
        })
        .collect();
    let mut out = crate::stats::render(&header, &rows);
    for j in jobs {
        if let Some(e) = j["error"].as_str() {
            out.push_str(&format!("job {}: {e}\n", j["id"]));
        }
    }
    out
}

/// A `bitmap_*` answer for people, or None for a method that is not one.
fn bitmap_text(method: &str, r: &Value) -> Option<String> {
    if method == "bitmap_list" {
        let header = ["NAME", "GRANULARITY", "STATE", "DIRTY"];
        let rows: Vec<Vec<String>> = r
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                let state = if b["inconsistent"] == true {
                    "inconsistent"
                } else if b["enabled"] == true {
                    "enabled"
                } else {
                    "disabled"
                };
                vec![
                    b["name"].as_str().unwrap_or("").to_owned(),
                    human(b["granularity"].as_u64().unwrap_or(0)),
                    state.to_owned(),
                    human(b["dirty_bytes"].as_u64().unwrap_or(0)),
                ]
            })
            .collect();
        return Some(crate::stats::render(&header, &rows));
    }
    let verb = method.strip_prefix("bitmap_")?;
    Some(format!("export {}: bitmap {}: {verb} done\n", r["export"], r["name"]))
}
