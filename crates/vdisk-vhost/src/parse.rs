//! The virtio-blk request parser: one descriptor chain in, one decision out.
//! It validates everything at the edge (directions, guest-memory bounds,
//! header, and through [`vdisk_engine::validate`] range, size limits,
//! alignment and read-only) so that only well-formed requests
//! ever reach the engine; everything else becomes a status to write back at
//! once (IOERR or UNSUPP). It reads guest memory but never writes it, and
//! knows nothing of the image.
//!
//! Layout is not assumed (VIRTIO 1.x, "any layout"): the device-readable
//! bytes are taken as one stream (16-byte header, then write data or a
//! discard range), the device-writable bytes as another (read data or the
//! ID, then the status byte as the very last byte).

use std::ops::Deref;

use vdisk_engine::{Bounds, Op, Refusal};
use virtio_bindings::virtio_blk::*;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use crate::config::{ID_BYTES, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SECTOR};

pub const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
pub const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
pub const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

const HEADER: usize = 16;
const RANGE: usize = 16;

/// A piece of guest memory: guest address and length, already checked to lie in guest memory.
pub type Seg = (GuestAddress, u32);

/// What the device must know to judge a request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub size: u64,
    pub read_only: bool,
    /// Writeback cache on: writes complete once in the host page cache. Off:
    /// every write (and discard, zeroing) is durable before completion.
    pub writeback: bool,
}

/// What to do with one chain.
#[derive(Debug, PartialEq)]
pub enum Action {
    /// Hand to the engine: `segs` are the data (read into / written from).
    Io { op: Op, offset: u64, len: u64, segs: Vec<Seg> },
    /// Write the serial into `segs`.
    GetId { segs: Vec<Seg> },
    /// Nothing to do but write this status.
    Answer(u8),
}

#[derive(Debug, PartialEq)]
pub struct Parsed {
    pub head: u16,
    /// Where the status byte goes; None when the chain has no writable byte
    /// (then only the used-ring entry, of length 0, tells the guest).
    pub status: Option<GuestAddress>,
    pub action: Action,
}

/// Judges one chain. Never fails: a malformed chain is an `Answer`. The walk
/// over the descriptors ([`Streams::walk`]) is separate from the decoding of
/// each request type, as virtio-queue's `Reader`/`Writer` separate them.
pub fn parse<M>(chain: DescriptorChain<M>, limits: &Limits) -> Parsed
where
    M: Deref + Clone,
    M::Target: GuestMemory,
{
    let head = chain.head_index();
    let streams = Streams::walk(&chain);
    let status = streams.status;
    let action = decode(chain.memory(), streams, limits).unwrap_or_else(Action::Answer);
    Parsed { head, status, action }
}

/// A chain's bytes as the device sees them: the device-readable descriptors
/// in order, the device-writable ones in order (without the status byte), and
/// where the status byte goes.
struct Streams {
    readable: Vec<Seg>,
    writable: Vec<Seg>,
    status: Option<GuestAddress>,
    /// Readable after writable, or a descriptor outside guest memory.
    malformed: bool,
}

impl Streams {
    fn walk<M>(chain: &DescriptorChain<M>) -> Streams
    where
        M: Deref + Clone,
        M::Target: GuestMemory,
    {
        let mem = chain.memory();
        let mut s = Streams { readable: Vec::new(), writable: Vec::new(), status: None, malformed: false };
        // Whether the chain's last non-empty descriptor is writable and in guest memory:
        // only then does its last byte hold the status.
        let mut status_ok = false;
        for d in chain.clone() {
            if d.len() == 0 {
                continue;
            }
            let access = if d.is_write_only() { Permissions::Write } else { Permissions::Read };
            status_ok = false;
            if !mem.check_range(d.addr(), d.len() as usize, access) {
                s.malformed = true;
                continue;
            }
            if d.is_write_only() {
                s.writable.push((d.addr(), d.len()));
                status_ok = true;
            } else {
                s.malformed |= !s.writable.is_empty();
                s.readable.push((d.addr(), d.len()));
            }
        }
        // The status byte: the last byte of the last descriptor.
        if let Some((addr, len)) = s.writable.last_mut().filter(|_| status_ok) {
            s.status = Some(addr.unchecked_add(u64::from(*len) - 1));
            *len -= 1;
            if *len == 0 {
                s.writable.pop();
            }
        }
        s
    }
}

/// The action of a walked chain, or the status to answer at once.
fn decode<M: GuestMemory + ?Sized>(mem: &M, streams: Streams, limits: &Limits) -> Result<Action, u8> {
    if streams.status.is_none() || streams.malformed {
        return Err(S_IOERR);
    }
    let mut header = [0u8; HEADER];
    let data_out = gather(mem, &streams.readable, &mut header).ok_or(S_IOERR)?;
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap());
    match kind {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            decode_rw(kind == VIRTIO_BLK_T_OUT, sector, data_out, streams.writable, limits)
        }
        VIRTIO_BLK_T_FLUSH => Ok(Action::Io { op: Op::Flush, offset: 0, len: 0, segs: vec![] }),
        VIRTIO_BLK_T_GET_ID if total(&streams.writable) == 0 => Err(S_IOERR),
        VIRTIO_BLK_T_GET_ID => Ok(Action::GetId { segs: streams.writable }),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            decode_discard(mem, kind == VIRTIO_BLK_T_DISCARD, &data_out, limits)
        }
        _ => Err(S_UNSUPP),
    }
}

/// IN / OUT: the data is the writable (read) or readable (write) stream after the header.
fn decode_rw(write: bool, sector: u64, data_out: Vec<Seg>, writable: Vec<Seg>, limits: &Limits) -> Result<Action, u8> {
    // Data the wrong way round (write data in writable buffers or the reverse).
    let (segs, stray) = if write { (data_out, writable) } else { (writable, data_out) };
    let len = total(&segs);
    if total(&stray) != 0 {
        return Err(S_IOERR);
    }
    let op = if write { Op::Write { fua: !limits.writeback } } else { Op::Read };
    let offset = checked(op, sector, len, limits)?;
    Ok(Action::Io { op, offset, len, segs })
}

/// DISCARD / WRITE_ZEROES: one range after the header.
fn decode_discard<M: GuestMemory + ?Sized>(
    mem: &M,
    discard: bool,
    data_out: &[Seg],
    limits: &Limits,
) -> Result<Action, u8> {
    let bytes = total(data_out);
    if bytes == 0 || !bytes.is_multiple_of(RANGE as u64) {
        return Err(S_IOERR);
    }
    if bytes / RANGE as u64 > u64::from(MAX_DISCARD_SEG) {
        return Err(S_UNSUPP);
    }
    let mut range = [0u8; RANGE];
    gather(mem, data_out, &mut range).ok_or(S_IOERR)?;
    let start = u64::from_le_bytes(range[0..8].try_into().unwrap());
    let sectors = u32::from_le_bytes(range[8..12].try_into().unwrap());
    let rflags = u32::from_le_bytes(range[12..16].try_into().unwrap());
    let allowed = if discard { 0 } else { VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP };
    if rflags & !allowed != 0 {
        return Err(S_UNSUPP);
    }
    let len = u64::from(sectors) * SECTOR;
    let fua = !limits.writeback;
    let unmap = rflags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
    let op = if discard { Op::Trim { fua } } else { Op::WriteZeroes { fua, no_hole: !unmap, fast_zero: false } };
    let offset = checked(op, start, len, limits)?;
    Ok(Action::Io { op, offset, len, segs: vec![] })
}

fn total(segs: &[Seg]) -> u64 {
    segs.iter().map(|s| u64::from(s.1)).sum()
}

/// The byte offset of a request of `len` bytes at `sector`, once the
/// engine's one check ([`vdisk_engine::validate`]) passed it: whole sectors,
/// inside the disk, no longer than a discard or zeroing may be, nothing
/// written to a read-only disk. Each refusal is IOERR, except an empty range
/// inside the disk, which is done at once (OK).
fn checked(op: Op, sector: u64, len: u64, limits: &Limits) -> Result<u64, u8> {
    let offset = sector.checked_mul(SECTOR).ok_or(S_IOERR)?;
    let bounds = Bounds {
        max_zero: u64::from(MAX_DISCARD_SECTORS) * SECTOR,
        align: SECTOR,
        ..Bounds::new(limits.size, limits.read_only)
    };
    match vdisk_engine::validate(op, offset, len, &bounds) {
        Ok(()) => Ok(offset),
        Err(Refusal::Empty) => Err(S_OK),
        Err(Refusal::ReadOnly | Refusal::TooLong | Refusal::Misaligned | Refusal::OutOfRange) => Err(S_IOERR),
    }
}

/// Fills `out` from the start of `segs`; returns the segments after it, or
/// None when they hold fewer bytes or cannot be read.
fn gather<M: GuestMemory + ?Sized>(mem: &M, segs: &[Seg], out: &mut [u8]) -> Option<Vec<Seg>> {
    let mut at = 0;
    let mut rest = Vec::new();
    for &(addr, len) in segs {
        let want = (out.len() - at).min(len as usize);
        if want > 0 {
            mem.read_slice(&mut out[at..at + want], addr).ok()?;
            at += want;
        }
        if want < len as usize {
            rest.push((addr.unchecked_add(want as u64), len - want as u32));
        }
    }
    (at == out.len()).then_some(rest)
}

/// Writes the serial into `segs`; returns the bytes written.
pub fn write_id<M: GuestMemory + ?Sized>(mem: &M, segs: &[Seg], id: &[u8; ID_BYTES]) -> Option<u32> {
    let mut at = 0;
    for &(addr, len) in segs {
        let n = (ID_BYTES - at).min(len as usize);
        mem.write_slice(&id[at..at + n], addr).ok()?;
        at += n;
        if at == ID_BYTES {
            break;
        }
    }
    Some(at as u32)
}
