//! PCI plumbing: config space, BAR sizing, capability list, MSI/MSI-X, INTx.
//!
//! A PCI device implements [`PciDevice`] (its BARs only) and is served through
//! [`PciAdapter`], which implements [`crate::device::Device`]: config space (region 7), BAR
//! sizing, command/status, the capability list with MSI and MSI-X (table and PBA emulated in
//! a BAR), INTx, and the vfio-user IRQ indexes. `protocol-docs/pci.md` describes the
//! emulation for device authors.
//!
//! Files: `config_space.rs` (bytes and write masks), `header.rs` (the type-0 header and
//! capability chain), `bar.rs` (BAR registers and access routing), `msi.rs`, `msix.rs`
//! (capabilities, MSI-X table and PBA), `shared_memory.rs` (memfd-backed BARs),
//! `validate.rs` (checks on [`PciConfig`]), `adapter.rs` ([`PciAdapter`]).
//!
//! ```
//! use umdev::pci::{BarKind, BarSpec, PciAdapter, PciConfig, PciDevice, PciIds};
//! use umdev::device::Device;
//!
//! struct Scratch([u8; 16]);
//! impl PciDevice for Scratch {
//!     fn config(&self) -> PciConfig {
//!         PciConfig {
//!             ids: PciIds { vendor: 0x1b36, device: 0x0005, ..Default::default() },
//!             bars: vec![BarSpec { index: 0, size: 16, kind: BarKind::Mmio32,
//!                                  prefetchable: false, shared: None }],
//!             msi_vectors: 1,
//!             ..Default::default()
//!         }
//!     }
//!     fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
//!         let start = offset as usize;
//!         data.copy_from_slice(&self.0[start..start + data.len()]);
//!     }
//!     fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
//!         let start = offset as usize;
//!         self.0[start..start + data.len()].copy_from_slice(data);
//!     }
//! }
//!
//! let mut dev = PciAdapter::new(Scratch([0; 16])).unwrap();
//! dev.region_write(0, 4, &[1, 2]).unwrap();
//! let mut id = [0u8; 2];
//! dev.region_read(7, 0, &mut id).unwrap();
//! assert_eq!(u16::from_le_bytes(id), 0x1b36);
//! ```

mod adapter;
mod bar;
mod config_space;
mod header;
mod msi;
mod msix;
mod shared_memory;
mod validate;

#[cfg(test)]
mod adapter_bme_tests;
#[cfg(test)]
mod adapter_config_tests;
#[cfg(test)]
mod adapter_irq_tests;
#[cfg(test)]
pub(crate) mod test_device;

use std::sync::Arc;

use crate::dma::DmaHandle;
use crate::irq::Interrupts;

pub use adapter::PciAdapter;
pub use shared_memory::SharedMemory;

/// PCI identity of a device.
#[derive(Clone, Copy, Debug, Default)]
pub struct PciIds {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Subsystem vendor ID.
    pub subsystem_vendor: u16,
    /// Subsystem ID.
    pub subsystem: u16,
    /// Class code (base class << 16 | subclass << 8 | prog-if).
    pub class_code: u32,
    /// Revision ID.
    pub revision: u8,
}

/// Kind of a BAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Mmio32,
    /// 64-bit memory BAR (takes this slot and the next).
    Mmio64,
    /// I/O port BAR.
    Io,
}

/// One BAR a device declares.
#[derive(Clone, Debug)]
pub struct BarSpec {
    /// BAR slot 0..=5.
    pub index: usize,
    /// Size in bytes: a power of two (≥ 16 for memory, ≥ 4 for I/O).
    pub size: u64,
    /// Memory or I/O, 32 or 64 bit.
    pub kind: BarKind,
    /// Prefetchable (memory BARs only).
    pub prefetchable: bool,
    /// Backed by shared memory the client may mmap directly (the whole BAR is one sparse
    /// mmap area); accesses that still arrive by message go to that memory, not the device.
    pub shared: Option<Arc<SharedMemory>>,
}

/// MSI-X placement: how many vectors, and where in the device's BARs the framework puts
/// the vector table (16 bytes per vector) and the pending-bit array (PBA: one bit per
/// vector, in whole 8-byte qwords).
///
/// The rules, all checked when the [`PciAdapter`] is built (a violation is an
/// `InvalidArgument` error from [`PciAdapter::new`], never silence):
/// - `vectors` is 1..=2048;
/// - the table and the PBA lie in declared **memory** BARs that are **not** backed by
///   shared memory (accesses to them must trap to be emulated), entirely inside the BAR;
/// - their offsets are **8-byte aligned** (the PCI spec's BIR encoding) and below 4 GiB;
///   the table and the PBA do not overlap;
/// - they may share a BAR with the device's registers, but must not overlap a register
///   range the device declares in [`PciConfig::registers`]. Declare your register ranges:
///   without them the framework cannot tell that a table at offset 0 sits on top of your
///   registers.
///
/// Accesses to the table and PBA ranges never reach [`PciDevice::bar_read`] /
/// [`PciDevice::bar_write`]: the framework answers them (an access that straddles a range
/// edge is split, and the device sees only its part). Put them in a page of their own (a
/// 4 KiB-aligned offset, as real devices do) so that a VMM that maps BAR pages can map
/// the rest of the BAR around them.
///
/// ```
/// use umdev::pci::{BarKind, BarSpec, MsixSpec, PciAdapter, PciConfig, PciDevice, RegisterRange};
///
/// struct Dev(MsixSpec);
/// impl PciDevice for Dev {
///     fn config(&self) -> PciConfig {
///         let bar0 = BarSpec { index: 0, size: 0x4000, kind: BarKind::Mmio32, prefetchable: false, shared: None };
///         PciConfig {
///             bars: vec![bar0],
///             registers: vec![RegisterRange { bar: 0, offset: 0, size: 0x1000 }],
///             msix: Some(self.0),
///             ..Default::default()
///         }
///     }
///     fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) { data.fill(0) }
///     fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
/// }
///
/// // Registers in the first page, table and PBA in pages of their own: accepted.
/// let good = MsixSpec { vectors: 4, table_bar: 0, table_offset: 0x2000, pba_bar: 0, pba_offset: 0x3000 };
/// assert!(PciAdapter::new(Dev(good)).is_ok());
/// // The table on top of the registers: an error, not silence.
/// let bad = MsixSpec { table_offset: 0, ..good };
/// let err = PciAdapter::new(Dev(bad)).err().unwrap();
/// assert!(err.to_string().contains("overlaps the device's registers"), "{err}");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct MsixSpec {
    /// Number of vectors (1..=2048).
    pub vectors: u16,
    /// BAR holding the table; the table and PBA are emulated by the framework.
    pub table_bar: usize,
    /// Offset of the table in that BAR (8-byte aligned; a page of its own is best).
    pub table_offset: u64,
    /// BAR holding the PBA.
    pub pba_bar: usize,
    /// Offset of the PBA in that BAR (8-byte aligned).
    pub pba_offset: u64,
}

/// A range of a BAR where the device has registers, declared in [`PciConfig::registers`]
/// so that the framework can refuse an MSI-X table or PBA placed on top of it. It changes
/// nothing else: accesses anywhere in a trapped BAR still reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegisterRange {
    /// BAR slot.
    pub bar: usize,
    /// First byte of the registers.
    pub offset: u64,
    /// Bytes (not 0).
    pub size: u64,
}

/// Everything the framework needs to build config space for a device.
#[derive(Clone, Debug, Default)]
pub struct PciConfig {
    /// Identity.
    pub ids: PciIds,
    /// BARs.
    pub bars: Vec<BarSpec>,
    /// Offer legacy INTx (pin A).
    pub intx: bool,
    /// Number of MSI vectors (0 = no MSI capability; otherwise a power of two ≤ 32).
    pub msi_vectors: u16,
    /// MSI-X capability, if any (placement rules: [`MsixSpec`]).
    pub msix: Option<MsixSpec>,
    /// Where the device has registers (optional; validated: inside a declared trapped BAR,
    /// and not under the MSI-X table or PBA).
    pub registers: Vec<RegisterRange>,
    /// Vendor-specific capabilities (ID 0x09), chained after MSI and MSI-X in this order.
    /// Each entry is the capability from its third byte on (the framework writes the ID and
    /// the next pointer); its first byte is therefore `cap_len`, the length of the whole
    /// capability, which must equal `2 + entry.len()`. Read-only to the guest. Validated:
    /// the length byte is right, and everything fits the 256-byte config space. The virtio
    /// transport ([`crate::virtio`]) places its structures with these.
    pub vendor_capabilities: Vec<Vec<u8>>,
}

/// What a PCI device implements: its BARs and lifecycle. Config space is the framework's.
pub trait PciDevice: Send {
    /// Identity, BARs and interrupt capabilities. Called once when the adapter is built.
    fn config(&self) -> PciConfig;

    /// Guest read of a trapped BAR (not shared-memory, not the MSI-X table/PBA).
    /// Unimplemented registers should read as zero.
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]);

    /// Guest write to a trapped BAR. Any value may arrive; never panic.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);

    /// Called once with the handles the device keeps (and may give to worker threads).
    fn attach(&mut self, _dma: DmaHandle, _irq: Interrupts) {}

    /// Device reset (DEVICE_RESET or FLR): drop pins, stop work, clear registers.
    fn reset(&mut self) {}

    /// DMA unmap notifier: drop every pin in `[iova, iova + size)` before returning.
    fn dma_unmap(&mut self, _iova: u64, _size: u64) {}

    /// The client went away; device state is kept.
    fn disconnected(&mut self) {}

    /// The device's live-migration support, if it has any (`None`: the device does not
    /// migrate, and umdev does not offer migration for it).
    fn migration(&mut self) -> Option<&mut dyn crate::migration::Migrate> {
        None
    }
}
