//! The MSI-X capability and the table and PBA it points into a BAR.
//!
//! Capability (offsets from its start): ID 0x11, next pointer, control at 0x2 (table size
//! minus one in bits 10:0, function mask bit 14 and enable bit 15 guest-writable), table
//! offset|BIR at 0x4 and PBA offset|BIR at 0x8 (read-only).
//!
//! The table (16 bytes per vector: address low, address high, data, vector control) and the
//! PBA (one pending bit per vector, 64 per qword) are emulated here, inside the device's
//! BAR; the device never sees those accesses. Vector-control bit 0 masks the vector; a
//! trigger on a masked vector sets its PBA bit and unmasking sends it. PBA writes are
//! ignored.
//!
//! Table entries come out of reset **unmasked** (the PCI spec says masked). QEMU emulates the
//! MSI-X table itself and never forwards table writes to the server, so a table that
//! started masked would stay masked and swallow every interrupt. Guests always program an
//! entry before enabling MSI-X, so starting unmasked is invisible to them.

use super::config_space::ConfigSpace;
use super::MsixSpec;
use crate::irq::state::IrqState;

/// Capability ID of MSI-X.
pub(crate) const CAP_ID: u8 = 0x11;
/// Size of the capability in config space.
pub(crate) const CAP_SIZE: usize = 0xc;
/// Bytes per table entry.
pub(crate) const ENTRY_SIZE: u64 = 16;

const CONTROL: usize = 0x2;
const TABLE: usize = 0x4;
const PBA: usize = 0x8;
const CONTROL_FUNCTION_MASK: u16 = 1 << 14;
const CONTROL_ENABLE: u16 = 1 << 15;
const VECTOR_CONTROL_MASK: u32 = 1;

/// Size in bytes of the table for `vectors` vectors.
pub(crate) fn table_size(vectors: u16) -> u64 {
    u64::from(vectors) * ENTRY_SIZE
}

/// Size in bytes of the PBA for `vectors` vectors (whole qwords).
pub(crate) fn pba_size(vectors: u16) -> u64 {
    u64::from(vectors).div_ceil(64) * 8
}

/// Where the MSI-X capability lives and what it describes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MsixCap {
    /// Offset in config space.
    pub(crate) offset: usize,
    /// Placement of table and PBA (validated).
    pub(crate) spec: MsixSpec,
}

impl MsixCap {
    /// Write the capability with `next` as its next pointer.
    pub(crate) fn install(&self, cs: &mut ConfigSpace, next: u8) {
        let o = self.offset;
        let s = &self.spec;
        cs.init_u8(o, CAP_ID, 0);
        cs.init_u8(o + 1, next, 0);
        cs.init_u16(
            o + CONTROL,
            s.vectors.saturating_sub(1) & 0x7ff,
            CONTROL_FUNCTION_MASK | CONTROL_ENABLE,
        );
        // Offsets are 8-byte aligned and below 4 GiB (validated), BIR ≤ 5.
        cs.init_u32(o + TABLE, s.table_offset as u32 | s.table_bar as u32, 0);
        cs.init_u32(o + PBA, s.pba_offset as u32 | s.pba_bar as u32, 0);
    }

    /// (enabled, function masked) as the guest set them.
    pub(crate) fn control(&self, cs: &ConfigSpace) -> (bool, bool) {
        let c = cs.u16(self.offset + CONTROL);
        (c & CONTROL_ENABLE != 0, c & CONTROL_FUNCTION_MASK != 0)
    }
}

/// Message address and data of every vector (the mask bits live in the IRQ state, where
/// triggering threads see them).
#[derive(Debug)]
pub(crate) struct MsixTable {
    /// Per vector: address low, address high, data.
    entries: Vec<[u32; 3]>,
}

impl MsixTable {
    /// A table of `vectors` zeroed entries.
    pub(crate) fn new(vectors: u16) -> MsixTable {
        MsixTable {
            entries: vec![[0; 3]; usize::from(vectors)],
        }
    }

    /// Zero every entry (the masks are reset with the IRQ state).
    pub(crate) fn reset(&mut self) {
        self.entries.iter_mut().for_each(|e| *e = [0; 3]);
    }

    /// Address low, address high and data of every vector (for migration).
    pub(crate) fn entries(&self) -> &[[u32; 3]] {
        &self.entries
    }

    /// Replace every entry with migrated ones; `entries` must have one per vector.
    pub(crate) fn restore(&mut self, entries: &[[u32; 3]]) -> Result<(), String> {
        if entries.len() != self.entries.len() {
            return Err(format!(
                "MSI-X table of {} vectors, this function has {}",
                entries.len(),
                self.entries.len()
            ));
        }
        for (e, s) in self.entries.iter_mut().zip(entries) {
            *e = [s[0] & !0x3, s[1], s[2]];
        }
        Ok(())
    }

    fn dword(&self, irq: &IrqState, index: u64) -> u32 {
        let vector = index / 4;
        let Some(entry) = usize::try_from(vector)
            .ok()
            .and_then(|v| self.entries.get(v))
        else {
            return 0;
        };
        match index % 4 {
            3 => u32::from(irq.msix.guest_masked(vector as u32)),
            field => entry[field as usize],
        }
    }

    fn set_dword(&mut self, irq: &IrqState, index: u64, value: u32) {
        let vector = index / 4;
        let Some(entry) = usize::try_from(vector)
            .ok()
            .and_then(|v| self.entries.get_mut(v))
        else {
            return;
        };
        match index % 4 {
            0 => entry[0] = value & !0x3,
            3 => irq.set_msix_vector_masked(vector as u32, value & VECTOR_CONTROL_MASK != 0),
            field => entry[field as usize] = value,
        }
    }

    /// Guest read at `offset` within the table (any size and alignment).
    pub(crate) fn read(&self, irq: &IrqState, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            *b = self.dword(irq, at / 4).to_le_bytes()[(at % 4) as usize];
        }
    }

    /// Guest write at `offset` within the table: read-modify-write of each touched dword.
    pub(crate) fn write(&mut self, irq: &IrqState, offset: u64, data: &[u8]) {
        let mut i = 0usize;
        while i < data.len() {
            let at = offset.saturating_add(i as u64);
            let index = at / 4;
            let mut bytes = self.dword(irq, index).to_le_bytes();
            let mut lane = (at % 4) as usize;
            while lane < 4 && i < data.len() {
                bytes[lane] = data[i];
                lane += 1;
                i += 1;
            }
            self.set_dword(irq, index, u32::from_le_bytes(bytes));
        }
    }

    /// Guest read at `offset` within the PBA.
    pub(crate) fn read_pba(irq: &IrqState, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            let word = usize::try_from(at / 8).unwrap_or(usize::MAX);
            *b = irq.msix.pending_word(word).to_le_bytes()[(at % 8) as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_msix_table_unaligned_write_updates_fields() {
        let irq = IrqState::new(false, 0, 4);
        let mut t = MsixTable::new(4);
        t.write(&irq, 16 + 6, &[0xaa, 0xbb, 0xcc, 0xdd]);
        let mut buf = [0u8; 16];
        t.read(&irq, 16, &mut buf);
        assert_eq!(&buf[4..12], &[0, 0, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0]);
    }

    #[test]
    fn test_msix_table_address_low_bits_read_zero() {
        let irq = IrqState::new(false, 0, 1);
        let mut t = MsixTable::new(1);
        t.write(&irq, 0, &0xfee0_0003u32.to_le_bytes());
        let mut buf = [0u8; 4];
        t.read(&irq, 0, &mut buf);
        assert_eq!(u32::from_le_bytes(buf), 0xfee0_0000);
    }

    #[test]
    fn test_msix_table_vector_control_sets_mask() {
        let irq = IrqState::new(false, 0, 2);
        let mut t = MsixTable::new(2);
        t.write(&irq, 16 + 12, &[0xff, 0xff, 0xff, 0xff]);
        assert!(irq.msix.guest_masked(1));
        let mut buf = [0u8; 4];
        t.read(&irq, 16 + 12, &mut buf);
        assert_eq!(u32::from_le_bytes(buf), 1, "only the mask bit is writable");
    }

    #[test]
    fn test_msix_sizes() {
        assert_eq!(table_size(2048), 0x8000);
        assert_eq!(pba_size(1), 8);
        assert_eq!(pba_size(65), 16);
    }
}
