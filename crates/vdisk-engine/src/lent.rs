//! `Lent`: memory an export lends the engine for one read or write, such as a
//! VM guest's (vhost-user zero copy), so the data moves between the file and
//! that memory with no copy. It is never a `&[u8]` or `&mut [u8]`: another
//! process may change it at any time, which Rust references forbid. It is an
//! address and a length, handed to the kernel as an iovec; the one thing the
//! engine writes itself is zeros (a read of a hole), with a raw write.
//!
//! The one `unsafe` a lender writes is [`Lent::new`], where it vouches for the memory.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::sys::Segment;

pub struct Lent {
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the memory mapped while the engine holds it.
    _owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: a Lent is an address the lender vouched for (see `Lent::new`); it is
// used by one thread at a time, like the request that carries it.
unsafe impl Send for Lent {}
// SAFETY: shared access reads only the address and the length, never the memory.
unsafe impl Sync for Lent {}

impl Lent {
    /// Memory of `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// For as long as `owner` is alive, `ptr` must be valid for reads and
    /// writes of `len` bytes. Until the `Lent` is dropped, nothing in this
    /// process may access them except through it (another process may: the
    /// engine never makes a reference to them, so that only affects the data).
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Lent {
        Lent { ptr, len, _owner: owner }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte (for alignment checks).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes `[at, at + len)` as a segment for a vectored call. Panics outside the memory.
    pub(crate) fn segment(&self, at: usize, len: usize) -> Segment {
        assert!(at.checked_add(len).is_some_and(|end| end <= self.len), "Lent::segment past the end");
        Segment { ptr: self.ptr.as_ptr().wrapping_add(at), len }
    }

    /// Zeroes bytes `[at, at + len)`. Panics outside the memory.
    pub(crate) fn zero(&self, at: usize, len: usize) {
        let seg = self.segment(at, len);
        // SAFETY: inside the memory `new`'s caller vouched for (checked above);
        // a raw write, no reference is made.
        unsafe { std::ptr::write_bytes(seg.ptr, 0, seg.len) };
    }
}

impl fmt::Debug for Lent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lent({} bytes at {:#x})", self.len, self.addr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn lent_memory_is_zeroed_in_place_and_released() {
        let owner = Arc::new(Mutex::new(vec![7u8; 8192]));
        let ptr = NonNull::new(owner.lock().unwrap()[100..].as_mut_ptr()).unwrap();
        // SAFETY: the Vec lives as long as `owner`, which the Lent holds; nothing else touches it meanwhile.
        let lent = unsafe { Lent::new(ptr, 4096, owner.clone()) };
        assert_eq!(lent.len(), 4096);
        lent.zero(10, 20);
        assert_eq!(lent.segment(4000, 96).len, 96);
        drop(lent);
        assert_eq!(Arc::strong_count(&owner), 1, "the hold on the owner was released");
        let v = owner.lock().unwrap();
        assert_eq!((v[109], v[110], v[129], v[130]), (7, 0, 0, 7));
    }
}
