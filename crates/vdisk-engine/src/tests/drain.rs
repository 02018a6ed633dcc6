//! Every way out with requests in flight, on every backend (uring on a core
//! of its own, the thread pool), under the `faults` feature: a `delay=MS`
//! rule keeps each read and write with the backend, then the device stops,
//! fails (an injected panic in a delivery while later requests are still
//! out), or its core stops. Each time every request is answered, the
//! device's count of operations whose memory a backend holds (`lent`) is
//! above 0 while they are out and comes back to 0 only once the backend has
//! returned each, and no buffer was ever freed while a backend held it
//! (`faults::violations`, checked on every buffer freed in this process).

use std::time::{Duration, Instant};

use super::failure::faults_env;
use super::*;

const RECV: Duration = Duration::from_secs(10);

fn lent(rig: &Rig) -> usize {
    rig.dev.faults.as_ref().expect("the device has its faults").lent()
}

/// Waits (up to 2 s) until the backend holds the memory of some operation of `rig`.
fn wait_lent(rig: &Rig, name: &str) {
    let t = Instant::now();
    while lent(rig) == 0 {
        assert!(t.elapsed() < Duration::from_secs(2), "{name}: the backend never held a request");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn reads(first: u64, n: u64) -> Vec<Request> {
    (first..first + n).map(|i| Request::new(Op::Read, i * 4096, 4096, i)).collect()
}

fn writes(first: u64, n: u64) -> Vec<Request> {
    (first..first + n).map(|i| write(i * 4096, pattern(i as u8, 4096), i)).collect()
}

fn recv_all(rig: &Rig, n: usize, name: &str) -> Vec<Request> {
    (0..n)
        .map(|i| rig.rx.recv_timeout(RECV).unwrap_or_else(|_| panic!("{name}: completion {i} of {n} never came")))
        .collect()
}

fn backends(prefix: &str) -> Vec<(String, EngineConfig)> {
    vec![
        (format!("{prefix}-uring"), EngineConfig { kind: EngineKind::Uring, ..Default::default() }),
        (format!("{prefix}-threads"), EngineConfig { kind: EngineKind::Threads, workers: 4, ..Default::default() }),
    ]
}

#[test]
fn a_device_stopped_with_requests_in_flight_waits_for_the_backend_to_return_each() {
    faults_env();
    for (name, cfg) in backends("drain-stop") {
        let rig = Rig::new(&name, 1 << 20, false, &cfg);
        rig.dev.submit(writes(0, 16), &rig.sink);
        rig.dev.submit(reads(16, 16), &rig.sink);
        wait_lent(&rig, &name);
        rig.dev.shutdown().unwrap_or_else(|e| panic!("{name}: {}", e.report()));
        assert_eq!(lent(&rig), 0, "{name}: stopped, no backend holds anything of it");
        let done = recv_all(&rig, 32, &name);
        assert!(done.iter().all(|r| r.error.is_none()), "{name}: a stop finishes what is in flight: {done:?}");
        assert_eq!(faults::violations(), 0, "{name}: a buffer was freed while a backend held it");
    }
}

#[test]
fn a_device_failed_with_requests_in_flight_frees_nothing_the_backend_holds() {
    faults_env();
    for (name, cfg) in backends("drain-fail") {
        let rig = Rig::new(&name, 1 << 20, false, &cfg);
        // The first batch's delivery panics while the second is still with the backend.
        rig.dev.submit(writes(0, 8), &rig.sink);
        std::thread::sleep(Duration::from_millis(150));
        rig.dev.submit(reads(8, 8), &rig.sink);
        let done = recv_all(&rig, 16, &name);
        assert!(rig.dev.failure().is_some(), "{name}: the injected panic failed the device");
        let eio = |r: &Request| r.error.as_ref().is_some_and(|e| e.errno() == libc::EIO);
        // Writes a thread delivered before the panic are answered as done; the
        // reads, in flight then, and whatever the panicked delivery held, get EIO.
        assert!(done.iter().all(|r| r.error.is_none() || eio(r)), "{name}: {done:?}");
        assert!(done.iter().filter(|r| r.tag >= 8).all(eio), "{name}: the reads in flight get EIO: {done:?}");
        assert!(done.iter().any(|r| r.tag < 8 && eio(r)), "{name}: the panicked delivery's writes get EIO");
        // Answered, their buffers are freed now: none may still be with the backend.
        drop(done);
        let t = Instant::now();
        while lent(&rig) > 0 {
            assert!(t.elapsed() < Duration::from_secs(3), "{name}: the backend never gave back {}", lent(&rig));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(rig.dev.shutdown().is_err(), "{name}: the stop says the device failed");
        assert_eq!(faults::violations(), 0, "{name}: a buffer was freed while a backend held it");
    }
}

#[test]
fn a_core_stopped_with_requests_in_flight_cancels_and_reaps_them() {
    faults_env();
    let core = Core::new(1);
    let cfg = EngineConfig { kind: EngineKind::Uring, ..Default::default() };
    let rig = Rig::on(&core, "drain-core", 1 << 20, &cfg);
    rig.dev.submit(reads(0, 16), &rig.sink);
    wait_lent(&rig, "drain-core");
    let t = Instant::now();
    core.stop();
    assert!(t.elapsed() < Duration::from_secs(3), "the stop is bounded: {:?}", t.elapsed());
    assert_eq!(lent(&rig), 0, "stopped, the ring holds nothing of the device (cancelled and reaped)");
    let done = recv_all(&rig, 16, "drain-core");
    assert!(done.iter().all(|r| r.error.is_some()), "stopped in flight, each is answered with an error: {done:?}");
    drop(done);
    let later = {
        rig.dev.submit(reads(0, 1), &rig.sink);
        recv_all(&rig, 1, "drain-core")
    };
    assert_eq!(later[0].error.as_ref().map(|e| e.errno()), Some(libc::EIO), "after the stop: EIO");
    let e = rig.dev.shutdown().expect_err("the device failed with its core").report().to_string();
    assert!(e.contains("core stopped"), "{e}");
    assert_eq!(faults::violations(), 0, "a buffer was freed while the ring held it");
    // The core serves new devices again, on a new worker.
    let again = Rig::on(&core, "drain-core-again", 1 << 20, &cfg);
    assert!(again.run(writes(0, 4)).iter().all(|r| r.error.is_none()));
    again.dev.shutdown().unwrap();
}
