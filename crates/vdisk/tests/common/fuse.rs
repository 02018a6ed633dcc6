//! What the FUSE tests (fuse.rs, fuse_reliability.rs) share: one mounting
//! test at a time, the FUSE-over-io_uring switch, and a served image's set-up.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use super::{create_image, TempDir};

pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// One mounting test at a time (in this test binary); they need root and /dev/fuse.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // SAFETY: geteuid only returns a number.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the FUSE tests mount file systems and need root (CI runs as root)");
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: load the fuse module (modprobe fuse)");
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets FUSE-over-io_uring on ("Y") or off ("N"), and back to what it was when dropped.
pub struct UringSwitch(String);

impl UringSwitch {
    pub fn set(value: &str) -> UringSwitch {
        let old = std::fs::read_to_string(ENABLE_URING).unwrap_or_else(|e| {
            panic!("{ENABLE_URING}: {e}: this kernel has no FUSE-over-io_uring (needs 6.14+ with CONFIG_FUSE_IO_URING)")
        });
        std::fs::write(ENABLE_URING, value).unwrap_or_else(|e| panic!("cannot write {value} to {ENABLE_URING}: {e}"));
        UringSwitch(old.trim().to_owned())
    }

    pub fn on() -> UringSwitch {
        UringSwitch::set("Y")
    }
}

impl Drop for UringSwitch {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE_URING, &self.0);
    }
}

/// Runs `f(ring)` as the only mounting test, with FUSE-over-io_uring switched
/// on for it (and back after) when `ring`.
pub fn on_transport<T>(ring: bool, f: impl FnOnce(bool) -> T) -> T {
    let _s = serial();
    let _on = ring.then(UringSwitch::on);
    f(ring)
}

/// The serve arguments `IMG --fuse FILE`, with `--fuse-uring` when `ring`.
pub fn fuse_args<'a>(img: &'a Path, file: &'a Path, ring: bool) -> Vec<&'a str> {
    let mut args = vec![img.to_str().unwrap(), "--fuse", file.to_str().unwrap()];
    if ring {
        args.push("--fuse-uring");
    }
    args
}

/// A new test directory with a fresh raw image `image` of `size` in it, and
/// the path `disk` beside it for the FUSE file: (dir, image, file).
pub fn fuse_disk(tag: &str, image: &str, size: &str) -> (TempDir, PathBuf, PathBuf) {
    let dir = TempDir::new(tag);
    let img = dir.path(image);
    create_image(&img, size);
    let file = dir.path("disk");
    (dir, img, file)
}
