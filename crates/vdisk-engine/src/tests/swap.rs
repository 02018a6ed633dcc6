//! Quiesce and swap: requests submitted while a device is quiesced wait, then
//! complete on the new image, in order, nothing lost; every engine configuration.

use std::path::PathBuf;
use std::time::Duration;

use super::*;

#[test]
fn requests_held_by_a_quiesce_complete_on_the_new_image() {
    // On tmpfs too, where the inline path runs everything itself.
    let shm = std::path::Path::new("/dev/shm");
    let bases: Vec<(&str, PathBuf)> =
        [("", std::env::temp_dir())].into_iter().chain(shm.is_dir().then(|| ("shm-", shm.to_owned()))).collect();
    for (name, cfg, (place, base)) in
        configs().into_iter().flat_map(|(n, c)| bases.iter().map(move |b| (n, c.clone(), b)))
    {
        let name = format!("{place}{name}");
        let rig = Rig::new_in(base, &format!("swap-{name}"), 4 << 20, false, &cfg, Format::Raw);
        assert!(rig.run(vec![write(0, pattern(1, 65536), 0)]).iter().all(|r| r.error.is_none()), "{name}");
        let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
        // Queued and inline submissions alike wait in the queue: none completes yet.
        let held = vec![
            write(1 << 20, pattern(2, 65536), 0),
            Request::new(Op::Flush, 0, 0, 1),
            write((1 << 20) + 65536, pattern(3, 4096), 2),
            Request::new(Op::Read, 0, 65536, 3),
        ];
        rig.dev.submit(held, &rig.sink);
        let mut inline_done = Vec::new();
        rig.dev.submit_inline(vec![write(2 << 20, pattern(4, 4096), 4)], &rig.sink, &mut inline_done);
        assert!(inline_done.is_empty(), "{name}: the inline path ran while quiesced");
        assert!(rig.rx.recv_timeout(Duration::from_millis(100)).is_err(), "{name}: a request ran while quiesced");
        guard.flush().unwrap();
        let overlay = rig.dir.join("top.cow");
        let _ = std::fs::remove_file(&overlay);
        CowImage::create(&overlay, &rig.dir.join("disk.img")).unwrap();
        let top = Arc::new(CowImage::open(&overlay, false, None, false).unwrap());
        guard.replace_image(top).unwrap();
        assert_eq!(rig.dev.image().format(), "cow", "{name}");
        drop(guard);
        let mut done: Vec<Request> = (0..5).map(|_| rig.rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        done.sort_by_key(|r| r.tag);
        assert!(
            done.iter().all(|r| r.error.is_none()),
            "{name}: {:?}",
            done.iter().map(|r| &r.error).collect::<Vec<_>>()
        );
        assert_eq!(done[3].buf(), &pattern(1, 65536)[..], "{name}: the old data, read through the new top");
        // Every held write went to the overlay (one batch's requests have no order among them).
        let reads = vec![
            Request::new(Op::Read, 1 << 20, 65536, 0),
            Request::new(Op::Read, 2 << 20, 4096, 1),
            Request::new(Op::Read, (1 << 20) + 65536, 4096, 2),
        ];
        let back = rig.run(reads);
        assert!(back[0].buf() == &pattern(2, 65536)[..], "{name}: held write 0");
        assert!(back[1].buf() == &pattern(4, 4096)[..], "{name}: the inline write");
        assert!(back[2].buf() == &pattern(3, 4096)[..], "{name}: held write 2");
        let base = std::fs::read(rig.dir.join("disk.img")).unwrap();
        assert!(base[..65536] == pattern(1, 65536)[..], "{name}: the write before the quiesce is in the old image");
        assert!(base[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0), "{name}: a held write reached the old image");
        assert!(rig.run_inline(vec![write(3 << 20, pattern(5, 4096), 0)])[0].error.is_none(), "{name}");
        rig.dev.shutdown().unwrap();
    }
}

#[test]
fn a_swap_cannot_change_the_size() {
    let rig = Rig::new("swap-size", 1 << 20, false, &EngineConfig::default());
    let other = rig.dir.join("other.img");
    let _ = std::fs::remove_file(&other);
    RawImage::create(&other, 2 << 20, None).unwrap();
    let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
    let e = guard.replace_image(Arc::new(RawImage::open(&other, false).unwrap())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    drop(guard);
    assert!(rig.run(vec![write(0, pattern(1, 4096), 0)])[0].error.is_none());
    rig.dev.shutdown().unwrap();
}

#[test]
fn a_quiesce_that_cannot_drain_gives_up_in_time_and_changes_nothing() {
    let cfg = EngineConfig { kind: EngineKind::Threads, workers: 1, ..Default::default() };
    let rig = Rig::new("swap-stalled", 1 << 20, false, &cfg);
    let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let path = rig.dev.image().file_path(0).to_owned();
    let image = super::Stalled { inner: RawImage::open(&path, false).unwrap(), gate: gate.clone() };
    let stalled = Device::start("stalled", Arc::new(image), &cfg).unwrap();
    stalled.submit(vec![Request::new(Op::Read, 0, 4096, 0)], &rig.sink);
    // Until its worker has taken the read, a quiesce holds it instead (and succeeds).
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        match stalled.quiesce(Duration::from_millis(200)) {
            Err(e) => break e,
            Ok(guard) if std::time::Instant::now() < give_up => {
                drop(guard);
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(_) => panic!("the stalled read was never taken"),
        }
    };
    assert!(e.to_string().contains("in flight"), "{e}");
    // Released again: a write queued after it runs once the read is let go.
    stalled.submit(vec![write(8192, pattern(1, 4096), 1)], &rig.sink);
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    let done: Vec<Request> = (0..2).map(|_| rig.rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
    assert!(done.iter().all(|r| r.error.is_none()));
    stalled.shutdown().unwrap();
}

#[test]
fn a_job_runs_its_own_requests_while_the_guest_waits() {
    for (name, cfg) in configs() {
        let rig = Rig::new(&format!("swap-exec-{name}"), 1 << 20, false, &cfg);
        let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
        rig.dev.submit(vec![write(0, pattern(2, 4096), 0)], &rig.sink);
        // (Requests of one batch are not ordered: a job's read after its write is a batch of its own.)
        assert!(guard.execute(vec![write(0, pattern(1, 4096), 7)])[0].error.is_none(), "{name}");
        let read = guard.execute(vec![Request::new(Op::Read, 0, 4096, 8)]).remove(0);
        assert!(read.error.is_none(), "{name}");
        assert!(read.buf() == &pattern(1, 4096)[..], "{name}: the job's write, before the held one");
        drop(guard);
        assert!(rig.rx.recv_timeout(Duration::from_secs(10)).unwrap().error.is_none());
        let back = rig.run(vec![Request::new(Op::Read, 0, 4096, 0)]);
        assert!(back[0].buf() == &pattern(2, 4096)[..], "{name}: the held write, after the job's");
        rig.dev.shutdown().unwrap();
    }
}

/// A disk in memory reached by blocking calls only (as an NBD export is).
#[derive(Clone, Default)]
struct MemTarget {
    bytes: Arc<std::sync::Mutex<Vec<u8>>>,
    syncs: Arc<std::sync::atomic::AtomicUsize>,
}

impl vdisk_image::BlockTarget for MemTarget {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let b = self.bytes.lock().unwrap();
        buf.copy_from_slice(&b[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.bytes.lock().unwrap()[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.bytes.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }

    fn sync(&self) -> std::io::Result<()> {
        self.syncs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// A file device swapped onto an image whose target is not a file (a
/// mirror's pivot onto NBD or RBD) serves it on every engine with the
/// target's blocking calls: reads, writes (inline submissions too), FUA,
/// WRITE_ZEROES, TRIM and FLUSH reach it.
#[test]
fn a_device_swapped_onto_a_blocking_target_serves_it() {
    for (name, cfg) in configs() {
        let rig = Rig::new(&format!("swap-blocking-{name}"), 4 << 20, false, &cfg);
        let mem = MemTarget::default();
        *mem.bytes.lock().unwrap() = pattern(9, 4 << 20);
        let image = vdisk_image::RemoteImage::new("mem://disk", 4 << 20, false, "mem", Box::new(mem.clone()));
        let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
        guard.replace_image(Arc::new(image)).unwrap();
        drop(guard);
        let zero = Op::WriteZeroes { fua: false, no_hole: false, fast_zero: false };
        let done = rig.run(vec![
            write(0, pattern(1, 8192), 0),
            fua_write(1 << 20, pattern(2, 4096), 1, true),
            Request::new(zero, 2 << 20, 65536, 2),
            Request::new(Op::Trim { fua: false }, 3 << 20, 65536, 3),
        ]);
        assert!(
            done.iter().all(|r| r.error.is_none()),
            "{name}: {:?}",
            done.iter().map(|r| &r.error).collect::<Vec<_>>()
        );
        rig.run_inline(vec![write(8192, pattern(3, 4096), 4)]);
        let syncs = mem.syncs.load(std::sync::atomic::Ordering::SeqCst);
        assert!(syncs >= 1, "{name}: the FUA write synced the target");
        assert!(rig.run(vec![Request::new(Op::Flush, 0, 0, 5)])[0].error.is_none(), "{name}");
        assert!(mem.syncs.load(std::sync::atomic::Ordering::SeqCst) > syncs, "{name}: a FLUSH syncs the target");
        let back = rig.run(vec![Request::new(Op::Read, 0, 12288, 6), Request::new(Op::Read, 2 << 20, 4096, 7)]);
        let mut want = pattern(1, 8192);
        want.extend(pattern(3, 4096));
        assert!(back[0].buf() == &want[..], "{name}: reads come from the target");
        assert!(back[1].buf().iter().all(|&b| b == 0), "{name}: zeroed on the target");
        let b = mem.bytes.lock().unwrap().clone();
        assert!(b[1 << 20..(1 << 20) + 4096] == pattern(2, 4096)[..], "{name}");
        assert!(b[3 << 20..(3 << 20) + 65536].iter().all(|&x| x == 0), "{name}: trimmed on the target");
        rig.dev.shutdown().unwrap();
    }
}
