//! The migration messages: DEVICE_FEATURE MIGRATION and MIG_DEVICE_STATE payloads
//! (decoded by [`super::feature`]), and MIG_DATA_READ / MIG_DATA_WRITE.
//!
//! Sizes and errnos (`protocol-docs/migration.md`):
//! - MIGRATION GET and MIG_DEVICE_STATE GET/SET need `argsz` ≥ 16 (the 8-byte feature
//!   header and the 8-byte reply data), else `EINVAL`. GET carries no data (8 bytes are
//!   tolerated and ignored); SET carries exactly `device_state` u32 and `data_fd` u32
//!   (unused in vfio-user); a `device_state` that names no state is `EINVAL`.
//! - MIG_DATA_READ is exactly `argsz` u32, `size` u32: `size` above the transfer limit is
//!   `E2BIG`, `argsz` below 8 + `size` is `EINVAL`. The reply is `argsz` (8 + bytes
//!   returned), `size` (bytes returned), the data.
//! - MIG_DATA_WRITE is `argsz` u32, `size` u32, then exactly `size` bytes: `size` above
//!   the limit is `E2BIG`, any other length mismatch or `argsz` below 8 is `EINVAL`. The
//!   reply has no payload.

use vfio_bindings::bindings::vfio::{
    vfio_device_feature_mig_state, vfio_device_feature_migration, VFIO_MIGRATION_PRE_COPY,
    VFIO_MIGRATION_STOP_COPY,
};

use super::feature::FEATURE_HEADER_SIZE;
use super::wire::{Put, Reader};
use super::ProtocolError;
use crate::migration::{MigState, MigrationCaps};

/// MIGRATION's reply data: `struct vfio_device_feature_migration` (flags u64).
pub const MIGRATION_DATA_SIZE: usize = std::mem::size_of::<vfio_device_feature_migration>();
/// MIG_DEVICE_STATE's data: `struct vfio_device_feature_mig_state` (state u32, data_fd).
pub const MIG_STATE_DATA_SIZE: usize = std::mem::size_of::<vfio_device_feature_mig_state>();
/// The fixed part of MIG_DATA_READ/WRITE (argsz, size).
pub const MIG_DATA_HEADER_SIZE: usize = 8;

/// The MIGRATION feature's flags for a device with `caps`: STOP_COPY always, PRE_COPY when
/// offered, never P2P.
pub fn migration_flags(caps: MigrationCaps) -> u64 {
    let mut f = u64::from(VFIO_MIGRATION_STOP_COPY);
    if caps.pre_copy {
        f |= u64::from(VFIO_MIGRATION_PRE_COPY);
    }
    f
}

/// The reply to MIGRATION GET: argsz, the request's flags, then the migration flags.
pub fn encode_migration_reply(request_flags: u32, flags: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(FEATURE_HEADER_SIZE + MIGRATION_DATA_SIZE);
    v.put_u32((FEATURE_HEADER_SIZE + MIGRATION_DATA_SIZE) as u32);
    v.put_u32(request_flags);
    v.put_u64(flags);
    v
}

/// The reply to MIG_DEVICE_STATE GET or SET: argsz, the request's flags, `state`, and
/// `data_fd` -1 (unused in vfio-user).
pub fn encode_mig_state_reply(request_flags: u32, state: MigState) -> Vec<u8> {
    let mut v = Vec::with_capacity(FEATURE_HEADER_SIZE + MIG_STATE_DATA_SIZE);
    v.put_u32((FEATURE_HEADER_SIZE + MIG_STATE_DATA_SIZE) as u32);
    v.put_u32(request_flags);
    v.put_u32(state as u32);
    v.put_u32(u32::MAX);
    v
}

/// The data of a MIG_DEVICE_STATE SET request (for clients).
pub fn encode_mig_state_data(state: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(MIG_STATE_DATA_SIZE);
    v.put_u32(state);
    v.put_u32(u32::MAX);
    v
}

/// Check `argsz` of a migration feature: room for the 8-byte reply data.
pub(super) fn check_argsz(what: &'static str, argsz: u32) -> Result<(), ProtocolError> {
    let min = (FEATURE_HEADER_SIZE + MIG_STATE_DATA_SIZE) as u32;
    if argsz < min {
        return Err(ProtocolError::ArgszTooSmall { what, argsz, min });
    }
    Ok(())
}

/// GET data: none, or an 8-byte buffer that is ignored.
pub(super) fn check_get_data(what: &'static str, data: &[u8]) -> Result<(), ProtocolError> {
    if !data.is_empty() && data.len() != MIG_STATE_DATA_SIZE {
        return Err(ProtocolError::BadPayloadSize {
            what,
            expected: FEATURE_HEADER_SIZE,
            got: FEATURE_HEADER_SIZE + data.len(),
        });
    }
    Ok(())
}

/// SET data: `device_state` and `data_fd`; the state must name a state.
pub(super) fn decode_set_state(data: &[u8]) -> Result<MigState, ProtocolError> {
    if data.len() != MIG_STATE_DATA_SIZE {
        return Err(ProtocolError::BadPayloadSize {
            what: "MIG_DEVICE_STATE SET",
            expected: FEATURE_HEADER_SIZE + MIG_STATE_DATA_SIZE,
            got: FEATURE_HEADER_SIZE + data.len(),
        });
    }
    let mut r = Reader::new(data, "MIG_DEVICE_STATE");
    let raw = r.u32()?;
    let _data_fd = r.u32()?;
    MigState::from_u32(raw).ok_or_else(|| {
        ProtocolError::invalid(
            "MIG_DEVICE_STATE device_state",
            format!("{raw} names no state"),
        )
    })
}

/// A decoded MIG_DATA_READ or MIG_DATA_WRITE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigData<'a> {
    /// MIG_DATA_READ of up to `size` bytes.
    Read {
        /// Bytes asked for.
        size: u32,
    },
    /// MIG_DATA_WRITE of `data`.
    Write(&'a [u8]),
}

/// Decode MIG_DATA_READ (`write` false) or MIG_DATA_WRITE; `max` is the transfer limit.
pub fn decode_mig_data(
    payload: &[u8],
    write: bool,
    max: u32,
) -> Result<MigData<'_>, ProtocolError> {
    let what = if write {
        "MIG_DATA_WRITE"
    } else {
        "MIG_DATA_READ"
    };
    let mut r = Reader::new(payload, what);
    let argsz = r.u32()?;
    let size = r.u32()?;
    if size > max {
        return Err(ProtocolError::TransferTooLarge {
            count: u64::from(size),
            max: u64::from(max),
        });
    }
    if write {
        if r.remaining() != size as usize {
            return Err(ProtocolError::BadPayloadSize {
                what,
                expected: MIG_DATA_HEADER_SIZE + size as usize,
                got: payload.len(),
            });
        }
        if (argsz as usize) < MIG_DATA_HEADER_SIZE {
            return Err(ProtocolError::ArgszTooSmall {
                what,
                argsz,
                min: MIG_DATA_HEADER_SIZE as u32,
            });
        }
        return Ok(MigData::Write(r.rest()));
    }
    if r.remaining() != 0 {
        return Err(ProtocolError::BadPayloadSize {
            what,
            expected: MIG_DATA_HEADER_SIZE,
            got: payload.len(),
        });
    }
    // size ≤ max ≤ u32::MAX, so 8 + size fits u64 and the comparison is exact.
    let need = MIG_DATA_HEADER_SIZE as u64 + u64::from(size);
    if u64::from(argsz) < need {
        return Err(ProtocolError::ArgszTooSmall {
            what,
            argsz,
            min: u32::try_from(need).unwrap_or(u32::MAX),
        });
    }
    Ok(MigData::Read { size })
}

/// A MIG_DATA_READ request payload (for clients).
pub fn encode_mig_data_read(size: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(MIG_DATA_HEADER_SIZE);
    v.put_u32((MIG_DATA_HEADER_SIZE as u32).saturating_add(size));
    v.put_u32(size);
    v
}

/// A MIG_DATA_WRITE request payload, or the reply to a MIG_DATA_READ: argsz, size, data.
pub fn encode_mig_data(data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(MIG_DATA_HEADER_SIZE + data.len());
    v.put_u32((MIG_DATA_HEADER_SIZE + data.len()) as u32);
    v.put_u32(data.len() as u32);
    v.extend_from_slice(data);
    v
}

/// The reply to a MIG_DATA_READ of `asked` bytes that got `data` (at most `asked`):
/// argsz `8 + data.len()`, size `data.len()`, the data, then zero bytes up to `8 + asked`.
///
/// The padding is libvfio-user's: its server always answers with the full asked length
/// (the real length in argsz and size), and its client's transport refuses a reply shorter
/// than the buffer it read into (ECONNRESET), so a shorter reply breaks every
/// libvfio-user-based client on the first short read (protocol-docs/migration.md).
pub fn encode_mig_data_reply(data: &[u8], asked: u32) -> Vec<u8> {
    let mut v = Vec::new();
    put_mig_data_reply(&mut v, data, asked);
    v
}

/// [`encode_mig_data_reply`] appended to `buf` (a reply's buffer: no second copy).
pub fn put_mig_data_reply(buf: &mut Vec<u8>, data: &[u8], asked: u32) {
    let len = MIG_DATA_HEADER_SIZE + data.len().max(asked as usize);
    buf.reserve(len);
    buf.put_u32((MIG_DATA_HEADER_SIZE + data.len()) as u32);
    buf.put_u32(data.len() as u32);
    buf.extend_from_slice(data);
    buf.resize(buf.len() + (len - MIG_DATA_HEADER_SIZE - data.len()), 0);
}

/// The data of a MIG_DATA_READ reply: checks that argsz is `8 + size`, that the payload
/// holds that much, and that anything after it (the padding of
/// [`encode_mig_data_reply`]) is zero.
pub fn decode_mig_data_reply(payload: &[u8]) -> Result<&[u8], ProtocolError> {
    let mut r = Reader::new(payload, "MIG_DATA_READ reply");
    let argsz = r.u32()?;
    let size = r.u32()?;
    let end = MIG_DATA_HEADER_SIZE + size as usize;
    if argsz as usize != end || payload.len() < end || payload[end..].iter().any(|&b| b != 0) {
        return Err(ProtocolError::BadPayloadSize {
            what: "MIG_DATA_READ reply",
            expected: end,
            got: payload.len(),
        });
    }
    Ok(&payload[MIG_DATA_HEADER_SIZE..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(argsz: u32, size: u32) -> Vec<u8> {
        let mut v = Vec::new();
        v.put_u32(argsz);
        v.put_u32(size);
        v
    }

    #[test]
    fn test_mig_data_layout_sizes_keep_their_values() {
        assert_eq!(
            (
                MIGRATION_DATA_SIZE,
                MIG_STATE_DATA_SIZE,
                MIG_DATA_HEADER_SIZE
            ),
            (8, 8, 8)
        );
    }

    #[test]
    fn test_mig_data_read_size_over_limit_e2big_small_argsz_einval() {
        assert_eq!(
            decode_mig_data(&read(8 + 4096, 4096), false, 4096).unwrap(),
            MigData::Read { size: 4096 }
        );
        let e = decode_mig_data(&read(u32::MAX, 4097), false, 4096).unwrap_err();
        assert_eq!(e.errno(), libc::E2BIG);
        let e = decode_mig_data(&read(8 + 4095, 4096), false, 4096).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        let mut long = read(8 + 16, 16);
        long.push(0);
        assert_eq!(
            decode_mig_data(&long, false, 4096).unwrap_err().errno(),
            libc::EINVAL
        );
        assert!(decode_mig_data(&[0; 7], false, 4096).is_err());
    }

    #[test]
    fn test_mig_data_write_length_must_match_size() {
        let p = encode_mig_data(&[1, 2, 3]);
        assert_eq!(
            decode_mig_data(&p, true, 4096).unwrap(),
            MigData::Write(&[1, 2, 3])
        );
        assert_eq!(
            decode_mig_data(&p[..p.len() - 1], true, 4096)
                .unwrap_err()
                .errno(),
            libc::EINVAL
        );
        let big = encode_mig_data(&[0; 4097]);
        assert_eq!(
            decode_mig_data(&big, true, 4096).unwrap_err().errno(),
            libc::E2BIG
        );
        let mut lying = read(8, u32::MAX);
        lying.extend_from_slice(&[0; 8]);
        assert_eq!(
            decode_mig_data(&lying, true, u32::MAX).unwrap_err().errno(),
            libc::EINVAL
        );
    }

    #[test]
    fn test_mig_data_reply_round_trip_and_mismatch_refused() {
        let p = encode_mig_data(b"abc");
        assert_eq!(decode_mig_data_reply(&p).unwrap(), b"abc");
        assert!(decode_mig_data_reply(&p[..p.len() - 1]).is_err());
    }

    #[test]
    fn test_mig_data_reply_padded_to_the_asked_size_with_real_length_in_argsz_and_size() {
        let p = encode_mig_data_reply(b"abc", 16);
        assert_eq!(
            p.len(),
            8 + 16,
            "libvfio-user's clients read 8 + asked bytes"
        );
        assert_eq!(&p[..8], &[11, 0, 0, 0, 3, 0, 0, 0], "argsz 8 + 3, size 3");
        assert_eq!(&p[8..11], b"abc");
        assert!(p[11..].iter().all(|&b| b == 0));
        assert_eq!(decode_mig_data_reply(&p).unwrap(), b"abc");
        // A full read has no padding; an empty one is all padding.
        assert_eq!(
            encode_mig_data_reply(&[7; 16], 16),
            encode_mig_data(&[7; 16])
        );
        let empty = encode_mig_data_reply(&[], 4);
        assert_eq!(empty, [8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(decode_mig_data_reply(&empty).unwrap(), b"");
        // Padding that is not zero, or an argsz that counts it, is refused.
        let mut dirty = p.clone();
        dirty[20] = 1;
        assert!(decode_mig_data_reply(&dirty).is_err());
        let mut long_argsz = p.clone();
        long_argsz[0] = 24;
        assert!(decode_mig_data_reply(&long_argsz).is_err());
    }

    #[test]
    fn test_set_state_unknown_value_einval() {
        assert_eq!(
            decode_set_state(&encode_mig_state_data(1)).unwrap(),
            MigState::Stop
        );
        for bad in [8, 0xabcd, u32::MAX] {
            assert_eq!(
                decode_set_state(&encode_mig_state_data(bad))
                    .unwrap_err()
                    .errno(),
                libc::EINVAL
            );
        }
        assert!(decode_set_state(&[1, 0, 0, 0]).is_err());
    }
}
