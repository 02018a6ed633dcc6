//! Images on Ceph RBD, against a real single-node cluster (scripts/cephrig:
//! one monitor, one memstore OSD, pool "rbd"), started once for this test
//! binary in a temporary directory on its own monitor port and stopped when
//! the binary exits. The real binary is driven with real clients (qemu-io,
//! nbdcopy, nbdsh, fio, the kernel through FUSE) and checked against the
//! cluster's own tool (`rbd export`, `rbd import`).
//!
//! Needs the Ceph daemons and librbd (scripts/install-test-deps.sh installs
//! them); the FUSE test needs root, as CI has.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use common::{assert_same, output, qemu_io, read_file, run, text, vdisk, vdisk_bounded, Server, TempDir, MIB};

/// The running cluster: its directory and configuration file.
struct Cluster {
    dir: PathBuf,
    conf: String,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
/// Tests take it shared; the one that stops the OSD takes it alone.
static OSD: RwLock<()> = RwLock::new(());

fn rig() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cephrig/ceph-micro.sh")
}

extern "C" fn stop_cluster() {
    if let Some(c) = CLUSTER.get() {
        let _ = Command::new("bash").arg(rig()).arg("stop").arg(&c.dir).status();
        // A daemon that was still exiting may have left a pid file behind the script's rm.
        let _ = std::fs::remove_dir_all(&c.dir);
    }
}

/// Starts the cluster the first time (about 10 s), then hands it out.
fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(|| {
        let pid = std::process::id();
        // Now and then the OSD of a fresh cluster fails to register on a busy machine
        // (its log: "wrong fsid"); a fresh directory and port a moment later works.
        let mut last = None;
        let mut dir = PathBuf::new();
        for attempt in 0..4u32 {
            dir = std::env::temp_dir().join(format!("vdisk-ceph-{pid}-{attempt}"));
            let port = (20000 + (pid + attempt * 7919) % 20000).to_string();
            let out = Command::new("bash")
                .arg("-x")
                .arg(rig())
                .arg("start")
                .arg(&dir)
                .env("CEPH_PORT", &port)
                .env("CEPH_MEM_BYTES", (1u64 << 30).to_string())
                .output()
                .expect("run scripts/cephrig/ceph-micro.sh");
            if out.status.success() {
                last = None;
                break;
            }
            let osd_log = std::fs::read_to_string(dir.join("log/osd.0.log")).unwrap_or_default();
            let why: Vec<&str> = osd_log.lines().filter(|l| l.contains(" -1 ")).take(3).collect();
            eprintln!("ceph rig attempt {attempt} failed ({}): {}", out.status, why.join(" | "));
            let _ = Command::new("bash").arg(rig()).arg("stop").arg(&dir).status();
            let _ = std::fs::remove_dir_all(&dir);
            last = Some(out);
            std::thread::sleep(Duration::from_secs(3));
        }
        if let Some(out) = last {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(15).collect();
            panic!(
                "the Ceph test cluster did not start (scripts/install-test-deps.sh installs it): {}\n{}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        // SAFETY: registers a plain function that takes no arguments; it runs at exit.
        unsafe { libc::atexit(stop_cluster) };
        Cluster { conf: dir.join("ceph.conf").display().to_string(), dir }
    })
}

/// The cluster, held shared against the OSD stall test.
fn shared() -> (&'static Cluster, RwLockReadGuard<'static, ()>) {
    let c = cluster();
    (c, OSD.read().unwrap_or_else(|e| e.into_inner()))
}

/// A fresh image name.
fn name(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{tag}{}", N.fetch_add(1, Ordering::Relaxed))
}

/// `rbd ARGS` against the test cluster, asserting success.
fn rbd(c: &Cluster, args: &[&str]) -> String {
    let out = common::bounded(Command::new("rbd").args(args).env("CEPH_CONF", &c.conf), Duration::from_secs(120));
    assert!(out.status.success(), "rbd {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The image's bytes as `rbd export` gives them.
fn export(c: &Cluster, dir: &TempDir, image: &str) -> Vec<u8> {
    let to = dir.path(&format!("{}.export", image.replace(['/', '@'], "_")));
    let _ = std::fs::remove_file(&to);
    rbd(c, &["export", image, to.to_str().unwrap()]);
    read_file(&to)
}

fn create(c: &Cluster, image: &str, size: &str) {
    let spec = format!("rbd:rbd/{image}");
    let out = vdisk(&["create", &spec, "--size", size, "--ceph-conf", &c.conf]);
    assert!(out.status.success(), "vdisk create {spec}: {}", text(&out));
}

fn serve(c: &Cluster, dir: &TempDir, args: &[&str]) -> Server {
    Server::start_env(dir, args, &[("CEPH_CONF", &c.conf)])
}

/// Deterministic bytes that differ at every offset and between seeds.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len).map(|_| common::xorshift(&mut x) as u8).collect()
}

#[test]
fn create_and_info_and_mistakes() {
    let (c, _g) = shared();
    let img = name("info");
    create(c, &img, "64M");
    let spec = format!("rbd:rbd/{img}");
    let out = vdisk(&["info", &spec, "--ceph-conf", &c.conf, "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["format"], "rbd");
    assert_eq!(v["virtual-size"], 64 * MIB as u64);
    // :conf= in the name instead of the flag.
    let out = vdisk(&["info", &format!("{spec}:conf={}", c.conf)]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("64 MiB"), "{}", text(&out));

    let again = vdisk(&["create", &spec, "--size", "1M", "--ceph-conf", &c.conf]);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again));
    assert!(text(&again).contains("already exists"), "{}", text(&again));

    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![format!("rbd:rbd/{img}-missing")], "does not exist in pool"),
        (vec!["rbd:nosuchpool/x".into()], "pool \"nosuchpool\" does not exist"),
        (vec![spec.clone(), "--ceph-conf".into(), "/nonexistent/ceph.conf".into()], "/nonexistent/ceph.conf"),
        (vec![format!("{spec}@nosnap")], "snapshot"),
        (vec!["rbd:justapool".into()], "rbd:POOL/IMAGE"),
    ];
    for (args, want) in cases {
        let mut all = vec!["serve".to_owned()];
        all.extend(args.iter().cloned());
        if !args.iter().any(|a| a == "--ceph-conf") {
            all.extend(["--ceph-conf".to_owned(), c.conf.clone()]);
        }
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = vdisk_bounded(&refs);
        assert_eq!(out.status.code(), Some(2), "{refs:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{refs:?}: wanted {want:?} in {err}");
        assert_eq!(err.trim().lines().count(), 1, "{refs:?}: one line, got {err}");
    }
}

#[test]
fn an_unreachable_cluster_fails_within_30_seconds() {
    let dir = TempDir::new("rbd-unreachable");
    // A monitor address nobody listens on.
    let conf = dir.path("ceph.conf");
    std::fs::write(&conf, "[global]\nmon host = v1:127.0.0.1:9\nauth client required = none\n").unwrap();
    let t = Instant::now();
    let out = vdisk_bounded(&["serve", "rbd:rbd/disk", "--ceph-conf", conf.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to the Ceph cluster") && err.contains("mon host"), "{err}");
}

#[test]
fn what_vdisk_writes_is_what_rbd_export_returns() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-export");
    let img = name("exp");
    create(c, &img, "32M");
    let server = serve(c, &dir, &[&format!("rbd:rbd/{img}")]);
    let uri = server.uri(&img);
    let mut want = vec![0u8; 32 * MIB];
    // 8 MiB of distinct data over 4 connections, in 256 KiB requests.
    let data = pattern(8 * MIB, 1);
    let src = dir.path("src");
    std::fs::write(&src, &data).unwrap();
    run("nbdcopy", &["--connections=4", "--flush", src.to_str().unwrap(), &uri]);
    want[..8 * MIB].copy_from_slice(&data);
    // Small unaligned writes, a FUA write, zeroes (with and without holes), a trim of written data.
    qemu_io(
        &uri,
        &[
            "write -P 0x5a 12345 3000",
            "write -f -P 0x77 10M 64k",
            "write -z 1M 128k",
            "write -P 0x11 20M 1M",
            "write -z -u 20M 512k",
            "flush",
        ],
    );
    want[12345..12345 + 3000].fill(0x5a);
    want[10 * MIB..10 * MIB + 64 * 1024].fill(0x77);
    want[MIB..MIB + 128 * 1024].fill(0);
    want[20 * MIB..21 * MIB].fill(0x11);
    want[20 * MIB..20 * MIB + 512 * 1024].fill(0);
    assert_same("rbd export after writes through vdisk", &export(c, &dir, &format!("rbd/{img}")), &want);
    // And read back through vdisk the same.
    let back = dir.path("back");
    run("nbdcopy", &[&uri, back.to_str().unwrap()]);
    assert_same("read back through vdisk", &read_file(&back), &want);
    // Block status from the object map (whole 4 MiB objects): written objects are data,
    // the never-written last two are a hole.
    let map = run("nbdinfo", &["--map", &uri]);
    let covering = |at: u64| {
        map.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| {
                f.len() >= 4 && {
                    let (o, n): (u64, u64) = (f[0].parse().unwrap(), f[1].parse().unwrap());
                    o <= at && at < o + n
                }
            })
            .map(|f| f[3..].join(" "))
            .unwrap_or_default()
    };
    assert!(covering(0).contains("data"), "offset 0 is data:\n{map}");
    assert!(covering(26 * MIB as u64).contains("hole"), "offset 26M is a hole:\n{map}");
    server.stop();
    // A clean stop closes the image: no watcher and no exclusive lock left for the next client to wait out.
    let status = rbd(c, &["status", &format!("rbd/{img}")]);
    assert!(status.contains("none"), "a watcher is left after vdisk stopped:\n{status}");
    let locks = rbd(c, &["lock", "ls", &format!("rbd/{img}")]);
    assert!(!locks.contains("exclusive lock"), "the exclusive lock is left after vdisk stopped:\n{locks}");
}

#[test]
fn what_rbd_import_put_in_reads_the_same_and_snapshots_are_read_only() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-import");
    let img = name("imp");
    let data = pattern(16 * MIB + 4096, 2);
    let src = dir.path("src.img");
    std::fs::write(&src, &data).unwrap();
    rbd(c, &["import", src.to_str().unwrap(), &format!("rbd/{img}")]);
    rbd(c, &["snap", "create", &format!("rbd/{img}@s1")]);
    let server = serve(c, &dir, &[&format!("rbd:rbd/{img}"), &format!("rbd:rbd/{img}@s1")]);
    let back = dir.path("back");
    run("nbdcopy", &[&server.uri(&img), back.to_str().unwrap()]);
    assert_same("rbd import read through vdisk", &read_file(&back), &data);
    // The image changes; the snapshot keeps the imported data and refuses writes.
    qemu_io(&server.uri(&img), &["write -P 0x33 0 1M", "flush"]);
    let snap = format!("{img}@s1");
    let out = output("qemu-io", &["-f", "raw", &server.uri(&snap), "-c", "write -P 1 0 4k"]);
    assert!(text(&out).to_lowercase().contains("failed") || !out.status.success(), "{}", text(&out));
    let snap_back = dir.path("snap");
    run("nbdcopy", &[&server.uri(&snap), snap_back.to_str().unwrap()]);
    assert_same("snapshot through vdisk", &read_file(&snap_back), &data);
    assert!(server.stdout.iter().any(|l| l.contains("@s1") && l.contains("read-only")), "{:?}", server.stdout);
    server.stop();
}

#[test]
fn fio_verify_over_nbd() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-fio");
    let img = name("fio");
    create(c, &img, "64M");
    let server = serve(c, &dir, &[&format!("rbd:rbd/{img}")]);
    let uri = server.uri(&img);
    let out = output(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--bsrange=4k-64k",
            "--iodepth=16",
            "--size=32M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No verify state file left in the working directory.
            "--verify_state_save=0",
        ],
    );
    assert!(out.status.success(), "fio verify: {}", text(&out));
    assert!(!text(&out).contains("verify: bad"), "{}", text(&out));
    server.stop();
}

#[test]
fn sigkill_loses_nothing_acknowledged_before_a_flush() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-kill");
    let img = name("kill");
    create(c, &img, "16M");
    // librbd's cache in writeback mode holding dirty data for a minute: only the FLUSH
    // makes these writes durable before the SIGKILL.
    let spec = format!("rbd:rbd/{img}:rbd_cache_policy=writeback:rbd_cache_max_dirty_age=60");
    let server = serve(c, &dir, &[&spec]);
    // Many writes in flight at once, then one FLUSH; SIGKILL right after its reply.
    // The first FLUSH turns librbd's cache from writethrough to writeback.
    let script = "
import os
h.flush()
bufs = []
for i in range(64):
    buf = bytes([i + 1]) * 65536
    h.aio_pwrite(buf, i * 131072)
    bufs.append(buf)
while h.aio_in_flight() > 0:
    h.poll(-1)
h.flush()
print('flushed')
";
    let out = common::nbdsh(&server.uri(&img), script);
    assert!(out.contains("flushed"));
    let st = server.stop_with(libc::SIGKILL);
    assert!(!st.success());
    let got = export(c, &dir, &format!("rbd/{img}"));
    for i in 0..64usize {
        let at = i * 131072;
        assert!(got[at..at + 65536].iter().all(|&b| b == i as u8 + 1), "write {i} at {at} lost after SIGKILL");
    }
}

#[test]
fn the_fuse_export_of_an_rbd_image() {
    // SAFETY: geteuid only returns a number.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the FUSE test mounts a file system and needs root");
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-fuse");
    let img = name("fuse");
    create(c, &img, "16M");
    let file = dir.path("disk.raw");
    let server = serve(c, &dir, &[&format!("rbd:rbd/{img}"), "--fuse", file.to_str().unwrap()]);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 16 * MIB as u64);
    let data = pattern(MIB + 777, 3);
    f.write_all_at(&data, 3 * MIB as u64 + 5).unwrap();
    f.sync_all().unwrap();
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 3 * MIB as u64 + 5).unwrap();
    assert_same("read back through FUSE", &back, &data);
    drop(f);
    let got = export(c, &dir, &format!("rbd/{img}"));
    assert_same("rbd export after FUSE writes", &got[3 * MIB + 5..3 * MIB + 5 + data.len()], &data);
    server.stop();
}

/// The stopped OSD of the cluster: SIGCONT when dropped, also when a test
/// fails, and then waits until the cluster answers again, so the tests after
/// it start on a working cluster (or the log says why not).
struct Stopped(&'static Cluster, i32);

impl Stopped {
    fn osd(c: &'static Cluster) -> Stopped {
        let pid: i32 = std::fs::read_to_string(c.dir.join("run/osd.0.pid")).unwrap().trim().parse().unwrap();
        // SAFETY: kill only reads its integer arguments.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        Stopped(c, pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: kill only reads its integer arguments.
        unsafe { libc::kill(self.1, libc::SIGCONT) };
        let ask = |args: &[&str]| {
            let mut cmd = Command::new("timeout");
            cmd.arg("15").args(args).env("CEPH_CONF", &self.0.conf);
            common::bounded(&mut cmd, Duration::from_secs(30))
        };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(90) {
            if ask(&["rbd", "ls", "rbd"]).status.success() {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        let tail = |log: &str| {
            let all = std::fs::read_to_string(self.0.dir.join("log").join(log)).unwrap_or_default();
            all.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        eprintln!(
            "the Ceph cluster does not answer 90 s after its OSD was continued; ceph -s:\n{}\nosd.0.log:\n{}\nmon.a.log:\n{}",
            text(&ask(&["ceph", "-s"])),
            tail("osd.0.log"),
            tail("mon.a.log")
        );
    }
}

#[test]
fn an_osd_stopped_for_10_seconds_delays_rbd_requests_and_nothing_else() {
    let c = cluster();
    let _alone = OSD.write().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("rbd-stall");
    let img = name("stall");
    create(c, &img, "16M");
    let local = dir.path("local.img");
    common::create_image(&local, "16M");
    let server = serve(c, &dir, &[&format!("rbd:rbd/{img}"), local.to_str().unwrap()]);
    let (rbd_uri, local_uri) = (server.uri(&img), server.uri("local"));
    qemu_io(&rbd_uri, &["write -P 0x21 0 1M", "flush"]);

    let stopped = Stopped::osd(c);
    let t0 = Instant::now();
    let writer = {
        let uri = rbd_uri.clone();
        std::thread::spawn(move || {
            qemu_io(&uri, &["write -P 0x42 1M 4M", "read -P 0x21 0 1M", "flush"]);
            Instant::now()
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    // The other export goes on as if nothing happened.
    for round in 0..3 {
        let t = Instant::now();
        qemu_io(&local_uri, &[format!("write -P {} 0 1M", round + 1), format!("read -P {} 0 1M", round + 1)]);
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the file export took {:?} while the OSD was stopped",
            t.elapsed()
        );
    }
    assert!(!writer.is_finished(), "RBD requests completed while the OSD was stopped");
    std::thread::sleep(Duration::from_secs(10).saturating_sub(t0.elapsed()));
    let resumed = Instant::now();
    drop(stopped);
    // The waiting requests finish once the OSD is back.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !writer.is_finished() {
        assert!(Instant::now() < deadline, "RBD requests did not resume within 60 s of the OSD's return");
        std::thread::sleep(Duration::from_millis(50));
    }
    let done = writer.join().expect("the writer's qemu-io succeeded");
    assert!(done >= resumed - Duration::from_millis(100), "finished before the OSD came back");
    let mut want = vec![0u8; 16 * MIB];
    want[..MIB].fill(0x21);
    want[MIB..5 * MIB].fill(0x42);
    assert_same("rbd export after the stall", &export(c, &dir, &format!("rbd/{img}")), &want);
    server.stop();
}

#[test]
fn a_local_cow_overlay_over_an_rbd_snapshot_round_trips() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-cow");
    let img = name("golden");
    let base = pattern(8 * MIB, 4);
    let src = dir.path("golden.img");
    std::fs::write(&src, &base).unwrap();
    rbd(c, &["import", src.to_str().unwrap(), &format!("rbd/{img}")]);
    rbd(c, &["snap", "create", &format!("rbd/{img}@base")]);
    let snap = format!("rbd:rbd/{img}@base");
    let conf = ["--ceph-conf", c.conf.as_str()];

    // Not a snapshot: refused, the image could change under the overlay.
    let out = vdisk(&[
        "create",
        "--backing",
        &format!("rbd:rbd/{img}"),
        dir.path("bad.cow").to_str().unwrap(),
        conf[0],
        conf[1],
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("snapshot"), "{}", text(&out));

    let (vm1, vm2) = (dir.path("vm1.cow"), dir.path("vm2.cow"));
    for vm in [&vm1, &vm2] {
        let out = vdisk(&["create", "--backing", &snap, vm.to_str().unwrap(), conf[0], conf[1]]);
        assert!(out.status.success(), "{}", text(&out));
    }
    let server = serve(c, &dir, &[vm1.to_str().unwrap(), vm2.to_str().unwrap()]);
    let back = dir.path("vm1.read");
    run("nbdcopy", &[&server.uri("vm1"), back.to_str().unwrap()]);
    assert_same("a new overlay reads as its snapshot", &read_file(&back), &base);
    // Unaligned writes (copy-up of partial sectors from the snapshot), a zeroed range.
    qemu_io(&server.uri("vm1"), &["write -P 0x66 1000 5000", "write -z 4M 64k", "flush"]);
    let mut want = base.clone();
    want[1000..6000].fill(0x66);
    want[4 * MIB..4 * MIB + 65536].fill(0);
    run("nbdcopy", &[&server.uri("vm1"), back.to_str().unwrap()]);
    assert_same("overlay after writes", &read_file(&back), &want);
    // The other overlay and the snapshot itself are untouched.
    run("nbdcopy", &[&server.uri("vm2"), back.to_str().unwrap()]);
    assert_same("the other overlay", &read_file(&back), &base);
    server.stop();
    assert_same("the snapshot", &export(c, &dir, &format!("rbd/{img}@base")), &base);

    // Served again (size checked against the snapshot), and merged into a new raw image.
    let server = serve(c, &dir, &[vm1.to_str().unwrap()]);
    run("nbdcopy", &[&server.uri("vm1"), back.to_str().unwrap()]);
    assert_same("overlay served again", &read_file(&back), &want);
    server.stop();
    let merged = dir.path("merged.img");
    let out = vdisk(&["commit", vm1.to_str().unwrap(), "--into", merged.to_str().unwrap(), conf[0], conf[1]]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("merged image", &read_file(&merged), &want);
    let out = vdisk(&["commit", vm1.to_str().unwrap(), conf[0], conf[1]]);
    assert_eq!(out.status.code(), Some(2), "a snapshot cannot take a commit: {}", text(&out));
}

#[test]
fn opening_while_the_osd_is_down_fails_within_30_seconds() {
    let c = cluster();
    let img = name("down");
    {
        let _g = OSD.read().unwrap_or_else(|e| e.into_inner());
        create(c, &img, "4M");
    }
    let _alone = OSD.write().unwrap_or_else(|e| e.into_inner());
    let _stopped = Stopped::osd(c);
    let t = Instant::now();
    let mut child = Command::new(common::vdisk_bin())
        .args(["serve", &format!("rbd:rbd/{img}"), "--ceph-conf", &c.conf, "--socket", "/nonexistent/x.sock"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("vdisk serve still opening an image after 30 s with the OSD down");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("no answer from the Ceph cluster"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn readonly_and_direct_on_rbd() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-ro");
    let img = name("ro");
    create(c, &img, "4M");
    let spec = format!("rbd:rbd/{img}");
    let out = vdisk_bounded(&["serve", &spec, "--direct", "--ceph-conf", &c.conf]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--direct"), "{}", text(&out));
    let server = serve(c, &dir, &[&spec, "--readonly"]);
    let out = output("qemu-io", &["-f", "raw", &server.uri(&img), "-c", "write -P 1 0 4k"]);
    assert!(text(&out).to_lowercase().contains("failed") || !out.status.success(), "{}", text(&out));
    let out = output("qemu-io", &["-r", "-f", "raw", &server.uri(&img), "-c", "read -P 0 0 4M"]);
    assert!(out.status.success() && !text(&out).contains("failed"), "{}", text(&out));
    server.stop();
}

#[test]
fn a_vm_guest_on_an_rbd_image_over_vhost_user_blk() {
    let vmrig = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vmrig");
    let out = Command::new("bash").arg(vmrig.join("vm-setup.sh")).output().expect("run scripts/vmrig/vm-setup.sh");
    assert!(out.status.success(), "the VM rig could not be set up (scripts/vmrig/vm-setup.sh):\n{}", text(&out));
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-vm");
    let img = name("vm");
    create(c, &img, "128M");
    let socket = dir.path("vub.sock");
    let spec = format!("rbd:rbd/{img}");
    let args = ["serve", &spec, "--ceph-conf", &c.conf, "--vhost-user-blk", socket.to_str().unwrap()];
    let server = Server::spawn(&args, socket.clone());
    // The rig's guest workload: O_DIRECT patterns, odd-offset sectors, discard, mkfs.ext4, files, verify.
    let out = Command::new("bash")
        .arg(vmrig.join("vm-vhost-user-blk.sh"))
        .args(["--timeout", "300", "--mb", "16", "--files", "20"])
        .arg(&socket)
        .output()
        .expect("run vm-vhost-user-blk.sh");
    let all = text(&out);
    assert!(out.status.success(), "guest workload failed:\n{all}");
    for step in ["raw_md5 ok", "small_io ok", "discard ok", "mkfs type=ext4", "fs_verify ok", "VMRIG-RESULT: rc=0"] {
        assert!(all.contains(step), "guest output lacks {step:?}:\n{all}");
    }
    server.stop();
}

#[test]
fn fua_and_sync_writes_survive_sigkill_without_a_flush() {
    let (c, _g) = shared();
    for (tag, extra, flags) in [("fua", None, "nbd.CMD_FLAG_FUA"), ("sync", Some("--sync"), "0")] {
        let dir = TempDir::new(&format!("rbd-{tag}"));
        let img = name(tag);
        create(c, &img, "16M");
        // librbd's cache in writeback mode, keeping dirty data for a minute (Ceph options in
        // the name, as qemu passes them): nothing but a flush makes a write durable, so
        // without the engine's flush after FUA and --sync writes this test fails.
        let spec = format!("rbd:rbd/{img}:rbd_cache_policy=writeback:rbd_cache_max_dirty_age=60");
        let mut args = vec![spec.as_str()];
        args.extend(extra);
        let server = serve(c, &dir, &args);
        // The first FLUSH turns librbd's cache from writethrough to writeback; after it, only
        // FUA (or --sync) makes a write durable before its reply, and no FLUSH follows here.
        let script = format!(
            "
h.pwrite(b'\\x01' * 4096, 0)
h.flush()
for i in range(16):
    h.pwrite(bytes([0x40 + i]) * 65536, 1048576 + i * 65536, {flags})
print('written')
"
        );
        let out = common::nbdsh(&server.uri(&img), &script);
        assert!(out.contains("written"));
        let st = server.stop_with(libc::SIGKILL);
        assert!(!st.success());
        let got = export(c, &dir, &format!("rbd/{img}"));
        for i in 0..16usize {
            let at = MIB + i * 65536;
            assert!(got[at..at + 65536].iter().all(|&b| b == 0x40 + i as u8), "{tag}: write {i} lost after SIGKILL");
        }
    }
}

/// Issue 22, item 4: SIGTERM ends the server within `--stop-timeout` even when
/// an export's storage does not answer. An RBD export with writes in flight
/// and its only OSD stopped, beside a file export with unflushed writes: the
/// process exits within the limit with status 3, the log names the RBD export
/// as not flushed, and the file export was flushed all the same.
#[test]
fn sigterm_with_the_osd_stopped_exits_within_the_stop_timeout() {
    let c = cluster();
    let _alone = OSD.write().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("rbd-wedged-stop");
    let img = name("wedged");
    create(c, &img, "16M");
    let local = dir.path("local.img");
    common::create_image(&local, "16M");
    let socket = dir.path("nbd.sock");
    let log = dir.path("vdisk.log");
    let spec = format!("rbd:rbd/{img}");
    let args = ["serve", &spec, s(&local), "--socket", s(&socket), "--stop-timeout", "5s"];
    let mut child = Command::new(common::vdisk_bin())
        .args(args)
        .env("CEPH_CONF", &c.conf)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let uri = |export: &str| format!("nbd+unix:///{export}?socket={}", socket.display());
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "vdisk never listened: {}", std::fs::read_to_string(&log).unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    qemu_io(&uri(&img), &["write -P 0x21 0 1M", "flush"]);
    // Acknowledged, not flushed: the stop must flush it even though the RBD export cannot be.
    qemu_io(&uri("local"), &["write -P 0x5a 0 2M"]);

    let stopped = Stopped::osd(c);
    // Writes in flight on the RBD export, waiting for the OSD; the client is cut at the stop.
    let writer = {
        let uri = uri(&img);
        std::thread::spawn(move || output("qemu-io", &["-f", "raw", "-c", "write -P 0x42 1M 4M", "-c", "flush", &uri]))
    };
    std::thread::sleep(Duration::from_secs(1));
    assert!(!writer.is_finished(), "RBD writes completed with the OSD stopped");
    let t = Instant::now();
    // SAFETY: kill only reads its integer arguments.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "vdisk still stopping {:?} after SIGTERM with --stop-timeout 5s:\n{}",
                t.elapsed(),
                std::fs::read_to_string(&log).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = t.elapsed();
    let text = std::fs::read_to_string(&log).unwrap();
    eprintln!("stopped in {took:?} with {status}:\n{text}");
    assert_eq!(status.code(), Some(3), "the documented status of a stop that timed out:\n{text}");
    // 5 s, with headroom for a loaded machine; without the bound it never ends.
    assert!(took < Duration::from_secs(12), "the stop took {took:?}");
    assert!(
        text.lines().any(|l| l.contains(&format!("export {img:?}: not stopped")) && l.contains("not flushed")),
        "no log line names the wedged export:\n{text}"
    );
    assert!(text.contains("export \"local\": flushed and stopped"), "{text}");
    assert!(!socket.exists(), "the socket file is left behind");
    drop(stopped);
    let _ = writer.join();
    let mut want = vec![0u8; 16 * MIB];
    want[..2 * MIB].fill(0x5a);
    assert_same("the file export, flushed at the stop", &read_file(&local), &want);
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A panic in an RBD export's delivery (`VDISK_FAULTS=NAME:panic#20`) while
/// fio keeps 32 requests in flight at librbd: the export fails and answers
/// EIO; what librbd still held is collected (its AIO cannot be cancelled)
/// before any of it is answered or freed, which a faults build checks on
/// every answer and every freed buffer (it aborts otherwise); another RBD
/// export of the server goes on serving, and SIGTERM ends the server.
#[test]
fn a_panic_with_requests_in_flight_at_librbd_frees_nothing_librbd_holds() {
    use common::nbd::{Client, CMD_READ};
    use std::os::unix::process::ExitStatusExt;
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-panic");
    let (bad, good) = (name("panicky"), name("beside"));
    create(c, &bad, "64M");
    create(c, &good, "16M");
    let faults = format!("{bad}:panic#20");
    let env = [("CEPH_CONF", c.conf.as_str()), ("VDISK_FAULTS", faults.as_str()), ("RUST_BACKTRACE", "0")];
    let server = Server::start_env(&dir, &[&format!("rbd:rbd/{bad}"), &format!("rbd:rbd/{good}")], &env);
    let uri = server.uri(&bad);
    // fio stops at the first EIO; the bound only keeps a hang from passing.
    let fio = output(
        "timeout",
        &[
            "60",
            "fio",
            "--name=inflight",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--size=32M",
            "--time_based",
            "--runtime=10",
        ],
    );
    assert_ne!(fio.status.code(), Some(124), "fio hung on the failing export: {}", text(&fio));
    assert!(!fio.status.success(), "the injected panic failed fio's export: {}", text(&fio));
    let (mut client, _) = Client::open(&server.socket, &bad);
    assert_eq!(client.call(0, CMD_READ, 0, 4096, &[]).error, 5, "the failed export answers EIO");
    qemu_io(&server.uri(&good), &["write -P 9 0 64k", "flush", "read -P 9 0 64k"]);
    let status = server.stop_with(libc::SIGTERM);
    assert_ne!(status.signal(), Some(libc::SIGABRT), "the server aborted: a buffer freed while librbd held it");
    assert!(status.code().is_some(), "the server exits by itself after SIGTERM: {status}");
}

/// Issue 26, item 1, for RBD: an RBD export's dirty bitmaps live in the
/// image's RBD metadata (`vdisk.bitmaps`). `vdisk ctl bitmap add`, writes by
/// nbdsh, and `nbdinfo --map=qemu:dirty-bitmap:B` shows exactly the granules
/// written; a restart (a clean stop) serves the same bits; after kill -9 the
/// bitmap comes back inconsistent, is not served, and only `remove` is
/// allowed. A snapshot export keeps none and says so.
#[test]
fn rbd_dirty_bitmaps_live_in_the_image_metadata_and_survive_restarts_not_crashes() {
    const G: u64 = 64 << 10;
    const SIZE: u64 = 4 << 20;
    let writes: [(u64, u64); 5] =
        [(0, 4096), (3 * G + 100, 10), (16 * G - 1, 2), (2 << 20, 200 << 10), (SIZE - 512, 512)];
    let mut dirty = vec![false; (SIZE / G) as usize];
    for (o, l) in writes {
        for g in o / G..=(o + l - 1) / G {
            dirty[g as usize] = true;
        }
    }
    let mut want: Vec<(u64, u64)> = Vec::new();
    for (i, d) in dirty.iter().enumerate() {
        let at = i as u64 * G;
        match want.last_mut() {
            Some((o, l)) if *d && *o + *l == at => *l += G,
            _ if *d => want.push((at, G)),
            _ => {}
        }
    }
    let dirty_runs = |uri: &str, b: &str| -> Vec<(u64, u64)> {
        run("nbdinfo", &[&format!("--map=qemu:dirty-bitmap:{b}"), uri])
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[2] == "1").then(|| (f[0].parse().unwrap(), f[1].parse().unwrap()))
            })
            .collect()
    };

    let (c, _g) = shared();
    let dir = TempDir::new("rbd-bitmaps");
    let img = name("bm");
    create(c, &img, "4M");
    rbd(c, &["snap", "create", &format!("rbd/{img}@s")]);
    let spec = format!("rbd:rbd/{img}");
    let control = dir.path("ctl.sock");
    let ctl_ok = |args: &[&str]| common::control::ctl_ok(&control, args);
    let refused = |args: &[&str], what: &str| common::control::ctl_refused(&control, args, what);
    let list = || common::json(&ctl_ok(&["--json", "bitmap", "list", &img]));
    let snap = format!("{img}@s");
    let start = || serve(c, &dir, &[&spec, &format!("{spec}@s"), "--control", s(&control)]);

    let server = start();
    let uri = server.uri(&img);
    ctl_ok(&["bitmap", "add", &img, "b0", "--granularity", "64K"]);
    refused(&["bitmap", "add", &img, "b0"], "already");
    refused(&["bitmap", "add", &snap, "b0"], "RBD snapshot");
    let meta = rbd(c, &["image-meta", "list", &format!("rbd/{img}")]);
    assert!(meta.contains("vdisk.bitmaps"), "the bitmaps are in the image's metadata: {meta}");
    let script: String =
        writes.iter().map(|(o, l)| format!("h.pwrite(b'\\x07' * {l}, {o})\n")).collect::<Vec<_>>().concat();
    common::nbdsh(&uri, &script);
    assert_eq!(dirty_runs(&uri, "b0"), want, "nbdinfo --map=qemu:dirty-bitmap:b0");
    let l = list();
    assert_eq!(l[0]["dirty_bytes"], want.iter().map(|r| r.1).sum::<u64>(), "{l}");
    server.stop();

    // A clean stop kept the bits: served again, consistent.
    let server = start();
    let uri = server.uri(&img);
    let l = list();
    assert_eq!((l.as_array().unwrap().len(), l[0]["inconsistent"].as_bool()), (1, Some(false)), "{l}");
    assert_eq!(dirty_runs(&uri, "b0"), want, "after a restart");
    // Killed while served: the bitmap was marked in use, so it comes back inconsistent.
    let watchers = |st: String| -> Vec<String> {
        st.lines().filter(|l| l.contains("watcher=")).map(|l| l.trim().to_owned()).collect()
    };
    let killed = watchers(rbd(c, &["status", &format!("rbd/{img}")]));
    assert!(!killed.is_empty(), "vdisk keeps a watch on rbd/{img}");
    server.stop_with(libc::SIGKILL);
    // Starts at once: bitmaps found marked in use need no write (the killed client still
    // holds the image's exclusive lock).
    let server = start();
    let uri = server.uri(&img);
    let l = list();
    assert_eq!(l[0]["inconsistent"], true, "{l}");
    let out = output("nbdinfo", &["--map=qemu:dirty-bitmap:b0", &uri]);
    assert!(
        !out.status.success() || text(&out).trim().is_empty(),
        "an inconsistent bitmap was served:\n{}",
        text(&out)
    );
    refused(&["bitmap", "clear", &img, "b0"], "inconsistent");
    // A change is a write: it waits until the OSD drops the killed client's watch
    // (osd_client_watch_timeout, 30 s by default) and librbd may break its lock, as
    // for any RBD client after a crash; waited for here, not in the control request.
    let t0 = Instant::now();
    while watchers(rbd(c, &["status", &format!("rbd/{img}")])).iter().any(|w| killed.contains(w)) {
        assert!(t0.elapsed() < Duration::from_secs(120), "the killed client's watch stays on rbd/{img}");
        std::thread::sleep(Duration::from_millis(500));
    }
    ctl_ok(&["bitmap", "remove", &img, "b0"]);
    assert_eq!(list(), serde_json::json!([]));
    server.stop();
}

/// A large RBD image's bitmap is one large metadata value: a 1 TiB image
/// (thin) with a 64 KiB bitmap keeps 2 MiB of bits, 2.7 MiB in base64. It
/// is saved, survives a clean restart and marks the one write at the end.
/// A damaged value stops the export from starting, with the way out.
#[test]
fn a_1_tib_rbd_image_keeps_its_bitmap_through_a_restart() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-bitmaps-big");
    let img = name("bmbig");
    create(c, &img, "1T");
    let spec = format!("rbd:rbd/{img}");
    let control = dir.path("ctl.sock");
    let ctl = |args: &[&str]| common::control::ctl_ok(&control, args);
    let server = serve(c, &dir, &[&spec, "--control", s(&control)]);
    ctl(&["bitmap", "add", &img, "big"]);
    let end: u64 = 1 << 40;
    common::nbdsh(&server.uri(&img), &format!("h.pwrite(b'\\x01' * 512, {})\n", end - 512));
    server.stop();
    let meta = rbd(c, &["image-meta", "get", &format!("rbd/{img}"), "vdisk.bitmaps"]);
    assert!(meta.trim().len() > 2 << 20, "the saved value is {} bytes", meta.trim().len());
    let server = serve(c, &dir, &[&spec, "--control", s(&control)]);
    let l = common::json(&ctl(&["--json", "bitmap", "list", &img]));
    assert_eq!((l[0]["inconsistent"].as_bool(), l[0]["dirty_bytes"].as_u64()), (Some(false), Some(65536)), "{l}");
    let map = common::nbdinfo_map(&server.uri(&img), "qemu:dirty-bitmap:big");
    let dirty: Vec<(u64, u64)> = map.iter().filter(|e| e.2 == 1).map(|e| (e.0, e.1)).collect();
    assert_eq!(dirty, vec![(end - 65536, 65536)], "{map:?}");
    server.stop();
    // A value that is not the format is refused, never half read, and the message says how out.
    rbd(c, &["image-meta", "set", &format!("rbd/{img}"), "vdisk.bitmaps", "Zm9v"]);
    let sock = dir.path("bad.sock");
    let out = vdisk_bounded(&["serve", &spec, "--ceph-conf", &c.conf, "--socket", s(&sock)]);
    assert!(!out.status.success(), "served with a damaged bitmap value:\n{}", text(&out));
    let t = text(&out);
    assert!(t.contains("vdisk.bitmaps") && t.contains("image-meta remove"), "{t}");
}

/// Waits (at most 60 s) until ready mirror `id` has copied everything dirty
/// (done == total, twice the same).
fn mirror_caught_up(control: &Path, id: u64) {
    let last = std::cell::RefCell::new(None);
    common::control::job_until(control, id, |j| {
        assert_eq!(j["state"], "ready", "{j}");
        let before = last.replace(Some(j["done"].clone()));
        let same = j["done"] == j["total"] && before.as_ref() == Some(&j["done"]);
        if !same {
            std::thread::sleep(Duration::from_millis(250));
        }
        same
    });
}

/// The job `vdisk ctl mirror` started: the last in the table.
fn last_job(control: &Path) -> u64 {
    let jobs = common::json(&common::control::ctl_ok(control, &["jobs", "--json"]));
    jobs.as_array().unwrap().last().unwrap()["id"].as_u64().unwrap()
}

/// A file export "disk" of 32 MiB of data made from `seed`, served with a
/// control socket: its directory, file, data, control socket and server.
struct FileExport {
    dir: TempDir,
    disk: PathBuf,
    data: Vec<u8>,
    control: PathBuf,
    server: Server,
}

fn file_export(c: &Cluster, tag: &str, seed: u64) -> FileExport {
    let dir = TempDir::new(tag);
    let disk = dir.path("disk.img");
    let data = common::make_base(&disk, 32 * MIB, seed);
    let control = dir.path("ctl.sock");
    let server = serve(c, &dir, &[s(&disk), "--control", s(&control)]);
    FileExport { dir, disk, data, control, server }
}

/// `vdisk ctl mirror` of a file export to `rbd:rbd/NAME` while fio verifies
/// on the export: the image is made at the export's size; once ready and
/// caught up (fio stopped), a cancel leaves the image holding the disk:
/// `rbd export` reads the export's bytes. A second mirror into that image with `--existing` works; one into
/// an image too small is refused, naming it; the refusals come first.
#[test]
fn mirror_of_a_file_export_to_an_rbd_image_under_fio_verify() {
    let (c, _g) = shared();
    let FileExport { dir, disk, data: _, control, server } = file_export(c, "rbd-mirror-to", 31);
    let uri = server.uri("disk");
    let img = name("mirrorto");
    let to = format!("rbd:rbd/{img}");
    let refused = |args: &[&str], what: &str| {
        let out = common::control::ctl(&control, args);
        assert!(
            !out.status.success() && text(&out).contains(what),
            "vdisk ctl {args:?}: {what:?} not in:\n{}",
            text(&out)
        );
    };
    refused(&["mirror", "disk", "--to", &to, "--format", "qcow2"], "applies to a new file only");
    refused(&["mirror", "disk", "--to", &to, "--existing"], "does not exist");
    let small = name("small");
    create(c, &small, "16M");
    refused(
        &["mirror", "disk", "--to", &format!("rbd:rbd/{small}"), "--existing"],
        &format!("rbd:rbd/{small} is 16777216 bytes, smaller"),
    );
    // Nothing was made by the refusals.
    let ls = rbd(c, &["ls", "rbd"]);
    assert!(!ls.lines().any(|l| l == img), "{ls}");

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fio = common::control::fio_until(dir.0.clone(), uri.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let said = common::control::ctl_ok(&control, &["mirror", "disk", "--to", &to]);
    assert!(said.contains(&to), "{said}");
    let id = last_job(&control);
    let j = common::control::job_until(&control, id, |j| j["state"] != "running");
    assert_eq!(j["state"], "ready", "{j}");
    let info = rbd(c, &["info", &format!("rbd/{img}")]);
    assert!(info.contains("32 MiB"), "{info}");
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed");
    mirror_caught_up(&control, id);
    let view = common::read_export(&dir, &uri, "view.raw");
    common::control::ctl_ok(&control, &["cancel", &id.to_string()]);
    let j = common::control::job_until(&control, id, |j| j["state"] != "ready");
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_same("the RBD target", &export(c, &dir, &format!("rbd/{img}")), &view);
    // Into the same image again: refused without --existing, which writes the zeros too.
    refused(&["mirror", "disk", "--to", &to], "already exists");
    common::nbdsh(&uri, "h.zero(1048576, 0)\nh.pwrite(b'\\x5a' * 65536, 4194304)\n");
    // --wait without --pivot returns once the job is ready.
    common::control::ctl_ok(&control, &["mirror", "disk", "--to", &to, "--existing", "--wait"]);
    let id = last_job(&control);
    assert_eq!(common::control::job(&control, id)["state"], "ready");
    mirror_caught_up(&control, id);
    let view = common::read_export(&dir, &uri, "view2.raw");
    common::control::ctl_ok(&control, &["cancel", &id.to_string()]);
    let j = common::control::job_until(&control, id, |j| j["state"] != "ready");
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_same("the RBD target, again", &export(c, &dir, &format!("rbd/{img}")), &view);
    server.stop();
    assert_same("the export's own file", &read_file(&disk), &view);
}

/// `vdisk ctl mirror --pivot` of a file export to a new RBD image while fio
/// verifies on the export: once ready the export switches to the image (its
/// file engine performs the I/O with librbd's blocking calls), fio goes on
/// verifying through it, and `rbd export` reads what the export serves.
#[test]
fn mirror_of_a_file_export_to_an_rbd_image_with_pivot() {
    let (c, _g) = shared();
    let FileExport { dir, disk, data, control, server } = file_export(c, "rbd-mirror-pivot", 35);
    let uri = server.uri("disk");
    let to = format!("rbd:rbd/{}", name("mirrorpivot"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fio = common::control::fio_until(dir.0.clone(), uri.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let said = common::control::ctl_ok(&control, &["mirror", "disk", "--to", &to, "--pivot", "--wait"]);
    assert!(said.contains("done"), "{said}");
    let list = common::json(&common::control::ctl_ok(&control, &["list", "--json"]));
    assert_eq!((list[0]["image"].as_str(), list[0]["format"].as_str()), (Some(to.as_str()), Some("rbd")), "{list}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed, through the pivot onto RBD");
    qemu_io(&uri, &["write -P 0x4d 5M 64k", "read -P 0x4d 5M 64k"]);
    let view = common::read_export(&dir, &uri, "view.raw");
    server.stop();
    assert_same("the RBD image", &export(c, &dir, &to["rbd:".len()..]), &view);
    assert_eq!(read_file(&disk).len(), data.len(), "the export's old file is left");
}

/// A mirror to RBD cancelled before it is ready removes the image it made;
/// the export serves as before. A target on a cluster that cannot be reached
/// is refused within ~30 s, and the export serves on.
#[test]
fn mirror_to_rbd_cancelled_midway_and_to_a_cluster_that_is_not_there() {
    let (c, _g) = shared();
    let FileExport { dir, data, control, server, .. } = file_export(c, "rbd-mirror-cancel", 33);
    let uri = server.uri("disk");
    let img = name("mirrorcancel");
    let to = format!("rbd:rbd/{img}");
    common::control::ctl_ok(&control, &["mirror", "disk", "--to", &to, "--bps", "2M"]);
    let id = last_job(&control);
    common::control::job_until(&control, id, |j| j["done"].as_u64().unwrap_or(0) > 0);
    common::control::ctl_ok(&control, &["cancel", &id.to_string()]);
    let j = common::control::job_until(&control, id, |j| j["state"] != "running");
    assert_eq!(j["state"], "cancelled", "{j}");
    let ls = rbd(c, &["ls", "rbd"]);
    assert!(!ls.lines().any(|l| l == img), "the partial image is still there: {ls}");
    assert_same("the export after the cancel", &common::read_export(&dir, &uri, "v.raw"), &data);

    // A monitor address nothing listens on.
    let port = common::free_port();
    let bad = dir.path("nowhere.conf");
    std::fs::write(&bad, format!("[global]\nmon host = 127.0.0.1:{port}\n")).unwrap();
    let t0 = Instant::now();
    let out = common::control::ctl(&control, &["mirror", "disk", "--to", &format!("{to}:conf={}", s(&bad))]);
    let took = t0.elapsed();
    let t = text(&out);
    assert!(!out.status.success() && t.contains("Ceph") && t.contains(&to), "{t}");
    assert!(took < Duration::from_secs(45), "the refusal took {took:?}: {t}");
    qemu_io(&uri, &["write -P 0x3c 0 64k", "read -P 0x3c 0 64k"]);
    let list = common::json(&common::control::ctl_ok(&control, &["jobs", "--json"]));
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    server.stop();
}

/// An RBD export mirrored to a file (no pivot: its device cannot be
/// swapped) while fio verifies on it; cancelled once caught up, the file
/// holds the export's bytes. Then to a new RBD image, the same.
#[test]
fn mirror_of_an_rbd_export_to_a_file() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-mirror-from");
    let img = name("mirrorfrom");
    create(c, &img, "32M");
    let spec = format!("rbd:rbd/{img}");
    let control = dir.path("ctl.sock");
    let server = serve(c, &dir, &[&spec, "--control", s(&control)]);
    let uri = server.uri(&img);
    qemu_io(&uri, &["write -P 0x11 0 4M", "write -P 0x22 20M 3M", "flush"]);
    let target = dir.path("copy.raw");
    let out = common::control::ctl(&control, &["mirror", &img, "--to", s(&target), "--pivot"]);
    assert!(!out.status.success() && text(&out).contains("cannot be swapped"), "{}", text(&out));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fio = common::control::fio_until(dir.0.clone(), uri.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    common::control::ctl_ok(&control, &["mirror", &img, "--to", s(&target)]);
    let id = last_job(&control);
    let j = common::control::job_until(&control, id, |j| j["state"] != "running");
    assert_eq!(j["state"], "ready", "{j}");
    stop.store(true, Ordering::SeqCst);
    fio.join().expect("every fio verify passed");
    mirror_caught_up(&control, id);
    let view = common::read_export(&dir, &uri, "view.raw");
    common::control::ctl_ok(&control, &["cancel", &id.to_string()]);
    let j = common::control::job_until(&control, id, |j| j["state"] != "ready");
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_same("the file target", &read_file(&target), &view);
    // And to another RBD image, made by the job.
    let copy = name("mirrorcopy");
    common::control::ctl_ok(&control, &["mirror", &img, "--to", &format!("rbd:rbd/{copy}"), "--wait"]);
    let id = last_job(&control);
    mirror_caught_up(&control, id);
    common::control::ctl_ok(&control, &["cancel", &id.to_string()]);
    let j = common::control::job_until(&control, id, |j| j["state"] != "ready");
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_same("the RBD target", &export(c, &dir, &format!("rbd/{copy}")), &view);
    server.stop();
    assert_same("the RBD image", &export(c, &dir, &format!("rbd/{img}")), &view);
}

/// Issue 25: `vdisk ctl snapshot EXPORT --rbd-snap NAME` makes an RBD
/// snapshot of a live RBD export's image. Acknowledged writes that librbd's
/// cache still held are in it (the export is quiesced and flushed first),
/// the export serves on (fio verify runs across a second snapshot), later
/// writes are not in it (`rbd export IMAGE@SNAP`), and the mistakes are
/// refused with nothing changed.
#[test]
fn a_live_rbd_export_takes_rbd_snapshots() {
    let (c, _g) = shared();
    let dir = TempDir::new("rbd-snap");
    let img = name("livesnap");
    create(c, &img, "16M");
    let local = dir.path("local.img");
    common::create_image(&local, "16M");
    let control = dir.path("ctl.sock");
    let spec = format!("rbd:rbd/{img}:rbd_cache_policy=writeback:rbd_cache_max_dirty_age=60");
    let server = serve(c, &dir, &[&spec, s(&local), "--control", s(&control)]);
    let uri = server.uri(&img);
    let ctl = |args: &[&str]| common::control::ctl(&control, args);
    // After the first flush librbd's cache holds writes back: only the snapshot's own flush saves these.
    qemu_io(&uri, &["write -P 0x10 0 4k", "flush", "write -P 0x11 0 4M"]);
    let out = ctl(&["snapshot", &img, "--rbd-snap", "s1"]);
    assert!(out.status.success(), "{}", text(&out));
    let fio = {
        let (dir, uri) = (dir.0.clone(), uri.clone());
        std::thread::spawn(move || common::fio_randwrite_verify(&dir, &uri, "the RBD export across a snapshot"))
    };
    std::thread::sleep(Duration::from_millis(500));
    let out = ctl(&["snapshot", &img, "--rbd-snap", "s2"]);
    assert!(out.status.success(), "{}", text(&out));
    fio.join().expect("fio verify passed across the snapshot");
    qemu_io(&uri, &["write -P 0x22 0 4M", "flush"]);
    let snaps = rbd(c, &["snap", "ls", &format!("rbd/{img}")]);
    assert!(snaps.contains("s1") && snaps.contains("s2"), "{snaps}");
    let mut want = vec![0u8; 16 * MIB];
    want[..4 * MIB].fill(0x11);
    assert_same("rbd export of @s1", &export(c, &dir, &format!("rbd/{img}@s1")), &want);
    assert!(export(c, &dir, &format!("rbd/{img}"))[..4 * MIB].iter().all(|&b| b == 0x22), "the head moved on");
    // Mistakes: a name taken, a bad name, a file export, both kinds at once.
    for (args, code, what) in [
        (vec!["snapshot", &img, "--rbd-snap", "s1"], 1, "exists"),
        (vec!["snapshot", &img, "--rbd-snap", "a@b"], 1, "cannot name a snapshot"),
        (vec!["snapshot", "local", "--rbd-snap", "s1"], 1, "not an RBD image"),
        (vec!["snapshot", &img, "--rbd-snap", "s3", "--overlay", "/tmp/x.qcow2"], 2, "--overlay"),
    ] {
        let out = ctl(&args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(what), "{args:?}: {what:?} not in {}", text(&out));
    }
    let snaps = rbd(c, &["snap", "ls", &format!("rbd/{img}")]);
    assert!(!snaps.contains("s3") && snaps.lines().count() == 3, "only s1 and s2:\n{snaps}");
    qemu_io(&server.uri("local"), &["write -P 1 0 4k", "read -P 1 0 4k"]);
    server.stop();
}
