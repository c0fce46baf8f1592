//! Guest-visible memory formats of the ccw device: the channel command word (CCW), the
//! operation block, the status block, and the status/fault codes they carry.
//!
//! Everything is little-endian. The layouts are documented for driver authors in
//! `protocol-docs/devices/ccw.md`; the device (parser) and the guest-driver helpers
//! ([`super::driver`]) share these encoders so the two can never disagree.

/// Size of one encoded CCW in bytes.
pub const CCW_SIZE: u64 = 16;
/// Required alignment of CCW addresses (the program address and TIC targets).
pub const CCW_ALIGN: u64 = 8;
/// Size of one IDAW (an 8-byte page address).
pub const IDAW_SIZE: u64 = 8;
/// Required alignment of an IDAW list's address.
pub const IDAW_LIST_ALIGN: u64 = 8;
/// The page size IDAWs address (4 KiB).
pub const IDAW_PAGE_SIZE: u64 = 4096;
/// Size of the operation block in bytes.
pub const OPB_SIZE: usize = 32;
/// Required alignment of the operation block address.
pub const OPB_ALIGN: u64 = 8;
/// Size of the status block in bytes.
pub const STATUS_BLOCK_SIZE: usize = 32;
/// Size of the device's sense data (what SENSE transfers).
pub const SENSE_SIZE: usize = 32;
/// The block size of `OperationBlock::block` and of the capacity register.
pub const BLOCK_SIZE: u64 = 512;

/// CCW command codes.
pub mod cmd {
    /// WRITE: guest memory → image at the current position.
    pub const WRITE: u8 = 0x01;
    /// READ: image at the current position → guest memory.
    pub const READ: u8 = 0x02;
    /// NOP: control no-operation; transfers nothing.
    pub const NOP: u8 = 0x03;
    /// SENSE: the device's 32 sense bytes → guest memory.
    pub const SENSE: u8 = 0x04;
    /// TIC: transfer in channel (jump to the CCW at the data address).
    pub const TIC: u8 = 0x08;
}

/// CCW flag bits (the s390 bit positions).
pub mod flags {
    /// Chain data: the next CCW continues this command's data transfer.
    pub const CD: u8 = 0x80;
    /// Chain command: the next CCW is a new command.
    pub const CC: u8 = 0x40;
    /// Suppress length indication (SENSE with a count other than 32).
    pub const SLI: u8 = 0x20;
    /// Skip: READ/SENSE transfer nothing to memory (READ still advances the position).
    pub const SKIP: u8 = 0x10;
    /// Indirect data addressing: the data address points to an IDAW list.
    pub const IDA: u8 = 0x04;
    /// Bits that must be zero (s390's PCI, suspend and MIDA flags are not supported).
    pub const RESERVED: u8 = 0x08 | 0x02 | 0x01;
}

/// Operation-block flag bits.
pub mod opb_flags {
    /// Flush the image to stable storage (fdatasync) after the program's data transfer.
    pub const FLUSH: u32 = 1 << 0;
    /// Bits that must be zero.
    pub const RESERVED: u32 = !FLUSH;
}

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
    /// aborted by a DMA unmap).
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
}

impl Fault {
    /// All faults, in code order.
    pub const ALL: [Fault; 27] = [
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
            Fault::PinFailed | Fault::Aborted | Fault::NotAttached => {
                (ends, cstat::CHANNEL_CONTROL_CHECK)
            }
            Fault::OutOfRange | Fault::ImageIo => (ends | dstat::UNIT_CHECK, 0),
            Fault::IncorrectLength => (ends, cstat::INCORRECT_LENGTH),
        }
    }
}

/// One channel command word, decoded (16 bytes on the wire).
///
/// | bytes | field |
/// |---|---|
/// | 0 | command code |
/// | 1 | flags |
/// | 2..4 | count (u16) |
/// | 4..8 | IDAW count when `IDA` is set, else reserved (0) |
/// | 8..16 | data address / IDAW list address / TIC target (u64) |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CcwWord {
    /// Command code (see [`cmd`]).
    pub cmd: u8,
    /// Flags (see [`flags`]).
    pub flags: u8,
    /// Byte count.
    pub count: u16,
    /// Number of IDAWs in the list (IDA only; otherwise must be 0).
    pub idaw_count: u32,
    /// Data address, IDAW list address, or TIC target.
    pub addr: u64,
}

impl CcwWord {
    /// Encode to the 16-byte wire form.
    pub fn to_bytes(&self) -> [u8; CCW_SIZE as usize] {
        let mut b = [0u8; CCW_SIZE as usize];
        b[0] = self.cmd;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.count.to_le_bytes());
        b[4..8].copy_from_slice(&self.idaw_count.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    /// Decode from the 16-byte wire form.
    pub fn from_bytes(b: &[u8; CCW_SIZE as usize]) -> CcwWord {
        CcwWord {
            cmd: b[0],
            flags: b[1],
            count: u16::from_le_bytes([b[2], b[3]]),
            idaw_count: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            addr: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        }
    }
}

/// The operation block the guest points OPB_ADDR at (32 bytes).
///
/// | bytes | field |
/// |---|---|
/// | 0..8 | channel program address (first CCW) |
/// | 8..16 | starting block (512-byte units) |
/// | 16..24 | status block address |
/// | 24..28 | flags ([`opb_flags`]) |
/// | 28..32 | reserved (0) |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OperationBlock {
    /// Address of the first CCW.
    pub program: u64,
    /// Starting block number.
    pub block: u64,
    /// Where the device stores the status block.
    pub status: u64,
    /// Flags.
    pub flags: u32,
    /// Reserved; must be 0.
    pub reserved: u32,
}

impl OperationBlock {
    /// Encode to the wire form.
    pub fn to_bytes(&self) -> [u8; OPB_SIZE] {
        let mut b = [0u8; OPB_SIZE];
        b[0..8].copy_from_slice(&self.program.to_le_bytes());
        b[8..16].copy_from_slice(&self.block.to_le_bytes());
        b[16..24].copy_from_slice(&self.status.to_le_bytes());
        b[24..28].copy_from_slice(&self.flags.to_le_bytes());
        b[28..32].copy_from_slice(&self.reserved.to_le_bytes());
        b
    }

    /// Decode from the wire form.
    pub fn from_bytes(b: &[u8; OPB_SIZE]) -> OperationBlock {
        OperationBlock {
            program: le_u64(b, 0),
            block: le_u64(b, 8),
            status: le_u64(b, 16),
            flags: le_u32(b, 24),
            reserved: le_u32(b, 28),
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

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ccw_word_roundtrip_preserves_fields() {
        let w = CcwWord {
            cmd: cmd::READ,
            flags: flags::IDA | flags::CC,
            count: 0xabcd,
            idaw_count: 3,
            addr: 0x1122_3344_5566_7788,
        };
        assert_eq!(CcwWord::from_bytes(&w.to_bytes()), w);
        assert_eq!(w.to_bytes()[2], 0xcd);
    }

    #[test]
    fn test_operation_block_roundtrip_preserves_fields() {
        let o = OperationBlock {
            program: 0x1000,
            block: 77,
            status: 0x2008,
            flags: opb_flags::FLUSH,
            reserved: 0,
        };
        assert_eq!(OperationBlock::from_bytes(&o.to_bytes()), o);
    }

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
    }
}
