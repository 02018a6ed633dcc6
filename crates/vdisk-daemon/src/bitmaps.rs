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
//!
//! The bitmaps belong to the export, not to one file: when a live operation
//! changes its top (a snapshot, a pivot, a stream or commit that reopens it),
//! [`swap_top`] saves them closed where they are (under the quiesce: the layer
//! left behind keeps a consistent copy as of then, and a reopened file opens
//! them cleanly), and once the device serves the new top they are kept by it
//! (its own store, or a sidecar beside it), marked in use, from the maps the
//! device went on marking. An image that keeps none (another server's NBD
//! export) leaves them in memory only, and says so.

use std::path::Path;
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
    /// Where the set is saved; None: nowhere, since the top changed to an
    /// image that keeps none.
    keeper: Option<Keeper>,
    set: Vec<StoredBitmap>,
    /// Closed by a clean stop: no change is made after it.
    closed: bool,
    /// The store kept bitmaps, or a change was saved: the close must write.
    kept: bool,
}

/// Where an image keeps bitmaps: its own store (qcow2, RBD) or a sidecar file beside it.
struct Keeper {
    image: Arc<dyn Image>,
    sidecar: Option<SidecarStore>,
}

impl Keeper {
    /// Where `image` (named `path`) keeps bitmaps; None: it keeps none (an
    /// RBD snapshot, another server's NBD export).
    fn of(image: Arc<dyn Image>, path: &Path, read_only: bool) -> Option<Keeper> {
        let sidecar = match image.bitmap_store() {
            Some(_) => None,
            None if matches!(image.format(), "rbd" | "nbd") => return None,
            None => Some(SidecarStore::new(sidecar::default_path(path), image.size(), read_only)),
        };
        Some(Keeper { image, sidecar })
    }

    fn store(&self) -> &dyn BitmapStore {
        match &self.sidecar {
            Some(s) => s,
            None => self.image.bitmap_store().expect("an image with its own store"),
        }
    }
}

impl State {
    /// Where a save goes: nowhere for a read-only export, or while no bitmap
    /// was ever kept (an image that never had one is not written to).
    fn saver(&self, read_only: bool) -> Option<&Keeper> {
        self.keeper.as_ref().filter(|_| !read_only && self.kept)
    }
}

/// One export's bitmaps.
pub struct ExportBitmaps {
    export: String,
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
        let read_only = device.read_only();
        let Some(keeper) = Keeper::of(device.image().clone(), image_path, read_only) else { return Ok(None) };
        let set = keeper
            .store()
            .open_session()
            .map_err(|e| Error::failed(format!("cannot open the dirty bitmaps of export {export:?}")).because(e))?;
        let mut me = ExportBitmaps {
            export: export.to_owned(),
            device: device.clone(),
            read_only,
            state: Mutex::new(State { keeper: Some(keeper), set: Vec::new(), closed: false, kept: false }),
        };
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
        let Some(keeper) = st.saver(self.read_only) else { return Ok(()) };
        keeper
            .store()
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
        let saved = st.keeper.as_ref().map_or(Ok(()), |k| k.store().save(&st.set, false));
        if let Err(e) = saved {
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

    /// Before the export's top is swapped, its device quiesced: the bitmaps
    /// are saved closed where they are kept (the module doc).
    fn hand_over(&self) {
        let st = self.state.lock().unwrap();
        let Some(keeper) = st.saver(self.read_only).filter(|_| !st.closed) else { return };
        if let Err(e) = keeper.store().save(&st.set, true) {
            log::warn!(export:% = self.export; "export {:?}: cannot save its dirty bitmaps before its top changes: {}",
                self.export, e.report());
        }
    }

    /// After a swap of the export's top (done or failed): the image the
    /// device serves now, named `path`, keeps the bitmaps, marked in use.
    fn follow(&self, path: &Path) {
        let mut st = self.state.lock().unwrap();
        if st.closed {
            return;
        }
        let image = self.device.image().clone();
        let moved = st.keeper.as_ref().is_none_or(|k| !std::ptr::addr_eq(Arc::as_ptr(&k.image), Arc::as_ptr(&image)));
        let export = &self.export;
        if moved {
            st.keeper = Keeper::of(image, path, self.read_only);
            match &st.keeper {
                None if !st.set.is_empty() => log::warn!(export:% = export; "export {export:?}: {} keeps no dirty \
                    bitmaps: its bitmaps are kept in memory only (served, but lost when it stops)", path.display()),
                None => {}
                // What the new top held before is replaced by the export's set.
                Some(k) => match k.store().open_session() {
                    Ok(found) => st.kept |= !found.is_empty(),
                    Err(e) => log::warn!(export:% = export; "export {export:?}: the dirty bitmaps of {}: {}",
                        path.display(), e.report()),
                },
            }
        }
        let Some(keeper) = st.saver(self.read_only) else { return };
        if let Err(e) = keeper.store().save(&st.set, false) {
            log::warn!(export:% = export; "export {export:?}: cannot save its dirty bitmaps in {} ({}): they are \
                kept in memory, and the next bitmap change or a clean stop saves them", path.display(), e.report());
        }
    }
}

/// Swaps an export's top: `swap` opens the new one and puts it under the
/// device, which the caller has quiesced; the export's `bitmaps`, if any,
/// go with it (the module doc). `path` names the top after a swap that succeeds.
pub(crate) fn swap_top<T, E>(
    bitmaps: Option<&ExportBitmaps>,
    path: &Path,
    swap: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if let Some(b) = bitmaps {
        b.hand_over();
    }
    let r = swap();
    if let Some(b) = bitmaps {
        b.follow(path);
    }
    r
}
