//! The NBD meta-context options (NBD_OPT_LIST_META_CONTEXT and
//! NBD_OPT_SET_META_CONTEXT): byte 0 picks LIST or SET and whether
//! structured replies come first; the rest is the option's data. Parsed,
//! matched and run through the handshake (see `fuzzing::meta_context_input`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vdisk_nbd::{fuzzing, Export};

static EXPORTS: OnceLock<Vec<Export>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let exports = EXPORTS.get_or_init(fuzzing::default_exports);
    fuzzing::meta_context_input(data, exports);
});
