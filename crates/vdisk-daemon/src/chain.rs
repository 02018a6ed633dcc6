//! `chain`: what a live disk operation (commit, mirror, snapshot, stream)
//! knows of an image chain on disk, outside the engine: the layers its
//! headers name ([`chain_of`]), whether two names are one file
//! ([`same_file`]), the BSD lock an open image holds on one file of its
//! chain ([`relock`]), and an image's bytes read and written through its own
//! mapping with plain `pread`/`pwrite` of the extents ([`read`], [`write`],
//! [`zero`], [`flush`]), as the engine's planner does. The copy jobs use these
//! on their own threads, on an image the engine serves (read) or one opened on
//! its own (written). Errors are messages for people, naming the file.

use std::fs::{File, Metadata};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use vdisk_image::{Extent, Format, Image};

/// The most layers a chain may have here (as the image opens count them).
pub const MAX_LAYERS: usize = 64;

/// One layer of a chain: its file (as its overlay's header resolves it) and format.
#[derive(Clone, Debug)]
pub struct Layer {
    pub path: PathBuf,
    pub format: Format,
}

/// The chain whose live top is `top` (in `format`), the top first: each
/// layer's backing as its header names it (a qcow2 backing in the format its
/// header names, or as detected; a COW overlay's raw or RBD backing). No lock
/// is taken and no backing opened.
pub fn chain_of(top: &Path, format: Format) -> Result<Vec<Layer>, String> {
    let mut chain = vec![Layer { path: top.to_owned(), format }];
    loop {
        let last = chain.last().expect("not empty");
        let next = match last.format {
            Format::Qcow2 => {
                let i = vdisk_image::qcow2::inspect(&last.path).map_err(|e| e.report().to_string())?;
                match i.backing_resolved {
                    None => None,
                    Some(p) => {
                        let named = i.header.backing_format.as_deref().and_then(Format::from_name);
                        let f = match named {
                            Some(f) => f,
                            None => vdisk_image::detect(&p).map_err(|e| e.report().to_string())?,
                        };
                        Some(Layer { path: p, format: f })
                    }
                }
            }
            Format::Cow => {
                let i = vdisk_image::cow::inspect(&last.path).map_err(|e| e.report().to_string())?;
                let f = if vdisk_image::rbd::is_rbd(&i.backing_resolved) { Format::Rbd } else { Format::Raw };
                Some(Layer { path: i.backing_resolved, format: f })
            }
            Format::Raw | Format::Rbd => None,
        };
        match next {
            None => return Ok(chain),
            Some(_) if chain.len() >= MAX_LAYERS => {
                return Err(format!("the chain of {} is deeper than {MAX_LAYERS} layers", top.display()))
            }
            Some(l) => chain.push(l),
        }
    }
}

/// The same file (device and inode).
pub fn same_inode(a: &Metadata, b: &Metadata) -> bool {
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

/// `a` and `b` name the same file (symlinks and relative names resolved).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => same_inode(&x, &y),
        _ => false,
    }
}

/// `file` (an open file) is the file `meta` describes.
pub fn is_file(file: &File, meta: &Metadata) -> bool {
    file.metadata().is_ok_and(|m| same_inode(&m, meta))
}

/// Turns the BSD lock that `image` holds on the file `path` (its own file or
/// any file of its chain) into `op` (`LOCK_SH`, `LOCK_EX`, `LOCK_UN`); a file
/// it does not hold is left alone. A lock that cannot change is logged.
pub fn relock(image: &dyn Image, path: &Path, op: i32) {
    let Ok(want) = std::fs::metadata(path) else { return };
    for file in image.files() {
        if !is_file(file, &want) {
            continue;
        }
        // SAFETY: flock only reads its integer arguments; the fd is open (`image` holds it).
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } != 0 {
            log::warn!("{}: cannot change its lock: {}", path.display(), std::io::Error::last_os_error());
        }
    }
}

/// Reads `buf.len()` bytes at `offset` of the disk `image` holds, as it is
/// now: the image's read mapping (into `extents`), then each extent from its
/// file, or an RBD image's own blocking read (zeros where it maps to none).
pub fn read(image: &dyn Image, offset: u64, buf: &mut [u8], extents: &mut Vec<Extent>) -> Result<(), String> {
    extents.clear();
    let len = buf.len() as u64;
    image
        .map_read(offset, len, extents)
        .map_err(|e| format!("mapping {len} bytes at offset {offset} of {}: {}", name(image), e.report()))?;
    let mut at = 0usize;
    for ext in extents.iter() {
        let n = ext.len() as usize;
        match *ext {
            Extent::Data { file, offset: fo, .. } => {
                let into = &mut buf[at..at + n];
                let r = match (image.files().get(file), image.target(file)) {
                    (Some(f), _) => f.read_exact_at(into, fo),
                    (None, Some(t)) => match t.blocking() {
                        Some(t) => t.read_at(into, fo),
                        None => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
                    },
                    (None, None) => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
                };
                r.map_err(|e| format!("reading {n} bytes at offset {fo} of {}: {e}", image.file_path(file).display()))?
            }
            Extent::Zero { .. } => buf[at..at + n].fill(0),
        }
        at += n;
    }
    Ok(())
}

/// Writes `data` at `offset` of `image`'s disk, as the engine's planner does:
/// prepare, map (into `extents`), write the extents, then `write_done` (or
/// `write_failed`).
pub fn write(image: &dyn Image, offset: u64, data: &[u8], extents: &mut Vec<Extent>) -> Result<(), String> {
    let len = data.len() as u64;
    let r = map_write(image, offset, len, extents).and_then(|()| {
        let mut at = 0usize;
        for ext in extents.iter() {
            let n = ext.len() as usize;
            if let Extent::Data { file, offset: fo, .. } = *ext {
                image.files()[file].write_all_at(&data[at..at + n], fo).map_err(|e| {
                    format!("writing {n} bytes at offset {fo} of {}: {e}", image.file_path(file).display())
                })?;
            }
            at += n;
        }
        Ok(())
    });
    written(image, offset, len, r)
}

/// Makes `len` bytes at `offset` of `image`'s disk read as zeros: the image
/// zeroes what its metadata can, and the rest is punched (or written zeros)
/// where it maps.
pub fn zero(image: &dyn Image, offset: u64, len: u64, extents: &mut Vec<Extent>) -> Result<(), String> {
    let rest = match image.zero(offset, len, false, false) {
        Ok(rest) => rest,
        Err(e) => {
            image.write_failed(offset, len);
            return Err(format!("zeroing {len} bytes at offset {offset} of {}: {}", name(image), e.report()));
        }
    };
    let r = rest.into_iter().try_for_each(|(o, l)| {
        map_write(image, o, l, extents)?;
        for ext in extents.iter() {
            let Extent::Data { file, offset: fo, len: n } = *ext else { continue };
            punch(&image.files()[file], fo, n)
                .map_err(|e| format!("zeroing {n} bytes at offset {o} of {}: {e}", image.file_path(file).display()))?;
        }
        Ok(())
    });
    written(image, offset, len, r)
}

/// Makes what was written to `image` durable: its own file, then its metadata.
pub fn flush(image: &dyn Image) -> Result<(), String> {
    if let Some(f) = image.files().first() {
        f.sync_all().map_err(|e| format!("flushing {}: {e}", name(image)))?;
    }
    image.sync_metadata().map_err(|e| format!("flushing {}: {}", name(image), e.report()))
}

/// The image's own file, for messages.
fn name(image: &dyn Image) -> std::path::Display<'_> {
    image.file_path(0).display()
}

/// Prepares and maps a write of `len` bytes at `offset` into `extents`.
fn map_write(image: &dyn Image, offset: u64, len: u64, extents: &mut Vec<Extent>) -> Result<(), String> {
    extents.clear();
    image
        .prepare_write(offset, len)
        .and_then(|()| image.map_write(offset, len, extents))
        .map_err(|e| format!("mapping {len} bytes at offset {offset} of {}: {}", name(image), e.report()))
}

/// Ends a write of `len` bytes at `offset` as `r` says.
fn written(image: &dyn Image, offset: u64, len: u64, r: Result<(), String>) -> Result<(), String> {
    match r {
        Ok(()) => image
            .write_done(offset, len, false)
            .map_err(|e| format!("recording {len} bytes at offset {offset} of {}: {}", name(image), e.report())),
        Err(e) => {
            image.write_failed(offset, len);
            Err(e)
        }
    }
}

/// Makes `len` bytes at `offset` of `file` read as zeros: a hole where the
/// file system punches one, written zeros where it does not.
fn punch(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate only reads its integer arguments; the fd is open (`file` holds it).
    if unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) } == 0 {
        return Ok(());
    }
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(zeros.len() as u64);
        file.write_all_at(&zeros[..n as usize], offset + at)?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use vdisk_image::OpenOptions;

    /// A new 1 MiB qcow2 file at `path`, over a raw `backing` if given.
    pub(crate) fn new_qcow2(path: &Path, backing: Option<&Path>) {
        let o = vdisk_image::qcow2::CreateOptions {
            size: 1 << 20,
            cluster_bits: vdisk_image::qcow2::DEFAULT_CLUSTER_BITS,
            backing: backing.map(|b| (b, "raw")),
        };
        vdisk_image::Qcow2Image::create(path, &o).unwrap();
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vdisk-chain-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_qcow2_over_raw_chain_is_read_from_its_headers_and_written_read_and_zeroed_through_its_mapping() {
        let d = dir("rw");
        let (base, top) = (d.join("base.raw"), d.join("top.qcow2"));
        std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
        new_qcow2(&top, Some(&base));
        let chain = chain_of(&top, Format::Qcow2).unwrap();
        assert_eq!(chain.len(), 2);
        assert!(same_file(&chain[0].path, &top) && same_file(&chain[1].path, &base));
        assert_eq!((chain[0].format, chain[1].format), (Format::Qcow2, Format::Raw));
        assert!(!same_file(&top, &base));

        let image =
            vdisk_image::open(&top, &OpenOptions { format: Some(Format::Qcow2), ..Default::default() }).unwrap().image;
        let mut extents = Vec::new();
        let mut buf = vec![0u8; 8192];
        read(&*image, 4096, &mut buf, &mut extents).unwrap();
        assert!(buf.iter().all(|&b| b == 7), "the backing's bytes show through");
        write(&*image, 4096, &[9u8; 8192], &mut extents).unwrap();
        zero(&*image, 65536, 65536, &mut extents).unwrap();
        flush(&*image).unwrap();
        read(&*image, 0, &mut buf, &mut extents).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 7) && buf[4096..].iter().all(|&b| b == 9));
        let mut z = vec![1u8; 65536];
        read(&*image, 65536, &mut z, &mut extents).unwrap();
        assert!(z.iter().all(|&b| b == 0), "zeroed over the backing's bytes");
        drop(image);
        assert!(std::fs::read(&base).unwrap().iter().all(|&b| b == 7), "the backing is never written");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn relock_changes_the_lock_an_image_holds_on_its_file() {
        let d = dir("lock");
        let top = d.join("top.qcow2");
        new_qcow2(&top, None);
        let image =
            vdisk_image::open(&top, &OpenOptions { format: Some(Format::Qcow2), ..Default::default() }).unwrap().image;
        let other = File::open(&top).unwrap();
        // SAFETY: flock only reads its integer arguments; `other` holds the fd open.
        let try_lock = |op: i32| unsafe { libc::flock(other.as_raw_fd(), op | libc::LOCK_NB) } == 0;
        assert!(!try_lock(libc::LOCK_SH), "the image holds its file exclusively");
        relock(&*image, &top, libc::LOCK_SH);
        assert!(try_lock(libc::LOCK_SH) && !try_lock(libc::LOCK_EX));
        try_lock(libc::LOCK_UN);
        relock(&*image, &top, libc::LOCK_UN);
        assert!(try_lock(libc::LOCK_EX));
        drop(image);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
