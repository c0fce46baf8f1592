//! Server → client DMA_READ and DMA_WRITE: request encoding and reply validation.
//!
//! Two layouts exist in the field ([`DmaRwLayout`]): the spec's (address u64, count u64,
//! data at payload offset 16) and QEMU 10.x's (`VFIOUserDMARW`: address u64, count u32,
//! data at payload offset 12, message padded to 32 + count bytes). The request of a
//! DMA_READ is the same 16 bytes in both; DMA_WRITE requests and DMA_READ replies differ.
//! See protocol-docs/server-dma.md.

use super::wire::{Put, Reader};
use super::ProtocolError;

/// Size of the DMA_READ/DMA_WRITE fixed part (address, count).
pub const DMA_RW_SIZE: usize = 16;

/// Where the data of a DMA_READ reply / DMA_WRITE request sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DmaRwLayout {
    /// The spec (and libvfio-user): count is a u64, data at payload offset 16.
    #[default]
    Spec,
    /// QEMU 10.x: count is a u32, data at payload offset 12, 4 bytes of padding at the end.
    Qemu,
}

impl DmaRwLayout {
    /// Append a DMA_WRITE request payload for `data` at `iova`.
    pub fn put_write(self, out: &mut Vec<u8>, iova: u64, data: &[u8]) {
        match self {
            DmaRwLayout::Spec => put_dma_write(out, iova, data),
            DmaRwLayout::Qemu => {
                out.put_u64(iova);
                out.put_u32(data.len() as u32);
                out.extend_from_slice(data);
                out.put_u32(0);
            }
        }
    }

    /// Validate a DMA_READ reply for (`iova`, `count`); returns the data.
    pub fn decode_read_reply(
        self,
        payload: &[u8],
        iova: u64,
        count: u64,
    ) -> Result<&[u8], ProtocolError> {
        match self {
            DmaRwLayout::Spec => decode_dma_read_reply(payload, iova, count),
            DmaRwLayout::Qemu => {
                let mut r = Reader::new(payload, "DMA_READ reply");
                let addr = r.u64()?;
                let n = r.u32()? as u64;
                if addr != iova || n != count {
                    return Err(ProtocolError::invalid(
                        "DMA_READ reply",
                        format!("address/count {addr:#x}/{n} do not match the request {iova:#x}/{count}"),
                    ));
                }
                if payload.len() as u64 != DMA_RW_SIZE as u64 + count {
                    return Err(ProtocolError::BadPayloadSize {
                        what: "DMA_READ reply (QEMU layout)",
                        expected: DMA_RW_SIZE + count as usize,
                        got: payload.len(),
                    });
                }
                r.bytes(count as usize)
            }
        }
    }
}

/// The DMA_READ request payload (identical in both layouts for counts below 4 GiB).
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
    fn test_qemu_layout_read_reply_data_at_offset_12() {
        let mut p = Vec::new();
        p.put_u64(0x1000);
        p.put_u32(4);
        p.extend_from_slice(&[9, 8, 7, 6]);
        p.put_u32(0);
        assert_eq!(
            DmaRwLayout::Qemu.decode_read_reply(&p, 0x1000, 4).unwrap(),
            &[9, 8, 7, 6]
        );
        assert!(DmaRwLayout::Qemu
            .decode_read_reply(&p[..19], 0x1000, 4)
            .is_err());
        assert!(DmaRwLayout::Qemu.decode_read_reply(&p, 0x1000, 5).is_err());
    }

    #[test]
    fn test_qemu_layout_write_request_padded_to_32_plus_count() {
        let mut p = Vec::new();
        DmaRwLayout::Qemu.put_write(&mut p, 0x2000, &[1, 2, 3]);
        assert_eq!(p.len(), 16 + 3);
        assert_eq!(&p[12..15], &[1, 2, 3]);
        let mut s = Vec::new();
        DmaRwLayout::Spec.put_write(&mut s, 0x2000, &[1, 2, 3]);
        assert_eq!(&s[16..], &[1, 2, 3]);
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
