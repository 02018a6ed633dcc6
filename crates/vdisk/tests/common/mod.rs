//! Shared harness for the integration tests: start the real `vdisk` binary,
//! wait until it is ready, hand out URIs for real clients, stop it cleanly.
#![allow(dead_code)]

pub mod control;
pub mod fuse;
pub mod logged;
pub mod nbd;

use std::io::{BufRead, BufReader};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

pub fn vdisk_bin() -> &'static str {
    env!("CARGO_BIN_EXE_vdisk")
}

/// A TCP port free right now on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A path as the `&str` a command line takes (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One step of the xorshift64 generator every test's pseudo-random data comes from.
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Pseudo-random data from `seed`, 64 KiB chunk by chunk. `special(i, chunk)`
/// may fill chunk `i` itself (it starts as zeros) and return true: the random
/// bytes then pass over it.
pub fn chunked_data(len: usize, seed: u64, special: impl Fn(usize, &mut [u8]) -> bool) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(64 * KIB).enumerate() {
        if special(i, chunk) {
            continue;
        }
        for b in chunk.iter_mut() {
            *b = (xorshift(&mut x) >> 24) as u8;
        }
    }
    v
}

/// Backing or image data: pseudo-random, with zero stretches (every fifth 64 KiB chunk).
pub fn base_data(len: usize, seed: u64) -> Vec<u8> {
    chunked_data(len, seed, |i, _| i % 5 == 2)
}

/// Writes [`base_data`] to `path` as a base image and returns its data.
pub fn make_base(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let data = base_data(len, seed);
    std::fs::write(path, &data).unwrap();
    data
}

/// Reads a whole export into memory with nbdcopy (4 connections), through
/// the file `name` in `dir`, removed again.
pub fn read_export(dir: &TempDir, uri: &str, name: &str) -> Vec<u8> {
    let out = dir.path(name);
    let _ = std::fs::remove_file(&out);
    run("nbdcopy", &["--connections=4", uri, s(&out)]);
    let data = read_file(&out);
    std::fs::remove_file(&out).unwrap();
    data
}

/// A fresh directory for one test, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        watchdog();
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let base = std::env::var_os("VDISK_TEST_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        let p = base.join(format!("vdisk-it-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `vdisk ARGS` to completion.
pub fn vdisk(args: &[&str]) -> Output {
    bounded(Command::new(vdisk_bin()).args(args), COMMAND_LIMIT)
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = output(cmd, args);
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `nbdinfo --map=CONTEXT URI` as rows of (offset, length, flags).
pub fn nbdinfo_map(uri: &str, context: &str) -> Vec<(u64, u64, u32)> {
    run("nbdinfo", &[&format!("--map={context}"), uri])
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect()
}

/// Creates a sparse image of `size` (e.g. "64M") with `vdisk create`.
pub fn create_image(path: &Path, size: &str) {
    let out = vdisk(&["create", path.to_str().unwrap(), "--size", size]);
    assert!(out.status.success(), "vdisk create: {}", String::from_utf8_lossy(&out.stderr));
}

/// A sparse image of `size` in `dir`, named `name` (export name: its stem),
/// as the path a command line takes.
pub fn image(dir: &TempDir, name: &str, size: &str) -> String {
    let p = dir.path(name);
    create_image(&p, size);
    p.to_str().unwrap().to_owned()
}

/// A new test directory with a sparse raw `disk.img` of `size` in it, served
/// by `vdisk serve IMAGE EXTRA...` (export `disk`): (dir, image, server).
pub fn serve_new_disk(tag: &str, size: &str, extra: &[&str]) -> (TempDir, String, Server) {
    let dir = TempDir::new(tag);
    let img = image(&dir, "disk.img", size);
    let mut args = vec![img.as_str()];
    args.extend_from_slice(extra);
    let server = Server::start(&dir, &args);
    (dir, img, server)
}

/// A running `vdisk serve`.
pub struct Server {
    pub child: Child,
    pub socket: PathBuf,
    pub stdout: Vec<String>,
}

impl Server {
    /// Starts `vdisk serve ARGS --socket DIR/nbd.sock` and waits for "vdisk: ready".
    pub fn start(dir: &TempDir, args: &[&str]) -> Server {
        Self::start_env(dir, args, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_env(dir: &TempDir, args: &[&str], env: &[(&str, &str)]) -> Server {
        let socket = dir.path("nbd.sock");
        let socket_arg = socket.to_str().unwrap().to_owned();
        let mut all: Vec<&str> = vec!["serve"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--socket", &socket_arg]);
        Self::spawn_env(&all, socket, env)
    }

    /// Starts `vdisk ARGS` as given (the caller names the socket) and waits until ready.
    pub fn spawn(args: &[&str], socket: PathBuf) -> Server {
        Self::spawn_env(args, socket, &[])
    }

    fn spawn_env(args: &[&str], socket: PathBuf, env: &[(&str, &str)]) -> Server {
        watchdog();
        let mut child = Command::new(vdisk_bin())
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn vdisk");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let ready = line.trim() == "vdisk: ready";
                    lines.push(line);
                    if ready {
                        break;
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    panic!("vdisk {args:?} did not become ready; it printed: {lines:#?}");
                }
            }
        }
        Server { child, socket, stdout: lines }
    }

    /// `nbd+unix:///EXPORT?socket=PATH`
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    /// Sends `signal` and waits for the exit status.
    pub fn stop_with(mut self, signal: i32) -> std::process::ExitStatus {
        // SAFETY: kill only reads its integer arguments.
        unsafe { libc::kill(self.child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("vdisk did not stop within 30 s of signal {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM; asserts a clean exit and that the socket file is gone.
    pub fn stop(self) {
        let socket = self.socket.clone();
        let st = self.stop_with(libc::SIGTERM);
        assert!(st.success(), "vdisk exited with {st} after SIGTERM");
        assert!(!socket.exists(), "socket {} left behind", socket.display());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sizes, and the engines every client test runs against.
pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;
pub const ENGINES: [&str; 2] = ["uring", "threads"];

/// Runs `cmd ARGS` and returns its output whatever the exit status; a client
/// that cannot be started fails the test.
pub fn output(cmd: &str, args: &[&str]) -> Output {
    bounded(Command::new(cmd).args(args), COMMAND_LIMIT)
}

/// How long one client command may run before the test calls it hung.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(300);

/// Runs `cmd` to its end with stdin closed and its output collected, like
/// `Command::output`, but kills it and fails the test if it has not exited
/// within `limit`: a client stuck on a server that never answers fails its
/// test instead of hanging the whole run.
pub fn bounded(cmd: &mut Command, limit: Duration) -> Output {
    watchdog();
    let what = format!("{:?}", cmd.get_program());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e} (is it installed? .ci/run installs it)"));
    fn drain(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut all = Vec::new();
            let _ = from.read_to_end(&mut all);
            all
        })
    }
    let (out, err) = (drain(child.stdout.take().unwrap()), drain(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} was still running after {limit:?}: killed, the test fails");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// Arms, once per test binary, a watchdog that ends the binary if it runs
/// longer than `VDISK_TEST_BINARY_LIMIT` seconds (default 720; the slowest
/// binary takes about 140 s): it names itself, kills every process the tests
/// started and exits with a failure, so a hang anywhere ends in a report
/// (and `atexit` cleanups such as the Ceph cluster's stop still run) instead
/// of a CI timeout.
pub fn watchdog() {
    static ARMED: Once = Once::new();
    ARMED.call_once(|| {
        let limit = std::env::var("VDISK_TEST_BINARY_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(720);
        let spawned = std::thread::Builder::new().name("test-watchdog".into()).spawn(move || {
            std::thread::sleep(Duration::from_secs(limit));
            let me = std::env::args().next().unwrap_or_default();
            // Straight to fd 2: eprintln! in a thread a test started is captured with that test.
            let _ = writeln!(
                std::io::stderr(),
                "\nWATCHDOG: {me} has run for {limit} s (VDISK_TEST_BINARY_LIMIT): a test hangs (the lines \
                 \"has been running for over 60 seconds\" above name it). Killing the processes it started \
                 and failing."
            );
            kill_descendants();
            std::process::exit(101);
        });
        spawned.expect("start the test watchdog");
    });
}

/// SIGKILLs every descendant of this process (found through /proc).
fn kill_descendants() {
    for _ in 0..3 {
        let mut parent_of = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
            let ppid: Option<i32> =
                stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
            if let Some(ppid) = ppid {
                parent_of.push((pid, ppid));
            }
        }
        let mut family = vec![std::process::id() as i32];
        let mut i = 0;
        while i < family.len() {
            let p = family[i];
            family.extend(parent_of.iter().filter(|&&(_, pp)| pp == p).map(|&(c, _)| c));
            i += 1;
        }
        for &pid in &family[1..] {
            // SAFETY: kill only reads its integer arguments.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

pub fn text(out: &Output) -> String {
    format!(
        "status: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// fio's nbd engine writing 16 MiB of random 4 KiB blocks (QD16) to `uri`,
/// run in `dir`, then reading them back checked (crc32c); asserts no error
/// and that the verify pass ran. `what` names the export in a failure.
pub fn fio_randwrite_verify(dir: &Path, uri: &str, what: &str) {
    let uri = format!("--uri={uri}");
    let args = [
        "--name=verify",
        "--ioengine=nbd",
        &uri,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=16M",
        "--verify=crc32c",
        "--do_verify=1",
    ];
    let out = bounded(Command::new("fio").args(args).current_dir(dir), COMMAND_LIMIT);
    let all = text(&out);
    assert!(out.status.success() && all.contains("err= 0"), "fio on {what} failed:\n{all}");
    assert!(!all.contains("verify: bad") && all.contains("read: IOPS"), "fio on {what} did not verify:\n{all}");
}

/// `qemu-io -f raw URI -c CMD...`, asserting that it succeeds and that no
/// command reports a failure (qemu-io prints "... failed" for both I/O errors
/// and pattern mismatches). Returns stdout.
pub fn qemu_io<S: AsRef<str>>(uri: &str, cmds: &[S]) -> String {
    let mut args = vec!["-f", "raw", uri];
    for c in cmds {
        args.extend_from_slice(&["-c", c.as_ref()]);
    }
    let out = output("qemu-io", &args);
    let all = text(&out);
    assert!(out.status.success(), "qemu-io {args:?} failed:\n{all}");
    assert!(!all.to_lowercase().contains("failed"), "qemu-io {args:?} reported a failure:\n{all}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `nbdsh -u URI -c SCRIPT`, asserting success. nbdsh runs whichever
/// `python3` comes first in PATH; the libnbd bindings belong to the system
/// Python, so /usr/bin goes first (a pyenv python3 would not find them).
pub fn nbdsh(uri: &str, script: &str) -> String {
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = bounded(Command::new("nbdsh").env("PATH", path).args(["-u", uri, "-c", script]), COMMAND_LIMIT);
    assert!(out.status.success(), "nbdsh -u {uri} failed:\n{}\nscript:\n{script}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}):\n{s}"))
}

/// One JSON-RPC request to the control socket `control` on a new connection; the response.
pub fn rpc(control: &Path, method: &str, params: serde_json::Value) -> serde_json::Value {
    use std::io::Write;
    let mut c = std::os::unix::net::UnixStream::connect(control).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    writeln!(c, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line).unwrap();
    json(&line)
}

/// The error message of a response that must be an error.
pub fn refused(v: &serde_json::Value) -> String {
    v["error"]["message"].as_str().unwrap_or_else(|| panic!("not an error: {v}")).to_owned()
}

pub fn read_file(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Asserts that two buffers are equal, naming the first differing offset
/// instead of dumping megabytes.
pub fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length differs");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at offset {i}: got {:#04x}, want {:#04x}", got[i], want[i]);
    }
}

/// Runs `vdisk ARGS`, killing it (and failing) if it has not exited within
/// 20 s: a `serve` that should have refused to start must not hang the test.
pub fn vdisk_bounded(args: &[&str]) -> Output {
    bounded(Command::new(vdisk_bin()).args(args), Duration::from_secs(20))
}

/// Runs `vdisk soak --seconds 0 --json --dir DIR ARGS` with `env`.
pub fn soak(dir: &TempDir, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(vdisk_bin());
    cmd.args(["soak", "--seconds", "0", "--json", "--dir"]).arg(&dir.0).args(args).envs(env.iter().copied());
    bounded(&mut cmd, Duration::from_secs(600))
}

/// Runs the soak's rounds `args` on a build broken on purpose
/// (`VDISK_BREAK=breakage`) and asserts that a round's verdict caught it,
/// saying `verdict`; the round that did.
pub fn caught(breakage: &str, args: &[&str], verdict: &str) -> u64 {
    let dir = TempDir::new(breakage);
    let out = soak(&dir, args, &[("VDISK_BREAK", breakage)]);
    assert!(!out.status.success(), "VDISK_BREAK={breakage} went unnoticed through {args:?}:\n{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("crash round"))
        .unwrap_or_else(|| panic!("VDISK_BREAK={breakage}: failed, but not by a round's verdict:\n{}", text(&out)));
    let round = line.split("crash round ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok());
    let round = round.unwrap_or_else(|| panic!("no round number in {line:?}"));
    assert!(line.contains(verdict), "VDISK_BREAK={breakage}: caught, but not by {verdict:?}: {line}");
    eprintln!("VDISK_BREAK={breakage}: caught in round {round}: {}", &line[..line.len().min(300)]);
    round
}

/// What a passing run of crash rounds did, from its JSON report.
pub struct Rounds {
    pub report: serde_json::Value,
    pub acked: u64,
    pub flushes: u64,
    pub pinned: u64,
}

impl Rounds {
    /// A count of the report's live-operation section ("mirrors", "cuts_mid_job", ...); panics if missing.
    pub fn live(&self, key: &str) -> u64 {
        self.report["crash"]["live"][key].as_u64().unwrap_or_else(|| panic!("no {key} in {}", self.report))
    }
}

/// Runs `rounds` soak crash rounds with `args` and asserts that every round
/// passed its verdict and that the verdicts had teeth: the rounds wrote and
/// flushed, and blocks had to hold one particular generation. (The bounds
/// hold with three such runs at once on two cores; a quiet machine does
/// several times more.)
pub fn crash_rounds(name: &str, rounds: u64, args: &[&str]) -> Rounds {
    let dir = TempDir::new(name);
    let mut all = vec!["--rounds".to_owned(), rounds.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let out = soak(&dir, &all, &[]);
    assert!(out.status.success(), "vdisk soak {args:?} failed:\n{}", text(&out));
    let report = json(&String::from_utf8_lossy(&out.stdout));
    let crash = &report["crash"];
    assert_eq!(crash["rounds"].as_u64(), Some(rounds), "{report}");
    let count = |k: &str| crash[k].as_u64().unwrap_or_else(|| panic!("no {k} in {report}"));
    let (acked, flushes, pinned) = (count("writes_acked"), count("flushes"), count("pinned_blocks"));
    assert!(acked > rounds * 10 && flushes > 0 && pinned > rounds / 2, "too little happened: {report}");
    Rounds { report, acked, flushes, pinned }
}
