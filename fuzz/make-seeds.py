#!/usr/bin/env python3
"""Writes the NBD, virtio-blk, qcow2 and control-socket seed corpora (corpus/nbd_handshake,
corpus/nbd_requests, corpus/virtio_blk, corpus/qcow2_image, corpus/control_rpc, corpus/meta_context; the layout of a
virtio_blk input is in crates/vdisk-vhost/src/fuzzing.rs).
The cow_header seeds are made by uml_mkcow (see run.sh's header)."""
import os, struct

here = os.path.dirname(os.path.abspath(__file__))
IHAVEOPT = 0x49484156454F5054
REQ = 0x25609513


def opt(o, data=b""):
    return struct.pack(">QII", IHAVEOPT, o, len(data)) + data


def s(x):
    return struct.pack(">I", len(x)) + x


def go(name, infos=(), o=7):
    return opt(o, s(name) + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos))


def meta(o, name, queries):
    return opt(o, s(name) + struct.pack(">I", len(queries)) + b"".join(s(q) for q in queries))


def req(kind, offset=0, length=0, flags=0, cookie=1, payload=b""):
    return struct.pack(">IHHQQI", REQ, flags, kind, cookie, offset, length) + payload


flags = struct.pack(">I", 3)  # FIXED_NEWSTYLE | NO_ZEROES
handshakes = {
    "go_default": b"\0" + flags + go(b""),
    "go_named_infos": b"\0" + flags + go(b"disk", (0, 1, 2, 3)),
    "structured_meta_go": b"\0" + flags + opt(8) + meta(9, b"disk", [b"base:"]) + meta(10, b"disk", [b"base:allocation"]) + go(b"disk"),
    "list_info_go_ro": b"\0" + flags + opt(3) + go(b"ro", (3,), o=6) + go(b"ro"),
    "export_name_zeroes": b"\0" + struct.pack(">I", 1) + opt(1, b"big"),
    "unknown_then_abort": b"\0" + flags + opt(99, b"xyz") + go(b"nope") + opt(2),
    "shutting_down": b"\1" + flags + go(b"disk") + opt(2),
}
requests = {
    "read_write_flush": b"\x20" + req(0, 0, 4096) + req(1, 4096, 8, 1, 2, b"abcdefgh") + req(3, cookie=3) + req(2),
    "structured_status": b"\x23" + req(7, 0, 65536, 8) + req(0, 0, 512, 4) + req(6, 512, 512, 18) + req(4, 0, 4096),
    "read_only_refusals": b"\x24" + req(1, 0, 1, 0, 1, b"x") + req(4, 0, 1) + req(5, 0, 4096) + req(0, 4095, 2),
    "edges": b"\x38" + req(0, 2**64 - 4096, 4096) + req(0, 0, 2**32 - 1) + req(42, 0, 1) + req(3, 1, 0),
}
# virtio-blk: limits byte, head, 16 descriptors (addr, len, flags, next), then guest memory from 0x1000.
NEXT, WRITE, INDIRECT = 1, 2, 4
HDR, RANGE, DATA, STATUS = 0x1000, 0x1010, 0x2000, 0x3000


def chain(descs, mem=b"", limits=0b0110, head=0):
    table = b"".join(struct.pack("<QIHH", *d) for d in descs).ljust(256, b"\0")
    return bytes([limits, head]) + table + mem


def blk(kind, sector=0):
    return struct.pack("<IIQ", kind, 0, sector)


def simple(kind, data=None, sector=0, extra=b""):
    descs = [(HDR, 16, NEXT, 1)]
    if data:
        descs.append((data[0], data[1], data[2] | NEXT, 2))
    descs.append((STATUS, 1, WRITE, 0))
    return chain(descs, blk(kind, sector) + extra)


virtio = {
    "read": simple(0, (DATA, 512, WRITE), sector=8),
    "write": simple(1, (DATA, 1024, 0)),
    "flush": simple(4),
    "get_id": simple(8, (DATA, 20, WRITE)),
    "discard": simple(11, (RANGE, 16, 0), extra=struct.pack("<QII", 16, 8, 0)),
    "write_zeroes_unmap": simple(13, (RANGE, 16, 0), extra=struct.pack("<QII", 0, 64, 1)),
    # The head points at an indirect table (in guest memory at 0x1100) of three descriptors.
    "indirect_read": chain([(0x1100, 48, INDIRECT, 0)], blk(0).ljust(0x100, b"\0")
                           + struct.pack("<QIHH", HDR, 16, NEXT, 1) + struct.pack("<QIHH", DATA, 4096, WRITE | NEXT, 2)
                           + struct.pack("<QIHH", STATUS, 1, WRITE, 0)),
    "across_region_end": simple(0, (0xff00, 0x200, WRITE)),
}
for d, seeds in (("nbd_handshake", handshakes), ("nbd_requests", requests), ("virtio_blk", virtio)):
    os.makedirs(os.path.join(here, "corpus", d), exist_ok=True)
    for name, b in seeds.items():
        with open(os.path.join(here, "corpus", d, name), "wb") as f:
            f.write(b)


def qcow2_seeds():
    """Small qcow2 images (512-byte clusters, so a whole image fits in the
    8 KiB inputs run.sh allows) made by qemu-img in several shapes, with data
    clusters, zero clusters and a backing file name. Skipped without qemu-img."""
    import shutil, subprocess, tempfile
    if not shutil.which("qemu-img"):
        print("qemu-img not found: corpus/qcow2_image not written")
        return
    out_dir = os.path.join(here, "corpus", "qcow2_image")
    os.makedirs(out_dir, exist_ok=True)
    shapes = {
        "v3_rc16": "cluster_size=512",
        "v2": "cluster_size=512,compat=0.10",
        "v3_rc1": "cluster_size=512,refcount_bits=1",
        "v3_rc64": "cluster_size=512,refcount_bits=64",
        "v3_backing": "cluster_size=512,backing_file=base.raw,backing_fmt=raw",
        "v3_bitmaps": "cluster_size=512",
    }
    # A persistent bitmap (512-byte granularity, enabled) before the writes.
    bitmaps = {"v3_bitmaps": [["--add", "-g", "512", "b0"]]}
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "base.raw"), "wb").write(b"\x01" * 65536)
        for name, opts in shapes.items():
            img = os.path.join(tmp, name + ".qcow2")
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, img, "64K"], check=True, cwd=tmp)
            for b in bitmaps.get(name, []):
                subprocess.run(["qemu-img", "bitmap", *b[:-1], img, b[-1]], check=True, cwd=tmp)
            for cmd in ["write -P 0x5a 0 700", "write -z 4096 1024", "write -P 0x11 30000 100"]:
                subprocess.run(["qemu-io", "-f", "qcow2", "-c", cmd, img], check=True, cwd=tmp, capture_output=True)
            data = open(img, "rb").read()
            assert len(data) <= 8192, (name, len(data))
            open(os.path.join(out_dir, name), "wb").write(data)


def control_seeds():
    """One JSON-RPC request line per file, for every method, with each kind of
    param, plus a few of the mistakes the socket must answer clearly."""
    import json
    def r(method, params=None, id=1):
        o = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            o["params"] = params
        return (json.dumps(o) + "\n").encode()
    seeds = {
        "add_full": r("export_add", {"image": "/srv/a.img", "name": "a", "readonly": True, "format": "qcow2",
                                     "backing": "/srv/b.img", "ignore_backing_mtime": False, "fuse": "/srv/a.fuse",
                                     "vhost_user_blk": "/srv/a.sock", "num_queues": 4, "iops": 100, "bps": 1048576,
                                     "read_bps": 0, "write_bps": 7, "ceph_conf": "/etc/ceph/ceph.conf", "ceph_id": "x"}),
        "add_min": r("export_add", {"image": "rbd:pool/img@snap"}, id="s"),
        "remove": r("export_remove", {"name": "a", "hard": True}),
        "list": r("export_list"),
        "stats": r("export_stats", {"name": "a"}, id=None),
        "qos": r("export_set_qos", {"name": "a", "iops": 0, "write_bps": 99}),
        "info": r("server_info", {}),
        "reload": r("config_reload"),
        "notification": b'{"jsonrpc":"2.0","method":"export_list"}\n',
        "two_lines": r("export_list") + r("nosuch", [1]),
        "bad_types": r("export_add", {"image": 5, "num_queues": -1}),
        "deep": b"[" * 200 + b"]" * 200 + b"\n",
    }
    out_dir = os.path.join(here, "corpus", "control_rpc")
    os.makedirs(out_dir, exist_ok=True)
    for name, b in seeds.items():
        open(os.path.join(out_dir, name), "wb").write(b)


def meta_context_seeds():
    """Byte 0: bit 0 SET (else LIST), bit 1 structured replies first, bits 2.. the
    descriptor cap; then the option's data (crates/vdisk-nbd/src/fuzzing.rs)."""
    def data(name, queries):
        return s(name) + struct.pack(">I", len(queries)) + b"".join(s(q) for q in queries)
    seeds = {
        "list_all": bytes([0b10]) + data(b"disk", []),
        "list_qemu": bytes([0b10]) + data(b"disk", [b"qemu:", b"qemu:dirty-bitmap:", b"base:"]),
        "set_three": bytes([0b10111]) + data(b"disk", [b"base:allocation", b"qemu:allocation-depth",
                                                      b"qemu:dirty-bitmap:b0", b"qemu:dirty-bitmap:nope"]),
        "set_unstructured": bytes([0b1]) + data(b"disk", [b"qemu:dirty-bitmap:b:1"]),
    }
    out_dir = os.path.join(here, "corpus", "meta_context")
    os.makedirs(out_dir, exist_ok=True)
    for name, b in seeds.items():
        open(os.path.join(out_dir, name), "wb").write(b)


qcow2_seeds()
control_seeds()
meta_context_seeds()
