//! Meta contexts with real clients (libnbd's nbdinfo and nbdsh) against a
//! server of a real raw image: `qemu:dirty-bitmap:NAME` for the bitmaps the
//! export is given, `qemu:allocation-depth`, listing, and several contexts
//! answered in one block-status reply.

use std::os::unix::net::UnixListener;
use std::process::Command;
use std::sync::Arc;

use vdisk_engine::{Device, EngineConfig, EngineKind};
use vdisk_image::bitmap::DirtyBitmap;
use vdisk_image::{Image, RawImage};

use crate::{Export, Listener, Server, ServerOptions};

struct Served {
    server: Arc<Server>,
    serving: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    dir: std::path::PathBuf,
    uri: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.stop();
        if let Some(t) = self.serving.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 4 MiB raw image with data at 1 MiB, served as "disk" with bitmaps
/// b0 (64 KiB: dirty at 0 and 2 MiB..2 MiB+128K) and b1 (4 KiB, clean).
fn serve(tag: &str) -> Served {
    let dir = std::env::temp_dir().join(format!("vdisk-nbd-meta-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.raw");
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(4 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 65536], 1 << 20).unwrap();
    let image: Arc<dyn Image> = Arc::new(RawImage::open(&img, false).unwrap());
    let config = EngineConfig { kind: EngineKind::Threads, workers: 1, ..EngineConfig::default() };
    let device = Arc::new(Device::start("disk", image, &config).unwrap());
    let export = Export { name: "disk".into(), description: String::new(), device, allow: Default::default() };
    let server = Server::new(vec![export], ServerOptions::default()).unwrap();
    let b0 = Arc::new(DirtyBitmap::new(4 << 20, 65536).unwrap());
    b0.record_write(100, 1);
    b0.record_write(2 << 20, 100 << 10);
    let b1 = Arc::new(DirtyBitmap::new(4 << 20, 4096).unwrap());
    server.set_bitmaps("disk", vec![("b0".into(), b0), ("b1".into(), b1)]);
    let sock = dir.join("nbd.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let serving = {
        let (server, sock) = (server.clone(), sock.clone());
        std::thread::spawn(move || server.serve(vec![Listener::Unix(listener, sock)]))
    };
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    Served { server, serving: Some(serving), dir, uri }
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} is needed (libnbd-bin, python3-libnbd; scripts/install-test-deps.sh): {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// nbdinfo --map rows: (offset, length, flags).
fn map(uri: &str, context: &str) -> Vec<(u64, u64, u32)> {
    run("nbdinfo", &[&format!("--map={context}"), uri])
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect()
}

#[test]
fn nbdinfo_reads_dirty_bitmaps_and_allocation_depth() {
    let s = serve("nbdinfo");
    let k = 65536;
    assert_eq!(
        map(&s.uri, "qemu:dirty-bitmap:b0"),
        [(0, k, 1), (k, (2 << 20) - k, 0), (2 << 20, 2 * k, 1), ((2 << 20) + 2 * k, (2 << 20) - 2 * k, 0)]
    );
    assert_eq!(map(&s.uri, "qemu:dirty-bitmap:b1"), [(0, 4 << 20, 0)]);
    // A raw file holds every byte it has: depth 1 throughout (as qemu counts it).
    assert_eq!(map(&s.uri, "qemu:allocation-depth"), [(0, 4 << 20, 1)]);
    // base:allocation is unchanged: the data run, holes around it.
    let base = map(&s.uri, "base:allocation");
    assert!(base.contains(&(1 << 20, k, 0)), "{base:?}");
    // --list --content shows every context offered.
    let list = run("nbdinfo", &["--list", &s.uri]);
    for c in ["base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"] {
        assert!(list.contains(c), "{c} not listed:\n{list}");
    }
}

#[test]
fn several_contexts_answer_in_one_reply_and_queries_follow_the_spec() {
    let s = serve("nbdsh");
    let script = r#"
import nbd, sys
uri = sys.argv[1]
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_uri(uri)
def listed(queries):
    got = []
    h.clear_meta_contexts()
    for q in queries:
        h.add_meta_context(q)
    h.opt_list_meta_context(lambda name: got.append(name))
    return sorted(got)
print("all", listed([]))
print("qemu", listed(["qemu:"]))
print("bitmaps", listed(["qemu:dirty-bitmap:"]))
print("base", listed(["base:"]))
h.clear_meta_contexts()
for c in ["base:allocation", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:nope", "qemu:allocation-depth", "qemu:"]:
    h.add_meta_context(c)
h.opt_go()
seen = {}
def cb(ctx, offset, entries, err):
    seen[ctx] = list(entries)
    return 0
h.block_status(4 << 20, 0, cb)
for k in sorted(seen):
    print("status", k, seen[k])
print("selected", h.can_meta_context("qemu:dirty-bitmap:b0"), h.can_meta_context("qemu:dirty-bitmap:nope"))
h.shutdown()
"#;
    let py = s.dir.join("t.py");
    std::fs::write(&py, script).unwrap();
    // The system Python has the libnbd bindings (python3-libnbd).
    let out = run("/usr/bin/python3", &[py.to_str().unwrap(), &s.uri]);
    let line = |tag: &str| out.lines().filter(|l| l.starts_with(tag)).collect::<Vec<_>>().join("\n");
    assert_eq!(
        line("all "),
        "all ['base:allocation', 'qemu:allocation-depth', 'qemu:dirty-bitmap:b0', 'qemu:dirty-bitmap:b1']",
        "{out}"
    );
    assert_eq!(line("qemu "), "qemu ['qemu:allocation-depth', 'qemu:dirty-bitmap:b0', 'qemu:dirty-bitmap:b1']");
    assert_eq!(line("bitmaps "), "bitmaps ['qemu:dirty-bitmap:b0', 'qemu:dirty-bitmap:b1']");
    assert_eq!(line("base "), "base ['base:allocation']");
    // One block status, three contexts, three chunks; unknown names and "qemu:" are not selected in SET.
    let status = line("status ");
    assert_eq!(status.lines().count(), 3, "{out}");
    assert!(status.contains("status qemu:allocation-depth [4194304, 1]"), "{out}");
    assert!(status.contains("status qemu:dirty-bitmap:b0 [65536, 1, 2031616, 0, 131072, 1, 1966080, 0]"), "{out}");
    assert!(status.contains("status base:allocation [1048576, 3, 65536, 0, 3080192, 3]"), "{out}");
    assert_eq!(line("selected"), "selected True False", "{out}");
}
