//! Real NBD clients (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh, fio) against
//! the real `vdisk serve`. A missing client fails its test: none is skipped.

mod common;

use common::{
    assert_same, chunked_data, free_port, image, json, nbdsh, output, qemu_io, read_file, run, serve_new_disk, text,
    Server, TempDir, ENGINES, KIB, MIB,
};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// Deterministic test data: pseudo-random 64 KiB chunks, with every fifth
/// chunk zero, some chunks one repeated byte, and the last MiB zero.
fn test_data(len: usize, seed: u64) -> Vec<u8> {
    let mut v = chunked_data(len, seed, |i, chunk| match (i % 5, i % 7) {
        (0, _) => true,
        (_, 3) => {
            chunk.fill(i as u8 | 0x80);
            true
        }
        _ => false,
    });
    let tail = len.saturating_sub(MIB);
    v[tail..].fill(0);
    v
}

/// Overwrites `data` at `offset` in the (image) file at `path`.
fn write_at(path: &Path, offset: u64, data: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, offset).unwrap();
    f.sync_all().unwrap();
}

/// Asserts that `data[range]` is all `byte`.
fn assert_filled(data: &[u8], start: usize, len: usize, byte: u8) {
    if let Some(i) = data[start..start + len].iter().position(|&b| b != byte) {
        panic!("offset {}: got {:#04x}, want {byte:#04x} for [{start}, +{len})", start + i, data[start + i]);
    }
}

#[test]
fn qemu_img_convert_in_and_out() {
    let dir = TempDir::new("convert");
    let img = image(&dir, "disk.img", "16M");
    // Junk everywhere, so that the zero regions of the source must really be
    // written as zeroes.
    write_at(Path::new(&img), 0, &vec![0x5a; 16 * MIB]);
    let src = dir.path("src.raw");
    let data = test_data(16 * MIB, 0x9e37_79b9_7f4a_7c15);
    std::fs::write(&src, &data).unwrap();
    let src = src.to_str().unwrap();

    let server = Server::start(&dir, &[&img]);
    let uri = server.uri("disk");
    run("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", src, &uri]);
    let cmp = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", src, &uri]);
    assert!(cmp.contains("Images are identical"), "qemu-img compare: {cmp}");

    let out = dir.path("out.raw");
    run("qemu-img", &["convert", "-f", "raw", "-O", "raw", &uri, out.to_str().unwrap()]);
    assert_same("converted out", &read_file(&out), &data);
    server.stop();
    assert_same("image file", &read_file(Path::new(&img)), &data);
}

#[test]
fn qemu_io_write_read_zero_discard() {
    for engine in ENGINES {
        let (_dir, img, server) = serve_new_disk(&format!("qemu-io-{engine}"), "16M", &["--engine", engine]);
        let uri = server.uri("disk");
        qemu_io(
            &uri,
            &[
                "write -P 0xab 0 1M",
                "read -P 0xab 0 1M",
                // Zeroes over data, so that a no-op would show.
                "write -P 0x77 1M 1M",
                "write -z 1M 1M",
                "read -P 0 1M 1M",
                "write -P 0xcd 2M 1M",
                "discard 2M 1M",
                "read -P 0 2M 1M",
                // Unaligned write inside the first MiB.
                "write -P 0x11 513 1000",
                "read -P 0xab 0 513",
                "read -P 0x11 513 1000",
                "read -P 0xab 1513 1047063",
                // FUA write, zeroes that may unmap, unaligned zeroes, flush.
                "write -f -P 0x3c 3M 64k",
                "read -P 0x3c 3M 64k",
                "write -P 0xee 4M 1M",
                "write -z -u 4M 512k",
                "write -z 4718593 1000",
                "read -P 0 4M 512k",
                "read -P 0xee 4718592 1",
                "read -P 0 4718593 1000",
                "read -P 0xee 4719593 523287",
                "flush",
                // Crossing the end of written data into never-written space.
                "read -P 0 5M 11M",
            ],
        );
        // The tail of the device, and reads/writes ending exactly at its end.
        qemu_io(&uri, &["write -P 0x99 16773120 4096", "read -P 0x99 16773120 4096"]);
        server.stop();

        let d = read_file(Path::new(&img));
        assert_eq!(d.len(), 16 * MIB);
        assert_filled(&d, 0, 513, 0xab);
        assert_filled(&d, 513, 1000, 0x11);
        assert_filled(&d, 1513, MIB - 1513, 0xab);
        assert_filled(&d, MIB, 2 * MIB, 0);
        assert_filled(&d, 3 * MIB, 64 * KIB, 0x3c);
        assert_filled(&d, 3 * MIB + 64 * KIB, MIB - 64 * KIB, 0);
        assert_filled(&d, 4 * MIB, 512 * KIB, 0);
        assert_filled(&d, 4718592, 1, 0xee);
        assert_filled(&d, 4718593, 1000, 0);
        assert_filled(&d, 4719593, 523287, 0xee);
        assert_filled(&d, 5 * MIB, 11 * MIB - 4096, 0);
        assert_filled(&d, 16773120, 4096, 0x99);
    }
}

#[test]
fn nbdinfo_list_and_flags() {
    let dir = TempDir::new("nbdinfo");
    let a = image(&dir, "a.img", "16M");
    let b = image(&dir, "b.img", "32M");
    let server = Server::start(&dir, &[&a, &b]);

    let any = format!("nbd+unix:///?socket={}", server.socket.display());
    let list = json(&run("nbdinfo", &["--list", "--json", &any]));
    let exports = list["exports"].as_array().unwrap_or_else(|| panic!("no exports: {list}"));
    let mut names: Vec<(&str, u64)> =
        exports.iter().map(|e| (e["export-name"].as_str().unwrap(), e["export-size"].as_u64().unwrap())).collect();
    names.sort();
    assert_eq!(names, [("a", 16 * MIB as u64), ("b", 32 * MIB as u64)], "{list}");

    let info = json(&run("nbdinfo", &["--json", &server.uri("a")]));
    assert_eq!(info["structured"], true, "{info}");
    let e = &info["exports"][0];
    assert_eq!(e["export-name"], "a", "{info}");
    assert_eq!(e["export-size"], 16 * MIB as u64, "{info}");
    assert_eq!(e["is_read_only"], false, "{info}");
    for flag in
        ["can_multi_conn", "can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_df", "can_cache"]
    {
        assert_eq!(e[flag], true, "{flag} in {info}");
    }
    let desc = e["description"].as_str().unwrap_or_else(|| panic!("no description in {info}"));
    assert!(!desc.trim().is_empty(), "empty description in {info}");
    assert_eq!(e["block_size_minimum"], 1, "{info}");
    assert_eq!(e["block_size_preferred"], 4096, "{info}");
    assert_eq!(e["block_size_maximum"], 32 * MIB as u64, "{info}");
    let contexts = e["contexts"].as_array().unwrap_or_else(|| panic!("no contexts in {info}"));
    assert!(contexts.iter().any(|c| c == "base:allocation"), "{info}");

    let plain = run("nbdinfo", &["--list", &any]);
    assert!(plain.contains("export=\"a\"") && plain.contains("export=\"b\""), "{plain}");
    server.stop();
}

/// One line of `nbdinfo --map`: offset, length, type (bit 0: hole, bit 1: zero).
fn parse_map(map: &str) -> Vec<(u64, u64, u32)> {
    map.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 3, "bad map line {l:?} in\n{map}");
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect()
}

#[test]
fn nbdinfo_map_shows_data_and_holes() {
    let dir = TempDir::new("map");
    let img = image(&dir, "disk.img", "32M");
    // Data written into the file before serving, and some written over NBD.
    write_at(Path::new(&img), 4 * MIB as u64, &vec![0x5a; MIB]);
    write_at(Path::new(&img), 20 * MIB as u64, &vec![0x5b; 64 * KIB]);
    let server = Server::start(&dir, &[&img]);
    let uri = server.uri("disk");
    qemu_io(&uri, &["write -P 0x33 10M 64k", "flush"]);
    let map = run("nbdinfo", &["--map", &uri]);
    server.stop();

    let extents = parse_map(&map);
    let mut next = 0;
    for &(off, len, _) in &extents {
        assert_eq!(off, next, "map not contiguous:\n{map}");
        assert!(len > 0, "empty extent:\n{map}");
        next = off + len;
    }
    assert_eq!(next, 32 * MIB as u64, "map does not cover the disk:\n{map}");
    let type_at = |pos: u64| extents.iter().find(|&&(o, l, _)| o <= pos && pos < o + l).unwrap().2;
    let data = [(4 * MIB, MIB), (10 * MIB, 64 * KIB), (20 * MIB, 64 * KIB)];
    for &(off, len) in &data {
        for pos in (off..off + len).step_by(4096) {
            assert_eq!(type_at(pos as u64) & 1, 0, "offset {pos} should be data:\n{map}");
        }
    }
    // Far (1 MiB or more) from any data: holes, reading as zeroes.
    for pos in (0..32 * MIB).step_by(64 * KIB) {
        if data.iter().all(|&(o, l)| pos + MIB <= o || pos >= o + l + MIB) {
            assert_eq!(type_at(pos as u64), 3, "offset {pos} should be a hole:\n{map}");
        }
    }
    assert!(map.contains("data") && map.contains("hole"), "{map}");
}

#[test]
fn nbdcopy_in_and_out() {
    for engine in ENGINES {
        let dir = TempDir::new(&format!("nbdcopy-{engine}"));
        let img = image(&dir, "disk.img", "16M");
        write_at(Path::new(&img), 0, &vec![0x5a; 16 * MIB]);
        let src = dir.path("src.raw");
        let data = test_data(16 * MIB, 0x2545_f491_4f6c_dd1d);
        std::fs::write(&src, &data).unwrap();
        let out = dir.path("out.raw");

        let server = Server::start(&dir, &[&img, "--engine", engine]);
        let uri = server.uri("disk");
        run("nbdcopy", &["--connections=4", src.to_str().unwrap(), &uri]);
        run("nbdcopy", &["--connections=4", "--flush", &uri, out.to_str().unwrap()]);
        assert_same(&format!("nbdcopy out ({engine})"), &read_file(&out), &data);
        server.stop();
        assert_same(&format!("image file ({engine})"), &read_file(Path::new(&img)), &data);
    }
}

/// fio's random writes then verify pass over the nbd engine, on
/// [offset, offset + size) of the export; returns fio's output.
fn fio_verify(dir: &TempDir, uri: &str, offset: &str, size: &str) -> String {
    let uri = format!("--uri={uri}");
    let offset = format!("--offset={offset}");
    let size = format!("--size={size}");
    let args = [
        "--name=v",
        "--ioengine=nbd",
        &uri,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        &offset,
        &size,
        "--verify=crc32c",
        "--do_verify=1",
        "--numjobs=1",
    ];
    let out = Command::new("fio")
        .args(args)
        .current_dir(&dir.0)
        .output()
        .unwrap_or_else(|e| panic!("cannot run fio: {e} (is it installed?)"));
    let all = text(&out);
    assert!(out.status.success(), "fio {args:?} failed:\n{all}");
    assert!(all.contains("err= 0"), "fio reported errors:\n{all}");
    assert!(!all.contains("verify: bad") && !all.contains("verify failed"), "fio verify errors:\n{all}");
    // The verify pass ran: it shows up as reads.
    assert!(all.contains("read: IOPS"), "fio did not verify:\n{all}");
    all
}

#[test]
fn fio_randwrite_verify() {
    for engine in ENGINES {
        let (dir, _img, server) = serve_new_disk(&format!("fio-{engine}"), "16M", &["--engine", engine]);
        fio_verify(&dir, &server.uri("disk"), "0", "16M");
        server.stop();
    }
}

#[test]
fn readonly_export_refuses_writes() {
    let dir = TempDir::new("readonly");
    let img = image(&dir, "disk.img", "16M");
    write_at(Path::new(&img), 0, &vec![0x42; MIB]);
    let before = read_file(Path::new(&img));
    let server = Server::start(&dir, &[&img, "--readonly"]);
    let uri = server.uri("disk");

    let out = output("qemu-io", &["-f", "raw", &uri, "-c", "write 0 4k"]);
    assert!(!out.status.success(), "write on a --readonly export succeeded:\n{}", text(&out));
    run("qemu-io", &["-r", "-f", "raw", &uri, "-c", "read -P 0x42 0 1M", "-c", "read -P 0 1M 15M"]);

    let info = json(&run("nbdinfo", &["--json", &uri]));
    assert_eq!(info["exports"][0]["is_read_only"], true, "{info}");

    // Past libnbd's own checks: the server itself must refuse.
    let script = r#"
h.set_strict_mode(0)
for name, op in [("write", lambda: h.pwrite(b"y" * 4096, 0)),
                 ("zero", lambda: h.zero(4096, 0)),
                 ("trim", lambda: h.trim(4096, 0))]:
    try:
        op()
    except nbd.Error as e:
        print(name, "refused:", e.errno)
    else:
        raise SystemExit(name + " succeeded on a read-only export")
assert h.pread(4096, 0) == b"\x42" * 4096
"#;
    let said = nbdsh(&uri, script);
    assert_eq!(said.matches("refused").count(), 3, "{said}");
    server.stop();
    assert!(read_file(Path::new(&img)) == before, "the --readonly image changed");
}

#[test]
fn two_exports_unix_and_tcp() {
    let dir = TempDir::new("tcp");
    let a = image(&dir, "a.img", "16M");
    let b = image(&dir, "b.img", "32M");
    write_at(Path::new(&a), 0, &vec![0xa1; 64 * KIB]);
    write_at(Path::new(&b), 0, &vec![0xb2; 64 * KIB]);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::start(&dir, &[&a, &b, "--listen", &listen]);

    let tcp_a = format!("nbd://{listen}/a");
    let tcp_b = format!("nbd://{listen}/b");
    qemu_io(&tcp_a, &["read -P 0xa1 0 64k", "read -P 0 64k 64k"]);
    qemu_io(&tcp_b, &["read -P 0xb2 0 64k", "write -P 0xb3 64k 64k", "flush"]);
    // The same export over the Unix socket sees the TCP client's write.
    qemu_io(&server.uri("b"), &["read -P 0xb2 0 64k", "read -P 0xb3 64k 64k"]);

    // The empty export name picks the first image, on both transports.
    let unix_default = format!("nbd+unix:///?socket={}", server.socket.display());
    qemu_io(&unix_default, &["read -P 0xa1 0 64k"]);
    for uri in [unix_default, format!("nbd://{listen}/"), format!("nbd://{listen}")] {
        let info = json(&run("nbdinfo", &["--json", &uri]));
        assert_eq!(info["exports"][0]["export-size"], 16 * MIB as u64, "{uri}: {info}");
    }

    // An unknown export name is refused.
    let out = output("qemu-io", &["-f", "raw", &format!("nbd://{listen}/nope"), "-c", "read 0 4k"]);
    assert!(!out.status.success(), "export 'nope' was opened:\n{}", text(&out));
    server.stop();
    assert!(std::net::TcpStream::connect(&listen).is_err(), "{listen} still accepts connections after stop");
    assert_filled(&read_file(Path::new(&b)), 64 * KIB, 64 * KIB, 0xb3);
    assert_filled(&read_file(Path::new(&a)), 64 * KIB, 64 * KIB, 0);
}

/// A pattern write/read (plus FUA and flush) on a server started with `extra`.
fn pattern_roundtrip(tag: &str, extra: &[&str]) {
    let (dir, img, server) = serve_new_disk(tag, "16M", extra);
    let uri = server.uri("disk");
    qemu_io(
        &uri,
        &[
            "write -P 0x5c 0 2M",
            "write -f -P 0x5d 3M 4k",
            "write -z 1M 64k",
            "flush",
            "read -P 0x5c 0 1M",
            "read -P 0 1M 64k",
            "read -P 0x5c 1088k 960k",
            "read -P 0x5d 3M 4k",
        ],
    );
    // Many requests in flight at once, whatever the number of workers.
    fio_verify(&dir, &uri, "8M", "4M");
    server.stop();
    let d = read_file(Path::new(&img));
    assert_filled(&d, 3 * MIB, 4096, 0x5d);
}

#[test]
fn serve_sync() {
    pattern_roundtrip("sync", &["--sync"]);
    pattern_roundtrip("sync-threads", &["--engine", "threads", "--sync"]);
}

#[test]
fn serve_one_worker() {
    // --workers sizes the thread engine's pool.
    pattern_roundtrip("workers", &["--engine", "threads", "--workers", "1"]);
}

#[test]
fn serve_unbatched_and_sqpoll() {
    pattern_roundtrip("batch1-threads", &["--engine", "threads", "--batch", "1"]);
    pattern_roundtrip("batch1-uring", &["--engine", "uring", "--batch", "1"]);
    pattern_roundtrip("sqpoll", &["--engine", "uring", "--sqpoll", "--rings", "2"]);
}

#[test]
fn nbdsh_flush_then_second_connection() {
    let (_dir, img, server) = serve_new_disk("nbdsh", "16M", &[]);
    let uri = server.uri("disk");
    let script = format!(
        r#"
assert h.can_multi_conn()
h.pwrite(b"x" * 4096, 0)
h.flush()
h2 = nbd.NBD()
h2.connect_uri({uri:?})
assert h2.pread(4096, 0) == b"x" * 4096
h2.pwrite(b"y" * 4096, 131072, nbd.CMD_FLAG_FUA)
assert h.pread(4096, 131072) == b"y" * 4096
h.cache(65536, 0)
# Data, 124 KiB of zeroes, data: with DF it must still come as one chunk.
chunks = []
def chunk(buf, offset, status, err):
    chunks.append((offset, status, len(buf)))
    return 0
buf = h.pread_structured(135168, 0, chunk, nbd.CMD_FLAG_DF)
assert buf == b"x" * 4096 + bytes(126976) + b"y" * 4096, "DF read returned the wrong data"
assert len(chunks) == 1, "DF read came in %d chunks: %r" % (len(chunks), chunks)
assert h.pread(135168, 0) == buf
try:
    h.zero(65536, 1 << 20, nbd.CMD_FLAG_FAST_ZERO)
except nbd.Error as e:
    assert e.errno == "ENOTSUP", "fast zero failed: %s" % e
assert h.pread(65536, 1 << 20) == bytes(65536)
h2.shutdown()
print("ok")
"#
    );
    assert_eq!(nbdsh(&uri, &script).trim(), "ok");
    // A fresh client, in another process, sees the flushed data too.
    let said = nbdsh(&uri, r#"print(h.pread(4096, 0) == b"x" * 4096, h.pread(4096, 131072) == b"y" * 4096)"#);
    assert_eq!(said.trim(), "True True");
    server.stop();
    let d = read_file(Path::new(&img));
    assert_filled(&d, 0, 4096, b'x');
    assert_filled(&d, 4096, 126976, 0);
    assert_filled(&d, 131072, 4096, b'y');
}

#[test]
fn qemu_io_large_unaligned_requests() {
    let (_dir, img, server) = serve_new_disk("large", "64M", &[]);
    let uri = server.uri("disk");
    // 40 MiB at an odd offset: more than the 32 MiB maximum block size, so
    // qemu splits it at the limit the server advertised.
    qemu_io(
        &uri,
        &["write -P 0x21 511 40M", "read -P 0x21 511 40M", "read -P 0 0 511", "read -P 0 41943551 4096", "flush"],
    );
    // Exactly the maximum in one request.
    let said = nbdsh(
        &uri,
        r#"
h.pwrite(b"\x22" * (32 << 20), 32 << 20)
assert h.pread(32 << 20, 32 << 20) == b"\x22" * (32 << 20)
print("ok")
"#,
    );
    assert_eq!(said.trim(), "ok");
    server.stop();
    let d = read_file(Path::new(&img));
    assert_filled(&d, 0, 511, 0);
    assert_filled(&d, 511, 32 * MIB - 511, 0x21);
    assert_filled(&d, 32 * MIB, 32 * MIB, 0x22);
}

#[test]
fn sigterm_under_load_exits_cleanly() {
    let (dir, _img, server) = serve_new_disk("load", "32M", &[]);
    let uri = format!("--uri={}", server.uri("disk"));
    let mut fio = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &uri,
            "--rw=randrw",
            "--bs=64k",
            "--iodepth=16",
            "--size=32M",
            "--time_based",
            "--runtime=20",
        ])
        .current_dir(&dir.0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run fio: {e} (is it installed?)"));
    // Let fio connect and get going (no timing is asserted).
    std::thread::sleep(std::time::Duration::from_millis(700));
    assert!(fio.try_wait().unwrap().is_none(), "fio stopped before the server was signalled");
    // Clean exit 0 and socket removed, while requests are in flight.
    server.stop();
    let _ = fio.kill();
    let _ = fio.wait();
}
