//! `vdisk ctl backup begin|end|list`: point-in-time backup views over the
//! control socket (the `backup_*` methods of docs/control.md).

use std::path::PathBuf;

use clap::Subcommand;
use serde_json::{json, Map, Value};
use vdisk_daemon::Error;

#[derive(Subcommand)]
pub enum BackupCommand {
    /// Freeze a read-only NBD export VIEW of EXPORT as it is now (copy-before-write keeps it while the guest writes).
    Begin {
        export: String,
        /// The view's NBD export name.
        #[arg(long, value_name = "VIEW")]
        name: String,
        /// Serve this bitmap, frozen now, as the view's qemu:dirty-bitmap:B (with --new-bitmap it stops marking).
        #[arg(long, value_name = "B")]
        bitmap: Option<String>,
        /// Start this new bitmap, empty, for the next incremental backup.
        #[arg(long, value_name = "B2")]
        new_bitmap: Option<String>,
        /// Directory of the scratch file (default: the image's own directory).
        #[arg(long, value_name = "DIR")]
        scratch: Option<PathBuf>,
    },
    /// Drop a backup view and its scratch data.
    End { view: String },
    /// The backups in progress.
    List,
}

/// The JSON-RPC method and params.
pub fn request(c: BackupCommand) -> Result<(&'static str, Map<String, Value>), Error> {
    let mut p = Map::new();
    let method = match c {
        BackupCommand::Begin { export, name, bitmap, new_bitmap, scratch } => {
            p.insert("export".into(), export.into());
            p.insert("view".into(), name.into());
            if let Some(b) = bitmap {
                p.insert("bitmap".into(), b.into());
            }
            if let Some(b) = new_bitmap {
                p.insert("new_bitmap".into(), b.into());
            }
            if let Some(d) = scratch {
                let d =
                    std::path::absolute(&d).map_err(|e| Error::invalid(d.display().to_string()).at(&d).because(e))?;
                p.insert("scratch".into(), json!(d));
            }
            "backup_begin"
        }
        BackupCommand::End { view } => {
            p.insert("view".into(), view.into());
            "backup_end"
        }
        BackupCommand::List => "backup_list",
    };
    Ok((method, p))
}
