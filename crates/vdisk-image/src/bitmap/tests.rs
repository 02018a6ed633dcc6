//! The dirty map against a plain `Vec<bool>` model, exhaustively on small
//! sizes and with many pseudo-random operations.

use std::sync::Arc;

use super::*;

/// A tiny deterministic generator (xorshift64*), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const G: u64 = 512;

struct Model {
    bits: Vec<bool>,
    size: u64,
}

impl Model {
    fn set(&mut self, off: u64, len: u64) {
        let end = (off + len).min(self.size);
        if len == 0 || off >= end {
            return;
        }
        for b in off / G..=(end - 1) / G {
            self.bits[b as usize] = true;
        }
    }

    fn clear(&mut self, off: u64, len: u64) {
        let end = (off + len).min(self.size);
        for (b, bit) in self.bits.iter_mut().enumerate() {
            let (s, e) = (b as u64 * G, ((b as u64 + 1) * G).min(self.size));
            if s >= off && e <= end {
                *bit = false;
            }
        }
    }

    fn extents(&self, off: u64, len: u64) -> Vec<(u64, bool)> {
        let end = (off + len).min(self.size);
        let mut out: Vec<(u64, bool)> = Vec::new();
        for pos in off..end {
            let d = self.bits[(pos / G) as usize];
            match out.last_mut() {
                Some(l) if l.1 == d => l.0 += 1,
                _ => out.push((1, d)),
            }
        }
        out
    }
}

fn check(m: &DirtyBitmap, model: &Model) {
    for (i, &b) in model.bits.iter().enumerate() {
        assert_eq!(m.get_bit(i as u64), b, "bit {i}");
    }
    assert_eq!(m.count(), model.bits.iter().filter(|&&b| b).count() as u64);
}

#[test]
fn random_operations_match_the_model() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for size in [1, 511, 512, 513, 64 * G - 1, 64 * G, 64 * G + 7, 200 * G + 100] {
        let m = DirtyBitmap::new(size, G).unwrap();
        let mut model = Model { bits: vec![false; size.div_ceil(G) as usize], size };
        for _ in 0..300 {
            let off = rng.below(size + G);
            let span = if rng.below(4) == 0 { size } else { 3 * G };
            let len = rng.below(span);
            match rng.below(5) {
                0 | 1 => {
                    m.set(off, len);
                    model.set(off, len);
                }
                2 => {
                    m.clear(off, len);
                    model.clear(off, len);
                }
                3 => {
                    assert_eq!(m.extents(off, len, usize::MAX), model.extents(off, len), "extents {off}+{len}");
                }
                _ => {
                    if let Some((s, l)) = m.take_next(off, len.max(1)) {
                        let first = (s / G) as usize;
                        assert!(model.bits[first], "take_next at {s} gave a clean granule");
                        assert!(s >= off / G * G);
                        assert!(!model.bits[(off / G) as usize..first].iter().any(|&b| b));
                        assert_eq!(s % G, 0);
                        model.clear(s, l);
                    } else {
                        assert!(!model.bits.iter().skip((off / G) as usize).any(|&b| b));
                    }
                }
            }
            check(&m, &model);
        }
    }
}

#[test]
fn every_small_range_sets_and_reports_exactly() {
    let size = 10 * G + 3;
    for off in (0..size).step_by(97) {
        for len in (0..size).step_by(131) {
            let m = DirtyBitmap::new(size, G).unwrap();
            let mut model = Model { bits: vec![false; 11], size };
            m.set(off, len);
            model.set(off, len);
            check(&m, &model);
            assert_eq!(m.extents(0, size, usize::MAX), model.extents(0, size));
            let dirty: u64 = model.extents(0, size).iter().filter(|e| e.1).map(|e| e.0).sum();
            assert_eq!(m.dirty_bytes(), dirty);
        }
    }
}

#[test]
fn extents_stop_at_max_and_resume() {
    let m = DirtyBitmap::new(100 * G, G).unwrap();
    for k in (0..100).step_by(2) {
        m.set(k * G, 1);
    }
    let first = m.extents(0, 100 * G, 3);
    assert_eq!(first, [(G, true), (G, false), (G, true)]);
    assert_eq!(m.extents(3 * G, 100 * G, 1), [(G, false)]);
}

#[test]
fn disabled_bitmaps_ignore_writes_but_keep_bits() {
    let m = DirtyBitmap::new(1 << 20, 64 << 10).unwrap();
    m.record_write(0, 4096);
    m.set_enabled(false);
    m.record_write(1 << 19, 4096);
    assert_eq!(m.extents(0, 1 << 20, 10), [(64 << 10, true), ((1 << 20) - (64 << 10), false)]);
    m.set_enabled(true);
    m.record_write(1 << 19, 1);
    assert_eq!(m.count(), 2);
}

#[test]
fn merge_across_granularities() {
    let a = DirtyBitmap::new(1 << 20, 4096).unwrap();
    let b = DirtyBitmap::new(1 << 20, 64 << 10).unwrap();
    a.set(70000, 10);
    b.merge(&a).unwrap();
    assert_eq!(b.extents(0, 1 << 20, 10)[..2], [(64 << 10, false), (64 << 10, true)]);
    let c = DirtyBitmap::new(1 << 20, 4096).unwrap();
    c.merge(&a).unwrap();
    assert_eq!(c.count(), 1);
    assert!(DirtyBitmap::new(1 << 21, 4096).unwrap().merge(&a).is_err());
}

#[test]
fn granularity_is_checked() {
    assert!(DirtyBitmap::new(1 << 20, 256).is_err());
    assert!(DirtyBitmap::new(1 << 20, 3 << 10).is_err());
    assert!(DirtyBitmap::new(1 << 20, DEFAULT_GRANULARITY).is_ok());
}

#[test]
fn bits_round_trip_in_qemu_order() {
    let m = DirtyBitmap::new(130 * G, G).unwrap();
    m.set(0, 1);
    m.set(9 * G, 1);
    m.set(129 * G, 1);
    let mut bytes = [0u8; 24];
    m.export_bits(0, &mut bytes);
    assert_eq!(bytes[0], 1);
    assert_eq!(bytes[1], 2);
    assert_eq!(bytes[16], 2);
    let n = DirtyBitmap::new(130 * G, G).unwrap();
    n.import_bits(0, &[0xff; 24]);
    assert_eq!(n.count(), 130);
}

#[test]
fn a_drain_loses_no_concurrent_write() {
    // A copy job drains while writers mark: every granule a writer marked
    // is either returned by some take_next or still dirty at the end.
    let m = Arc::new(DirtyBitmap::new(4096 * G, G).unwrap());
    let writer = {
        let m = m.clone();
        std::thread::spawn(move || {
            let mut rng = Rng(7);
            let mut marked = vec![false; 4096];
            for _ in 0..20000 {
                let b = rng.below(4096);
                m.record_write(b * G, 1);
                marked[b as usize] = true;
            }
            marked
        })
    };
    let mut taken = vec![false; 4096];
    for _ in 0..50 {
        let mut at = 0;
        while let Some((s, l)) = m.take_next(at, 16 * G) {
            (s / G..(s + l) / G).for_each(|b| taken[b as usize] = true);
            at = s + l;
        }
    }
    let marked = writer.join().unwrap();
    for b in 0..4096 {
        if marked[b] {
            assert!(taken[b] || m.get_bit(b as u64), "granule {b} was lost");
        }
    }
}

#[test]
fn take_within_takes_only_the_granules_a_range_meets() {
    // Granules 2, 3, 5 and the last, partial one (the disk ends mid-granule).
    let m = DirtyBitmap::new(10 * G + G / 2, G).unwrap();
    m.set(2 * G, 2 * G);
    m.set(5 * G, G);
    m.set(10 * G, G / 2);
    assert_eq!(m.take_within(0, 2 * G, G), None, "nothing dirty before granule 2");
    // A byte range inside granule 3 takes the whole granule, no more.
    assert_eq!(m.take_within(3 * G + 10, 20, 16 * G), Some((3 * G, G)));
    assert!(m.get_bit(2) && !m.get_bit(3));
    // From granule 1 to mid granule 5: granule 2, then 5.
    assert_eq!(m.take_within(G, 4 * G + 1, 16 * G), Some((2 * G, G)));
    assert_eq!(m.take_within(G, 4 * G + 1, 16 * G), Some((5 * G, G)));
    assert_eq!(m.take_within(G, 4 * G + 1, 16 * G), None);
    // The partial last granule, clipped at the disk's end.
    assert_eq!(m.take_within(10 * G + 1, 1, 16 * G), Some((10 * G, G / 2)));
    assert_eq!(m.count(), 0);
}
