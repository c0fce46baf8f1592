//! DEVICE_FEATURE: DMA logging start/stop/report, and the migration features MIGRATION and
//! MIG_DEVICE_STATE (their payloads are in [`super::migration`]); everything else ENOTSUP.
//! Whether the device migrates is the server's to say: a migration feature of a device
//! without migration is answered ENOTSUP there, not here.

use vfio_bindings::bindings::vfio::{
    vfio_device_feature, vfio_device_feature_dma_logging_control,
    vfio_device_feature_dma_logging_range, vfio_device_feature_dma_logging_report,
    VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
    VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, VFIO_DEVICE_FEATURE_GET, VFIO_DEVICE_FEATURE_MASK,
    VFIO_DEVICE_FEATURE_MIGRATION, VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, VFIO_DEVICE_FEATURE_PROBE,
    VFIO_DEVICE_FEATURE_SET,
};

use super::migration::{check_argsz, check_get_data, decode_set_state};
use super::wire::{Put, Reader};
use super::ProtocolError;
use crate::migration::MigState;

/// Size of the DEVICE_FEATURE fixed part (argsz, flags): `struct vfio_device_feature`
/// without its data.
pub const FEATURE_HEADER_SIZE: usize = std::mem::size_of::<vfio_device_feature>();
/// DMA_LOGGING_START's fixed part (page_size, num_ranges, reserved): the kernel's
/// `struct vfio_device_feature_dma_logging_control` up to its `ranges` pointer, in whose
/// place vfio-user sends the ranges inline.
const LOGGING_CONTROL_SIZE: usize =
    std::mem::offset_of!(vfio_device_feature_dma_logging_control, ranges);
/// One DMA logging range (iova, length): `struct vfio_device_feature_dma_logging_range`.
const LOGGING_RANGE_SIZE: usize = std::mem::size_of::<vfio_device_feature_dma_logging_range>();
/// DMA_LOGGING_REPORT's fixed part (iova, length, page_size): the kernel's
/// `struct vfio_device_feature_dma_logging_report` up to its `bitmap` pointer; vfio-user
/// returns the bitmap inline instead.
const LOGGING_REPORT_SIZE: usize =
    std::mem::offset_of!(vfio_device_feature_dma_logging_report, bitmap);
/// Most ranges umdev accepts in DMA_LOGGING_START.
pub const MAX_LOGGING_RANGES: u32 = 1024;

/// A decoded DEVICE_FEATURE request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeatureRequest {
    /// PROBE of a supported feature/operation: the reply echoes the request payload.
    Probe,
    /// PROBE of MIGRATION or MIG_DEVICE_STATE: echoed if the device migrates, else ENOTSUP.
    MigrationProbe,
    /// MIGRATION GET: which migration states the device offers.
    Migration,
    /// MIG_DEVICE_STATE GET.
    MigStateGet,
    /// MIG_DEVICE_STATE SET to a state.
    MigStateSet(MigState),
    /// DMA_LOGGING_START (SET).
    LoggingStart {
        /// Requested tracking page size.
        page_size: u64,
        /// IOVA ranges (iova, length); empty = everything.
        ranges: Vec<(u64, u64)>,
    },
    /// DMA_LOGGING_STOP (SET).
    LoggingStop,
    /// DMA_LOGGING_REPORT (GET).
    LoggingReport {
        /// Start of the range.
        iova: u64,
        /// Length of the range.
        length: u64,
        /// Bitmap granularity.
        page_size: u64,
        /// Bytes of bitmap to return (u64 words, ≥ 1 bit per page).
        bitmap_len: usize,
    },
}

/// Decode DEVICE_FEATURE. `max_bitmap` bounds the REPORT bitmap in bytes.
pub fn decode_feature(
    payload: &[u8],
    nfds: usize,
    max_bitmap: usize,
) -> Result<FeatureRequest, ProtocolError> {
    if nfds != 0 {
        return Err(ProtocolError::WrongFdCount {
            what: "DEVICE_FEATURE",
            expected: "0",
            got: nfds,
        });
    }
    let mut r = Reader::new(payload, "DEVICE_FEATURE");
    let argsz = r.u32()?;
    let flags = r.u32()?;
    if (argsz as usize) < FEATURE_HEADER_SIZE {
        return Err(ProtocolError::ArgszTooSmall {
            what: "DEVICE_FEATURE",
            argsz,
            min: FEATURE_HEADER_SIZE as u32,
        });
    }
    let ops = flags & !VFIO_DEVICE_FEATURE_MASK;
    let all_ops = VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_PROBE;
    let get = ops & VFIO_DEVICE_FEATURE_GET != 0;
    let set = ops & VFIO_DEVICE_FEATURE_SET != 0;
    let probe = ops & VFIO_DEVICE_FEATURE_PROBE != 0;
    if ops & !all_ops != 0 || ops == 0 || (get && set && !probe) {
        return Err(ProtocolError::BadFlags {
            what: "DEVICE_FEATURE",
            flags,
        });
    }
    let feature = flags & VFIO_DEVICE_FEATURE_MASK;
    let (can_get, can_set) = match feature {
        VFIO_DEVICE_FEATURE_DMA_LOGGING_START | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => {
            (false, true)
        }
        VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT | VFIO_DEVICE_FEATURE_MIGRATION => (true, false),
        VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE => (true, true),
        _ => return Err(ProtocolError::Unsupported("this device feature")),
    };
    if (get && !can_get) || (set && !can_set) {
        return Err(ProtocolError::invalid(
            "DEVICE_FEATURE",
            format!("feature {feature} does not support the requested operation {ops:#x}"),
        ));
    }
    let migration = matches!(
        feature,
        VFIO_DEVICE_FEATURE_MIGRATION | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE
    );
    if probe {
        return Ok(if migration {
            FeatureRequest::MigrationProbe
        } else {
            FeatureRequest::Probe
        });
    }
    match feature {
        VFIO_DEVICE_FEATURE_MIGRATION => {
            check_argsz("MIGRATION", argsz)?;
            check_get_data("MIGRATION", r.rest())?;
            Ok(FeatureRequest::Migration)
        }
        VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE => {
            check_argsz("MIG_DEVICE_STATE", argsz)?;
            if get {
                check_get_data("MIG_DEVICE_STATE", r.rest())?;
                Ok(FeatureRequest::MigStateGet)
            } else {
                Ok(FeatureRequest::MigStateSet(decode_set_state(r.rest())?))
            }
        }
        VFIO_DEVICE_FEATURE_DMA_LOGGING_START => {
            let page_size = r.u64()?;
            let num_ranges = r.u32()?;
            let _reserved = r.u32()?;
            if num_ranges > MAX_LOGGING_RANGES {
                return Err(ProtocolError::invalid(
                    "DMA_LOGGING_START num_ranges",
                    format!("{num_ranges} > {MAX_LOGGING_RANGES}"),
                ));
            }
            if r.remaining() != num_ranges as usize * LOGGING_RANGE_SIZE {
                return Err(ProtocolError::BadPayloadSize {
                    what: "DMA_LOGGING_START",
                    expected: FEATURE_HEADER_SIZE
                        + LOGGING_CONTROL_SIZE
                        + num_ranges as usize * LOGGING_RANGE_SIZE,
                    got: payload.len(),
                });
            }
            if !page_size.is_power_of_two() {
                return Err(ProtocolError::invalid(
                    "DMA_LOGGING_START page_size",
                    format!("{page_size:#x} is not a power of two"),
                ));
            }
            let mut ranges = Vec::with_capacity(num_ranges as usize);
            for _ in 0..num_ranges {
                let iova = r.u64()?;
                let len = r.u64()?;
                if len == 0 || iova.checked_add(len).is_none() {
                    return Err(ProtocolError::invalid(
                        "DMA_LOGGING_START range",
                        format!("iova {iova:#x} length {len:#x}"),
                    ));
                }
                ranges.push((iova, len));
            }
            Ok(FeatureRequest::LoggingStart { page_size, ranges })
        }
        VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => Ok(FeatureRequest::LoggingStop),
        _ => {
            let iova = r.u64()?;
            let length = r.u64()?;
            let page_size = r.u64()?;
            if r.remaining() != 0 {
                return Err(ProtocolError::BadPayloadSize {
                    what: "DMA_LOGGING_REPORT",
                    expected: FEATURE_HEADER_SIZE + LOGGING_REPORT_SIZE,
                    got: payload.len(),
                });
            }
            if !page_size.is_power_of_two() || length == 0 || iova.checked_add(length).is_none() {
                return Err(ProtocolError::invalid(
                    "DMA_LOGGING_REPORT",
                    format!("iova {iova:#x} length {length:#x} page_size {page_size:#x}"),
                ));
            }
            let pages = length.div_ceil(page_size);
            let bitmap_len = pages.div_ceil(64).saturating_mul(8);
            if bitmap_len > max_bitmap as u64 {
                return Err(ProtocolError::TransferTooLarge {
                    count: bitmap_len,
                    max: max_bitmap as u64,
                });
            }
            let bitmap_len = bitmap_len as usize;
            let need = FEATURE_HEADER_SIZE + LOGGING_REPORT_SIZE + bitmap_len;
            if (argsz as usize) < need {
                return Err(ProtocolError::ArgszTooSmall {
                    what: "DMA_LOGGING_REPORT",
                    argsz,
                    min: need as u32,
                });
            }
            Ok(FeatureRequest::LoggingReport {
                iova,
                length,
                page_size,
                bitmap_len,
            })
        }
    }
}

/// Encode a DEVICE_FEATURE payload (for test clients).
pub fn encode_feature(argsz: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(FEATURE_HEADER_SIZE + data.len());
    v.put_u32(argsz);
    v.put_u32(flags);
    v.extend_from_slice(data);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_logging_layout_sizes_keep_their_values() {
        // The literals these sizes replaced (vfio-user's inline layouts of the kernel
        // structs): START is page_size + num_ranges + reserved, then 16-byte ranges;
        // REPORT is iova + length + page_size, then the bitmap.
        assert_eq!(
            (
                LOGGING_CONTROL_SIZE,
                LOGGING_RANGE_SIZE,
                LOGGING_REPORT_SIZE
            ),
            (16, 16, 24)
        );
    }

    #[test]
    fn test_feature_probe_logging_and_migration_ok_others_enotsup() {
        let p = encode_feature(
            8,
            VFIO_DEVICE_FEATURE_PROBE
                | VFIO_DEVICE_FEATURE_SET
                | VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
            &[],
        );
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::Probe
        );
        let p = encode_feature(8, VFIO_DEVICE_FEATURE_PROBE | 1, &[]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::MigrationProbe
        );
        let p = encode_feature(8, VFIO_DEVICE_FEATURE_PROBE | 3, &[]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::ENOTSUP
        );
    }

    #[test]
    fn test_feature_logging_start_ranges_decoded() {
        let mut d = Vec::new();
        d.put_u64(4096);
        d.put_u32(1);
        d.put_u32(0);
        d.put_u64(0x10000);
        d.put_u64(0x4000);
        let p = encode_feature(8 + d.len() as u32, VFIO_DEVICE_FEATURE_SET | 6, &d);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::LoggingStart {
                page_size: 4096,
                ranges: vec![(0x10000, 0x4000)]
            }
        );
        assert!(decode_feature(&p[..p.len() - 1], 0, 1 << 20).is_err());
    }

    #[test]
    fn test_feature_report_bitmap_size_and_argsz() {
        let mut d = Vec::new();
        d.put_u64(0);
        d.put_u64(65 * 4096);
        d.put_u64(4096);
        let p = encode_feature(8 + 24 + 16, VFIO_DEVICE_FEATURE_GET | 8, &d);
        match decode_feature(&p, 0, 1 << 20).unwrap() {
            FeatureRequest::LoggingReport { bitmap_len, .. } => assert_eq!(bitmap_len, 16),
            other => panic!("{other:?}"),
        }
        let p = encode_feature(8 + 24, VFIO_DEVICE_FEATURE_GET | 8, &d);
        assert!(decode_feature(&p, 0, 1 << 20).is_err());
        let p = encode_feature(8 + 24 + 16, VFIO_DEVICE_FEATURE_SET | 8, &d);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::EINVAL
        );
    }

    #[test]
    fn test_feature_bad_flags_rejected() {
        let p = encode_feature(8, 6, &[]);
        assert!(decode_feature(&p, 0, 1 << 20).is_err(), "no op bits");
        let p = encode_feature(8, VFIO_DEVICE_FEATURE_SET | (1 << 20) | 6, &[]);
        assert!(decode_feature(&p, 0, 1 << 20).is_err());
    }

    #[test]
    fn test_feature_migration_get_set_sizes_and_ops() {
        use super::super::migration::encode_mig_state_data;
        let get = VFIO_DEVICE_FEATURE_GET;
        let set = VFIO_DEVICE_FEATURE_SET;
        let p = encode_feature(16, get | VFIO_DEVICE_FEATURE_MIGRATION, &[]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::Migration
        );
        let p = encode_feature(15, get | VFIO_DEVICE_FEATURE_MIGRATION, &[]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::EINVAL
        );
        let p = encode_feature(16, set | VFIO_DEVICE_FEATURE_MIGRATION, &[0; 8]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::EINVAL
        );
        let p = encode_feature(16, get | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &[]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::MigStateGet
        );
        let data = encode_mig_state_data(MigState::StopCopy as u32);
        let p = encode_feature(16, set | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &data);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap(),
            FeatureRequest::MigStateSet(MigState::StopCopy)
        );
        let p = encode_feature(16, set | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, &data[..4]);
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::EINVAL
        );
        let p = encode_feature(
            16,
            set | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE,
            &encode_mig_state_data(9),
        );
        assert_eq!(
            decode_feature(&p, 0, 1 << 20).unwrap_err().errno(),
            libc::EINVAL
        );
    }
}
