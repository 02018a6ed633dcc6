//! NBD wire-protocol tests for `vdisk serve`.
//!
//! A deliberately small raw client (`common::nbd`) talks to the real binary
//! over its Unix socket, so every byte the server sends or expects is checked,
//! including the error paths that well-behaved clients (qemu, libnbd) never
//! take. The tests are grouped as handshake, transmission, errors and
//! robustness; hostile clients at scale (10,000 connections, a client that
//! never reads, every request size) are in abuse.rs.

mod common;

use common::nbd::*;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::Duration;

// ---------------------------------------------------------------------------
// Handshake and options
// ---------------------------------------------------------------------------

#[test]
fn list_returns_every_export_then_ack() {
    let fx = Fixture::with_images("list", &[("alpha", "1M"), ("beta", "2M")], &[]);
    let mut c = Client::handshake(fx.sock());
    let replies = c.option(OPT_LIST, &[]);
    let (last, servers) = replies.split_last().unwrap();
    assert_eq!(last.typ, REP_ACK, "LIST must end with ACK: {replies:?}");
    let mut names: Vec<String> = servers
        .iter()
        .map(|r| {
            assert_eq!(r.typ, REP_SERVER, "LIST reply type");
            let mut cur = Cursor(&r.data);
            let n = cur.u32() as usize;
            assert!(n + 4 <= r.data.len(), "REP_SERVER name length {n} beyond reply");
            cur.string(n)
        })
        .collect();
    names.sort();
    assert_eq!(names, ["alpha", "beta"]);
    // Negotiation goes on.
    let info = c.go("beta", &[]).expect("GO after LIST");
    assert_eq!(info.size, 2 * MIB);
    c.disconnect();
    fx.stop();
}

#[test]
fn list_with_data_is_invalid() {
    let fx = Fixture::new("list-data", &[]);
    let mut c = Client::handshake(fx.sock());
    let replies = c.option(OPT_LIST, &[0, 0, 0, 4]);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].typ, REP_ERR_INVALID);
    c.go("disk", &[]).expect("GO after a rejected LIST");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn info_reports_export_and_requested_information() {
    let fx = Fixture::new("info", &[]);
    let mut c = Client::handshake(fx.sock());

    // NBD_INFO_EXPORT comes even when nothing is requested.
    let plain = c.info("disk", &[]).expect("INFO");
    assert_eq!(plain.size, DISK_SIZE);
    assert_ne!(plain.flags & TF_HAS_FLAGS, 0);

    // An information type the server does not know (99) is ignored.
    let info = c.info("disk", &[99, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]).expect("INFO with requests");
    assert_eq!(info.size, DISK_SIZE);
    assert_eq!(info.flags, plain.flags, "same export, same flags");
    assert_eq!(info.name.as_deref(), Some("disk"), "NBD_INFO_NAME");
    assert!(info.description.is_some(), "NBD_INFO_DESCRIPTION was requested but not sent");
    assert_eq!(info.block_size, Some([1, 4096, MAX_PAYLOAD]), "NBD_INFO_BLOCK_SIZE");

    // INFO does not leave negotiation: GO still works and gives the same answer.
    let go = c.go("disk", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]).expect("GO after INFO");
    assert_eq!((go.size, go.flags), (info.size, info.flags));
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn go_reports_requested_information_and_enters_transmission() {
    let fx = Fixture::new("go", &[]);
    let mut c = Client::handshake(fx.sock());
    let info = c.go("disk", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]).expect("GO");
    assert_eq!(info.size, DISK_SIZE);
    assert_eq!(info.name.as_deref(), Some("disk"));
    assert!(info.description.is_some(), "NBD_INFO_DESCRIPTION was requested but not sent");
    assert_eq!(info.block_size, Some([1, 4096, MAX_PAYLOAD]));
    let data = pattern(1, 4096);
    c.write(8192, &data, 0);
    assert_eq!(c.read(8192, 4096), data);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_export_is_err_unknown() {
    let fx = Fixture::new("unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    assert_eq!(c.info("nosuch", &[]).unwrap_err(), REP_ERR_UNKNOWN, "INFO of an unknown export");
    assert_eq!(c.go("nosuch", &[INFO_NAME]).unwrap_err(), REP_ERR_UNKNOWN, "GO to an unknown export");
    c.go("disk", &[]).expect("GO after a failed GO");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn empty_name_selects_the_first_image() {
    let fx = Fixture::with_images("default", &[("first", "1M"), ("second", "2M")], &[]);
    let mut c = Client::handshake(fx.sock());
    let info = c.info("", &[INFO_NAME]).expect("INFO of the default export");
    assert_eq!(info.size, MIB, "default export is the first image");
    assert_eq!(info.name.as_deref(), Some("first"), "canonical name of the default export");

    let info = c.go("", &[]).expect("GO to the default export");
    assert_eq!(info.size, MIB);
    let data = pattern(2, 512);
    c.write(MIB - 512, &data, 0);
    c.disconnect();

    // The same bytes are visible through the explicit name.
    let (mut named, _) = Client::open(fx.sock(), "first");
    assert_eq!(named.read(MIB - 512, 512), data);
    named.disconnect();
    fx.stop();
}

#[test]
fn transmission_flags_of_a_writable_export() {
    let fx = Fixture::new("flags", &[]);
    let want = TF_HAS_FLAGS
        | TF_SEND_FLUSH
        | TF_SEND_FUA
        | TF_SEND_TRIM
        | TF_SEND_WRITE_ZEROES
        | TF_SEND_FAST_ZERO
        | TF_SEND_CACHE
        | TF_CAN_MULTI_CONN;
    let mut c = Client::handshake(fx.sock());
    let before = c.info("disk", &[]).expect("INFO").flags;
    assert_eq!(before & want, want, "flags {before:#06x} lack {:#06x}", want & !before);
    assert_eq!(before & TF_READ_ONLY, 0, "READ_ONLY on a writable export");
    assert_eq!(before & TF_SEND_DF, 0, "SEND_DF must be clear without structured replies");

    c.structured_reply();
    let after = c.go("disk", &[]).expect("GO").flags;
    assert_eq!(after & want, want, "flags {after:#06x} lack {:#06x}", want & !after);
    assert_ne!(after & TF_SEND_DF, 0, "SEND_DF once structured replies are negotiated");
    c.disconnect();
    fx.stop();
}

#[test]
fn transmission_flags_of_a_readonly_export() {
    let fx = Fixture::new("flags-ro", &["--readonly"]);
    let (c, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_HAS_FLAGS, 0, "HAS_FLAGS");
    assert_ne!(info.flags & TF_READ_ONLY, 0, "READ_ONLY with --readonly: {:#06x}", info.flags);
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_reply_is_acknowledged() {
    let fx = Fixture::new("structured", &[]);
    let mut c = Client::handshake(fx.sock());
    // The option takes no data.
    let replies = c.option(OPT_STRUCTURED_REPLY, &[0; 4]);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].typ, REP_ERR_INVALID, "STRUCTURED_REPLY with data");
    c.structured_reply();
    c.go("disk", &[]).expect("GO");
    // A READ now comes as chunks.
    let r = c.call(0, CMD_READ, 0, 4096, &[]);
    r.assert_ok("structured READ");
    assert!(!r.simple, "READ answered with a simple reply after STRUCTURED_REPLY");
    c.disconnect();
    fx.stop();
}

#[test]
fn set_meta_context_before_structured_reply_is_invalid() {
    let fx = Fixture::new("meta-early", &[]);
    let mut c = Client::handshake(fx.sock());
    let r = c.meta_context(OPT_SET_META_CONTEXT, "disk", &[BASE_ALLOCATION]);
    assert_eq!(r.unwrap_err(), REP_ERR_INVALID);
    c.go("disk", &[]).expect("GO after the rejected option");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn set_meta_context_selects_base_allocation() {
    let fx = Fixture::new("meta-set", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_SET_META_CONTEXT, "disk", &[BASE_ALLOCATION]).expect("SET_META_CONTEXT");
    assert_eq!(contexts.len(), 1, "{contexts:?}");
    assert_eq!(contexts[0].1, BASE_ALLOCATION);
    let id = contexts[0].0;
    c.go("disk", &[]).expect("GO");
    let (got, _) = c.call(0, CMD_BLOCK_STATUS, 0, 4096, &[]).block_status();
    assert_eq!(got, id, "BLOCK_STATUS context id");
    c.disconnect();
    fx.stop();
}

#[test]
fn list_meta_context_with_base_query_lists_base_allocation() {
    let fx = Fixture::new("meta-list", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_LIST_META_CONTEXT, "disk", &["base:"]).expect("LIST_META_CONTEXT");
    assert!(contexts.iter().any(|(_, n)| n == BASE_ALLOCATION), "base: query listed {contexts:?}");
    assert!(contexts.iter().all(|(_, n)| n.starts_with("base:")), "base: query listed {contexts:?}");
    c.go("disk", &[]).expect("GO after LIST_META_CONTEXT");
    c.disconnect();
    fx.stop();
}

#[test]
fn list_meta_context_without_queries_lists_base_allocation() {
    let fx = Fixture::new("meta-list-all", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    let contexts = c.meta_context(OPT_LIST_META_CONTEXT, "disk", &[]).expect("LIST_META_CONTEXT");
    assert!(contexts.iter().any(|(_, n)| n == BASE_ALLOCATION), "listed {contexts:?}");
    c.disconnect_in_negotiation();
    fx.stop();
}

#[test]
fn set_meta_context_ignores_unknown_contexts() {
    let fx = Fixture::new("meta-unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    // Unknown namespaces must be ignored: nothing selected, still ACK.
    let contexts = c.meta_context(OPT_SET_META_CONTEXT, "disk", &["x-nosuch:thing"]).expect("SET_META_CONTEXT");
    assert!(contexts.is_empty(), "selected {contexts:?}");
    // A query whose length runs past the option data is invalid.
    let mut bad = 4u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"disk");
    bad.extend_from_slice(&1u32.to_be_bytes());
    bad.extend_from_slice(&100u32.to_be_bytes());
    bad.extend_from_slice(b"base:");
    let replies = c.option(OPT_SET_META_CONTEXT, &bad);
    assert_eq!(replies.last().unwrap().typ, REP_ERR_INVALID, "{replies:?}");
    // Nothing is selected, so BLOCK_STATUS is refused.
    c.go("disk", &[]).expect("GO");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_option_is_unsupported_and_negotiation_continues() {
    let fx = Fixture::new("unknown-opt", &[]);
    let mut c = Client::handshake(fx.sock());
    // 99 is unassigned; 11 (EXTENDED_HEADERS) is what newer libnbd asks for.
    for (opt, data) in [(99, &b"some option data"[..]), (11, &[][..])] {
        let replies = c.option(opt, data);
        assert_eq!(replies.len(), 1, "option {opt}: {replies:?}");
        assert_eq!(replies[0].typ, REP_ERR_UNSUP, "option {opt}");
    }
    c.go("disk", &[]).expect("GO after an unknown option");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_without_zeroes() {
    let fx = Fixture::new("export-name", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = c.bytes(10).expect("EXPORT_NAME reply");
    let mut cur = Cursor(&reply);
    assert_eq!(cur.u64(), DISK_SIZE);
    assert_ne!(cur.u16() & TF_HAS_FLAGS, 0);
    // No 124 zero bytes: if they came, this reply would start with them and
    // fail on its magic.
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_with_zeroes() {
    let fx = Fixture::new("export-name-zeroes", &[]);
    let mut c = Client::connect(fx.sock());
    c.send_client_flags(FLAG_C_FIXED_NEWSTYLE);
    c.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = c.bytes(10 + 124).expect("EXPORT_NAME reply with zeroes");
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), DISK_SIZE);
    assert!(is_zero(&reply[10..]), "the 124 reserved bytes are not zero");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn export_name_option_with_unknown_name_closes() {
    let fx = Fixture::new("export-name-unknown", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_EXPORT_NAME, b"nosuch");
    let stray = c.expect_closed("EXPORT_NAME of an unknown export");
    assert!(stray.is_empty(), "server sent {stray:02x?} before closing");
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn abort_is_acknowledged_and_closes() {
    let fx = Fixture::new("abort", &[]);
    let mut c = Client::handshake(fx.sock());
    c.send_option(OPT_ABORT, &[]);
    let r = c.recv_option_reply(OPT_ABORT);
    assert_eq!(r.typ, REP_ACK, "ABORT reply");
    assert!(r.data.is_empty());
    let stray = c.expect_closed("after OPT_ABORT");
    assert!(stray.is_empty(), "server sent {stray:02x?} after the ACK to ABORT");
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn bad_client_flags_close_only_that_connection() {
    let fx = Fixture::new("bad-flags", &[]);
    for flags in [1 << 31, FLAG_C_FIXED_NEWSTYLE | 1 << 2] {
        let mut c = Client::connect(fx.sock());
        c.send_client_flags(flags);
        let stray = c.expect_closed(&format!("client flags {flags:#x}"));
        assert!(stray.is_empty(), "server sent {stray:02x?} after bad client flags {flags:#x}");
    }
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn bad_option_magic_closes_only_that_connection() {
    let fx = Fixture::new("bad-opt-magic", &[]);
    let mut c = Client::handshake(fx.sock());
    let mut msg = 0x0123_4567_89ab_cdef_u64.to_be_bytes().to_vec();
    msg.extend_from_slice(&OPT_LIST.to_be_bytes());
    msg.extend_from_slice(&0u32.to_be_bytes());
    c.send(&msg);
    c.expect_closed("bad option magic");
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn client_closing_mid_handshake_leaves_server_working() {
    let fx = Fixture::new("mid-handshake", &[]);
    // Before the greeting is read.
    drop(UnixStream::connect(fx.sock()).unwrap());
    // After the greeting, before the client flags.
    drop(Client::connect(fx.sock()));
    // Half the client flags.
    Client::connect(fx.sock()).send(&[0, 0]);
    // Half an option header.
    Client::handshake(fx.sock()).send(&IHAVEOPT.to_be_bytes()[..6]);
    // An option header promising more data than is sent.
    let mut c = Client::handshake(fx.sock());
    let mut msg = IHAVEOPT.to_be_bytes().to_vec();
    msg.extend_from_slice(&OPT_GO.to_be_bytes());
    msg.extend_from_slice(&100u32.to_be_bytes());
    msg.extend_from_slice(&[0, 0, 0, 4, b'd']);
    c.send(&msg);
    drop(c);
    // An option sent, its reply never read.
    Client::handshake(fx.sock()).send_option(OPT_LIST, &[]);

    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Transmission
// ---------------------------------------------------------------------------

#[test]
fn read_write_round_trip() {
    let fx = Fixture::new("rw", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // Unaligned on purpose: the minimum block size is 1.
    let data = pattern(3, 10_000);
    c.write(12_345, &data, 0);
    assert_eq!(c.read(12_345, 10_000), data);
    let around = c.read(12_000, 11_000);
    assert!(is_zero(&around[..345]), "bytes before the write changed");
    assert_eq!(&around[345..10_345], &data[..]);
    assert!(is_zero(&around[10_345..]), "bytes after the write changed");
    // The last byte of the disk.
    c.write(DISK_SIZE - 1, &[0xab], 0);
    assert_eq!(c.read(DISK_SIZE - 1, 1), [0xab]);
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_write_round_trip() {
    let fx = Fixture::new("rw-structured", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let data = pattern(4, 300 * KIB as usize);
    c.write(MIB + 7, &data, 0);
    assert_eq!(c.read(MIB + 7, data.len() as u32), data);
    // Data and hole in one read.
    let mixed = c.read(MIB - 4096, 4096 + 7 + data.len() as u32 + 4096);
    assert!(is_zero(&mixed[..4096 + 7]));
    assert_eq!(&mixed[4096 + 7..4096 + 7 + data.len()], &data[..]);
    assert!(is_zero(&mixed[4096 + 7 + data.len()..]));
    c.disconnect();
    fx.stop();
}

#[test]
fn write_with_fua_and_flush() {
    let fx = Fixture::new("fua", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(5, 64 * KIB as usize);
    c.write(2 * MIB, &data, CMD_FLAG_FUA);
    c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    c.write(3 * MIB, &data, 0);
    c.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    assert_eq!(c.read(2 * MIB, data.len() as u32), data);
    assert_eq!(c.read(3 * MIB, data.len() as u32), data);
    c.disconnect();
    fx.stop();
}

#[test]
fn trim_then_read_is_zeros() {
    let fx = Fixture::new("trim", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(6, 256 * KIB as usize);
    c.write(MIB, &data, 0);
    c.call(0, CMD_TRIM, MIB, 128 * KIB as u32, &[]).assert_ok("TRIM");
    c.call(CMD_FLAG_FUA, CMD_TRIM, MIB + 128 * KIB, 64 * KIB as u32, &[]).assert_ok("TRIM with FUA");
    let back = c.read(MIB, data.len() as u32);
    assert!(is_zero(&back[..192 * KIB as usize]), "trimmed range does not read as zeros");
    assert_eq!(&back[192 * KIB as usize..], &data[192 * KIB as usize..], "data after the trim changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn write_zeroes_reads_back_zeros() {
    let fx = Fixture::new("write-zeroes", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let len = 64 * KIB as u32;
    for (i, flags) in [0, CMD_FLAG_NO_HOLE, CMD_FLAG_FAST_ZERO, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE].into_iter().enumerate()
    {
        let off = (i as u64 + 1) * MIB + 100;
        let data = pattern(7 + i as u64, len as usize + 200);
        c.write(off - 100, &data, 0);
        c.call(flags, CMD_WRITE_ZEROES, off, len, &[]).assert_ok(&format!("WRITE_ZEROES flags {flags:#x}"));
        let back = c.read(off - 100, len + 200);
        assert_eq!(&back[..100], &data[..100], "flags {flags:#x}: bytes before changed");
        assert!(is_zero(&back[100..100 + len as usize]), "flags {flags:#x}: not zeros");
        assert_eq!(&back[100 + len as usize..], &data[100 + len as usize..], "flags {flags:#x}: bytes after changed");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn cache_succeeds() {
    let fx = Fixture::new("cache", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.write(0, &pattern(8, 4096), 0);
    c.call(0, CMD_CACHE, 0, MIB as u32, &[]).assert_ok("CACHE");
    assert_eq!(c.read(0, 4096), pattern(8, 4096));
    c.disconnect();
    fx.stop();
}

/// Checks that `descriptors` answer a request of `len` bytes without
/// REQ_ONE (the first N-1 end inside it, the last reaches its end) and
/// returns the status of each byte of the request.
fn status_map(descriptors: &[(u32, u32)], len: u64) -> Vec<u32> {
    let mut map = Vec::with_capacity(len as usize);
    for (i, &(n, flags)) in descriptors.iter().enumerate() {
        assert!((map.len() as u64) < len, "descriptor {i} starts beyond the request: {descriptors:?}");
        assert_eq!(flags & !(STATE_HOLE | STATE_ZERO), 0, "unknown base:allocation flags {flags:#x}");
        let take = (n as u64).min(len - map.len() as u64);
        map.resize(map.len() + take as usize, flags);
    }
    assert_eq!(map.len() as u64, len, "descriptors cover only {} of {len} bytes: {descriptors:?}", map.len());
    map
}

#[test]
fn block_status_reports_holes_and_data() {
    let fx = Fixture::new("block-status", &[]);
    let (mut c, info, id) = Client::open_structured(fx.sock(), "disk");

    // A fresh sparse image is one hole that reads as zeros.
    let r = c.call(0, CMD_BLOCK_STATUS, 0, info.size as u32, &[]);
    r.assert_ok("BLOCK_STATUS");
    let (got, desc) = r.block_status();
    assert_eq!(got, id, "context id");
    let map = status_map(&desc, info.size);
    assert!(map.iter().all(|&f| f == STATE_HOLE | STATE_ZERO), "fresh image not all HOLE|ZERO: {desc:?}");

    // Written data is reported as data.
    let data = pattern(9, 64 * KIB as usize);
    c.write(4 * MIB, &data, 0);
    let r = c.call(0, CMD_BLOCK_STATUS, 0, 8 * MIB as u32, &[]);
    r.assert_ok("BLOCK_STATUS");
    let (got, desc) = r.block_status();
    assert_eq!(got, id);
    let map = status_map(&desc, 8 * MIB);
    let written = 4 * MIB as usize..(4 * MIB + 64 * KIB) as usize;
    assert!(map[written].iter().all(|&f| f == 0), "written range not reported as data (0): {desc:?}");
    assert!(map[..MIB as usize].iter().all(|&f| f == STATE_HOLE | STATE_ZERO), "untouched range not a hole: {desc:?}");

    // A request starting inside the data.
    let r = c.call(0, CMD_BLOCK_STATUS, 4 * MIB + 4096, 8192, &[]);
    let (_, desc) = r.block_status();
    assert!(status_map(&desc, 8192).iter().all(|&f| f == 0), "{desc:?}");
    c.disconnect();
    fx.stop();
}

#[test]
fn block_status_with_req_one_returns_one_descriptor() {
    let fx = Fixture::new("block-status-one", &[]);
    let (mut c, _, id) = Client::open_structured(fx.sock(), "disk");
    c.write(MIB, &pattern(10, 64 * KIB as usize), 0);
    for (offset, len, want) in
        [(0, 4 * MIB, STATE_HOLE | STATE_ZERO), (MIB, 4 * MIB, 0), (0, 4096, STATE_HOLE | STATE_ZERO)]
    {
        let r = c.call(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, offset, len as u32, &[]);
        r.assert_ok("BLOCK_STATUS with REQ_ONE");
        let (got, desc) = r.block_status();
        assert_eq!(got, id);
        assert_eq!(desc.len(), 1, "REQ_ONE at {offset}: {desc:?}");
        assert!(desc[0].0 as u64 <= len, "REQ_ONE descriptor longer than the request: {desc:?}");
        assert_eq!(desc[0].1, want, "REQ_ONE at {offset}: {desc:?}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_of_a_hole() {
    let fx = Fixture::new("read-hole", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let r = c.call(0, CMD_READ, 2 * MIB, 256 * KIB as u32, &[]);
    r.assert_ok("READ of a hole");
    assert!(!r.simple);
    assert!(!r.content_chunks().is_empty(), "no content chunk: {:?}", r.chunks);
    assert_ne!(r.chunks.last().unwrap().flags & REPLY_FLAG_DONE, 0, "last chunk lacks DONE");
    assert!(is_zero(&r.data), "hole does not read as zeros");
    c.disconnect();
    fx.stop();
}

#[test]
fn structured_read_with_df_is_one_chunk() {
    let fx = Fixture::new("read-df", &[]);
    let (mut c, info, _) = Client::open_structured(fx.sock(), "disk");
    assert_ne!(info.flags & TF_SEND_DF, 0);
    let data = pattern(11, 8192);
    c.write(MIB + 8192, &data, 0);
    // A hole, data, and a mixture of both (which must come as OFFSET_DATA).
    for (offset, len) in [(0, 64 * KIB), (MIB + 8192, 8192), (MIB, 64 * KIB)] {
        let r = c.call(CMD_FLAG_DF, CMD_READ, offset, len as u32, &[]);
        r.assert_ok("READ with DF");
        assert_eq!(r.content_chunks().len(), 1, "DF read at {offset}: {:?}", r.chunks);
        assert_eq!(r.chunks.len(), 1, "DF read at {offset} should be a single chunk: {:?}", r.chunks);
        assert_eq!(r.chunks[0].flags, REPLY_FLAG_DONE);
        let mut want = vec![0u8; len as usize];
        let lo = (MIB + 8192).max(offset);
        let hi = (MIB + 16384).min(offset + len);
        if lo < hi {
            want[(lo - offset) as usize..(hi - offset) as usize]
                .copy_from_slice(&data[(lo - MIB - 8192) as usize..(hi - MIB - 8192) as usize]);
            assert_eq!(r.chunks[0].typ, REPLY_TYPE_OFFSET_DATA, "DF read over data must be OFFSET_DATA");
        }
        assert_eq!(r.data, want, "DF read at {offset}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn fua_is_accepted_on_every_command() {
    // proto.md, command flags: FUA "is valid for all commands, provided
    // NBD_FLAG_SEND_FUA has been negotiated, in which case the server MUST
    // accept all commands with this bit set (even by ignoring the bit)".
    let fx = Fixture::new("fua-all", &[]);
    let mut refused = Vec::new();
    let (mut c, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_SEND_FUA, 0);
    c.write(0, &pattern(16, 4096), 0);
    for (name, typ, len) in [("READ", CMD_READ, 4096), ("FLUSH", CMD_FLUSH, 0), ("CACHE", CMD_CACHE, 4096)] {
        let r = c.call(CMD_FLAG_FUA, typ, 0, len, &[]);
        if r.error != 0 {
            refused.push(format!("{name}|FUA: error {}", r.error));
        } else if typ == CMD_READ {
            assert_eq!(r.data, pattern(16, 4096));
        }
    }
    c.disconnect();

    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    for (name, flags, typ) in [("BLOCK_STATUS", 0, CMD_BLOCK_STATUS), ("READ|DF", CMD_FLAG_DF, CMD_READ)] {
        let r = c.call(flags | CMD_FLAG_FUA, typ, 0, 4096, &[]);
        if r.error != 0 {
            refused.push(format!("{name}|FUA (structured): error {}", r.error));
        }
    }
    c.disconnect();
    fx.stop();
    assert!(refused.is_empty(), "commands refused with FUA set: {refused:#?}");
}

#[test]
fn writes_of_many_sizes_in_one_burst() {
    // Many WRITEs in one send: payloads that straddle the server's read
    // buffer, and payloads on both sides of any "read it directly" threshold.
    let fx = Fixture::new("burst", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let sizes =
        [1usize, 511, 4096, 200 << 10, 256 << 10, (256 << 10) + 1, (512 << 10) - 28, 512 << 10, (1 << 20) + 3, 5 << 20];
    let mut burst = Vec::new();
    let mut placed = Vec::new();
    let mut offset = 4096u64;
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(200 + i as u64, n);
        burst.extend_from_slice(&c.encode_request(0, CMD_WRITE, offset, n as u32, &data).1);
        placed.push((offset, data));
        offset += n as u64 + 1234;
    }
    c.send(&burst);
    for _ in 0..sizes.len() {
        c.recv().assert_ok("WRITE in a burst");
    }
    for (offset, data) in placed {
        assert_eq!(c.read(offset, data.len() as u32), data, "{}-byte WRITE at {offset}", data.len());
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn requests_trickled_in_small_pieces() {
    let fx = Fixture::new("trickle", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    for (i, size) in [10usize << 10, 300 << 10].into_iter().enumerate() {
        let data = pattern(17 + i as u64, size);
        let offset = MIB * (i as u64 + 1);
        let (cookie, msg) = c.encode_request(0, CMD_WRITE, offset, size as u32, &data);
        // The header a byte at a time, then the payload in uneven pieces;
        // short pauses let the server see each piece on its own.
        let mut at = 0;
        for step in [1; 28].into_iter().chain([5, 1000, 70_000, 1, 200_000]) {
            let end = (at + step).min(msg.len());
            c.send(&msg[at..end]);
            at = end;
            std::thread::sleep(Duration::from_millis(1));
        }
        c.send(&msg[at..]);
        let r = c.recv();
        assert_eq!(r.cookie, cookie);
        r.assert_ok("trickled WRITE");
        assert_eq!(c.read(offset, size as u32), data, "{size}-byte trickled WRITE");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn large_commands_without_payload_succeed() {
    // TRIM, WRITE_ZEROES, CACHE and BLOCK_STATUS carry no payload: their
    // length is not bound by the 32 MiB maximum payload.
    let fx = Fixture::with_images("large-no-payload", &[("disk", "64M")], &[]);
    let (mut c, info, _) = Client::open_structured(fx.sock(), "disk");
    let len = 48 * MIB as u32;
    for i in 0..8 {
        c.write(i * 8 * MIB, &pattern(300 + i, 4096), 0);
    }
    c.call(0, CMD_WRITE_ZEROES, 0, len, &[]).assert_ok("48 MiB WRITE_ZEROES");
    c.call(0, CMD_TRIM, 8 * MIB, len, &[]).assert_ok("48 MiB TRIM");
    c.call(0, CMD_CACHE, 0, len, &[]).assert_ok("48 MiB CACHE");
    let r = c.call(0, CMD_BLOCK_STATUS, 0, info.size as u32, &[]);
    r.assert_ok("64 MiB BLOCK_STATUS");
    let (_, desc) = r.block_status();
    assert!(desc.iter().take(desc.len() - 1).map(|d| d.0 as u64).sum::<u64>() < info.size, "{desc:?}");
    // WRITE_ZEROES covered [0, 48 MiB), TRIM [8, 56 MiB); 56 MiB is untouched.
    for i in 0..7 {
        assert!(is_zero(&c.read(i * 8 * MIB, 4096)), "block at {} MiB not zeroed", i * 8);
    }
    assert_eq!(c.read(56 * MIB, 4096), pattern(307, 4096), "block at 56 MiB changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn writes_are_visible_on_other_connections_to_the_export() {
    // CAN_MULTI_CONN: what one connection wrote (and was told is done) the
    // others read.
    let fx = Fixture::new("multi-conn", &[]);
    let (mut a, info) = Client::open(fx.sock(), "disk");
    assert_ne!(info.flags & TF_CAN_MULTI_CONN, 0);
    let (mut b, _) = Client::open(fx.sock(), "disk");
    for i in 0..16 {
        let data = pattern(400 + i, 8192);
        a.write(i * 8192, &data, if i % 2 == 0 { CMD_FLAG_FUA } else { 0 });
        assert_eq!(b.read(i * 8192, 8192), data, "block {i} written on A, read on B");
    }
    a.call(0, CMD_FLUSH, 0, 0, &[]).assert_ok("FLUSH");
    a.disconnect();
    b.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Errors: each gets an error reply and the connection goes on
// ---------------------------------------------------------------------------

/// Sends one request that must fail with one of `errors`, then checks the
/// stream is still in sync.
fn expect_error(c: &mut Client, flags: u16, typ: u16, offset: u64, len: u32, payload: &[u8], errors: &[u32]) -> Reply {
    let r = c.call(flags, typ, offset, len, payload);
    assert!(
        errors.contains(&r.error),
        "command {typ} flags {flags:#x} offset {offset} len {len}: got error {}, want one of {errors:?}",
        r.error
    );
    assert!(r.data.is_empty(), "error reply carried data");
    c.assert_alive();
    r
}

#[test]
fn read_past_the_end_is_einval() {
    let fx = Fixture::new("err-read-end", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, DISK_SIZE - 512, 1024, &[], &[EINVAL]);
    expect_error(&mut c, 0, CMD_READ, DISK_SIZE, 1, &[], &[EINVAL]);
    expect_error(&mut c, 0, CMD_READ, u64::MAX - 100, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn write_past_the_end_is_enospc() {
    let fx = Fixture::new("err-write-end", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(12, 1024);
    expect_error(&mut c, 0, CMD_WRITE, DISK_SIZE - 512, 1024, &data, &[ENOSPC]);
    expect_error(&mut c, 0, CMD_WRITE, u64::MAX - 100, 1024, &data, &[ENOSPC]);
    // Nothing of the failed write landed.
    assert!(is_zero(&c.read(DISK_SIZE - 512, 512)));
    c.disconnect();
    fx.stop();
}

#[test]
fn zero_length_read_is_einval() {
    let fx = Fixture::new("err-read-zero", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, 0, 0, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn oversized_read_is_rejected() {
    let fx = Fixture::new("err-read-big", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_READ, 0, MAX_PAYLOAD + 1, &[], &[EINVAL, EOVERFLOW]);
    expect_error(&mut c, 0, CMD_READ, 0, u32::MAX, &[], &[EINVAL, EOVERFLOW]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_command_is_einval() {
    let fx = Fixture::new("err-cmd", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, 42, 0, 0, &[], &[EINVAL]);
    expect_error(&mut c, 0, 42, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn unknown_command_flags_are_einval() {
    let fx = Fixture::new("err-flags", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0x8000, CMD_READ, 0, 4096, &[], &[EINVAL]);
    expect_error(&mut c, 0x8000, CMD_FLUSH, 0, 0, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn write_to_readonly_export_is_eperm_and_payload_is_consumed() {
    let fx = Fixture::new("err-ro-write", &["--readonly"]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // A payload of zeros: if the server took it for requests it would see a
    // bad magic and close, and the READ after it would fail.
    expect_error(&mut c, 0, CMD_WRITE, 0, MIB as u32, &vec![0; MIB as usize], &[EPERM]);
    expect_error(&mut c, CMD_FLAG_FUA, CMD_WRITE, 4096, 100, &[0; 100], &[EPERM]);
    assert!(is_zero(&c.read(0, 8192)), "the read-only export changed");
    c.disconnect();
    fx.stop();
}

#[test]
fn trim_and_write_zeroes_on_readonly_export_are_eperm() {
    let fx = Fixture::new("err-ro-trim", &["--readonly"]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_TRIM, 0, 4096, &[], &[EPERM]);
    expect_error(&mut c, 0, CMD_WRITE_ZEROES, 0, 4096, &[], &[EPERM]);
    c.disconnect();
    fx.stop();
}

#[test]
fn block_status_without_meta_context_is_einval() {
    let fx = Fixture::new("err-bs", &[]);
    // With structured replies but no context selected.
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    c.go("disk", &[]).expect("GO");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    // Without structured replies at all.
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, 0, CMD_BLOCK_STATUS, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn df_without_structured_replies_is_einval() {
    let fx = Fixture::new("err-df", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    expect_error(&mut c, CMD_FLAG_DF, CMD_READ, 0, 4096, &[], &[EINVAL]);
    c.disconnect();
    fx.stop();
}

#[test]
fn oversized_write_gets_an_error_and_the_stream_stays_in_sync() {
    let fx = Fixture::new("err-write-big", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let len = MAX_PAYLOAD + 4096;
    let cookie = c.send_request(0, CMD_WRITE, 0, len, &[]);
    // The payload goes from another thread, so an early error reply cannot
    // deadlock us against a server that reads it only after replying.
    let mut w = c.sock.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&pattern(13, len as usize)));
    match c.try_recv() {
        Ok(r) => {
            assert_eq!(r.cookie, cookie);
            assert_ne!(r.error, 0, "a {len}-byte WRITE succeeded");
            writer.join().unwrap().expect("server stopped reading the payload of the rejected WRITE");
            c.assert_alive();
            assert!(is_zero(&c.read(0, 4096)), "the rejected WRITE changed the disk");
            c.disconnect();
        }
        Err(e) => {
            let _ = writer.join();
            eprintln!("NOTE: the server closed the connection on a {len}-byte WRITE ({e})");
            let (mut c, _) = Client::open(fx.sock(), "disk");
            c.assert_alive();
            c.disconnect();
        }
    }
    fx.stop();
}

#[test]
fn structured_read_error_is_an_error_chunk_with_done() {
    let fx = Fixture::new("err-structured", &[]);
    let (mut c, _, _) = Client::open_structured(fx.sock(), "disk");
    let r = expect_error(&mut c, 0, CMD_READ, DISK_SIZE - 512, 1024, &[], &[EINVAL]);
    assert!(!r.simple, "READ error came as a simple reply in structured mode");
    let last = r.chunks.last().unwrap();
    assert_eq!(last.typ, REPLY_TYPE_ERROR, "{:?}", r.chunks);
    assert_ne!(last.flags & REPLY_FLAG_DONE, 0, "error chunk lacks DONE");
    assert!(r.content_chunks().is_empty(), "content with the error: {:?}", r.chunks);
    c.disconnect();
    fx.stop();
}

// ---------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let fx = Fixture::new("bad-magic", &[]);
    let (mut keeper, _) = Client::open(fx.sock(), "disk");
    let (mut bad, _) = Client::open(fx.sock(), "disk");
    keeper.write(0, &pattern(14, 4096), 0);
    bad.assert_alive();
    let mut msg = 0xdead_beef_u32.to_be_bytes().to_vec();
    msg.extend_from_slice(&[0; 24]);
    bad.send(&msg);
    let stray = bad.expect_closed("bad request magic");
    assert!(stray.is_empty(), "server sent {stray:02x?} before closing");
    assert_eq!(keeper.read(0, 4096), pattern(14, 4096));
    keeper.disconnect();
    let (c, _) = Client::open(fx.sock(), "disk");
    c.disconnect();
    fx.stop();
}

#[test]
fn pipelined_requests_all_get_matching_replies() {
    const N: u64 = 256;
    const LEN: u32 = 4096;
    let fx = Fixture::new("pipeline", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    // Cookie -> is it a READ.
    let mut outstanding = HashMap::new();
    for i in 0..N {
        outstanding.insert(c.send_request(0, CMD_WRITE, i * 8192, LEN, &pattern(i, LEN as usize)), false);
    }
    for i in 0..N {
        outstanding.insert(c.send_request(0, CMD_READ, i * 8192, LEN, &[]), true);
    }
    assert_eq!(outstanding.len() as u64, 2 * N, "cookies are not distinct");
    for _ in 0..2 * N {
        let r = c.recv();
        r.assert_ok("pipelined request");
        let is_read = outstanding
            .remove(&r.cookie)
            .unwrap_or_else(|| panic!("reply for cookie {:#x} that was never sent or already answered", r.cookie));
        // A READ sent before a WRITE was acknowledged may or may not see it,
        // so only the length is checked here, the contents below.
        assert_eq!(r.data.len(), if is_read { LEN as usize } else { 0 });
    }
    assert!(outstanding.is_empty());
    // Every write is acknowledged now: all the data must be there.
    for i in 0..N {
        assert_eq!(c.read(i * 8192, LEN), pattern(i, LEN as usize), "block {i}");
    }
    c.disconnect();
    fx.stop();
}

#[test]
fn disc_closes_after_answering_outstanding_requests() {
    let fx = Fixture::new("disc", &[]);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    let data = pattern(15, 64 * KIB as usize);
    // A WRITE and the DISC right behind it: the WRITE must still be answered.
    let cookie = c.send_request(0, CMD_WRITE, 0, data.len() as u32, &data);
    c.send_request(0, CMD_DISC, 0, 0, &[]);
    let r = c.recv();
    assert_eq!(r.cookie, cookie);
    r.assert_ok("WRITE before DISC");
    let stray = c.expect_closed("after NBD_CMD_DISC");
    assert!(stray.is_empty(), "server sent {} bytes after NBD_CMD_DISC", stray.len());

    let (mut c, _) = Client::open(fx.sock(), "disk");
    assert_eq!(c.read(0, data.len() as u32), data);
    c.disconnect();
    fx.stop();
}

#[test]
fn two_exports_serve_two_clients_at_once() {
    let fx = Fixture::with_images("two", &[("one", "16M"), ("two", "16M")], &[]);
    let start = Arc::new(Barrier::new(2));
    let sock = fx.sock().to_path_buf();
    let (s1, b1) = (sock.clone(), start.clone());
    let writer = std::thread::spawn(move || {
        let (mut c, _) = Client::open(&s1, "one");
        b1.wait();
        for i in 0..64 {
            let data = pattern(100 + i, 64 * KIB as usize);
            c.write(i * 64 * KIB, &data, 0);
            assert_eq!(c.read(i * 64 * KIB, data.len() as u32), data, "export one, block {i}");
        }
        c.disconnect();
    });
    let (s2, b2) = (sock, start);
    let reader = std::thread::spawn(move || {
        let (mut c, _) = Client::open(&s2, "two");
        b2.wait();
        for i in 0..64 {
            assert!(
                is_zero(&c.read(i * 64 * KIB, 64 * KIB as u32)),
                "export two, block {i}: writes leaked across exports"
            );
        }
        c.disconnect();
    });
    writer.join().expect("writer on export one");
    reader.join().expect("reader on export two");

    let (mut one, _) = Client::open(fx.sock(), "one");
    let (mut two, _) = Client::open(fx.sock(), "two");
    assert_eq!(one.read(63 * 64 * KIB, 64 * KIB as u32), pattern(163, 64 * KIB as usize));
    assert!(is_zero(&two.read(0, 4 * MIB as u32)), "export two changed");
    one.disconnect();
    two.disconnect();
    fx.stop();
}

#[test]
fn sigterm_with_clients_connected_stops_cleanly() {
    let fx = Fixture::new("sigterm", &[]);
    let (mut idle, _) = Client::open(fx.sock(), "disk");
    idle.assert_alive();
    let negotiating = Client::handshake(fx.sock());
    let (mut busy, _) = Client::open(fx.sock(), "disk");
    let data = pattern(19, 64 * KIB as usize);
    let cookie = busy.send_request(0, CMD_WRITE, 0, data.len() as u32, &data);
    // stop() asserts exit status 0 and that the socket file is gone.
    fx.stop();
    // The outstanding WRITE was answered before the connection closed.
    let r = busy.try_recv().expect("reply to the WRITE in flight at SIGTERM");
    assert_eq!(r.cookie, cookie);
    r.assert_ok("WRITE in flight at SIGTERM");
    busy.expect_closed("after SIGTERM");
    idle.expect_closed("after SIGTERM");
    negotiating.expect_closed("after SIGTERM");
}
