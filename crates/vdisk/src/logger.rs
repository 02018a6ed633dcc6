//! The stderr logger: warnings by default, `-v` for info, `-vv` for debug,
//! `--log-level` to choose exactly. Two forms:
//!
//! - text, as always: `vdisk: warning: message`. Under systemd (stderr is the
//!   journal stream named by `$JOURNAL_STREAM`) each line starts with its
//!   syslog priority (`<4>warning: message`) instead of the program name, which
//!   the journal adds itself, with its own timestamp.
//! - JSON (`--log-format json`): one object per line with `time` (RFC 3339,
//!   UTC), `level`, `message`, and the record's structured fields (`export`,
//!   `client`) where the code logging it gives them (`log::warn!(export = name; ...)`).

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use log::kv::{Key, Value, VisitSource};
use log::{Level, LevelFilter, Log, Metadata, Record};
use serde_json::Map;

use crate::cli::{LogFormat, LogLevel};

struct Stderr {
    json: bool,
    journal: bool,
}

impl Log for Stderr {
    fn enabled(&self, m: &Metadata) -> bool {
        // The soak's power-loss storage (fuser) says so when a request of a
        // server it just killed can no longer be answered: expected there, so
        // shown only with -vv.
        if m.target().starts_with("fuser") && log::max_level() < LevelFilter::Debug {
            return false;
        }
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let line = if self.json {
            json_line(r)
        } else if self.journal {
            format!("<{}>{}: {}", priority(r.level()), name(r.level()), r.args())
        } else {
            format!("vdisk: {}: {}", name(r.level()), r.args())
        };
        // One write per line, so lines of several threads never interleave.
        let _ = std::io::stderr().lock().write_all(format!("{line}\n").as_bytes());
    }

    fn flush(&self) {}
}

fn name(l: Level) -> &'static str {
    match l {
        Level::Error => "error",
        Level::Warn => "warning",
        Level::Info => "info",
        Level::Debug => "debug",
        Level::Trace => "trace",
    }
}

/// sd-daemon(3)'s `<N>` prefixes.
fn priority(l: Level) -> u8 {
    match l {
        Level::Error => 3,
        Level::Warn => 4,
        Level::Info => 6,
        Level::Debug | Level::Trace => 7,
    }
}

fn json_line(r: &Record) -> String {
    let mut o = Map::new();
    o.insert("time".into(), rfc3339(SystemTime::now()).into());
    o.insert("level".into(), r.level().as_str().to_ascii_lowercase().into());
    o.insert("message".into(), r.args().to_string().into());
    let mut fields = Fields(&mut o);
    let _ = r.key_values().visit(&mut fields);
    serde_json::Value::Object(o).to_string()
}

struct Fields<'a>(&'a mut Map<String, serde_json::Value>);

impl<'kvs> VisitSource<'kvs> for Fields<'_> {
    fn visit_pair(&mut self, key: Key<'kvs>, value: Value<'kvs>) -> Result<(), log::kv::Error> {
        self.0.insert(key.as_str().to_owned(), value.to_string().into());
        Ok(())
    }
}

/// `2026-12-01T14:15:00.123Z`
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (secs, ms) = (d.as_secs(), d.subsec_millis());
    let (days, rest) = ((secs / 86400) as i64, secs % 86400);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// Whether stderr is the journal stream systemd named in `$JOURNAL_STREAM` (`DEV:INODE`).
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some((dev, ino)) = std::env::var("JOURNAL_STREAM").ok().and_then(|v| {
        let (d, i) = v.split_once(':')?;
        Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?))
    }) else {
        return false;
    };
    std::fs::metadata("/proc/self/fd/2").is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

pub fn init(verbose: u8, quiet: bool, format: LogFormat, level: Option<LogLevel>) {
    let level = match (level, quiet, verbose) {
        (Some(LogLevel::Error), ..) | (None, true, _) => LevelFilter::Error,
        (Some(LogLevel::Warn), ..) | (None, false, 0) => LevelFilter::Warn,
        (Some(LogLevel::Info), ..) | (None, false, 1) => LevelFilter::Info,
        (Some(LogLevel::Trace), ..) => LevelFilter::Trace,
        (Some(LogLevel::Debug), ..) | (None, false, _) => LevelFilter::Debug,
    };
    let logger = Box::new(Stderr { json: format == LogFormat::Json, journal: stderr_is_journal() });
    let _ = log::set_logger(Box::leak(logger));
    log::set_max_level(level);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + std::time::Duration::from_millis(1_709_210_096_789);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.789Z");
    }
}
