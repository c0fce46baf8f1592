//! The whole server connection loop fed from a byte stream: the bytes are written into a
//! socketpair whose other end is a server connection serving the test device, then the
//! client hangs up. The server must neither panic nor hang, and must release every DMA map
//! and pin at disconnect. Byte 0 is a knob: bit 0 offers twin-socket mode, bit 1 prepends
//! a valid VERSION command so the fuzzer spends its effort past negotiation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, rest)) = data.split_first() else {
        return;
    };
    let twin = knobs & 1 != 0;
    if knobs & 2 != 0 {
        let mut v = umdev_fuzz::version_message();
        v.extend_from_slice(rest);
        umdev_fuzz::run_stream(&v, twin);
    } else {
        umdev_fuzz::run_stream(rest, twin);
    }
});
