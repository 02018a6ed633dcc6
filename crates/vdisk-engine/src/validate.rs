//! The one check of a request's range, length, alignment and the device's
//! read-only state. Every export calls [`validate`] at its edge, before a
//! request reaches the engine, and maps the [`Refusal`] to its own wire error
//! (NBD's errno, FUSE's, a virtio-blk status). Below the edge these
//! conditions are invariants: the planner and the workers only
//! `debug_assert!` them ([`debug_assert_valid`]), they never check again.
//!
//! What a refusal means on the wire stays the export's: NBD refuses an empty
//! request, virtio-blk completes it, a FUSE read past the end is short. The
//! engine only says which rule the request breaks, in a fixed order:
//! read-only, length, alignment, range, empty.

use vdisk_image::Image;

use crate::Op;

/// What a request is judged against: the device's size and read-only state,
/// and the export's own limits (the defaults, from [`crate::Device::bounds`],
/// have none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Bytes of the device.
    pub size: u64,
    /// Writes, trims and write zeroes are refused.
    pub read_only: bool,
    /// The longest read or write the export takes.
    pub max_data: u64,
    /// The longest trim or write zeroes the export takes.
    pub max_zero: u64,
    /// Offsets and lengths are multiples of this (1: any byte).
    pub align: u64,
}

impl Bounds {
    /// A device of `size` bytes with no limits of an export.
    pub fn new(size: u64, read_only: bool) -> Bounds {
        Bounds { size, read_only, max_data: u64::MAX, max_zero: u64::MAX, align: 1 }
    }
}

/// Why [`validate`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A write, trim or write zeroes on a read-only device.
    ReadOnly,
    /// Longer than the export's limit for the operation.
    TooLong,
    /// Offset or length not a multiple of the export's alignment.
    Misaligned,
    /// The range does not lie within the device (`offset + len` past its
    /// size, or beyond `u64`).
    OutOfRange,
    /// A zero-length range inside the device: nothing to do. Whether that is
    /// an error is the export's call.
    Empty,
}

/// Judges one request at an export's edge. A FLUSH's range means nothing: it
/// always passes (an export that wants it zero checks that itself).
pub fn validate(op: Op, offset: u64, len: u64, bounds: &Bounds) -> Result<(), Refusal> {
    if op == Op::Flush {
        return Ok(());
    }
    if op.writes() && bounds.read_only {
        return Err(Refusal::ReadOnly);
    }
    let max = match op {
        Op::Read | Op::Write { .. } => bounds.max_data,
        Op::Trim { .. } | Op::WriteZeroes { .. } => bounds.max_zero,
        _ => u64::MAX,
    };
    if len > max {
        return Err(Refusal::TooLong);
    }
    let align = bounds.align.max(1);
    if !offset.is_multiple_of(align) || !len.is_multiple_of(align) {
        return Err(Refusal::Misaligned);
    }
    if offset.checked_add(len).is_none_or(|end| end > bounds.size) {
        return Err(Refusal::OutOfRange);
    }
    if len == 0 {
        return Err(Refusal::Empty);
    }
    Ok(())
}

/// The engine's side of the edge: a request that reached it was validated, so
/// it is in range and writes only a writable device. Checked in debug builds
/// only (an empty range is harmless and allowed); a release build does not
/// even ask the image its size.
#[inline]
pub(crate) fn debug_assert_valid(op: Op, offset: u64, len: u64, image: &dyn Image) {
    if cfg!(debug_assertions) {
        let (size, read_only) = (image.size(), image.read_only());
        let r = validate(op, offset, len, &Bounds::new(size, read_only));
        assert!(
            matches!(r, Ok(()) | Err(Refusal::Empty)),
            "{} of {len} bytes at {offset} reached the engine unvalidated ({r:?}; device of {size} bytes{})",
            op.name(),
            if read_only { ", read-only" } else { "" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Op = Op::Write { fua: false };
    const Z: Op = Op::WriteZeroes { fua: false, no_hole: false, fast_zero: false };

    #[test]
    fn ranges_inside_the_device_pass() {
        let b = Bounds::new(1 << 20, false);
        for op in [Op::Read, W, Op::Trim { fua: true }, Z, Op::Cache, Op::BlockStatus { max: 1 }] {
            assert_eq!(validate(op, 0, 1 << 20, &b), Ok(()), "{op:?}");
            assert_eq!(validate(op, (1 << 20) - 1, 1, &b), Ok(()), "{op:?}");
        }
    }

    #[test]
    fn ranges_past_the_end_or_overflowing_are_refused() {
        let b = Bounds::new(1 << 20, false);
        assert_eq!(validate(Op::Read, 1 << 20, 1, &b), Err(Refusal::OutOfRange));
        assert_eq!(validate(W, (1 << 20) - 1, 2, &b), Err(Refusal::OutOfRange));
        assert_eq!(validate(Op::Read, u64::MAX, 2, &b), Err(Refusal::OutOfRange));
        assert_eq!(validate(Z, 1, u64::MAX, &b), Err(Refusal::OutOfRange));
        // An empty range is in the device up to its very end, and only then empty.
        assert_eq!(validate(Op::Read, 1 << 20, 0, &b), Err(Refusal::Empty));
        assert_eq!(validate(Op::Read, (1 << 20) + 1, 0, &b), Err(Refusal::OutOfRange));
    }

    #[test]
    fn read_only_refuses_what_writes_first() {
        let b = Bounds::new(4096, true);
        for op in [W, Op::Trim { fua: false }, Z] {
            // Read-only wins over every other rule.
            assert_eq!(validate(op, 1 << 40, 0, &b), Err(Refusal::ReadOnly), "{op:?}");
        }
        assert_eq!(validate(Op::Read, 0, 4096, &b), Ok(()));
        assert_eq!(validate(Op::Cache, 0, 4096, &b), Ok(()));
        assert_eq!(validate(Op::BlockStatus { max: 4 }, 0, 4096, &b), Ok(()));
    }

    #[test]
    fn lengths_and_alignment_follow_the_export() {
        let b = Bounds { max_data: 8192, max_zero: 1 << 30, align: 512, ..Bounds::new(1 << 40, false) };
        assert_eq!(validate(Op::Read, 0, 8192, &b), Ok(()));
        assert_eq!(validate(Op::Read, 0, 8704, &b), Err(Refusal::TooLong));
        assert_eq!(validate(W, 0, 8704, &b), Err(Refusal::TooLong));
        assert_eq!(validate(Z, 0, 1 << 30, &b), Ok(()));
        assert_eq!(validate(Z, 0, (1 << 30) + 512, &b), Err(Refusal::TooLong));
        // Not data, not zeroing: no length limit.
        assert_eq!(validate(Op::Cache, 0, 1 << 31, &b), Ok(()));
        assert_eq!(validate(Op::Read, 1, 512, &b), Err(Refusal::Misaligned));
        assert_eq!(validate(Op::Read, 512, 100, &b), Err(Refusal::Misaligned));
        // Too long is named before misaligned, misaligned before out of range.
        assert_eq!(validate(Op::Read, 1, 9000, &b), Err(Refusal::TooLong));
        assert_eq!(validate(Op::Read, u64::MAX, 1, &b), Err(Refusal::Misaligned));
    }

    #[test]
    fn a_flush_passes_whatever_its_range() {
        assert_eq!(validate(Op::Flush, u64::MAX, u64::MAX, &Bounds::new(0, true)), Ok(()));
    }
}
