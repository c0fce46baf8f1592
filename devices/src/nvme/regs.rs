//! BAR0 controller registers (NVMe 1.4 section 3.1) and doorbells, with the decoding of
//! guest accesses.
//!
//! Registers are 32 bits wide (CAP, ASQ and ACQ are 64-bit pairs that Linux reads and
//! writes as two halves). Reads of any size and alignment are assembled from the
//! covering 32-bit registers; writes must be 4 bytes at a 4-aligned offset or 8 bytes at
//! an 8-aligned offset (split in two): anything else is ignored and logged. The doorbells
//! start at [`DOORBELLS`] with a stride of 4 bytes (CAP.DSTRD = 0): submission queue `y`'s
//! tail at `0x1000 + 8y`, completion queue `y`'s head at `0x1000 + 8y + 4`.

/// Controller Capabilities, low half.
pub const CAP_LO: u64 = 0x00;
/// Controller Capabilities, high half.
pub const CAP_HI: u64 = 0x04;
/// Version.
pub const VS: u64 = 0x08;
/// Interrupt Mask Set.
pub const INTMS: u64 = 0x0c;
/// Interrupt Mask Clear.
pub const INTMC: u64 = 0x10;
/// Controller Configuration.
pub const CC: u64 = 0x14;
/// Controller Status.
pub const CSTS: u64 = 0x1c;
/// NVM Subsystem Reset (not supported: CAP.NSSRS = 0, writes ignored).
pub const NSSR: u64 = 0x20;
/// Admin Queue Attributes.
pub const AQA: u64 = 0x24;
/// Admin Submission Queue base address, low half.
pub const ASQ_LO: u64 = 0x28;
/// Admin Submission Queue base address, high half.
pub const ASQ_HI: u64 = 0x2c;
/// Admin Completion Queue base address, low half.
pub const ACQ_LO: u64 = 0x30;
/// Admin Completion Queue base address, high half.
pub const ACQ_HI: u64 = 0x34;
/// First doorbell.
pub const DOORBELLS: u64 = 0x1000;

/// Version 1.4.0.
pub const VERSION_1_4: u32 = 0x0001_0400;

/// CC.EN.
pub const CC_EN: u32 = 1 << 0;
/// CC.CSS (bits 6:4): 0 = NVM command set.
pub const CC_CSS_SHIFT: u32 = 4;
/// CC.MPS (bits 10:7): memory page size 2^(12 + MPS).
pub const CC_MPS_SHIFT: u32 = 7;
/// CC.AMS (bits 13:11): 0 = round robin.
pub const CC_AMS_SHIFT: u32 = 11;
/// CC.SHN (bits 15:14): shutdown notification.
pub const CC_SHN_SHIFT: u32 = 14;
/// CC.IOSQES (bits 19:16).
pub const CC_IOSQES_SHIFT: u32 = 16;
/// CC.IOCQES (bits 23:20).
pub const CC_IOCQES_SHIFT: u32 = 20;

/// CSTS.RDY.
pub const CSTS_RDY: u32 = 1 << 0;
/// CSTS.CFS: Controller Fatal Status.
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST (bits 3:2) = shutdown processing occurring.
pub const CSTS_SHST_OCCURRING: u32 = 1 << 2;
/// CSTS.SHST = shutdown processing complete.
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;
/// CSTS.SHST mask.
pub const CSTS_SHST_MASK: u32 = 3 << 2;

/// The fields of CC this controller looks at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cc(pub u32);

impl Cc {
    /// Enable.
    pub fn en(self) -> bool {
        self.0 & CC_EN != 0
    }
    /// I/O command set selected.
    pub fn css(self) -> u32 {
        (self.0 >> CC_CSS_SHIFT) & 7
    }
    /// Memory page size exponent (0 = 4 KiB).
    pub fn mps(self) -> u32 {
        (self.0 >> CC_MPS_SHIFT) & 0xf
    }
    /// Arbitration mechanism.
    pub fn ams(self) -> u32 {
        (self.0 >> CC_AMS_SHIFT) & 7
    }
    /// Shutdown notification (0 none, 1 normal, 2 abrupt).
    pub fn shn(self) -> u32 {
        (self.0 >> CC_SHN_SHIFT) & 3
    }
    /// I/O submission queue entry size exponent.
    pub fn iosqes(self) -> u32 {
        (self.0 >> CC_IOSQES_SHIFT) & 0xf
    }
    /// I/O completion queue entry size exponent.
    pub fn iocqes(self) -> u32 {
        (self.0 >> CC_IOCQES_SHIFT) & 0xf
    }
}

/// Build CAP from the controller's limits: MQES (0-based), CQR = 1 (queues must be
/// physically contiguous), AMS = round robin only, TO in 500 ms units, DSTRD = 0,
/// CSS = NVM command set, MPSMIN = MPSMAX = 0 (4 KiB pages).
pub fn cap(mqes: u16, timeout_500ms: u8) -> u64 {
    u64::from(mqes) | 1 << 16 | u64::from(timeout_500ms) << 24 | 1 << 37
}

/// What a doorbell offset names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbell {
    /// Submission queue `qid`'s tail.
    SqTail(u16),
    /// Completion queue `qid`'s head.
    CqHead(u16),
}

/// Decode a doorbell offset (4-aligned, at or past [`DOORBELLS`]); `None` past the
/// queue-id space.
pub fn doorbell(offset: u64) -> Option<Doorbell> {
    let idx = offset.checked_sub(DOORBELLS)? / 4;
    let qid = u16::try_from(idx / 2).ok()?;
    Some(if idx % 2 == 0 {
        Doorbell::SqTail(qid)
    } else {
        Doorbell::CqHead(qid)
    })
}

/// Offset of a doorbell (what a guest driver writes).
pub fn doorbell_offset(db: Doorbell) -> u64 {
    match db {
        Doorbell::SqTail(q) => DOORBELLS + u64::from(q) * 8,
        Doorbell::CqHead(q) => DOORBELLS + u64::from(q) * 8 + 4,
    }
}

/// Serve a read of `data.len()` bytes at `offset` from 32-bit registers given by `reg`.
pub fn read_bytes(offset: u64, data: &mut [u8], mut reg: impl FnMut(u64) -> u32) {
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
                let v = reg(base).to_le_bytes();
                cached = Some((base, v));
                v
            }
        };
        *b = bytes[(at & 3) as usize];
    }
}

/// Split a write into 32-bit register writes: 4 bytes at a 4-aligned offset, or 8 bytes at
/// an 8-aligned offset (low half first, as Linux's `lo_hi_writeq` does). Anything else is
/// empty.
pub fn decode_write(offset: u64, data: &[u8]) -> Vec<(u64, u32)> {
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    match data.len() {
        4 if offset.is_multiple_of(4) => vec![(offset, word(data))],
        8 if offset.is_multiple_of(8) => match offset.checked_add(4) {
            Some(hi) => vec![(offset, word(&data[..4])), (hi, word(&data[4..]))],
            None => Vec::new(),
        },
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cap_fields_are_where_linux_reads_them() {
        let c = cap(1023, 20);
        assert_eq!(c & 0xffff, 1023); // MQES
        assert_eq!((c >> 16) & 1, 1); // CQR
        assert_eq!((c >> 24) & 0xff, 20); // TO
        assert_eq!((c >> 32) & 0xf, 0); // DSTRD
        assert_eq!((c >> 37) & 0xff, 1); // CSS: NVM
        assert_eq!((c >> 48) & 0xff, 0); // MPSMIN, MPSMAX
    }

    #[test]
    fn test_doorbell_decoding_round_trips() {
        assert_eq!(doorbell(0x1000), Some(Doorbell::SqTail(0)));
        assert_eq!(doorbell(0x1004), Some(Doorbell::CqHead(0)));
        assert_eq!(doorbell(0x1018), Some(Doorbell::SqTail(3)));
        assert_eq!(doorbell(0xfff), None);
        for q in [0u16, 1, 7, 65535] {
            for db in [Doorbell::SqTail(q), Doorbell::CqHead(q)] {
                assert_eq!(doorbell(doorbell_offset(db)), Some(db));
            }
        }
    }

    #[test]
    fn test_decode_write_accepts_only_aligned_dwords_and_qwords() {
        assert_eq!(decode_write(0x14, &[1, 0, 0, 0]), vec![(0x14, 1)]);
        assert_eq!(
            decode_write(0x28, &[0, 0x10, 0, 0, 1, 0, 0, 0]),
            vec![(0x28, 0x1000), (0x2c, 1)]
        );
        assert!(decode_write(0x2c, &[0; 8]).is_empty());
        assert!(decode_write(0x15, &[0; 4]).is_empty());
        assert!(decode_write(0x14, &[0; 2]).is_empty());
        let mut out = [0u8; 6];
        read_bytes(0x2, &mut out, |o| o as u32 * 0x0101_0101);
        assert_eq!(out, [0, 0, 4, 4, 4, 4]);
    }
}
