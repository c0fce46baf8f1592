//! VFIO_USER_VERSION: version numbers and the JSON capabilities.

use serde_json::{Map, Value};

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
    /// A `migration` object was present (umdev does not support migration and never
    /// echoes it).
    pub migration: bool,
    /// `migration.max_bitmap_size`, which only QEMU sends (used to recognize QEMU's
    /// DMA_READ/DMA_WRITE layout, see [`super::dma_rw::DmaRwLayout`]).
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

fn cap_u32(obj: &Map<String, Value>, key: &'static str) -> Result<Option<u32>, ProtocolError> {
    match obj.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ProtocolError::BadCapabilities(format!("{key} must be a u32"))),
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
        let mut caps = Capabilities::default();
        if json.is_empty() {
            return Ok(caps);
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
            return Ok(caps);
        }
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ProtocolError::BadCapabilities(format!("invalid JSON: {e}")))?;
        let top = v.as_object().ok_or_else(|| {
            ProtocolError::BadCapabilities("version data is not an object".into())
        })?;
        let Some(c) = top.get("capabilities") else {
            return Ok(caps);
        };
        let c = c.as_object().ok_or_else(|| {
            ProtocolError::BadCapabilities("capabilities is not an object".into())
        })?;
        if let Some(n) = cap_u32(c, "max_msg_fds")? {
            caps.max_msg_fds = n;
            caps.present.max_msg_fds = true;
        }
        if let Some(n) = cap_u32(c, "max_data_xfer_size")? {
            caps.max_data_xfer_size = n;
            caps.present.max_data_xfer_size = true;
        }
        if let Some(n) = cap_u32(c, "max_dma_maps")? {
            caps.max_dma_maps = n;
            caps.present.max_dma_maps = true;
        }
        if let Some(v) = c.get("pgsizes") {
            caps.pgsizes = v
                .as_u64()
                .ok_or_else(|| ProtocolError::BadCapabilities("pgsizes must be a number".into()))?;
            caps.present.pgsizes = true;
        }
        if let Some(v) = c.get("write_multiple") {
            caps.write_multiple = v.as_bool().ok_or_else(|| {
                ProtocolError::BadCapabilities("write_multiple must be a boolean".into())
            })?;
            caps.present.write_multiple = true;
        }
        if let Some(v) = c.get("twin_socket") {
            let t = v.as_object().ok_or_else(|| {
                ProtocolError::BadCapabilities("twin_socket must be an object".into())
            })?;
            caps.present.twin_socket = true;
            caps.twin_socket = match t.get("supported") {
                None => false,
                Some(b) => b.as_bool().ok_or_else(|| {
                    ProtocolError::BadCapabilities("twin_socket.supported must be a boolean".into())
                })?,
            };
            caps.twin_socket_fd_index = cap_u32(t, "fd_index")?;
        }
        if let Some(m) = c.get("migration") {
            caps.migration = true;
            caps.migration_max_bitmap_size = m.get("max_bitmap_size").and_then(Value::as_u64);
        }
        Ok(caps)
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

    /// The JSON text (no NUL) of [`Version::encode_payload`].
    pub fn caps_json(&self) -> String {
        let c = &self.caps;
        let p = &c.present;
        let mut parts: Vec<String> = Vec::new();
        if p.max_msg_fds {
            parts.push(format!("\"max_msg_fds\":{}", c.max_msg_fds));
        }
        if p.max_data_xfer_size {
            parts.push(format!("\"max_data_xfer_size\":{}", c.max_data_xfer_size));
        }
        if p.max_dma_maps {
            parts.push(format!("\"max_dma_maps\":{}", c.max_dma_maps));
        }
        if p.pgsizes {
            parts.push(format!("\"pgsizes\":{}", c.pgsizes));
        }
        if p.write_multiple {
            parts.push(format!("\"write_multiple\":{}", c.write_multiple));
        }
        if p.twin_socket {
            match c.twin_socket_fd_index {
                Some(i) if c.twin_socket => parts.push(format!(
                    "\"twin_socket\":{{\"supported\":true,\"fd_index\":{i}}}"
                )),
                _ => parts.push("\"twin_socket\":{\"supported\":false}".to_string()),
            }
        }
        format!("{{\"capabilities\":{{{}}}}}", parts.join(","))
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
}

/// The outcome of negotiation: the reply to send and the limits that now apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The reply (version + capabilities).
    pub reply: Version,
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
/// dropping optional keys.
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
    let write_multiple = cc.write_multiple;
    let mut caps = Capabilities {
        max_msg_fds: offer.max_msg_fds,
        max_data_xfer_size: xfer,
        max_dma_maps: maps,
        pgsizes: offer.pgsize,
        twin_socket: twin,
        twin_socket_fd_index: twin.then_some(0),
        write_multiple,
        migration: false,
        migration_max_bitmap_size: None,
        present: Present {
            max_msg_fds: cc.present.max_msg_fds,
            max_data_xfer_size: cc.present.max_data_xfer_size,
            max_dma_maps: cc.present.max_dma_maps,
            pgsizes: cc.present.pgsizes,
            twin_socket: cc.present.twin_socket,
            write_multiple: cc.present.write_multiple && write_multiple,
        },
    };
    let mut reply = Version {
        major: MAJOR,
        // MINOR is 0, so it is never above the client's minor.
        minor: MINOR,
        caps: caps.clone(),
    };
    // Shorten the reply until it fits the client's buffer; twin_socket goes last since
    // dropping it changes the outcome (it is then disabled).
    let droppers: [fn(&mut Present); 5] = [
        |p| p.write_multiple = false,
        |p| p.pgsizes = false,
        |p| p.max_dma_maps = false,
        |p| p.max_msg_fds = false,
        |p| p.max_data_xfer_size = false,
    ];
    let mut i = 0;
    while super::header::HEADER_SIZE + reply.encode_payload().len() > request_size
        && i < droppers.len()
    {
        droppers[i](&mut caps.present);
        reply.caps = caps.clone();
        i += 1;
    }
    // Values whose key was dropped fall back to the spec default on the client side.
    let max_data_xfer_size = if reply.caps.present.max_data_xfer_size {
        xfer
    } else {
        xfer.min(DEFAULT_MAX_DATA_XFER_SIZE)
    };
    let write_multiple = reply.caps.present.write_multiple && write_multiple;
    Ok(Negotiated {
        reply,
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
        assert!(!back.caps.migration, "migration must not be echoed");
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

    #[test]
    fn test_negotiate_pgsize_mismatch_rejected() {
        let v = Version::decode(&payload(0, 0, "{\"capabilities\":{\"pgsizes\":8192}}")).unwrap();
        assert!(negotiate(&v, &offer(), 200).is_err());
    }
}
