//! Building the type-0 header and capability list of a device from its [`PciConfig`].
//!
//! | offset | field | guest-writable |
//! |--------|-------|----------------|
//! | 0x00 | vendor, device ID | no |
//! | 0x04 | command | IO, MEM, BUS_MASTER, INTX_DISABLE |
//! | 0x06 | status | error bits W1C; CAP_LIST and INTERRUPT are computed |
//! | 0x08 | revision, class code | no |
//! | 0x0c | cache line size | yes (unused) |
//! | 0x0e | header type 0 | no |
//! | 0x10–0x24 | BARs | address bits above the size |
//! | 0x2c | subsystem vendor, subsystem ID | no |
//! | 0x30 | expansion ROM BAR | no: reads 0 (no ROM) |
//! | 0x34 | capabilities pointer | no |
//! | 0x3c | interrupt line | yes |
//! | 0x3d | interrupt pin (1 = INTA if INTx) | no |
//!
//! Capabilities: MSI at 0x40 (if any MSI vectors), then MSI-X (if any), then the
//! vendor-specific capabilities in their order, each at a 4-byte aligned offset.

use super::bar;
use super::config_space::{command, reg, status, ConfigSpace};
use super::msi::{self, MsiCap};
use super::msix::{self, MsixCap};
use super::PciConfig;

/// Capability ID of a vendor-specific capability.
pub(crate) const VENDOR_CAP_ID: u8 = 0x09;
/// Bytes of a vendor capability the framework writes: ID and next pointer.
pub(crate) const VENDOR_HEADER: usize = 2;

/// Config-space bytes the capabilities of `config` take, from 0x40 on, with the padding
/// that keeps each vendor capability 4-byte aligned.
pub(crate) fn capabilities_end(config: &PciConfig) -> usize {
    let mut next = reg::HEADER_END;
    if config.msi_vectors > 0 {
        next += msi::CAP_SIZE;
    }
    if config.msix.is_some() {
        next += msix::CAP_SIZE;
    }
    for body in &config.vendor_capabilities {
        next = next.next_multiple_of(4) + VENDOR_HEADER + body.len();
    }
    next
}

/// Where the capabilities were placed.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CapLayout {
    /// The MSI capability, if any.
    pub(crate) msi: Option<MsiCap>,
    /// The MSI-X capability, if any.
    pub(crate) msix: Option<MsixCap>,
}

/// Build config space (and record it as the reset state) for a validated config.
pub(crate) fn build(config: &PciConfig) -> (ConfigSpace, CapLayout) {
    let mut cs = ConfigSpace::new();
    let ids = &config.ids;
    cs.init_u16(reg::VENDOR_ID, ids.vendor, 0);
    cs.init_u16(reg::DEVICE_ID, ids.device, 0);
    cs.init_u16(reg::COMMAND, 0, command::WRITABLE);
    cs.init_u16(reg::STATUS, 0, 0);
    cs.init_w1c_u16(reg::STATUS, status::W1C);
    cs.init_u8(reg::REVISION, ids.revision, 0);
    let class = ids.class_code & 0x00ff_ffff;
    for (i, b) in class.to_le_bytes()[..3].iter().enumerate() {
        cs.init_u8(reg::CLASS_PROG_IF + i, *b, 0);
    }
    cs.init_u8(reg::CACHE_LINE_SIZE, 0, 0xff);
    cs.init_u8(reg::HEADER_TYPE, 0, 0);
    for spec in &config.bars {
        bar::install(&mut cs, spec);
    }
    cs.init_u16(reg::SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor, 0);
    cs.init_u16(reg::SUBSYSTEM_ID, ids.subsystem, 0);
    cs.init_u32(reg::ROM_BAR, 0, 0);
    cs.init_u8(reg::INTERRUPT_LINE, 0, 0xff);
    cs.init_u8(reg::INTERRUPT_PIN, u8::from(config.intx), 0);

    let mut layout = CapLayout::default();
    let mut next = reg::HEADER_END;
    if config.msi_vectors > 0 {
        layout.msi = Some(MsiCap {
            offset: next,
            vectors: u32::from(config.msi_vectors),
        });
        next += msi::CAP_SIZE;
    }
    if let Some(spec) = config.msix {
        layout.msix = Some(MsixCap { offset: next, spec });
        next += msix::CAP_SIZE;
    }
    // Vendor capabilities after MSI-X, 4-byte aligned (validated to fit).
    let mut vendor = Vec::with_capacity(config.vendor_capabilities.len());
    for body in &config.vendor_capabilities {
        next = next.next_multiple_of(4);
        vendor.push(next);
        next += VENDOR_HEADER + body.len();
    }
    debug_assert!(next <= super::config_space::CONFIG_SIZE);
    // Chain: header → MSI → MSI-X → vendor… → 0. Offsets are below 0x100: they fit a byte.
    let mut offsets: Vec<u8> = Vec::new();
    offsets.extend(layout.msi.map(|c| c.offset as u8));
    offsets.extend(layout.msix.map(|c| c.offset as u8));
    offsets.extend(vendor.iter().map(|&o| o as u8));
    let next_of = |i: usize| offsets.get(i + 1).copied().unwrap_or(0);
    let mut i = 0;
    if let Some(cap) = layout.msi {
        cap.install(&mut cs, next_of(i));
        i += 1;
    }
    if let Some(cap) = layout.msix {
        cap.install(&mut cs, next_of(i));
        i += 1;
    }
    for (body, &offset) in config.vendor_capabilities.iter().zip(&vendor) {
        cs.init_u8(offset, VENDOR_CAP_ID, 0);
        cs.init_u8(offset + 1, next_of(i), 0);
        for (k, b) in body.iter().enumerate() {
            cs.init_u8(offset + VENDOR_HEADER + k, *b, 0);
        }
        i += 1;
    }
    let first = offsets.first().copied().unwrap_or(0);
    cs.init_u8(reg::CAPABILITIES, first, 0);
    if first != 0 {
        cs.init_u16(reg::STATUS, status::CAP_LIST, 0);
    }
    cs.seal_defaults();
    (cs, layout)
}
