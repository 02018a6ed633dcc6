//! The allocation of a backing image over a window, asked for once and handed
//! out piece by piece while an overlay maps a range.
//!
//! An overlay whose own clusters alternate with its backing's would otherwise
//! ask the backing once per cluster, and each such question to a raw file is a
//! SEEK_DATA and a SEEK_HOLE; the kernel answers SEEK_HOLE by walking on to the
//! next hole, which on a fully written tmpfs file is its end. Mapping a large
//! overlay (a commit or mirror marking what to copy, NBD block status) then
//! grew with the square of the disk's size. The backing's answer does not
//! depend on the overlay, so one question covers every cluster up to the end
//! of the range asked.

use crate::{Allocation, Result};

/// How many runs one question to the backing image may return.
const RUNS: usize = 256;

/// What the backing image answered last, from `start`.
#[derive(Default)]
pub(crate) struct BackingWindow {
    start: u64,
    end: u64,
    runs: Vec<Allocation>,
    /// Where the last piece was taken: the index of its run and that run's offset.
    cursor: (usize, u64),
}

impl BackingWindow {
    /// Appends to `out` the backing image's runs that cover `len` bytes at
    /// `pos` (in order, as the backing sees them), asking `ask(from, len,
    /// max, runs)` for `[pos, limit)` whenever the window does not hold
    /// `pos`. Returns the bytes covered: less than `len` only if the backing
    /// answered nothing at some offset.
    pub(crate) fn take(
        &mut self,
        mut pos: u64,
        len: u64,
        limit: u64,
        mut ask: impl FnMut(u64, u64, usize, &mut Vec<Allocation>) -> Result<()>,
        out: &mut Vec<Allocation>,
    ) -> Result<u64> {
        let from = pos;
        let end = pos + len;
        while pos < end {
            if pos < self.start || pos >= self.end {
                self.runs.clear();
                ask(pos, limit.max(end) - pos, RUNS, &mut self.runs)?;
                self.start = pos;
                self.end = pos + self.runs.iter().map(|r| r.len).sum::<u64>();
                self.cursor = (0, pos);
                if self.end == pos {
                    break;
                }
            }
            if pos < self.cursor.1 {
                self.cursor = (0, self.start);
            }
            let (mut i, mut at) = self.cursor;
            while i < self.runs.len() && pos < end {
                let r = self.runs[i];
                let (s, e) = (pos.max(at), end.min(at + r.len));
                if s < e {
                    out.push(Allocation { len: e - s, ..r });
                    pos = e;
                }
                if at + r.len > pos {
                    break;
                }
                at += r.len;
                i += 1;
            }
            self.cursor = (i, at);
        }
        Ok(pos - from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(len: u64, hole: bool) -> Allocation {
        Allocation { len, hole, zero: hole, depth: 1 }
    }

    #[test]
    fn one_question_serves_every_piece_in_order() {
        let backing = [run(100, false), run(50, true), run(850, false)];
        let mut asked = Vec::new();
        let mut w = BackingWindow::default();
        let mut ask = |at: u64, len: u64, _max: usize, out: &mut Vec<Allocation>| -> Result<()> {
            asked.push((at, len));
            let mut o = 0;
            for r in backing {
                let (s, e) = (at.max(o), (at + len).min(o + r.len));
                if s < e {
                    out.push(Allocation { len: e - s, ..r });
                }
                o += r.len;
            }
            Ok(())
        };
        let mut got = Vec::new();
        for (pos, len) in [(0, 64), (64, 64), (192, 64), (900, 100)] {
            let mut out = Vec::new();
            assert_eq!(w.take(pos, len, 1000, &mut ask, &mut out).unwrap(), len);
            got.push(out.iter().map(|a| (a.len, a.hole)).collect::<Vec<_>>());
        }
        assert_eq!(got, [vec![(64, false)], vec![(36, false), (28, true)], vec![(64, false)], vec![(100, false)]]);
        // Going back refills from the window's own runs; only a position outside it asks again.
        let mut out = Vec::new();
        w.take(10, 10, 1000, &mut ask, &mut out).unwrap();
        assert_eq!(asked, [(0, 1000)]);
    }

    #[test]
    fn a_backing_that_answers_nothing_stops_the_take() {
        let mut w = BackingWindow::default();
        let mut out = Vec::new();
        assert_eq!(w.take(0, 64, 64, |_, _, _, _| Ok(()), &mut out).unwrap(), 0);
        assert!(out.is_empty());
    }
}
