//! Entry point for the `virtio_blk` fuzz target (fuzz/fuzz_targets/virtio_blk.rs):
//! the virtio-blk parser judging one descriptor chain that the input controls
//! entirely — the descriptor table, the head, the headers and data in guest
//! memory, and the device's limits. Not part of the API.
//!
//! Input layout: byte 0 picks the limits (bit 0 read-only, bit 1 writeback,
//! bits 2–3 the disk size), byte 1 the head descriptor, bytes 2..258 are the
//! descriptor table (16 descriptors at guest address 0), and the rest is copied
//! into guest memory at 0x1000. Guest memory is two regions, 0..64 KiB and
//! 128..144 KiB, so chains can point into holes and across region ends.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

use virtio_queue::{Queue, QueueOwnedT, QueueT};

use crate::parse::{parse, write_id, Action, Limits, Parsed};

const QSIZE: u16 = 16;
const AVAIL: u64 = 0x100;
const USED: u64 = 0x200;
const DATA: u64 = 0x1000;
const SIZES: [u64; 4] = [512, 1 << 20, 1 << 30, 1 << 40];

/// Parses the chain the input describes and checks what the parser promises of
/// every request it lets through. Returns the decision (None when the queue
/// yields no chain, e.g. a head past the table).
pub fn virtio_blk_input(input: &[u8]) -> Option<Parsed> {
    let mut head = [0u8; 258];
    let n = input.len().min(head.len());
    head[..n].copy_from_slice(&input[..n]);
    let limits =
        Limits { read_only: head[0] & 1 != 0, writeback: head[0] & 2 != 0, size: SIZES[(head[0] >> 2) as usize & 3] };
    let mem: GuestMemoryMmap<()> =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000), (GuestAddress(0x20000), 0x4000)]).ok()?;
    mem.write_slice(&head[2..], GuestAddress(0)).ok()?;
    let rest = input.get(head.len()..).unwrap_or_default();
    mem.write_slice(&rest[..rest.len().min(0xf000)], GuestAddress(DATA)).ok()?;
    mem.write_obj(1u16, GuestAddress(AVAIL + 2)).ok()?;
    mem.write_obj(u16::from(head[1]) % QSIZE, GuestAddress(AVAIL + 4)).ok()?;

    let mut queue = Queue::new(QSIZE).ok()?;
    queue.set_size(QSIZE);
    queue.set_desc_table_address(Some(0), Some(0));
    queue.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    queue.set_used_ring_address(Some(USED as u32), Some(0));
    queue.set_ready(true);
    let chain = queue.iter(&mem).ok()?.next()?;
    let parsed = parse(chain, &limits);

    if let Some(at) = parsed.status {
        assert!(mem.check_range(at, 1, vm_memory::Permissions::Write), "status byte outside guest memory: {parsed:?}");
    }
    match &parsed.action {
        Action::Io { op, offset, len, segs, .. } => {
            assert!(parsed.status.is_some(), "a request without a status byte went to the engine");
            assert!(offset.checked_add(*len).is_some_and(|end| end <= limits.size), "out of range: {parsed:?}");
            let data: u64 = segs.iter().map(|&(_, l)| u64::from(l)).sum();
            if op.is_data() {
                assert!(*len > 0 && len % 512 == 0 && data == *len, "bad data length: {parsed:?}");
                assert!(
                    !(limits.read_only && matches!(op, vdisk_engine::Op::Write { .. })),
                    "write to a read-only disk"
                );
            }
            for &(addr, l) in segs {
                assert!(addr.checked_add(u64::from(l)).is_some(), "segment wraps: {parsed:?}");
                assert!(mem.check_range(addr, l as usize, vm_memory::Permissions::Read), "segment outside memory");
            }
        }
        Action::GetId { segs } => {
            assert!(!segs.is_empty());
            write_id(&mem, segs, &[b'v'; crate::config::ID_BYTES]);
        }
        Action::Answer(_) => {}
    }
    Some(parsed)
}

#[cfg(test)]
mod tests {
    //! Replays the kept corpus (fuzz/corpus/virtio_blk/) and every one-bit
    //! change of its inputs' first 300 bytes, so `cargo test` checks the
    //! properties too.

    use super::*;
    use crate::parse::S_IOERR;
    use std::path::PathBuf;

    fn corpus() -> Vec<(String, Vec<u8>)> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/virtio_blk");
        let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (run fuzz/make-seeds.py)", dir.display()))
            .map(|e| {
                let p = e.unwrap().path();
                (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
            })
            .collect();
        seeds.sort();
        seeds
    }

    #[test]
    fn seeds_are_what_they_say() {
        let seeds = corpus();
        let get = |name: &str| {
            let input = &seeds.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no seed {name}")).1;
            virtio_blk_input(input).unwrap().action
        };
        assert!(matches!(get("read"), Action::Io { op: vdisk_engine::Op::Read, len: 512, .. }));
        assert!(matches!(get("write"), Action::Io { op: vdisk_engine::Op::Write { .. }, len: 1024, .. }));
        assert!(matches!(get("flush"), Action::Io { op: vdisk_engine::Op::Flush, .. }));
        assert!(matches!(get("get_id"), Action::GetId { .. }));
        assert!(matches!(get("discard"), Action::Io { op: vdisk_engine::Op::Trim { .. }, .. }));
        assert!(matches!(get("write_zeroes_unmap"), Action::Io { op: vdisk_engine::Op::WriteZeroes { .. }, .. }));
        assert!(matches!(get("indirect_read"), Action::Io { op: vdisk_engine::Op::Read, len: 4096, .. }));
        assert_eq!(get("across_region_end"), Action::Answer(S_IOERR));
    }

    #[test]
    fn one_bit_changes_never_break_the_promises() {
        let mut runs = 0;
        for (_, seed) in corpus() {
            virtio_blk_input(&seed);
            for i in 0..seed.len().min(300) {
                for bit in 0..8 {
                    let mut v = seed.clone();
                    v[i] ^= 1 << bit;
                    virtio_blk_input(&v);
                    runs += 1;
                }
            }
        }
        assert!(runs > 1000, "too few inputs replayed: {runs}");
    }
}
