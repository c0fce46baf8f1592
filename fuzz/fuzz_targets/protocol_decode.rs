//! Every client→server decoder fed arbitrary bytes: the first 16 bytes are the header
//! (validated first, as the server does), one byte picks the fd count and the limits, the
//! rest is the payload. Also the reply decoders of server→client DMA and VERSION
//! negotiation. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use umdev::protocol::dma_rw::{
    decode_dma_read_reply, decode_dma_rw_request, decode_dma_write_reply,
};
use umdev::protocol::version::{negotiate, ServerOffer, Version};
use umdev::protocol::{decode_request, Header, Limits, MessageType, HEADER_SIZE};

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_SIZE + 1 {
        return;
    }
    let knobs = data[HEADER_SIZE];
    let payload = &data[HEADER_SIZE + 1..];
    let Ok(mut hdr) = Header::decode(&data[..HEADER_SIZE]) else {
        return;
    };
    let _ = hdr.validate(1 << 20);
    // Let the size field agree with the payload most of the time.
    if knobs & 0x80 == 0 {
        hdr.msg_size = (HEADER_SIZE + payload.len()) as u32;
    }
    let limits = Limits {
        max_data_xfer_size: if knobs & 0x40 != 0 { 4096 } else { 1 << 20 },
        max_msg_fds: 16,
        pgsize: 4096,
        write_multiple: knobs & 0x20 != 0,
    };
    let nfds = (knobs & 0x1f) as usize;
    if let Ok((MessageType::Command, _)) = hdr.validate(u32::MAX) {
        if let Ok(req) = decode_request(&hdr, payload, nfds, &limits) {
            let _ = format!("{req:?}");
        }
    }
    if let Ok(v) = Version::decode(payload) {
        let offer = ServerOffer {
            max_msg_fds: 16,
            max_data_xfer_size: 1 << 20,
            max_dma_maps: 65535,
            pgsize: 4096,
            twin_socket: knobs & 1 != 0,
        };
        if let Ok(n) = negotiate(&v, &offer, HEADER_SIZE + payload.len()) {
            let _ = n.reply.encode_payload();
        }
    }
    let _ = decode_dma_rw_request(payload);
    let iova = u64::from(hdr.msg_id) << 12;
    let count = u64::from(hdr.error);
    let _ = decode_dma_read_reply(payload, iova, count);
    let _ = decode_dma_write_reply(payload, iova, count);
});
