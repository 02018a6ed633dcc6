//! The engine conformance suite: the same assertions for every engine
//! configuration (and, as they arrive, every engine and image format).

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use vdisk_image::{CowImage, ErrorKind, Image, RawImage};

use super::*;

struct Collect(Mutex<mpsc::Sender<Request>>);

impl Sink for Collect {
    fn complete(&self, done: Vec<Request>) {
        let tx = self.0.lock().unwrap();
        for r in done {
            tx.send(r).unwrap();
        }
    }
}

struct Rig {
    dev: Arc<Device>,
    sink: Arc<dyn Sink>,
    rx: mpsc::Receiver<Request>,
    dir: PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Rig {
    fn new(tag: &str, size: u64, read_only: bool, config: &EngineConfig) -> Rig {
        Self::new_in(&std::env::temp_dir(), tag, size, read_only, config, Format::Raw)
    }

    fn new_as(tag: &str, size: u64, read_only: bool, config: &EngineConfig, format: Format) -> Rig {
        Self::new_in(&std::env::temp_dir(), tag, size, read_only, config, format)
    }

    /// A raw read-write device of `size` bytes on `core`'s workers.
    fn on(core: &Core, tag: &str, size: u64, config: &EngineConfig) -> Rig {
        Self::new_with(&std::env::temp_dir(), tag, size, false, config, Format::Raw, Some(core))
    }

    fn new_in(
        base: &std::path::Path,
        tag: &str,
        size: u64,
        read_only: bool,
        config: &EngineConfig,
        format: Format,
    ) -> Rig {
        Self::new_with(base, tag, size, read_only, config, format, None)
    }

    fn new_with(
        base: &std::path::Path,
        tag: &str,
        size: u64,
        read_only: bool,
        config: &EngineConfig,
        format: Format,
        core: Option<&Core>,
    ) -> Rig {
        let dir = base.join(format!("vdisk-engine-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let _ = std::fs::remove_file(&path);
        RawImage::create(&path, size, None).unwrap();
        let image: Arc<dyn Image> = match format {
            Format::Raw => Arc::new(RawImage::open(&path, read_only).unwrap()),
            Format::Cow => {
                let overlay = dir.join("disk.cow");
                let _ = std::fs::remove_file(&overlay);
                CowImage::create(&overlay, &path).unwrap();
                Arc::new(CowImage::open(&overlay, read_only, None, false).unwrap())
            }
        };
        let dev = Device::start_on(core.unwrap_or(Core::global()), tag, image, config).unwrap();
        assert_eq!(dev.kind(), config.kind, "{tag}: the engine asked for runs here");
        let (tx, rx) = mpsc::channel();
        Rig { dev: Arc::new(dev), sink: Arc::new(Collect(Mutex::new(tx))), rx, dir }
    }

    /// A 1 MiB raw image, read-write, opened for direct I/O (the temp dir must
    /// support O_DIRECT), served as device `name` under `config`.
    fn new_direct(tag: &str, name: &str, config: &EngineConfig) -> Rig {
        let dir = std::env::temp_dir().join(format!("vdisk-engine-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let _ = std::fs::remove_file(&path);
        RawImage::create(&path, 1 << 20, None).unwrap();
        let image = match RawImage::open(&path, false).unwrap().with_direct_io() {
            Ok(i) => i,
            Err(e) => panic!("the temp dir must support O_DIRECT for this test: {}", e.report()),
        };
        assert_eq!(image.direct_files().len(), 1);
        let dev = Arc::new(Device::start(name, Arc::new(image), config).unwrap());
        let (tx, rx) = mpsc::channel();
        Rig { dev, sink: Arc::new(Collect(Mutex::new(tx))), rx, dir }
    }

    /// Submits a batch through `submit_inline` and returns all completions in tag order.
    fn run_inline(&self, batch: Vec<Request>) -> Vec<Request> {
        let n = batch.len();
        let mut out = Vec::new();
        self.dev.submit_inline(batch, &self.sink, &mut out);
        while out.len() < n {
            out.push(self.rx.recv().unwrap());
        }
        out.sort_by_key(|r| r.tag);
        out
    }

    /// Submits a batch and returns the completions in tag order.
    fn run(&self, batch: Vec<Request>) -> Vec<Request> {
        let n = batch.len();
        self.dev.submit(batch, &self.sink);
        let mut out: Vec<Request> = (0..n).map(|_| self.rx.recv().unwrap()).collect();
        out.sort_by_key(|r| r.tag);
        out
    }
}

fn write(off: u64, data: Vec<u8>, tag: u64) -> Request {
    fua_write(off, data, tag, false)
}

fn fua_write(off: u64, data: Vec<u8>, tag: u64, fua: bool) -> Request {
    let len = data.len() as u64;
    Request::new(Command::Write { data: Buf::from_slice(&data).into(), fua }, off, len, tag)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i / 512) as u8) ^ (i as u8)).collect()
}

/// The image formats every engine configuration is checked against.
#[derive(Clone, Copy, Debug)]
enum Format {
    Raw,
    /// A COW overlay over a sparse (all-zero) raw base.
    Cow,
}

/// Every engine configuration crossed with every image format.
fn cases() -> Vec<(String, EngineConfig, Format)> {
    let mut out = Vec::new();
    for format in [Format::Raw, Format::Cow] {
        for (name, cfg) in configs() {
            out.push((format!("{name}-{format:?}"), cfg, format));
        }
    }
    out
}

fn configs() -> Vec<(&'static str, EngineConfig)> {
    vec![
        ("threads", EngineConfig { kind: EngineKind::Threads, ..Default::default() }),
        ("one-worker", EngineConfig { kind: EngineKind::Threads, workers: 1, ..Default::default() }),
        (
            "no-coalesce",
            EngineConfig { kind: EngineKind::Threads, coalesce: false, batch: 1, workers: 4, ..Default::default() },
        ),
        ("sync", EngineConfig { kind: EngineKind::Threads, sync: true, workers: 4, ..Default::default() }),
        ("uring", EngineConfig::default()),
        ("uring-batch1", EngineConfig { kind: EngineKind::Uring, batch: 1, ..Default::default() }),
        ("uring-sync", EngineConfig { kind: EngineKind::Uring, sync: true, coalesce: false, ..Default::default() }),
    ]
}

#[test]
fn reads_return_what_batched_writes_wrote() {
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("rw-{name}"), 4 << 20, false, &cfg, format);
        // 64 adjacent 4 KiB writes in one batch: the coalescing path.
        let writes: Vec<Request> = (0..64).map(|i| write(i * 4096, pattern(i as u8, 4096), i)).collect();
        assert!(rig.run(writes).iter().all(|r| r.error.is_none()), "{name}");
        // An unaligned write straddling two of them.
        let odd = write(4096 * 3 + 17, pattern(99, 5000), 0);
        assert!(rig.run(vec![odd])[0].error.is_none());
        let reads: Vec<Request> = (0..64).map(|i| Request::new(Op::Read, i * 4096, 4096, i)).collect();
        let done = rig.run(reads);
        let mut expect: Vec<u8> = (0..64).flat_map(|i| pattern(i as u8, 4096)).collect();
        expect[4096 * 3 + 17..4096 * 3 + 17 + 5000].copy_from_slice(&pattern(99, 5000));
        for r in &done {
            assert!(r.error.is_none(), "{name}");
            let at = r.offset as usize;
            assert_eq!(r.buf(), &expect[at..at + 4096], "{name}: block at {at}");
        }
        let fua = fua_write(1 << 20, pattern(7, 65536), 0, true);
        let flush = Request::new(Op::Flush, 0, 0, 1);
        assert!(rig.run(vec![fua, flush]).iter().all(|r| r.error.is_none()));
        rig.dev.shutdown().unwrap();
    }
}

#[test]
fn trim_and_write_zeroes_read_back_as_zeros() {
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("zero-{name}"), 1 << 20, false, &cfg, format);
        rig.run(vec![write(0, vec![0xab; 1 << 20], 0)]);
        let trim = Request::new(Op::Trim { fua: false }, 0, 65536, 0);
        let zero = Request::new(Op::WriteZeroes { fua: false, no_hole: true, fast_zero: false }, 65536, 65536, 1);
        let zero_odd = Request::new(Op::WriteZeroes { fua: false, no_hole: false, fast_zero: true }, 200_001, 999, 2);
        assert!(rig.run(vec![trim, zero, zero_odd]).iter().all(|r| r.error.is_none()), "{name}");
        let got = rig.run(vec![Request::new(Op::Read, 0, 1 << 20, 0)]).remove(0).take_buf();
        assert!(got[..131072].iter().all(|&b| b == 0), "{name}");
        assert!(got[200_001..201_000].iter().all(|&b| b == 0), "{name}");
        assert_eq!(got[200_000], 0xab);
        assert_eq!(got[201_000], 0xab);
        let bs = Request::new(Op::BlockStatus { max: 16 }, 0, 1 << 20, 0);
        let st = rig.run(vec![bs]).remove(0).runs().to_vec();
        assert!(st[0].hole, "{name}: a trimmed start is a hole: {st:?}");
        assert_eq!(st[0].len, 65536, "{name}: {st:?}");
    }
}

/// A read-only device's bounds refuse what writes (at the exports' edge: the
/// engine itself only asserts it), and the reads it serves still work.
#[test]
fn read_only_devices_refuse_writes() {
    for (name, cfg, format) in cases() {
        read_only_refuses(&name, &cfg, format);
    }
}

fn read_only_refuses(name: &str, cfg: &EngineConfig, format: Format) {
    let rig = Rig::new_as(&format!("ro-{name}"), 65536, true, cfg, format);
    let bounds = rig.dev.bounds();
    assert_eq!(bounds, Bounds::new(65536, true), "{name}");
    assert_eq!(validate(Op::WRITE, 0, 512, &bounds), Err(Refusal::ReadOnly), "{name}");
    assert_eq!(validate(Op::Trim { fua: false }, 0, 512, &bounds), Err(Refusal::ReadOnly), "{name}");
    assert_eq!(validate(Op::Read, 0, 512, &bounds), Ok(()), "{name}");
    let done = rig.run(vec![Request::new(Op::Read, 0, 512, 2)]);
    assert!(done[0].error.is_none(), "{name}");
}

#[test]
fn shutdown_finishes_queued_requests() {
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("drain-{name}"), 1 << 20, false, &cfg, format);
        let batch: Vec<Request> = (0..200).map(|i| write((i % 256) * 4096, vec![i as u8; 4096], i)).collect();
        rig.dev.submit(batch, &rig.sink);
        rig.dev.shutdown().unwrap();
        assert_eq!(rig.rx.try_iter().count(), 200, "{name}");
    }
}

#[test]
fn many_batches_from_many_threads() {
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("mt-{name}"), 4 << 20, false, &cfg, format);
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (dev, sink) = (rig.dev.clone(), rig.sink.clone());
                std::thread::spawn(move || {
                    for round in 0..20u64 {
                        let batch: Vec<Request> = (0..16)
                            .map(|i| {
                                write((t * 256 + (round * 16 + i) % 256) * 4096, pattern((t * 7 + i) as u8, 4096), i)
                            })
                            .collect();
                        dev.submit(batch, &sink);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let done: Vec<Request> = (0..4 * 20 * 16).map(|_| rig.rx.recv().unwrap()).collect();
        assert!(done.iter().all(|r| r.error.is_none()), "{name}");
    }
}

#[test]
fn inline_submission_matches_queued_submission() {
    // /dev/shm is in memory (everything inline); the temp dir is usually not (cached reads inline).
    for base in [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        if !base.is_dir() {
            continue;
        }
        for (name, cfg, format) in cases() {
            let rig = Rig::new_in(&base, &format!("inline-{name}"), 1 << 20, false, &cfg, format);
            let writes: Vec<Request> = (0..32).map(|i| write(i * 8192, pattern(i as u8, 8192), i)).collect();
            assert!(rig.run_inline(writes).iter().all(|r| r.error.is_none()), "{name}");
            let mut mixed: Vec<Request> = (0..32).map(|i| Request::new(Op::Read, i * 8192, 8192, i)).collect();
            mixed.push(Request::new(Op::Flush, 0, 0, 100));
            mixed.push(Request::new(Op::Trim { fua: false }, 0, 8192, 101));
            let done = rig.run_inline(mixed);
            for r in &done[..32] {
                assert!(r.error.is_none(), "{name}");
                assert_eq!(r.buf(), pattern(r.tag as u8, 8192), "{name} in {}: block {}", base.display(), r.tag);
            }
            assert!(done[32..].iter().all(|r| r.error.is_none()));
            let zero = rig.run_inline(vec![Request::new(Op::Read, 0, 8192, 0)]).remove(0).take_buf();
            assert!(zero.iter().all(|&b| b == 0), "{name}: trimmed range reads zeros");
        }
    }
}

#[test]
fn direct_io_serves_aligned_and_unaligned_requests() {
    for (name, cfg) in configs() {
        let rig = Rig::new_direct(&format!("direct-{name}"), name, &cfg);
        // Aligned (direct) and unaligned (through the cache) writes, then reads of both kinds.
        let done = rig.run(vec![write(0, pattern(1, 65536), 0), write(65536 + 100, pattern(2, 5000), 1)]);
        assert!(done.iter().all(|r| r.error.is_none()), "{name}");
        let done = rig.run(vec![Request::new(Op::Read, 0, 65536, 0), Request::new(Op::Read, 65536 + 100, 5000, 1)]);
        assert_eq!(done[0].buf(), pattern(1, 65536), "{name}");
        assert_eq!(done[1].buf(), pattern(2, 5000), "{name}");
        let mut inline = Vec::new();
        rig.dev.submit_inline(vec![Request::new(Op::Read, 4096, 4096, 0)], &rig.sink, &mut inline);
        assert!(inline.is_empty(), "{name}: direct devices never run inline");
        assert_eq!(rig.rx.recv().unwrap().buf(), pattern(1, 65536)[4096..8192].to_vec());
    }
}

/// An image whose reads hang until released: a stalled backing store.
pub(super) struct Stalled {
    inner: RawImage,
    gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Image for Stalled {
    fn format(&self) -> &'static str {
        "stalled"
    }
    /// The raw image's, opened read-write.
    fn base(&self) -> &vdisk_image::ImageBase {
        self.inner.base()
    }
    fn map_read(&self, offset: u64, len: u64, out: &mut Vec<vdisk_image::Extent>) -> vdisk_image::Result<()> {
        let (open, cv) = &*self.gate;
        drop(cv.wait_while(open.lock().unwrap(), |open| !*open).unwrap());
        self.inner.map_read(offset, len, out)
    }
    fn map_write(&self, offset: u64, len: u64, out: &mut Vec<vdisk_image::Extent>) -> vdisk_image::Result<()> {
        self.inner.map_write(offset, len, out)
    }
    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<vdisk_image::Allocation>,
    ) -> vdisk_image::Result<()> {
        self.inner.allocation(offset, len, max, out)
    }
}

#[test]
fn a_stalled_device_never_blocks_another() {
    for (name, cfg) in configs() {
        let busy = Rig::new(&format!("busy-{name}"), 1 << 20, false, &cfg);
        let stalled_rig = Rig::new(&format!("stalled-{name}"), 1 << 20, false, &cfg);
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let path = stalled_rig.dev.image().file_path(0).to_owned();
        let image = Stalled { inner: RawImage::open(&path, false).unwrap(), gate: gate.clone() };
        // A mapping that blocks holds up its core worker and whatever shares it
        // (docs/design.md): the stalled device gets a core of its own.
        let own = Core::new(1);
        let stalled = Device::start_on(&own, "stalled", Arc::new(image), &cfg).unwrap();
        // Every worker or ring of the stalled device is stuck in a read.
        let reads: Vec<Request> = (0..64).map(|i| Request::new(Op::Read, i * 4096, 4096, i)).collect();
        stalled.submit(reads, &stalled_rig.sink);
        // The other device still serves a thousand requests.
        for round in 0..100 {
            let batch: Vec<Request> = (0..10).map(|i| write(i * 4096, vec![round as u8; 4096], i)).collect();
            assert!(busy.run(batch).iter().all(|r| r.error.is_none()), "{name}");
        }
        assert!(stalled_rig.rx.try_recv().is_err(), "{name}: the stalled reads cannot have finished");
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        for _ in 0..64 {
            assert!(stalled_rig.rx.recv().unwrap().error.is_none());
        }
        stalled.shutdown().unwrap();
    }
}

/// Memory lent to the engine in pieces, as an export lends a guest's memory.
struct Lender {
    mem: Arc<Mutex<Buf>>,
    base: std::ptr::NonNull<u8>,
}

impl Lender {
    fn new(len: usize) -> Lender {
        let mem = Arc::new(Mutex::new(Buf::zeroed(len)));
        let base = std::ptr::NonNull::new(mem.lock().unwrap().as_mut_ptr()).unwrap();
        Lender { mem, base }
    }

    /// `len` bytes at `at` of the lent memory.
    fn lend(&self, at: usize, len: usize) -> Option<Lent> {
        assert!(at + len <= self.mem.lock().unwrap().len());
        let ptr = self.base.as_ptr().wrapping_add(at);
        // SAFETY: the range lies inside the Buf that `mem` keeps alive (the Lent
        // holds `mem`); the test lends disjoint ranges and reads them only after
        // the requests are back.
        Some(unsafe { Lent::new(std::ptr::NonNull::new(ptr).unwrap(), len, self.mem.clone()) })
    }

    fn bytes(&self, at: usize, len: usize) -> Vec<u8> {
        self.mem.lock().unwrap()[at..at + len].to_vec()
    }
}

/// Borrowed buffers, aligned or not, contiguous pieces of one transfer (as a
/// virtio request with several descriptors becomes), on every engine and
/// format, and on an O_DIRECT image where only the aligned ones may go direct.
#[test]
fn borrowed_buffers_are_read_into_and_written_from_in_place() {
    let check = |name: &str, rig: &Rig| {
        let lender = Lender::new(1 << 20);
        lender.mem.lock().unwrap()[..262144].copy_from_slice(&pattern(5, 262144));
        // Three pieces of one 12 KiB write at consecutive offsets (aligned pointers),
        // and one piece at an odd address.
        let mut reqs = Vec::new();
        for i in 0..3u64 {
            let data = lender.lend(i as usize * 4096, 4096).unwrap().into();
            reqs.push(Request::new(Command::Write { data, fua: false }, 65536 + i * 4096, 4096, i));
        }
        let data = lender.lend(100_000 + 3, 1536).unwrap().into();
        reqs.push(Request::new(Command::Write { data, fua: false }, 131072, 1536, 3));
        let done = rig.run(reqs);
        assert!(
            done.iter().all(|r| r.error.is_none() && matches!(r.cmd.data(), Some(Data::Lent(_))) && r.buf().is_empty()),
            "{name}: {done:?}"
        );
        drop(done);
        let mut reqs = Vec::new();
        for i in 0..3u64 {
            let data = lender.lend(524288 + i as usize * 4096, 4096).unwrap().into();
            reqs.push(Request::new(Command::Read { data }, 65536 + i * 4096, 4096, i));
        }
        let data = lender.lend(700_000 + 1, 1536).unwrap().into();
        reqs.push(Request::new(Command::Read { data }, 131072, 1536, 3));
        let done = rig.run(reqs);
        assert!(done.iter().all(|r| r.error.is_none()), "{name}");
        drop(done);
        assert_eq!(lender.bytes(524288, 12288), lender.bytes(0, 12288), "{name}: the pieces read back in place");
        assert_eq!(lender.bytes(700_001, 1536), lender.bytes(100_003, 1536), "{name}: the odd piece too");
        assert_eq!(Arc::strong_count(&lender.mem), 1, "{name}: the engine let go of the lent memory");
    };
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("lent-{name}"), 1 << 20, false, &cfg, format);
        check(&name, &rig);
    }
    for (name, cfg) in configs() {
        let rig = Rig::new_direct(&format!("lent-direct-{name}"), name, &cfg);
        check(&format!("direct-{name}"), &rig);
    }
}

/// Durable writes on storage that loses what was never fsynced (a FUSE file
/// system, crates/vdisk-powercut), for every configuration, with and
/// without O_DIRECT: FUA writes (aligned, so direct ones take the O_DIRECT
/// file) and writes covered by a FLUSH are all there after the power cut.
/// On FUSE the kernel drops RWF_DSYNC from an asynchronous O_DIRECT write,
/// so this is where the ring engine's linked fdatasync is needed.
#[test]
fn durable_writes_survive_a_power_cut_of_fuse_storage() {
    // SAFETY: geteuid only returns a number.
    if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/fuse").exists() {
        panic!("this test mounts a FUSE file system: it needs root and /dev/fuse (CI has both)");
    }
    // Once as most FUSE file systems answer OPEN, once with FOPEN_DIRECT_IO
    // (libfuse's direct_io, vdisk's own export): there no RWF_DSYNC write
    // brings an FSYNC at all.
    for fopen_direct_io in [false, true] {
        power_cut_round(fopen_direct_io);
    }
}

fn power_cut_round(fopen_direct_io: bool) {
    let dir = std::env::temp_dir().join(format!("vdisk-engine-{}-powercut-{fopen_direct_io}", std::process::id()));
    let mut storage = vdisk_powercut::Storage::mount_with(&dir.join("store"), fopen_direct_io).unwrap();
    let path = storage.path("disk.img");
    std::fs::write(&path, vec![0u8; 4 << 20]).unwrap();
    storage.sync_all();
    let mut round = 0u8;
    for direct in [false, true] {
        for (name, cfg) in configs() {
            round += 1;
            let mut image = RawImage::open(&path, false).unwrap();
            if direct {
                image = image.with_direct_io().expect("O_DIRECT on the FUSE storage");
            }
            let dev = Arc::new(Device::start(name, Arc::new(image), &cfg).unwrap());
            let (tx, rx) = mpsc::channel();
            let rig = Rig { dev, sink: Arc::new(Collect(Mutex::new(tx))), rx, dir: dir.join("unused") };
            let base = round as u64 * 64 * 1024;
            let fua = fua_write(base, pattern(round, 16384), 0, true);
            let plain = write(base + 16384, pattern(round ^ 0x55, 16384), 1);
            let done = rig.run(vec![fua, plain]);
            assert!(done.iter().all(|r| r.error.is_none()), "{name}");
            assert!(rig.run(vec![Request::new(Op::Flush, 0, 0, 2)])[0].error.is_none(), "{name}");
            // Written after the flush, not durable: may be lost; here only to be pending at the cut.
            assert!(rig.run(vec![write(base + 32768, pattern(7, 4096), 3)])[0].error.is_none());
            let fua = fua_write(base + 40960, pattern(round ^ 0xaa, 8192), 4, true);
            assert!(rig.run(vec![fua])[0].error.is_none(), "{name}");
            storage.cut(vdisk_powercut::Survival::Nothing);
            drop(rig);
            storage.restart().unwrap();
            let disk = storage.durable("disk.img").unwrap();
            let at = |o: u64, n: usize| &disk[(base + o) as usize..(base + o) as usize + n];
            let what = format!(
                "{name}{}{}",
                if direct { " --direct" } else { "" },
                if fopen_direct_io { ", storage with FOPEN_DIRECT_IO" } else { "" }
            );
            assert!(at(0, 16384) == pattern(round, 16384), "{what}: a FUA write was lost");
            assert!(at(16384, 16384) == pattern(round ^ 0x55, 16384), "{what}: a flushed write was lost");
            assert!(at(40960, 8192) == pattern(round ^ 0xaa, 8192), "{what}: a FUA write after a flush was lost");
        }
    }
    drop(storage);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stats_count_each_request_once_inline_or_queued() {
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("stats-{name}"), 4 << 20, false, &cfg, format);
        let writes: Vec<Request> = (0..16).map(|i| write(i * 8192, pattern(i as u8, 4096), i)).collect();
        rig.run(writes);
        let mut reads: Vec<Request> = (0..16).map(|i| Request::new(Op::Read, i * 8192, 4096, i)).collect();
        reads.push(Request::new(Op::Flush, 0, 0, 99));
        rig.run_inline(reads);
        let s = rig.dev.stats();
        assert_eq!((s.write_ops, s.write_bytes, s.read_ops, s.read_bytes), (16, 65536, 16, 65536), "{name}: {s:?}");
        assert_eq!((s.flush_ops, s.errors, s.in_flight), (1, 0, 0), "{name}: {s:?}");
        assert_eq!((s.read_latency.count, s.write_latency.count, s.flush_latency.count), (16, 16, 1), "{name}");
    }
}

#[cfg(feature = "faults")]
mod drain;
mod failure;
mod shared;
mod swap;

/// Every write, TRIM and WRITE_ZEROES a device completes, queued or inline,
/// marks its observers' maps; reads and flushes do not, and a removed map is
/// marked no more.
#[test]
fn write_observers_see_every_completed_write() {
    use vdisk_image::bitmap::DirtyBitmap;
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("observe-{name}"), 4 << 20, false, &cfg, format);
        let map = Arc::new(DirtyBitmap::new(4 << 20, 65536).unwrap());
        rig.dev.write_observers().add(map.clone());
        rig.run(vec![write(0, pattern(1, 4096), 0), Request::new(Op::Read, 1 << 20, 4096, 1)]);
        rig.run_inline(vec![write(3 << 20, pattern(2, 512), 0), Request::new(Op::Flush, 0, 0, 1)]);
        let trim = Request::new(Op::Trim { fua: false }, 65536, 65536, 0);
        let zero = Request::new(Op::WriteZeroes { fua: false, no_hole: false, fast_zero: false }, 2 << 20, 4096, 1);
        assert!(rig.run(vec![trim, zero]).iter().all(|r| r.error.is_none()), "{name}");
        let dirty: Vec<(u64, bool)> = map.extents(0, 4 << 20, 64);
        let runs: Vec<u64> = dirty
            .iter()
            .scan(0, |at, &(len, d)| {
                let start = *at;
                *at += len;
                Some(if d { Some(start) } else { None })
            })
            .flatten()
            .collect();
        assert_eq!(runs, vec![0, 2 << 20, 3 << 20], "{name}: dirty runs start at {runs:?} ({dirty:?})");
        assert_eq!(map.count(), 4, "{name}");
        assert!(rig.dev.write_observers().remove(&map));
        rig.run(vec![write(1 << 20, pattern(3, 4096), 0)]);
        assert!(!map.is_dirty(1 << 20), "{name}: a removed map is not marked");
        rig.dev.shutdown().unwrap();
    }
}

/// A gate that holds every write that succeeded until the test lets it go.
#[derive(Default)]
struct HoldWrites {
    held: Mutex<Vec<Held>>,
    open: std::sync::atomic::AtomicBool,
}

impl WriteGate for HoldWrites {
    fn hold(&self, done: &mut Vec<Held>) {
        if self.open.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let mut held = self.held.lock().unwrap();
        let (writes, rest): (Vec<Held>, Vec<Held>) =
            done.drain(..).partition(|h| h.request.op().writes() && h.request.error.is_none());
        held.extend(writes);
        *done = rest;
    }

    fn open(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        answer(held);
    }
}

/// A write gate holds completed writes, queued or inline, back from their
/// sink while reads pass; a quiesce does not wait for what it holds; the
/// writes are answered once it lets them go, and when the device stops.
#[test]
fn a_write_gate_holds_writes_until_let_go() {
    let wait = std::time::Duration::from_millis(300);
    for (name, cfg, format) in cases() {
        let rig = Rig::new_as(&format!("gate-{name}"), 4 << 20, false, &cfg, format);
        let gate = Arc::new(HoldWrites::default());
        rig.dev.set_write_gate(Some(gate.clone()));
        rig.dev.submit(vec![write(0, pattern(1, 4096), 1)], &rig.sink);
        let mut inline = Vec::new();
        rig.dev.submit_inline(vec![write(1 << 20, pattern(2, 512), 2)], &rig.sink, &mut inline);
        assert!(inline.is_empty(), "{name}: an inline write is held too");
        let deadline = std::time::Instant::now() + wait;
        while gate.held.lock().unwrap().len() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(gate.held.lock().unwrap().len(), 2, "{name}: both writes are held");
        let read = rig.run(vec![Request::new(Op::Read, 0, 4096, 3)]);
        assert_eq!(read[0].tag, 3, "{name}: a read passes the gate");
        assert!(read[0].buf() == pattern(1, 4096), "{name}: a held write is in the image");
        assert!(rig.rx.recv_timeout(std::time::Duration::from_millis(50)).is_err(), "{name}: none answered");
        drop(rig.dev.quiesce(wait).expect("a held write is not in flight"));
        let before = rig.dev.stats();
        assert_eq!((before.write_ops, before.in_flight), (0, 2), "{name}: held writes are not answered yet");
        std::thread::sleep(std::time::Duration::from_millis(20));
        answer(std::mem::take(&mut *gate.held.lock().unwrap()));
        let mut tags: Vec<u64> = (0..2).map(|_| rig.rx.recv_timeout(wait).unwrap().tag).collect();
        tags.sort();
        assert_eq!(tags, [1, 2], "{name}");
        let after = rig.dev.stats();
        assert_eq!((after.write_ops, after.in_flight, after.read_ops), (2, 0, 1), "{name}: counted once answered");
        assert!(after.write_latency.p50 >= 20_000, "{name}: the time held is latency: {:?}", after.write_latency);
        rig.dev.submit(vec![write(2 << 20, pattern(3, 4096), 4)], &rig.sink);
        let deadline = std::time::Instant::now() + wait;
        while gate.held.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        rig.dev.shutdown().unwrap();
        assert_eq!(rig.rx.recv_timeout(wait).unwrap().tag, 4, "{name}: stopping answers what the gate holds");
    }
}
