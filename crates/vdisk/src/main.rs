//! `vdisk`: the command line and its wiring. It parses what the user asked
//! for and runs it: `serve` builds the daemon (crates/vdisk-daemon) with its
//! control socket (crates/vdisk-control) and waits for signals; `soak` is
//! crates/vdisk-soak; the rest are small commands on images. A user mistake
//! is one line on stderr and exit code 2.

mod cli;
mod commit;
mod create;
mod ctl;
mod info;
mod logger;
mod merge;
mod serve;

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
        cli::Command::Soak(a) => vdisk_soak::run(a).map_err(Failure::from),
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
        vdisk_daemon::Error::from(e).into()
    }
}

/// The daemon's errors: a failure exits 1, a refusal of what was asked 2.
impl From<vdisk_daemon::Error> for Failure {
    fn from(e: vdisk_daemon::Error) -> Self {
        match e.kind() {
            vdisk_daemon::ErrorKind::Failed => Failure::runtime(e.to_string()),
            _ => Failure::usage(e.to_string()),
        }
    }
}
