//! A small stderr logger: warnings by default, `-v` for info, `-vv` for debug.

use log::{Level, LevelFilter, Log, Metadata, Record};

struct Stderr;

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
        if self.enabled(r.metadata()) {
            let level = match r.level() {
                Level::Error => "error",
                Level::Warn => "warning",
                Level::Info => "info",
                Level::Debug => "debug",
                Level::Trace => "trace",
            };
            eprintln!("vdisk: {level}: {}", r.args());
        }
    }

    fn flush(&self) {}
}

pub fn init(verbose: u8, quiet: bool) {
    let level = match (quiet, verbose) {
        (true, _) => LevelFilter::Error,
        (false, 0) => LevelFilter::Warn,
        (false, 1) => LevelFilter::Info,
        _ => LevelFilter::Debug,
    };
    let _ = log::set_logger(&Stderr);
    log::set_max_level(level);
}
