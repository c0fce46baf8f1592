//! Checks on a device's [`PciConfig`] before the adapter builds config space from it.

use super::msix::{pba_size, table_size};
use super::{BarKind, BarSpec, PciConfig};
use crate::device::DeviceError;

/// Most MSI-X vectors a function may have.
pub(crate) const MAX_MSIX_VECTORS: u16 = 2048;
/// Most MSI vectors a function may have.
pub(crate) const MAX_MSI_VECTORS: u16 = 32;
/// Largest I/O BAR the PCI spec allows.
const MAX_IO_BAR: u64 = 256;

fn bad(msg: String) -> DeviceError {
    DeviceError::InvalidArgument(format!("invalid PciConfig: {msg}"))
}

fn check_bar(bar: &BarSpec) -> Result<(), DeviceError> {
    let i = bar.index;
    if i > 5 {
        return Err(bad(format!("BAR slot {i} is out of range 0..=5")));
    }
    if !bar.size.is_power_of_two() {
        return Err(bad(format!(
            "BAR{i} size {:#x} is not a power of two",
            bar.size
        )));
    }
    match bar.kind {
        BarKind::Io => {
            if !(4..=MAX_IO_BAR).contains(&bar.size) {
                return Err(bad(format!("I/O BAR{i} size must be 4..=256 bytes")));
            }
            if bar.prefetchable {
                return Err(bad(format!("I/O BAR{i} cannot be prefetchable")));
            }
            if bar.shared.is_some() {
                return Err(bad(format!("I/O BAR{i} cannot be backed by shared memory")));
            }
        }
        BarKind::Mmio32 | BarKind::Mmio64 => {
            if bar.size < 16 {
                return Err(bad(format!("memory BAR{i} must be at least 16 bytes")));
            }
            if bar.kind == BarKind::Mmio32 && bar.size > 1 << 31 {
                return Err(bad(format!("32-bit BAR{i} cannot exceed 2 GiB")));
            }
            if bar.kind == BarKind::Mmio64 && i == 5 {
                return Err(bad("a 64-bit BAR cannot start in slot 5".into()));
            }
        }
    }
    if let Some(shm) = &bar.shared {
        if bar.size < 4096 {
            return Err(bad(format!(
                "shared-memory BAR{i} must be at least one 4 KiB page to be mmapped"
            )));
        }
        if shm.len() < bar.size {
            return Err(bad(format!(
                "BAR{i} is {:#x} bytes but its shared memory only {:#x}",
                bar.size,
                shm.len()
            )));
        }
    }
    Ok(())
}

/// Validate BAR slots and sizes, MSI and MSI-X parameters and placement.
pub(crate) fn validate(config: &PciConfig) -> Result<(), DeviceError> {
    let mut used = [false; 6];
    for bar in &config.bars {
        check_bar(bar)?;
        let slots = if bar.kind == BarKind::Mmio64 { 2 } else { 1 };
        for (slot, in_use) in used.iter_mut().enumerate().skip(bar.index).take(slots) {
            if std::mem::replace(in_use, true) {
                return Err(bad(format!("BAR slot {slot} is used twice")));
            }
        }
    }
    let v = config.msi_vectors;
    if v != 0 && (!v.is_power_of_two() || v > MAX_MSI_VECTORS) {
        return Err(bad(format!(
            "msi_vectors {v} must be 0 or a power of two ≤ {MAX_MSI_VECTORS}"
        )));
    }
    if let Some(m) = &config.msix {
        if m.vectors == 0 || m.vectors > MAX_MSIX_VECTORS {
            return Err(bad(format!(
                "MSI-X vectors {} must be 1..={MAX_MSIX_VECTORS}",
                m.vectors
            )));
        }
        let find = |slot: usize, what: &str| -> Result<&BarSpec, DeviceError> {
            let bar = config
                .bars
                .iter()
                .find(|b| b.index == slot)
                .ok_or_else(|| {
                    bad(format!(
                        "MSI-X {what} is in BAR{slot}, which is not declared"
                    ))
                })?;
            if bar.kind == BarKind::Io {
                return Err(bad(format!("MSI-X {what} cannot be in I/O BAR{slot}")));
            }
            if bar.shared.is_some() {
                return Err(bad(format!(
                    "MSI-X {what} cannot be in shared-memory BAR{slot} (it must trap)"
                )));
            }
            Ok(bar)
        };
        let table_bar = find(m.table_bar, "table")?;
        let pba_bar = find(m.pba_bar, "PBA")?;
        let table = (m.table_offset, table_size(m.vectors));
        let pba = (m.pba_offset, pba_size(m.vectors));
        for (what, (off, len), bar) in [("table", table, table_bar), ("PBA", pba, pba_bar)] {
            if off % 8 != 0 || off > u64::from(u32::MAX) {
                return Err(bad(format!(
                    "MSI-X {what} offset {off:#x} must be 8-byte aligned and below 4 GiB"
                )));
            }
            if off
                .checked_add(len)
                .filter(|&end| end <= bar.size)
                .is_none()
            {
                return Err(bad(format!(
                    "MSI-X {what} {off:#x}+{len:#x} does not fit BAR{} of {:#x} bytes",
                    bar.index, bar.size
                )));
            }
        }
        if m.table_bar == m.pba_bar && table.0 < pba.0 + pba.1 && pba.0 < table.0 + table.1 {
            return Err(bad("MSI-X table and PBA overlap".into()));
        }
    }
    check_vendor_capabilities(config)?;
    check_registers(config)
}

/// Vendor capabilities: each has its length byte right and all fit config space.
fn check_vendor_capabilities(config: &PciConfig) -> Result<(), DeviceError> {
    for (i, body) in config.vendor_capabilities.iter().enumerate() {
        let whole = body.len() + super::header::VENDOR_HEADER;
        if body.is_empty() || usize::from(body[0]) != whole {
            return Err(bad(format!(
                "vendor capability {i}: its length byte must be {whole} (the whole capability)"
            )));
        }
    }
    let end = super::header::capabilities_end(config);
    if end > super::config_space::CONFIG_SIZE {
        return Err(bad(format!(
            "capabilities need {end:#x} bytes of config space, more than 0x100"
        )));
    }
    Ok(())
}

/// Declared register ranges lie inside declared trapped BARs and under no MSI-X range.
fn check_registers(config: &PciConfig) -> Result<(), DeviceError> {
    for r in &config.registers {
        let Some(bar) = config.bars.iter().find(|b| b.index == r.bar) else {
            return Err(bad(format!(
                "registers at BAR{} {:#x}: that BAR is not declared",
                r.bar, r.offset
            )));
        };
        if bar.shared.is_some() {
            return Err(bad(format!(
                "registers in shared-memory BAR{}: its accesses never reach the device",
                r.bar
            )));
        }
        let end = r.offset.checked_add(r.size).filter(|&e| e <= bar.size);
        let Some(end) = end.filter(|_| r.size > 0) else {
            return Err(bad(format!(
                "registers {:#x}+{:#x} do not fit BAR{} of {:#x} bytes",
                r.offset, r.size, r.bar, bar.size
            )));
        };
        let Some(m) = &config.msix else { continue };
        // In range: the MSI-X checks above passed.
        let table = (m.table_bar, m.table_offset, table_size(m.vectors), "table");
        let pba = (m.pba_bar, m.pba_offset, pba_size(m.vectors), "PBA");
        for (slot, off, len, what) in [table, pba] {
            if slot == r.bar && off < end && r.offset < off + len {
                return Err(bad(format!(
                    "MSI-X {what} {off:#x}+{len:#x} in BAR{slot} overlaps the device's registers \
                     {:#x}+{:#x}; move it to a page of its own",
                    r.offset, r.size
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::MsixSpec;

    fn bar(index: usize, size: u64, kind: BarKind) -> BarSpec {
        BarSpec {
            index,
            size,
            kind,
            prefetchable: false,
            shared: None,
        }
    }

    fn msix(vectors: u16, table_offset: u64, pba_offset: u64) -> Option<MsixSpec> {
        Some(MsixSpec {
            vectors,
            table_bar: 0,
            table_offset,
            pba_bar: 0,
            pba_offset,
        })
    }

    fn config(bars: Vec<BarSpec>) -> PciConfig {
        PciConfig {
            bars,
            ..Default::default()
        }
    }

    #[test]
    fn test_validate_good_config_passes() {
        let mut c = config(vec![
            bar(0, 0x4000, BarKind::Mmio64),
            bar(2, 16, BarKind::Io),
        ]);
        c.msi_vectors = 8;
        c.msix = msix(64, 0x2000, 0x3000);
        validate(&c).unwrap();
    }

    #[test]
    fn test_validate_bad_bars_are_rejected() {
        let cases = [
            vec![bar(6, 0x1000, BarKind::Mmio32)],
            vec![bar(0, 0x1800, BarKind::Mmio32)],
            vec![bar(0, 8, BarKind::Mmio32)],
            vec![bar(0, 2, BarKind::Io)],
            vec![bar(0, 512, BarKind::Io)],
            vec![bar(5, 0x1000, BarKind::Mmio64)],
            vec![
                bar(0, 0x1000, BarKind::Mmio64),
                bar(1, 0x1000, BarKind::Mmio32),
            ],
            vec![
                bar(3, 0x1000, BarKind::Mmio32),
                bar(3, 0x1000, BarKind::Mmio32),
            ],
            vec![bar(0, 1 << 32, BarKind::Mmio32)],
        ];
        for bars in cases {
            let e = validate(&config(bars.clone())).unwrap_err();
            assert!(matches!(e, DeviceError::InvalidArgument(_)), "{bars:?}");
        }
    }

    #[test]
    fn test_validate_bad_msi_and_msix_are_rejected() {
        let base = || config(vec![bar(0, 0x1000, BarKind::Mmio32)]);
        let mut c = base();
        c.msi_vectors = 3;
        assert!(validate(&c).is_err());
        c.msi_vectors = 64;
        assert!(validate(&c).is_err());
        for m in [
            msix(0, 0, 0x800),
            msix(2049, 0, 0x800),
            msix(129, 0, 0x800),   // table 0x810 long overlaps PBA at 0x800
            msix(8, 0xf88, 0xe00), // table past the end
            msix(8, 0x4, 0x800),   // unaligned
            msix(8, 0x0, 0x40),    // overlap
        ] {
            let mut c = base();
            c.msix = m;
            assert!(validate(&c).is_err(), "{m:?}");
        }
        let mut c = base();
        c.msix = Some(MsixSpec {
            vectors: 1,
            table_bar: 1,
            table_offset: 0,
            pba_bar: 0,
            pba_offset: 0,
        });
        assert!(validate(&c).is_err(), "table in an undeclared BAR");
    }

    #[test]
    fn test_validate_msix_over_declared_registers_is_rejected() {
        let regs = |offset, size| crate::pci::RegisterRange {
            bar: 0,
            offset,
            size,
        };
        let with = |m, r: Vec<crate::pci::RegisterRange>| {
            let mut c = config(vec![bar(0, 0x4000, BarKind::Mmio32)]);
            c.msix = m;
            c.registers = r;
            validate(&c)
        };
        // Table in the registers' page, PBA in the registers' last bytes: both refused.
        let e = with(msix(4, 0, 0x3000), vec![regs(0, 0x100)]).unwrap_err();
        assert!(e.to_string().contains("MSI-X table"), "{e}");
        let e = with(msix(4, 0x2000, 0xff8), vec![regs(0, 0x1000)]).unwrap_err();
        assert!(e.to_string().contains("MSI-X PBA"), "{e}");
        // Adjacent is fine; without declared registers nothing can be checked.
        with(msix(4, 0x1000, 0x1040), vec![regs(0, 0x1000)]).unwrap();
        with(msix(4, 0, 0x3000), vec![]).unwrap();
        // Registers of their own must fit a declared, trapped BAR.
        assert!(with(None, vec![regs(0x3ff0, 0x20)]).is_err());
        assert!(with(None, vec![regs(0, 0)]).is_err());
        assert!(with(None, vec![regs(u64::MAX, 2)]).is_err());
        let mut c = config(vec![bar(0, 0x4000, BarKind::Mmio32)]);
        c.registers = vec![crate::pci::RegisterRange {
            bar: 1,
            offset: 0,
            size: 4,
        }];
        assert!(validate(&c).is_err(), "undeclared BAR");
    }

    #[test]
    fn test_validate_shared_bar_smaller_than_page_is_rejected() {
        let shm = std::sync::Arc::new(crate::pci::SharedMemory::new("v", 4096).unwrap());
        let mut b = bar(0, 0x1000, BarKind::Mmio32);
        b.shared = Some(shm.clone());
        validate(&config(vec![b.clone()])).unwrap();
        b.size = 0x2000;
        assert!(
            validate(&config(vec![b.clone()])).is_err(),
            "memory too small"
        );
        b.size = 16;
        assert!(validate(&config(vec![b])).is_err());
    }
}
