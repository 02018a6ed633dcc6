//! The NBD fixed-newstyle handshake, fed a client's whole stream: byte 0 bit 0
//! says whether the server is shutting down, the rest is what the client sends.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vdisk_nbd::{fuzzing, Export};

static EXPORTS: OnceLock<Vec<Export>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let exports = EXPORTS.get_or_init(fuzzing::default_exports);
    fuzzing::handshake_input(data, exports);
});
