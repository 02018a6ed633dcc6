//! `vdisk ctl bitmap VERB EXPORT [NAME]`: an export's dirty bitmaps over
//! the control socket (the `bitmap_*` methods of docs/control.md).

use clap::Subcommand;
use serde_json::{json, Map, Value};
use vdisk_daemon::size::parse_size;

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

/// The JSON-RPC method and params.
pub fn request(c: BitmapCommand) -> (&'static str, Map<String, Value>) {
    let mut p = Map::new();
    let mut two = |e: String, n: String| {
        p.insert("export".into(), e.into());
        p.insert("name".into(), n.into());
    };
    let method = match c {
        BitmapCommand::Add { export, name, granularity, disabled } => {
            two(export, name);
            if let Some(g) = granularity {
                p.insert("granularity".into(), g.into());
            }
            if disabled {
                p.insert("disabled".into(), true.into());
            }
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
