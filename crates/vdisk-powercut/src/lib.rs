//! Storage that loses power: a small FUSE file system (one flat directory,
//! all in memory) for vdisk's power-loss tests. vdisk runs unchanged on top
//! of it; its `pwritev2`, `fdatasync`, `fallocate` and io_uring calls reach
//! this file system through the kernel's FUSE client, exactly as they would
//! reach any other FUSE file system.
//!
//! The durability model is a disk with a volatile write cache and nothing
//! else:
//! - every WRITE, hole punch, zero range and size change is applied at once
//!   to what reads see, and remembered as *pending*;
//! - an FSYNC (with or without its datasync bit) of a file makes everything
//!   pending in that file durable. Nothing else does: not CLOSE/FLUSH, and
//!   not the `O_DSYNC`/`O_SYNC` bits a WRITE may carry in its flags (they are
//!   counted in [`Stats`], so a test can see what the kernel sends);
//! - [`Storage::cut`] is the power cut: the storage dies at once (every later
//!   request fails with EIO) and only the durable state remains, either
//!   exactly ([`Survival::Nothing`]) or with a random part of the pending
//!   writes applied, each 512-byte piece of each on its own
//!   ([`Survival::Random`]: a disk that wrote some of its cache, in any
//!   order, tearing writes at sector boundaries);
//! - [`Storage::cut_at_fsync`] arms a cut that happens when the Nth FSYNC
//!   arrives, before it takes effect: the moment the most data is pending;
//! - [`Storage::restart`] unmounts and mounts again on the durable state only.
//!
//! Directory operations (create, unlink, rename) are durable at once (a file
//! system that journals its metadata); what a file holds is only as durable
//! as its FSYNCs made it (`vdisk soak --jobs` creates overlays and replaces
//! bitmap sidecar files between cuts). The file system asks the kernel
//! for `FUSE_ASYNC_DIO`, as libfuse does by default, so asynchronous
//! O_DIRECT writes reach it the way they reach most FUSE file systems.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

/// What survives a power cut besides what was fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Survival {
    /// Nothing: every write not covered by an FSYNC is gone.
    Nothing,
    /// Each 512-byte piece of each pending write (and each pending size
    /// change) survives with probability 1/2, chosen from this seed.
    Random(u64),
}

/// What the kernel sent, counted since the storage was created.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub writes: u64,
    /// WRITEs whose flags carried O_DSYNC or O_SYNC.
    pub dsync_writes: u64,
    /// WRITEs whose flags carried O_DIRECT.
    pub direct_writes: u64,
    pub fsyncs: u64,
    /// FSYNCs with the datasync bit.
    pub datasyncs: u64,
    pub fallocates: u64,
    /// Opens with O_DIRECT.
    pub direct_opens: u64,
    /// Power cuts so far.
    pub cuts: u64,
}

enum Pending {
    Write { offset: u64, data: Vec<u8> },
    Zero { offset: u64, len: u64 },
    Size(u64),
}

struct Node {
    name: OsString,
    /// What reads see.
    current: Vec<u8>,
    /// What survives a cut.
    durable: Vec<u8>,
    /// What `current` has that `durable` lacks, in order.
    pending: Vec<Pending>,
    mtime: SystemTime,
    perm: u16,
}

const ROOT: u64 = 1;
const SECTOR: u64 = 512;
const TTL: Duration = Duration::from_secs(1);

struct State {
    nodes: BTreeMap<u64, Node>,
    next_ino: u64,
    dead: bool,
    /// A cut armed for the Nth FSYNC from now.
    cut_at_fsync: Option<(u64, Survival)>,
    stats: Stats,
    /// Answer OPEN with FOPEN_DIRECT_IO (no page cache in the kernel for these files).
    direct_io: bool,
}

struct Rng(u64);

impl Rng {
    fn bit(&mut self) -> bool {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 & (1 << 40) != 0
    }
}

fn write_at(buf: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset as usize + data.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    buf[offset as usize..end].copy_from_slice(data);
}

/// Zeros inside the file's size (FALLOC_FL_KEEP_SIZE).
fn zero_at(buf: &mut [u8], offset: u64, len: u64) {
    let start = (offset as usize).min(buf.len());
    let end = ((offset + len) as usize).min(buf.len());
    buf[start..end].fill(0);
}

/// The 512-byte pieces of [offset, offset + len), as (start, end).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset + len;
    let mut p = offset;
    std::iter::from_fn(move || {
        if p >= end {
            return None;
        }
        let q = ((p / SECTOR + 1) * SECTOR).min(end);
        let r = (p, q);
        p = q;
        Some(r)
    })
}

impl State {
    fn cut(&mut self, survival: Survival) {
        let mut rng = match survival {
            Survival::Nothing => None,
            Survival::Random(seed) => Some(Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)),
        };
        for node in self.nodes.values_mut() {
            let mut disk = std::mem::take(&mut node.durable);
            if let Some(rng) = rng.as_mut() {
                for op in node.pending.drain(..) {
                    match op {
                        Pending::Write { offset, data } => {
                            for (p, q) in pieces(offset, data.len() as u64) {
                                if rng.bit() {
                                    write_at(&mut disk, p, &data[(p - offset) as usize..(q - offset) as usize]);
                                }
                            }
                        }
                        Pending::Zero { offset, len } => {
                            for (p, q) in pieces(offset, len) {
                                if rng.bit() {
                                    zero_at(&mut disk, p, q - p);
                                }
                            }
                        }
                        Pending::Size(n) => {
                            if rng.bit() {
                                disk.resize(n as usize, 0);
                            }
                        }
                    }
                }
            }
            node.pending.clear();
            node.current = disk.clone();
            node.durable = disk;
        }
        self.dead = true;
        self.cut_at_fsync = None;
        self.stats.cuts += 1;
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, size, mtime, perm) = if ino == ROOT {
            (FileType::Directory, 0, SystemTime::UNIX_EPOCH, 0o755)
        } else {
            let n = self.nodes.get(&ino)?;
            (FileType::RegularFile, n.current.len() as u64, n.mtime, n.perm)
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm,
            nlink: if ino == ROOT { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn open_flags(&self) -> FopenFlags {
        if self.direct_io {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        }
    }

    fn find(&self, name: &OsStr) -> Option<u64> {
        self.nodes.iter().find(|(_, n)| n.name == name).map(|(&i, _)| i)
    }
}

struct Fs(Arc<Mutex<State>>);

impl Fs {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn has(flags: OpenFlags, bit: i32) -> bool {
    flags.0 & bit == bit
}

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // As libfuse asks by default: asynchronous direct I/O stays asynchronous.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let st = self.state();
        match st.find(name).filter(|_| parent.0 == ROOT).and_then(|i| st.attr(i)) {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.state().attr(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(m) = mode {
            n.perm = (m & 0o7777) as u16;
        }
        if let Some(s) = size {
            n.current.resize(s as usize, 0);
            n.pending.push(Pending::Size(s));
            n.mtime = SystemTime::now();
        }
        match mtime {
            Some(TimeOrNow::SpecificTime(t)) => n.mtime = t,
            Some(TimeOrNow::Now) => n.mtime = SystemTime::now(),
            None => {}
        }
        let a = st.attr(ino.0).expect("the node exists");
        reply.attr(&TTL, &a);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        match st.find(name).filter(|_| parent.0 == ROOT) {
            Some(i) => {
                st.nodes.remove(&i);
                reply.ok()
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    /// Durable at once, as every directory operation here (vdisk's bitmap
    /// sidecar is replaced by a rename of a synced temporary file).
    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        if parent.0 != ROOT || newparent.0 != ROOT || flags.bits() != 0 {
            return reply.error(if flags.bits() != 0 { Errno::EINVAL } else { Errno::ENOENT });
        }
        let Some(from) = st.find(name) else { return reply.error(Errno::ENOENT) };
        if let Some(to) = st.find(newname).filter(|&to| to != from) {
            st.nodes.remove(&to);
        }
        st.nodes.get_mut(&from).expect("found").name = newname.to_owned();
        reply.ok()
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        if !st.nodes.contains_key(&ino.0) {
            return reply.error(Errno::ENOENT);
        }
        if has(flags, libc::O_DIRECT) {
            st.stats.direct_opens += 1;
        }
        reply.opened(FileHandle(0), st.open_flags());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        let Some(n) = st.nodes.get(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let start = (offset as usize).min(n.current.len());
        let end = (offset as usize + size as usize).min(n.current.len());
        reply.data(&n.current[start..end]);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        st.stats.writes += 1;
        if has(flags, libc::O_DSYNC) {
            st.stats.dsync_writes += 1;
        }
        if has(flags, libc::O_DIRECT) {
            st.stats.direct_writes += 1;
        }
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        write_at(&mut n.current, offset, data);
        n.pending.push(Pending::Write { offset, data: data.to_vec() });
        n.mtime = SystemTime::now();
        reply.written(data.len() as u32);
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        st.stats.fsyncs += 1;
        if datasync {
            st.stats.datasyncs += 1;
        }
        if let Some((n, survival)) = st.cut_at_fsync {
            if n <= 1 {
                st.cut(survival);
                return reply.error(Errno::EIO);
            }
            st.cut_at_fsync = Some((n - 1, survival));
        }
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        n.durable = n.current.clone();
        n.pending.clear();
        reply.ok();
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let st = self.state();
        let mut entries =
            vec![(ROOT, FileType::Directory, OsString::from(".")), (ROOT, FileType::Directory, "..".into())];
        entries.extend(st.nodes.iter().map(|(&i, n)| (i, FileType::RegularFile, n.name.clone())));
        for (k, (i, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(i), (k + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: fuser::PollNotifier,
        events: fuser::PollEvents,
        _flags: fuser::PollFlags,
        reply: fuser::ReplyPoll,
    ) {
        // A regular file is always ready.
        reply.poll(events);
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::from_i32(libc::ENODATA));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.size(0);
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: fuser::ReplyStatfs) {
        reply.statfs(1 << 22, 1 << 21, 1 << 21, 1 << 10, 1 << 9, 4096, 255, 4096);
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        if parent.0 != ROOT {
            return reply.error(Errno::ENOENT);
        }
        let ino = match st.find(name) {
            Some(_) if flags & libc::O_EXCL != 0 => return reply.error(Errno::EEXIST),
            Some(i) => i,
            None => {
                let i = st.next_ino;
                st.next_ino += 1;
                let node = Node {
                    name: name.to_owned(),
                    current: Vec::new(),
                    durable: Vec::new(),
                    pending: Vec::new(),
                    mtime: SystemTime::now(),
                    perm: (mode & 0o7777) as u16,
                };
                st.nodes.insert(i, node);
                i
            }
        };
        if flags & libc::O_DIRECT != 0 {
            st.stats.direct_opens += 1;
        }
        let a = st.attr(ino).expect("just made");
        reply.created(&TTL, &a, Generation(0), FileHandle(0), st.open_flags());
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut st = self.state();
        if st.dead {
            return reply.error(Errno::EIO);
        }
        st.stats.fallocates += 1;
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let zeroing = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0;
        if mode & !(libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let end = offset + length;
        if !keep && end > n.current.len() as u64 {
            n.current.resize(end as usize, 0);
            n.pending.push(Pending::Size(end));
        }
        if zeroing {
            zero_at(&mut n.current, offset, length);
            n.pending.push(Pending::Zero { offset, len: length });
        }
        n.mtime = SystemTime::now();
        reply.ok();
    }
}

/// Tells whether the storage is dead (cut and not yet restarted).
#[derive(Clone)]
pub struct Probe(Arc<Mutex<State>>);

impl Probe {
    pub fn is_dead(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).dead
    }
}

/// A mounted power-loss file system and its state, which outlives mounts.
pub struct Storage {
    state: Arc<Mutex<State>>,
    mountpoint: PathBuf,
    session: Option<BackgroundSession>,
}

impl Storage {
    /// Mounts an empty file system at `mountpoint` (created if missing).
    pub fn mount(mountpoint: &Path) -> io::Result<Storage> {
        Self::mount_with(mountpoint, false)
    }

    /// [`Storage::mount`]; with `direct_io` every OPEN is answered with
    /// FOPEN_DIRECT_IO, as file systems mounted with libfuse's `direct_io`
    /// (and vdisk's own FUSE export) do: the kernel keeps no page cache for
    /// the files and sends every read and write as it comes.
    pub fn mount_with(mountpoint: &Path, direct_io: bool) -> io::Result<Storage> {
        std::fs::create_dir_all(mountpoint)?;
        let state = State {
            nodes: BTreeMap::new(),
            next_ino: ROOT + 1,
            dead: false,
            cut_at_fsync: None,
            stats: Stats::default(),
            direct_io,
        };
        let mut s = Storage { state: Arc::new(Mutex::new(state)), mountpoint: mountpoint.to_owned(), session: None };
        s.attach()?;
        Ok(s)
    }

    fn attach(&mut self) -> io::Result<()> {
        let mut cfg = Config::default();
        cfg.mount_options = vec![MountOption::FSName("vdisk-powercut".into()), MountOption::Subtype("powercut".into())];
        let session = fuser::spawn_mount(Fs(self.state.clone()), &self.mountpoint, &cfg)?;
        self.session = Some(session);
        Ok(())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The path of `name` in the file system.
    pub fn path(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    /// Makes everything written so far durable (the end of a test's setup).
    pub fn sync_all(&self) {
        for n in self.state().nodes.values_mut() {
            n.durable = n.current.clone();
            n.pending.clear();
        }
    }

    /// The power cut: from now on every request fails with EIO, and only
    /// what `survival` allows of the unsynced writes remains.
    pub fn cut(&self, survival: Survival) {
        let mut st = self.state();
        if !st.dead {
            st.cut(survival);
        }
    }

    /// Cuts the power when the `n`th FSYNC from now arrives (n >= 1), before
    /// it makes anything durable.
    pub fn cut_at_fsync(&self, n: u64, survival: Survival) {
        self.state().cut_at_fsync = Some((n.max(1), survival));
    }

    pub fn is_dead(&self) -> bool {
        self.state().dead
    }

    /// Whether OPENs from now on are answered with FOPEN_DIRECT_IO.
    pub fn set_direct_io(&self, on: bool) {
        self.state().direct_io = on;
    }

    /// A handle other threads can ask whether the power is off.
    pub fn probe(&self) -> Probe {
        Probe(self.state.clone())
    }

    pub fn stats(&self) -> Stats {
        self.state().stats.clone()
    }

    /// The durable bytes of file `name` (what a restart would see).
    pub fn durable(&self, name: &str) -> Option<Vec<u8>> {
        let st = self.state();
        st.find(OsStr::new(name)).map(|i| st.nodes[&i].durable.clone())
    }

    /// Power back on: cuts first if still alive (nothing unsynced survives
    /// then), unmounts, and mounts again on the durable state. Whoever used
    /// the files must have closed them (a killed process is gone).
    pub fn restart(&mut self) -> io::Result<()> {
        self.cut(Survival::Nothing);
        self.detach()?;
        {
            let mut st = self.state();
            st.dead = false;
            st.cut_at_fsync = None;
        }
        self.attach()
    }

    fn detach(&mut self) -> io::Result<()> {
        let Some(session) = self.session.take() else { return Ok(()) };
        let path = self.mountpoint.clone();
        if let Err(e) = session.umount_and_join() {
            // Busy: detach it; the old connection goes once its last user does.
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
            // SAFETY: umount2 only reads the NUL-terminated path for the duration of the call.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                // EINVAL: no longer a mount point. The unmount went through and the
                // error came from the session's end (ECONNABORTED once the
                // connection is gone), which is what a power cut leaves.
                if io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                    return Err(io::Error::new(e.kind(), format!("cannot unmount {}: {e}", path.display())));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            log::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests;
