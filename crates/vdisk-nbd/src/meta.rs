//! NBD metadata contexts: which block-status "meanings" an export offers,
//! how NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT queries select
//! them (NetworkBlockDevice/nbd doc/proto.md; qemu's docs/interop/nbd.txt),
//! and the descriptors each one puts in a block-status reply.
//!
//! Offered, in this order (a context's id on a connection is its index + 1):
//! `base:allocation` (hole/zero flags), `qemu:allocation-depth` (the chain
//! layer holding a run: 1 the top, 2 its backing, ..., 0 none), and
//! `qemu:dirty-bitmap:NAME` for each bitmap the export is given (flag 1:
//! dirty). LIST takes namespace queries too ("base:", "qemu:",
//! "qemu:dirty-bitmap:"; no query at all lists everything); SET selects only
//! by whole names, and a name that matches nothing is simply not selected.
//!
//! What it owns: parsing the option's data (untrusted bytes) and matching;
//! the reply bytes for each context. It does no I/O.

use std::sync::Arc;

use vdisk_image::bitmap::DirtyBitmap;
use vdisk_image::Allocation;

use crate::proto::*;

pub const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// The flag of a dirty run in `qemu:dirty-bitmap:` replies.
pub const STATE_DIRTY: u32 = 1;
/// Longest query or export name accepted in the option's data.
const MAX_STRING: usize = 4096;
/// Most queries in one option.
const MAX_QUERIES: u32 = 1024;

/// The bitmaps an export serves as `qemu:dirty-bitmap:NAME`, by NAME.
pub type ServedBitmaps = Arc<[(String, Arc<DirtyBitmap>)]>;

/// One context an export offers.
#[derive(Debug, Clone)]
pub enum Context {
    BaseAllocation,
    AllocationDepth,
    DirtyBitmap(String, Arc<DirtyBitmap>),
}

impl Context {
    pub fn name(&self) -> String {
        match self {
            Context::BaseAllocation => META_BASE_ALLOCATION.to_owned(),
            Context::AllocationDepth => ALLOCATION_DEPTH.to_owned(),
            Context::DirtyBitmap(n, _) => format!("{DIRTY_BITMAP_PREFIX}{n}"),
        }
    }

    /// True when a LIST query `q` (namespace or whole name) names this context.
    fn listed_by(&self, q: &str) -> bool {
        match self {
            Context::BaseAllocation => q == "base:",
            Context::AllocationDepth => q == "qemu:",
            Context::DirtyBitmap(..) => q == "qemu:" || q == DIRTY_BITMAP_PREFIX,
        }
    }
}

/// A context selected on a connection, with its id.
#[derive(Debug, Clone)]
pub struct Selected {
    pub id: u32,
    pub context: Context,
}

/// What an export offers, in id order.
pub fn offered(bitmaps: &[(String, Arc<DirtyBitmap>)]) -> Vec<Context> {
    let mut v = vec![Context::BaseAllocation, Context::AllocationDepth];
    v.extend(bitmaps.iter().map(|(n, b)| Context::DirtyBitmap(n.clone(), b.clone())));
    v
}

/// The option's data: export name, then the queries. None when malformed
/// (short, trailing bytes, a string over 4 KiB, over 1024 queries).
pub fn parse(data: &[u8]) -> Option<(String, Vec<String>)> {
    let mut r = data;
    let mut take = |n: usize| -> Option<&[u8]> {
        if r.len() < n {
            return None;
        }
        let (a, b) = r.split_at(n);
        r = b;
        Some(a)
    };
    let u32_at = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let name_len = u32_at(take(4)?) as usize;
    if name_len > MAX_STRING {
        return None;
    }
    let name = String::from_utf8_lossy(take(name_len)?).into_owned();
    let n = u32_at(take(4)?);
    if n > MAX_QUERIES {
        return None;
    }
    let mut queries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let len = u32_at(take(4)?) as usize;
        if len > MAX_STRING {
            return None;
        }
        queries.push(String::from_utf8_lossy(take(len)?).into_owned());
    }
    r.is_empty().then_some((name, queries))
}

/// The contexts of `offered` the queries pick, each once, in id order,
/// with their ids. `list`: LIST's rules (namespace queries; none lists all).
pub fn matching(offered: &[Context], queries: &[String], list: bool) -> Vec<Selected> {
    offered
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            (list && queries.is_empty()) || queries.iter().any(|q| *q == c.name() || (list && c.listed_by(q)))
        })
        .map(|(i, c)| Selected { id: i as u32 + 1, context: c.clone() })
        .collect()
}

/// The block-status chunks of one reply: one per selected context, in
/// order, the last flagged DONE. `runs` is the image's allocation from
/// `offset` (it may stop short of `len`); at most `max` descriptors each
/// (1 for REQ_ONE).
pub fn encode_block_status(
    out: &mut Head,
    cookie: u64,
    contexts: &[Selected],
    (offset, len): (u64, u64),
    runs: &[Allocation],
    max: usize,
) {
    let last = contexts.len().saturating_sub(1);
    for (i, s) in contexts.iter().enumerate() {
        let mut descs: Vec<(u32, u32)> = Vec::new();
        let add = |descs: &mut Vec<(u32, u32)>, n: u64, flags: u32| match descs.last_mut() {
            Some(d) if d.1 == flags && d.0 as u64 + n <= u32::MAX as u64 => d.0 += n as u32,
            _ => descs.push((n as u32, flags)),
        };
        match &s.context {
            Context::BaseAllocation | Context::AllocationDepth => {
                let mut left = len;
                for r in runs {
                    if left == 0 {
                        break;
                    }
                    let n = r.len.min(left);
                    left -= n;
                    let flags = match s.context {
                        Context::BaseAllocation => {
                            (if r.hole { STATE_HOLE } else { 0 }) | if r.zero { STATE_ZERO } else { 0 }
                        }
                        _ => r.depth,
                    };
                    add(&mut descs, n, flags);
                }
                if runs.is_empty() {
                    add(&mut descs, len, if matches!(s.context, Context::AllocationDepth) { 1 } else { 0 });
                }
            }
            Context::DirtyBitmap(_, map) => {
                for (n, dirty) in map.extents(offset, len, max.max(1)) {
                    add(&mut descs, n, if dirty { STATE_DIRTY } else { 0 });
                }
                if descs.is_empty() {
                    // Past the bitmap's end (it cannot be): clean.
                    add(&mut descs, len, 0);
                }
            }
        }
        descs.truncate(max.max(1));
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        chunk_header(out, flags, REPLY_TYPE_BLOCK_STATUS, cookie, 4 + 8 * descs.len() as u32);
        out.extend_from_slice(&s.id.to_be_bytes());
        for (n, f) in descs {
            out.extend_from_slice(&n.to_be_bytes());
            out.extend_from_slice(&f.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn names(s: &[Selected]) -> Vec<(u32, String)> {
        s.iter().map(|s| (s.id, s.context.name())).collect()
    }

    fn two_bitmaps() -> Vec<Context> {
        let b = |g| Arc::new(DirtyBitmap::new(1 << 20, g).unwrap());
        offered(&[("b0".into(), b(65536)), ("b1".into(), b(4096))])
    }

    #[test]
    fn list_takes_namespaces_and_set_only_whole_names() {
        let o = two_bitmaps();
        assert_eq!(matching(&o, &[], true).len(), 4);
        assert!(matching(&o, &[], false).is_empty());
        assert_eq!(
            names(&matching(&o, &q(&["qemu:"]), true)),
            [(2, ALLOCATION_DEPTH.into()), (3, "qemu:dirty-bitmap:b0".into()), (4, "qemu:dirty-bitmap:b1".into())]
        );
        assert_eq!(matching(&o, &q(&["qemu:dirty-bitmap:"]), true).len(), 2);
        assert_eq!(names(&matching(&o, &q(&["base:"]), true)), [(1, "base:allocation".into())]);
        assert!(matching(&o, &q(&["qemu:", "base:", "qemu:dirty-bitmap:"]), false).is_empty());
        let set = matching(
            &o,
            &q(&["qemu:dirty-bitmap:b1", "nope:x", "qemu:dirty-bitmap:zz", "base:allocation", "base:allocation"]),
            false,
        );
        assert_eq!(names(&set), [(1, "base:allocation".into()), (4, "qemu:dirty-bitmap:b1".into())]);
    }

    #[test]
    fn malformed_option_data_is_refused() {
        let mut d = Vec::new();
        d.extend_from_slice(&4u32.to_be_bytes());
        d.extend_from_slice(b"disk");
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&5u32.to_be_bytes());
        d.extend_from_slice(b"qemu:");
        assert_eq!(parse(&d), Some(("disk".into(), q(&["qemu:"]))));
        for n in 0..d.len() {
            assert_eq!(parse(&d[..n]), None);
        }
        d.push(0);
        assert_eq!(parse(&d), None);
    }

    #[test]
    fn one_chunk_per_context_and_only_the_last_is_done() {
        let o = two_bitmaps();
        let Context::DirtyBitmap(_, b0) = &o[2] else { unreachable!() };
        b0.set(65536, 1);
        let sel = matching(&o, &q(&["base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0"]), false);
        let runs = [
            Allocation { len: 4096, hole: false, zero: false, depth: 1 },
            Allocation { len: 4096, hole: false, zero: false, depth: 2 },
            Allocation { len: 1 << 20, hole: true, zero: true, depth: 0 },
        ];
        let mut out = Head::new();
        encode_block_status(&mut out, 7, &sel, (0, 1 << 20), &runs, 100);
        // base: 2 descriptors (data merged, hole); depth: 3; bitmap: clean, dirty, clean.
        let sizes = [20 + 4 + 2 * 8, 20 + 4 + 3 * 8, 20 + 4 + 3 * 8];
        assert_eq!(out.len(), sizes.iter().sum::<usize>());
        let mut at = 0;
        for (i, n) in sizes.iter().enumerate() {
            let flags = u16::from_be_bytes([out[at + 4], out[at + 5]]);
            assert_eq!(flags, if i == 2 { REPLY_FLAG_DONE } else { 0 });
            assert_eq!(u32::from_be_bytes(out[at + 20..at + 24].try_into().unwrap()), sel[i].id);
            at += n;
        }
        let bm = &out[sizes[0] + sizes[1] + 24..];
        let desc = |k: usize| {
            (
                u32::from_be_bytes(bm[8 * k..8 * k + 4].try_into().unwrap()),
                u32::from_be_bytes(bm[8 * k + 4..8 * k + 8].try_into().unwrap()),
            )
        };
        assert_eq!([desc(0), desc(1), desc(2)], [(65536, 0), (65536, 1), ((1 << 20) - 131072, 0)]);
    }
}
