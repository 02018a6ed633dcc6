//! `vdisk`: the command line and its wiring. It parses what the user asked
//! for and runs it: `serve` builds the daemon (crates/vdisk-daemon) with its
//! control socket (crates/vdisk-control) and waits for signals; `soak` is
//! crates/vdisk-soak; the rest are small commands on images. A user mistake
//! is one line on stderr and exit code 2.

mod cli;
mod commit;
mod create;
mod ctl;
mod ctl_verbs;
mod info;
mod logger;
mod merge;
mod serve;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;
use vdisk_daemon::Error;

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
        cli::Command::Soak(a) => vdisk_soak::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if json_logs {
                // One JSON object per line on stderr, the last words too.
                log::error!("{}", e.report());
            } else {
                eprintln!("vdisk: {}", e.report());
            }
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Something failed while doing what was asked: 1; the user asked for
/// something that cannot be (a refusal of any other kind): 2.
fn exit_code(e: &Error) -> u8 {
    match e.kind() {
        vdisk_daemon::ErrorKind::Failed => 1,
        _ => 2,
    }
}
