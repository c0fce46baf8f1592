//! REGION_READ, REGION_WRITE and REGION_WRITE_MULTI.

use super::wire::{Put, Reader};
use super::ProtocolError;

/// Size of the access header (offset 8, region 4, count 4).
pub const REGION_ACCESS_SIZE: usize = 16;
/// Size of one REGION_WRITE_MULTI entry.
pub const WRITE_MULTI_ENTRY_SIZE: usize = 24;
/// Largest data of one WRITE_MULTI entry.
pub const WRITE_MULTI_DATA: usize = 8;
/// Most entries umdev accepts in one WRITE_MULTI (QEMU's VFIO_USER_MULTI_MAX).
pub const WRITE_MULTI_MAX: u64 = 200;

/// A validated region access (read request, or write without its data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionAccess {
    /// Offset in the region.
    pub offset: u64,
    /// Region index.
    pub region: u32,
    /// Bytes.
    pub count: u32,
}

impl RegionAccess {
    fn read_from(r: &mut Reader<'_>, max_xfer: u32) -> Result<Self, ProtocolError> {
        let offset = r.u64()?;
        let region = r.u32()?;
        let count = r.u32()?;
        if count == 0 {
            return Err(ProtocolError::invalid("region access count", "count is 0"));
        }
        if count > max_xfer {
            return Err(ProtocolError::TransferTooLarge {
                count: count as u64,
                max: max_xfer as u64,
            });
        }
        if offset.checked_add(count as u64).is_none() {
            return Err(ProtocolError::invalid(
                "region access",
                format!("offset {offset:#x} + count {count} wraps"),
            ));
        }
        Ok(RegionAccess {
            offset,
            region,
            count,
        })
    }

    /// Decode a REGION_READ request: exactly 16 bytes, 0 < count ≤ max_xfer, no wrap.
    pub fn decode_read(payload: &[u8], max_xfer: u32) -> Result<Self, ProtocolError> {
        if payload.len() != REGION_ACCESS_SIZE {
            return Err(ProtocolError::BadPayloadSize {
                what: "REGION_READ",
                expected: REGION_ACCESS_SIZE,
                got: payload.len(),
            });
        }
        Self::read_from(&mut Reader::new(payload, "REGION_READ"), max_xfer)
    }

    /// Decode a REGION_WRITE request: header then exactly `count` bytes of data.
    pub fn decode_write(payload: &[u8], max_xfer: u32) -> Result<(Self, &[u8]), ProtocolError> {
        let mut r = Reader::new(payload, "REGION_WRITE");
        let a = Self::read_from(&mut r, max_xfer)?;
        let data = r.rest();
        if data.len() != a.count as usize {
            return Err(ProtocolError::BadPayloadSize {
                what: "REGION_WRITE",
                expected: REGION_ACCESS_SIZE + a.count as usize,
                got: payload.len(),
            });
        }
        Ok((a, data))
    }

    /// Encode the 16-byte access header (request or reply).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(REGION_ACCESS_SIZE + self.count as usize);
        self.put(&mut v);
        v
    }

    /// Append the 16-byte access header to `out`.
    pub fn put(&self, out: &mut Vec<u8>) {
        out.put_u64(self.offset);
        out.put_u32(self.region);
        out.put_u32(self.count);
    }
}

/// One write of a REGION_WRITE_MULTI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOne {
    /// The access.
    pub access: RegionAccess,
    /// Data (first `access.count` bytes are valid).
    pub data: [u8; WRITE_MULTI_DATA],
}

impl WriteOne {
    /// The valid data bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data[..self.access.count as usize]
    }
}

/// Decode REGION_WRITE_MULTI: wr_cnt in 1..=200, payload exactly 8 + 24 × wr_cnt, each
/// count 1..=8.
pub fn decode_write_multi(payload: &[u8]) -> Result<Vec<WriteOne>, ProtocolError> {
    let mut r = Reader::new(payload, "REGION_WRITE_MULTI");
    let n = r.u64()?;
    if n == 0 || n > WRITE_MULTI_MAX {
        return Err(ProtocolError::invalid(
            "REGION_WRITE_MULTI wr_cnt",
            format!("{n}, must be 1..={WRITE_MULTI_MAX}"),
        ));
    }
    let expected = 8 + WRITE_MULTI_ENTRY_SIZE * n as usize;
    if payload.len() != expected {
        return Err(ProtocolError::BadPayloadSize {
            what: "REGION_WRITE_MULTI",
            expected,
            got: payload.len(),
        });
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let access = RegionAccess::read_from(&mut r, WRITE_MULTI_DATA as u32)?;
        let mut data = [0u8; WRITE_MULTI_DATA];
        data.copy_from_slice(r.bytes(WRITE_MULTI_DATA)?);
        out.push(WriteOne { access, data });
    }
    Ok(out)
}

/// Encode a REGION_WRITE_MULTI payload (for test clients).
pub fn encode_write_multi(writes: &[WriteOne]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + writes.len() * WRITE_MULTI_ENTRY_SIZE);
    v.put_u64(writes.len() as u64);
    for w in writes {
        w.access.put(&mut v);
        v.extend_from_slice(&w.data);
    }
    v
}

/// The REGION_WRITE_MULTI reply payload.
pub fn encode_write_multi_reply(done: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(8);
    v.put_u64(done);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_region_read_count_limits_enforced() {
        let a = RegionAccess {
            offset: 0,
            region: 0,
            count: 4,
        };
        assert_eq!(RegionAccess::decode_read(&a.encode(), 4096).unwrap(), a);
        let big = RegionAccess { count: 8192, ..a };
        assert_eq!(
            RegionAccess::decode_read(&big.encode(), 4096)
                .unwrap_err()
                .errno(),
            libc::E2BIG
        );
        let zero = RegionAccess { count: 0, ..a };
        assert!(RegionAccess::decode_read(&zero.encode(), 4096).is_err());
        let wrap = RegionAccess {
            offset: u64::MAX,
            ..a
        };
        assert!(RegionAccess::decode_read(&wrap.encode(), 4096).is_err());
    }

    #[test]
    fn test_region_write_data_length_must_match_count() {
        let a = RegionAccess {
            offset: 8,
            region: 1,
            count: 4,
        };
        let mut p = a.encode();
        p.extend_from_slice(&[1, 2, 3, 4]);
        let (d, data) = RegionAccess::decode_write(&p, 4096).unwrap();
        assert_eq!((d, data), (a, &[1u8, 2, 3, 4][..]));
        p.push(5);
        assert!(RegionAccess::decode_write(&p, 4096).is_err());
    }

    #[test]
    fn test_write_multi_roundtrip_and_limits() {
        let w = WriteOne {
            access: RegionAccess {
                offset: 4,
                region: 0,
                count: 2,
            },
            data: [9, 8, 0, 0, 0, 0, 0, 0],
        };
        let p = encode_write_multi(&[w, w]);
        assert_eq!(decode_write_multi(&p).unwrap(), vec![w, w]);
        assert!(decode_write_multi(&p[..p.len() - 1]).is_err());
        assert!(decode_write_multi(&encode_write_multi(&[])).is_err());
        let mut bad = w;
        bad.access.count = 9;
        assert!(decode_write_multi(&encode_write_multi(&[bad])).is_err());
    }
}
