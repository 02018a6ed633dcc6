//! What an export is served through besides NBD: its FUSE file
//! ([`crate::fuse`]) and vhost-user-blk socket ([`crate::vhost`]), each a
//! [`Frontend`] over the export's device that the daemon stops, last started
//! first, when the export goes.

use crate::Error;

/// An export beside NBD (FUSE, vhost-user-blk) over the same devices.
pub trait Frontend: Send {
    /// Stops serving and releases what it holds (mount point, socket); requests
    /// already taken are answered first.
    fn stop(self: Box<Self>) -> Result<(), Error>;
}

/// Started frontends; whatever is still here when dropped is stopped, last started first.
pub struct Frontends(pub Vec<Box<dyn Frontend>>);

impl Drop for Frontends {
    fn drop(&mut self) {
        while let Some(f) = self.0.pop() {
            if let Err(e) = f.stop() {
                log::warn!("{}", e.report());
            }
        }
    }
}
