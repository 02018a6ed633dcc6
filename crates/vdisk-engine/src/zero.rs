//! The zero ladder: how a range of an image's file is made to read as zeros
//! (WRITE_ZEROES) or deallocated (TRIM). Each rung is tried in turn: a
//! punched hole where holes are allowed, a zeroed allocated range
//! (`FALLOC_FL_ZERO_RANGE`), written zeros. A file system that refuses a rung
//! (EOPNOTSUPP, ENODEV: tmpfs has no ZERO_RANGE, ramfs no fallocate at all)
//! refuses it for good, so the ladder remembers, per file of the device, what
//! each file refused and does not ask again on every request.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::sys::{self, Segment};

/// `FALLOC_FL_PUNCH_HOLE` was refused.
const PUNCH: u8 = 1;
/// `FALLOC_FL_ZERO_RANGE` was refused.
const ZERO_RANGE: u8 = 2;

/// What each file of a device refused, shared by all its workers.
pub(crate) struct ZeroLadder {
    refused: Box<[AtomicU8]>,
}

impl ZeroLadder {
    /// A ladder for an image of `files` files, none of which refused anything yet.
    pub fn new(files: usize) -> ZeroLadder {
        ZeroLadder { refused: (0..files).map(|_| AtomicU8::new(0)).collect() }
    }

    fn has_refused(&self, file: usize, rung: u8) -> bool {
        self.refused.get(file).is_some_and(|r| r.load(Ordering::Relaxed) & rung != 0)
    }

    fn remember(&self, file: usize, rung: u8) {
        if let Some(r) = self.refused.get(file) {
            if r.fetch_or(rung, Ordering::Relaxed) & rung == 0 {
                let what = if rung == PUNCH { "punching holes" } else { "zeroing ranges" };
                log::debug!("file {file} of the image does not support {what}; not asking it again");
            }
        }
    }

    /// One fallocate rung on file `index`: Ok(true) when done, Ok(false) when
    /// the file refuses it (now or before: then it is not asked again).
    fn rung(&self, index: usize, file: &File, rung: u8, offset: u64, len: u64) -> io::Result<bool> {
        if self.has_refused(index, rung) {
            return Ok(false);
        }
        let mode = libc::FALLOC_FL_KEEP_SIZE
            | if rung == PUNCH { libc::FALLOC_FL_PUNCH_HOLE } else { libc::FALLOC_FL_ZERO_RANGE };
        match fallocate(file, mode, offset, len) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENODEV)) => {
                self.remember(index, rung);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// TRIM of a range of file `index`: a punched hole. TRIM is advisory: a
    /// file that cannot punch keeps its data.
    pub fn trim(&self, index: usize, file: &File, offset: u64, len: u64) -> io::Result<()> {
        self.rung(index, file, PUNCH, offset, len).map(|_| ())
    }

    /// Makes a range of file `index` read as zeros: a punched hole unless
    /// `no_hole`, else a zeroed (allocated) range, else written zeros unless
    /// the caller wants it `fast` only (then EOPNOTSUPP).
    pub fn zero(&self, index: usize, file: &File, offset: u64, len: u64, no_hole: bool, fast: bool) -> io::Result<()> {
        if !no_hole && self.rung(index, file, PUNCH, offset, len)? {
            return Ok(());
        }
        if self.rung(index, file, ZERO_RANGE, offset, len)? {
            return Ok(());
        }
        if fast {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        write_zeros(file, offset, len)
    }
}

fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    #[cfg(test)]
    tests::ATTEMPTS.with(|a| a.borrow_mut().push(mode));
    sys::fallocate(file, mode, offset, len)
}

/// The last rung: zeros written, 1 MiB at a time.
fn write_zeros(file: &File, offset: u64, len: u64) -> io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut zeros = crate::Buf::zeroed(CHUNK.min(len) as usize);
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at) as usize;
        let seg = Segment { ptr: zeros.as_mut_ptr(), len: n };
        // SAFETY: the segment is the first `n` bytes of `zeros`, ours until the loop ends.
        unsafe { sys::pwritev_full(file, &[seg], offset + at, false)? };
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::os::unix::fs::FileExt;

    use super::*;

    thread_local! {
        /// The fallocate modes this thread tried, in order (the ladder's test hook).
        pub(super) static ATTEMPTS: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    }

    fn attempts() -> Vec<i32> {
        ATTEMPTS.with(|a| std::mem::take(&mut *a.borrow_mut()))
    }

    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH_MODE: i32 = KEEP | libc::FALLOC_FL_PUNCH_HOLE;
    const ZERO_MODE: i32 = KEEP | libc::FALLOC_FL_ZERO_RANGE;

    /// A file on tmpfs (/dev/shm), which punches holes but refuses
    /// FALLOC_FL_ZERO_RANGE with EOPNOTSUPP: a real refusal.
    fn tmpfs_file(tag: &str) -> (File, std::path::PathBuf) {
        let path = std::path::Path::new("/dev/shm").join(format!("vdisk-zero-{}-{tag}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(1 << 20).unwrap();
        assert!(sys::in_memory(&file), "/dev/shm is not tmpfs here");
        (file, path)
    }

    #[test]
    fn a_refused_zero_range_is_not_asked_again() {
        let (file, path) = tmpfs_file("zr");
        file.write_all_at(&[0xaa; 8192], 0).unwrap();
        let ladder = ZeroLadder::new(1);
        attempts();
        // NO_HOLE: zero range (refused by tmpfs), then written zeros.
        ladder.zero(0, &file, 0, 4096, true, false).unwrap();
        assert_eq!(attempts(), [ZERO_MODE], "the first request asks");
        assert!(ladder.has_refused(0, ZERO_RANGE) && !ladder.has_refused(0, PUNCH));
        ladder.zero(0, &file, 4096, 4096, true, false).unwrap();
        assert_eq!(attempts(), [], "the second goes straight to written zeros");
        let mut back = [0xffu8; 8192];
        file.read_exact_at(&mut back, 0).unwrap();
        assert!(back.iter().all(|&b| b == 0), "both ranges read as zeros");
        // A fast zero is refused at once, without a call.
        let e = ladder.zero(0, &file, 0, 4096, true, true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
        assert_eq!(attempts(), []);
        // Holes still work and are still asked for.
        ladder.zero(0, &file, 0, 4096, false, true).unwrap();
        ladder.trim(0, &file, 0, 4096).unwrap();
        assert_eq!(attempts(), [PUNCH_MODE, PUNCH_MODE]);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn each_file_is_remembered_on_its_own() {
        let (shm, path) = tmpfs_file("two");
        let disk = tempfile_on_disk();
        let ladder = ZeroLadder::new(2);
        attempts();
        ladder.zero(0, &shm, 0, 4096, true, false).unwrap();
        assert_eq!(attempts(), [ZERO_MODE]);
        // File 1 (not tmpfs) has refused nothing: it is asked.
        ladder.zero(1, &disk.0, 0, 4096, true, false).unwrap();
        assert_eq!(attempts(), [ZERO_MODE]);
        assert!(!ladder.has_refused(1, ZERO_RANGE) || !sys::in_memory(&disk.0));
        // An index the ladder does not know is asked every time, never remembered.
        ladder.zero(5, &shm, 0, 4096, true, false).unwrap();
        ladder.zero(5, &shm, 0, 4096, true, false).unwrap();
        assert_eq!(attempts(), [ZERO_MODE, ZERO_MODE]);
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(disk.1);
    }

    fn tempfile_on_disk() -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("vdisk-zero-{}-disk", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(1 << 20).unwrap();
        (file, path)
    }
}
