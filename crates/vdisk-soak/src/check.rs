//! What the soak writes and how it judges what it reads back. Every write
//! carries a block number and a generation, so any piece of data read later
//! says which write (if any) put it there. The verdict is per 512-byte piece
//! (a crash may tear a write at sector boundaries, never inside a sector):
//! each piece must hold what it held before the round (only if no write to
//! its block became durable) or a generation written to its block at or
//! after the last durable one. Anything else is data that was lost or never
//! written there.

/// The bytes of generation `gen` of block `block` (generation 0 is the
/// pre-fill); `salt` makes every soak run's data its own.
pub fn content(salt: u64, block: u64, gen: u64, out: &mut [u8]) {
    let mut x = (salt ^ block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ gen.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// What a block saw during one round.
#[derive(Debug, Clone, Default)]
pub struct BlockLog {
    /// Every write sent to it: generation, and whether it was a zeroing
    /// command (WRITE_ZEROES or TRIM: reads back as zeros).
    pub attempts: Vec<(u64, bool)>,
    /// The newest generation that must have survived (0: none).
    pub floor: u64,
}

/// Checks `now` (the disk as read after the crash) against `prior` (as it
/// was before the round) for blocks of `bs` bytes. Returns the first
/// violation as a message naming block, bytes and what was allowed.
pub fn verify(salt: u64, bs: usize, prior: &[u8], now: &[u8], logs: &[BlockLog]) -> Result<(), String> {
    if prior.len() != now.len() {
        return Err(format!("the disk is {} bytes, was {}", now.len(), prior.len()));
    }
    let mut buf = vec![0u8; bs];
    for (b, log) in logs.iter().enumerate() {
        let start = b * bs;
        let candidates: Vec<Vec<u8>> = log
            .attempts
            .iter()
            .filter(|&&(g, _)| g >= log.floor)
            .map(|&(g, zero)| {
                if zero {
                    vec![0; bs]
                } else {
                    content(salt, b as u64, g, &mut buf);
                    buf.clone()
                }
            })
            .collect();
        if log.floor > 0 && !log.attempts.iter().any(|&(g, _)| g == log.floor) {
            return Err(format!("block {b}: durable generation {} was never attempted (harness bug)", log.floor));
        }
        let mut p = start;
        while p < start + bs {
            let q = ((p / 512 + 1) * 512).min(start + bs);
            let got = &now[p..q];
            let ok =
                (log.floor == 0 && got == &prior[p..q]) || candidates.iter().any(|c| got == &c[p - start..q - start]);
            if !ok {
                return Err(format!(
                    "block {b} bytes [{p}, {q}) hold data never written there or older than the last durable write \
                     (durable generation {}, written {:?}); got {:02x?}",
                    log.floor,
                    log.attempts,
                    &got[..8.min(got.len())]
                ));
            }
            p = q;
        }
    }
    let tail = logs.len() * bs;
    if now[tail..] != prior[tail..] {
        return Err(format!("bytes past the last block (from {tail}) changed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 1000;

    fn disk(blocks: &[(u64, u64)]) -> Vec<u8> {
        let mut d = vec![7u8; blocks.len() * BS + 100];
        for (b, &(gen, _)) in blocks.iter().enumerate() {
            if gen > 0 {
                content(1, b as u64, gen, &mut d[b * BS..(b + 1) * BS]);
            }
        }
        d
    }

    #[test]
    fn durable_and_later_generations_pass() {
        let prior = disk(&[(0, 0), (0, 0)]);
        let now = disk(&[(2, 0), (0, 0)]);
        let logs = vec![BlockLog { attempts: vec![(1, false), (2, false), (3, false)], floor: 2 }, BlockLog::default()];
        verify(1, BS, &prior, &now, &logs).unwrap();
    }

    #[test]
    fn a_lost_durable_write_is_caught() {
        let prior = disk(&[(0, 0)]);
        let now = disk(&[(1, 0)]);
        let logs = vec![BlockLog { attempts: vec![(1, false), (2, false)], floor: 2 }];
        let e = verify(1, BS, &prior, &now, &logs).unwrap_err();
        assert!(e.contains("block 0"), "{e}");
        // The pre-round content is no excuse once something was durable.
        let logs = vec![BlockLog { attempts: vec![(1, false)], floor: 1 }];
        assert!(verify(1, BS, &prior, &prior, &logs).is_err());
    }

    #[test]
    fn invented_data_is_caught() {
        let prior = disk(&[(0, 0), (0, 0)]);
        // Block 1 holds block 0's generation 1: written, but not there.
        let mut now = prior.clone();
        content(1, 0, 1, &mut now[BS..2 * BS]);
        let logs = vec![BlockLog::default(), BlockLog { attempts: vec![(1, false)], floor: 0 }];
        assert!(verify(1, BS, &prior, &now, &logs).is_err());
        let mut now = prior.clone();
        now[2 * BS + 3] ^= 1;
        assert!(verify(1, BS, &prior, &now, &logs).is_err(), "the tail changed");
    }

    #[test]
    fn torn_writes_at_sector_boundaries_pass_inside_a_sector_fail() {
        let prior = disk(&[(0, 0)]);
        let mut now = prior.clone();
        content(1, 0, 1, &mut now[..BS]);
        now[512..BS].copy_from_slice(&prior[512..BS]);
        let logs = vec![BlockLog { attempts: vec![(1, false)], floor: 0 }];
        verify(1, BS, &prior, &now, &logs).unwrap();
        now[100..BS].copy_from_slice(&prior[100..BS]);
        assert!(verify(1, BS, &prior, &now, &logs).is_err());
    }

    #[test]
    fn zeroing_commands_read_back_as_zeros() {
        let prior = disk(&[(0, 0)]);
        let mut now = prior.clone();
        now[..BS].fill(0);
        let logs = vec![BlockLog { attempts: vec![(4, true)], floor: 4 }];
        verify(1, BS, &prior, &now, &logs).unwrap();
    }
}
