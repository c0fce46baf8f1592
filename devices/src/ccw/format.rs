//! Guest-visible memory formats of the ccw device: the channel command word (CCW) and the
//! operation block (the status block and fault codes are in [`super::status`]).
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

pub(crate) fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
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
}
