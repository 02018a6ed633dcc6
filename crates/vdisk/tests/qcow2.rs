//! qcow2 images end to end: made by `qemu-img create`/`convert` in many
//! shapes (versions 2 and 3, clusters of 512 B to 2 MiB, refcounts of 1 to
//! 64 bits, extended L2, backing chains) or by `vdisk create`, served by the
//! real binary, written by real clients (qemu-io over nbd+unix, nbdsh,
//! nbdcopy), then judged by qemu itself: `qemu-img check` clean and `qemu-img
//! compare` equal to a raw model the test keeps. SIGKILL crash rounds on
//! qcow2 overlays run through `vdisk soak --format qcow2`, which runs
//! `qemu-img check` after every kill. A missing tool fails.

mod common;

use common::{
    assert_same, base_data, crash_rounds, json, make_base, nbdsh, output, qemu_io, read_export, read_file, run, s,
    text, vdisk, vdisk_bounded, Server, TempDir, KIB, MIB,
};
use std::path::Path;

/// `qemu-img check`: no corruption and no leaks.
fn check_clean(img: &Path) {
    let out = output("qemu-img", &["check", s(img)]);
    assert!(out.status.success(), "qemu-img check {}:\n{}", img.display(), text(&out));
}

/// `qemu-img check` of the image alone (its backing chain not opened: qemu
/// has no driver for UML COW).
fn check_clean_alone(img: &Path) {
    let spec = format!(
        r#"json:{{"driver":"qcow2","backing":null,"file":{{"driver":"file","filename":"{}"}}}}"#,
        img.display()
    );
    let out = output("qemu-img", &["check", &spec]);
    assert!(out.status.success(), "qemu-img check {}:\n{}", img.display(), text(&out));
}

/// `qemu-img compare IMG MODEL` with the model written to a raw file.
fn compare(dir: &TempDir, img: &Path, model: &[u8]) {
    let raw = dir.path("model.raw");
    std::fs::write(&raw, model).unwrap();
    let out = output("qemu-img", &["compare", "-F", "raw", s(img), s(&raw)]);
    assert!(out.status.success(), "qemu-img compare {} with the model:\n{}", img.display(), text(&out));
}

/// Client operations: unaligned and aligned writes, FUA, zeroes (allocated
/// and unmapping), discards, the last bytes of the disk. Applied to `model`;
/// returns the qemu-io commands, each range read back at the end.
fn client_ops(model: &mut [u8]) -> Vec<String> {
    let size = model.len();
    let ops: Vec<(String, usize, usize, u8)> = vec![
        ("write -P 0xab 513 1000".to_string(), 513, 1000, 0xab),
        ("write -P 0x11 4095 2".to_string(), 4095, 2, 0x11),
        (format!("write -P 0x22 {} {}", MIB, 64 * KIB), MIB, 64 * KIB, 0x22),
        (format!("write -P 0x33 {} 3", MIB - 1), MIB - 1, 3, 0x33),
        (format!("write -z {} {}", 2 * MIB, MIB), 2 * MIB, MIB, 0),
        (format!("write -z -u {} 5000", 3 * MIB + 100), 3 * MIB + 100, 5000, 0),
        (format!("discard {} {}", 4 * MIB, MIB), 4 * MIB, MIB, 0),
        (format!("write -f -P 0x44 {} 4096", 5 * MIB), 5 * MIB, 4096, 0x44),
        (format!("write -P 0x66 {} 200", 5 * MIB + 100), 5 * MIB + 100, 200, 0x66),
        (format!("write -P 0x55 {} 512", size - 512), size - 512, 512, 0x55),
        (format!("write -P 0x77 {} {}", 6 * MIB + 7, MIB + 3), 6 * MIB + 7, MIB + 3, 0x77),
        (format!("write -z -u {} 511", 7 * MIB + 1), 7 * MIB + 1, 511, 0),
        (format!("write -P 0x88 0 {}", 128 * KIB), 0, 128 * KIB, 0x88),
    ];
    let mut cmds = Vec::new();
    for (cmd, off, len, fill) in &ops {
        model[*off..off + len].fill(*fill);
        cmds.push(cmd.clone());
    }
    for (_, off, len, _) in &ops {
        let p = model[*off];
        if model[*off..off + len].iter().all(|&b| b == p) {
            cmds.push(format!("read -P {p:#x} {off} {len}"));
        }
    }
    cmds.push("flush".into());
    cmds
}

/// One shape of image qemu-img makes: its options, and whether it has a backing file.
struct Shape {
    name: &'static str,
    options: &'static str,
    backing: bool,
}

const SHAPES: &[Shape] = &[
    Shape { name: "v2-64k", options: "compat=0.10", backing: true },
    Shape { name: "v3-512-rc1", options: "cluster_size=512,refcount_bits=1", backing: true },
    Shape { name: "v3-4k-rc64", options: "cluster_size=4096,refcount_bits=64", backing: false },
    Shape { name: "v3-64k-rc16", options: "cluster_size=65536", backing: true },
    Shape { name: "v3-2m-rc8", options: "cluster_size=2M,refcount_bits=8", backing: true },
    Shape { name: "v3-64k-extl2", options: "extended_l2=on", backing: true },
    Shape { name: "v3-32k-extl2-nobacking", options: "extended_l2=on,cluster_size=32768", backing: false },
];

#[test]
fn qemu_images_of_every_shape_written_through_vdisk_check_clean_and_match() {
    const SIZE: usize = 8 * MIB;
    for (i, shape) in SHAPES.iter().enumerate() {
        let engine = if i % 2 == 0 { "uring" } else { "threads" };
        let dir = TempDir::new(&format!("qcow2-shape-{}", shape.name));
        let top = dir.path("top.qcow2");
        let mut model = vec![0u8; SIZE];
        let mut create = vec!["create", "-q", "-f", "qcow2", "-o", shape.options];
        let base = dir.path("base.raw");
        if shape.backing {
            model = make_base(&base, SIZE, 0x9e37_79b9 + i as u64);
            create.extend_from_slice(&["-b", s(&base), "-F", "raw"]);
        }
        let size = SIZE.to_string();
        create.extend_from_slice(&[s(&top), &size]);
        run("qemu-img", &create);
        // qemu writes first: data clusters, zero clusters, a partial cluster.
        let pre = ["write -P 0x5a 64k 192k", "write -z 1536k 512k", "write -P 0x5b 3000 100"];
        let mut args = vec!["-f", "qcow2", s(&top)];
        pre.iter().for_each(|c| args.extend_from_slice(&["-c", c]));
        run("qemu-io", &args);
        model[64 * KIB..256 * KIB].fill(0x5a);
        model[1536 * KIB..2 * MIB].fill(0);
        model[3000..3100].fill(0x5b);

        // Two shapes through O_DIRECT (qemu's cache=none), the rest through the page cache.
        let mut args = vec![s(&top), "--engine", engine];
        if i == 3 || i == 4 {
            args.push("--direct");
        }
        let server = Server::start(&dir, &args);
        assert!(server.stdout.iter().any(|l| l.contains("qcow2")), "{:?}", server.stdout);
        let uri = server.uri("top");
        assert_same(&format!("{} as qemu left it", shape.name), &read_export(&dir, &uri, "export.raw"), &model);
        qemu_io(&uri, &client_ops(&mut model));
        nbdsh(&uri, "h.trim(1000, 5 * 1024 * 1024 + 7)\nh.zero(100, 7 * 1024 * 1024 + 300)\nh.flush()");
        model[5 * MIB + 7..5 * MIB + 1007].fill(0);
        model[7 * MIB + 300..7 * MIB + 400].fill(0);
        assert_same(&format!("{} written through vdisk", shape.name), &read_export(&dir, &uri, "export.raw"), &model);
        server.stop();
        check_clean(&top);
        compare(&dir, &top, &model);
        if shape.backing {
            assert_same("the backing file", &read_file(&base), &base_data(SIZE, 0x9e37_79b9 + i as u64));
        }
    }
}

#[test]
fn vdisk_created_images_read_the_same_in_qemu() {
    for (cluster, backing) in [("512", false), ("64K", true), ("2M", true), ("4K", false)] {
        let dir = TempDir::new(&format!("qcow2-created-{cluster}"));
        let img = dir.path("disk.qcow2");
        let base = dir.path("base.raw");
        let mut model = vec![0u8; 12 * MIB];
        let mut args = vec!["create", "--format", "qcow2", "--cluster-size", cluster, s(&img)];
        if backing {
            model = make_base(&base, 12 * MIB, 7);
            args.extend_from_slice(&["--backing", s(&base)]);
        } else {
            args.extend_from_slice(&["--size", "12M"]);
        }
        let out = vdisk(&args);
        assert!(out.status.success(), "{}", text(&out));
        check_clean(&img);
        compare(&dir, &img, &model);

        let server = Server::start(&dir, &[s(&img)]);
        let uri = server.uri("disk");
        qemu_io(&uri, &client_ops(&mut model));
        // A whole-disk copy in 256 KiB requests over 4 connections.
        let src = dir.path("src.raw");
        let data = make_base(&src, 4 * MIB, 99);
        let dst = format!("nbd+unix:///disk?socket={}", server.socket.display());
        run("nbdcopy", &["--connections=4", "--destination-is-zero", s(&src), &dst]);
        model[..4 * MIB].copy_from_slice(&data);
        server.stop();
        check_clean(&img);
        compare(&dir, &img, &model);

        let info = json(&String::from_utf8_lossy(&vdisk(&["info", "--json", s(&img)]).stdout));
        assert_eq!(info["format"], "qcow2", "{info}");
        assert_eq!(info["qcow2-version"], 3, "{info}");
        assert_eq!(info["virtual-size"], 12 * MIB as u64, "{info}");
        let q = json(&run("qemu-img", &["info", "--output=json", s(&img)]));
        assert_eq!(q["cluster-size"], info["cluster-size"], "{q}");
        if backing {
            assert_eq!(info["backing-format"], "raw", "{info}");
            assert_eq!(q["backing-filename-format"], "raw", "{q}");
        }
    }
}

#[test]
fn compressed_images_zlib_and_zstd_read_and_rewrite() {
    let dir = TempDir::new("qcow2-compressed");
    let raw = dir.path("src.raw");
    let mut model = base_data(8 * MIB, 11);
    model[..MIB].iter_mut().enumerate().for_each(|(i, b)| *b = b"compressible"[i % 12]);
    std::fs::write(&raw, &model).unwrap();
    for (name, opts) in [("zlib", "compression_type=zlib"), ("zstd", "compression_type=zstd")] {
        let img = dir.path(&format!("{name}.qcow2"));
        run("qemu-img", &["convert", "-q", "-c", "-O", "qcow2", "-o", opts, s(&raw), s(&img)]);
        let server = Server::start(&dir, &[s(&img)]);
        let uri = server.uri(name);
        assert_same(&format!("{name}: compressed clusters read"), &read_export(&dir, &uri, "export.raw"), &model);
        let mut want = model.clone();
        qemu_io(&uri, &client_ops(&mut want));
        assert_same(&format!("{name}: rewritten"), &read_export(&dir, &uri, "export.raw"), &want);
        server.stop();
        check_clean(&img);
        compare(&dir, &img, &want);
    }
}

#[test]
fn commit_of_a_qcow2_overlay_into_raw_and_into_a_new_image() {
    let dir = TempDir::new("qcow2-commit");
    let base = dir.path("base.raw");
    let mut model = make_base(&base, 8 * MIB, 5);
    let top = dir.path("top.qcow2");
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", "-b", "base.raw", "-F", "raw", s(&top)],
    );
    let server = Server::start(&dir, &[s(&top)]);
    qemu_io(&server.uri("top"), &client_ops(&mut model));
    server.stop();
    let merged = dir.path("merged.raw");
    let out = vdisk(&["commit", s(&top), "--into", s(&merged)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("vdisk commit --into", &read_file(&merged), &model);
    let out = vdisk(&["commit", s(&top)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("vdisk commit into the raw base", &read_file(&base), &model);
    compare(&dir, &top, &model);
}

#[test]
fn backing_chains_qcow2_over_qcow2_over_cow_and_raw() {
    let dir = TempDir::new("qcow2-chain");
    let raw = dir.path("base.raw");
    let mut model = make_base(&raw, 6 * MIB, 3);
    // UML COW over raw, qcow2 (made by qemu-img, relative backing name) over it, vdisk's qcow2 on top.
    let cow = dir.path("mid.cow");
    let out = vdisk(&["create", "--backing", s(&raw), s(&cow)]);
    assert!(out.status.success(), "{}", text(&out));
    let server = Server::start(&dir, &[s(&cow)]);
    qemu_io(&server.uri("mid"), &["write -P 0x31 100k 300k"]);
    model[100 * KIB..400 * KIB].fill(0x31);
    server.stop();
    // qemu has no driver for UML COW: vdisk makes that link, qemu-img the next (relative name, unchecked).
    let mid = dir.path("mid.qcow2");
    let out = vdisk(&["create", "--format", "qcow2", "--backing", s(&cow), s(&mid)]);
    assert!(out.status.success(), "{}", text(&out));
    let top = dir.path("top.qcow2");
    run("qemu-img", &["create", "-q", "-u", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", s(&top), "6M"]);
    let server = Server::start(&dir, &[s(&top), "--engine", "threads"]);
    let uri = server.uri("top");
    assert_same("the chain as built", &read_export(&dir, &uri, "export.raw"), &model);
    qemu_io(&uri, &["write -P 0x41 200k 64k", "write -P 0x42 5000 10", "flush"]);
    model[200 * KIB..264 * KIB].fill(0x41);
    model[5000..5010].fill(0x42);
    assert_same("the chain after writes", &read_export(&dir, &uri, "export.raw"), &model);
    // Block status: the written clusters are data, an untouched zero stretch of the base a hole.
    let map = run("nbdinfo", &["--map", &uri]);
    assert!(map.contains("data"), "{map}");
    server.stop();
    check_clean_alone(&top);
    check_clean_alone(&mid);

    // Over raw, as qemu-img makes it, with qemu reading the result.
    let q = dir.path("q.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", s(&q)]);
    let server = Server::start(&dir, &[s(&q)]);
    qemu_io(&server.uri("q"), &["write -P 0x51 1M 1M", "flush"]);
    server.stop();
    let mut want = base_data(6 * MIB, 3);
    want[MIB..2 * MIB].fill(0x51);
    check_clean(&q);
    compare(&dir, &q, &want);
}

/// The first bytes of a file, changed in place.
fn poke(path: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new().write(true).open(path).unwrap().write_all_at(bytes, at).unwrap();
}

fn refused(args: &[&str], needle: &str) {
    let out = vdisk_bounded(args);
    assert_eq!(out.status.code(), Some(2), "vdisk {args:?} should fail with 2:\n{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "vdisk {args:?}: {needle:?} not in:\n{err}");
}

#[test]
fn encrypted_corrupt_looping_and_hostile_images_are_refused_with_the_way_out() {
    let dir = TempDir::new("qcow2-refusals");
    let sock = s(&dir.path("x.sock")).to_owned();
    let enc = dir.path("enc.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "--object",
            "secret,id=sec0,data=hunter2",
            "-f",
            "qcow2",
            "-o",
            "encrypt.format=luks,encrypt.key-secret=sec0",
            s(&enc),
            "1M",
        ],
    );
    refused(&["serve", s(&enc), "--socket", &sock], "encrypted");

    let img = dir.path("dirty.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&img), "1M"]);
    poke(&img, 79, &[2]); // incompatible features: corrupt
    refused(&["serve", s(&img), "--socket", &sock], "--readonly");
    let server = Server::start(&dir, &[s(&img), "--readonly"]);
    assert!(nbdsh(&server.uri("dirty"), "print(h.pread(4096, 0) == bytes(4096))").contains("True"));
    server.stop();

    let (a, b) = (dir.path("a.qcow2"), dir.path("b.qcow2"));
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&b), "1M"]);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", s(&a)]);
    run("qemu-img", &["rebase", "-u", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", s(&b)]);
    refused(&["serve", s(&a), "--socket", &sock], "loops");

    let gone = dir.path("orphan.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", s(&b), "-F", "qcow2", "-u", s(&gone), "1M"]);
    std::fs::remove_file(&b).unwrap();
    refused(&["serve", s(&gone), "--socket", &sock], "--backing PATH");

    // An L1 table pointing past the end of the file, and a huge L1 size.
    let bad = dir.path("bad.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&bad), "1M"]);
    poke(&bad, 36, &0xffff_ffffu32.to_be_bytes());
    refused(&["serve", s(&bad), "--socket", &sock], "L1 table");
}

#[test]
fn a_dirty_image_with_lazy_refcounts_is_repaired_when_opened_for_writing() {
    let dir = TempDir::new("qcow2-dirty");
    let img = dir.path("dirty.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on,cluster_size=4096", s(&img), "8M"]);
    // qemu-io killed before it closes the image: the dirty bit stays, refcounts are stale.
    let _ = output("qemu-io", &["-c", "write -P 0x21 0 1M", "-c", "write -P 0x22 3M 20k", "-c", "sigraise 9", s(&img)]);
    let bytes = read_file(&img);
    assert_eq!(bytes[79] & 1, 1, "qemu-io left no dirty bit");
    assert!(!output("qemu-img", &["check", s(&img)]).status.success(), "the stale refcounts went unnoticed");
    // Read-only: served as it is.
    let server = Server::start(&dir, &[s(&img), "--readonly"]);
    assert!(nbdsh(&server.uri("dirty"), "print(h.pread(4096, 0) == b'\\x21' * 4096)").contains("True"));
    server.stop();
    assert_eq!(read_file(&img)[79] & 1, 1, "a read-only open changed the image");
    // Read-write: repaired first, then written.
    let server = Server::start(&dir, &[s(&img)]);
    qemu_io(&server.uri("dirty"), &["read -P 0x21 0 1M", "read -P 0x22 3M 20k", "write -P 0x23 5M 8k", "flush"]);
    server.stop();
    assert_eq!(read_file(&img)[79] & 1, 0, "the dirty bit is still set");
    check_clean(&img);
    let mut want = vec![0u8; 8 * MIB];
    want[..MIB].fill(0x21);
    want[3 * MIB..3 * MIB + 20 * KIB].fill(0x22);
    want[5 * MIB..5 * MIB + 8 * KIB].fill(0x23);
    compare(&dir, &img, &want);
}

#[test]
fn sigkill_crash_rounds_on_qcow2_overlays_pass_qemu_img_check() {
    crash_rounds("qcow2-crash", 24, &["--format", "qcow2"]);
}
