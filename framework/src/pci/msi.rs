//! The MSI capability: 64-bit addresses with per-vector masking.
//!
//! Layout (offsets from the capability start):
//!
//! | off | size | field | guest-writable |
//! |-----|------|-------|----------------|
//! | 0x0 | 1 | ID 0x05 | no |
//! | 0x1 | 1 | next pointer | no |
//! | 0x2 | 2 | control: enable (bit 0), MMC (3:1, log2 of vectors), MME (6:4), 64-bit (7), per-vector mask (8) | enable, MME |
//! | 0x4 | 4 | message address low (bits 1:0 zero) | yes |
//! | 0x8 | 4 | message address high | yes |
//! | 0xc | 2 | message data | yes |
//! | 0x10 | 4 | mask bits (one per vector) | the existing vectors' bits |
//! | 0x14 | 4 | pending bits | no (computed) |
//!
//! The message address and data are stored but unused: the client turns each vector's
//! eventfd into the message. Enable, MME and the mask bits drive [`crate::irq`].

use super::config_space::ConfigSpace;

/// Capability ID of MSI.
pub(crate) const CAP_ID: u8 = 0x05;
/// Size of the capability in config space.
pub(crate) const CAP_SIZE: usize = 0x18;

const CONTROL: usize = 0x2;
const ADDRESS_LO: usize = 0x4;
const ADDRESS_HI: usize = 0x8;
const DATA: usize = 0xc;
const MASK: usize = 0x10;
const PENDING: usize = 0x14;

const CONTROL_ENABLE: u16 = 1 << 0;
const CONTROL_MME_SHIFT: u16 = 4;
const CONTROL_MME_MASK: u16 = 0b111 << CONTROL_MME_SHIFT;
const CONTROL_64BIT: u16 = 1 << 7;
const CONTROL_PER_VECTOR_MASK: u16 = 1 << 8;

/// Where the MSI capability lives and how many vectors it offers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MsiCap {
    /// Offset in config space.
    pub(crate) offset: usize,
    /// Vectors offered (power of two ≤ 32, validated).
    pub(crate) vectors: u32,
}

impl MsiCap {
    /// Write the capability with `next` as its next pointer.
    pub(crate) fn install(&self, cs: &mut ConfigSpace, next: u8) {
        let o = self.offset;
        let mmc = self.vectors.max(1).trailing_zeros() as u16;
        cs.init_u8(o, CAP_ID, 0);
        cs.init_u8(o + 1, next, 0);
        cs.init_u16(
            o + CONTROL,
            (mmc << 1) | CONTROL_64BIT | CONTROL_PER_VECTOR_MASK,
            CONTROL_ENABLE | CONTROL_MME_MASK,
        );
        cs.init_u32(o + ADDRESS_LO, 0, !0x3);
        cs.init_u32(o + ADDRESS_HI, 0, !0);
        cs.init_u16(o + DATA, 0, !0);
        let vector_bits = if self.vectors >= 32 {
            u32::MAX
        } else {
            (1u32 << self.vectors) - 1
        };
        cs.init_u32(o + MASK, 0, vector_bits);
        cs.init_u32(o + PENDING, 0, 0);
    }

    /// Number of vectors the guest enabled (0 if MSI is disabled). An MME above the offered
    /// count is clamped to the count.
    pub(crate) fn enabled_vectors(&self, cs: &ConfigSpace) -> u32 {
        let control = cs.u16(self.offset + CONTROL);
        if control & CONTROL_ENABLE == 0 {
            return 0;
        }
        let mme = u32::from((control & CONTROL_MME_MASK) >> CONTROL_MME_SHIFT);
        (1u32 << mme).min(self.vectors)
    }

    /// The mask register.
    pub(crate) fn mask_bits(&self, cs: &ConfigSpace) -> u32 {
        cs.u32(self.offset + MASK)
    }

    /// The computed pending register (offset, length), which migration does not compare.
    pub(crate) fn pending_range(&self) -> (usize, usize) {
        (self.offset + PENDING, 4)
    }

    /// Store the computed pending bits before a guest read.
    pub(crate) fn set_pending_bits(&self, cs: &mut ConfigSpace, bits: u32) {
        cs.set_u32_raw(self.offset + PENDING, bits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(vectors: u32) -> (MsiCap, ConfigSpace) {
        let mut cs = ConfigSpace::new();
        let cap = MsiCap {
            offset: 0x40,
            vectors,
        };
        cap.install(&mut cs, 0);
        (cap, cs)
    }

    #[test]
    fn test_msi_enable_with_mme_enables_that_many_vectors() {
        let (cap, mut cs) = cap(8);
        assert_eq!(cs.u16(0x42) & 0xe, 3 << 1, "MMC = log2(8)");
        assert_eq!(cap.enabled_vectors(&cs), 0);
        cs.write(0x42, &[0x21, 0]).unwrap();
        assert_eq!(cap.enabled_vectors(&cs), 4);
        cs.write(0x42, &[0x71, 0]).unwrap();
        assert_eq!(cap.enabled_vectors(&cs), 8, "MME above MMC is clamped");
    }

    #[test]
    fn test_msi_mask_bits_only_for_existing_vectors() {
        let (cap, mut cs) = cap(2);
        cs.write(0x50, &[0xff; 4]).unwrap();
        assert_eq!(cap.mask_bits(&cs), 0b11);
        cs.write(0x54, &[0xff; 4]).unwrap();
        assert_eq!(cs.u32(0x54), 0, "pending bits are read-only");
    }
}
