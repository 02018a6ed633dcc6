//! `Buf`: a request's data buffer, aligned for O_DIRECT and pooled. It behaves
//! like a `Vec<u8>` for what the exports need (build, fill, slice) but its
//! memory always starts on a 4 KiB boundary, so the engine can hand it to the
//! kernel for direct I/O without a bounce copy.
//!
//! Allocations come in power-of-two classes from 4 KiB to 32 MiB and return to
//! a process-wide pool when dropped (up to [`POOL_LIMIT`] bytes in all), so a
//! steady stream of requests allocates nothing and large buffers are not
//! mapped and unmapped (and page-faulted in) per request.
//!
//! Memory the engine does not own (a VM guest's) is never a `Buf`: see
//! [`crate::Lent`].

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The alignment of every buffer: enough for O_DIRECT on any common device.
pub const ALIGN: usize = 4096;
/// Most bytes the pool keeps for reuse.
pub const POOL_LIMIT: usize = 128 << 20;
/// Allocations from this size up are anonymous mappings of their own: zero
/// without being written, so their pages are faulted in only where a request
/// puts data. (The allocator's `alloc_zeroed` with 4 KiB alignment writes
/// every byte, which made each FUSE ring entry's 1 MiB payload resident at
/// start whether or not a request ever used it.)
const MAP_MIN: usize = 128 << 10;
const MIN_CLASS: u32 = 12;
const MAX_CLASS: u32 = 25;
const CLASSES: usize = (MAX_CLASS - MIN_CLASS + 1) as usize;

/// Free buffers by size class. Pointers in here are owned by the pool.
struct Pool {
    free: [Mutex<Vec<usize>>; CLASSES],
    bytes: AtomicUsize,
}

static POOL: Pool = Pool { free: [const { Mutex::new(Vec::new()) }; CLASSES], bytes: AtomicUsize::new(0) };

/// The class (allocation size) that holds `len` bytes, if pooled.
fn class_of(len: usize) -> Option<(usize, usize)> {
    let size = len.max(ALIGN).next_power_of_two();
    let class = size.trailing_zeros();
    (class <= MAX_CLASS).then(|| ((class - MIN_CLASS) as usize, size))
}

/// An allocation of at least `len` bytes, initialised (zeroed when new, stale
/// bytes of an earlier request when reused), and its capacity.
fn obtain(len: usize) -> (NonNull<u8>, usize) {
    let (cap, pooled) = match class_of(len) {
        Some((class, size)) => (size, POOL.free[class].lock().unwrap().pop()),
        None => (len, None),
    };
    if let Some(p) = pooled {
        POOL.bytes.fetch_sub(cap, Ordering::Relaxed);
        // SAFETY: only non-null pointers from `give_back` are in the pool.
        return (unsafe { NonNull::new_unchecked(p as *mut u8) }, cap);
    }
    let layout = Buf::layout(cap);
    if cap >= MAP_MIN {
        // SAFETY: a fresh private anonymous mapping; it touches no memory of ours.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            alloc::handle_alloc_error(layout);
        }
        // SAFETY: mmap succeeded, so `p` is non-null (and page-aligned, which is ALIGN).
        return (unsafe { NonNull::new_unchecked(p.cast()) }, cap);
    }
    // SAFETY: the layout has a non-zero size and a valid alignment.
    let p = unsafe { alloc::alloc_zeroed(layout) };
    (NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout)), cap)
}

/// Returns an allocation to the pool, or frees it when the pool is full or the size is not a class.
fn give_back(ptr: NonNull<u8>, cap: usize) {
    if let Some((class, size)) = class_of(cap) {
        if size == cap && POOL.bytes.fetch_add(cap, Ordering::Relaxed) + cap <= POOL_LIMIT {
            POOL.free[class].lock().unwrap().push(ptr.as_ptr() as usize);
            return;
        }
        if size == cap {
            POOL.bytes.fetch_sub(cap, Ordering::Relaxed);
        }
    }
    if cap >= MAP_MIN {
        // SAFETY: mapped by `obtain` with this length, and given back exactly once.
        unsafe { libc::munmap(ptr.as_ptr().cast(), cap) };
        return;
    }
    // SAFETY: allocated by `obtain` with this layout, and given back exactly once.
    unsafe { alloc::dealloc(ptr.as_ptr(), Buf::layout(cap)) };
}

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
        let mut b = Buf::for_io(len);
        b.fill(0);
        b
    }

    /// `len` bytes whose contents are unspecified (possibly an earlier
    /// request's data): for buffers the I/O will fill completely.
    pub fn for_io(len: usize) -> Buf {
        if len == 0 {
            return Buf::new();
        }
        let (ptr, cap) = obtain(len);
        Buf { ptr, len, cap }
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
        let (new, new_cap) = obtain(cap);
        if self.cap > 0 {
            // SAFETY: both regions are valid for `len` bytes and are distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), new.as_ptr(), self.len) };
            give_back(self.ptr, self.cap);
        }
        self.ptr = new;
        self.cap = new_cap;
    }

    /// Sets the length; new bytes are zero.
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            self.reserve_total(len);
        } else if len > self.len {
            let tail = self.ptr.as_ptr().wrapping_add(self.len);
            // SAFETY: [self.len, len) is inside the allocation (len <= cap).
            unsafe { std::ptr::write_bytes(tail, 0, len - self.len) };
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

    /// Bytes the allocation holds; [`Buf::set_len`] may go up to this.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length within the capacity without touching the bytes: they
    /// are whatever the allocation holds (zeros when new, or what the last
    /// user or the kernel wrote there). For buffers filled from outside, such
    /// as a FUSE ring entry's payload. Panics past the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "Buf::set_len({len}) past capacity {}", self.cap);
        // Every byte of an allocation is initialised: `obtain` zeroes new ones.
        self.len = len;
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
            crate::faults::freeing(self.ptr.as_ptr(), self.cap);
            give_back(self.ptr, self.cap);
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

    /// Pages of a large buffer are resident only once written (a FUSE ring
    /// entry's 1 MiB payload costs nothing until a request uses it).
    #[test]
    fn large_buffers_are_faulted_in_on_use() {
        let len = (33 << 20) + 4096; // past the largest class: always a fresh mapping
        let mut b = Buf::for_io(len);
        let resident = |b: &Buf| {
            let mut vec = vec![0u8; b.capacity().div_ceil(4096)];
            // SAFETY: the range is our mapping and `vec` has one byte per page of it.
            let r = unsafe { libc::mincore(b.as_ptr() as *mut _, b.capacity(), vec.as_mut_ptr()) };
            assert_eq!(r, 0);
            vec.iter().filter(|&&v| v & 1 != 0).count()
        };
        assert!(b.is_aligned());
        assert_eq!(resident(&b), 0);
        assert!(b[..8192].iter().all(|&x| x == 0));
        b[..8192].fill(7);
        assert_eq!(resident(&b), 2);
    }

    #[test]
    fn buffers_are_reused_from_the_pool() {
        let a = Buf::for_io(100_000);
        drop(a);
        // Same class (128 KiB): normally the buffer just dropped.
        let b = Buf::for_io(120_000);
        assert!(b.is_aligned());
        assert_eq!(b.len(), 120_000);
        let z = Buf::zeroed(120_000);
        assert!(z.iter().all(|&x| x == 0), "zeroed() zeroes a reused buffer");
    }
}
