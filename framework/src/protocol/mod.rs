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
//! [`region_access`], [`feature`] (DEVICE_FEATURE), [`migration`] (the migration
//! features' payloads and MIG_DATA_READ/WRITE), [`dma_rw`] (server → client), and
//! [`request`] which ties them into [`decode_request`].

mod error;
mod header;

pub mod device_info;
pub mod dma_map;
pub mod dma_rw;
pub mod feature;
pub mod migration;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_wire_constants_keep_their_values() {
        // The literal values umdev had before the `linux/vfio.h` ones came from
        // vfio-bindings: a change there (or a name pointing at the wrong constant) would
        // change the wire.
        let table: [(&str, u64, u64); 14] = [
            (
                "DMA_MAP_FLAG_READ",
                dma_map::DMA_MAP_FLAG_READ.into(),
                1 << 0,
            ),
            (
                "DMA_MAP_FLAG_WRITE",
                dma_map::DMA_MAP_FLAG_WRITE.into(),
                1 << 1,
            ),
            ("DMA_MAP_SIZE", dma_map::DMA_MAP_SIZE as u64, 32),
            ("DMA_UNMAP_SIZE", dma_map::DMA_UNMAP_SIZE as u64, 24),
            (
                "DMA_UNMAP_FLAG_ALL",
                dma_map::DMA_UNMAP_FLAG_ALL.into(),
                1 << 1,
            ),
            (
                "DMA_UNMAP_LEGACY_FLAGS",
                dma_map::DMA_UNMAP_LEGACY_FLAGS.into(),
                0x7,
            ),
            ("DEVICE_INFO_SIZE", device_info::DEVICE_INFO_SIZE as u64, 16),
            ("REGION_INFO_SIZE", device_info::REGION_INFO_SIZE as u64, 32),
            (
                "SPARSE_CAP_HEADER_SIZE",
                device_info::SPARSE_CAP_HEADER_SIZE as u64,
                16,
            ),
            ("SPARSE_AREA_SIZE", device_info::SPARSE_AREA_SIZE as u64, 16),
            (
                "REGION_IO_FDS_SIZE",
                device_info::REGION_IO_FDS_SIZE as u64,
                16,
            ),
            ("IRQ_INFO_SIZE", device_info::IRQ_INFO_SIZE as u64, 16),
            ("SET_IRQS_SIZE", set_irqs::SET_IRQS_SIZE as u64, 20),
            (
                "FEATURE_HEADER_SIZE",
                feature::FEATURE_HEADER_SIZE as u64,
                8,
            ),
        ];
        for (name, value, wire) in table {
            assert_eq!(value, wire, "{name}");
        }
    }
}
