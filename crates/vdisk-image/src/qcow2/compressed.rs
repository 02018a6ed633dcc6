//! Compressed qcow2 clusters (what `qemu-img convert -c` writes): read only.
//!
//! What it owns: turning a compressed cluster (raw deflate, or a zstd frame
//! when the header's compression type says so) into bytes the engine can
//! read like any other extent. The engine moves data between files and
//! buffers only, so a cluster is inflated once, on first read, into an
//! anonymous in-memory file (`memfd`, the image's last file) at its guest
//! cluster's offset there (a sparse file: memory only for clusters read).
//! Writes never produce compressed clusters: a write to one claims a new
//! cluster, filled from the inflated copy. The inflated copies live as long
//! as the image is open (the cost: memory as large as the compressed
//! clusters read, decompressed; `qemu-img convert` without -c avoids it).
//!
//! What it must never do: trust the compressed length (it is clamped to the
//! file), produce more or fewer bytes than one cluster, or panic on a
//! corrupt stream (that is a `Corrupt` error for the request).

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::io::FromRawFd;
use std::path::Path;
use std::sync::Mutex;

use crate::{Error, ErrorKind, Result};

/// An anonymous in-memory file.
pub fn memfd(name: &std::ffi::CStr) -> std::io::Result<File> {
    // SAFETY: `name` is NUL-terminated; memfd_create reads only it and the flags.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by memfd_create and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The inflated copies of compressed clusters.
pub struct Inflated {
    /// Guest clusters already inflated into the memory file.
    done: Mutex<HashSet<u64>>,
    cluster_bits: u32,
    zstd: bool,
}

impl Inflated {
    pub fn new(cluster_bits: u32, zstd: bool) -> Self {
        Inflated { done: Mutex::new(HashSet::new()), cluster_bits, zstd }
    }

    /// Makes sure guest cluster `c`, compressed as `len` bytes at `at` of
    /// `image`, is inflated in `cache`; returns its offset there.
    pub fn get(&self, image: (&File, &Path, u64), cache: &File, c: u64, at: u64, len: u64) -> Result<u64> {
        let cs = 1u64 << self.cluster_bits;
        let slot = c * cs;
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if done.contains(&c) {
            return Ok(slot);
        }
        let (file, path, file_len) = image;
        let len = len.min(file_len.saturating_sub(at)).min(2 * cs);
        let mut input = vec![0u8; len as usize];
        file.read_exact_at(&mut input, at).map_err(|e| {
            Error::io(e, format!("cannot read the compressed cluster at {at:#x} of {}", path.display()))
        })?;
        let out = self.inflate(&input).map_err(|why| {
            Error::new(
                ErrorKind::Corrupt,
                format!("{}: the compressed cluster at {at:#x} does not decompress ({why})", path.display()),
            )
        })?;
        cache
            .write_all_at(&out, slot)
            .map_err(|e| Error::io(e, format!("cannot keep an inflated cluster of {} in memory", path.display())))?;
        done.insert(c);
        Ok(slot)
    }

    /// Exactly one cluster of output; a stream that ends early is zero-padded
    /// only if it ended cleanly (qemu accepts that for deflate too).
    fn inflate(&self, input: &[u8]) -> std::result::Result<Vec<u8>, String> {
        let cs = 1usize << self.cluster_bits;
        let mut out = vec![0u8; cs];
        let mut n = 0;
        let mut fill = |r: &mut dyn Read| -> std::result::Result<(), String> {
            while n < cs {
                match r.read(&mut out[n..]) {
                    Ok(0) => return Err(format!("{n} bytes instead of {cs}")),
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        };
        if self.zstd {
            let mut d = ruzstd::decoding::StreamingDecoder::new(input).map_err(|e| e.to_string())?;
            fill(&mut d)?;
        } else {
            fill(&mut flate2::read::DeflateDecoder::new(input))?;
        }
        Ok(out)
    }
}
