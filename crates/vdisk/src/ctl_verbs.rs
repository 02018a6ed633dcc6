//! The `vdisk ctl` verbs that are groups of their own: `bitmap VERB EXPORT
//! [NAME]` (an export's dirty bitmaps: the `bitmap_*` methods of
//! docs/control.md) and `backup begin|end|list` (point-in-time backup views:
//! `backup_*`), each turned into its JSON-RPC request; and what every verb
//! uses to fill its params.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use serde_json::{json, Map, Value};
use vdisk_daemon::size::parse_size;
use vdisk_daemon::Error;

/// `path` made absolute, as the server (whose working directory is not ours)
/// needs it; an `rbd:POOL/IMAGE` name or an NBD URI is no path and goes as it is.
pub fn absolute(path: &Path) -> Result<PathBuf, Error> {
    let named = path.to_str().is_some_and(vdisk_nbd::remote::Uri::is_nbd) || vdisk_image::rbd::is_rbd(path);
    if named {
        return Ok(path.to_owned());
    }
    std::path::absolute(path).map_err(|e| Error::invalid(path.display().to_string()).at(path).because(e))
}

/// Sets each param that is given (a flag is given when true).
pub fn set(p: &mut Map<String, Value>, params: impl IntoIterator<Item = (&'static str, Option<Value>)>) {
    p.extend(params.into_iter().filter_map(|(k, v)| Some((k.to_owned(), v?))));
}

/// A flag's param: `true` when set, else not sent.
pub fn flag(on: bool) -> Option<Value> {
    on.then_some(Value::Bool(true))
}

#[derive(Subcommand)]
pub enum BitmapCommand {
    /// Start a new bitmap: every write from now on is marked in it (persistent: in the qcow2 image, or IMAGE.bitmaps).
    Add {
        export: String,
        name: String,
        /// Bytes per bit, a power of two from 512 to 2G (K, M, G suffixes).
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        granularity: Option<u64>,
        /// Start it disabled (not marking writes).
        #[arg(long)]
        disabled: bool,
    },
    /// Drop a bitmap (the only thing an inconsistent one allows).
    Remove { export: String, name: String },
    /// Clear every bit.
    Clear { export: String, name: String },
    /// Mark writes in it again.
    Enable { export: String, name: String },
    /// Stop marking writes in it (its bits are kept).
    Disable { export: String, name: String },
    /// Merge the bits of --from bitmaps into NAME.
    Merge {
        export: String,
        name: String,
        /// A bitmap merged into NAME (repeat for more).
        #[arg(long, value_name = "BITMAP", required = true)]
        from: Vec<String>,
    },
    /// The export's bitmaps.
    List { export: String },
}

/// The JSON-RPC method and params of a `bitmap` verb.
pub fn bitmap_request(c: BitmapCommand) -> (&'static str, Map<String, Value>) {
    let mut p = Map::new();
    let mut two = |e: String, n: String| {
        p.insert("export".into(), e.into());
        p.insert("name".into(), n.into());
    };
    let method = match c {
        BitmapCommand::Add { export, name, granularity, disabled } => {
            two(export, name);
            set(&mut p, [("granularity", granularity.map(Into::into)), ("disabled", flag(disabled))]);
            "bitmap_add"
        }
        BitmapCommand::Remove { export, name } => {
            two(export, name);
            "bitmap_remove"
        }
        BitmapCommand::Clear { export, name } => {
            two(export, name);
            "bitmap_clear"
        }
        BitmapCommand::Enable { export, name } => {
            two(export, name);
            "bitmap_enable"
        }
        BitmapCommand::Disable { export, name } => {
            two(export, name);
            "bitmap_disable"
        }
        BitmapCommand::Merge { export, name, from } => {
            two(export, name);
            p.insert("sources".into(), json!(from));
            "bitmap_merge"
        }
        BitmapCommand::List { export } => {
            p.insert("export".into(), export.into());
            "bitmap_list"
        }
    };
    (method, p)
}

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

/// The JSON-RPC method and params of a `backup` verb.
pub fn backup_request(c: BackupCommand) -> Result<(&'static str, Map<String, Value>), Error> {
    let mut p = Map::new();
    let method = match c {
        BackupCommand::Begin { export, name, bitmap, new_bitmap, scratch } => {
            let scratch = scratch.map(|d| absolute(&d)).transpose()?;
            let given =
                [("export", Some(export.into())), ("view", Some(name.into())), ("bitmap", bitmap.map(Into::into))];
            set(
                &mut p,
                given
                    .into_iter()
                    .chain([("new_bitmap", new_bitmap.map(Into::into)), ("scratch", scratch.map(|d| json!(d)))]),
            );
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
