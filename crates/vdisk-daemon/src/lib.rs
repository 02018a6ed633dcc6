//! The running vdisk server as a library: a [`Daemon`] owns every export
//! (its device, its FUSE file and vhost-user socket, its place on the NBD
//! listeners) and adds, removes and stops them; [`reload`] applies a changed
//! config file through the same methods; [`metrics`] serves their counters.
//! Everything here returns typed results and one [`Error`] with an
//! [`ErrorKind`]: no command-line parsing and no JSON. The command line
//! (crates/vdisk) builds the daemon and maps errors to exit codes; the
//! control socket (crates/vdisk-control) maps them to JSON-RPC.
//!
//! Modules, each depending only on those listed after it:
//! `metrics`, `reload` → `config` → `security` → `commit` → `mirror`, `stream` →
//! `snapshot` → `backup` → `daemon` → `jobs`, `chain` (the job table and
//! what a live operation knows of an image chain on disk, below them all);
//! `daemon` → `views`, `bitmaps`, `fuse`, `vhost`
//! → `frontend`, `listen`, `stopping` → `systemd`; `spec` → `formats` →
//! `size`; `error` below all.

pub mod backup;
pub mod bitmaps;
pub mod chain;
pub mod commit;
pub mod config;
pub mod daemon;
pub mod error;
pub mod formats;
pub mod frontend;
mod fuse;
pub mod jobs;
pub mod listen;
pub mod metrics;
pub mod mirror;
pub mod reload;
pub mod security;
pub mod size;
pub mod snapshot;
pub mod spec;
pub mod stopping;
pub mod stream;
pub mod systemd;
mod vhost;
pub mod views;

pub use daemon::{Daemon, ExportInfo, ExportStats, Origin, ServerInfo, Settings, Ticket};
pub use error::{Error, ErrorKind};
pub use reload::{Reload, ReloadReport, Reloader};
pub use spec::{ExportSpec, ImageFormat};
