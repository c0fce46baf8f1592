//! BAR0 register layout of the ccw device and the decoding of guest accesses.
//!
//! All registers are 32 bits wide, little-endian. Reads of any size and alignment are
//! served byte by byte from the covering registers (unknown offsets read as zero). Writes
//! must be 4 bytes at a 4-aligned offset or 8 bytes at an 8-aligned offset (split into two
//! registers); anything else is ignored.

/// BAR0 size.
pub const BAR0_SIZE: u64 = 4096;

/// ID register (RO): [`MAGIC`].
pub const ID: u64 = 0x00;
/// VERSION register (RO): [`VERSION_VALUE`].
pub const VERSION: u64 = 0x04;
/// Operation-block address, low 32 bits (RW).
pub const OPB_ADDR_LO: u64 = 0x08;
/// Operation-block address, high 32 bits (RW).
pub const OPB_ADDR_HI: u64 = 0x0c;
/// START (WO, reads 0): writing 1 submits the operation block at OPB_ADDR.
pub const START: u64 = 0x10;
/// STATUS (RO): [`STATUS_BUSY`], [`STATUS_START_DROPPED`].
pub const STATUS: u64 = 0x14;
/// IRQ_STATUS (RW1C): [`IRQ_DONE`], [`IRQ_STATUS_LOST`].
pub const IRQ_STATUS: u64 = 0x18;
/// Capacity in 512-byte blocks, low 32 bits (RO).
pub const CAPACITY_LO: u64 = 0x20;
/// Capacity in 512-byte blocks, high 32 bits (RO).
pub const CAPACITY_HI: u64 = 0x24;
/// LAST_STATUS (RO): bits 0..8 device status, 8..16 channel status, 16..32 fault code of
/// the last finished program (also valid when the status block could not be stored).
pub const LAST_STATUS: u64 = 0x28;
/// COMPLETED (RO): number of programs finished since reset (wrapping).
pub const COMPLETED: u64 = 0x2c;
/// MAX_CCWS (RO): the CCW limit per program (TICs included).
pub const MAX_CCWS: u64 = 0x30;
/// BLOCK_SIZE (RO): 512.
pub const BLOCK_SIZE_REG: u64 = 0x34;

/// Value of the ID register: the bytes "CCWD" in little-endian order.
pub const MAGIC: u32 = u32::from_le_bytes(*b"CCWD");
/// Value of the VERSION register (major << 16 | minor).
pub const VERSION_VALUE: u32 = 0x0001_0000;

/// STATUS bit: a program is queued or running.
pub const STATUS_BUSY: u32 = 1 << 0;
/// STATUS bit: a START arrived while busy (or before attach) and was dropped; cleared by
/// the next accepted START and by reset.
pub const STATUS_START_DROPPED: u32 = 1 << 1;

/// IRQ_STATUS bit: a program finished.
pub const IRQ_DONE: u32 = 1 << 0;
/// IRQ_STATUS bit: the finished program's status block could not be stored (see
/// LAST_STATUS).
pub const IRQ_STATUS_LOST: u32 = 1 << 1;
/// Every defined IRQ_STATUS bit.
pub const IRQ_ALL: u32 = IRQ_DONE | IRQ_STATUS_LOST;

/// Serve a read of `data.len()` bytes at `offset` from 32-bit registers given by `reg`.
pub fn read_bytes(offset: u64, data: &mut [u8], reg: impl Fn(u64) -> u32) {
    let mut cached: Option<(u64, [u8; 4])> = None;
    for (i, b) in data.iter_mut().enumerate() {
        let Some(at) = offset.checked_add(i as u64) else {
            *b = 0;
            continue;
        };
        let base = at & !3;
        let bytes = match cached {
            Some((o, v)) if o == base => v,
            _ => {
                let v = if base < BAR0_SIZE {
                    reg(base).to_le_bytes()
                } else {
                    [0; 4]
                };
                cached = Some((base, v));
                v
            }
        };
        *b = bytes[(at & 3) as usize];
    }
}

/// Decode a write into (register offset, value) pairs; empty if the access shape is not
/// supported.
pub fn decode_write(offset: u64, data: &[u8]) -> Vec<(u64, u32)> {
    let dword = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    match data.len() {
        4 if offset & 3 == 0 => vec![(offset, dword(data))],
        8 if offset & 7 == 0 => vec![
            (offset, dword(&data[..4])),
            (offset.saturating_add(4), dword(&data[4..])),
        ],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_read_bytes_unaligned_spans_registers() {
        let mut out = [0u8; 6];
        read_bytes(2, &mut out, |o| match o {
            0 => 0x4433_2211,
            4 => 0x8877_6655,
            _ => 0,
        });
        assert_eq!(out, [0x33, 0x44, 0x55, 0x66, 0x77, 0x88]);
    }

    #[test]
    fn test_read_bytes_past_bar_reads_zero() {
        let mut out = [0xffu8; 8];
        read_bytes(u64::MAX - 3, &mut out, |_| 0xffff_ffff);
        assert_eq!(out, [0; 8]);
    }

    #[test]
    fn test_decode_write_shapes() {
        assert_eq!(decode_write(8, &[1, 0, 0, 0]), vec![(8, 1)]);
        assert_eq!(
            decode_write(8, &[1, 0, 0, 0, 2, 0, 0, 0]),
            vec![(8, 1), (12, 2)]
        );
        assert!(decode_write(4, &[0; 8]).is_empty());
        assert!(decode_write(2, &[0; 4]).is_empty());
        assert!(decode_write(0, &[0; 2]).is_empty());
    }

    #[test]
    fn test_magic_spells_ccwd() {
        assert_eq!(&MAGIC.to_le_bytes(), b"CCWD");
    }
}
