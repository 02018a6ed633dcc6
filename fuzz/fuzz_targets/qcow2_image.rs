//! A whole qcow2 image file: header, extensions, L1/L2 and refcount tables
//! parsed, then read, written, zeroed and flushed in memory
//! (`vdisk_image::qcow2::fuzzing::image_input`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vdisk_image::qcow2::fuzzing::image_input(data);
});
