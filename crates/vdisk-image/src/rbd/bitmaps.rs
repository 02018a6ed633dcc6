//! The dirty bitmaps of an RBD image, kept in the image's own RBD metadata
//! (`rbd_metadata_set`/`rbd_metadata_get`) under the key [`METADATA_KEY`]:
//! the bytes of vdisk's sidecar bitmap format (`bitmap::sidecar`, documented
//! in docs/design.md "Dirty bitmaps"), base64-encoded because librbd's C
//! calls carry a metadata value as a NUL-terminated string. They travel with
//! the image: any host that opens it finds them, and no local path is needed. RBD snapshots and
//! `rbd_diff_iterate2` are not used: a snapshot per bitmap would cost the
//! cluster a copy-on-write of each object first written after it.
//!
//! What it owns: reading and writing that one value. A write is one omap
//! update of the image's header object, atomic in RADOS: a crash leaves the
//! old value or the new one. The in-use rule is the sidecar's: a read-write
//! session marks every bitmap in use before the export serves a write, a
//! clean close clears the marks, and bitmaps found marked come back
//! inconsistent. A value that fails to decode is refused, never half read.

use std::ffi::c_char;
use std::sync::atomic::Ordering;

use super::{cstr, os_err, ImageT, RbdImage};
use crate::bitmap::sidecar::{decode, encode};
use crate::bitmap::{store::check_name, BitmapStore, StoredBitmap};
use crate::{Error, ErrorKind, Result};

/// The RBD metadata key holding an image's bitmaps (`rbd image-meta get POOL/IMAGE vdisk.bitmaps`).
pub const METADATA_KEY: &str = "vdisk.bitmaps";

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with `=` padding (RFC 4648).
fn base64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes of standard padded base64 `s`; None if it is not that.
fn unbase64(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (k, q) in s.chunks(4).enumerate() {
        let last = k == s.len() / 4 - 1;
        let pad = q.iter().rev().take_while(|&&b| b == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &b in &q[..4 - pad] {
            let v = ALPHABET.iter().position(|&a| a == b)? as u32;
            n = n << 6 | v;
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}

impl RbdImage {
    fn meta_hint(&self) -> String {
        format!("`rbd image-meta remove {}/{} {METADATA_KEY}` drops them", self.spec.pool, self.spec.image)
    }

    /// The bytes kept under [`METADATA_KEY`]; None if there is no such key.
    fn bitmaps_value(&self) -> Result<Option<Vec<u8>>> {
        let img = self.img().map_err(|e| Error::io(e, format!("{} is closed", self.spec)))?;
        let key = cstr(METADATA_KEY, "metadata key")?;
        let mut buf = vec![0u8; 4096];
        loop {
            let mut len = buf.len();
            // SAFETY: an open image; `buf` is writable for `len` bytes, both outlive this
            // synchronous call; librbd writes at most `len` bytes or sets `len` and fails ERANGE.
            let rc = unsafe {
                (self.conn.lib.rbd_metadata_get)(img, key.as_ptr(), buf.as_mut_ptr().cast::<c_char>(), &mut len)
            };
            match rc {
                0 => {
                    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                    buf.truncate(end);
                    return Ok(Some(buf));
                }
                r if r == -libc::ENOENT => return Ok(None),
                r if r == -libc::ERANGE && len > buf.len() => buf = vec![0u8; len],
                r => {
                    return Err(Error::io(
                        os_err(r.into()),
                        format!("cannot read the metadata {METADATA_KEY} (dirty bitmaps) of {}", self.spec),
                    ))
                }
            }
        }
    }

    /// The bitmaps kept and their generation (0 with none).
    fn read_bitmaps(&self) -> Result<(Vec<StoredBitmap>, u64)> {
        let Some(text) = self.bitmaps_value()? else {
            return Ok((Vec::new(), 0));
        };
        let what = format!("the dirty bitmaps of {} (RBD metadata {METADATA_KEY})", self.spec);
        let bytes = unbase64(&text)
            .ok_or_else(|| Error::new(ErrorKind::Corrupt, format!("{what} are not base64; {}", self.meta_hint())))?;
        decode(&bytes, self.base.size)
            .map_err(|e| Error::new(e.kind(), format!("{what}: {}; {}", e.message(), self.meta_hint())))
    }
}

impl BitmapStore for RbdImage {
    fn open_session(&self) -> Result<Vec<StoredBitmap>> {
        let (set, generation) = self.read_bitmaps()?;
        self.bitmap_generation.store(generation, Ordering::Relaxed);
        for m in set.iter().filter(|m| m.inconsistent) {
            log::warn!(
                "{}: bitmap {:?} was not saved cleanly: it is inconsistent and will not be used for \
                 incremental backup; remove it and start a new one",
                self.spec,
                m.name
            );
        }
        // Only consistent bitmaps need marking; ones found marked (after a crash) stay so. Not
        // writing then lets the export start before librbd can break a dead client's lock.
        if !self.base.read_only && set.iter().any(|m| !m.inconsistent) {
            self.save(&set, false)?;
        }
        Ok(set)
    }

    fn save(&self, set: &[StoredBitmap], close: bool) -> Result<()> {
        if self.base.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!("{} is open read-only: its bitmaps cannot be saved", self.spec),
            ));
        }
        for (i, m) in set.iter().enumerate() {
            check_name(&m.name)?;
            if m.map.size() != self.base.size || set[..i].iter().any(|o| o.name == m.name) {
                return Err(Error::invalid(format!("bitmap {:?} is of another disk size or named twice", m.name)));
            }
        }
        let generation = self.bitmap_generation.fetch_add(1, Ordering::Relaxed) + 1;
        let value = base64(&encode(self.base.size, set, close, generation));
        let key = cstr(METADATA_KEY, "metadata key")?;
        let value = cstr(&value, "metadata value")?;
        let lib = self.conn.lib;
        let rc = match self.img() {
            // SAFETY: an open image and two NUL-terminated strings alive for this synchronous call.
            Ok(img) => unsafe { (lib.rbd_metadata_set)(img, key.as_ptr(), value.as_ptr()) },
            // The clean close comes after the device's last flush, which closed the image
            // (releasing its exclusive lock): a handle of its own for this one write.
            Err(_) => {
                let name = cstr(&self.spec.image, "image name")?;
                let mut img: ImageT = std::ptr::null_mut();
                // SAFETY: the pool handle stays open while `self` lives; a NUL-terminated
                // name, a null snapshot (the image itself) and a valid out-pointer.
                let rc = unsafe { (lib.rbd_open)(self.conn.ioctx, name.as_ptr(), &mut img, std::ptr::null()) };
                if rc < 0 {
                    rc
                } else {
                    // SAFETY: the image just opened and two NUL-terminated strings alive for this call.
                    let rc = unsafe { (lib.rbd_metadata_set)(img, key.as_ptr(), value.as_ptr()) };
                    // SAFETY: opened above, closed once, nothing in flight on it.
                    unsafe { (lib.rbd_close)(img) };
                    rc
                }
            }
        };
        if rc < 0 {
            return Err(Error::io(
                os_err(rc.into()),
                format!("cannot write the metadata {METADATA_KEY} (dirty bitmaps) of {}", self.spec),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_refuses_junk() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        for n in 0..300usize {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + n) as u8).collect();
            assert_eq!(unbase64(base64(&data).as_bytes()).as_deref(), Some(&data[..]));
        }
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Zm9*", "===="] {
            assert_eq!(unbase64(bad.as_bytes()), None, "{bad}");
        }
    }
}
