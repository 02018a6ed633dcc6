//! The control socket as its own authority (issue 27): its mode and group are
//! its own (never --socket-mode), only the owner, root and the control group
//! may change exports, what it adds must lie beneath --image-root, and no
//! request (a FIFO, a socket, a character device) wedges it. Driven against
//! the real binary, with `vdisk ctl` run as `nobody` through setpriv, and the
//! served image read back with qemu-io.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A group id no user of the test machine has (the control group of these tests).
const GROUP: u32 = 54_321;

/// A test directory others may traverse (so only the socket's own mode keeps them out).
fn open_dir(tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// `vdisk serve --control DIR/ctl.sock --socket DIR/nbd.sock EXTRA...`.
fn serve(dir: &TempDir, extra: &[&str]) -> (Server, PathBuf) {
    let control = dir.path("ctl.sock");
    let socket = dir.path("nbd.sock");
    let mut args = vec!["serve", "--control", s(&control), "--socket", s(&socket)];
    args.extend_from_slice(extra);
    (Server::spawn(&args, socket.clone()), control)
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// `vdisk ctl --control PATH ARGS` run as `nobody`, with `groups` as its only groups.
fn ctl_as_nobody(control: &Path, groups: Option<u32>, args: &[&str]) -> Output {
    let groups = match groups {
        Some(g) => format!("--groups={g}"),
        None => "--clear-groups".into(),
    };
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=nobody", "--regid=nogroup", &groups, vdisk_bin(), "ctl", "--control", s(control)]);
    cmd.args(args).output().expect("run setpriv (util-linux)")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_control_socket_has_its_own_mode_and_only_owner_and_group_change_things() {
    let dir = open_dir("ctl-authority");
    let root = dir.path("root");
    std::fs::create_dir(&root).unwrap();
    create_image(&root.join("in.img"), "4M");

    // --socket-mode opens the NBD socket to everyone, never the control socket.
    let (server, control) = serve(&dir, &["--socket-mode", "0666"]);
    assert_eq!(mode(&dir.path("nbd.sock")), 0o666);
    assert_eq!(mode(&control), 0o600, "--socket-mode must not apply to the control socket");
    let out = ctl_as_nobody(&control, None, &["list"]);
    assert_eq!(out.status.code(), Some(1), "nobody reached a 0600 control socket: {}", text(&out));
    assert!(stderr(&out).contains("Permission denied"), "{}", text(&out));
    server.stop();

    // A socket others can reach needs image roots, or the server refuses to start.
    let nbd = dir.path("nbd.sock");
    let args = ["serve", "--control", s(&control), "--socket", s(&nbd), "--control-mode", "0660"];
    let out = vdisk_bounded(&args);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(stderr(&out).contains("--image-root"), "the refusal says what to add: {}", text(&out));

    // 0660 and a control group: its members may list and add beneath the roots, nothing outside.
    let g = GROUP.to_string();
    let (server, control) = serve(&dir, &["--control-mode", "0660", "--control-group", &g, "--image-root", s(&root)]);
    let meta = std::fs::metadata(&control).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, GROUP));
    let out = ctl_as_nobody(&control, None, &["list"]);
    assert_eq!(out.status.code(), Some(1), "not in the group, cannot connect: {}", text(&out));
    let out = ctl_as_nobody(&control, Some(GROUP), &["list", "--json"]);
    assert!(out.status.success(), "a member lists: {}", text(&out));
    assert_eq!(json(&String::from_utf8_lossy(&out.stdout)), json!([]));
    let out = ctl_as_nobody(&control, Some(GROUP), &["add", "/etc/shadow"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(stderr(&out).contains("outside the image roots"), "{}", text(&out));
    let out = ctl_as_nobody(&control, Some(GROUP), &["add", s(&root.join("in.img"))]);
    assert!(out.status.success(), "a member adds beneath the roots: {}", text(&out));
    qemu_io(&server.uri("in"), &["write -P 9 0 64k", "read -P 9 0 64k"]);
    server.stop();

    // Readable by all (0666), no group: anyone may read, only the owner and root change.
    let (server, control) = serve(&dir, &["--control-mode", "0666", "--image-root", s(&root)]);
    let out = ctl_as_nobody(&control, None, &["info", "--json"]);
    assert!(out.status.success(), "anyone who can connect may read: {}", text(&out));
    for args in [vec!["add", s(&root.join("in.img"))], vec!["reload"], vec!["remove", "in"]] {
        let out = ctl_as_nobody(&control, None, &args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(stderr(&out).contains("only the server's own user"), "{args:?}: {}", text(&out));
    }
    assert_eq!(rpc(&control, "export_list", json!({}))["result"], json!([]), "nothing was added");
    server.stop();
}

#[test]
fn image_roots_confine_what_the_control_socket_adds() {
    let dir = open_dir("ctl-roots");
    let root = dir.path("root");
    std::fs::create_dir(&root).unwrap();
    let outside = dir.path("outside.img");
    create_image(&outside, "1M");
    create_image(&root.join("in.img"), "1M");
    std::os::unix::fs::symlink(&outside, root.join("link.img")).unwrap();
    // A qcow2 inside whose backing file is outside (qcow2 backing would leak it).
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", s(&outside), "-F", "raw", s(&root.join("over.qcow2"))]);
    // One whose backing file is inside (served below), and a COW overlay inside over the outside file.
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "in.img", "-F", "raw", s(&root.join("ok.qcow2"))]);
    let out = vdisk(&["create", "--backing", s(&outside), s(&root.join("over.cow"))]);
    assert!(out.status.success(), "{}", text(&out));
    let canonical = root.canonicalize().unwrap();
    let roots = canonical.display().to_string();

    // The operator's own image on the command line stays unrestricted.
    let (server, control) = serve(&dir, &["--image-root", s(&root), s(&outside)]);
    qemu_io(&server.uri("outside"), &["read -P 0 0 4k"]);

    let dotdot = format!("{}/../outside.img", root.display());
    for (image, extra) in [
        ("/etc/shadow", json!({})),
        (dotdot.as_str(), json!({})),
        (s(&root.join("link.img")), json!({})),
        (s(&outside), json!({"name": "abs"})),
        (s(&root.join("over.qcow2")), json!({})),
        (s(&root.join("over.cow")), json!({})),
        (s(&root.join("ok.qcow2")), json!({"name": "b", "backing": s(&outside)})),
        (s(&root.join("in.img")), json!({"name": "v", "vhost_user_blk": s(&dir.path("v.sock"))})),
        (s(&root.join("in.img")), json!({"name": "f", "fuse": "/etc/cron.d/disk"})),
        ("rbd:rbd/disk@snap", json!({"ceph_conf": "/etc/shadow"})),
    ] {
        let mut params = extra.clone();
        params["image"] = json!(image);
        if params.get("name").is_none() {
            params["name"] = json!(format!("e{}", image.len()));
        }
        let v = rpc(&control, "export_add", params.clone());
        let m = refused(&v);
        assert!(m.contains("outside the image roots") && m.contains(&roots), "{params}: {m}");
    }
    let list = rpc(&control, "export_list", json!({}));
    assert_eq!(list["result"].as_array().unwrap().len(), 1, "only the command line's export: {list}");

    let v = rpc(&control, "export_add", json!({"image": s(&root.join("in.img"))}));
    assert_eq!(v["result"]["name"], "in", "{v}");
    qemu_io(&server.uri("in"), &["write -P 5 4k 8k", "read -P 5 4k 8k", "read -P 0 0 4k"]);
    let out = run("nbdinfo", &["--size", &server.uri("in")]);
    assert_eq!(out.trim(), (1 << 20).to_string());
    // A qcow2 inside over a backing file inside is served, through its chain.
    let v = rpc(&control, "export_add", json!({"image": s(&root.join("ok.qcow2"))}));
    assert_eq!(v["result"]["name"], "ok", "{v}");
    qemu_io(&server.uri("ok"), &["read -P 5 4k 8k", "read -P 0 0 4k"]);
    server.stop();
}

#[test]
fn fifos_sockets_and_devices_fail_at_once_and_the_next_add_works() {
    let dir = open_dir("ctl-wedge");
    let fifo = dir.path("fifo");
    run("mkfifo", &[s(&fifo)]);
    let sock = dir.path("listening.sock");
    let _listener = UnixListener::bind(&sock).unwrap();
    let img = image(&dir, "good.img", "1M");
    let (server, control) = serve(&dir, &[]);
    for (path, kind) in [(s(&fifo), "FIFO"), (s(&sock), "unix socket"), ("/dev/zero", "character device")] {
        for format in ["auto", "raw", "qcow2", "cow"] {
            let started = Instant::now();
            let v = rpc(&control, "export_add", json!({"image": path, "format": format, "name": "x"}));
            let took = started.elapsed();
            let m = refused(&v);
            assert!(took < Duration::from_secs(1), "{path} ({format}) took {took:?}: {m}");
            assert!(m.contains(kind) && m.contains("not a disk image"), "{path} ({format}): {m}");
        }
    }
    // The same as a COW overlay's backing file: refused at once too.
    let cow = dir.path("over.cow");
    assert!(vdisk(&["create", "--backing", &img, s(&cow)]).status.success());
    let started = Instant::now();
    let v = rpc(&control, "export_add", json!({"image": s(&cow), "backing": s(&fifo)}));
    assert!(started.elapsed() < Duration::from_secs(1) && refused(&v).contains("FIFO"), "{v}");

    let started = Instant::now();
    let v = rpc(&control, "export_add", json!({"image": img}));
    assert_eq!(v["result"]["name"], "good", "{v}");
    assert!(started.elapsed() < Duration::from_secs(5));
    qemu_io(&server.uri("good"), &["write -P 1 0 4k", "read -P 1 0 4k"]);

    // Stopped and continued (a debugger, a cgroup freeze): the socket goes on answering.
    let mut waiting = UnixStream::connect(&control).unwrap();
    let pid = server.child.id() as i32;
    for sig in [libc::SIGSTOP, libc::SIGCONT] {
        // SAFETY: kill only reads its integer arguments; the pid is our own child's.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        std::thread::sleep(Duration::from_millis(200));
    }
    writeln!(waiting, r#"{{"jsonrpc":"2.0","id":1,"method":"export_list"}}"#).unwrap();
    waiting.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut line = String::new();
    BufReader::new(&waiting).read_line(&mut line).unwrap();
    assert_eq!(json(&line)["result"][0]["name"], "good", "{line}");
    assert_eq!(rpc(&control, "server_info", json!({}))["result"]["exports"], 1);
    server.stop();
}

/// Raises this process's soft descriptor limit to `want` (for a thousand clients).
fn raise_fd_limit(want: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    if r.rlim_cur < want {
        assert!(r.rlim_max >= want, "this test needs {want} descriptors; the hard limit is {}", r.rlim_max);
        r.rlim_cur = want;
        // SAFETY: as above; only this process's limit changes.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    }
}

/// Sends `bytes` on a new connection and returns every response line until the server closes or goes quiet.
fn exchange(control: &Path, bytes: &[u8]) -> Vec<Value> {
    let mut c = UnixStream::connect(control).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = c.write_all(bytes);
    let _ = c.shutdown(std::net::Shutdown::Write);
    BufReader::new(&c).lines().map_while(Result::ok).map(|l| json(&l)).collect()
}

#[test]
fn hostile_control_clients_get_clear_errors_and_change_nothing() {
    let dir = open_dir("ctl-abuse");
    let img = image(&dir, "keep.img", "1M");
    let (server, control) = serve(&dir, &["--control-timeout", "5", &img]);
    let code = |v: &Value| v["error"]["code"].as_i64().unwrap_or_else(|| panic!("not an error: {v}"));

    // Random bytes (no newline in them), then a newline: one parse error.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise: Vec<u8> = (0..65536).map(|_| (xorshift(&mut x) % 255) as u8).filter(|b| *b != b'\n').collect();
    noise.push(b'\n');
    let r = exchange(&control, &noise);
    assert_eq!((r.len(), code(&r[0])), (1, -32700), "{r:?}");

    // 100,000-deep JSON, bare and inside params: a parse error, no stack overflow.
    let deep = format!("{}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    let inside = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"export_add\",\"params\":{{\"image\":{}1{}}}}}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    for line in [deep, inside] {
        let r = exchange(&control, line.as_bytes());
        assert_eq!(code(&r[0]), -32700, "{r:?}");
        assert!(refused(&r[0]).contains("recursion limit"), "{r:?}");
    }

    // A 3 MiB line: an error, then the connection is closed.
    let r = exchange(&control, &vec![b'{'; 3 << 20]);
    assert_eq!((r.len(), code(&r[0])), (1, -32600), "{r:?}");
    assert!(refused(&r[0]).contains("over 1048576 bytes"), "{r:?}");

    // Wrong param types: which param, and what it must be.
    for (params, what) in [
        (json!({"image": 5}), "image must be a string"),
        (json!({"image": "/x", "readonly": "yes"}), "readonly must be true or false"),
        (json!({"image": "/x", "num_queues": 65}), "num_queues 65"),
        (json!({"image": "/x", "iops": -1}), "iops must be a whole number"),
        (json!({"image": "/x", "format": "vmdk"}), "format \"vmdk\" is not one of"),
        (json!({"image": "/x", "colour": "red"}), "no parameter \"colour\""),
    ] {
        let v = rpc(&control, "export_add", params.clone());
        assert_eq!(code(&v), -32602, "{params}: {v}");
        assert!(refused(&v).contains(what), "{params}: {v}");
    }

    // 1,100 idle clients: past 1,024 a new one is closed at once; the server goes on.
    raise_fd_limit(4096);
    let mut idle: Vec<UnixStream> = (0..1100).map(|_| UnixStream::connect(&control).unwrap()).collect();
    let mut late = UnixStream::connect(&control).unwrap();
    late.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut late, &mut buf).unwrap_or(0), 0, "a client past the limit is closed");
    idle.truncate(900);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = exchange(&control, b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"export_list\"}\n");
        if let Some(v) = r.first() {
            assert_eq!(v["result"][0]["name"], "keep", "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "no room for a client after 200 idle ones left");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(idle);
    qemu_io(&server.uri("keep"), &["write -P 2 0 4k", "read -P 2 0 4k"]);
    server.stop();
}

#[test]
fn an_open_that_hangs_blocks_only_its_own_request_and_is_dropped_past_the_deadline() {
    let _fuse = common::fuse::serial();
    let dir = open_dir("ctl-deadline");
    // A disk image on a FUSE file whose server is stopped: opening or reading it hangs, as on a dead NFS mount.
    let src = image(&dir, "src.img", "1M");
    let slow = dir.path("slow.img");
    let fuse_sock = dir.path("fuse-nbd.sock");
    let fuse_server = Server::spawn(&["serve", &src, "--fuse", s(&slow), "--socket", s(&fuse_sock)], fuse_sock.clone());
    let good = image(&dir, "good.img", "1M");
    let (server, control) = serve(&dir, &["--control-timeout", "5"]);
    let fuse_pid = fuse_server.child.id() as i32;
    // Should the test fail half-way: the FUSE server continued and its file unmounted, not left hanging.
    struct Resume(i32, PathBuf);
    impl Drop for Resume {
        fn drop(&mut self) {
            // SAFETY: kill only reads its integer arguments.
            unsafe { libc::kill(self.0, libc::SIGCONT) };
            if std::thread::panicking() {
                let _ = Command::new("umount").args(["-l", s(&self.1)]).output();
            }
        }
    }
    let resume = Resume(fuse_pid, slow.clone());
    // SAFETY: kill only reads its integer arguments; the pid is our own child's.
    assert_eq!(unsafe { libc::kill(fuse_pid, libc::SIGSTOP) }, 0);

    let hung = {
        let (control, slow) = (control.clone(), slow.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let v = rpc(&control, "export_add", json!({"image": s(&slow), "name": "slow"}));
            (v, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // Meanwhile other changes go on: the hung open holds no lock they need,
    // and its name is taken until it is given up.
    let v = rpc(&control, "export_add", json!({"image": good}));
    assert_eq!(v["result"]["name"], "good", "{v}");
    let v = rpc(&control, "export_add", json!({"image": s(&slow), "name": "slow"}));
    assert!(refused(&v).contains("being added"), "{v}");
    assert!(!hung.is_finished(), "the hung add answered before its deadline");
    let (v, took) = hung.join().unwrap();
    let m = refused(&v);
    assert!(m.contains("did not finish within 5 s") && m.contains("nothing was"), "{m}");
    assert!(took >= Duration::from_secs(5), "answered after {took:?}");

    // The file system comes back: the late open is closed and dropped, the name free again.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(fuse_pid, libc::SIGCONT) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let names: Vec<Value> = rpc(&control, "export_list", json!({}))["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].clone())
            .collect();
        assert_eq!(names, [json!("good")], "nothing of the given-up add is served");
        let v = rpc(&control, "export_add", json!({"image": s(&slow), "name": "slow", "readonly": true}));
        if v.get("result").is_some() {
            break;
        }
        assert!(refused(&v).contains("being added"), "{v}");
        assert!(Instant::now() < deadline, "the late open never let go of its name");
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu_io(&server.uri("good"), &["write -P 4 0 4k", "read -P 4 0 4k"]);
    let v = rpc(&control, "export_remove", json!({"name": "slow", "hard": true}));
    assert_eq!(v["result"]["removed"], true, "{v}");
    server.stop();
    drop(resume);
    fuse_server.stop();
}
