//! DMA_MAP and DMA_UNMAP requests and the DMA_UNMAP reply.

use vfio_bindings::bindings::vfio::{
    vfio_iommu_type1_dma_unmap, VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE,
    VFIO_DMA_UNMAP_FLAG_ALL, VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP, VFIO_DMA_UNMAP_FLAG_VADDR,
};

use super::wire::{Put, Reader};
use super::ProtocolError;

/// DMA_MAP flag: the device may read the region (`VFIO_DMA_MAP_FLAG_READ`).
pub const DMA_MAP_FLAG_READ: u32 = VFIO_DMA_MAP_FLAG_READ;
/// DMA_MAP flag: the device may write the region (`VFIO_DMA_MAP_FLAG_WRITE`).
pub const DMA_MAP_FLAG_WRITE: u32 = VFIO_DMA_MAP_FLAG_WRITE;
/// Size of the DMA_MAP payload: argsz, flags, offset, iova, size. vfio-user's own layout
/// (`linux/vfio.h`'s `vfio_iommu_type1_dma_map` has the same size but a vaddr where
/// vfio-user has the file offset), so it is not taken from the bindings.
pub const DMA_MAP_SIZE: usize = 32;
/// Size of the DMA_UNMAP payload (and of its reply): `struct vfio_iommu_type1_dma_unmap`
/// without the dirty bitmap.
pub const DMA_UNMAP_SIZE: usize = std::mem::size_of::<vfio_iommu_type1_dma_unmap>();
/// DMA_UNMAP flag "unmap everything" (`VFIO_DMA_UNMAP_FLAG_ALL` of `linux/vfio.h`, also
/// libvfio-user's value). QEMU 10.x sends it, with iova 0 and size 0, when a 2^64-byte
/// section goes away.
pub const DMA_UNMAP_FLAG_ALL: u32 = VFIO_DMA_UNMAP_FLAG_ALL;
/// Every DMA_UNMAP flag bit `linux/vfio.h` defines: GET_DIRTY_BITMAP, ALL and VADDR. Of
/// them umdev implements only ALL ([`DMA_UNMAP_FLAG_ALL`]); the other two are answered
/// with ENOTSUP (bit 2 is also UNMAP_ALL in the `vfio_user` crate, whose bit values
/// disagree with everybody else's). A bit outside this mask is EINVAL.
pub const DMA_UNMAP_LEGACY_FLAGS: u32 =
    VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP | VFIO_DMA_UNMAP_FLAG_ALL | VFIO_DMA_UNMAP_FLAG_VADDR;

/// A validated DMA_MAP request (the fd travels separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaMapRequest {
    /// READ/WRITE bits.
    pub flags: u32,
    /// Offset in the fd (meaningless without one).
    pub offset: u64,
    /// IOVA of the start.
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
}

impl DmaMapRequest {
    /// Decode and validate: payload and argsz exactly 32 bytes, flags only READ|WRITE and
    /// at least one, size non-zero, iova and size aligned to `pgsize`, no wrap-around of
    /// iova+size or offset+size, at most one fd. A map may not end exactly at 2^64 either
    /// (iova + size must fit in a u64: the DMA layer keeps a mapping's exclusive end in a
    /// u64), unlike an unmap range.
    pub fn decode(payload: &[u8], nfds: usize, pgsize: u64) -> Result<Self, ProtocolError> {
        if payload.len() != DMA_MAP_SIZE {
            return Err(ProtocolError::BadPayloadSize {
                what: "DMA_MAP",
                expected: DMA_MAP_SIZE,
                got: payload.len(),
            });
        }
        let mut r = Reader::new(payload, "DMA_MAP");
        let argsz = r.u32()?;
        let flags = r.u32()?;
        let offset = r.u64()?;
        let iova = r.u64()?;
        let size = r.u64()?;
        if argsz as usize != DMA_MAP_SIZE {
            return Err(ProtocolError::invalid(
                "DMA_MAP argsz",
                format!("{argsz}, must be {DMA_MAP_SIZE}"),
            ));
        }
        if flags & !(DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE) != 0 || flags == 0 {
            return Err(ProtocolError::BadFlags {
                what: "DMA_MAP",
                flags,
            });
        }
        if nfds > 1 {
            return Err(ProtocolError::WrongFdCount {
                what: "DMA_MAP",
                expected: "0 or 1",
                got: nfds,
            });
        }
        check_range("DMA_MAP", iova, size, pgsize)?;
        if iova.checked_add(size).is_none() {
            return Err(ProtocolError::invalid(
                "DMA_MAP",
                format!("iova {iova:#x} + size {size:#x} reaches 2^64"),
            ));
        }
        if nfds == 1 {
            if offset.checked_add(size).is_none() {
                return Err(ProtocolError::invalid(
                    "DMA_MAP offset",
                    format!("offset {offset:#x} + size {size:#x} wraps"),
                ));
            }
            if !offset.is_multiple_of(pgsize) {
                return Err(ProtocolError::invalid(
                    "DMA_MAP offset",
                    format!("offset {offset:#x} is not {pgsize}-aligned"),
                ));
            }
        }
        Ok(DmaMapRequest {
            flags,
            offset,
            iova,
            size,
        })
    }

    /// Encode the payload (for test clients).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(DMA_MAP_SIZE);
        v.put_u32(DMA_MAP_SIZE as u32);
        v.put_u32(self.flags);
        v.put_u64(self.offset);
        v.put_u64(self.iova);
        v.put_u64(self.size);
        v
    }
}

/// Non-zero size, the last byte `iova + size - 1` does not wrap (so a range may end exactly
/// at 2^64, as type1 allows), iova and size aligned to `pgsize`.
fn check_range(what: &'static str, iova: u64, size: u64, pgsize: u64) -> Result<(), ProtocolError> {
    if size == 0 {
        return Err(ProtocolError::invalid(what, "size is 0"));
    }
    if iova.checked_add(size - 1).is_none() {
        return Err(ProtocolError::invalid(
            what,
            format!("iova {iova:#x} + size {size:#x} wraps"),
        ));
    }
    if pgsize != 0 && (!iova.is_multiple_of(pgsize) || !size.is_multiple_of(pgsize)) {
        return Err(ProtocolError::invalid(
            what,
            format!("iova {iova:#x} / size {size:#x} not aligned to {pgsize}"),
        ));
    }
    Ok(())
}

/// A validated DMA_UNMAP request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaUnmapRequest {
    /// argsz as sent.
    pub argsz: u32,
    /// FLAG_ALL: remove every mapping (iova and size are 0).
    pub all: bool,
    /// Start of the range.
    pub iova: u64,
    /// Size of the range (`iova + size` may be exactly 2^64).
    pub size: u64,
}

impl DmaUnmapRequest {
    /// Decode and validate: payload 24 bytes, argsz ≥ 24, no fds; flags 0 with a non-zero,
    /// aligned range whose last byte does not wrap (it may end exactly at 2^64), or exactly
    /// FLAG_ALL with iova and size 0; other legacy bits ENOTSUP, unknown bits EINVAL. Which
    /// mappings the range removes is the DMA layer's business (type1v2: every mapping it
    /// covers; see `DmaSpace::unmap`).
    pub fn decode(payload: &[u8], nfds: usize, pgsize: u64) -> Result<Self, ProtocolError> {
        if payload.len() != DMA_UNMAP_SIZE {
            return Err(ProtocolError::BadPayloadSize {
                what: "DMA_UNMAP",
                expected: DMA_UNMAP_SIZE,
                got: payload.len(),
            });
        }
        if nfds != 0 {
            return Err(ProtocolError::WrongFdCount {
                what: "DMA_UNMAP",
                expected: "0",
                got: nfds,
            });
        }
        let mut r = Reader::new(payload, "DMA_UNMAP");
        let argsz = r.u32()?;
        let flags = r.u32()?;
        let iova = r.u64()?;
        let size = r.u64()?;
        if (argsz as usize) < DMA_UNMAP_SIZE {
            return Err(ProtocolError::ArgszTooSmall {
                what: "DMA_UNMAP",
                argsz,
                min: DMA_UNMAP_SIZE as u32,
            });
        }
        if flags & !DMA_UNMAP_LEGACY_FLAGS != 0 {
            return Err(ProtocolError::BadFlags {
                what: "DMA_UNMAP",
                flags,
            });
        }
        if flags == DMA_UNMAP_FLAG_ALL {
            if iova != 0 || size != 0 {
                return Err(ProtocolError::invalid(
                    "DMA_UNMAP",
                    format!("FLAG_ALL with iova {iova:#x} size {size:#x}; both must be 0"),
                ));
            }
            return Ok(DmaUnmapRequest {
                argsz,
                all: true,
                iova,
                size,
            });
        }
        if flags != 0 {
            return Err(ProtocolError::Unsupported(
                "legacy DMA_UNMAP flags (GET_DIRTY_BITMAP / VADDR / the vfio_user crate's UNMAP_ALL)",
            ));
        }
        check_range("DMA_UNMAP", iova, size, pgsize)?;
        Ok(DmaUnmapRequest {
            argsz,
            all: false,
            iova,
            size,
        })
    }

    /// True for FLAG_ALL (remove every mapping).
    pub fn is_all(&self) -> bool {
        self.all
    }

    /// The request payload (for test clients): argsz 24, the flags, iova and size.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with_size(self.size)
    }

    /// The reply payload: the request's entry with the size field set to the bytes actually
    /// unmapped, as the kernel's type1 writes it back (0 when the range covered no mapping;
    /// the total of every mapping for FLAG_ALL). For an unmap of exactly one mapping this is
    /// the spec's "original DMA entry". QEMU's client reads only the errno.
    pub fn encode_reply(&self, bytes_removed: u64) -> Vec<u8> {
        self.encode_with_size(bytes_removed)
    }

    fn encode_with_size(&self, size: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(DMA_UNMAP_SIZE);
        v.put_u32(DMA_UNMAP_SIZE as u32);
        v.put_u32(if self.is_all() { DMA_UNMAP_FLAG_ALL } else { 0 });
        v.put_u64(self.iova);
        v.put_u64(size);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(flags: u32, iova: u64, size: u64) -> Vec<u8> {
        DmaMapRequest {
            flags,
            offset: 0,
            iova,
            size,
        }
        .encode()
    }

    #[test]
    fn test_dma_map_valid_decodes() {
        let m = DmaMapRequest::decode(&map(3, 0x1000, 0x2000), 1, 4096).unwrap();
        assert_eq!((m.iova, m.size, m.flags), (0x1000, 0x2000, 3));
    }

    #[test]
    fn test_dma_map_bad_inputs_rejected() {
        assert!(DmaMapRequest::decode(&map(4, 0, 4096), 0, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(0, 0, 4096), 0, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(1, 0, 0), 0, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(1, u64::MAX - 4095, 8192), 0, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(1, 0x800, 4096), 0, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(1, 0, 4096), 2, 4096).is_err());
        assert!(DmaMapRequest::decode(&map(1, 0, 4096)[..31], 0, 4096).is_err());
        let mut bad_argsz = map(1, 0, 4096);
        bad_argsz[0] = 16;
        assert!(DmaMapRequest::decode(&bad_argsz, 0, 4096).is_err());
    }

    fn unmap(flags: u32) -> Vec<u8> {
        unmap_range(flags, 0x1000, 0x1000)
    }

    fn unmap_range(flags: u32, iova: u64, size: u64) -> Vec<u8> {
        let mut v = Vec::new();
        v.put_u32(24);
        v.put_u32(flags);
        v.put_u64(iova);
        v.put_u64(size);
        v
    }

    #[test]
    fn test_dma_unmap_range_ending_at_2_pow_64_accepted_map_and_past_it_einval() {
        // QEMU's vIOMMU replay sends ranges ending exactly at 2^64.
        let u = DmaUnmapRequest::decode(&unmap_range(0, 1 << 63, 1 << 63), 0, 4096).unwrap();
        assert_eq!((u.iova, u.size), (1 << 63, 1 << 63));
        let top = u64::MAX - 0xfff;
        let u = DmaUnmapRequest::decode(&unmap_range(0, top, 0x1000), 0, 4096).unwrap();
        assert_eq!((u.iova, u.size), (top, 0x1000));
        let u = DmaUnmapRequest::decode(&unmap_range(0, 0, u64::MAX - 0xfff), 0, 4096).unwrap();
        assert_eq!(u.size, u64::MAX - 0xfff);
        // One page past 2^64 wraps; size 0 stays invalid.
        for (iova, size) in [(top, 0x2000), (1 << 63, (1 << 63) + 0x1000), (0x1000, 0)] {
            assert_eq!(
                DmaUnmapRequest::decode(&unmap_range(0, iova, size), 0, 4096)
                    .unwrap_err()
                    .errno(),
                libc::EINVAL,
                "{iova:#x}+{size:#x}"
            );
        }
        // A map cannot end at 2^64 (the DMA layer cannot represent it).
        assert_eq!(
            DmaMapRequest::decode(&map(3, top, 0x1000), 0, 4096)
                .unwrap_err()
                .errno(),
            libc::EINVAL
        );
        assert!(DmaMapRequest::decode(&map(3, top - 0x1000, 0x1000), 0, 4096).is_ok());
    }

    #[test]
    fn test_dma_unmap_reply_carries_bytes_removed() {
        let u = DmaUnmapRequest::decode(&unmap_range(0, 0x10000, 0x40000), 0, 4096).unwrap();
        assert_eq!(u.encode(), unmap_range(0, 0x10000, 0x40000));
        assert_eq!(u.encode_reply(0x3000), unmap_range(0, 0x10000, 0x3000));
        assert_eq!(u.encode_reply(0), unmap_range(0, 0x10000, 0));
    }

    #[test]
    fn test_dma_unmap_flag_all_needs_zero_range() {
        let mut p = Vec::new();
        p.put_u32(24);
        p.put_u32(DMA_UNMAP_FLAG_ALL);
        p.put_u64(0);
        p.put_u64(0);
        let u = DmaUnmapRequest::decode(&p, 0, 4096).unwrap();
        assert!(u.is_all());
        assert_eq!(&u.encode()[4..8], &DMA_UNMAP_FLAG_ALL.to_ne_bytes());
        assert_eq!(
            DmaUnmapRequest::decode(&unmap(DMA_UNMAP_FLAG_ALL), 0, 4096)
                .unwrap_err()
                .errno(),
            libc::EINVAL
        );
    }

    #[test]
    fn test_dma_unmap_legacy_flags_enotsup_others_einval() {
        assert!(DmaUnmapRequest::decode(&unmap(0), 0, 4096).is_ok());
        assert_eq!(
            DmaUnmapRequest::decode(&unmap(1), 0, 4096)
                .unwrap_err()
                .errno(),
            libc::ENOTSUP
        );
        assert_eq!(
            DmaUnmapRequest::decode(&unmap(4), 0, 4096)
                .unwrap_err()
                .errno(),
            libc::ENOTSUP
        );
        assert_eq!(
            DmaUnmapRequest::decode(&unmap(8), 0, 4096)
                .unwrap_err()
                .errno(),
            libc::EINVAL
        );
        assert!(DmaUnmapRequest::decode(&unmap(0), 1, 4096).is_err());
    }
}
