//! COW overlays (UML COW v3) end to end: made by `uml_mkcow` or `vdisk
//! create --backing`, served by the real binary, written by real clients
//! (qemu-io, nbdsh, nbdcopy), merged by `uml_moo`
//! and `vdisk commit`. Every result is compared with a model the test keeps.
//! A missing tool fails. (Crash consistency of overlays, SIGKILL mid-workload,
//! is in crash.rs, with raw images, through `vdisk soak`.)

mod common;

use common::{
    assert_same, base_data, make_base, nbdsh, qemu_io, read_export, read_file, run, s, text, vdisk, vdisk_bounded,
    Server, TempDir, ENGINES, KIB, MIB,
};
use std::io::Read;
use std::process::{Command, Stdio};

/// What a list of client operations does, applied to the model and turned
/// into qemu-io commands.
enum Op {
    Write(usize, usize, u8),
    /// FUA write.
    WriteFua(usize, usize, u8),
    /// WRITE_ZEROES that must stay allocated (qemu-io `write -z`).
    Zero(usize, usize),
    /// WRITE_ZEROES that may punch (qemu-io `write -z -u`).
    ZeroUnmap(usize, usize),
    /// TRIM: on an overlay it reads back as zeros, whatever the backing file holds.
    Discard(usize, usize),
}

fn apply(ops: &[Op], model: &mut [u8]) -> Vec<String> {
    let mut cmds = Vec::new();
    for op in ops {
        let (cmd, off, len, fill) = match *op {
            Op::Write(o, l, p) => (format!("write -P {p:#x} {o} {l}"), o, l, p),
            Op::WriteFua(o, l, p) => (format!("write -f -P {p:#x} {o} {l}"), o, l, p),
            Op::Zero(o, l) => (format!("write -z {o} {l}"), o, l, 0),
            Op::ZeroUnmap(o, l) => (format!("write -z -u {o} {l}"), o, l, 0),
            Op::Discard(o, l) => (format!("discard {o} {l}"), o, l, 0),
        };
        model[off..off + len].fill(fill);
        cmds.push(cmd);
    }
    // Read every range back through the server, in the final state.
    for op in ops {
        let (Op::Write(o, l, _) | Op::WriteFua(o, l, _) | Op::Zero(o, l) | Op::ZeroUnmap(o, l) | Op::Discard(o, l)) =
            *op;
        let p = model[o];
        if model[o..o + l].iter().all(|&b| b == p) {
            cmds.push(format!("read -P {p:#x} {o} {l}"));
        }
    }
    cmds.push("flush".into());
    cmds
}

/// Odd offsets, partial sectors at both ends, zeroes and discards over
/// backing data, FUA, the last sector, overwrites.
fn client_ops() -> Vec<Op> {
    vec![
        Op::Write(513, 1000, 0xab),
        Op::Write(4095, 2, 0x11),
        Op::Write(MIB, 64 * KIB, 0x22),
        Op::Write(MIB - 1, 3, 0x33),
        Op::Zero(2 * MIB, MIB),
        Op::ZeroUnmap(3 * MIB + 100, 5000),
        Op::Discard(4 * MIB, MIB),
        Op::WriteFua(6 * MIB, 4096, 0x44),
        Op::Write(6 * MIB + 100, 200, 0x66),
        Op::Write(16 * MIB - 512, 512, 0x55),
        Op::Write(7 * MIB + 7, 3 * MIB, 0x77),
        Op::ZeroUnmap(8 * MIB + 1, 511),
    ]
}

#[test]
fn uml_mkcow_overlay_written_through_vdisk_merges_with_uml_moo() {
    for engine in ENGINES {
        let dir = TempDir::new(&format!("cow-mkcow-{engine}"));
        let base = dir.path("base.img");
        let mut model = make_base(&base, 16 * MIB, 0x9e37_79b9_7f4a_7c15);
        let overlay = dir.path("disk.cow");
        run("uml_mkcow", &["-f", s(&overlay), s(&base)]);

        let server = Server::start(&dir, &[s(&overlay), "--engine", engine]);
        assert!(server.stdout.iter().any(|l| l.contains("cow over")), "{:?}", server.stdout);
        let uri = server.uri("disk");
        let cmds = apply(&client_ops(), &mut model);
        qemu_io(&uri, &cmds);
        // Byte-exact trims and zeroes (qemu may round discards to its alignment).
        nbdsh(&uri, "h.trim(1000, 5 * 1024 * 1024 + 7)\nh.zero(100, 12 * 1024 * 1024 + 300)\nh.flush()");
        model[5 * MIB + 7..5 * MIB + 1007].fill(0);
        model[12 * MIB + 300..12 * MIB + 400].fill(0);
        assert_same(&format!("export ({engine})"), &read_export(&dir, &uri, "out.raw"), &model);
        server.stop();

        assert_same(
            &format!("base after serving ({engine})"),
            &read_file(&base),
            &base_data(16 * MIB, 0x9e37_79b9_7f4a_7c15),
        );
        let merged = dir.path("merged.img");
        run("uml_moo", &[s(&overlay), s(&merged)]);
        assert_same(&format!("uml_moo merge ({engine})"), &read_file(&merged), &model);

        // A restarted server reads back what the first one left on disk.
        let server = Server::start(&dir, &[s(&overlay), "--engine", engine, "--readonly"]);
        assert_same(
            &format!("export after restart ({engine})"),
            &read_export(&dir, &server.uri("disk"), "again.raw"),
            &model,
        );
        server.stop();
    }
}

#[test]
fn vdisk_overlay_is_what_uml_mkcow_makes_and_commit_equals_uml_moo() {
    let dir = TempDir::new("cow-commit");
    let base = dir.path("base.img");
    let mut model = make_base(&base, 16 * MIB, 0x2545_f491_4f6c_dd1d);
    let ours = dir.path("disk.cow");
    let out = vdisk(&["create", "--backing", s(&base), s(&ours)]);
    assert!(out.status.success(), "{}", text(&out));
    let theirs = dir.path("theirs.cow");
    run("uml_mkcow", &["-f", s(&theirs), s(&base)]);
    assert_same("vdisk create --backing vs uml_mkcow", &read_file(&ours), &read_file(&theirs));

    let server = Server::start(&dir, &[s(&ours)]);
    qemu_io(&server.uri("disk"), &apply(&client_ops(), &mut model));
    server.stop();

    let info: serde_json::Value =
        serde_json::from_slice(&vdisk(&["info", "--json", s(&ours)]).stdout).expect("vdisk info --json");
    assert_eq!(info["format"], "cow", "{info}");
    assert_eq!(info["virtual-size"], 16 * MIB as u64, "{info}");
    assert_eq!(info["backing-file"], s(&base.canonicalize().unwrap()), "{info}");
    assert_eq!(info["backing-ok"], true, "{info}");
    assert_eq!(info["data-offset"], 12288, "{info}");
    // Whole 4 KiB pages (8 sectors) of every range written.
    assert_eq!(info["sectors-allocated"], touched_pages(&client_ops()).len() * 8, "{info}");
    assert_whole_pages(&ours);

    // Non-destructive merges.
    let by_moo = dir.path("moo.img");
    run("uml_moo", &[s(&ours), s(&by_moo)]);
    assert_same("uml_moo merge of a vdisk overlay", &read_file(&by_moo), &model);
    let by_vdisk = dir.path("vdisk.img");
    let out = vdisk(&["commit", s(&ours), "--into", s(&by_vdisk)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("vdisk commit --into", &read_file(&by_vdisk), &model);
    let out = vdisk(&["commit", s(&ours), "--into", s(&by_vdisk)]);
    assert_eq!(out.status.code(), Some(2), "an existing --into file is refused: {}", text(&out));

    // In-place merges into two copies of the base (mtimes kept, so both tools accept them).
    let (a, b) = (dir.path("base-a.img"), dir.path("base-b.img"));
    run("cp", &["--preserve=timestamps", s(&base), s(&a)]);
    run("cp", &["--preserve=timestamps", s(&base), s(&b)]);
    run("uml_moo", &["-d", "-b", s(&a), s(&ours)]);
    let out = vdisk(&["commit", s(&ours), "--backing", s(&b)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("vdisk commit in place vs uml_moo -d", &read_file(&b), &read_file(&a));
    assert_same("vdisk commit in place", &read_file(&b), &model);
    // The base it was made over changed nothing.
    assert_same("original base", &read_file(&base), &base_data(16 * MIB, 0x2545_f491_4f6c_dd1d));
}

/// The 4 KiB pages that `ops` touch.
fn touched_pages(ops: &[Op]) -> std::collections::BTreeSet<usize> {
    ops.iter()
        .flat_map(|op| {
            let (Op::Write(o, l, _) | Op::WriteFua(o, l, _) | Op::Zero(o, l) | Op::ZeroUnmap(o, l) | Op::Discard(o, l)) =
                *op;
            o / 4096..(o + l).div_ceil(4096)
        })
        .collect()
}

/// Reads the overlay's header and on-disk bitmap, asserts that every 4 KiB
/// page (the header's alignment, 8 sectors) has all its bits set or none, as
/// the UML kernel writes them and needs them, and returns the pages set.
fn assert_whole_pages(overlay: &std::path::Path) -> std::collections::BTreeSet<usize> {
    let bytes = read_file(overlay);
    let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let size = u64::from_be_bytes(bytes[12..20].try_into().unwrap()) as usize;
    let (sector, align) = (be32(20), be32(24));
    assert_eq!((sector, align), (512, 4096), "the header of {}", overlay.display());
    let bitmap_at = (32 + 4096usize).div_ceil(align) * align;
    let sectors = size.div_ceil(sector);
    let bit = |n: usize| bytes[bitmap_at + n / 8] & (1 << (n % 8)) != 0;
    let per_page = align / sector;
    let mut set = std::collections::BTreeSet::new();
    for page in 0..sectors.div_ceil(per_page) {
        let bits: Vec<bool> = (page * per_page..((page + 1) * per_page).min(sectors)).map(bit).collect();
        assert!(
            bits.iter().all(|&b| b) || bits.iter().all(|&b| !b),
            "{}: page {page} (bytes {}..) is only partly in the overlay: bits {bits:?}",
            overlay.display(),
            page * align
        );
        if bits[0] {
            set.insert(page);
        }
    }
    set
}

/// Unaligned writes (the 5000 bytes at offset 1000, ranges across page
/// boundaries, single sectors, zeroes, FUA, the short last page) fill whole
/// pages of the overlay, and vdisk's own read (live, then after a restart),
/// `vdisk commit` and `uml_moo` agree byte for byte. (tests/uml.rs adds the
/// UML kernel as a reader.)
#[test]
fn unaligned_writes_fill_whole_pages_and_every_reader_agrees() {
    // Three sectors past a whole number of pages: the last page is short.
    const SIZE: usize = 4 * MIB + 1536;
    let ops = || {
        vec![
            Op::Write(1000, 5000, 0xaa),
            Op::Write(8192 + 4095, 2, 0x11),
            Op::Write(65536 + 512, 512, 0x22),
            Op::Write(MIB - 1, 3, 0x33),
            Op::Write(MIB + 100, 64 * KIB, 0x44),
            Op::ZeroUnmap(2 * MIB + 100, 5000),
            Op::Zero(2 * MIB + 40000, 700),
            Op::WriteFua(3 * MIB + 3000, 100, 0x55),
            Op::Write(SIZE - 2000, 2000, 0x66),
        ]
    };
    for engine in ENGINES {
        let dir = TempDir::new(&format!("cow-pages-{engine}"));
        let base = dir.path("base.img");
        let mut model = make_base(&base, SIZE, 0x5eed_c0e5);
        let overlay = dir.path("disk.cow");
        let out = vdisk(&["create", "--backing", s(&base), s(&overlay)]);
        assert!(out.status.success(), "{}", text(&out));
        let server = Server::start(&dir, &[s(&overlay), "--engine", engine]);
        let uri = server.uri("disk");
        qemu_io(&uri, &apply(&ops(), &mut model));
        assert_same(&format!("vdisk read ({engine})"), &read_export(&dir, &uri, "live.raw"), &model);
        server.stop();

        assert_eq!(assert_whole_pages(&overlay), touched_pages(&ops()), "pages in the overlay ({engine})");
        let server = Server::start(&dir, &[s(&overlay), "--engine", engine, "--readonly"]);
        let again = read_export(&dir, &server.uri("disk"), "again.raw");
        server.stop();
        assert_same(&format!("vdisk read after a restart ({engine})"), &again, &model);
        let by_vdisk = dir.path("commit.img");
        let out = vdisk(&["commit", s(&overlay), "--into", s(&by_vdisk)]);
        assert!(out.status.success(), "{}", text(&out));
        assert_same(&format!("vdisk commit ({engine})"), &read_file(&by_vdisk), &model);
        let by_moo = dir.path("moo.img");
        run("uml_moo", &[s(&overlay), s(&by_moo)]);
        assert_same(&format!("uml_moo ({engine})"), &read_file(&by_moo), &model);
    }
}

/// Asserts exit 2 and one line on stderr that contains every one of `words`.
fn assert_refused(args: &[&str], words: &[&str]) {
    let out = vdisk_bounded(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "vdisk {args:?}: {}", text(&out));
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "vdisk {args:?}: want one line on stderr:\n{err}");
    for w in words {
        assert!(lines[0].contains(w), "vdisk {args:?}: {w:?} missing from: {}", lines[0]);
    }
}

#[test]
fn bad_overlays_are_refused_with_exit_2_naming_the_file() {
    let dir = TempDir::new("cow-bad");
    let base = dir.path("base.img");
    make_base(&base, 4 * MIB, 7);
    let good_path = dir.path("good.cow");
    run("uml_mkcow", &["-f", s(&good_path), s(&base)]);
    let good = read_file(&good_path);
    let sock = dir.path("nbd.sock");
    let variants: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated.cow", good[..1000].to_vec(), "truncated"),
        ("magic.cow", [&[0x4f, 0x4f, 0x4f, 0x4e][..], &good[4..]].concat(), "--format"),
        ("v1.cow", [&good[..4], &[0, 0, 0, 1], &good[8..]].concat(), "version 1"),
        ("v2.cow", [&good[..4], &[0, 0, 0, 2], &good[8..]].concat(), "version 2"),
        ("short.cow", good[..8192 + 100].to_vec(), "too short for the bitmap"),
        ("sector.cow", [&good[..20], &[0, 0, 0, 0], &good[24..]].concat(), "sector size 0"),
    ];
    for (name, bytes, word) in &variants {
        let p = dir.path(name);
        std::fs::write(&p, bytes).unwrap();
        if *name == "magic.cow" {
            // Not COW magic: auto-detection takes it as raw. Asked for as an overlay, it is refused.
            assert_refused(&["serve", s(&p), "--format", "cow", "--socket", s(&sock)], &[s(&p), "not a COW overlay"]);
            continue;
        }
        assert_refused(&["serve", s(&p), "--socket", s(&sock)], &[s(&p), word]);
        assert_refused(&["info", s(&p)], &[s(&p), word]);
        assert_refused(&["commit", s(&p), "--into", s(&dir.path("x.img"))], &[s(&p), word]);
    }

    // The backing file is gone, then back with another mtime, then another size.
    let ov = s(&good_path);
    let moved = dir.path("moved.img");
    std::fs::rename(&base, &moved).unwrap();
    assert_refused(&["serve", ov, "--socket", s(&sock)], &[ov, s(&base), "--backing"]);
    assert_refused(&["commit", ov], &[ov, s(&base), "--backing"]);
    run("touch", &["-d", "2001-01-01", s(&moved)]);
    assert_refused(
        &["serve", ov, "--backing", s(&moved), "--socket", s(&sock)],
        &[ov, s(&moved), "--ignore-backing-mtime"],
    );
    let server = Server::start(&dir, &[ov, "--backing", s(&moved), "--ignore-backing-mtime"]);
    server.stop();
    std::fs::rename(&moved, &base).unwrap();
    assert_refused(&["serve", ov, "--socket", s(&sock)], &[ov, s(&base), "modified after"]);
    let f = std::fs::OpenOptions::new().append(true).open(&base).unwrap();
    f.set_len(4 * MIB as u64 + 512).unwrap();
    assert_refused(&["serve", ov, "--ignore-backing-mtime", "--socket", s(&sock)], &[ov, s(&base), "4194816 bytes"]);

    // Mistakes on the command line.
    assert_refused(&["create", s(&dir.path("n.img"))], &["--size"]);
    assert_refused(&["create", "--backing", s(&dir.path("nope.img")), s(&dir.path("n.cow"))], &["nope.img"]);
    assert_refused(&["create", "--backing", s(&base), ov], &["already exists"]);
    let raw = dir.path("raw.img");
    std::fs::write(&raw, vec![0u8; 65536]).unwrap();
    assert_refused(&["serve", s(&raw), "--backing", s(&base), "--socket", s(&sock)], &[s(&raw), "COW overlays only"]);
    assert_refused(&["commit", s(&raw)], &[s(&raw), "not a COW overlay"]);
}

/// A COW overlay reads its backing file as raw bytes: `create` refuses an
/// image format there (a qcow2 or another overlay) and says what to make
/// instead.
#[test]
fn a_cow_overlay_over_an_image_format_is_refused() {
    let dir = TempDir::new("cow-over-format");
    let base = dir.path("base.img");
    make_base(&base, 4 * MIB, 3);
    let q = dir.path("base.qcow2");
    assert!(vdisk(&["create", "--format", "qcow2", "--size", "4M", s(&q)]).status.success());
    let cow = dir.path("mid.cow");
    assert!(vdisk(&["create", "--backing", s(&base), s(&cow)]).status.success());
    for b in [&q, &cow] {
        let new = dir.path("new.cow");
        assert_refused(&["create", "--backing", s(b), s(&new)], &[s(b), "--format qcow2"]);
        assert!(!new.exists(), "nothing is left behind");
    }
    let out = vdisk(&["info", "--json", s(&cow)]);
    assert!(text(&out).contains("\"format\": \"cow\""), "{}", text(&out));
}

#[test]
fn many_overlays_over_one_base_served_at_once() {
    const N: usize = 4;
    let dir = TempDir::new("cow-many");
    let base = dir.path("base.img");
    let base_bytes = make_base(&base, 16 * MIB, 0xdead_beef);
    let mtime = std::fs::metadata(&base).unwrap().modified().unwrap();
    let mut args = Vec::new();
    for i in 0..N {
        let ov = dir.path(&format!("vm{i}.cow"));
        let out = vdisk(&["create", "--backing", s(&base), s(&ov)]);
        assert!(out.status.success(), "{}", text(&out));
        args.push(s(&ov).to_owned());
    }
    args.extend(["--engine".to_owned(), "uring".to_owned()]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&dir, &argv);
    let any = format!("nbd+unix:///?socket={}", server.socket.display());
    let list = run("nbdinfo", &["--list", &any]);
    for i in 0..N {
        assert!(list.contains(&format!("export=\"vm{i}\"")), "{list}");
    }
    // Each overlay gets its own data: half the disk, at a different place.
    let models: Vec<Vec<u8>> = (0..N)
        .map(|i| {
            let mut m = base_bytes.clone();
            let at = i * 2 * MIB + 333;
            m[at..at + 8 * MIB].copy_from_slice(&base_data(8 * MIB, 100 + i as u64));
            m
        })
        .collect();
    std::thread::scope(|scope| {
        for (i, model) in models.iter().enumerate() {
            let (uri, dir) = (server.uri(&format!("vm{i}")), &dir);
            scope.spawn(move || {
                let src = dir.path(&format!("src{i}.raw"));
                std::fs::write(&src, model).unwrap();
                run("nbdcopy", &["--connections=4", "--flush", s(&src), &uri]);
                assert_same(&format!("vm{i}"), &read_export(dir, &uri, &format!("out{i}.raw")), model);
            });
        }
    });
    server.stop();
    assert_same("base", &read_file(&base), &base_bytes);
    assert_eq!(std::fs::metadata(&base).unwrap().modified().unwrap(), mtime, "the base was modified");
    for (i, model) in models.iter().enumerate() {
        let merged = dir.path(&format!("merged{i}.img"));
        run("uml_moo", &[&args[i], s(&merged)]);
        assert_same(&format!("uml_moo of vm{i}"), &read_file(&merged), model);
    }
}

/// The backing path in a header is untrusted: a relative one that names one
/// file from the overlay's directory and another from the current directory
/// is refused (naming --backing), `info` says which file `serve` opens (through
/// symlinks), and `--backing` settles it.
#[test]
fn an_ambiguous_or_symlinked_backing_path_is_never_followed_silently() {
    let dir = TempDir::new("cow-untrusted");
    let (a, b) = (dir.path("a"), dir.path("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    make_base(&a.join("base.img"), MIB, 1);
    make_base(&b.join("base.img"), MIB, 2);
    let overlay = a.join("vm.cow");
    assert!(vdisk(&["create", "--backing", s(&a.join("base.img")), s(&overlay)]).status.success());
    // Rewrite the header's path (at byte 32) as a relative one, as another tool might.
    let mut bytes = read_file(&overlay);
    bytes[32..32 + 4096].fill(0);
    bytes[32..40].copy_from_slice(b"base.img");
    std::fs::write(&overlay, &bytes).unwrap();
    let in_b = |args: &[&str]| Command::new(common::vdisk_bin()).args(args).current_dir(&b).output().unwrap();

    let out = in_b(&["serve", s(&overlay), "--socket", s(&dir.path("x.sock"))]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(err.contains("another file") && err.contains("--backing"), "{err}");
    let out = in_b(&["info", s(&overlay)]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("problem: the header of"), "{}", text(&out));
    // From a neutral directory there is no doubt; --backing settles it anywhere.
    let out = vdisk(&["info", s(&overlay), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backing-ok"], true, "{v}");
    assert_eq!(v["backing-file-opens"], s(&a.join("base.img")), "{v}");

    // A symlinked base: info shows the real file, serve prints it.
    let link = dir.path("link.img");
    std::os::unix::fs::symlink(a.join("base.img"), &link).unwrap();
    let over2 = dir.path("vm2.cow");
    assert!(vdisk(&["create", "--backing", s(&link), s(&over2)]).status.success());
    let out = vdisk(&["info", s(&over2)]);
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(info.contains("through symlinks") && info.contains(s(&a.join("base.img"))), "{info}");
    assert!(info.contains("inode"), "{info}");
    let server = Server::start(&dir, &[s(&over2), "--readonly"]);
    assert!(server.stdout.iter().any(|l| l.contains(&format!("cow over {}", a.join("base.img").display()))));
    server.stop();
    let mut child = Command::new(common::vdisk_bin())
        .args(["serve", s(&overlay), "--readonly", "--backing", s(&b.join("base.img"))])
        .args(["--socket", s(&dir.path("y.sock")), "--ignore-backing-mtime"])
        .current_dir(&b)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let _ = std::io::BufRead::read_line(&mut out, &mut first);
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    assert!(first.contains(&format!("cow over {}", b.join("base.img").display())), "--backing: {first}\n{err}");
}
