//! BAR registers: flag bits, sizing write masks, and where an access to a BAR goes.
//!
//! A BAR's address bits below its size are read-only zero, so writing all-ones and reading
//! back yields the size mask with the type flags in the low bits. A 64-bit BAR's upper half
//! is the next slot, with the upper 32 bits of the mask.

use super::config_space::{reg, ConfigSpace};
use super::{BarKind, BarSpec};

/// Memory BAR type bits: 64-bit.
const MEM_TYPE_64: u32 = 0b10 << 1;
/// Memory BAR: prefetchable.
const MEM_PREFETCH: u32 = 1 << 3;
/// I/O BAR indicator.
const IO_SPACE: u32 = 1;

/// Config-space offset of BAR slot `slot`.
pub(crate) fn bar_offset(slot: usize) -> usize {
    reg::BAR0 + 4 * slot
}

/// The low dword of a BAR: (flag bits, write mask).
fn low_dword(spec: &BarSpec) -> (u32, u32) {
    let size_mask = !(spec.size.wrapping_sub(1));
    match spec.kind {
        BarKind::Io => (IO_SPACE, (size_mask as u32) & !0x3),
        BarKind::Mmio32 | BarKind::Mmio64 => {
            let mut flags = 0;
            if spec.kind == BarKind::Mmio64 {
                flags |= MEM_TYPE_64;
            }
            if spec.prefetchable {
                flags |= MEM_PREFETCH;
            }
            (flags, (size_mask as u32) & !0xf)
        }
    }
}

/// Write a (validated) BAR's registers into config space.
pub(crate) fn install(cs: &mut ConfigSpace, spec: &BarSpec) {
    let (flags, wmask) = low_dword(spec);
    cs.init_u32(bar_offset(spec.index), flags, wmask);
    if spec.kind == BarKind::Mmio64 {
        let high_mask = (!(spec.size.wrapping_sub(1)) >> 32) as u32;
        cs.init_u32(bar_offset(spec.index + 1), 0, high_mask);
    }
}

/// The current base address the guest programmed into a BAR (flags stripped).
pub(crate) fn address(cs: &ConfigSpace, spec: &BarSpec) -> u64 {
    let low = cs.u32(bar_offset(spec.index));
    match spec.kind {
        BarKind::Io => u64::from(low & !0x3),
        BarKind::Mmio32 => u64::from(low & !0xf),
        BarKind::Mmio64 => {
            u64::from(low & !0xf) | (u64::from(cs.u32(bar_offset(spec.index + 1))) << 32)
        }
    }
}

/// What part of a BAR an access touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BarPart {
    /// The device's own registers.
    Device,
    /// The emulated MSI-X table.
    MsixTable,
    /// The emulated MSI-X PBA.
    MsixPba,
}

/// Framework-emulated ranges inside one BAR, as `(start, end, part)`.
#[derive(Clone, Debug, Default)]
pub(crate) struct BarRanges {
    ranges: Vec<(u64, u64, BarPart)>,
}

impl BarRanges {
    /// Add an emulated range `[start, end)` (ranges never overlap: validated).
    pub(crate) fn add(&mut self, start: u64, end: u64, part: BarPart) {
        self.ranges.push((start, end, part));
        self.ranges.sort_by_key(|r| r.0);
    }

    /// True if `[offset, offset + len)` touches no emulated range (the common case: one
    /// device call, no allocation).
    pub(crate) fn device_only(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len);
        self.ranges.iter().all(|&(s, e, _)| e <= offset || s >= end)
    }

    /// Split `[offset, offset + len)` into pieces `(offset, len, part)`.
    pub(crate) fn split(&self, offset: u64, len: u64) -> Vec<(u64, u64, BarPart)> {
        let end = offset.saturating_add(len);
        let mut out = Vec::with_capacity(1);
        let mut pos = offset;
        while pos < end {
            let (piece_end, part) = match self.ranges.iter().find(|r| r.1 > pos) {
                Some(&(s, e, part)) if s <= pos => (e.min(end), part),
                Some(&(s, _, _)) => (s.min(end), BarPart::Device),
                None => (end, BarPart::Device),
            };
            out.push((pos, piece_end - pos, part));
            pos = piece_end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(index: usize, size: u64, kind: BarKind, prefetchable: bool) -> BarSpec {
        BarSpec {
            index,
            size,
            kind,
            prefetchable,
            shared: None,
        }
    }

    fn size_probe(cs: &mut ConfigSpace, slot: usize) -> u32 {
        cs.write(bar_offset(slot) as u64, &[0xff; 4]).unwrap();
        cs.u32(bar_offset(slot))
    }

    #[test]
    fn test_bar_sizing_mmio32_reads_size_mask() {
        let mut cs = ConfigSpace::new();
        install(&mut cs, &spec(0, 0x1000, BarKind::Mmio32, false));
        assert_eq!(size_probe(&mut cs, 0), 0xffff_f000);
    }

    #[test]
    fn test_bar_sizing_mmio64_prefetchable_spans_two_slots() {
        let mut cs = ConfigSpace::new();
        install(&mut cs, &spec(2, 0x2_0000_0000, BarKind::Mmio64, true));
        assert_eq!(size_probe(&mut cs, 2), 0x0000_000c);
        assert_eq!(size_probe(&mut cs, 3), 0xffff_fffe);
    }

    #[test]
    fn test_bar_sizing_io_keeps_io_bit() {
        let mut cs = ConfigSpace::new();
        install(&mut cs, &spec(4, 32, BarKind::Io, false));
        assert_eq!(size_probe(&mut cs, 4), 0xffff_ffe1);
    }

    #[test]
    fn test_bar_address_round_trips() {
        let mut cs = ConfigSpace::new();
        let s = spec(0, 0x10000, BarKind::Mmio64, false);
        install(&mut cs, &s);
        cs.write(0x10, &0xfe01_2345u32.to_le_bytes()).unwrap();
        cs.write(0x14, &0x1u32.to_le_bytes()).unwrap();
        assert_eq!(address(&cs, &s), 0x1_fe01_0000);
    }

    #[test]
    fn test_bar_ranges_split_straddling_access() {
        let mut r = BarRanges::default();
        r.add(0x100, 0x140, BarPart::MsixTable);
        r.add(0x140, 0x148, BarPart::MsixPba);
        let pieces = r.split(0xf8, 0x60);
        assert_eq!(
            pieces,
            vec![
                (0xf8, 8, BarPart::Device),
                (0x100, 0x40, BarPart::MsixTable),
                (0x140, 8, BarPart::MsixPba),
                (0x148, 0x10, BarPart::Device),
            ]
        );
        assert_eq!(r.split(0, 4), vec![(0, 4, BarPart::Device)]);
        assert!(r.split(5, 0).is_empty());
        assert!(r.device_only(0xf8, 8));
        assert!(!r.device_only(0xf8, 9));
        assert!(r.device_only(0x148, 0x100));
        assert!(!r.device_only(0x13f, 1));
    }
}
