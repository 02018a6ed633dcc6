//! An export's statistics as JSON (the control socket's `export_stats`) and
//! as a table for people (`vdisk ctl stats`). The counting itself is the
//! engine's (`vdisk_engine::stats`); this module only presents it.

use serde_json::{json, Value};
use vdisk_engine::stats::Latency;
use vdisk_engine::Snapshot;

pub fn to_json(name: &str, connections: usize, s: &Snapshot) -> Value {
    let lat = |l: &Latency| json!({"count": l.count, "p50": l.p50, "p99": l.p99, "p999": l.p999});
    json!({
        "name": name,
        "connections": connections,
        "in_flight": s.in_flight,
        "read_ops": s.read_ops,
        "read_bytes": s.read_bytes,
        "write_ops": s.write_ops,
        "write_bytes": s.write_bytes,
        "flush_ops": s.flush_ops,
        "trim_ops": s.trim_ops,
        "zero_ops": s.zero_ops,
        "other_ops": s.other_ops,
        "errors": s.errors,
        "latency_us": {"read": lat(&s.read_latency), "write": lat(&s.write_latency), "flush": lat(&s.flush_latency)},
    })
}

/// One row per export: the fields of [`to_json`] people look at first.
pub fn table(stats: &[Value]) -> String {
    let header = [
        "NAME",
        "CONNS",
        "INFLIGHT",
        "READS",
        "READ",
        "WRITES",
        "WRITTEN",
        "FLUSHES",
        "ERRORS",
        "READ p50/p99 µs",
        "WRITE p50/p99 µs",
    ];
    let rows: Vec<Vec<String>> = stats
        .iter()
        .map(|s| {
            let n = |k: &str| s[k].as_u64().unwrap_or(0).to_string();
            let b = |k: &str| vdisk_daemon::size::human(s[k].as_u64().unwrap_or(0));
            let l = |k: &str| format!("{}/{}", s["latency_us"][k]["p50"], s["latency_us"][k]["p99"]);
            let name = s["name"].as_str().unwrap_or("").to_owned();
            vec![
                name,
                n("connections"),
                n("in_flight"),
                n("read_ops"),
                b("read_bytes"),
                n("write_ops"),
                b("write_bytes"),
                n("flush_ops"),
                n("errors"),
                l("read"),
                l("write"),
            ]
        })
        .collect();
    render(&header, &rows)
}

/// Left-aligned columns, two spaces apart.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}
