//! Many devices on one core worker: they all serve, a flooding device does
//! not starve a QD1 one, devices come and go while others run, and a
//! failure of one (a panic in its delivery) leaves the others on the same
//! ring serving. Each test runs on a core of its own with one worker, so
//! every device in it shares one ring. Thread-engine devices share the
//! process-wide pool, a stalled one holding at most half of it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::*;

const RECV: Duration = Duration::from_secs(20);

fn uring() -> EngineConfig {
    EngineConfig { kind: EngineKind::Uring, ..Default::default() }
}

fn recv(rig: &Rig, what: &str) -> Request {
    rig.rx.recv_timeout(RECV).unwrap_or_else(|_| panic!("{what}: a completion never came"))
}

/// Writes a block of its own to every device at once, then reads each back.
fn each_reads_back_its_own(rigs: &[Rig]) {
    for (i, rig) in rigs.iter().enumerate() {
        rig.dev.submit(vec![write(4096, pattern(i as u8, 4096), 1)], &rig.sink);
    }
    for rig in rigs {
        assert!(recv(rig, "write").error.is_none());
    }
    for (i, rig) in rigs.iter().enumerate() {
        let back = rig.run(vec![Request::new(Op::Read, 4096, 4096, 1)]);
        assert_eq!(back[0].buf(), pattern(i as u8, 4096), "device {i}");
    }
}

#[test]
fn a_hundred_devices_share_one_worker_and_each_reads_back_its_own() {
    let core = Core::new(1);
    let rigs: Vec<Rig> = (0..100).map(|i| Rig::on(&core, &format!("many-{i}"), 64 << 10, &uring())).collect();
    assert_eq!(core.loads(), vec![100], "one worker serves them all");
    each_reads_back_its_own(&rigs);
    for rig in &rigs {
        rig.dev.shutdown().unwrap();
    }
    assert_eq!(core.loads(), vec![0], "every device let go of its worker");
}

#[test]
fn a_qd1_reader_keeps_flowing_beside_a_qd128_writer_on_the_same_ring() {
    let core = Core::new(1);
    let flood = Rig::on(&core, "flood", 8 << 20, &uring());
    let quiet = Rig::on(&core, "quiet", 1 << 20, &uring());
    let (stop, flooded) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let writer = {
        let (stop, flooded) = (stop.clone(), flooded.clone());
        std::thread::spawn(move || {
            // 128 writes in flight at all times: one more for each one done.
            let batch: Vec<Request> = (0..128).map(|i| write(i * 65536, vec![7; 65536], i)).collect();
            flood.dev.submit(batch, &flood.sink);
            let mut tag = 128;
            while !stop.load(Ordering::Relaxed) {
                let done = recv(&flood, "flood");
                assert!(done.error.is_none());
                flooded.fetch_add(1, Ordering::Relaxed);
                flood.dev.submit(vec![write((tag % 128) * 65536, vec![7; 65536], tag)], &flood.sink);
                tag += 1;
            }
            for _ in 0..128 {
                recv(&flood, "flood drain");
            }
            flood
        })
    };
    while flooded.load(Ordering::Relaxed) < 256 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = flooded.load(Ordering::Relaxed);
    // Every read of the quiet device is answered while the flood goes on.
    for i in 0..200 {
        let r = quiet.run(vec![Request::new(Op::Read, (i % 256) * 4096, 4096, i)]);
        assert!(r[0].error.is_none());
    }
    let during = flooded.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    let flood = writer.join().unwrap();
    assert!(during > 0, "the flood ran while the reader read");
    quiet.dev.shutdown().unwrap();
    flood.dev.shutdown().unwrap();
}

#[test]
fn devices_come_and_go_while_another_serves_on_the_same_ring() {
    let core = Core::new(1);
    let steady = Rig::on(&core, "steady", 1 << 20, &uring());
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut round = 0u8;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<Request> = (0..16).map(|i| write(i * 4096, pattern(round, 4096), i)).collect();
                assert!(steady.run(batch).iter().all(|r| r.error.is_none()));
                let back = steady.run((0..16).map(|i| Request::new(Op::Read, i * 4096, 4096, i)).collect());
                assert!(back.iter().all(|r| r.buf() == pattern(round, 4096)), "round {round}");
                round = round.wrapping_add(1);
            }
            (round, steady)
        })
    };
    for i in 0..60 {
        let rig = Rig::on(&core, &format!("comer-{i}"), 64 << 10, &uring());
        // Some leave with requests still queued or in flight: those are answered first.
        rig.dev.submit((0..8).map(|j| write(j * 4096, vec![i as u8; 4096], j)).collect(), &rig.sink);
        rig.dev.shutdown().unwrap();
        assert_eq!(rig.rx.try_iter().count(), 8, "device {i}: everything answered by the stop");
    }
    stop.store(true, Ordering::Relaxed);
    let (rounds, steady) = runner.join().unwrap();
    assert!(rounds > 0);
    assert_eq!(core.loads(), vec![1], "only the steady device is left");
    steady.dev.shutdown().unwrap();
}

/// Holds the last owner of a device and drops it when its completions come
/// (on the core worker), as an export's connection state may.
struct LastOwner(Mutex<Option<Arc<Device>>>, Mutex<mpsc::Sender<usize>>);

impl Sink for LastOwner {
    fn complete(&self, done: Vec<Request>) {
        drop(self.0.lock().unwrap().take());
        self.1.lock().unwrap().send(done.len()).unwrap();
    }
}

/// Submits many writes to `doomed`'s device with a sink that holds the
/// device's last owner and drops it on its first completion (so on the thread
/// that serves it, while that thread is still at the writes), then waits for
/// every completion.
fn leave_the_last_owner_to_its_sink(doomed: Rig) {
    let (tx, rx) = mpsc::channel();
    let owner = Arc::new(LastOwner(Mutex::new(Some(doomed.dev.clone())), Mutex::new(tx)));
    let dev = doomed.dev.clone();
    drop(doomed);
    let sink: Arc<dyn Sink> = owner.clone();
    dev.submit((0..256).map(|i| write(i * 4096, vec![1; 4096], i)).collect(), &sink);
    drop(dev);
    let mut n = 0;
    while n < 256 {
        n += rx.recv_timeout(RECV).expect("every completion came");
    }
}

#[test]
fn a_device_whose_last_owner_is_dropped_on_its_worker_does_not_wedge_it() {
    let core = Core::new(1);
    let other = Rig::on(&core, "owner-other", 1 << 20, &uring());
    let doomed = Rig::on(&core, "owner-doomed", 1 << 20, &uring());
    leave_the_last_owner_to_its_sink(doomed);
    // The worker dropped the device's last owner and goes on serving the other.
    assert!(other.run(vec![write(0, vec![2; 4096], 1)])[0].error.is_none());
    let deadline = std::time::Instant::now() + RECV;
    while core.loads() != vec![1] && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(core.loads(), vec![1], "the dropped device let go of the worker");
    other.dev.shutdown().unwrap();
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_owned())
        .collect()
}

#[test]
fn thread_engine_devices_share_the_pool_and_a_stalled_one_holds_at_most_its_cap() {
    let threads = EngineConfig { kind: EngineKind::Threads, ..Default::default() };
    let rigs: Vec<Rig> = (0..100).map(|i| Rig::new(&format!("tp-{i}"), 64 << 10, false, &threads)).collect();
    each_reads_back_its_own(&rigs);
    let names = thread_names();
    let size = crate::pool::global().size();
    let pooled = names.iter().filter(|n| n.starts_with("vdisk-pool")).count();
    assert!(pooled <= size, "{pooled} pool threads, more than the pool's {size}");
    assert!(!names.iter().any(|n| n.starts_with("tp-")), "a device has threads of its own: {names:?}");

    // A device asking for more workers than the pool has still holds at most half of it.
    let stalled_rig = Rig::new("tp-stalled", 1 << 20, false, &threads);
    let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let path = stalled_rig.dev.image().file_path(0).to_owned();
    let image = Stalled { inner: RawImage::open(&path, false).unwrap(), gate: gate.clone() };
    let greedy = EngineConfig { workers: 1024, batch: 1, ..threads.clone() };
    let stalled = Device::start("tp-stalled", Arc::new(image), &greedy).unwrap();
    let reads: Vec<Request> = (0..256).map(|i| Request::new(Op::Read, i * 4096, 4096, i)).collect();
    stalled.submit(reads, &stalled_rig.sink);
    std::thread::sleep(Duration::from_millis(100));
    for (i, rig) in rigs.iter().enumerate() {
        let back = rig.run(vec![Request::new(Op::Read, 4096, 4096, 1)]);
        assert_eq!(back[0].buf(), pattern(i as u8, 4096), "device {i} beside the stalled one");
    }
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    for _ in 0..256 {
        assert!(stalled_rig.rx.recv_timeout(RECV).unwrap().error.is_none());
    }
    stalled.shutdown().unwrap();
    for rig in &rigs {
        rig.dev.shutdown().unwrap();
    }
}

#[test]
fn a_thread_device_whose_last_owner_is_dropped_on_a_pool_thread_does_not_wedge_it() {
    let threads = EngineConfig { kind: EngineKind::Threads, workers: 1, ..Default::default() };
    let other = Rig::new("tp-owner-other", 1 << 20, false, &threads);
    let doomed = Rig::new("tp-owner-doomed", 1 << 20, false, &threads);
    leave_the_last_owner_to_its_sink(doomed);
    // The pool thread dropped the device's last owner and the pool goes on serving.
    for i in 0..20 {
        assert!(other.run(vec![write(0, vec![i; 4096], 1)])[0].error.is_none());
    }
    other.dev.shutdown().unwrap();
}
