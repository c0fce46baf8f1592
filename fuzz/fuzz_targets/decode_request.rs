//! Fuzz the vfio-user decoder: the input is a 16-byte header, one byte giving the number
//! of attached fds, and the payload. Decoding must never panic, and every error must map
//! to a non-zero errno.
#![no_main]

use libfuzzer_sys::fuzz_target;
use umdev::protocol::{decode_request, Header, Limits};

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let Ok(mut hdr) = Header::decode(&data[..16]) else {
        return;
    };
    let nfds = (data[16] % 20) as usize;
    let payload = &data[17..];
    hdr.msg_size = (16 + payload.len()) as u32;
    let limits = Limits {
        max_data_xfer_size: 1 << 20,
        max_msg_fds: 16,
        pgsize: 4096,
        write_multiple: data[16] & 0x80 != 0,
    };
    if hdr.validate(2 << 20).is_ok() {
        if let Err(e) = decode_request(&hdr, payload, nfds, &limits) {
            assert!(e.errno() > 0);
        }
    }
    let _ = umdev::protocol::version::Version::decode(payload);
});
