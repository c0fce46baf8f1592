//! Server → client DMA_READ and DMA_WRITE: request encoding and reply validation.
//!
//! Layout per the spec: address u64, count u64, data. (QEMU 10.x declares `count` as u32
//! with its data at payload offset 12; see protocol-docs/server-dma.md.)

use super::wire::{Put, Reader};
use super::ProtocolError;

/// Size of the DMA_READ/DMA_WRITE fixed part (address, count).
pub const DMA_RW_SIZE: usize = 16;

/// The DMA_READ request payload.
pub fn encode_dma_read(iova: u64, count: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(DMA_RW_SIZE);
    v.put_u64(iova);
    v.put_u64(count);
    v
}

/// Append the DMA_WRITE request payload (address, count, data) to `out`.
pub fn put_dma_write(out: &mut Vec<u8>, iova: u64, data: &[u8]) {
    out.put_u64(iova);
    out.put_u64(data.len() as u64);
    out.extend_from_slice(data);
}

/// Validate a DMA_READ reply payload for a request of (`iova`, `count`); returns the data.
pub fn decode_dma_read_reply(
    payload: &[u8],
    iova: u64,
    count: u64,
) -> Result<&[u8], ProtocolError> {
    let mut r = Reader::new(payload, "DMA_READ reply");
    let addr = r.u64()?;
    let n = r.u64()?;
    if addr != iova || n != count {
        return Err(ProtocolError::invalid(
            "DMA_READ reply",
            format!("address/count {addr:#x}/{n} do not match the request {iova:#x}/{count}"),
        ));
    }
    let data = r.rest();
    if data.len() as u64 != count {
        return Err(ProtocolError::BadPayloadSize {
            what: "DMA_READ reply",
            expected: DMA_RW_SIZE + count as usize,
            got: payload.len(),
        });
    }
    Ok(data)
}

/// Validate a DMA_WRITE reply payload. Accepted: empty (QEMU answers with a bare header),
/// address + u32 count (the spec's table) or address + u64 count (libvfio-user); when
/// present, address and count must match.
pub fn decode_dma_write_reply(payload: &[u8], iova: u64, count: u64) -> Result<(), ProtocolError> {
    if payload.is_empty() {
        return Ok(());
    }
    let mut r = Reader::new(payload, "DMA_WRITE reply");
    let addr = r.u64()?;
    let n = match payload.len() {
        12 => r.u32()? as u64,
        16 => r.u64()?,
        got => {
            return Err(ProtocolError::BadPayloadSize {
                what: "DMA_WRITE reply",
                expected: DMA_RW_SIZE,
                got,
            })
        }
    };
    if addr != iova || n != count {
        return Err(ProtocolError::invalid(
            "DMA_WRITE reply",
            format!("address/count {addr:#x}/{n} do not match the request {iova:#x}/{count}"),
        ));
    }
    Ok(())
}

/// Decode a DMA_READ/DMA_WRITE *request* (for test clients that serve them).
pub fn decode_dma_rw_request(payload: &[u8]) -> Result<(u64, u64, &[u8]), ProtocolError> {
    let mut r = Reader::new(payload, "DMA_READ/WRITE");
    let addr = r.u64()?;
    let count = r.u64()?;
    Ok((addr, count, r.rest()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_dma_read_reply_must_match_request() {
        let mut p = encode_dma_read(0x1000, 4);
        p.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(decode_dma_read_reply(&p, 0x1000, 4).unwrap(), &[1, 2, 3, 4]);
        assert!(decode_dma_read_reply(&p, 0x2000, 4).is_err());
        assert!(decode_dma_read_reply(&p[..19], 0x1000, 4).is_err());
    }

    #[test]
    fn test_dma_write_reply_three_layouts_accepted() {
        assert!(decode_dma_write_reply(&[], 0x1000, 4).is_ok());
        let p = encode_dma_read(0x1000, 4);
        assert!(decode_dma_write_reply(&p, 0x1000, 4).is_ok());
        assert!(decode_dma_write_reply(&p[..12], 0x1000, 4).is_ok());
        assert!(decode_dma_write_reply(&p, 0x1000, 5).is_err());
        assert!(decode_dma_write_reply(&p[..9], 0x1000, 4).is_err());
    }
}
