//! Fuzzes every decoder of bytes from the network (frame and stream headers, control messages).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = wiretrain_comm::untrusted::decode_untrusted(data);
});
