//! `vdisk`: the command line. It parses what the user asked for, opens the
//! images, starts one engine per device and the exports over them, and stops
//! them cleanly. A user mistake is one line on stderr and exit code 2.

mod cli;
mod commit;
mod config;
mod control;
mod create;
mod ctl;
mod daemon;
mod formats;
mod fuse;
mod info;
mod logger;
mod metrics;
mod reload;
mod security;
mod serve;
mod size;
mod soak;
mod stats;
mod stopping;
mod systemd;
mod vhost;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        Err(e) => {
            // One line, as for every other mistake on the command line.
            let text = e.render().to_string();
            let para: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
            eprintln!("vdisk: {} (see --help)", para.join(" ").trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    logger::init(cli.verbose, cli.quiet, cli.log_format, cli.log_level);
    let json_logs = cli.log_format == cli::LogFormat::Json;
    let result = match cli.command {
        cli::Command::Create(a) => create::run(a),
        cli::Command::Info(a) => info::run(a),
        cli::Command::Serve(a) => serve::run(*a),
        cli::Command::Commit(a) => commit::run(a),
        cli::Command::Ctl(a) => ctl::run(a),
        cli::Command::Soak(a) => soak::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if json_logs {
                // One JSON object per line on stderr, the last words too.
                log::error!("{e}");
            } else {
                eprintln!("vdisk: {e}");
            }
            ExitCode::from(e.exit_code())
        }
    }
}

/// An error for the user: the message, and whether it was their input (exit 2) or the system (exit 1).
#[derive(Debug)]
pub struct Failure {
    message: String,
    usage: bool,
}

impl Failure {
    /// The user asked for something that cannot be: exit code 2.
    pub fn usage(message: impl Into<String>) -> Self {
        Failure { message: message.into(), usage: true }
    }

    /// Something failed while doing what was asked: exit code 1.
    pub fn runtime(message: impl Into<String>) -> Self {
        Failure { message: message.into(), usage: false }
    }

    pub fn is_usage(&self) -> bool {
        self.usage
    }

    fn exit_code(&self) -> u8 {
        if self.usage {
            2
        } else {
            1
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Image errors the user caused (a missing file, a directory, a bad name) exit 2.
impl From<vdisk_image::Error> for Failure {
    fn from(e: vdisk_image::Error) -> Self {
        use vdisk_image::ErrorKind::*;
        match e.kind() {
            InvalidInput | NotFound | ReadOnly | Corrupt => Failure::usage(advised(&e)),
            _ => Failure::runtime(advised(&e)),
        }
    }
}

/// An image error's message with its advice in the terms of this command line.
pub fn advised(e: &vdisk_image::Error) -> String {
    use vdisk_image::Advice::*;
    let advice = match e.advice() {
        Some(CreateImage) => " (create one with `vdisk create IMAGE --size 10G`)",
        Some(ReadOnly) => " (try --readonly)",
        Some(NoDirectIo) => "; serve it without --direct",
        Some(NameBacking) => "; name the backing file with --backing PATH",
        Some(IgnoreBackingMtime) => {
            "; if it still holds the same data, pass --ignore-backing-mtime, or name the right file with --backing PATH"
        }
        Some(CephConfig) => "; name the Ceph configuration with --ceph-conf PATH (or :conf=PATH) and the client with --ceph-id NAME (or :id=NAME)",
        Some(_) | None => "",
    };
    format!("{e}{advice}")
}
