//! Fuzz the daemon's control-protocol decoder (`umdev::daemon::protocol`):
//! the input is what a control client sends, a JSON line and the payload it announces;
//! byte 0 chooses the reader's buffer size, so the line and the payload split anywhere.
//! Decoding must never panic; a decoded request's payload is exactly what it announces and
//! its buffer no larger; the response decoder (what the client reads) must not panic either.
#![no_main]

use std::io::BufReader;

use libfuzzer_sys::fuzz_target;
use umdev_fuzz::control_protocol::{
    decode_request, read_message, read_payload, Response, MAX_PAYLOAD,
};

fuzz_target!(|data: &[u8]| {
    let Some((&knob, input)) = data.split_first() else {
        return;
    };
    let capacity = match knob {
        0 => 8192,
        n => usize::from(n),
    };
    let mut reader = BufReader::with_capacity(capacity, input);
    if let Ok((request, payload)) = decode_request(&mut reader) {
        let announced = request.payload_len();
        assert!(announced <= MAX_PAYLOAD);
        assert_eq!(payload.len() as u64, announced);
        assert!(payload.capacity() as u64 <= announced.max(0));
    }
    // The client's side: a response line and the payload a `saved` reply announces.
    let mut reader = BufReader::with_capacity(capacity, input);
    if let Ok(message) = read_message(&mut reader) {
        if let Ok(response) = serde_json::from_slice::<Response>(&message) {
            if let Some(reply) = response.ok {
                let _ = read_payload(&mut reader, reply.payload_len().min(1 << 20));
            }
        }
    }
});
