//! The transmission-phase request stream: headers parsed with
//! `RequestHeader::parse`, payloads skipped, each header run through the edge
//! validation. Byte 0 picks what was negotiated and the export's size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vdisk_nbd::fuzzing::requests_input(data);
});
