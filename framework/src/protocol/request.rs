//! Decoding of client → server commands into the typed [`Request`].

use super::device_info::{
    decode_device_info, decode_irq_info, RegionInfoRequest, RegionIoFdsRequest,
};
use super::dma_map::{DmaMapRequest, DmaUnmapRequest};
use super::feature::{decode_feature, FeatureRequest};
use super::migration::{decode_mig_data, MigData};
use super::region_access::{decode_write_multi, RegionAccess, WriteOne};
use super::set_irqs::SetIrqsRequest;
use super::version::Version;
use super::{Command, Header, ProtocolError};

/// The limits in force on a connection (from the server configuration and negotiation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest REGION_READ/WRITE count and DMA logging bitmap.
    pub max_data_xfer_size: u32,
    /// Most fds accepted with one message.
    pub max_msg_fds: u32,
    /// DMA page size (map/unmap alignment).
    pub pgsize: u64,
    /// REGION_WRITE_MULTI was negotiated.
    pub write_multiple: bool,
}

/// A decoded, validated client command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// VERSION.
    Version(Version),
    /// DMA_MAP (fd, if any, travels separately).
    DmaMap(DmaMapRequest),
    /// DMA_UNMAP.
    DmaUnmap(DmaUnmapRequest),
    /// DEVICE_GET_INFO.
    DeviceGetInfo,
    /// DEVICE_GET_REGION_INFO.
    GetRegionInfo(RegionInfoRequest),
    /// DEVICE_GET_REGION_IO_FDS.
    GetRegionIoFds(RegionIoFdsRequest),
    /// DEVICE_GET_IRQ_INFO of an index.
    GetIrqInfo {
        /// IRQ index.
        index: u32,
    },
    /// DEVICE_SET_IRQS (eventfds travel separately).
    SetIrqs(SetIrqsRequest),
    /// REGION_READ.
    RegionRead(RegionAccess),
    /// REGION_WRITE with its data.
    RegionWrite(RegionAccess, &'a [u8]),
    /// REGION_WRITE_MULTI.
    RegionWriteMulti(Vec<WriteOne>),
    /// DEVICE_RESET.
    DeviceReset,
    /// DEVICE_FEATURE.
    Feature(FeatureRequest),
    /// MIG_DATA_READ or MIG_DATA_WRITE.
    MigData(MigData<'a>),
}

fn no_fds(cmd: Command, nfds: usize) -> Result<(), ProtocolError> {
    if nfds != 0 {
        return Err(ProtocolError::WrongFdCount {
            what: cmd.name(),
            expected: "0",
            got: nfds,
        });
    }
    Ok(())
}

/// Decode a command message: `hdr` has been validated as a command, `payload` is the rest
/// of the message and `nfds` the number of fds that came with it. Every size, count,
/// offset and flag is checked; anything wrong is a [`ProtocolError`] (never a panic).
pub fn decode_request<'a>(
    hdr: &Header,
    payload: &'a [u8],
    nfds: usize,
    limits: &Limits,
) -> Result<Request<'a>, ProtocolError> {
    let cmd = Command::from_u16(hdr.command)?;
    let needs_reply = matches!(
        cmd,
        Command::Version
            | Command::DeviceGetInfo
            | Command::DeviceGetRegionInfo
            | Command::DeviceGetRegionIoFds
            | Command::DeviceGetIrqInfo
            | Command::RegionRead
            | Command::DeviceFeature
            | Command::MigDataRead
    );
    if needs_reply && hdr.no_reply() {
        return Err(ProtocolError::NoReplyNotAllowed(cmd));
    }
    if nfds > limits.max_msg_fds as usize {
        return Err(ProtocolError::WrongFdCount {
            what: cmd.name(),
            expected: "at most max_msg_fds",
            got: nfds,
        });
    }
    Ok(match cmd {
        Command::Version => {
            no_fds(cmd, nfds)?;
            Request::Version(Version::decode(payload)?)
        }
        Command::DmaMap => Request::DmaMap(DmaMapRequest::decode(payload, nfds, limits.pgsize)?),
        Command::DmaUnmap => {
            Request::DmaUnmap(DmaUnmapRequest::decode(payload, nfds, limits.pgsize)?)
        }
        Command::DeviceGetInfo => {
            decode_device_info(payload, nfds)?;
            Request::DeviceGetInfo
        }
        Command::DeviceGetRegionInfo => {
            Request::GetRegionInfo(RegionInfoRequest::decode(payload, nfds)?)
        }
        Command::DeviceGetRegionIoFds => {
            Request::GetRegionIoFds(RegionIoFdsRequest::decode(payload, nfds)?)
        }
        Command::DeviceGetIrqInfo => Request::GetIrqInfo {
            index: decode_irq_info(payload, nfds)?,
        },
        Command::DeviceSetIrqs => {
            Request::SetIrqs(SetIrqsRequest::decode(payload, nfds, limits.max_msg_fds)?)
        }
        Command::RegionRead => {
            no_fds(cmd, nfds)?;
            Request::RegionRead(RegionAccess::decode_read(
                payload,
                limits.max_data_xfer_size,
            )?)
        }
        Command::RegionWrite => {
            no_fds(cmd, nfds)?;
            let (a, data) = RegionAccess::decode_write(payload, limits.max_data_xfer_size)?;
            Request::RegionWrite(a, data)
        }
        Command::RegionWriteMulti => {
            no_fds(cmd, nfds)?;
            if !limits.write_multiple {
                return Err(ProtocolError::Unsupported(
                    "REGION_WRITE_MULTI without negotiated write_multiple",
                ));
            }
            Request::RegionWriteMulti(decode_write_multi(payload)?)
        }
        Command::DeviceReset => {
            no_fds(cmd, nfds)?;
            if !payload.is_empty() {
                return Err(ProtocolError::BadPayloadSize {
                    what: "DEVICE_RESET",
                    expected: 0,
                    got: payload.len(),
                });
            }
            Request::DeviceReset
        }
        Command::DeviceFeature => Request::Feature(decode_feature(
            payload,
            nfds,
            limits.max_data_xfer_size as usize,
        )?),
        Command::MigDataRead | Command::MigDataWrite => {
            no_fds(cmd, nfds)?;
            Request::MigData(decode_mig_data(
                payload,
                cmd == Command::MigDataWrite,
                limits.max_data_xfer_size,
            )?)
        }
        Command::DmaRead | Command::DmaWrite => return Err(ProtocolError::WrongDirection(cmd)),
        Command::DirtyPages => {
            return Err(ProtocolError::Unsupported(
                "legacy DIRTY_PAGES (use DEVICE_FEATURE DMA logging)",
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::header::FLAGS_NO_REPLY;

    const LIMITS: Limits = Limits {
        max_data_xfer_size: 4096,
        max_msg_fds: 4,
        pgsize: 4096,
        write_multiple: false,
    };

    fn hdr(cmd: u16, flags: u32) -> Header {
        Header {
            msg_id: 1,
            command: cmd,
            msg_size: 16,
            flags,
            error: 0,
        }
    }

    #[test]
    fn test_decode_unknown_command_is_enosys() {
        let e = decode_request(&hdr(77, 0), &[], 0, &LIMITS).unwrap_err();
        assert_eq!(e.errno(), libc::ENOSYS);
    }

    #[test]
    fn test_decode_dma_read_from_client_rejected() {
        assert!(decode_request(&hdr(11, 0), &[0; 16], 0, &LIMITS).is_err());
    }

    #[test]
    fn test_decode_region_read_no_reply_rejected() {
        let a = RegionAccess {
            offset: 0,
            region: 0,
            count: 4,
        };
        let e = decode_request(&hdr(9, FLAGS_NO_REPLY), &a.encode(), 0, &LIMITS).unwrap_err();
        assert_eq!(e, ProtocolError::NoReplyNotAllowed(Command::RegionRead));
    }

    #[test]
    fn test_decode_reset_with_payload_or_fds_rejected() {
        assert_eq!(
            decode_request(&hdr(13, 0), &[], 0, &LIMITS).unwrap(),
            Request::DeviceReset
        );
        assert!(decode_request(&hdr(13, 0), &[0], 0, &LIMITS).is_err());
        assert!(decode_request(&hdr(13, 0), &[], 1, &LIMITS).is_err());
        assert!(decode_request(&hdr(13, 0), &[], 9, &LIMITS).is_err());
    }

    #[test]
    fn test_decode_write_multi_needs_negotiation() {
        let p = crate::protocol::region_access::encode_write_multi(&[]);
        let e = decode_request(&hdr(15, 0), &p, 0, &LIMITS).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTSUP);
    }

    #[test]
    fn test_decode_mig_data_decoded_dirty_pages_enotsup() {
        let mut p = Vec::new();
        p.extend_from_slice(&8u32.to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        assert_eq!(
            decode_request(&hdr(17, 0), &p, 0, &LIMITS).unwrap(),
            Request::MigData(MigData::Read { size: 0 })
        );
        assert_eq!(
            decode_request(&hdr(18, 0), &p, 0, &LIMITS).unwrap(),
            Request::MigData(MigData::Write(&[]))
        );
        assert!(decode_request(&hdr(18, 0), &p, 1, &LIMITS).is_err());
        assert_eq!(
            decode_request(&hdr(14, 0), &[], 0, &LIMITS)
                .unwrap_err()
                .errno(),
            libc::ENOTSUP
        );
    }

    mod fuzz {
        use super::*;
        use crate::protocol::dma_map::DmaMapRequest;
        use crate::protocol::region_access::RegionAccess;
        use crate::protocol::set_irqs::encode_set_irqs;
        use proptest::collection::vec;
        use proptest::prelude::*;

        fn seeds() -> Vec<(u16, Vec<u8>)> {
            let access = RegionAccess {
                offset: 0,
                region: 0,
                count: 4,
            };
            let mut write = access.encode();
            write.extend_from_slice(&[1, 2, 3, 4]);
            let map = DmaMapRequest {
                flags: 3,
                offset: 0,
                iova: 0x1000,
                size: 0x1000,
            };
            vec![
                (
                    1,
                    b"\0\0\0\0{\"capabilities\":{\"max_msg_fds\":4}}\0".to_vec(),
                ),
                (2, map.encode()),
                (3, map.encode()[8..].to_vec()),
                (4, vec![16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
                (8, encode_set_irqs(4 | 32, 1, 0, 2, &[])),
                (9, access.encode()),
                (10, write),
                (
                    16,
                    crate::protocol::feature::encode_feature(8, (1 << 18) | 6, &[]),
                ),
                (
                    16,
                    crate::protocol::feature::encode_feature(
                        16,
                        (1 << 17) | 2,
                        &crate::protocol::migration::encode_mig_state_data(3),
                    ),
                ),
                (
                    16,
                    crate::protocol::feature::encode_feature(16, (1 << 16) | 1, &[]),
                ),
                (17, crate::protocol::migration::encode_mig_data_read(64)),
                (18, crate::protocol::migration::encode_mig_data(&[9; 24])),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]

            #[test]
            fn prop_decode_random_message_never_panics(
                cmd in 0u16..24,
                flags in any::<u32>(),
                payload in vec(any::<u8>(), 0..200),
                nfds in 0usize..6,
            ) {
                let hdr = Header {
                    msg_id: 1,
                    command: cmd,
                    msg_size: (16 + payload.len()) as u32,
                    flags,
                    error: 0,
                };
                let _ = hdr.validate(1 << 20);
                if let Err(e) = decode_request(&hdr, &payload, nfds, &LIMITS) {
                    prop_assert!(e.errno() > 0);
                }
            }

            #[test]
            fn prop_decode_mutated_valid_message_never_panics(
                which in 0usize..12,
                pos in any::<prop::sample::Index>(),
                byte in any::<u8>(),
                cut in any::<prop::sample::Index>(),
                nfds in 0usize..3,
            ) {
                let (cmd, mut payload) = seeds().swap_remove(which);
                let i = pos.index(payload.len());
                payload[i] = byte;
                let keep = cut.index(payload.len() + 1);
                payload.truncate(keep.max(payload.len() / 2));
                let hdr = Header::command(1, Command::from_u16(cmd).unwrap(), payload.len());
                if let Err(e) = decode_request(&hdr, &payload, nfds, &LIMITS) {
                    prop_assert!(e.errno() > 0);
                }
            }
        }
    }
}
