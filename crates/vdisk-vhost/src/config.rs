//! What the guest learns about the disk: the virtio feature bits offered and
//! the virtio-blk configuration space, encoded by hand (little-endian, at the
//! offsets of the virtio 1.x layout) so no struct layout is trusted.

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// The logical block size the guest sees. 512 rather than 4096: guests then
/// accept any sector-aligned request (the rig writes single 512-byte sectors
/// with O_DIRECT), and the engine already takes unaligned requests; the 4 KiB
/// physical size is advertised through TOPOLOGY so file systems still align.
pub const SECTOR: u64 = 512;
/// Physical block = SECTOR << PHYSICAL_EXP (4 KiB).
const PHYSICAL_EXP: u8 = 3;
/// Largest queue the frontend may configure.
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// Data segments per request: a queue of the common size 128 minus the header
/// and status descriptors, so a guest without indirect descriptors fits too.
pub const SEG_MAX: u32 = 126;
/// Largest data segment.
pub const SIZE_MAX: u32 = 1 << 20;
/// Largest DISCARD / WRITE_ZEROES, in sectors (4 GiB), one range per request.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 23;
pub const MAX_DISCARD_SEG: u32 = 1;
/// Serial number bytes (GET_ID).
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
/// Bytes of the configuration space we present (up to write_zeroes_may_unmap and its padding).
pub const CONFIG_LEN: usize = 60;
/// Offset of the writeback flag, the only field the guest may write.
pub const WCE_OFFSET: usize = 32;

fn bit(b: u32) -> u64 {
    1u64 << b
}

/// The virtio features offered for a device.
pub fn features(read_only: bool) -> u64 {
    let mut f = bit(VIRTIO_F_VERSION_1)
        | bit(VIRTIO_RING_F_INDIRECT_DESC)
        | bit(VIRTIO_RING_F_EVENT_IDX)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | bit(VIRTIO_BLK_F_SIZE_MAX)
        | bit(VIRTIO_BLK_F_SEG_MAX)
        | bit(VIRTIO_BLK_F_BLK_SIZE)
        | bit(VIRTIO_BLK_F_FLUSH)
        | bit(VIRTIO_BLK_F_TOPOLOGY)
        | bit(VIRTIO_BLK_F_CONFIG_WCE)
        | bit(VIRTIO_BLK_F_MQ);
    if read_only {
        f |= bit(VIRTIO_BLK_F_RO);
    } else {
        f |= bit(VIRTIO_BLK_F_DISCARD) | bit(VIRTIO_BLK_F_WRITE_ZEROES);
    }
    f
}

pub fn has(features: u64, b: u32) -> bool {
    features & bit(b) != 0
}

/// The configuration space for a disk of `size` bytes with `num_queues` queues.
pub fn encode(size: u64, num_queues: u16, writeback: bool) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    put(0, &(size / SECTOR).to_le_bytes()); // capacity
    put(8, &SIZE_MAX.to_le_bytes());
    put(12, &SEG_MAX.to_le_bytes());
    // geometry (16..20) stays zero: nothing modern reads it.
    put(20, &(SECTOR as u32).to_le_bytes()); // blk_size
    put(24, &[PHYSICAL_EXP, 0]); // physical_block_exp, alignment_offset
    put(26, &(1u16 << PHYSICAL_EXP).to_le_bytes()); // min_io_size, in logical blocks
    put(28, &0u32.to_le_bytes()); // opt_io_size: no preference
    put(WCE_OFFSET, &[writeback as u8]);
    put(34, &num_queues.to_le_bytes());
    put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
    put(40, &MAX_DISCARD_SEG.to_le_bytes());
    put(44, &(1u32 << PHYSICAL_EXP).to_le_bytes()); // discard_sector_alignment
    put(48, &MAX_DISCARD_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
    put(52, &MAX_DISCARD_SEG.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

/// A stable 20-byte serial for GET_ID: "vdisk-" and a hash of the image's
/// path, so the same image gets the same /dev/disk/by-id name every time.
pub fn serial(path: &std::path::Path) -> [u8; ID_BYTES] {
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    // FNV-1a, 64 bit: stable across builds and platforms (unlike DefaultHasher).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canon.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let text = format!("vdisk-{:014x}", h & ((1 << 56) - 1));
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(&text.as_bytes()[..ID_BYTES]);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_at_their_offsets() {
        let c = encode(1 << 30, 2, true);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), (1 << 30) / 512);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(c[WCE_OFFSET], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(c[56], 1);
        assert_eq!(encode(1 << 30, 2, false)[WCE_OFFSET], 0);
    }

    #[test]
    fn serial_is_stable_and_20_bytes() {
        let a = serial(std::path::Path::new("/nonexistent/disk.img"));
        assert_eq!(a, serial(std::path::Path::new("/nonexistent/disk.img")));
        assert_ne!(a, serial(std::path::Path::new("/nonexistent/other.img")));
        assert!(a.starts_with(b"vdisk-"));
    }

    #[test]
    fn read_only_offers_no_discard() {
        assert!(has(features(true), VIRTIO_BLK_F_RO));
        assert!(!has(features(true), VIRTIO_BLK_F_DISCARD));
        assert!(has(features(false), VIRTIO_BLK_F_WRITE_ZEROES));
    }
}
