//! The virtio-blk request parser (`vdisk_vhost::parse`) on a descriptor chain
//! the input controls (layout in crates/vdisk-vhost/src/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vdisk_vhost::fuzzing::virtio_blk_input(data);
});
