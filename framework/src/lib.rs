//! # umdev — user-space mediated devices over vfio-user
//!
//! A device author implements one trait ([`pci::PciDevice`] for PCI devices, or the lower-level
//! [`device::Device`]); umdev serves it over the vfio-user protocol on a UNIX socket so that a
//! VMM (QEMU 10.1+ `-device vfio-user-pci`) can attach it to a guest.
//!
//! A device with one register, served on a socket and driven through it by the embedded VMM
//! of `umdev::testing` (the `testing` feature), as a test of your device would:
//!
//! ```
//! use umdev::pci::{BarKind, BarSpec, PciConfig, PciDevice};
//! use umdev::testing::{DeviceAccess, TestServer};
//!
//! /// One 32-bit register that reads as the last value written, plus one.
//! #[derive(Default)]
//! struct PlusOne(u32);
//!
//! impl PciDevice for PlusOne {
//!     fn config(&self) -> PciConfig {
//!         let bar0 = BarSpec { index: 0, size: 16, kind: BarKind::Mmio32, prefetchable: false, shared: None };
//!         PciConfig { bars: vec![bar0], msi_vectors: 1, ..Default::default() }
//!     }
//!     fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
//!         let value = if offset == 0 { self.0.wrapping_add(1) } else { 0 };
//!         let n = data.len().min(4);
//!         data.fill(0);
//!         data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
//!     }
//!     fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
//!         if let (0, Ok(bytes)) = (offset, <[u8; 4]>::try_from(data)) {
//!             self.0 = u32::from_le_bytes(bytes);
//!         }
//!     }
//! }
//!
//! let server = TestServer::start_pci(PlusOne::default())?; // on a socket in a temp dir
//! let mut vmm = server.connect()?; // the embedded VMM, standing in for QEMU and the guest
//! vmm.enable_device()?; // memory decoding and Bus Master, as a guest driver does
//! vmm.write32(0, 0, 41)?; // BAR0, offset 0
//! assert_eq!(vmm.read32(0, 0)?, 42);
//! assert!(vmm.find_capability(0x05)?.is_some()); // MSI: config space is the framework's
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`guide`] (`framework/docs/writing-a-device.md`) goes from there to a device with a worker
//! thread, pinned page arrays, interrupts, unmap, reset and disconnect, and running under
//! QEMU; `examples/hello.rs` is the template to copy.
//!
//! Layers, one module each:
//! - [`protocol`]: vfio-user wire types, encode/decode, validation (no I/O).
//! - [`server`]: sockets, connection loop, fd passing, server→client requests.
//! - [`dma`]: DMA map table, page pinning with coalescing, `dma_rw`, dirty log.
//! - [`device`]: the trait the server drives and the info types it returns.
//! - [`pci`]: PCI config space, BAR sizing, capability list, MSI/MSI-X; the `PciDevice` trait.
//! - [`irq`]: eventfd triggering and masking.
//! - [`instance`]: parents, types and instances (the mdev model), above `server`.
//! - [`migration`]: live migration: device states, what a device does to migrate, state encoding.
//! - `daemon` (the `daemon` feature, on by default): the daemon as a library: definitions, a
//!   control socket, lifecycle, migration between daemons and systemd for any set of
//!   parents, above `instance` (`umdev daemon` is it with the example parents).
//! - [`virtio`]: the virtio 1.x PCI transport (modern) and split virtqueues, for devices that
//!   stock guest drivers drive.
//!
//! With the `testing` feature, `testing` is the harness for testing a device: serve it on a
//! temp-dir socket and drive it with an embedded VMM (see its module documentation).
#![deny(missing_docs)]

#[cfg(feature = "daemon")]
pub mod daemon;
pub mod device;
pub mod dma;
// The guide's examples use the test harness; the module holds only documentation. Without
// the `testing` feature it is still documented (`cfg(doc)`), its examples just are not run.
#[cfg(any(doc, feature = "testing"))]
#[doc = include_str!("../docs/writing-a-device.md")]
pub mod guide {}
pub mod instance;
pub mod irq;
pub mod migration;
pub mod pci;
pub mod protocol;
pub mod server;
#[cfg(feature = "testing")]
pub mod testing;
pub mod virtio;
