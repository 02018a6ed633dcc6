//! The command line: help, `create`, `info`, `serve` argument errors, signals.

mod common;

use common::{create_image, image, json, run, serve_new_disk, vdisk, vdisk_bin, vdisk_bounded, Server, TempDir};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const MIB: u64 = 1 << 20;

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts exit code 2 and exactly one non-empty line on stderr; returns it.
fn assert_usage_error(args: &[&str], out: &Output) -> String {
    assert_eq!(out.status.code(), Some(2), "vdisk {args:?}: {}\nstderr: {}", out.status, stderr(out));
    let err = stderr(out);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "vdisk {args:?}: want one line on stderr, got:\n{err}");
    lines[0].to_owned()
}

#[test]
fn help_names_commands_and_options() {
    let out = vdisk(&["--help"]);
    assert!(out.status.success(), "vdisk --help: {}", stderr(&out));
    let help = stdout(&out);
    for word in ["create", "info", "serve"] {
        assert!(help.contains(word), "vdisk --help does not mention {word}:\n{help}");
    }
    let out = vdisk(&["serve", "--help"]);
    assert!(out.status.success(), "vdisk serve --help: {}", stderr(&out));
    let help = stdout(&out);
    for word in ["--socket", "--listen", "--readonly", "--workers", "--sync"] {
        assert!(help.contains(word), "vdisk serve --help does not mention {word}:\n{help}");
    }
    for sub in ["create", "info"] {
        let out = vdisk(&[sub, "--help"]);
        assert!(out.status.success(), "vdisk {sub} --help: {}", stderr(&out));
    }
    let out = vdisk(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2), "unknown subcommand: {}", out.status);
}

/// Options that only some builds have say so in `--help`, and a build
/// without them refuses them with a message naming the feature to build with.
#[test]
fn help_names_the_features_options_need() {
    let help = stdout(&vdisk(&["serve", "--help"]));
    let psk = help.split("--tls-psk <FILE>").nth(1).expect("serve --help lists --tls-psk");
    assert!(psk.contains("build with the psk feature"), "--tls-psk does not say it needs psk:\n{help}");
    let help = stdout(&vdisk(&["soak", "--help"]));
    let power = help.split("--power-loss <POWER_LOSS>").nth(1).expect("soak --help lists --power-loss");
    assert!(
        power.contains("build with the `powercut` feature"),
        "--power-loss does not say it needs powercut:\n{help}"
    );
}

#[cfg(not(feature = "psk"))]
#[test]
fn tls_psk_without_the_psk_feature_is_refused() {
    let dir = TempDir::new("no-psk");
    let img = dir.path("disk.img");
    create_image(&img, "1M");
    let keys = dir.path("keys.psk");
    std::fs::write(&keys, format!("alice:{}\n", "ab".repeat(32))).unwrap();
    std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let socket = dir.path("s");
    let args =
        ["serve", img.to_str().unwrap(), "--socket", socket.to_str().unwrap(), "--tls-psk", keys.to_str().unwrap()];
    let out = vdisk_bounded(&args);
    let line = assert_usage_error(&args, &out);
    assert!(line.contains("--features psk"), "the refusal does not say how to build with psk: {line}");
}

#[cfg(not(feature = "powercut"))]
#[test]
fn soak_power_loss_without_the_powercut_feature_is_refused() {
    let dir = TempDir::new("no-powercut");
    let d = dir.path("soak");
    let args = ["soak", "--rounds", "1", "--seconds", "0", "--power-loss", "drop", "--dir", d.to_str().unwrap()];
    let out = vdisk_bounded(&args);
    let line = assert_usage_error(&args, &out);
    assert!(line.contains("--features powercut"), "the refusal does not say how to build with powercut: {line}");
    assert!(!d.exists(), "the refused soak made {}", d.display());
}

#[test]
fn create_sizes_are_binary_and_sparse() {
    let dir = TempDir::new("create");
    for (size, bytes) in [("64M", 64 * MIB), ("4K", 4096), ("1048576", MIB), ("3G", 3 << 30), ("1T", 1 << 40)] {
        let p = dir.path(&format!("img-{size}.img"));
        create_image(&p, size);
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), bytes, "create --size {size}");
        assert!(m.blocks() * 512 < bytes.max(MIB), "create --size {size} is not sparse: {} blocks", m.blocks());
    }
}

#[test]
fn create_rejects_bad_sizes() {
    let dir = TempDir::new("badsize");
    for bad in ["12Q", "abc", "", "-1", "16MM", "99999999T"] {
        let p = dir.path("x.img");
        let size = format!("--size={bad}");
        let args = ["create", p.to_str().unwrap(), &size];
        let out = vdisk(&args);
        let line = assert_usage_error(&args, &out);
        if !bad.is_empty() {
            assert!(line.contains(bad), "vdisk {args:?}: message does not name {bad:?}: {line}");
        }
        assert!(!p.exists(), "vdisk {args:?} failed but left {} behind", p.display());
    }
}

#[test]
fn create_refuses_existing_file() {
    let dir = TempDir::new("exists");
    let p = dir.path("x.img");
    std::fs::write(&p, b"precious").unwrap();
    let args = ["create", p.to_str().unwrap(), "--size", "16M"];
    let out = vdisk(&args);
    assert_usage_error(&args, &out);
    assert_eq!(std::fs::read(&p).unwrap(), b"precious", "create clobbered an existing file");
}

#[test]
fn info_missing_file_names_it() {
    let dir = TempDir::new("info-missing");
    let p = dir.path("nope.img");
    let args = ["info", p.to_str().unwrap()];
    let out = vdisk(&args);
    let line = assert_usage_error(&args, &out);
    assert!(line.contains(p.to_str().unwrap()), "message does not name the path: {line}");
}

#[test]
fn info_plain_and_json() {
    let dir = TempDir::new("info");
    let p = dir.path("disk.img");
    create_image(&p, "16M");
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &vec![7u8; MIB as usize], 0).unwrap();
    f.sync_all().unwrap();
    let path = p.to_str().unwrap();

    let plain = run(vdisk_bin(), &["info", path]);
    assert!(plain.contains("raw"), "vdisk info does not name the format:\n{plain}");

    let out = run(vdisk_bin(), &["info", path, "--json"]);
    let v = json(&out);
    assert_eq!(v["format"], "raw", "{v}");
    assert_eq!(v["virtual-size"], 16 * MIB, "{v}");
    let allocated = v["allocated"].as_u64().unwrap_or_else(|| panic!("allocated is not a number: {v}"));
    assert!((MIB..16 * MIB).contains(&allocated), "allocated {allocated} for 1 MiB written to a sparse 16 MiB image");
    let shown = v["path"].as_str().unwrap_or_else(|| panic!("path is not a string: {v}"));
    assert_eq!(Path::new(shown).canonicalize().unwrap(), p.canonicalize().unwrap(), "{v}");
}

#[test]
fn create_preallocate_allocates() {
    let dir = TempDir::new("prealloc");
    let p = dir.path("full.img");
    let out = vdisk(&["create", p.to_str().unwrap(), "--size", "16M", "--preallocate"]);
    assert!(out.status.success(), "create --preallocate: {}", stderr(&out));
    let m = std::fs::metadata(&p).unwrap();
    assert_eq!(m.len(), 16 * MIB);
    assert!(m.blocks() * 512 >= 16 * MIB, "only {} bytes allocated", m.blocks() * 512);
    let v = json(&run(vdisk_bin(), &["info", p.to_str().unwrap(), "--json"]));
    assert!(v["allocated"].as_u64().unwrap() >= 16 * MIB, "{v}");
}

#[test]
fn serve_refuses_bad_images() {
    let dir = TempDir::new("serve-bad");
    let sock = dir.path("nbd.sock");
    let sock = sock.to_str().unwrap();
    let good = dir.path("good.img");
    create_image(&good, "16M");
    let missing = dir.path("missing.img");
    let subdir = dir.path("adir");
    std::fs::create_dir(&subdir).unwrap();
    for bad in [&missing, &subdir] {
        let bad = bad.to_str().unwrap();
        for args in [vec!["serve", bad, "--socket", sock], vec!["serve", good.to_str().unwrap(), bad, "--socket", sock]]
        {
            let out = vdisk_bounded(&args);
            let line = assert_usage_error(&args, &out);
            assert!(line.contains(bad), "vdisk {args:?}: message does not name {bad}: {line}");
            assert!(!Path::new(sock).exists(), "vdisk {args:?} left its socket behind");
        }
    }
    let args = ["serve", good.to_str().unwrap(), "--socket", sock, "--workers", "lots"];
    let out = vdisk_bounded(&args);
    assert_eq!(out.status.code(), Some(2), "vdisk {args:?}: {}", out.status);
}

#[test]
fn sigint_stops_cleanly() {
    let (_dir, _img, server) = serve_new_disk("sigint", "16M", &[]);
    run("nbdinfo", &[&server.uri("disk")]);
    let socket = server.socket.clone();
    let st = server.stop_with(libc::SIGINT);
    assert!(st.success(), "vdisk exited with {st} after SIGINT");
    assert!(!socket.exists(), "socket {} left behind after SIGINT", socket.display());
}

#[test]
fn sigterm_with_a_client_connected() {
    let (_dir, _img, server) = serve_new_disk("sigterm-busy", "16M", &[]);
    // A client that connects, finishes the handshake, says so and then idles.
    // nbdsh needs the system Python, which has the libnbd bindings.
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let mut client = Command::new("nbdsh")
        .env("PATH", path)
        .args(["-u", &server.uri("disk"), "-c", "print('connected', flush=True)\nimport time\ntime.sleep(60)"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot run nbdsh (is libnbd-bin installed?)");
    let mut word = [0u8; 9];
    client.stdout.take().unwrap().read_exact(&mut word).expect("nbdsh did not connect");
    assert_eq!(&word, b"connected");
    server.stop();
    let _ = client.kill();
    let _ = client.wait();
}

#[test]
fn unix_socket_is_private_unless_asked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("socket-mode");
    let img = image(&dir, "d.img", "1M");
    let mode = |server: &Server| std::fs::metadata(&server.socket).unwrap().permissions().mode() & 0o777;
    let server = Server::start(&dir, &[&img]);
    assert_eq!(mode(&server), 0o600, "the default socket is the owner's only");
    server.stop();
    let server = Server::start(&dir, &[&img, "--socket-mode", "0660"]);
    assert_eq!(mode(&server), 0o660);
    server.stop();
    let args = ["serve", &img, "--socket-mode", "999"];
    let line = assert_usage_error(&args, &vdisk(&args));
    assert!(line.contains("999"), "{line}");
}

#[test]
fn max_connections_turns_extra_clients_away() {
    use std::os::unix::net::UnixStream;
    let dir = TempDir::new("max-conn");
    let img = image(&dir, "d.img", "1M");
    let server = Server::start(&dir, &[&img, "--max-connections", "1"]);
    let greeting = |s: &mut UnixStream| {
        let mut b = [0u8; 18];
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        s.read_exact(&mut b).is_ok() && &b[..8] == b"NBDMAGIC"
    };
    let mut first = UnixStream::connect(&server.socket).unwrap();
    assert!(greeting(&mut first), "the first client is served");
    let mut second = UnixStream::connect(&server.socket).unwrap();
    assert!(!greeting(&mut second), "a second client is turned away");
    drop(first);
    // Once the first has gone, a new client is served again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut again = UnixStream::connect(&server.socket).unwrap();
        if greeting(&mut again) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no client served after the first left");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    server.stop();
}
