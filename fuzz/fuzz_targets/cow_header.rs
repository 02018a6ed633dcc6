//! The UML COW v3 overlay header parser (`vdisk_image::cow::parse_header`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vdisk_nbd::fuzzing::cow_header_input(data);
});
