//! vfio-user wire types: encode/decode with validation. No I/O here.
//!
//! Every message starts with a 16-byte [`Header`]; the payload layout depends on the
//! [`Command`]. Decoding goes header → fd count → payload size → fields → typed
//! [`Request`]; every size, count, offset and flag is checked, and anything wrong becomes a
//! [`ProtocolError`] whose [`ProtocolError::errno`] is what the error reply carries.
//! Integers are encoded explicitly in host byte order (the spec's "host endianness") by
//! [`wire`]; region info layouts follow `vfio-bindings`.
//!
//! Files, one message group each: [`version`], [`dma_map`], [`device_info`], [`set_irqs`],
//! [`region_access`], [`feature`] (DEVICE_FEATURE and MIG_DATA), [`dma_rw`] (server →
//! client), and [`request`] which ties them into [`decode_request`].

mod error;
mod header;

pub mod device_info;
pub mod dma_map;
pub mod dma_rw;
pub mod feature;
pub mod region_access;
pub mod request;
pub mod set_irqs;
pub mod version;
pub mod wire;

pub use error::ProtocolError;
pub use header::{
    Command, Header, MessageType, FLAGS_ERROR, FLAGS_NO_REPLY, FLAGS_TYPE_COMMAND, FLAGS_TYPE_MASK,
    FLAGS_TYPE_REPLY, HEADER_SIZE,
};
pub use request::{decode_request, Limits, Request};

/// Encode a whole message (header + payload) into one buffer.
pub fn encode_message(header: &Header, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_SIZE + payload.len());
    header.put(&mut out);
    out.extend_from_slice(payload);
    out
}
