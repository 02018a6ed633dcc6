//! Repairing the refcounts of a qcow2 image that was not closed cleanly
//! while it used lazy refcounts (the dirty bit): what `qemu-img check -r
//! all` does for refcounts that are too low, done on a read-write open.
//!
//! What it owns: counting every reference the image's own tables make
//! (header, L1 table, refcount table and blocks, L2 tables, data and
//! compressed clusters) and raising each refcount that is lower than that
//! count; then, once those refcounts are durable, clearing the dirty bit.
//! What it must never do: lower a refcount (a count too high is a leak,
//! harmless; too low is corruption), or clear the dirty bit before the
//! repaired refcounts are on disk.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;

use super::header::{INCOMPATIBLE_AT, INCOMPAT_DIRTY};
use super::Qcow2Image;
use crate::{Error, Result};

impl Qcow2Image {
    /// Counts the references to each host cluster the image's tables make.
    fn references(&self) -> Result<HashMap<u64, u64>> {
        let h = &self.header;
        let cs = h.cluster_size();
        let mut refs: HashMap<u64, u64> = HashMap::new();
        let mut add = |at: u64| *refs.entry(at / cs * cs).or_insert(0) += 1;
        add(0);
        (0..(h.l1_size as u64 * 8).div_ceil(cs)).for_each(|k| add(h.l1_table_offset + k * cs));
        (0..h.refcount_table_clusters as u64).for_each(|k| add(h.refcount_table_offset + k * cs));
        self.refs.lock().unwrap_or_else(|e| e.into_inner()).table_entries().for_each(&mut add);
        for i in (0..self.l2.l1_len()).filter(|&i| self.l2.has_table(i)) {
            add(self.l2.l1_entry(i) & super::l2::OFFSET_MASK);
            let first = i as u64 * h.l2_entries();
            for c in first..first + h.l2_entries() {
                self.l2.held(self.entry(c)?).into_iter().for_each(&mut add);
            }
        }
        Ok(refs)
    }

    /// Raises every refcount below its count of references, makes that
    /// durable, then clears the dirty bit. Returns the refcounts raised.
    pub(super) fn repair_refcounts(&mut self) -> Result<u64> {
        let refs = self.references()?;
        let bits = self.header.refcount_bits();
        let max = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
        let mut raised = 0;
        {
            let mut counts = self.refs.lock().unwrap_or_else(|e| e.into_inner());
            let mut clusters: Vec<_> = refs.into_iter().collect();
            clusters.sort_unstable();
            for (at, n) in clusters {
                if counts.get(&self.base.files[0], &self.base.path, at)? < n.min(max) {
                    counts.set_one(&self.base.files[0], &self.base.path, at, n.min(max))?;
                    raised += 1;
                }
            }
        }
        self.sync_round()?;
        let incompatible = self.header.incompatible & !INCOMPAT_DIRTY;
        self.base.files[0]
            .write_all_at(&incompatible.to_be_bytes(), INCOMPATIBLE_AT)
            .and_then(|_| self.base.files[0].sync_data())
            .map_err(|e| Error::io(e, format!("cannot clear the dirty bit of {}", self.base.path.display())))?;
        self.header.incompatible = incompatible;
        Ok(raised)
    }
}
