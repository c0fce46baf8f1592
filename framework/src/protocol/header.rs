//! The 16-byte message header and the command numbers.

use super::wire::{Put, Reader};
use super::ProtocolError;

/// Size of the header that starts every message.
pub const HEADER_SIZE: usize = 16;

/// Mask of the message-type bits in the header flags.
pub const FLAGS_TYPE_MASK: u32 = 0xf;
/// Type value of a command message.
pub const FLAGS_TYPE_COMMAND: u32 = 0x0;
/// Type value of a reply message.
pub const FLAGS_TYPE_REPLY: u32 = 0x1;
/// The sender wants no reply.
pub const FLAGS_NO_REPLY: u32 = 1 << 4;
/// The reply reports an error; the error field holds an errno.
pub const FLAGS_ERROR: u32 = 1 << 5;
const FLAGS_KNOWN: u32 = FLAGS_TYPE_MASK | FLAGS_NO_REPLY | FLAGS_ERROR;

/// Every command number of the spec (plus the legacy DIRTY_PAGES, answered with ENOTSUP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    /// VFIO_USER_VERSION.
    Version = 1,
    /// VFIO_USER_DMA_MAP.
    DmaMap = 2,
    /// VFIO_USER_DMA_UNMAP.
    DmaUnmap = 3,
    /// VFIO_USER_DEVICE_GET_INFO.
    DeviceGetInfo = 4,
    /// VFIO_USER_DEVICE_GET_REGION_INFO.
    DeviceGetRegionInfo = 5,
    /// VFIO_USER_DEVICE_GET_REGION_IO_FDS.
    DeviceGetRegionIoFds = 6,
    /// VFIO_USER_DEVICE_GET_IRQ_INFO.
    DeviceGetIrqInfo = 7,
    /// VFIO_USER_DEVICE_SET_IRQS.
    DeviceSetIrqs = 8,
    /// VFIO_USER_REGION_READ.
    RegionRead = 9,
    /// VFIO_USER_REGION_WRITE.
    RegionWrite = 10,
    /// VFIO_USER_DMA_READ (server → client).
    DmaRead = 11,
    /// VFIO_USER_DMA_WRITE (server → client).
    DmaWrite = 12,
    /// VFIO_USER_DEVICE_RESET.
    DeviceReset = 13,
    /// VFIO_USER_DIRTY_PAGES (legacy, removed from the spec).
    DirtyPages = 14,
    /// VFIO_USER_REGION_WRITE_MULTI.
    RegionWriteMulti = 15,
    /// VFIO_USER_DEVICE_FEATURE.
    DeviceFeature = 16,
    /// VFIO_USER_MIG_DATA_READ.
    MigDataRead = 17,
    /// VFIO_USER_MIG_DATA_WRITE.
    MigDataWrite = 18,
}

impl Command {
    /// The command with this number, or `UnknownCommand`.
    pub fn from_u16(v: u16) -> Result<Command, ProtocolError> {
        use Command::*;
        Ok(match v {
            1 => Version,
            2 => DmaMap,
            3 => DmaUnmap,
            4 => DeviceGetInfo,
            5 => DeviceGetRegionInfo,
            6 => DeviceGetRegionIoFds,
            7 => DeviceGetIrqInfo,
            8 => DeviceSetIrqs,
            9 => RegionRead,
            10 => RegionWrite,
            11 => DmaRead,
            12 => DmaWrite,
            13 => DeviceReset,
            14 => DirtyPages,
            15 => RegionWriteMulti,
            16 => DeviceFeature,
            17 => MigDataRead,
            18 => MigDataWrite,
            other => return Err(ProtocolError::UnknownCommand(other)),
        })
    }

    /// The spec's name, for logs.
    pub fn name(self) -> &'static str {
        use Command::*;
        match self {
            Version => "VERSION",
            DmaMap => "DMA_MAP",
            DmaUnmap => "DMA_UNMAP",
            DeviceGetInfo => "DEVICE_GET_INFO",
            DeviceGetRegionInfo => "DEVICE_GET_REGION_INFO",
            DeviceGetRegionIoFds => "DEVICE_GET_REGION_IO_FDS",
            DeviceGetIrqInfo => "DEVICE_GET_IRQ_INFO",
            DeviceSetIrqs => "DEVICE_SET_IRQS",
            RegionRead => "REGION_READ",
            RegionWrite => "REGION_WRITE",
            DmaRead => "DMA_READ",
            DmaWrite => "DMA_WRITE",
            DeviceReset => "DEVICE_RESET",
            DirtyPages => "DIRTY_PAGES",
            RegionWriteMulti => "REGION_WRITE_MULTI",
            DeviceFeature => "DEVICE_FEATURE",
            MigDataRead => "MIG_DATA_READ",
            MigDataWrite => "MIG_DATA_WRITE",
        }
    }
}

/// Whether a message is a command or a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageType {
    /// A command (request).
    Command,
    /// A reply to an earlier command with the same message id.
    Reply,
}

/// The header of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// Message id, echoed in the reply.
    pub msg_id: u16,
    /// Command number (raw; see [`Command::from_u16`]).
    pub command: u16,
    /// Size of the whole message including this header.
    pub msg_size: u32,
    /// Type, No_reply and Error bits.
    pub flags: u32,
    /// errno of an error reply.
    pub error: u32,
}

impl Header {
    /// Decode from the first 16 bytes of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Header, ProtocolError> {
        let mut r = Reader::new(buf, "header");
        Ok(Header {
            msg_id: r.u16()?,
            command: r.u16()?,
            msg_size: r.u32()?,
            flags: r.u32()?,
            error: r.u32()?,
        })
    }

    /// Encode into 16 bytes, as [`Header::put`] does (no allocation: every reply pays for
    /// this).
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut out = [0u8; HEADER_SIZE];
        out[0..2].copy_from_slice(&self.msg_id.to_ne_bytes());
        out[2..4].copy_from_slice(&self.command.to_ne_bytes());
        out[4..8].copy_from_slice(&self.msg_size.to_ne_bytes());
        out[8..12].copy_from_slice(&self.flags.to_ne_bytes());
        out[12..16].copy_from_slice(&self.error.to_ne_bytes());
        out
    }

    /// Append the encoded header to `out`.
    pub fn put(&self, out: &mut Vec<u8>) {
        out.put_u16(self.msg_id);
        out.put_u16(self.command);
        out.put_u32(self.msg_size);
        out.put_u32(self.flags);
        out.put_u32(self.error);
    }

    /// Check size and flags; return the message type and the payload length.
    /// `max_size` bounds the whole message (header included).
    pub fn validate(&self, max_size: u32) -> Result<(MessageType, usize), ProtocolError> {
        if (self.msg_size as usize) < HEADER_SIZE {
            return Err(ProtocolError::MessageTooSmall {
                size: self.msg_size,
            });
        }
        if self.msg_size > max_size {
            return Err(ProtocolError::MessageTooLarge {
                size: self.msg_size,
                max: max_size,
            });
        }
        if self.flags & !FLAGS_KNOWN != 0 {
            return Err(ProtocolError::BadHeaderFlags { flags: self.flags });
        }
        let ty = match self.flags & FLAGS_TYPE_MASK {
            FLAGS_TYPE_COMMAND => MessageType::Command,
            FLAGS_TYPE_REPLY => MessageType::Reply,
            _ => return Err(ProtocolError::BadHeaderFlags { flags: self.flags }),
        };
        Ok((ty, self.msg_size as usize - HEADER_SIZE))
    }

    /// True if the No_reply bit is set.
    pub fn no_reply(&self) -> bool {
        self.flags & FLAGS_NO_REPLY != 0
    }

    /// True if the Error bit is set.
    pub fn is_error(&self) -> bool {
        self.flags & FLAGS_ERROR != 0
    }

    /// A command header.
    pub fn command(msg_id: u16, command: Command, payload_len: usize) -> Header {
        Header {
            msg_id,
            command: command as u16,
            msg_size: (HEADER_SIZE + payload_len) as u32,
            flags: FLAGS_TYPE_COMMAND,
            error: 0,
        }
    }

    /// The header of a successful reply to `self` with `payload_len` bytes of payload.
    pub fn reply(&self, payload_len: usize) -> Header {
        Header {
            msg_id: self.msg_id,
            command: self.command,
            msg_size: (HEADER_SIZE + payload_len) as u32,
            flags: FLAGS_TYPE_REPLY,
            error: 0,
        }
    }

    /// The header of an error reply to `self`. A zero errno is replaced by EINVAL: the
    /// client would read errno 0 as success.
    pub fn error_reply(&self, errno: i32) -> Header {
        let errno = if errno <= 0 { libc::EINVAL } else { errno };
        Header {
            msg_id: self.msg_id,
            command: self.command,
            msg_size: HEADER_SIZE as u32,
            flags: FLAGS_TYPE_REPLY | FLAGS_ERROR,
            error: errno as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_header_encode_matches_put() {
        let h = Header {
            msg_id: 0x1234,
            command: 0x0a0b,
            msg_size: 0x01020304,
            flags: 0x0f0e0d0c,
            error: 0x11223344,
        };
        let mut v = Vec::new();
        h.put(&mut v);
        assert_eq!(h.encode().as_slice(), v.as_slice());
    }

    #[test]
    fn test_header_roundtrip_fields_preserved() {
        let h = Header {
            msg_id: 0x1234,
            command: 9,
            msg_size: 32,
            flags: FLAGS_NO_REPLY,
            error: 0,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn test_header_validate_small_size_rejected() {
        let h = Header {
            msg_size: 15,
            ..Default::default()
        };
        assert!(matches!(
            h.validate(1024),
            Err(ProtocolError::MessageTooSmall { size: 15 })
        ));
    }

    #[test]
    fn test_header_validate_unknown_type_rejected() {
        let h = Header {
            msg_size: 16,
            flags: 2,
            ..Default::default()
        };
        assert!(h.validate(1024).is_err());
        let h = Header {
            msg_size: 16,
            flags: 1 << 9,
            ..Default::default()
        };
        assert!(h.validate(1024).is_err());
    }

    #[test]
    fn test_header_validate_oversized_is_e2big() {
        let h = Header {
            msg_size: 2048,
            ..Default::default()
        };
        assert_eq!(h.validate(1024).unwrap_err().errno(), libc::E2BIG);
    }

    #[test]
    fn test_error_reply_zero_errno_becomes_einval() {
        let h = Header::command(3, Command::RegionRead, 16);
        let r = h.error_reply(0);
        assert_eq!(r.error, libc::EINVAL as u32);
        assert!(r.is_error());
        assert_eq!(r.msg_id, 3);
    }

    #[test]
    fn test_command_unknown_number_is_error() {
        assert_eq!(
            Command::from_u16(0).unwrap_err(),
            ProtocolError::UnknownCommand(0)
        );
        assert_eq!(
            Command::from_u16(19).unwrap_err(),
            ProtocolError::UnknownCommand(19)
        );
        for v in 1..=18u16 {
            assert_eq!(Command::from_u16(v).unwrap() as u16, v);
        }
    }
}
