//! The write path of a qcow2 image: claiming clusters for writes, the
//! copy-on-write of what a partial write leaves untouched, zero clusters,
//! and the order in which metadata reaches the disk.
//!
//! A write into a cluster the image owns alone (L2 entry with COPIED, every
//! unit it touches holding data) maps straight to it: one atomic load under
//! its L2 table's shared lock, nothing else. Any other cluster is *claimed*
//! first (`prepare_write`, under the
//! cluster's stripe lock): a host cluster is allocated (or the zero
//! cluster's own reused); each unit (subcluster, or the cluster) the write
//! touches is filled whole, its own range too, with what the guest sees
//! there now (the backing image, zeros, an old cluster; a fresh cluster's
//! zeros are skipped), and the claim is noted in `pending`. The fill is done
//! before the first write to the unit is mapped, so it never lands on top of
//! any write's data. Writes map to the claimed cluster; once one's data is in
//! the file (`write_done`) the L2 entry in memory points at the claim's
//! units. So whichever write publishes a claim first, and whichever fails,
//! no range of it reads bytes nobody wrote, before or after a crash.
//!
//! A write that covers a whole cluster with no shared claim in flight and
//! no host cluster of its own to reuse gets a new host cluster of its own
//! instead (`claim_whole`): nothing is filled, and its `write_done` points
//! the entry at it, replacing whatever is there. Any other write to that
//! cluster in flight overlaps it, so may be ordered before it; a shared
//! claim made before that publish is stale when its turn comes (the entry
//! is no longer the one it was made on) and is dropped, its write ordered
//! before the whole one. A private claim is published by the `write_done`
//! of the same range (the engine's pieces of a TRIM or WRITE_ZEROES that
//! `zero` leaves it are never whole clusters, or are the whole request).
//!
//! Durability ordering (`sync_round`, one round at a time, group commit):
//!
//! 1. take the changed L1 entries, then the changed L2 tables, then the
//!    changed refcount blocks, as bytes: every L2 entry taken was set after
//!    its data reached the file, and every cluster an L2 or L1 entry taken
//!    points at was counted before that entry was set;
//! 2. fdatasync: the data (and the copied-in parts) is durable;
//! 3. write the refcount blocks; if the refcount table changed in place
//!    (it names new blocks), fdatasync, then write it; a moved table is
//!    written beside the blocks, then fdatasync and the header naming it;
//!    fdatasync: refcount blocks durable before the table entry naming them,
//!    refcounts durable before any table that uses the clusters they count;
//! 4. write the L2 tables; if the L1 table changed, fdatasync (new L2 tables
//!    durable) and write it; fdatasync.
//!
//! A crash at any point leaves refcounts at least as high as what the tables
//! on disk use (leaks at worst, never a cluster in use with refcount 0), and
//! L2 entries pointing only at data that was durable before they were written.
//! A refcount drops (a rewritten compressed or shared cluster, a replaced
//! refcount table) only after the round that made the tables or header stop
//! naming it, and a cluster at refcount 0 is never reused (allocation only
//! appends), so none is reused while an old entry may still point at it.
//! What this module must never do: set an L2 entry before its data is
//! written, write an L2/L1 table before the refcounts it relies on, or drop a
//! refcount before what named the cluster is durably gone.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering;

use super::l2::{self, Entry, TableBytes, Unit, COPIED, ZERO};
use super::refcount::BlockBytes;
use super::{header, Qcow2Image, STRIPES};
use crate::{Error, ErrorKind, Extent, Image, Result};

/// A cluster claimed for writes in flight, not yet in its L2 table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claim {
    /// The host cluster the writes go to.
    host: u64,
    /// Newly allocated: it read as zeros before the claim filled it.
    fresh: bool,
    /// The units (bit per subcluster; bit 0 for a whole cluster) filled so far.
    units: u64,
    /// The L2 entry when the claim was made: if it changed before the claim
    /// is published, a write covering the whole cluster published its own
    /// cluster meanwhile, and this claim is stale (see `publish_range`).
    base: Entry,
}

/// The claims of one stripe.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// Guest cluster → its claim, shared by every write to it (filled).
    shared: HashMap<u64, Claim>,
    /// (guest cluster, write offset, write length) → a new host cluster of
    /// its own for a write covering the whole cluster: nothing filled (all
    /// of it is the write's), published by the first such write to finish.
    whole: HashMap<(u64, u64, u64), u64>,
}

thread_local! {
    /// The private claims the last `prepare_write` of this thread made or
    /// joined, (guest cluster, host), for the `map_write` that follows it.
    static PREPARED: std::cell::RefCell<Vec<(u64, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Qcow2Image {
    fn stripe(&self, c: u64) -> std::sync::MutexGuard<'_, Pending> {
        self.pending[(c % STRIPES as u64) as usize].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn io_err(&self, e: std::io::Error, what: &str, at: u64) -> Error {
        Error::io(e, format!("{what} at {at:#x} of {}", self.base.path.display()))
    }

    /// The units (subclusters with extended L2, else the cluster) of guest
    /// cluster `c` that [offset, offset+len) touches, as a bit mask.
    fn touched(&self, c: u64, offset: u64, len: u64) -> u64 {
        let cs = self.cs();
        let unit = cs / self.l2.units();
        let from = offset.max(c * cs) - c * cs;
        let to = (offset + len).min((c + 1) * cs) - c * cs;
        let (u0, u1) = (from / unit, to.div_ceil(unit));
        (u0..u1).fold(0, |m, u| m | 1 << u)
    }

    /// Claims every cluster of a write that cannot be written in place.
    pub(super) fn claim_range(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        PREPARED.with(|p| p.borrow_mut().clear());
        let cs = self.cs();
        for c in offset / cs..(offset + len).div_ceil(cs) {
            let units = self.touched(c, offset, len);
            if self.l2.in_place(self.entry(c)?, units).is_none() {
                let whole = offset <= c * cs && offset + len >= (c + 1) * cs && (c + 1) * cs <= self.header.size;
                if !(whole && self.claim_whole(c, offset, len)?) {
                    self.claim(c, units)?;
                }
            }
        }
        Ok(())
    }

    /// Claims a new host cluster of its own for a write of [offset,
    /// offset+len) that covers all of guest cluster `c`, or joins the one an
    /// identical write in flight claimed: nothing to fill, the write's data
    /// is all of it. False (claim the shared way) when the cluster has a
    /// shared claim in flight or a host cluster of its own to reuse.
    ///
    /// Why this is safe beside the shared claims: whichever write covering
    /// the whole cluster publishes its cluster, every other write to `c` in
    /// flight at that moment overlaps it and may be ordered before it (NBD
    /// gives overlapping writes in flight no order); a shared claim made
    /// before that publish and published after it is stale and dropped
    /// (`publish_range`), so no later publish brings back older data.
    fn claim_whole(&self, c: u64, offset: u64, len: u64) -> Result<bool> {
        let mut stripe = self.stripe(c);
        let e = self.entry(c)?;
        if self.l2.in_place(e, self.touched(c, offset, len)).is_some() {
            return Ok(true); // published meanwhile: in place after all
        }
        if stripe.shared.contains_key(&c) || self.l2.reusable(e).is_some() {
            return Ok(false);
        }
        let host = match stripe.whole.get(&(c, offset, len)) {
            Some(&host) => host,
            None => {
                let host = self.allocate_for(c)?;
                stripe.whole.insert((c, offset, len), host);
                host
            }
        };
        PREPARED.with(|p| p.borrow_mut().push((c, host)));
        Ok(true)
    }

    /// The host cluster a write of [offset, offset+len) within guest cluster
    /// `c` goes to (in place or claimed).
    pub(super) fn claimed_host(&self, c: u64, offset: u64, len: u64) -> Result<u64> {
        // A cluster of its own first: never in place, even if another write
        // published the cluster meanwhile (this one's publish replaces it).
        if let Some(h) = PREPARED.with(|p| p.borrow().iter().find(|w| w.0 == c).map(|w| w.1)) {
            return Ok(h);
        }
        let units = self.touched(c, offset, len);
        // In place, the usual case, is found without the lock.
        if let Some(h) = self.l2.in_place(self.entry(c)?, units) {
            return Ok(h);
        }
        // Else again under the stripe lock, which every publish holds: the entry and the
        // claims are seen together (unlocked, a claim published between the
        // two looks was in neither).
        let stripe = self.stripe(c);
        if let Some(h) = self.l2.in_place(self.entry(c)?, units) {
            return Ok(h);
        }
        if let Some(cl) = stripe.shared.get(&c) {
            return Ok(cl.host);
        }
        Err(Error::new(ErrorKind::Io, format!("{}: a write to cluster {c} was not prepared", self.base.path.display())))
    }

    /// Claims the units `units` of guest cluster `c` for a write touching
    /// them: a host cluster (this image's own, or a new one), and each unit
    /// not yet valid there filled whole with what the guest reads there now.
    fn claim(&self, c: u64, units: u64) -> Result<()> {
        let mut stripe = self.stripe(c);
        let e = self.entry(c)?;
        if self.l2.in_place(e, units).is_some() {
            return Ok(());
        }
        let mut cl = match stripe.shared.get(&c) {
            Some(cl) => *cl,
            None => match self.l2.reusable(e) {
                Some(host) => Claim { host, fresh: false, units: 0, base: e },
                // Data elsewhere (compressed, shared) moves whole into the new cluster.
                None if e.host() != 0 || e.compressed() => {
                    let host = self.allocate_for(c)?;
                    self.copy_in(c, host, true, (c * self.cs(), self.cs()), (0, 0))?;
                    Claim { host, fresh: true, units: (1u64 << self.l2.units()) - 1, base: e }
                }
                None => Claim { host: self.allocate_for(c)?, fresh: true, units: 0, base: e },
            },
        };
        let unit = self.cs() / self.l2.units();
        for u in 0..self.l2.units() {
            let bit = 1u64 << u;
            let done = cl.units & bit != 0;
            if units & bit == 0 || done || (!cl.fresh && self.l2.unit_valid(e, u)) {
                continue;
            }
            // The whole unit, the write's own range too, even when the write
            // covers all of it: whatever other writes publish this claim
            // first, the range reads old data until this write's lands, never
            // bytes nobody wrote. The fill is done here, before this write (the
            // first to touch the unit) is mapped, so it can never land on top of
            // any write's data; later writes find the unit filled. (A fresh
            // cluster's zeros cost nothing: they are skipped.)
            let start = c * self.cs() + u * unit;
            self.copy_in(c, cl.host, cl.fresh, (start, unit), (0, 0))?;
            cl.units |= bit;
        }
        stripe.shared.insert(c, cl);
        Ok(())
    }

    /// A new host cluster for guest cluster `c`, with an L2 table for it.
    fn allocate_for(&self, c: u64) -> Result<u64> {
        let i = (c / self.header.l2_entries()) as usize;
        let file = &self.base.files[0];
        let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
        let l1 = self.l2.l1_entry(i);
        if self.l2.has_table(i) && l1 & COPIED == 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: L2 table {i} is shared with a snapshot; vdisk does not write such images",
                    self.base.path.display()
                ),
            ));
        }
        if !self.l2.has_table(i) {
            let t = refs.allocate(file, &self.base.path, 1)?;
            self.l2.install(i, t);
        }
        let host = refs.allocate(file, &self.base.path, 1)?;
        self.cover(refs.next_free())?;
        Ok(host)
    }

    /// Extends the file past `end` (the allocator's next free cluster), so
    /// every cluster counted is inside it and tables and reads never meet its
    /// end. It grows 1 MiB (or a cluster) at a time: one `ftruncate` per MiB
    /// of new clusters, not per cluster; the tail past the last cluster in use
    /// has refcount 0 and is skipped when the image is opened again.
    pub(super) fn cover(&self, end: u64) -> Result<()> {
        if end <= self.file_len.load(Ordering::Acquire) {
            return Ok(());
        }
        let cs = self.cs();
        let len = end + (1u64 << 20).max(cs).div_ceil(cs) * cs - cs;
        self.base.files[0].set_len(len).map_err(|e| self.io_err(e, "cannot extend the image", len))?;
        self.file_len.store(len, Ordering::Release);
        self.l2.grown(len);
        Ok(())
    }

    /// Fills `(start, size)` of guest cluster `c` (a unit, or the whole
    /// cluster), except the part the write `(wo, wl)` covers, into host
    /// cluster `host` with what the guest reads there now. A `fresh` cluster
    /// already reads as zeros.
    fn copy_in(&self, c: u64, host: u64, fresh: bool, (start, size): (u64, u64), (wo, wl): (u64, u64)) -> Result<()> {
        let end = (start + size).min(self.header.size);
        let base = c * self.cs();
        let mut gaps = Vec::with_capacity(2);
        if wl == 0 {
            gaps.push((start, end));
        } else {
            gaps.push((start, wo.min(end)));
            gaps.push(((wo + wl).max(start), end));
        }
        for (from, to) in gaps.into_iter().filter(|g| g.0 < g.1) {
            let mut extents = Vec::new();
            self.map_read(from, to - from, &mut extents)?;
            self.copy_extents(&extents, host + (from - base), fresh)?;
        }
        Ok(())
    }

    /// Copies what `extents` map into file 0 from host offset `dest` on
    /// (zeros skipped where `fresh`, data already in place skipped).
    fn copy_extents(&self, extents: &[Extent], mut dest: u64, fresh: bool) -> Result<()> {
        for &ext in extents {
            let n = ext.len();
            #[cfg(test)]
            {
                let in_place = matches!(ext, Extent::Data { file: 0, offset, .. } if offset == dest);
                if !(in_place || fresh && matches!(ext, Extent::Zero { .. })) {
                    trace::note(trace::Step::Fill(dest, n));
                }
            }
            match ext {
                Extent::Data { file: 0, offset, .. } if offset == dest => {}
                Extent::Zero { .. } if fresh => {}
                Extent::Zero { .. } => self.write_at(&vec![0u8; n as usize], dest)?,
                Extent::Data { file, offset, .. } => {
                    // In the kernel where it can (no copy through user memory; a
                    // reflink on file systems that share extents), else read+write.
                    if copy_range(&self.base.files[file], offset, &self.base.files[0], dest, n).is_ok() {
                        dest += n;
                        continue;
                    }
                    let mut buf = vec![0u8; n as usize];
                    self.base.files[file].read_exact_at(&mut buf, offset).map_err(|e| {
                        Error::io(e, format!("copy-on-write read at {offset:#x} of {}", self.file_path(file).display()))
                    })?;
                    self.write_at(&buf, dest)?;
                }
            }
            dest += n;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], at: u64) -> Result<()> {
        self.base.files[0].write_all_at(buf, at).map_err(|e| self.io_err(e, "copy-on-write write", at))
    }

    /// Points the L2 entries of the clusters claimed for a finished write at
    /// their new data.
    pub(super) fn publish_range(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let cs = self.cs();
        for c in offset / cs..(offset + len).div_ceil(cs) {
            let mut stripe = self.stripe(c);
            if let Some(host) = stripe.whole.remove(&(c, offset, len)) {
                // All of the cluster is this write's data (or an identical
                // write's): it replaces whatever the entry names now.
                let old = self.entry(c)?;
                let bitmap = if self.header.extended_l2() { (1u64 << self.l2.units()) - 1 } else { 0 };
                self.l2.set(&self.base.files[0], &self.base.path, c, Entry { desc: host | COPIED, bitmap })?;
                self.release(old, host);
                continue;
            }
            if self.l2.in_place(self.entry(c)?, self.touched(c, offset, len)).is_some() {
                continue;
            }
            // Every unit of the claim was filled before any write to it was
            // mapped, so all of them are valid now, whichever write is done first.
            if let Some(cl) = stripe.shared.remove(&c) {
                let old = self.entry(c)?;
                if old != cl.base {
                    // A write covering the whole cluster, in flight with this
                    // one, published its own cluster after this claim was made:
                    // this write is ordered before it, and its data (and the
                    // old data the claim was filled with) is gone.
                    if cl.fresh {
                        self.released.lock().unwrap_or_else(|e| e.into_inner()).push(cl.host);
                    }
                    continue;
                }
                let bitmap = if self.header.extended_l2() {
                    // Allocation bits of another host cluster mean nothing here; zero bits stay.
                    let kept = if old.host() == cl.host { old.bitmap } else { old.bitmap & (u64::MAX << 32) };
                    (kept | cl.units) & !(cl.units << 32)
                } else {
                    0
                };
                self.l2.set(&self.base.files[0], &self.base.path, c, Entry { desc: cl.host | COPIED, bitmap })?;
                self.release(old, cl.host);
            }
        }
        if crate::breakage::active(crate::breakage::Breakage::Qcow2L2First) {
            // Broken on purpose (a test build): the entry goes out now, with no
            // sync at all, so it waits beside its data for the next one.
            self.round(false)?;
        }
        Ok(())
    }

    /// Records a TRIM or WRITE_ZEROES of whole clusters as zero clusters
    /// (version 3): the clusters this image owns keep their host cluster,
    /// punched unless `give_back` is false. Returns the ranges it could not
    /// handle (partial clusters, or everything on version 2, which has no
    /// zero flag) for the engine to zero the ordinary way.
    pub(super) fn zero_clusters(&self, offset: u64, len: u64, give_back: bool) -> Result<Vec<(u64, u64)>> {
        let cs = self.cs();
        let end = offset + len;
        let (first, last) = (offset.div_ceil(cs), end / cs);
        let whole_end = if end == self.header.size { end.div_ceil(cs) } else { last };
        if !self.header.has_zero_flag() || first >= whole_end {
            return Ok(vec![(offset, len)]);
        }
        let mut rest = Vec::new();
        if offset < first * cs {
            rest.push((offset, first * cs - offset));
        }
        if whole_end * cs < end {
            rest.push((whole_end * cs, end - whole_end * cs));
        }
        for c in first..whole_end {
            self.zero_cluster(c, give_back)?;
        }
        Ok(rest)
    }

    fn zero_cluster(&self, c: u64, give_back: bool) -> Result<()> {
        let mut stripe = self.stripe(c);
        let e = self.entry(c)?;
        let keep = self.l2.reusable(e).or_else(|| stripe.shared.get(&c).map(|cl| cl.host));
        if keep.is_none() && self.backing.is_none() && self.l2.unit(e, 0) == Unit::Backing && !self.header.extended_l2()
        {
            return Ok(()); // already reads as zeros
        }
        if !self.l2.has_table((c / self.header.l2_entries()) as usize) {
            self.allocate_table(c)?;
        }
        let host = keep.unwrap_or(0);
        if host != 0 && give_back {
            punch(&self.base.files[0], host, self.cs())
                .map_err(|e| self.io_err(e, "cannot punch the zeroed cluster", host))?;
        }
        stripe.shared.remove(&c);
        let next = if self.header.extended_l2() {
            Entry { desc: if host != 0 { host | COPIED } else { 0 }, bitmap: 0xffff_ffff << 32 }
        } else {
            Entry { desc: if host != 0 { host | COPIED | ZERO } else { ZERO }, bitmap: 0 }
        };
        self.l2.set(&self.base.files[0], &self.base.path, c, next)?;
        self.release(e, host);
        Ok(())
    }

    /// Notes the host clusters `old` named that its replacement (keeping
    /// `kept`) no longer does. Called after the new entry is set, so the round
    /// that takes the note has the new entry in its tables.
    fn release(&self, old: l2::Entry, kept: u64) {
        let gone: Vec<u64> = self.l2.held(old).into_iter().filter(|&h| h != kept).collect();
        if !gone.is_empty() {
            self.released.lock().unwrap_or_else(|e| e.into_inner()).extend(gone);
        }
    }

    fn allocate_table(&self, c: u64) -> Result<()> {
        let i = (c / self.header.l2_entries()) as usize;
        let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
        if !self.l2.has_table(i) {
            let t = refs.allocate(&self.base.files[0], &self.base.path, 1)?;
            self.cover(refs.next_free())?;
            self.l2.install(i, t);
        }
        Ok(())
    }

    /// One metadata round (see the module docs for the order). A caller whose
    /// changes were made before a round started waits for it instead. True
    /// when it dropped refcounts, which the next round writes.
    pub(super) fn sync_round(&self) -> Result<bool> {
        self.round(true)
    }

    /// A metadata round; without `last_sync` (only a test build that breaks
    /// durability on purpose asks for that) it ends without its last fdatasync.
    fn round(&self, last_sync: bool) -> Result<bool> {
        if self.base.read_only {
            return Ok(false);
        }
        let need = self.rounds_started.load(Ordering::SeqCst) + 1;
        let mut done = self.rounds_done.lock().unwrap_or_else(|e| e.into_inner());
        if *done >= need {
            return Ok(false);
        }
        let round = self.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
        let (l1, tables) = self.l2.take_dirty();
        let released = std::mem::take(&mut *self.released.lock().unwrap_or_else(|e| e.into_inner()));
        let (blocks, table, moved) = {
            let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
            let (b, t) = refs.take_dirty();
            // This round may name the moved table in the header: it must not
            // be freed as an intermediate one while the round runs.
            refs.header_pending = refs.moved;
            (b, t.map(|t| (refs.table_at, t)), refs.moved)
        };
        let r = self.write_round(&l1, &tables, &blocks, &table, moved, last_sync);
        if let Err(e) = r {
            self.l2.redirty(l1.is_some(), tables.iter().map(|t| t.0));
            self.l2.written(tables.iter().map(|t| t.0));
            let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
            refs.redirty(blocks.iter().map(|b| b.0), table.is_some());
            self.released.lock().unwrap_or_else(|e| e.into_inner()).extend(released);
            return Err(e);
        }
        self.l2.written(tables.iter().map(|t| t.0));
        let mut dropped = !released.is_empty();
        // The tables on disk no longer name these: their refcounts may drop
        // (written by the next round, before any table that round writes).
        if !released.is_empty() {
            let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
            for at in released {
                refs.release(&self.base.files[0], &self.base.path, at)?;
            }
        }
        if let Some(now) = moved {
            // The header names the new refcount table: the old one is free
            // (its refcounts drop in memory now, on disk next round).
            let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
            if refs.moved == moved {
                refs.moved = None;
            }
            refs.header_pending = None;
            let (old, n) = std::mem::replace(&mut refs.on_disk, now);
            for k in 0..n as u64 {
                refs.release(&self.base.files[0], &self.base.path, old + k * self.cs())?;
            }
            dropped = true;
        }
        if last_sync {
            // (A round without its last sync covers no caller waiting for one.)
            *done = round;
        }
        Ok(dropped)
    }

    fn write_round(
        &self,
        l1: &Option<Vec<u8>>,
        tables: &[TableBytes],
        blocks: &[BlockBytes],
        table: &Option<(u64, Vec<u8>)>,
        moved: Option<(u64, u32)>,
        last_sync: bool,
    ) -> Result<()> {
        if l1.is_none() && tables.is_empty() && blocks.is_empty() && table.is_none() {
            return Ok(());
        }
        let file = &self.base.files[0];
        let sync = |what: &str| {
            #[cfg(test)]
            trace::note(trace::Step::Sync);
            file.sync_data().map_err(|e| self.io_err(e, what, 0))
        };
        // Broken on purpose (a test build): only the last sync is left.
        let broken = crate::breakage::active(crate::breakage::Breakage::Qcow2L2First);
        let ordered = |what: &str| if broken { Ok(()) } else { sync(what) };
        let write = |b: &[u8], at: u64, what: &str| {
            #[cfg(test)]
            trace::note(trace::Step::Write(at, b.len() as u64));
            file.write_all_at(b, at).map_err(|e| self.io_err(e, what, at))
        };
        ordered("data sync")?;
        for (_, at, bytes) in blocks {
            write(bytes, *at, "refcount block write")?;
        }
        if let Some((at, bytes)) = table {
            if moved.is_none() && !blocks.is_empty() {
                // The table in place names new refcount blocks: they must be
                // durable first, or a crash can leave an entry naming a block
                // that reads as zeros (its own refcount, and every one it
                // holds, 0 while in use). A moved table is named by nothing
                // until the header, which waits for the sync below.
                ordered("refcount block sync")?;
            }
            write(bytes, *at, "refcount table write")?;
            if let Some((at, clusters)) = moved {
                sync("refcount table sync")?;
                let mut h = [0u8; 12];
                h[..8].copy_from_slice(&at.to_be_bytes());
                h[8..].copy_from_slice(&clusters.to_be_bytes());
                write(&h, header::REFTABLE_AT, "header write")?;
            }
        }
        if !blocks.is_empty() || table.is_some() {
            ordered("refcount sync")?;
        }
        for (_, at, bytes) in tables {
            write(bytes, *at, "L2 table write")?;
        }
        if let Some(bytes) = l1 {
            ordered("L2 table sync")?;
            write(bytes, self.header.l1_table_offset, "L1 table write")?;
        }
        if !last_sync {
            return Ok(());
        }
        sync("metadata sync")
    }
}

/// Gives a zeroed cluster's space back to the file system. A file system that
/// cannot punch keeps the old bytes: the zero flag hides them, and a later
/// write fills the rest of the cluster with zeros itself (see `copy_in`).
fn punch(file: &std::fs::File, at: u64, len: u64) -> std::io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate only reads its integer arguments; the fd is open for the call.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, at as libc::off_t, len as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(()),
        _ => Err(e),
    }
}

/// `copy_file_range` of `len` bytes, all of them or an error (the caller then
/// copies through memory: other file systems, a source that ends early).
fn copy_range(from: &std::fs::File, at: u64, to: &std::fs::File, dest: u64, len: u64) -> std::io::Result<()> {
    let (mut off_in, mut off_out) = (at as libc::loff_t, dest as libc::loff_t);
    let mut left = len as usize;
    while left > 0 {
        // SAFETY: both fds are open for the call; the offsets are ours, the kernel only updates them.
        let n = unsafe { libc::copy_file_range(from.as_raw_fd(), &mut off_in, to.as_raw_fd(), &mut off_out, left, 0) };
        match n {
            n if n > 0 => left -= n as usize,
            0 => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// What the metadata rounds of this thread wrote and synced, in order, when
/// a test asks (`start`/`take`): the ordering rules checked step by step.
#[cfg(test)]
pub(super) mod trace {
    use std::cell::RefCell;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Step {
        /// `len` bytes written at `at`.
        Write(u64, u64),
        Sync,
        /// A claim filled `len` bytes at `at` with what the guest read there.
        Fill(u64, u64),
    }

    thread_local! {
        static STEPS: RefCell<Option<Vec<Step>>> = const { RefCell::new(None) };
    }

    pub fn note(s: Step) {
        STEPS.with(|t| {
            if let Some(v) = t.borrow_mut().as_mut() {
                v.push(s);
            }
        });
    }

    pub fn start() {
        STEPS.with(|t| *t.borrow_mut() = Some(Vec::new()));
    }

    pub fn take() -> Vec<Step> {
        STEPS.with(|t| t.borrow_mut().take().unwrap_or_default())
    }
}
