//! The storage the power-loss rounds (`vdisk soak --power-loss`) put their
//! images on: crates/vdisk-powercut's FUSE file system that keeps only what
//! was fsynced. It is test machinery (it pulls in `fuser`), so only a build
//! with the `powercut` feature has it; a default (release) build has
//! stand-ins that can never be made, and `vdisk soak` refuses `--power-loss`
//! there before it starts ([`NOT_BUILT`]).

#[cfg(feature = "powercut")]
pub use vdisk_powercut::{Probe, Storage, Survival};

/// Why `--power-loss` cannot run in this build, and how to get one that can.
#[cfg(not(feature = "powercut"))]
pub const NOT_BUILT: &str = "--power-loss needs the power-cut test storage, which this vdisk was built without \
     (it is test machinery, not in a release build): rebuild with `cargo build --release --features powercut` \
     (needs /dev/fuse and root to run), or leave --power-loss off for SIGKILL crash rounds";

#[cfg(not(feature = "powercut"))]
pub use absent::{Probe, Storage, Survival};

/// Stand-ins with the power-cut storage's shape: `Storage::mount` fails, so
/// no `Storage` or `Probe` ever exists and their methods cannot be reached.
#[cfg(not(feature = "powercut"))]
mod absent {
    use std::io;
    use std::path::Path;

    /// What survives a power cut besides what was fsynced.
    #[derive(Debug, Clone, Copy)]
    pub enum Survival {
        Nothing,
        Random(#[allow(dead_code)] u64),
    }

    pub enum Storage {}

    #[derive(Clone)]
    pub enum Probe {}

    impl Storage {
        pub fn mount(_mountpoint: &Path) -> io::Result<Storage> {
            Err(io::Error::new(io::ErrorKind::Unsupported, super::NOT_BUILT))
        }
        pub fn mountpoint(&self) -> &Path {
            match *self {}
        }
        pub fn restart(&mut self) -> io::Result<()> {
            match *self {}
        }
        pub fn probe(&self) -> Probe {
            match *self {}
        }
        pub fn cut(&self, _survival: Survival) {
            match *self {}
        }
        pub fn cut_at_fsync(&self, _n: u64, _survival: Survival) {
            match *self {}
        }
        pub fn is_dead(&self) -> bool {
            match *self {}
        }
        pub fn sync_all(&self) {
            match *self {}
        }
        pub fn set_direct_io(&self, _on: bool) {
            match *self {}
        }
    }

    /// The real storage unmounts on drop; the soak drops it to do that.
    impl Drop for Storage {
        fn drop(&mut self) {
            match *self {}
        }
    }

    impl Probe {
        pub fn is_dead(&self) -> bool {
            match *self {}
        }
    }
}
