//! Helpers for the formats' unit tests, which play the engine's part.

use std::os::unix::fs::FileExt;

use crate::{Extent, Image};

/// Prepares and maps a write the way the engine does, without writing its
/// data yet: what is in flight between `plan` and the completion.
pub(crate) fn start(img: &(impl Image + ?Sized), offset: u64, len: u64) -> Vec<Extent> {
    img.prepare_write(offset, len).unwrap();
    let mut ext = Vec::new();
    img.map_write(offset, len, &mut ext).unwrap();
    ext
}

/// Lands the data of a write [`start`]ed earlier and reports it done.
pub(crate) fn finish(img: &(impl Image + ?Sized), offset: u64, ext: &[Extent], data: &[u8]) {
    let mut at = 0;
    for e in ext {
        let Extent::Data { file, offset, len } = *e else { panic!("a write mapped to zeros: {e:?}") };
        img.files()[file].write_all_at(&data[at..at + len as usize], offset).unwrap();
        at += len as usize;
    }
    img.write_done(offset, data.len() as u64, false).unwrap();
}

/// Writes through the image the way the engine does: prepare, map, pwrite, done.
pub(crate) fn write(img: &(impl Image + ?Sized), offset: u64, data: &[u8]) {
    let ext = start(img, offset, data.len() as u64);
    finish(img, offset, &ext, data);
}

/// Reads `len` bytes at `offset` through the image's mapping, as the engine does.
pub(crate) fn read(img: &(impl Image + ?Sized), offset: u64, len: u64) -> Vec<u8> {
    let mut ext = Vec::new();
    img.map_read(offset, len, &mut ext).unwrap();
    let mut out = Vec::new();
    for e in ext {
        match e {
            Extent::Zero { len } => out.extend(std::iter::repeat_n(0u8, len as usize)),
            Extent::Data { file, offset, len } => {
                let mut b = vec![0u8; len as usize];
                img.files()[file].read_exact_at(&mut b, offset).unwrap();
                out.extend(b);
            }
        }
    }
    assert_eq!(out.len() as u64, len);
    out
}
