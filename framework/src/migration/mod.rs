//! Live migration (VFIO migration v2 over vfio-user): the device states, what a device does
//! to migrate, and the versioned encoding of its state.
//!
//! A device opts in by returning its [`Migrate`] implementation from
//! [`crate::pci::PciDevice::migration`]. The framework owns the state machine (the kernel's
//! `vfio_device_mig_state` arcs, driven by DEVICE_FEATURE MIG_DEVICE_STATE), the stream
//! framing (MIG_DATA_READ/WRITE) and the state it emulates itself (PCI config space,
//! MSI/MSI-X, INTx); the device only stops, resumes, saves and loads its own state.
//!
//! The device's state travels as bytes it produces with [`encode_state`] and reads back
//! with [`decode_state`]: a serde value in postcard's encoding behind a small header that
//! names the format and its version, so that a stream from another umdev is either read
//! (a version the device still understands) or refused with a clear error, never misread.
//!
//! Files: [`arcs`] (the legal arcs and the shortest path a SET takes, checked against the
//! kernel's table), [`machine`] (the per-connection state machine: which [`Migrate`] call
//! each arc makes, the data sessions, ERROR), [`stream`] (the framed data stream of
//! MIG_DATA_READ/WRITE: start frame, PRE_COPY frames, the state, end; CRC-checked),
//! [`decode`] (field-by-field decoding of a state within the device's limits), this
//! file (the states, the trait, the versioned encoding).
//!
//! **Limits.** A device declares the largest state it produces
//! ([`Migrate::max_state_size`]); a destination refuses a frame longer than that at its
//! head, before buffering any of it, and holds at most one frame at a time, once. Inside a
//! frame, a device whose state carries sequences decodes them with a [`Decoder`], checking
//! each declared length against what it can hold before anything is allocated. The wire side is in
//! `protocol::feature`, the dispatch in `server`, the framework's own PCI state in
//! `pci/migration.rs`; `protocol-docs/migration.md` describes it all for a VMM.

pub mod arcs;
pub mod decode;
pub mod machine;
pub mod stream;

pub use decode::Decoder;
pub use machine::{Machine, MachineError, Quiesce};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The device states of VFIO migration v2 (`enum vfio_device_mig_state` of `linux/vfio.h`,
/// same values on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigState {
    /// The device failed a transition; only a reset leaves it.
    Error = 0,
    /// Not running: no DMA, no interrupts, no state change.
    Stop = 1,
    /// Normal operation.
    Running = 2,
    /// Stopped, its state being read out (source side).
    StopCopy = 3,
    /// Stopped, its state being written in (destination side).
    Resuming = 4,
    /// Running but not initiating peer-to-peer DMA (P2P; not offered by umdev).
    RunningP2p = 5,
    /// Running while state is read out early (source side).
    PreCopy = 6,
    /// PRE_COPY with peer-to-peer DMA quiesced (not offered by umdev).
    PreCopyP2p = 7,
}

impl MigState {
    /// The state with wire value `v`.
    pub fn from_u32(v: u32) -> Option<MigState> {
        Some(match v {
            0 => MigState::Error,
            1 => MigState::Stop,
            2 => MigState::Running,
            3 => MigState::StopCopy,
            4 => MigState::Resuming,
            5 => MigState::RunningP2p,
            6 => MigState::PreCopy,
            7 => MigState::PreCopyP2p,
            _ => return None,
        })
    }
}

/// The optional migration features a device offers (STOP_COPY is always offered; P2P never).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrationCaps {
    /// The device can send state while it runs ([`Migrate::precopy`]).
    pub pre_copy: bool,
}

/// Why a migration step failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The stream was not written by this format.
    #[error("not a {expected} state (found {found:?})")]
    WrongFormat {
        /// The format the reader expected.
        expected: String,
        /// What the header named.
        found: String,
    },
    /// The stream's format version is not one this side can read.
    #[error("{format} state version {found} is not supported (this umdev reads {min}..={max})")]
    UnsupportedVersion {
        /// The format.
        format: String,
        /// The version in the stream.
        found: u32,
        /// Oldest readable version.
        min: u32,
        /// Newest readable version.
        max: u32,
    },
    /// The bytes do not decode (cut short, corrupted, trailing bytes).
    #[error("{format} state is malformed: {why}")]
    Malformed {
        /// The format.
        format: String,
        /// What is wrong.
        why: String,
    },
    /// The state decodes but cannot be applied (e.g. a framebuffer of another size).
    #[error("{0}")]
    Incompatible(String),
    /// The device cannot do this now (e.g. stop while a reset is in progress).
    #[error("{0}")]
    Device(String),
}

/// What a device does to migrate. All methods run on the server's connection thread with
/// the device locked; see each for what the framework guarantees around it.
pub trait Migrate: Send {
    /// The optional features the device offers.
    fn caps(&self) -> MigrationCaps {
        MigrationCaps::default()
    }

    /// The largest [`Migrate::save`] state or [`Migrate::precopy`] chunk this device
    /// produces, in bytes, computed from its real size (a GPU: from its framebuffer). A
    /// destination refuses a longer frame at its head, before it buffers any of it, so this
    /// bounds what a client can make the destination hold; a source whose device produces
    /// more fails the arc instead of sending a stream no destination reads. At most
    /// [`stream::MAX_FRAME`] (the frame head's 32-bit length); the default,
    /// [`DEFAULT_MAX_STATE`], suits small register-only devices.
    fn max_state_size(&self) -> u64 {
        DEFAULT_MAX_STATE
    }

    /// Stop the device (RUNNING/PRE_COPY → STOP). When this returns: no DMA, no interrupt,
    /// no change of state that [`Migrate::save`] captures; in-flight work is finished or
    /// captured in that state. Server→client requests are cancelled while it runs (a
    /// device waiting for its worker does not wait for the client).
    fn stop(&mut self) -> Result<(), MigrationError>;

    /// Run again (STOP → RUNNING), on the source after an aborted migration or on the
    /// destination after [`Migrate::load`].
    fn resume(&mut self) -> Result<(), MigrationError>;

    /// The device's whole state, stopped (STOP_COPY); usually [`encode_state`] of a serde
    /// struct. Pins are not state: the destination pins again on demand.
    fn save(&mut self) -> Result<Vec<u8>, MigrationError>;

    /// Replace the device's state with `state` from [`Migrate::save`] (RESUMING → STOP).
    /// On error the device must be as after a reset, not half loaded. `state` is client
    /// data of at most [`Migrate::max_state_size`] bytes: a state with sequences reads them
    /// with a [`Decoder`], each declared length checked against the device's own sizes.
    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError>;

    /// PRE_COPY: state that changed since the previous call (the first call: what can be
    /// sent early, e.g. a whole framebuffer), or `None` when nothing is dirty. Called while
    /// the device runs.
    fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        Ok(None)
    }

    /// Apply one [`Migrate::precopy`] chunk on the destination (RESUMING), before
    /// [`Migrate::load`].
    fn load_precopy(&mut self, _chunk: &[u8]) -> Result<(), MigrationError> {
        Err(MigrationError::Device(
            "this device sends no PRE_COPY data".into(),
        ))
    }
}

/// [`Migrate::max_state_size`] of a device that does not declare its own: 16 MiB.
pub const DEFAULT_MAX_STATE: u64 = 16 << 20;

/// The header in front of every encoded state.
#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
}

/// Encode `value` as version `version` of `format` (e.g. `"umdev-gpu"`): a header naming
/// both, then the value, in postcard's encoding.
pub fn encode_state<T: Serialize>(
    format: &str,
    version: u32,
    value: &T,
) -> Result<Vec<u8>, MigrationError> {
    let mut out = Vec::new();
    encode_state_into(&mut out, format, version, value)?;
    Ok(out)
}

/// [`encode_state`] appended to `out` (a section behind another one, written without a
/// copy of its own).
pub fn encode_state_into<T: Serialize>(
    out: &mut Vec<u8>,
    format: &str,
    version: u32,
    value: &T,
) -> Result<(), MigrationError> {
    let header = Header {
        format: format.to_owned(),
        version,
    };
    // Sized first, so a large state is written once into a buffer of its exact size (no
    // doubling, no second copy).
    let size = postcard::experimental::serialized_size(&header)
        .and_then(|h| Ok(h + postcard::experimental::serialized_size(value)?))
        .map_err(|e| malformed(format, e))?;
    out.try_reserve_exact(size)
        .map_err(|e| MigrationError::Device(format!("{format} state of {size} bytes: {e}")))?;
    let taken = std::mem::take(out);
    let taken = postcard::to_extend(&header, taken).map_err(|e| malformed(format, e))?;
    *out = postcard::to_extend(value, taken).map_err(|e| malformed(format, e))?;
    Ok(())
}

/// Decode what [`encode_state`] wrote: the header must name `format` with a version in
/// `min..=max`, the value must decode from exactly the remaining bytes. Returns the version
/// found (a reader that supports several picks its type by it with [`decode_header`]).
pub fn decode_state<T: DeserializeOwned>(
    format: &str,
    min: u32,
    max: u32,
    bytes: &[u8],
) -> Result<(u32, T), MigrationError> {
    let (version, rest) = decode_header(format, min, max, bytes)?;
    let (value, trailing) =
        postcard::take_from_bytes::<T>(rest).map_err(|e| malformed(format, e))?;
    if !trailing.is_empty() {
        return Err(MigrationError::Malformed {
            format: format.to_owned(),
            why: format!("{} trailing bytes", trailing.len()),
        });
    }
    Ok((version, value))
}

/// Check the header of an encoded state; returns its version and the bytes after it.
pub fn decode_header<'a>(
    format: &str,
    min: u32,
    max: u32,
    bytes: &'a [u8],
) -> Result<(u32, &'a [u8]), MigrationError> {
    let (h, rest) = postcard::take_from_bytes::<Header>(bytes).map_err(|e| malformed(format, e))?;
    if h.format != format {
        return Err(MigrationError::WrongFormat {
            expected: format.to_owned(),
            found: h.format,
        });
    }
    if h.version < min || h.version > max {
        return Err(MigrationError::UnsupportedVersion {
            format: format.to_owned(),
            found: h.version,
            min,
            max,
        });
    }
    Ok((h.version, rest))
}

fn malformed(format: &str, e: postcard::Error) -> MigrationError {
    MigrationError::Malformed {
        format: format.to_owned(),
        why: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct V1 {
        regs: Vec<u32>,
        name: String,
    }

    #[test]
    fn test_state_round_trip_keeps_value_and_version() {
        let v = V1 {
            regs: vec![1, 2, 0xffff_ffff],
            name: "gpu".into(),
        };
        let bytes = encode_state("umdev-test", 3, &v).unwrap();
        let (version, back): (u32, V1) = decode_state("umdev-test", 1, 3, &bytes).unwrap();
        assert_eq!((version, back), (3, v));
    }

    #[test]
    fn test_state_newer_version_wrong_format_cut_short_trailing_all_refused() {
        let v = V1 {
            regs: vec![7; 16],
            name: "x".into(),
        };
        let bytes = encode_state("umdev-test", 4, &v).unwrap();
        assert!(matches!(
            decode_state::<V1>("umdev-test", 1, 3, &bytes),
            Err(MigrationError::UnsupportedVersion { found: 4, .. })
        ));
        assert!(matches!(
            decode_state::<V1>("umdev-other", 1, 4, &bytes),
            Err(MigrationError::WrongFormat { .. })
        ));
        for cut in 0..bytes.len() {
            assert!(
                decode_state::<V1>("umdev-test", 1, 4, &bytes[..cut]).is_err(),
                "a stream cut at {cut} of {} bytes was accepted",
                bytes.len()
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            decode_state::<V1>("umdev-test", 1, 4, &long),
            Err(MigrationError::Malformed { .. })
        ));
    }

    #[test]
    fn test_mig_state_wire_values_round_trip() {
        for v in 0..8 {
            assert_eq!(MigState::from_u32(v).map(|s| s as u32), Some(v));
        }
        assert_eq!(MigState::from_u32(8), None);
    }
}
