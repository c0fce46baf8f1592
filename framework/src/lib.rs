//! # umdev — user-space mediated devices over vfio-user
//!
//! A device author implements one trait ([`pci::PciDevice`] for PCI devices, or the lower-level
//! [`device::Device`]); umdev serves it over the vfio-user protocol on a UNIX socket so that a
//! VMM (QEMU 10.1+ `-device vfio-user-pci`) can attach it to a guest.
//!
//! Layers, one module each:
//! - [`protocol`]: vfio-user wire types, encode/decode, validation (no I/O).
//! - [`server`]: sockets, connection loop, fd passing, server→client requests.
//! - [`dma`]: DMA map table, page pinning with coalescing, `dma_rw`, dirty log.
//! - [`device`]: the trait the server drives and the info types it returns.
//! - [`pci`]: PCI config space, BAR sizing, capability list, MSI/MSI-X; the `PciDevice` trait.
//! - [`irq`]: eventfd triggering and masking.
//! - [`instance`]: parents, types and instances (the mdev model), above `server`.
//!
//! With the `testing` feature, `testing` is the harness for testing a device: serve it on a
//! temp-dir socket and drive it with an embedded VMM (see its module documentation).
#![deny(missing_docs)]

pub mod device;
pub mod dma;
pub mod instance;
pub mod irq;
pub mod pci;
pub mod protocol;
pub mod server;
#[cfg(feature = "testing")]
pub mod testing;
