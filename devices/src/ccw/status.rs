//! Completion reporting of the ccw device: device/channel status bits, sense bits, the
//! [`Fault`] codes and the status block the device stores when a program ends.
//!
//! Documented for driver authors in `protocol-docs/devices/ccw.md` ("Status block",
//! "Faults").

use super::format::{le_u32, le_u64};

/// Size of the status block in bytes.
pub const STATUS_BLOCK_SIZE: usize = 32;

/// Device status bits (status block byte 0).
pub mod dstat {
    /// Channel end: the channel part of the operation is done.
    pub const CHANNEL_END: u8 = 0x08;
    /// Device end: the device part of the operation is done.
    pub const DEVICE_END: u8 = 0x04;
    /// Unit check: the device detected an error; details in the sense data.
    pub const UNIT_CHECK: u8 = 0x02;
}

/// Channel status bits (status block byte 1).
pub mod cstat {
    /// Incorrect length: a SENSE count other than 32 without SLI.
    pub const INCORRECT_LENGTH: u8 = 0x40;
    /// Program check: the channel program or operation block is invalid.
    pub const PROGRAM_CHECK: u8 = 0x20;
    /// Protection check: a data page does not allow the access the command needs.
    pub const PROTECTION_CHECK: u8 = 0x10;
    /// Channel-control check: the device could not carry out a valid program (pin limit,
    /// aborted by a DMA unmap, Bus Master Enable clear).
    pub const CHANNEL_CONTROL_CHECK: u8 = 0x04;
}

/// Sense byte 0 bits.
pub mod sense {
    /// The command was rejected (e.g. block out of range).
    pub const COMMAND_REJECT: u8 = 0x80;
    /// The backing image failed (read/write/flush error).
    pub const EQUIPMENT_CHECK: u8 = 0x10;
}

/// Why a program ended the way it did; carried in the status block and the LAST_STATUS
/// register so a driver (and a test) can tell the cases apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Fault {
    /// No fault: the program completed.
    None = 0,
    /// The operation block could not be read.
    OpBlockUnreadable = 1,
    /// The operation block address is not 8-byte aligned.
    OpBlockUnaligned = 2,
    /// Reserved operation-block bits or fields are set.
    OpBlockReserved = 3,
    /// The status block address is not readable, so no status could be stored.
    StatusBlockInvalid = 4,
    /// A CCW address (program start or TIC target) is not 8-byte aligned.
    CcwUnaligned = 5,
    /// A CCW could not be read (unmapped address or overflow).
    CcwUnreadable = 6,
    /// Unknown command code.
    InvalidCommand = 7,
    /// Reserved flag bits or the reserved CCW field are set, or a flag is invalid for the
    /// command (e.g. chain-data on SENSE or NOP).
    InvalidFlags = 8,
    /// A data-transferring CCW with count 0.
    ZeroCount = 9,
    /// A TIC whose target is another TIC.
    TicToTic = 10,
    /// The first CCW of the program is a TIC.
    TicFirst = 11,
    /// The program revisits a CCW (an endless loop).
    Loop = 12,
    /// The program is longer than the device's CCW limit.
    ProgramTooLong = 13,
    /// The IDAW list address is not 8-byte aligned.
    IdawListUnaligned = 14,
    /// The IDAW list could not be read.
    IdawListUnreadable = 15,
    /// An IDAW other than the first is not 4 KiB aligned.
    IdawUnaligned = 16,
    /// The CCW count needs more bytes than its IDAW list covers.
    CountPastIdawList = 17,
    /// The IDAW count is 0 or above the per-CCW maximum.
    IdawCountInvalid = 18,
    /// A data address is not mapped (or `address + count` overflows).
    DataAddressInvalid = 19,
    /// A data page lacks the permission the command needs (read-only page for READ).
    DataProtection = 20,
    /// Pinning the program's pages failed for lack of resources (locked-memory limit).
    PinFailed = 21,
    /// The transfer would go past the end of the image.
    OutOfRange = 22,
    /// The backing image returned an I/O error.
    ImageIo = 23,
    /// SENSE with a count other than 32 and no SLI flag.
    IncorrectLength = 24,
    /// The program was aborted because the client unmapped memory it was using.
    Aborted = 25,
    /// START was written before the device was attached to a DMA space.
    NotAttached = 26,
    /// The guest has cleared Bus Master Enable in the PCI command register, so the device
    /// may not access guest memory: the program stopped at its first DMA (usually reading
    /// the operation block, so nothing ran and no status block could be stored).
    BusMasterOff = 27,
}

impl Fault {
    /// All faults, in code order.
    pub const ALL: [Fault; 28] = [
        Fault::None,
        Fault::OpBlockUnreadable,
        Fault::OpBlockUnaligned,
        Fault::OpBlockReserved,
        Fault::StatusBlockInvalid,
        Fault::CcwUnaligned,
        Fault::CcwUnreadable,
        Fault::InvalidCommand,
        Fault::InvalidFlags,
        Fault::ZeroCount,
        Fault::TicToTic,
        Fault::TicFirst,
        Fault::Loop,
        Fault::ProgramTooLong,
        Fault::IdawListUnaligned,
        Fault::IdawListUnreadable,
        Fault::IdawUnaligned,
        Fault::CountPastIdawList,
        Fault::IdawCountInvalid,
        Fault::DataAddressInvalid,
        Fault::DataProtection,
        Fault::PinFailed,
        Fault::OutOfRange,
        Fault::ImageIo,
        Fault::IncorrectLength,
        Fault::Aborted,
        Fault::NotAttached,
        Fault::BusMasterOff,
    ];

    /// The numeric code stored in the status block.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// Decode a code; `None` for an unknown one.
    pub fn from_code(code: u16) -> Option<Fault> {
        Fault::ALL.get(usize::from(code)).copied()
    }

    /// The (device status, channel status) pair a program ending with this fault reports.
    pub fn status(self) -> (u8, u8) {
        let ends = dstat::CHANNEL_END | dstat::DEVICE_END;
        match self {
            Fault::None => (ends, 0),
            Fault::OpBlockUnreadable
            | Fault::OpBlockUnaligned
            | Fault::OpBlockReserved
            | Fault::StatusBlockInvalid
            | Fault::CcwUnaligned
            | Fault::CcwUnreadable
            | Fault::InvalidCommand
            | Fault::InvalidFlags
            | Fault::ZeroCount
            | Fault::TicToTic
            | Fault::TicFirst
            | Fault::Loop
            | Fault::ProgramTooLong
            | Fault::IdawListUnaligned
            | Fault::IdawListUnreadable
            | Fault::IdawUnaligned
            | Fault::CountPastIdawList
            | Fault::IdawCountInvalid
            | Fault::DataAddressInvalid => (ends, cstat::PROGRAM_CHECK),
            Fault::DataProtection => (ends, cstat::PROTECTION_CHECK),
            Fault::PinFailed | Fault::Aborted | Fault::NotAttached | Fault::BusMasterOff => {
                (ends, cstat::CHANNEL_CONTROL_CHECK)
            }
            Fault::OutOfRange | Fault::ImageIo => (ends | dstat::UNIT_CHECK, 0),
            Fault::IncorrectLength => (ends, cstat::INCORRECT_LENGTH),
        }
    }
}

/// The status block the device stores when a program ends (32 bytes).
///
/// | bytes | field |
/// |---|---|
/// | 0 | device status ([`dstat`]) |
/// | 1 | channel status ([`cstat`]) |
/// | 2..4 | residual count of the last CCW executed (or the failing one) |
/// | 4..6 | fault code ([`Fault`]) |
/// | 6..8 | reserved |
/// | 8..16 | address of the last CCW executed / the failing CCW (0 if none) |
/// | 16..24 | total bytes transferred between the image and guest memory |
/// | 24..28 | sequence number (value of the COMPLETED register after this program) |
/// | 28..32 | reserved |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusBlock {
    /// Device status bits.
    pub device_status: u8,
    /// Channel status bits.
    pub channel_status: u8,
    /// Residual count.
    pub residual: u16,
    /// Fault code (see [`Fault::code`]).
    pub fault: u16,
    /// Last / failing CCW address.
    pub ccw_addr: u64,
    /// Bytes transferred.
    pub transferred: u64,
    /// Sequence number.
    pub sequence: u32,
}

impl StatusBlock {
    /// Encode to the wire form.
    pub fn to_bytes(&self) -> [u8; STATUS_BLOCK_SIZE] {
        let mut b = [0u8; STATUS_BLOCK_SIZE];
        b[0] = self.device_status;
        b[1] = self.channel_status;
        b[2..4].copy_from_slice(&self.residual.to_le_bytes());
        b[4..6].copy_from_slice(&self.fault.to_le_bytes());
        b[8..16].copy_from_slice(&self.ccw_addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.transferred.to_le_bytes());
        b[24..28].copy_from_slice(&self.sequence.to_le_bytes());
        b
    }

    /// Decode from the wire form.
    pub fn from_bytes(b: &[u8; STATUS_BLOCK_SIZE]) -> StatusBlock {
        StatusBlock {
            device_status: b[0],
            channel_status: b[1],
            residual: u16::from_le_bytes([b[2], b[3]]),
            fault: u16::from_le_bytes([b[4], b[5]]),
            ccw_addr: le_u64(b, 8),
            transferred: le_u64(b, 16),
            sequence: le_u32(b, 24),
        }
    }

    /// The decoded fault, if the code is known.
    pub fn fault(&self) -> Option<Fault> {
        Fault::from_code(self.fault)
    }

    /// True if the program completed without any error indication.
    pub fn is_ok(&self) -> bool {
        self.device_status == dstat::CHANNEL_END | dstat::DEVICE_END
            && self.channel_status == 0
            && self.fault == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_status_block_roundtrip_and_is_ok() {
        let s = StatusBlock {
            device_status: dstat::CHANNEL_END | dstat::DEVICE_END,
            channel_status: 0,
            residual: 0,
            fault: 0,
            ccw_addr: 0x3000,
            transferred: 4096,
            sequence: 9,
        };
        assert_eq!(StatusBlock::from_bytes(&s.to_bytes()), s);
        assert!(s.is_ok());
        let bad = StatusBlock {
            channel_status: cstat::PROGRAM_CHECK,
            ..s
        };
        assert!(!bad.is_ok());
    }

    #[test]
    fn test_fault_codes_roundtrip_for_all_faults() {
        for (i, f) in Fault::ALL.iter().enumerate() {
            assert_eq!(usize::from(f.code()), i);
            assert_eq!(Fault::from_code(f.code()), Some(*f));
        }
        assert_eq!(Fault::from_code(Fault::ALL.len() as u16), None);
    }

    #[test]
    fn test_fault_status_program_check_for_tic_to_tic() {
        assert_eq!(Fault::TicToTic.status().1, cstat::PROGRAM_CHECK);
        assert_eq!(Fault::DataProtection.status().1, cstat::PROTECTION_CHECK);
        assert_ne!(Fault::OutOfRange.status().0 & dstat::UNIT_CHECK, 0);
        assert_eq!(Fault::None.status(), (0x0c, 0));
        assert_eq!(
            Fault::BusMasterOff.status(),
            (0x0c, cstat::CHANNEL_CONTROL_CHECK)
        );
    }
}
