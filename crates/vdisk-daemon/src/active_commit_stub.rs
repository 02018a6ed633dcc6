//! STUB, to be replaced at merge: `Daemon::active_commit`, the commit of an
//! export's live top (a mirror into the base: docs/block-jobs.md), is built
//! by the mirror work (crates/vdisk-daemon/src/mirror.rs). Until then
//! `commit` calls this, which refuses before anything changes. Delete this
//! file (and its `mod` line in lib.rs) when mirror.rs brings the real one.

use std::path::Path;
use std::sync::Arc;

use crate::stream::Started;
use crate::{Daemon, Error};

impl Daemon {
    /// STUB: the real one (mirror.rs) commits the live top `name` into `base`.
    pub fn active_commit(
        self: &Arc<Self>,
        name: &str,
        base: &Path,
        _delete: bool,
        _bps: u64,
    ) -> Result<Started, Error> {
        Err(Error::invalid(format!(
            "commit of export {name:?} into {}: --top is the live top, and active commit (of the layer the guest \
             writes) is not built yet; commit a layer below it (--top FILE)",
            base.display()
        )))
    }
}
