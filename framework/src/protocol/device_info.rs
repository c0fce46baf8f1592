//! DEVICE_GET_INFO, DEVICE_GET_REGION_INFO (with the sparse-mmap capability chain),
//! DEVICE_GET_REGION_IO_FDS and DEVICE_GET_IRQ_INFO.

use vfio_bindings::bindings::vfio::{
    vfio_irq_info, vfio_region_info, vfio_region_info_cap_sparse_mmap,
    vfio_region_sparse_mmap_area, VFIO_REGION_INFO_CAP_SPARSE_MMAP, VFIO_REGION_INFO_FLAG_CAPS,
    VFIO_REGION_INFO_FLAG_MMAP,
};

use super::wire::{Put, Reader};
use super::ProtocolError;

/// Size of the DEVICE_GET_INFO payload (request and reply): argsz, flags, num_regions,
/// num_irqs. vfio-user's own layout: `linux/vfio.h`'s `struct vfio_device_info` has a
/// cap_offset and padding after them (24 bytes), which vfio-user does not send.
pub const DEVICE_INFO_SIZE: usize = 16;
/// Size of `struct vfio_region_info`, the fixed part of GET_REGION_INFO.
pub const REGION_INFO_SIZE: usize = std::mem::size_of::<vfio_region_info>();
/// Size of the sparse-mmap capability header (cap header 8 + nr_areas 4 + reserved 4):
/// `struct vfio_region_info_cap_sparse_mmap` without its areas.
pub const SPARSE_CAP_HEADER_SIZE: usize = std::mem::size_of::<vfio_region_info_cap_sparse_mmap>();
/// Size of one sparse-mmap area (offset 8 + size 8): `struct vfio_region_sparse_mmap_area`.
pub const SPARSE_AREA_SIZE: usize = std::mem::size_of::<vfio_region_sparse_mmap_area>();
/// Size of the GET_REGION_IO_FDS fixed part (request and reply). vfio-user only (no
/// counterpart in `linux/vfio.h`).
pub const REGION_IO_FDS_SIZE: usize = 16;
/// Size of the GET_IRQ_INFO payload (request and reply): `struct vfio_irq_info`.
pub const IRQ_INFO_SIZE: usize = std::mem::size_of::<vfio_irq_info>();

fn no_fds(what: &'static str, nfds: usize) -> Result<(), ProtocolError> {
    if nfds != 0 {
        return Err(ProtocolError::WrongFdCount {
            what,
            expected: "0",
            got: nfds,
        });
    }
    Ok(())
}

/// The fixed part of an info query: at least `size` bytes. Trailing bytes are ignored, as the
/// kernel's ioctls ignore what follows the fixed struct: argsz is the size of the client's
/// *reply* buffer, and a client that sends argsz bytes (libvfio-user's does, for a retry
/// with room for capabilities) sends that buffer, zeroed.
fn at_least<'a>(
    what: &'static str,
    payload: &'a [u8],
    size: usize,
) -> Result<Reader<'a>, ProtocolError> {
    if payload.len() < size {
        return Err(ProtocolError::Truncated {
            what,
            need: size,
            got: payload.len(),
        });
    }
    Ok(Reader::new(&payload[..size], what))
}

fn min_argsz(what: &'static str, argsz: u32, min: usize) -> Result<(), ProtocolError> {
    if (argsz as usize) < min {
        return Err(ProtocolError::ArgszTooSmall {
            what,
            argsz,
            min: min as u32,
        });
    }
    Ok(())
}

/// Validate a DEVICE_GET_INFO request (payload ≥ 16 bytes, argsz ≥ 16, no fds).
pub fn decode_device_info(payload: &[u8], nfds: usize) -> Result<u32, ProtocolError> {
    no_fds("DEVICE_GET_INFO", nfds)?;
    let mut r = at_least("DEVICE_GET_INFO", payload, DEVICE_INFO_SIZE)?;
    let argsz = r.u32()?;
    min_argsz("DEVICE_GET_INFO", argsz, DEVICE_INFO_SIZE)?;
    Ok(argsz)
}

/// The DEVICE_GET_INFO reply payload (16 bytes).
pub fn encode_device_info(flags: u32, num_regions: u32, num_irqs: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(DEVICE_INFO_SIZE);
    v.put_u32(DEVICE_INFO_SIZE as u32);
    v.put_u32(flags);
    v.put_u32(num_regions);
    v.put_u32(num_irqs);
    v
}

/// A validated GET_REGION_INFO request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfoRequest {
    /// Largest reply payload the client accepts.
    pub argsz: u32,
    /// Region index.
    pub index: u32,
}

impl RegionInfoRequest {
    /// Decode: payload ≥ 32 bytes (trailing bytes ignored), argsz ≥ 32, no fds.
    pub fn decode(payload: &[u8], nfds: usize) -> Result<Self, ProtocolError> {
        no_fds("DEVICE_GET_REGION_INFO", nfds)?;
        let mut r = at_least("DEVICE_GET_REGION_INFO", payload, REGION_INFO_SIZE)?;
        let argsz = r.u32()?;
        let _flags = r.u32()?;
        let index = r.u32()?;
        min_argsz("DEVICE_GET_REGION_INFO", argsz, REGION_INFO_SIZE)?;
        Ok(RegionInfoRequest { argsz, index })
    }
}

/// What a GET_REGION_INFO reply describes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegionInfoReply {
    /// Region index.
    pub index: u32,
    /// READ/WRITE/MMAP bits (CAPS is added when areas are present).
    pub flags: u32,
    /// Region size.
    pub size: u64,
    /// mmap offset in the region fd.
    pub offset: u64,
    /// Sparse mmap areas (offset, size) within the region; empty = no capability.
    pub sparse_areas: Vec<(u64, u64)>,
}

impl RegionInfoReply {
    /// Payload size with the capability chain.
    pub fn full_size(&self) -> usize {
        if self.sparse_areas.is_empty() {
            REGION_INFO_SIZE
        } else {
            REGION_INFO_SIZE + SPARSE_CAP_HEADER_SIZE + SPARSE_AREA_SIZE * self.sparse_areas.len()
        }
    }

    /// Encode the reply payload for a request with `argsz`. If the capability chain does
    /// not fit, only the 32-byte info goes out, with `argsz` set to the size needed so the
    /// client can retry; `cap_offset` then still points just after the info (QEMU rejects
    /// CAPS with a cap_offset below 32).
    pub fn encode(&self, argsz: u32) -> Vec<u8> {
        let full = self.full_size();
        let has_caps = !self.sparse_areas.is_empty();
        let fits = argsz as usize >= full;
        let mut flags = self.flags;
        if has_caps {
            flags |= VFIO_REGION_INFO_FLAG_CAPS;
        } else {
            flags &= !VFIO_REGION_INFO_FLAG_CAPS;
        }
        let mut v = Vec::with_capacity(if fits { full } else { REGION_INFO_SIZE });
        v.put_u32(full as u32);
        v.put_u32(flags);
        v.put_u32(self.index);
        v.put_u32(if has_caps { REGION_INFO_SIZE as u32 } else { 0 });
        v.put_u64(self.size);
        v.put_u64(self.offset);
        if has_caps && fits {
            v.put_u16(VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16);
            v.put_u16(1);
            v.put_u32(0);
            v.put_u32(self.sparse_areas.len() as u32);
            v.put_u32(0);
            for &(off, size) in &self.sparse_areas {
                v.put_u64(off);
                v.put_u64(size);
            }
        }
        v
    }

    /// True if the region is mappable.
    pub fn mappable(&self) -> bool {
        self.flags & VFIO_REGION_INFO_FLAG_MMAP != 0
    }

    /// True if the region fd goes with the reply to a request with `argsz`: the region is
    /// mappable and the reply is the full one (capabilities included). The short reply that
    /// only says how much room is needed carries no fd, as libvfio-user's server does: its
    /// client probes with no room for a control message and fails (`EFAULT`, truncated
    /// control data) if one comes; QEMU closes an fd from the short reply and keeps the
    /// one of the full reply, so it works either way.
    pub fn fd_goes_with(&self, argsz: u32) -> bool {
        self.mappable() && argsz as usize >= self.full_size()
    }
}

/// A validated GET_REGION_IO_FDS request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionIoFdsRequest {
    /// Largest reply payload.
    pub argsz: u32,
    /// Region index.
    pub index: u32,
}

impl RegionIoFdsRequest {
    /// Decode: payload ≥ 16 bytes (trailing bytes ignored), argsz ≥ 16, flags and count 0,
    /// no fds.
    pub fn decode(payload: &[u8], nfds: usize) -> Result<Self, ProtocolError> {
        no_fds("DEVICE_GET_REGION_IO_FDS", nfds)?;
        let mut r = at_least("DEVICE_GET_REGION_IO_FDS", payload, REGION_IO_FDS_SIZE)?;
        let argsz = r.u32()?;
        let flags = r.u32()?;
        let index = r.u32()?;
        let count = r.u32()?;
        min_argsz("DEVICE_GET_REGION_IO_FDS", argsz, REGION_IO_FDS_SIZE)?;
        if flags != 0 {
            return Err(ProtocolError::BadFlags {
                what: "DEVICE_GET_REGION_IO_FDS",
                flags,
            });
        }
        if count != 0 {
            return Err(ProtocolError::invalid(
                "DEVICE_GET_REGION_IO_FDS count",
                format!("{count}, must be 0 in a request"),
            ));
        }
        Ok(RegionIoFdsRequest { argsz, index })
    }

    /// The reply: no sub-regions (umdev offers no ioeventfds), so no fds either.
    pub fn encode_empty_reply(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(REGION_IO_FDS_SIZE);
        v.put_u32(REGION_IO_FDS_SIZE as u32);
        v.put_u32(0);
        v.put_u32(self.index);
        v.put_u32(0);
        v
    }
}

/// Validate a GET_IRQ_INFO request (payload ≥ 16 bytes, trailing bytes ignored, argsz ≥ 16,
/// no fds); returns the index.
pub fn decode_irq_info(payload: &[u8], nfds: usize) -> Result<u32, ProtocolError> {
    no_fds("DEVICE_GET_IRQ_INFO", nfds)?;
    let mut r = at_least("DEVICE_GET_IRQ_INFO", payload, IRQ_INFO_SIZE)?;
    let argsz = r.u32()?;
    let _flags = r.u32()?;
    let index = r.u32()?;
    min_argsz("DEVICE_GET_IRQ_INFO", argsz, IRQ_INFO_SIZE)?;
    Ok(index)
}

/// The GET_IRQ_INFO reply payload (16 bytes).
pub fn encode_irq_info(flags: u32, index: u32, count: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(IRQ_INFO_SIZE);
    v.put_u32(IRQ_INFO_SIZE as u32);
    v.put_u32(flags);
    v.put_u32(index);
    v.put_u32(count);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_region_info_layout_matches_vfio_bindings() {
        assert_eq!(REGION_INFO_SIZE, 32);
    }

    #[test]
    fn test_region_info_caps_not_fitting_reports_needed_argsz() {
        let r = RegionInfoReply {
            index: 2,
            flags: 7,
            size: 0x10000,
            offset: 0,
            sparse_areas: vec![(0x1000, 0x2000)],
        };
        let short = r.encode(32);
        assert_eq!(short.len(), 32);
        let mut rd = Reader::new(&short, "t");
        assert_eq!(rd.u32().unwrap(), 64);
        assert_eq!(
            rd.u32().unwrap() & VFIO_REGION_INFO_FLAG_CAPS,
            VFIO_REGION_INFO_FLAG_CAPS
        );
        let full = r.encode(64);
        assert_eq!(full.len(), 64);
        let mut rd = Reader::new(&full[32..], "t");
        assert_eq!(rd.u16().unwrap(), VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16);
        assert_eq!(rd.u16().unwrap(), 1);
        assert_eq!(rd.u32().unwrap(), 0);
        assert_eq!(rd.u32().unwrap(), 1);
        rd.u32().unwrap();
        assert_eq!((rd.u64().unwrap(), rd.u64().unwrap()), (0x1000, 0x2000));
    }

    #[test]
    fn test_region_info_request_small_argsz_rejected() {
        let mut p = Vec::new();
        p.put_u32(16);
        p.put_u32(0);
        p.put_u32(0);
        p.put_u32(0);
        p.put_u64(0);
        p.put_u64(0);
        assert!(RegionInfoRequest::decode(&p, 0).is_err());
        p[0] = 32;
        assert!(RegionInfoRequest::decode(&p, 0).is_ok());
        assert!(RegionInfoRequest::decode(&p, 1).is_err());
        assert!(RegionInfoRequest::decode(&p[..20], 0).is_err());
    }

    #[test]
    fn test_region_info_fd_short_reply_withheld_full_reply_carries_it() {
        let mut r = RegionInfoReply {
            index: 2,
            flags: VFIO_REGION_INFO_FLAG_MMAP | 3,
            size: 0x10000,
            offset: 0,
            sparse_areas: vec![(0, 0x10000)],
        };
        assert!(!r.fd_goes_with(32), "the probe has no room for the caps");
        assert!(!r.fd_goes_with(63));
        assert!(r.fd_goes_with(64));
        assert!(r.fd_goes_with(4096));
        r.flags &= !VFIO_REGION_INFO_FLAG_MMAP;
        assert!(
            !r.fd_goes_with(4096),
            "no fd for a region that is not mappable"
        );
    }

    #[test]
    fn test_info_requests_trailing_bytes_accepted_short_rejected() {
        // libvfio-user's client sends argsz bytes (its whole reply buffer, zeroed).
        let mut p = Vec::new();
        p.put_u32(64);
        p.put_u32(0);
        p.put_u32(2);
        p.extend_from_slice(&[0; 52]);
        assert_eq!(
            RegionInfoRequest::decode(&p, 0).unwrap(),
            RegionInfoRequest {
                argsz: 64,
                index: 2
            }
        );
        assert!(RegionInfoRequest::decode(&p[..31], 0).is_err());
        let mut q = Vec::new();
        q.put_u32(32);
        q.put_u32(0);
        q.put_u32(3);
        q.extend_from_slice(&[0; 20]);
        assert_eq!(decode_irq_info(&q, 0).unwrap(), 3);
        assert_eq!(decode_device_info(&q, 0).unwrap(), 32);
        let mut f = vec![0u8; 24];
        f[..4].copy_from_slice(&24u32.to_ne_bytes());
        f[8..12].copy_from_slice(&1u32.to_ne_bytes());
        assert_eq!(
            RegionIoFdsRequest::decode(&f, 0).unwrap(),
            RegionIoFdsRequest {
                argsz: 24,
                index: 1
            }
        );
        assert!(decode_irq_info(&q[..15], 0).is_err());
        assert!(decode_device_info(&q[..15], 0).is_err());
        assert!(RegionIoFdsRequest::decode(&f[..15], 0).is_err());
    }

    #[test]
    fn test_device_info_vfio_user_client_argsz_accepted() {
        // The vfio_user crate sends argsz 32 (it counts the header).
        let mut p = Vec::new();
        p.put_u32(32);
        p.put_u32(0);
        p.put_u32(0);
        p.put_u32(0);
        assert_eq!(decode_device_info(&p, 0).unwrap(), 32);
        p[0] = 8;
        assert!(decode_device_info(&p, 0).is_err());
    }
}
