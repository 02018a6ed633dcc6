//! Merging a qcow2 overlay (`vdisk commit`): into its raw backing file in
//! place (every unit this image holds, data or zeros, written over the
//! backing file's bytes), or the whole disk into a new sparse raw image.
//!
//! What it owns: the copy loops. What it must never do: write this image,
//! write a backing file that is not raw (a qcow2 or COW backing would need
//! its own allocation; `--into` covers those), or leave a half-written new
//! image behind.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::l2::Unit;
use super::Qcow2Image;
use crate::{Error, Extent, Image, Result};

const CHUNK: u64 = 1 << 20;

fn at(path: &Path, e: std::io::Error, what: &str) -> Error {
    Error::io(e, format!("{what} {}", path.display())).path(path)
}

impl Qcow2Image {
    /// Reads `buf.len()` bytes of the disk at `pos`, through the chain.
    fn read_disk(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        let mut extents = Vec::new();
        self.map_read(pos, buf.len() as u64, &mut extents)?;
        let mut k = 0usize;
        for ext in extents {
            let n = ext.len() as usize;
            match ext {
                Extent::Data { file, offset, .. } => self.base.files[file]
                    .read_exact_at(&mut buf[k..k + n], offset)
                    .map_err(|e| at(self.file_path(file), e, &format!("cannot read offset {offset} of")))?,
                Extent::Zero { .. } => buf[k..k + n].fill(0),
            }
            k += n;
        }
        Ok(())
    }

    /// The runs of the disk this image holds itself (data, zeros, compressed).
    fn own_runs(&self) -> Result<Vec<(u64, u64)>> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut pos = 0;
        while pos < self.header.size {
            let (unit, _, end) = self.unit_at(pos)?;
            if unit != Unit::Backing {
                match runs.last_mut() {
                    Some(r) if r.0 + r.1 == pos => r.1 += end - pos,
                    _ => runs.push((pos, end - pos)),
                }
            }
            pos = end;
        }
        Ok(runs)
    }

    /// Writes every unit this image holds into its backing file, which must
    /// be raw, then syncs it. Calls `progress(done, total)` in bytes; returns
    /// the bytes copied.
    pub fn commit_to_backing(&self, progress: &dyn Fn(u64, u64)) -> Result<u64> {
        let (Some(path), Some("raw")) = (self.backing_path(), self.backing_format()) else {
            return Err(Error::invalid(format!(
                "{} has no raw backing file to commit into; write the merged disk to a new image instead",
                self.base.path.display()
            )));
        };
        let file = OpenOptions::new().write(true).open(path).map_err(|e| at(path, e, "cannot open for writing"))?;
        crate::cow::lock_file(&file, path, true)?;
        let runs = self.own_runs()?;
        let total = runs.iter().map(|r| r.1).sum();
        let mut buf = vec![0u8; CHUNK as usize];
        let mut done = 0;
        progress(0, total);
        for (start, len) in runs {
            let mut pos = start;
            while pos < start + len {
                let n = CHUNK.min(start + len - pos) as usize;
                self.read_disk(pos, &mut buf[..n])?;
                file.write_all_at(&buf[..n], pos).map_err(|e| at(path, e, &format!("cannot write offset {pos} of")))?;
                pos += n as u64;
                done += n as u64;
                progress(done, total);
            }
        }
        file.sync_all().map_err(|e| at(path, e, "cannot sync"))?;
        Ok(done)
    }

    /// Writes the whole disk to a new sparse raw image at `new`, which must
    /// not exist. Calls `progress(done, total)` in bytes.
    pub fn write_merged(&self, new: &Path, progress: &dyn Fn(u64, u64)) -> Result<()> {
        crate::create_whole(new, |out| self.copy_disk(out, new, progress))
    }

    fn copy_disk(&self, out: &File, new: &Path, progress: &dyn Fn(u64, u64)) -> Result<()> {
        let size = self.header.size;
        let mut buf = vec![0u8; CHUNK as usize];
        let mut pos = 0;
        progress(0, size);
        while pos < size {
            let n = CHUNK.min(size - pos) as usize;
            self.read_disk(pos, &mut buf[..n])?;
            if buf[..n].iter().any(|&b| b != 0) {
                out.write_all_at(&buf[..n], pos).map_err(|e| at(new, e, &format!("cannot write offset {pos} of")))?;
            }
            pos += n as u64;
            progress(pos, size);
        }
        out.set_len(size).map_err(|e| at(new, e, "cannot size"))?;
        out.sync_all().map_err(|e| at(new, e, "cannot sync"))
    }
}
