//! Looking at an overlay without serving it (`vdisk info`), and merging it
//! (`vdisk commit`): into its backing file in place, as `uml_moo -d` does, or
//! into a new raw image, as `uml_moo OVERLAY NEW` does.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::open::{at, mtime32, read_full, read_metadata, resolve_backing};
use super::{CowImage, Header};
use crate::{Error, Extent, Image, Result};

/// Bytes copied per call while merging.
const CHUNK: u64 = 1 << 20;

/// What `vdisk info` shows about an overlay.
#[derive(Debug)]
pub struct Inspection {
    pub header: Header,
    /// The backing path as written, resolved against the overlay's directory.
    pub backing_resolved: PathBuf,
    /// None when the backing file opens and matches; otherwise why not.
    pub backing_problem: Option<String>,
    /// `backing_resolved` with every symlink and `..` resolved: the file `serve` would open.
    pub backing_canonical: Option<PathBuf>,
    /// That file's device, inode, size and mtime (seconds), when it exists.
    pub backing_stat: Option<(u64, u64, u64, i64)>,
    /// Sectors allocated in the overlay, as its on-disk bitmap says (a running
    /// server may hold newer bits in memory until its next flush).
    pub sectors_allocated: u64,
}

/// Reads an overlay's header and bitmap without locking it or opening the
/// backing file for I/O, and checks the backing file as `open` would.
pub fn inspect(path: &Path) -> Result<Inspection> {
    let file = crate::files::open(path, false, "overlay")?;
    let (header, map) = read_metadata(&file, path)?;
    if crate::rbd::is_rbd(header.backing_path()) {
        // An RBD snapshot: checked (size) when the overlay is opened, which needs the cluster.
        let sectors_allocated = map.count(0, map.sectors());
        let backing_resolved = header.backing_path().to_owned();
        return Ok(Inspection {
            backing_canonical: Some(backing_resolved.clone()),
            backing_resolved,
            backing_problem: None,
            backing_stat: None,
            header,
            sectors_allocated,
        });
    }
    let backing_resolved = resolve_backing(path, header.backing_path());
    let stat = std::fs::metadata(&backing_resolved);
    let backing_stat = stat.as_ref().ok().map(|m| (m.dev(), m.ino(), m.len(), m.mtime()));
    let backing_canonical = backing_resolved.canonicalize().ok();
    let ambiguity = super::open::ambiguous_backing(path, header.backing_path());
    let backing_problem = ambiguity.or(match stat {
        Err(e) => Some(format!("cannot open it: {e}")),
        Ok(m) if m.is_dir() => Some("it is a directory".to_owned()),
        Ok(m) if m.is_file() && m.len() != header.size => {
            Some(format!("it is {} bytes, the overlay was made over {}", m.len(), header.size))
        }
        Ok(m) if mtime32(&m) != header.mtime => Some(format!(
            "modified since the overlay was made (mtime {} vs {} in the header)",
            mtime32(&m),
            header.mtime
        )),
        Ok(_) => None,
    });
    let sectors_allocated = map.count(0, map.sectors());
    Ok(Inspection { header, backing_resolved, backing_problem, backing_canonical, backing_stat, sectors_allocated })
}

impl CowImage {
    /// Copies every sector held in the overlay into the backing file, then
    /// syncs it. The image must have been opened with `backing_writable`.
    /// Calls `progress(done, total)` in bytes; returns the bytes copied.
    pub fn commit_to_backing(&self, progress: &dyn Fn(u64, u64)) -> Result<u64> {
        if !self.backing_writable {
            return Err(Error::invalid("the backing file was opened read-only; it cannot take a commit"));
        }
        let sectors = self.map.sectors();
        let total = self.allocated_bytes();
        let mut buf = vec![0u8; CHUNK as usize];
        let mut done = 0;
        let mut s = 0;
        progress(0, total);
        while s < sectors {
            let (set, end) = self.map.run(s, sectors);
            if set {
                let (mut pos, stop) = (s * self.sector, (end * self.sector).min(self.header.size));
                while pos < stop {
                    let n = CHUNK.min(stop - pos) as usize;
                    read_full(&self.base.files[0], &mut buf[..n], self.data_offset + pos)
                        .map_err(|e| at(&self.base.path, e, &format!("cannot read offset {pos} of overlay")))?;
                    self.base.files[1]
                        .write_all_at(&buf[..n], pos)
                        .map_err(|e| at(&self.backing, e, &format!("cannot write offset {pos} of")))?;
                    pos += n as u64;
                    done += n as u64;
                    progress(done, total);
                }
            }
            s = end;
        }
        self.base.files[1].sync_all().map_err(|e| at(&self.backing, e, "cannot sync"))?;
        Ok(done)
    }

    /// Bytes of the disk held in the overlay.
    pub fn allocated_bytes(&self) -> u64 {
        let sectors = self.map.sectors();
        let mut total = 0;
        let mut s = 0;
        while s < sectors {
            let (set, end) = self.map.run(s, sectors);
            if set {
                total += (end * self.sector).min(self.header.size) - s * self.sector;
            }
            s = end;
        }
        total
    }

    /// Writes the whole disk (overlay over backing) to a new sparse raw image
    /// at `new`, which must not exist. Calls `progress(done, total)` in bytes.
    pub fn write_merged(&self, new: &Path, progress: &dyn Fn(u64, u64)) -> Result<()> {
        crate::create_whole(new, |out| self.copy_disk(out, new, progress))
    }

    fn copy_disk(&self, out: &File, new: &Path, progress: &dyn Fn(u64, u64)) -> Result<()> {
        let size = self.header.size;
        let mut buf = vec![0u8; CHUNK as usize];
        let mut extents = Vec::new();
        let mut pos = 0;
        progress(0, size);
        while pos < size {
            let n = CHUNK.min(size - pos);
            extents.clear();
            self.map_read(pos, n, &mut extents)?;
            let mut at_buf = 0usize;
            for ext in &extents {
                let len = ext.len() as usize;
                if let Extent::Data { file, offset, .. } = *ext {
                    self.read_file(file, &mut buf[at_buf..at_buf + len], offset)
                        .map_err(|e| at(self.file_path(file), e, &format!("cannot read offset {offset} of")))?;
                } else {
                    buf[at_buf..at_buf + len].fill(0);
                }
                at_buf += len;
            }
            let chunk = &buf[..n as usize];
            if chunk.iter().any(|&b| b != 0) {
                out.write_all_at(chunk, pos).map_err(|e| at(new, e, &format!("cannot write offset {pos} of")))?;
            }
            pos += n;
            progress(pos, size);
        }
        out.set_len(size).map_err(|e| at(new, e, "cannot size"))?;
        out.sync_all().map_err(|e| at(new, e, "cannot sync"))?;
        Ok(())
    }
}
