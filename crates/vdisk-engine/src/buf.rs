//! `Buf`: a request's data buffer, aligned for O_DIRECT. It behaves like a
//! `Vec<u8>` for what the exports need (build, fill, slice) but its memory
//! always starts on a 4 KiB boundary, so the engine can hand it to the kernel
//! for direct I/O without a bounce copy.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The alignment of every buffer: enough for O_DIRECT on any common device.
pub const ALIGN: usize = 4096;

pub struct Buf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: Buf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for Buf {}
// SAFETY: shared access only reads, like &Vec<u8>.
unsafe impl Sync for Buf {}

impl Buf {
    pub const fn new() -> Buf {
        Buf { ptr: NonNull::dangling(), len: 0, cap: 0 }
    }

    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Buf {
        let mut b = Buf::new();
        b.resize(len);
        b
    }

    pub fn from_slice(data: &[u8]) -> Buf {
        let mut b = Buf::new();
        b.extend_from_slice(data);
        b
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, ALIGN).expect("buffer size fits a layout")
    }

    /// Makes room for `cap` bytes in all, keeping the contents.
    pub fn reserve_total(&mut self, cap: usize) {
        if cap <= self.cap {
            return;
        }
        // SAFETY: the layout has a non-zero size (cap > self.cap >= 0) and a valid alignment.
        let new = unsafe { alloc::alloc_zeroed(Self::layout(cap)) };
        let Some(new) = NonNull::new(new) else { alloc::handle_alloc_error(Self::layout(cap)) };
        if self.cap > 0 {
            // SAFETY: both regions are valid for `len` bytes and distinct allocations;
            // the old one was allocated with this layout and is freed exactly once.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), new.as_ptr(), self.len);
                alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap));
            }
        }
        self.ptr = new;
        self.cap = cap;
    }

    /// Sets the length; new bytes are zero.
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            self.reserve_total(len);
        } else if len > self.len {
            // SAFETY: [len, new len) is inside the allocation.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(self.len), 0, len - self.len) };
        }
        self.len = len;
    }

    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let old = self.len;
        if old + data.len() > self.cap {
            self.reserve_total((old + data.len()).max(self.cap * 2));
        }
        self.len = old + data.len();
        self[old..].copy_from_slice(data);
    }

    pub fn is_aligned(&self) -> bool {
        (self.ptr.as_ptr() as usize).is_multiple_of(ALIGN)
    }
}

impl Default for Buf {
    fn default() -> Self {
        Buf::new()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated with this layout, freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
        }
    }
}

impl Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf({} bytes)", self.len)
    }
}

impl PartialEq<Vec<u8>> for Buf {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self[..] == other[..]
    }
}

impl PartialEq<[u8]> for Buf {
    fn eq(&self, other: &[u8]) -> bool {
        self[..] == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_growable_and_zeroed() {
        let mut b = Buf::zeroed(10);
        assert!(b.is_aligned());
        assert!(b.iter().all(|&x| x == 0));
        b.extend_from_slice(&[1; 5000]);
        assert!(b.is_aligned());
        assert_eq!(b.len(), 5010);
        assert_eq!(b[10], 1);
        b.resize(3);
        b.resize(8);
        assert_eq!(&b[..], &[0u8; 8]);
        let e = Buf::new();
        assert!(e.is_empty());
        assert_eq!(Buf::from_slice(b"abc"), b"abc".to_vec());
    }
}
