//! An export's persistent dirty bitmaps while it is served (issue 26; the
//! design: docs/design.md "Dirty bitmaps"). What it owns: the store session
//! (qcow2's own bitmaps, an RBD image's metadata `vdisk.bitmaps`, or the
//! sidecar file `IMAGE.bitmaps` of a raw or COW image), the set of bitmaps,
//! which of them the device marks (its write observers) and which the NBD
//! server serves as `qemu:dirty-bitmap:NAME`.
//!
//! At export start the store's session opens (marking every bitmap in use
//! on disk); enabled consistent bitmaps observe the device's writes; the
//! consistent ones are served over NBD. Every change is saved at once as a
//! checkpoint (`save(set, false)`); a clean stop saves with `close` after the
//! device's last flush, clearing the in-use marks. A bitmap found in use (the
//! image was not closed cleanly) is inconsistent: listed, never served, and
//! every operation but `remove` is refused, as qemu refuses them.

use std::sync::{Arc, Mutex};

use vdisk_engine::Device;
use vdisk_image::bitmap::sidecar::{self, SidecarStore};
use vdisk_image::bitmap::{self as bm, BitmapStore, DirtyBitmap, StoredBitmap};
use vdisk_image::Image;

use crate::{Error, ErrorKind};

/// Default granularity of a new bitmap (qemu's default for qcow2 too).
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;

/// A bitmap as `bitmap_list` shows it.
#[derive(Clone, Debug)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    pub enabled: bool,
    pub inconsistent: bool,
    /// Bytes marked dirty (whole granules).
    pub dirty_bytes: u64,
}

/// What a bitmap verb asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BitmapOp {
    Add {
        granularity: Option<u64>,
        disabled: bool,
    },
    Remove,
    Clear,
    Enable,
    Disable,
    /// Merge these bitmaps into the named one.
    Merge {
        sources: Vec<String>,
    },
}

struct State {
    set: Vec<StoredBitmap>,
    /// Closed by a clean stop: no change is made after it.
    closed: bool,
    /// The store kept bitmaps, or a change was saved: the close must write.
    kept: bool,
}

/// One export's bitmaps.
pub struct ExportBitmaps {
    export: String,
    image: Arc<dyn Image>,
    sidecar: Option<SidecarStore>,
    device: Arc<Device>,
    read_only: bool,
    state: Mutex<State>,
}

impl ExportBitmaps {
    /// Opens the store session of `device`'s image, `image_path` the image
    /// as named (the sidecar lies beside it). An RBD image keeps its own (in
    /// its RBD metadata); an RBD snapshot keeps none: None.
    pub(crate) fn open(
        export: &str,
        image_path: &std::path::Path,
        device: &Arc<Device>,
    ) -> Result<Option<Self>, Error> {
        let image = device.image().clone();
        let read_only = device.read_only();
        let sidecar = match image.bitmap_store() {
            Some(_) => None,
            None if image.format() == "rbd" => return Ok(None),
            None => Some(SidecarStore::new(sidecar::default_path(image_path), device.size(), read_only)),
        };
        let mut me = ExportBitmaps {
            export: export.to_owned(),
            image,
            sidecar,
            device: device.clone(),
            read_only,
            state: Mutex::new(State { set: Vec::new(), closed: false, kept: false }),
        };
        let set = me
            .store()
            .open_session()
            .map_err(|e| Error::failed(format!("cannot open the dirty bitmaps of export {export:?}")).because(e))?;
        for b in set.iter().filter(|b| b.inconsistent) {
            log::warn!(export:% = export; "export {export:?}: bitmap {:?} is inconsistent (the image was not \
                closed cleanly): not served; `vdisk ctl bitmap remove {export} {}` drops it", b.name, b.name);
        }
        let st = me.state.get_mut().unwrap();
        st.kept = !set.is_empty();
        st.set = set;
        me.observe(&me.state.lock().unwrap().set);
        Ok(Some(me))
    }

    fn store(&self) -> &dyn BitmapStore {
        match &self.sidecar {
            Some(s) => s,
            None => self.image.bitmap_store().expect("an image with its own store"),
        }
    }

    /// Makes the device mark exactly the enabled consistent bitmaps.
    fn observe(&self, set: &[StoredBitmap]) {
        let obs = self.device.write_observers();
        for b in set {
            if b.map.enabled() && !b.inconsistent {
                obs.add(b.map.clone());
            } else {
                obs.remove(&b.map);
            }
        }
    }

    /// The bitmaps the NBD export serves: the consistent ones.
    pub(crate) fn served(&self) -> Vec<(String, Arc<DirtyBitmap>)> {
        let st = self.state.lock().unwrap();
        st.set.iter().filter(|b| !b.inconsistent).map(|b| (b.name.clone(), b.map.clone())).collect()
    }

    pub fn list(&self) -> Vec<BitmapInfo> {
        let st = self.state.lock().unwrap();
        st.set
            .iter()
            .map(|b| BitmapInfo {
                name: b.name.clone(),
                granularity: b.map.granularity(),
                enabled: b.map.enabled(),
                inconsistent: b.inconsistent,
                dirty_bytes: b.map.dirty_bytes().min(b.map.size()),
            })
            .collect()
    }

    /// Ends the session cleanly: called after the device's last flush.
    /// Nothing is written for a read-only export or a sidecar never made.
    pub(crate) fn close(&self) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        for b in &st.set {
            self.device.write_observers().remove(&b.map);
        }
        // An image that never had a bitmap is not written to (no sidecar made, no qcow2 header rewritten).
        if self.read_only || !st.kept {
            return Ok(());
        }
        self.store()
            .save(&st.set, true)
            .map_err(|e| Error::failed(format!("cannot save the dirty bitmaps of export {:?}", self.export)).because(e))
    }

    /// Carries out one change and saves the set (a checkpoint); on a
    /// failed save the change is undone in memory.
    pub fn change(&self, name: &str, op: &BitmapOp) -> Result<(), Error> {
        bm::store::check_name(name).map_err(|e| Error::invalid(e.message().to_owned()))?;
        let export = &self.export;
        let mut st = self.state.lock().unwrap();
        if st.closed {
            return Err(Error::new(ErrorKind::NotFound, format!("export {export:?} is being removed")));
        }
        if self.read_only {
            return Err(Error::invalid(format!("export {export:?} is read-only: its bitmaps cannot be changed")));
        }
        let find = |set: &[StoredBitmap], n: &str| -> Result<usize, Error> {
            set.iter().position(|b| b.name == n).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!("export {export:?} has no bitmap {n:?} (`vdisk ctl bitmap list {export}` shows them)"),
                )
            })
        };
        let usable = |set: &[StoredBitmap], n: &str| -> Result<usize, Error> {
            let i = find(set, n)?;
            if set[i].inconsistent {
                return Err(Error::invalid(format!(
                    "bitmap {n:?} of export {export:?} is inconsistent (the image was not closed cleanly) and \
                     cannot be used; `vdisk ctl bitmap remove {export} {n}` drops it"
                )));
            }
            Ok(i)
        };
        let before = st.set.clone();
        // What to undo should the save fail: the bits of a cleared or merged-into bitmap.
        let mut undo: Option<(Arc<DirtyBitmap>, DirtyBitmap, bool)> = None;
        match op {
            BitmapOp::Add { granularity, disabled } => {
                if st.set.iter().any(|b| b.name == name) {
                    return Err(Error::new(
                        ErrorKind::Exists,
                        format!(
                            "export {export:?} has a bitmap {name:?} already: remove it first or pick another name"
                        ),
                    ));
                }
                let g = granularity.unwrap_or(DEFAULT_GRANULARITY);
                let map = DirtyBitmap::new(self.device.size(), g)
                    .map_err(|e| Error::invalid(format!("bitmap {name:?}: {}", e.message())))?;
                map.set_enabled(!disabled);
                st.set.push(StoredBitmap::new(name, map));
            }
            BitmapOp::Remove => {
                let i = find(&st.set, name)?;
                let gone = st.set.remove(i);
                self.device.write_observers().remove(&gone.map);
            }
            BitmapOp::Clear => {
                let m = st.set[usable(&st.set, name)?].map.clone();
                undo = Some((m.clone(), m.duplicate(), m.enabled()));
                m.clear_all();
            }
            BitmapOp::Enable | BitmapOp::Disable => {
                let m = &st.set[usable(&st.set, name)?].map;
                undo = Some((m.clone(), m.duplicate(), m.enabled()));
                m.set_enabled(*op == BitmapOp::Enable);
            }
            BitmapOp::Merge { sources } => {
                if sources.is_empty() {
                    return Err(Error::invalid("merge: name at least one bitmap to merge from"));
                }
                let target = st.set[usable(&st.set, name)?].map.clone();
                let from: Vec<Arc<DirtyBitmap>> = sources
                    .iter()
                    .map(|s| usable(&st.set, s).map(|i| st.set[i].map.clone()))
                    .collect::<Result<_, _>>()?;
                undo = Some((target.clone(), target.duplicate(), target.enabled()));
                for (s, m) in sources.iter().zip(&from) {
                    target
                        .merge(m)
                        .map_err(|e| Error::invalid(format!("cannot merge {s:?} into {name:?}: {}", e.message())))?;
                }
            }
        }
        self.observe(&st.set);
        st.kept = true;
        if let Err(e) = self.store().save(&st.set, false) {
            if let Some((m, old, enabled)) = undo {
                m.clear_all();
                m.merge(&old).ok();
                m.set_enabled(enabled);
            }
            st.set = before;
            self.observe(&st.set);
            return Err(
                Error::failed(format!("cannot save the bitmaps of export {export:?}; nothing was changed")).because(e)
            );
        }
        Ok(())
    }
}
