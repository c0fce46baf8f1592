//! VFIO_USER_VERSION: version numbers and the JSON capabilities.
//!
//! The JSON travels as typed structs with serde derive, in both directions:
//! `{"capabilities": {...}}` is `VersionJson` holding a `CapsJson`. Every key is an
//! `Option`: `None` is an absent key, which means the spec default on decode and "not
//! answered" on encode (the reply holds only the keys the client offered; `None` fields
//! are skipped, and the others come out in the structs' field order).
//!
//! Decoding rules (each a `BadCapabilities` → `EINVAL` when broken):
//! - the text is parsed into a `serde_json::Value` first and the structs are deserialized
//!   from it, so a key that appears twice in one object keeps its last value (a JSON
//!   object's usual reading, and what umdev always did) and errors carry no position;
//! - a known key of the wrong type, `null` included, is refused with a message that starts
//!   with the key's path (`twin_socket.fd_index: invalid type: ...`): each key has its own
//!   `deserialize_with` function in `key` for that;
//! - `capabilities`, `twin_socket` and the top level must be JSON objects (`object`: a
//!   derived struct alone would also take an array of its fields);
//! - unknown keys are ignored at every level;
//! - `migration` is accepted whatever it holds (umdev never validated it); only its
//!   `pgsize` and `max_bitmap_size` are read, each when it is a u64. The reply carries a
//!   `migration` object (umdev's `pgsize` and `max_bitmap_size`) only when the client
//!   offered one and the device migrates ([`ServerOffer::migration`]).

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{Error as _, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::wire::{Put, Reader};
use super::ProtocolError;

/// The protocol major version umdev speaks.
pub const MAJOR: u16 = 0;
/// The highest minor version umdev speaks.
pub const MINOR: u16 = 0;
/// Spec default of max_msg_fds when absent.
pub const DEFAULT_MAX_MSG_FDS: u32 = 1;
/// Spec default of max_data_xfer_size when absent.
pub const DEFAULT_MAX_DATA_XFER_SIZE: u32 = 1 << 20;
/// Spec default of max_dma_maps when absent.
pub const DEFAULT_MAX_DMA_MAPS: u32 = 65535;
/// Spec default of pgsizes when absent.
pub const DEFAULT_PGSIZES: u64 = 4096;
/// Upper bound umdev accepts for a client's max_data_xfer_size (QEMU's own cap).
pub const MAX_MAX_DATA_XFER_SIZE: u32 = 64 << 20;

/// Capabilities one side announces. Absent keys hold the spec defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Most fds the sender can receive in one message.
    pub max_msg_fds: u32,
    /// Largest data transfer (REGION_READ/WRITE, DMA_READ/WRITE count) the sender accepts.
    pub max_data_xfer_size: u32,
    /// Most simultaneous DMA maps.
    pub max_dma_maps: u32,
    /// Supported DMA page sizes, or'ed.
    pub pgsizes: u64,
    /// The sender supports twin-socket mode.
    pub twin_socket: bool,
    /// In a reply: index of the twin socket in the attached fds.
    pub twin_socket_fd_index: Option<u32>,
    /// REGION_WRITE_MULTI is supported.
    pub write_multiple: bool,
    /// A `migration` object was present (in a reply: umdev's device migrates).
    pub migration: bool,
    /// `migration.pgsize`: the dirty-page granularity.
    pub migration_pgsize: Option<u64>,
    /// `migration.max_bitmap_size`: the largest dirty bitmap in one reply. In a proposal
    /// only QEMU sends it (used to recognize QEMU's DMA_READ/DMA_WRITE layout, see
    /// [`super::dma_rw::DmaRwLayout`]).
    pub migration_max_bitmap_size: Option<u64>,
    /// Which keys were present (so a reply can stay a subset of the proposal).
    pub present: Present,
}

/// Which capability keys a message carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Present {
    /// max_msg_fds present.
    pub max_msg_fds: bool,
    /// max_data_xfer_size present.
    pub max_data_xfer_size: bool,
    /// max_dma_maps present.
    pub max_dma_maps: bool,
    /// pgsizes present.
    pub pgsizes: bool,
    /// twin_socket present.
    pub twin_socket: bool,
    /// write_multiple present.
    pub write_multiple: bool,
    /// migration present.
    pub migration: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            max_msg_fds: DEFAULT_MAX_MSG_FDS,
            max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
            max_dma_maps: DEFAULT_MAX_DMA_MAPS,
            pgsizes: DEFAULT_PGSIZES,
            twin_socket: false,
            twin_socket_fd_index: None,
            write_multiple: false,
            migration: false,
            migration_pgsize: None,
            migration_max_bitmap_size: None,
            present: Present::default(),
        }
    }
}

/// A decoded VERSION message (request or reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
    /// Capabilities (defaults if the JSON was absent).
    pub caps: Capabilities,
}

/// The whole VERSION JSON. In a reply `capabilities` is always there (possibly empty): the
/// `vfio_user` crate's client requires it.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct VersionJson {
    #[serde(deserialize_with = "key::capabilities")]
    capabilities: Option<CapsJson>,
}

/// The `capabilities` object. The field order is the reply's key order.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct CapsJson {
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::max_msg_fds"
    )]
    max_msg_fds: Option<u32>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::max_data_xfer_size"
    )]
    max_data_xfer_size: Option<u32>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::max_dma_maps"
    )]
    max_dma_maps: Option<u32>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::pgsizes"
    )]
    pgsizes: Option<u64>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::write_multiple"
    )]
    write_multiple: Option<bool>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::twin_socket"
    )]
    twin_socket: Option<TwinSocketJson>,
    /// Read (presence, `pgsize`, `max_bitmap_size`); written only when umdev's device
    /// migrates and the client offered it.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::migration"
    )]
    migration: Option<MigrationJson>,
}

/// `capabilities.twin_socket`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct TwinSocketJson {
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::twin_socket_supported"
    )]
    supported: Option<bool>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "key::twin_socket_fd_index"
    )]
    fd_index: Option<u32>,
}

/// What umdev reads and writes of `capabilities.migration`.
#[derive(Debug, Default, Serialize)]
struct MigrationJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    pgsize: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_bitmap_size: Option<u64>,
}

/// One `deserialize_with` function per key. A present key is `Some` even when its value
/// is `null` (which then fails its type, as an absent key does not), and the error of a
/// value of the wrong type starts with the key's path.
mod key {
    use super::{object, typed, CapsJson, MigrationJson, TwinSocketJson};
    use serde::{Deserialize, Deserializer};
    use serde_json::Value;

    macro_rules! keys {
        ($($name:ident: $ty:ty = $path:literal by $how:ident;)*) => {$(
            pub(super) fn $name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<$ty>, D::Error> {
                $how(d, $path).map(Some)
            }
        )*};
    }

    keys! {
        capabilities: CapsJson = "capabilities" by object;
        max_msg_fds: u32 = "max_msg_fds" by typed;
        max_data_xfer_size: u32 = "max_data_xfer_size" by typed;
        max_dma_maps: u32 = "max_dma_maps" by typed;
        pgsizes: u64 = "pgsizes" by typed;
        write_multiple: bool = "write_multiple" by typed;
        twin_socket: TwinSocketJson = "twin_socket" by object;
        twin_socket_supported: bool = "twin_socket.supported" by typed;
        twin_socket_fd_index: u32 = "twin_socket.fd_index" by typed;
    }

    /// Anything is accepted; `pgsize` and `max_bitmap_size` are kept when they are u64s.
    pub(super) fn migration<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<MigrationJson>, D::Error> {
        let v = Value::deserialize(d)?;
        Ok(Some(MigrationJson {
            pgsize: v.get("pgsize").and_then(Value::as_u64),
            max_bitmap_size: v.get("max_bitmap_size").and_then(Value::as_u64),
        }))
    }
}

/// A scalar key's value as `T`; the error is prefixed with the key's path.
fn typed<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    path: &'static str,
) -> Result<T, D::Error> {
    T::deserialize(d).map_err(|e| D::Error::custom(format_args!("{path}: {e}")))
}

/// A derived struct from a JSON object only (not from an array of its fields). A value
/// that is not an object gets an error prefixed with `path`; errors of the keys inside
/// pass through unchanged (they name their own key).
fn object<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    path: &'static str,
) -> Result<T, D::Error> {
    struct ObjectVisitor<'a, T> {
        entered: &'a Cell<bool>,
        _t: PhantomData<T>,
    }
    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<'_, T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            self.entered.set(true);
            T::deserialize(MapAccessDeserializer::new(map))
        }
    }
    let entered = Cell::new(false);
    d.deserialize_map(ObjectVisitor {
        entered: &entered,
        _t: PhantomData,
    })
    .map_err(|e| {
        if entered.get() {
            e
        } else {
            D::Error::custom(format_args!("{path}: {e}"))
        }
    })
}

impl From<CapsJson> for Capabilities {
    fn from(j: CapsJson) -> Self {
        let d = Capabilities::default();
        Capabilities {
            max_msg_fds: j.max_msg_fds.unwrap_or(d.max_msg_fds),
            max_data_xfer_size: j.max_data_xfer_size.unwrap_or(d.max_data_xfer_size),
            max_dma_maps: j.max_dma_maps.unwrap_or(d.max_dma_maps),
            pgsizes: j.pgsizes.unwrap_or(d.pgsizes),
            twin_socket: j
                .twin_socket
                .as_ref()
                .and_then(|t| t.supported)
                .unwrap_or(false),
            twin_socket_fd_index: j.twin_socket.as_ref().and_then(|t| t.fd_index),
            write_multiple: j.write_multiple.unwrap_or(false),
            migration: j.migration.is_some(),
            migration_pgsize: j.migration.as_ref().and_then(|m| m.pgsize),
            migration_max_bitmap_size: j.migration.as_ref().and_then(|m| m.max_bitmap_size),
            present: Present {
                max_msg_fds: j.max_msg_fds.is_some(),
                max_data_xfer_size: j.max_data_xfer_size.is_some(),
                max_dma_maps: j.max_dma_maps.is_some(),
                pgsizes: j.pgsizes.is_some(),
                twin_socket: j.twin_socket.is_some(),
                write_multiple: j.write_multiple.is_some(),
                migration: j.migration.is_some(),
            },
        }
    }
}

impl From<&Capabilities> for CapsJson {
    /// The keys marked in `present`; twin_socket carries `fd_index` only when it is
    /// supported and has one; `migration` carries the pgsize and max_bitmap_size that
    /// are set.
    fn from(c: &Capabilities) -> Self {
        let p = &c.present;
        let twin_socket = match c.twin_socket_fd_index {
            Some(i) if c.twin_socket => TwinSocketJson {
                supported: Some(true),
                fd_index: Some(i),
            },
            _ => TwinSocketJson {
                supported: Some(false),
                fd_index: None,
            },
        };
        CapsJson {
            max_msg_fds: p.max_msg_fds.then_some(c.max_msg_fds),
            max_data_xfer_size: p.max_data_xfer_size.then_some(c.max_data_xfer_size),
            max_dma_maps: p.max_dma_maps.then_some(c.max_dma_maps),
            pgsizes: p.pgsizes.then_some(c.pgsizes),
            write_multiple: p.write_multiple.then_some(c.write_multiple),
            twin_socket: p.twin_socket.then_some(twin_socket),
            migration: p.migration.then_some(MigrationJson {
                pgsize: c.migration_pgsize,
                max_bitmap_size: c.migration_max_bitmap_size,
            }),
        }
    }
}

impl Version {
    /// Decode a VERSION payload: major, minor, optional NUL-terminated JSON.
    pub fn decode(payload: &[u8]) -> Result<Version, ProtocolError> {
        let mut r = Reader::new(payload, "VERSION");
        let major = r.u16()?;
        let minor = r.u16()?;
        let json = r.rest();
        let caps = Self::parse_caps(json)?;
        Ok(Version { major, minor, caps })
    }

    fn parse_caps(json: &[u8]) -> Result<Capabilities, ProtocolError> {
        if json.is_empty() {
            return Ok(Capabilities::default());
        }
        let Some((&0, text)) = json.split_last() else {
            return Err(ProtocolError::BadCapabilities(
                "version data is not NUL-terminated".into(),
            ));
        };
        let text = std::str::from_utf8(text)
            .map_err(|_| ProtocolError::BadCapabilities("version data is not UTF-8".into()))?;
        let text = text.trim_end_matches('\0');
        if text.is_empty() {
            return Ok(Capabilities::default());
        }
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ProtocolError::BadCapabilities(format!("invalid JSON: {e}")))?;
        let json: VersionJson = object(v, "version data")
            .map_err(|e: serde_json::Error| ProtocolError::BadCapabilities(e.to_string()))?;
        Ok(json.capabilities.unwrap_or_default().into())
    }

    /// Encode a VERSION payload; the JSON holds only the keys marked present in
    /// `caps.present` (plus twin_socket when `twin_socket_fd_index` is set).
    pub fn encode_payload(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(160);
        out.put_u16(self.major);
        out.put_u16(self.minor);
        out.extend_from_slice(self.caps_json().as_bytes());
        out.push(0);
        out
    }

    /// The JSON text (no NUL) of [`Version::encode_payload`]: `{"capabilities":{...}}`
    /// with the present keys in the order max_msg_fds, max_data_xfer_size, max_dma_maps,
    /// pgsizes, write_multiple, twin_socket, migration.
    pub fn caps_json(&self) -> String {
        let json = VersionJson {
            capabilities: Some(CapsJson::from(&self.caps)),
        };
        // Structs of integers, booleans and options with string keys: serde_json cannot
        // fail on them.
        serde_json::to_string(&json).expect("the VERSION JSON always serializes")
    }
}

/// What umdev is willing to offer, from the server configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerOffer {
    /// Most fds umdev accepts in one message.
    pub max_msg_fds: u32,
    /// Largest transfer umdev accepts.
    pub max_data_xfer_size: u32,
    /// Most DMA maps.
    pub max_dma_maps: u32,
    /// DMA page size umdev supports (one size).
    pub pgsize: u64,
    /// Twin-socket mode offered.
    pub twin_socket: bool,
    /// REGION_WRITE_MULTI accepted: a client that offers `write_multiple` gets it back
    /// (see `ServerConfig::write_multiple` for why the server's default is off).
    pub write_multiple: bool,
    /// The device migrates: a client that offers `migration` gets it back.
    pub migration: bool,
}

/// The outcome of negotiation: the reply to send and the limits that now apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The reply (version + capabilities).
    pub reply: Version,
    /// The reply is longer than the client's request even after dropping every key that
    /// may be dropped (the caller logs it; a client whose reply buffer is its request's
    /// size, as QEMU's, would refuse it).
    pub reply_longer_than_request: bool,
    /// Max fds the client accepts from us in one message.
    pub client_max_msg_fds: u32,
    /// Largest transfer in either direction.
    pub max_data_xfer_size: u32,
    /// Max DMA maps.
    pub max_dma_maps: u32,
    /// REGION_WRITE_MULTI negotiated.
    pub write_multiple: bool,
    /// Twin-socket mode enabled (the reply must carry the client end at fd index 0).
    pub twin_socket: bool,
}

/// Apply the spec's negotiation rules to a client proposal: same major (else
/// `UnsupportedVersion`), minor ≤ the client's, capabilities a subset of the proposal,
/// numbers the minimum of both sides. `request_size` is the size of the client's whole
/// message: the reply is kept no longer (QEMU's reply buffer is the request's size) by
/// dropping keys whose absence loses nothing or only makes the client do less; `migration`
/// and limits the client must know are never dropped (see `reply_longer_than_request`).
pub fn negotiate(
    client: &Version,
    offer: &ServerOffer,
    request_size: usize,
) -> Result<Negotiated, ProtocolError> {
    if client.major != MAJOR {
        return Err(ProtocolError::UnsupportedVersion(client.major));
    }
    let cc = &client.caps;
    if cc.max_data_xfer_size == 0 || cc.max_data_xfer_size > MAX_MAX_DATA_XFER_SIZE {
        return Err(ProtocolError::BadCapabilities(format!(
            "max_data_xfer_size {} outside 1..={MAX_MAX_DATA_XFER_SIZE}",
            cc.max_data_xfer_size
        )));
    }
    if cc.pgsizes & offer.pgsize == 0 {
        return Err(ProtocolError::Unsupported(
            "client pgsizes without umdev's page size",
        ));
    }
    let xfer = cc.max_data_xfer_size.min(offer.max_data_xfer_size);
    let maps = cc.max_dma_maps.min(offer.max_dma_maps);
    let twin = offer.twin_socket && cc.twin_socket;
    let write_multiple = offer.write_multiple && cc.write_multiple;
    let migration = offer.migration && cc.migration;
    let mut caps = Capabilities {
        max_msg_fds: offer.max_msg_fds,
        max_data_xfer_size: xfer,
        max_dma_maps: maps,
        pgsizes: offer.pgsize,
        twin_socket: twin,
        twin_socket_fd_index: twin.then_some(0),
        write_multiple,
        migration,
        migration_pgsize: migration.then_some(offer.pgsize),
        migration_max_bitmap_size: migration.then_some(u64::from(xfer)),
        present: Present {
            max_msg_fds: cc.present.max_msg_fds,
            max_data_xfer_size: cc.present.max_data_xfer_size,
            max_dma_maps: cc.present.max_dma_maps,
            pgsizes: cc.present.pgsizes,
            twin_socket: cc.present.twin_socket,
            write_multiple: cc.present.write_multiple && write_multiple,
            migration,
        },
    };
    let mut reply = Version {
        major: MAJOR,
        // MINOR is 0, so it is never above the client's minor.
        minor: MINOR,
        caps: caps.clone(),
    };
    // Shorten the reply until it fits the client's buffer (QEMU's is the request's size;
    // the spec has no such rule). First the keys whose absence the client reads as the
    // same value (spec defaults: nothing is lost), then the keys whose absence only makes
    // the client do less (no REGION_WRITE_MULTI; one fd per message). Never dropped:
    // `migration` (the client would conclude the device cannot migrate), a max_dma_maps or
    // max_data_xfer_size below the default (the client would exceed them) and twin_socket
    // (dropping it changes the outcome). A reply that still does not fit goes out whole
    // (`reply_longer_than_request`): QEMU always proposes every key it knows with values
    // at least as long as umdev's answers, so it never gets one.
    /// (may this key be dropped, drop it).
    type Dropper = (fn(&Capabilities) -> bool, fn(&mut Present));
    let droppers: [Dropper; 6] = [
        (|c| c.pgsizes == DEFAULT_PGSIZES, |p| p.pgsizes = false),
        (
            |c| c.max_dma_maps == DEFAULT_MAX_DMA_MAPS,
            |p| p.max_dma_maps = false,
        ),
        (
            |c| c.max_data_xfer_size == DEFAULT_MAX_DATA_XFER_SIZE,
            |p| p.max_data_xfer_size = false,
        ),
        (
            |c| c.max_msg_fds == DEFAULT_MAX_MSG_FDS,
            |p| p.max_msg_fds = false,
        ),
        (|_| true, |p| p.write_multiple = false),
        (|_| true, |p| p.max_msg_fds = false),
    ];
    let fits = |r: &Version| super::header::HEADER_SIZE + r.encode_payload().len() <= request_size;
    for (may_drop, drop) in droppers {
        if fits(&reply) {
            break;
        }
        if may_drop(&caps) {
            drop(&mut caps.present);
            reply.caps = caps.clone();
        }
    }
    let reply_longer_than_request = !fits(&reply);
    // A dropped max_data_xfer_size had the default value, which the client now assumes.
    let max_data_xfer_size = xfer;
    let write_multiple = reply.caps.present.write_multiple && write_multiple;
    Ok(Negotiated {
        reply,
        reply_longer_than_request,
        client_max_msg_fds: cc.max_msg_fds,
        max_data_xfer_size,
        max_dma_maps: maps,
        write_multiple,
        twin_socket: twin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const QEMU_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":268435456},\"write_multiple\":true}}";

    fn payload(major: u16, minor: u16, json: &str) -> Vec<u8> {
        let mut v = Vec::new();
        v.put_u16(major);
        v.put_u16(minor);
        v.extend_from_slice(json.as_bytes());
        v.push(0);
        v
    }

    fn offer() -> ServerOffer {
        ServerOffer {
            max_msg_fds: 16,
            max_data_xfer_size: 1 << 20,
            max_dma_maps: 65535,
            pgsize: 4096,
            twin_socket: true,
            write_multiple: true,
            migration: false,
        }
    }

    #[test]
    fn test_version_decode_qemu_proposal_parses_all_keys() {
        let v = Version::decode(&payload(0, 0, QEMU_CAPS)).unwrap();
        assert_eq!(v.caps.max_msg_fds, 16);
        assert_eq!(v.caps.max_dma_maps, 65535);
        assert!(v.caps.write_multiple);
        assert!(v.caps.migration);
        assert_eq!(v.caps.migration_max_bitmap_size, Some(268435456));
    }

    #[test]
    fn test_version_decode_unknown_keys_ignored() {
        let v = Version::decode(&payload(0, 1, "{\"capabilities\":{\"x\":1},\"y\":[]}")).unwrap();
        assert_eq!(v.caps, Capabilities::default());
    }

    #[test]
    fn test_version_decode_no_json_gives_defaults() {
        let v = Version::decode(&[0, 0, 0, 0]).unwrap();
        assert_eq!(v.caps.max_msg_fds, 1);
    }

    #[test]
    fn test_version_decode_bad_json_rejected() {
        assert!(Version::decode(&payload(0, 0, "{nope")).is_err());
        assert!(
            Version::decode(&payload(0, 0, "{\"capabilities\":{\"max_msg_fds\":-1}}")).is_err()
        );
        let mut p = payload(0, 0, "{}");
        p.pop();
        assert!(Version::decode(&p).is_err(), "missing NUL");
        assert!(Version::decode(&[0, 0]).is_err());
    }

    #[test]
    fn test_negotiate_qemu_reply_fits_and_is_subset() {
        let req = payload(0, 0, QEMU_CAPS);
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 16 + req.len()).unwrap();
        let reply = n.reply.encode_payload();
        assert!(16 + reply.len() <= 16 + req.len());
        let back = Version::decode(&reply).unwrap();
        assert_eq!(back.major, 0);
        assert!(back.minor <= v.minor);
        assert!(
            !back.caps.migration,
            "migration must not be echoed for a device that does not migrate"
        );
        assert!(!n.reply.caps_json().contains("twin_socket"));
        assert!(n.write_multiple);
    }

    #[test]
    fn test_negotiate_short_request_drops_keys_to_fit() {
        let json = "{\"capabilities\":{\"max_msg_fds\":1,\"max_data_xfer_size\":4096,\"pgsizes\":4096,\"max_dma_maps\":5,\"write_multiple\":true}}";
        let req = payload(0, 0, json);
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 16 + req.len()).unwrap();
        assert!(16 + n.reply.encode_payload().len() <= 16 + req.len());
        assert_eq!(n.max_data_xfer_size, 4096);
    }

    #[test]
    fn test_negotiate_major_one_rejected() {
        let v = Version::decode(&payload(1, 0, "{}")).unwrap();
        assert_eq!(
            negotiate(&v, &offer(), 100).unwrap_err(),
            ProtocolError::UnsupportedVersion(1)
        );
    }

    #[test]
    fn test_negotiate_twin_socket_when_both_support() {
        let req = payload(
            0,
            0,
            "{\"capabilities\":{\"twin_socket\":{\"supported\":true}}}",
        );
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 200).unwrap();
        assert!(n.twin_socket);
        let back = Version::decode(&n.reply.encode_payload()).unwrap();
        assert!(back.caps.twin_socket);
        assert_eq!(back.caps.twin_socket_fd_index, Some(0));
    }

    fn caps_of(json: &str) -> Result<Capabilities, ProtocolError> {
        Version::decode(&payload(0, 0, json)).map(|v| v.caps)
    }

    /// JSON values of every type but the one a key wants, by the wanted type.
    fn wrong_values(wanted: &str) -> &'static [&'static str] {
        match wanted {
            "u32" => &[
                "null",
                "true",
                "\"16\"",
                "[]",
                "[16]",
                "{}",
                "1.5",
                "16.0",
                "1e3",
                "-1",
                "4294967296",
            ],
            "u64" => &[
                "null",
                "false",
                "\"4096\"",
                "[4096]",
                "{}",
                "4096.0",
                "-4096",
                "18446744073709551616",
            ],
            "bool" => &["null", "0", "1", "\"true\"", "[true]", "{}"],
            "object" => &["null", "true", "1", "\"x\"", "[]", "[true,0]", "[{}]"],
            _ => unreachable!("no such type {wanted}"),
        }
    }

    #[test]
    fn test_version_decode_known_key_of_wrong_type_rejected_naming_it() {
        // (key path as the message names it, wanted type, JSON with the value at `V`)
        let table: [(&str, &str, &str); 10] = [
            ("version data", "object", "V"),
            ("capabilities", "object", "{\"capabilities\":V}"),
            (
                "max_msg_fds",
                "u32",
                "{\"capabilities\":{\"max_msg_fds\":V}}",
            ),
            (
                "max_data_xfer_size",
                "u32",
                "{\"capabilities\":{\"max_data_xfer_size\":V}}",
            ),
            (
                "max_dma_maps",
                "u32",
                "{\"capabilities\":{\"max_dma_maps\":V}}",
            ),
            ("pgsizes", "u64", "{\"capabilities\":{\"pgsizes\":V}}"),
            (
                "write_multiple",
                "bool",
                "{\"capabilities\":{\"write_multiple\":V}}",
            ),
            (
                "twin_socket",
                "object",
                "{\"capabilities\":{\"twin_socket\":V}}",
            ),
            (
                "twin_socket.supported",
                "bool",
                "{\"capabilities\":{\"max_msg_fds\":4,\"twin_socket\":{\"supported\":V}}}",
            ),
            (
                "twin_socket.fd_index",
                "u32",
                "{\"capabilities\":{\"twin_socket\":{\"supported\":true,\"fd_index\":V}}}",
            ),
        ];
        for (path, wanted, template) in table {
            for bad in wrong_values(wanted) {
                let json = template.replace('V', bad);
                let err = caps_of(&json).unwrap_err();
                assert_eq!(err.errno(), libc::EINVAL, "{json}");
                let ProtocolError::BadCapabilities(msg) = &err else {
                    panic!("{json}: {err:?}");
                };
                assert!(msg.starts_with(&format!("{path}: ")), "{json}: {msg}");
            }
        }
    }

    #[test]
    fn test_version_decode_known_keys_at_their_bounds_accepted() {
        let c = caps_of(
            "{\"capabilities\":{\"max_msg_fds\":0,\"max_data_xfer_size\":4294967295,\
             \"max_dma_maps\":4294967295,\"pgsizes\":18446744073709551615,\
             \"write_multiple\":false,\"twin_socket\":{\"fd_index\":4294967295}}}",
        )
        .unwrap();
        assert_eq!(
            (
                c.max_msg_fds,
                c.max_data_xfer_size,
                c.max_dma_maps,
                c.pgsizes
            ),
            (0, u32::MAX, u32::MAX, u64::MAX)
        );
        assert!(!c.write_multiple && c.present.write_multiple);
        assert!(!c.twin_socket, "supported absent means false");
        assert!(c.present.twin_socket);
        assert_eq!(c.twin_socket_fd_index, Some(u32::MAX));
    }

    #[test]
    fn test_version_decode_unknown_keys_inside_known_objects_ignored() {
        let c = caps_of(
            "{\"capabilities\":{\"twin_socket\":{\"supported\":true,\"x\":[{}]},\
             \"migration\":{\"pgsize\":\"any\",\"y\":null}},\"z\":{\"w\":1}}",
        )
        .unwrap();
        assert!(c.twin_socket && c.present.twin_socket);
        assert_eq!(c.twin_socket_fd_index, None);
        assert!(c.migration);
        assert_eq!(c.migration_max_bitmap_size, None);
    }

    #[test]
    fn test_version_decode_migration_of_any_shape_accepted_not_echoed_by_decode() {
        for (m, bitmap) in [
            ("null", None),
            ("5", None),
            ("[1]", None),
            ("{\"max_bitmap_size\":\"big\"}", None),
            ("{\"max_bitmap_size\":-1}", None),
            ("{\"max_bitmap_size\":7}", Some(7)),
        ] {
            let json = format!("{{\"capabilities\":{{\"migration\":{m},\"max_dma_maps\":9}}}}");
            let v = Version::decode(&payload(0, 0, &json)).unwrap();
            assert!(v.caps.migration, "{json}");
            assert_eq!(v.caps.migration_max_bitmap_size, bitmap, "{json}");
            // Decoding keeps what it read; negotiate decides whether a reply carries it.
            let m = bitmap.map_or(String::new(), |b| format!("\"max_bitmap_size\":{b}"));
            assert_eq!(
                v.caps_json(),
                format!("{{\"capabilities\":{{\"max_dma_maps\":9,\"migration\":{{{m}}}}}}}")
            );
        }
    }

    #[test]
    fn test_version_decode_repeated_key_keeps_last_value() {
        // JSON objects read as a map: the last of a repeated key wins, and an earlier value
        // of the wrong type is never looked at (as before the serde structs).
        let c = caps_of(
            "{\"capabilities\":{\"max_msg_fds\":\"x\",\"max_msg_fds\":3},\
             \"capabilities\":{\"max_msg_fds\":8,\"pgsizes\":[],\"pgsizes\":8192}}",
        )
        .unwrap();
        assert_eq!((c.max_msg_fds, c.pgsizes), (8, 8192));
        assert!(!c.present.max_dma_maps);
        assert!(caps_of("{\"capabilities\":{\"max_msg_fds\":3,\"max_msg_fds\":\"x\"}}").is_err());
    }

    #[test]
    fn test_negotiate_qemu_proposal_gets_the_143_byte_reply_with_every_key() {
        let req = payload(0, 0, QEMU_CAPS);
        assert_eq!(super::super::header::HEADER_SIZE + req.len(), 199);
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 16 + req.len()).unwrap();
        let json = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\
                    \"max_dma_maps\":65535,\"pgsizes\":4096,\"write_multiple\":true}}";
        assert_eq!(n.reply.encode_payload(), payload(0, 0, json));
        assert_eq!(16 + n.reply.encode_payload().len(), 143);
        assert_eq!(
            (n.max_data_xfer_size, n.max_dma_maps, n.write_multiple),
            (1 << 20, 65535, true)
        );
    }

    #[test]
    fn test_negotiate_reply_over_request_size_drops_keys_in_documented_order() {
        let req = payload(0, 0, QEMU_CAPS);
        let v = Version::decode(&req).unwrap();
        // Spec defaults first (lossless), then what only makes the client do less.
        let order = [
            "pgsizes",
            "max_dma_maps",
            "max_data_xfer_size",
            "write_multiple",
            "max_msg_fds",
        ];
        let empty = 16 + payload(0, 0, "{\"capabilities\":{}}").len();
        for size in empty..=16 + req.len() {
            let n = negotiate(&v, &offer(), size).unwrap();
            let reply = n.reply.encode_payload();
            assert!(16 + reply.len() <= size, "request size {size}");
            let json = n.reply.caps_json();
            // The kept keys are the ones not yet dropped: a suffix of `order`.
            let dropped = order.iter().take_while(|k| !json.contains(*k)).count();
            for k in &order[dropped..] {
                assert!(json.contains(k), "size {size}: {k} missing in {json}");
            }
            assert!(!n.reply_longer_than_request, "size {size}");
            assert_eq!(n.write_multiple, dropped <= 3, "size {size}");
            let xfer_kept = dropped < 3;
            assert_eq!(n.max_data_xfer_size, 1 << 20, "size {size}");
            assert_eq!(
                Version::decode(&reply)
                    .unwrap()
                    .caps
                    .present
                    .max_data_xfer_size,
                xfer_kept
            );
        }
        let tight = negotiate(&v, &offer(), 142).unwrap();
        assert!(tight.reply.caps_json().contains("write_multiple"));
        assert!(!tight.reply.caps_json().contains("pgsizes"));
    }

    fn arb_caps() -> impl Strategy<Value = Capabilities> {
        (
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>()),
            (
                any::<bool>(),
                any::<Option<u32>>(),
                any::<bool>(),
                any::<bool>(),
            ),
            any::<[bool; 7]>(),
        )
            .prop_map(|((fds, xfer, maps, pg), (twin, fd_index, wm, mig), p)| {
                Capabilities {
                    max_msg_fds: fds,
                    max_data_xfer_size: xfer,
                    max_dma_maps: maps,
                    pgsizes: pg,
                    twin_socket: twin,
                    twin_socket_fd_index: fd_index,
                    write_multiple: wm,
                    migration: mig && p[6],
                    migration_pgsize: mig.then_some(4096),
                    migration_max_bitmap_size: mig.then_some(1 << 28),
                    present: Present {
                        max_msg_fds: p[0],
                        max_data_xfer_size: p[1],
                        max_dma_maps: p[2],
                        pgsizes: p[3],
                        twin_socket: p[4],
                        write_multiple: p[5],
                        migration: mig && p[6],
                    },
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn prop_version_reply_round_trip_keeps_present_keys(
            caps in arb_caps(),
            major in any::<u16>(),
            minor in any::<u16>(),
        ) {
            let v = Version { major, minor, caps: caps.clone() };
            let bytes = v.encode_payload();
            let back = Version::decode(&bytes).unwrap();
            prop_assert_eq!((back.major, back.minor), (major, minor));
            let d = Capabilities::default();
            let p = caps.present;
            let c = &back.caps;
            prop_assert_eq!(c.present, p);
            prop_assert_eq!(c.max_msg_fds, if p.max_msg_fds { caps.max_msg_fds } else { d.max_msg_fds });
            prop_assert_eq!(
                c.max_data_xfer_size,
                if p.max_data_xfer_size { caps.max_data_xfer_size } else { d.max_data_xfer_size }
            );
            prop_assert_eq!(c.max_dma_maps, if p.max_dma_maps { caps.max_dma_maps } else { d.max_dma_maps });
            prop_assert_eq!(c.pgsizes, if p.pgsizes { caps.pgsizes } else { d.pgsizes });
            prop_assert_eq!(c.write_multiple, p.write_multiple && caps.write_multiple);
            let twin = p.twin_socket && caps.twin_socket && caps.twin_socket_fd_index.is_some();
            prop_assert_eq!(c.twin_socket, twin);
            prop_assert_eq!(c.twin_socket_fd_index, if twin { caps.twin_socket_fd_index } else { None });
            prop_assert_eq!(c.migration, p.migration);
            if p.migration {
                prop_assert_eq!(c.migration_pgsize, caps.migration_pgsize);
                prop_assert_eq!(c.migration_max_bitmap_size, caps.migration_max_bitmap_size);
            }
            // Encoding what was decoded gives the same bytes.
            prop_assert_eq!(back.encode_payload(), bytes);
        }
    }

    #[test]
    fn test_negotiate_migration_echoed_only_when_offered_and_the_device_migrates() {
        let req = payload(0, 0, QEMU_CAPS);
        let v = Version::decode(&req).unwrap();
        let migrating = ServerOffer {
            migration: true,
            ..offer()
        };
        let n = negotiate(&v, &migrating, 16 + req.len()).unwrap();
        let back = Version::decode(&n.reply.encode_payload()).unwrap();
        assert!(back.caps.migration, "{}", n.reply.caps_json());
        assert_eq!(back.caps.migration_pgsize, Some(4096));
        assert_eq!(back.caps.migration_max_bitmap_size, Some(1 << 20));
        assert!(16 + n.reply.encode_payload().len() <= 16 + req.len());
        assert!(
            n.reply.caps_json().contains("write_multiple"),
            "all keys fit"
        );
        // Not offered by the client: not in the reply.
        let plain = payload(0, 0, "{\"capabilities\":{\"max_msg_fds\":4}}");
        let v = Version::decode(&plain).unwrap();
        let n = negotiate(&v, &migrating, 400).unwrap();
        assert!(!n.reply.caps_json().contains("migration"));
        // Offered, device does not migrate: not in the reply.
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 16 + req.len()).unwrap();
        assert!(!n.reply.caps_json().contains("migration"));
        // A reply that must shrink keeps `migration`: the spec defaults go first.
        let n = negotiate(&v, &migrating, 16 + req.len() - 60).unwrap();
        assert!(n.reply.caps_json().contains("migration"));
        assert!(16 + n.reply.encode_payload().len() <= 16 + req.len() - 60);
    }

    #[test]
    fn test_negotiate_short_request_offering_migration_keeps_migration_in_reply() {
        // A client that offers migration in a request shorter than the reply would be.
        let req = payload(0, 0, "{\"capabilities\":{\"migration\":{}}}");
        let v = Version::decode(&req).unwrap();
        let migrating = ServerOffer {
            migration: true,
            ..offer()
        };
        let n = negotiate(&v, &migrating, 16 + req.len()).unwrap();
        let back = Version::decode(&n.reply.encode_payload()).unwrap();
        assert!(back.caps.migration, "{}", n.reply.caps_json());
        assert_eq!(back.caps.migration_pgsize, Some(4096));
        assert!(n.reply_longer_than_request, "reported to the caller");
    }

    #[test]
    fn test_negotiate_non_default_limits_never_dropped() {
        // max_dma_maps and max_data_xfer_size below the defaults: the client would exceed
        // them if they were dropped, so the reply keeps them even when it is too long.
        let json = "{\"capabilities\":{\"max_data_xfer_size\":1024,\"max_dma_maps\":8,\"write_multiple\":true}}";
        let req = payload(0, 0, json);
        let v = Version::decode(&req).unwrap();
        let n = negotiate(&v, &offer(), 30).unwrap();
        let back = Version::decode(&n.reply.encode_payload()).unwrap();
        assert_eq!(back.caps.max_data_xfer_size, 1024);
        assert_eq!(back.caps.max_dma_maps, 8);
        assert!(
            !back.caps.present.write_multiple,
            "dropped: the client only does less"
        );
        assert!(!n.write_multiple);
        assert_eq!(n.max_data_xfer_size, 1024);
        assert!(n.reply_longer_than_request);
    }

    #[test]
    fn test_negotiate_pgsize_mismatch_rejected() {
        let v = Version::decode(&payload(0, 0, "{\"capabilities\":{\"pgsizes\":8192}}")).unwrap();
        assert!(negotiate(&v, &offer(), 200).is_err());
    }
}
