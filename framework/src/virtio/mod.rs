//! virtio 1.x over PCI (modern only): the transport a virtio device needs to be driven by a
//! stock guest driver (Linux's `virtio_pci`), and split virtqueues with checked descriptor
//! chains.
//!
//! A device implements [`VirtioDevice`] (its id, feature bits, queue sizes, config space,
//! and what to do when activated, notified and reset) and is served as
//! `PciAdapter::new(VirtioPci::new(device)?)`: [`VirtioPci`] is a [`crate::pci::PciDevice`]
//! that lays out the virtio structures and answers the transport's registers; the adapter
//! adds config space, MSI-X and INTx as for any PCI device.
//!
//! ## The transport ([`VirtioPci`])
//!
//! BAR0 (32-bit memory, 32 KiB, every page trapped), found by the driver through
//! vendor-specific capabilities ([`crate::pci::PciConfig::vendor_capabilities`]):
//!
//! | BAR0 offset | structure | capability `cfg_type` |
//! |---|---|---|
//! | 0x0000 | common configuration (0x40 bytes, virtio 1.2 layout) | 1 |
//! | 0x1000 | ISR status (1 byte; reading clears it and lowers INTx) | 3 |
//! | 0x2000 | device-specific configuration ([`VirtioDevice::config_size`] bytes) | 4 |
//! | 0x3000 | notifications: queue *n* at 0x3000 + 4 × *n* (`notify_off_multiplier` 4) | 2 |
//! | 0x4000 | MSI-X table (one vector per queue plus one for config changes) | — |
//! | 0x5000 | MSI-X PBA | — |
//!
//! - **Features**: the device's bits plus `VIRTIO_F_VERSION_1`, `VIRTIO_RING_F_INDIRECT_DESC`,
//!   `VIRTIO_RING_F_EVENT_IDX` and `VIRTIO_F_ACCESS_PLATFORM` (the device reaches memory
//!   by IOVA, so a vIOMMU works). Setting `FEATURES_OK` with bits that were not offered, or
//!   without `VERSION_1` (no legacy interface), leaves `FEATURES_OK` clear, as the spec says.
//! - **Queues**: size (a power of two up to the device's maximum), descriptor area, driver
//!   area, device area, MSI-X vector, enable. An enable with misaligned or wrapping
//!   addresses is refused with `DEVICE_NEEDS_RESET`.
//! - **Interrupts**: with MSI-X on, each queue and the config change raise their own
//!   vector (`VIRTIO_MSI_NO_VECTOR` = none; a vector beyond the table reads back as
//!   `NO_VECTOR`, as the spec has the device report a failed mapping). Without MSI-X, INTx
//!   with the ISR bits (bit 0 queue, bit 1 config).
//! - **Status**: `DRIVER_OK` after `FEATURES_OK` activates the device
//!   ([`VirtioDevice::activate`] with the enabled [`Virtqueue`]s); writing 0 resets device
//!   and transport (as do DEVICE_RESET and FLR). A queue whose driver breaks the rules
//!   (a bad chain, an avail index that jumps) and a failed activation set
//!   `DEVICE_NEEDS_RESET`, raise the config interrupt and log a line: never a panic.
//! - **Notifications**: QEMU's vfio-user client has no ioeventfds, so each notify is a
//!   trapped write (a socket round trip). The transport offers `VIRTIO_RING_F_EVENT_IDX` so
//!   a device suppresses them while it works ([`Virtqueue::disable_notification`],
//!   [`Virtqueue::enable_notification`]); a polled notify page is not implemented.
//! - Not offered: the legacy interface, packed virtqueues, `VIRTIO_PCI_CAP_PCI_CFG` (the
//!   config-space window to the BAR, which Linux does not use), shared memory regions,
//!   queue reset and notification data.
//!
//! ## Virtqueues ([`Virtqueue`], [`DescChain`], [`PinnedChain`])
//!
//! A split virtqueue lives in guest memory; the device reads and writes it with `dma_rw`
//! through its [`crate::dma::DmaHandle`] (so nothing of the rings is pinned, and an unmap
//! leaves nothing to drop), with acquire/release fences where the spec orders accesses.
//! [`Virtqueue::pop`] copies each descriptor once (a guest rewriting a descriptor while it
//! is read cannot make the device see two versions) and checks the whole chain before the
//! device sees any of it (`chain.rs`): head and `next` indexes in range; no more
//! descriptors than the table has (so a loop ends as an error); an indirect descriptor only
//! if negotiated, never with `NEXT`, never inside an indirect table, its length a non-zero
//! multiple of 16 of at most [`MAX_INDIRECT_DESCRIPTORS`] entries; no device-readable
//! descriptor after a device-writable one; no buffer that wraps the address space; and the
//! readable and writable bytes each at most the device's
//! [`VirtioDevice::max_chain_bytes`]. A violation is an [`VirtioError`], the queue stops
//! (`DEVICE_NEEDS_RESET`) and nothing of the chain was pinned.
//!
//! [`DescChain::pin`] pins a chain's device-readable buffers as **one page array** and its
//! device-writable buffers as another (one `pin_pages` call each: coalesced, all or
//! nothing, readable and writable respectively) and gives a [`PinnedChain`] whose
//! [`PinnedChain::read`] and [`PinnedChain::write`] address the buffers as one byte stream
//! each; dropping it unpins.
//!
//! ## Migration ([`VirtioMigrate`])
//!
//! A device migrates by returning its [`VirtioMigrate`] from [`VirtioDevice::migration`];
//! [`VirtioPci`] then is a [`crate::migration::Migrate`] (through
//! [`crate::pci::PciDevice::migration`], so the [`crate::pci::PciAdapter`] adds config
//! space and MSI-X around it) and saves the transport's own state — features offered and
//! negotiated, status, config generation, ISR, vectors, and per queue its size, enable,
//! vector, ring addresses and ring positions (next avail, next used, the last index
//! considered for an interrupt) — in front of the device's section. The device writes only
//! what is its own:
//!
//! ```
//! use umdev::migration::{encode_state_into, Decoder, MigrationError};
//! use umdev::virtio::{Activation, VirtioDevice, VirtioError, VirtioMigrate, Virtqueue};
//!
//! /// A device whose own state is one register; its queues are the transport's business.
//! struct Counter {
//!     queues: Vec<Option<Virtqueue>>,
//!     value: u32,
//! }
//!
//! impl VirtioDevice for Counter {
//!     fn device_id(&self) -> u16 { 0x7e }
//!     fn queue_max_sizes(&self) -> Vec<u16> { vec![16] }
//!     fn activate(&mut self, a: Activation) -> Result<(), VirtioError> {
//!         self.queues = a.queues; // after a migration: continuing at the saved positions
//!         Ok(())
//!     }
//!     fn reset(&mut self) {
//!         self.queues.clear();
//!         self.value = 0;
//!     }
//!     fn migration(&mut self) -> Option<&mut dyn VirtioMigrate> {
//!         Some(self)
//!     }
//! }
//!
//! impl VirtioMigrate for Counter {
//!     fn max_state_size(&self) -> u64 {
//!         64 // header and one varint: computed from the device's real sizes
//!     }
//!     fn stop(&mut self) -> Result<(), MigrationError> {
//!         // Finish every chain taken (a worker would be joined here), drop the queues.
//!         self.queues.clear();
//!         Ok(())
//!     }
//!     fn save(&mut self, out: &mut Vec<u8>) -> Result<(), MigrationError> {
//!         encode_state_into(out, "counter", 1, &self.value)
//!     }
//!     fn load(&mut self, bytes: &[u8]) -> Result<(), MigrationError> {
//!         let (_, mut d) = Decoder::new("counter", 1, 1, bytes)?;
//!         let value: u32 = d.value()?;
//!         d.finish()?; // everything checked: now change the device
//!         self.value = value;
//!         Ok(())
//!     }
//! }
//!
//! // The transport saves its part and the device's; a destination loads both.
//! use umdev::migration::Migrate;
//! use umdev::virtio::VirtioPci;
//! let mut src = VirtioPci::new(Counter { queues: Vec::new(), value: 7 }).unwrap();
//! let state = src.save().unwrap();
//! let mut dst = VirtioPci::new(Counter { queues: Vec::new(), value: 0 }).unwrap();
//! dst.load(&state).unwrap();
//! dst.resume().unwrap();
//! assert_eq!(dst.device().value, 7);
//! ```
//!
//! What the transport does around it: at STOP it calls [`VirtioMigrate::stop`] if the
//! device is active, then fences every old [`Virtqueue`] (they return
//! [`VirtioError::Stopped`]) and drops notifies until RUNNING; a save refuses a queue with
//! chains in flight (version 1 does not carry held buffers). A load checks the transport's
//! part whole (same features offered, same queue count, sizes, aligned rings, no chain in
//! flight), resets transport and device, lets the device load, and applies its own part
//! only if that succeeded. At RUNNING a device that was active gets
//! [`VirtioDevice::activate`] again, with queues that continue at the saved positions,
//! then one [`VirtioDevice::queue_notify`] per enabled queue so that chains published
//! before STOP without a notify are taken. So a device needs no migration code for its
//! queues: only its own state, and a `stop` that finishes what it took. Details and the
//! wire format: [`migration`]. The virtio-gpu (`umdev_devices::virtio_gpu::migration`) is
//! the example.
//!
//! ## Why not rust-vmm's `virtio-queue`
//!
//! `virtio-queue` walks rings through a `vm_memory::GuestMemory`, which hands out host
//! addresses of guest regions for direct access. umdev's DMA space is not that: an access
//! must pass the Bus Master gate, may go to the client as DMA_READ/DMA_WRITE when memory
//! has no fd, and must not outlive a DMA_UNMAP reply (the unmap waits for accesses in
//! flight); a pin is refcounted and accounted. A `GuestMemory` view of it would either
//! bypass those rules or re-implement them behind a trait made for static guest RAM; the
//! queue logic itself (about 300 lines here) is the smaller part. So the rings are read
//! through [`crate::dma::DmaHandle`], and chains are pinned through it.
//!
//! Files: `transport.rs` ([`VirtioPci`]), `common_cfg.rs` (the common configuration
//! registers and the transport state), `queue.rs` ([`Virtqueue`]), `chain.rs` (descriptor
//! chain checks, [`DescChain`]), `pinned_chain.rs` ([`PinnedChain`]), `migration.rs`
//! ([`VirtioMigrate`], the transport's state), `error.rs`.

mod chain;
mod common_cfg;
mod error;
pub mod migration;
mod pinned_chain;
mod queue;
mod signal;
mod transport;

#[cfg(test)]
mod chain_proptest;
#[cfg(test)]
mod tests;

pub use chain::{DescChain, Segment, MAX_INDIRECT_DESCRIPTORS};
pub use error::VirtioError;
pub use migration::VirtioMigrate;
pub use pinned_chain::{PinnedBuffers, PinnedChain};
pub use queue::Virtqueue;
pub use transport::{ConfigNotifier, VirtioPci, BAR0_SIZE};

use crate::dma::DmaHandle;

/// Feature bit: the device is virtio 1.x (required; there is no legacy interface).
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Feature bit: the device accesses memory through the platform's IOMMU (by IOVA).
pub const VIRTIO_F_ACCESS_PLATFORM: u64 = 1 << 33;
/// Feature bit: indirect descriptors.
pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
/// Feature bit: `used_event` / `avail_event` notification suppression.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// The feature bits the transport itself offers (besides the device's).
pub const TRANSPORT_FEATURES: u64 = VIRTIO_F_VERSION_1
    | VIRTIO_F_ACCESS_PLATFORM
    | VIRTIO_RING_F_INDIRECT_DESC
    | VIRTIO_RING_F_EVENT_IDX;

/// Device status bits (`device_status`).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready: the device is live.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u8 = 0x80;
}

/// "No MSI-X vector" in `config_msix_vector` / `queue_msix_vector`.
pub const VIRTIO_MSI_NO_VECTOR: u16 = 0xffff;

/// Most queues a [`VirtioDevice`] may have (the notify and MSI-X pages' room).
pub const MAX_QUEUES: usize = 64;

/// Default of [`VirtioDevice::max_chain_bytes`]: 1 MiB per direction.
pub const DEFAULT_MAX_CHAIN_BYTES: u64 = 1 << 20;

/// What a device gets when the driver sets `DRIVER_OK`.
pub struct Activation {
    /// The negotiated features (device and transport bits).
    pub features: u64,
    /// One entry per queue the device declared; `None` for a queue the driver did not
    /// enable.
    pub queues: Vec<Option<Virtqueue>>,
    /// The device's DMA handle (for pinning chains and anything else it reaches).
    pub dma: DmaHandle,
    /// Raises the configuration-change interrupt (after the device changed its config).
    pub config: ConfigNotifier,
}

/// A virtio device, served over PCI by [`VirtioPci`]. Methods run on the connection thread
/// (one at a time: the transport holds `&mut self`); a device with slow work hands its
/// queues to a worker thread in [`VirtioDevice::activate`].
///
/// Every value here comes from the guest or reaches it: never panic on any of them.
pub trait VirtioDevice: Send {
    /// The virtio device ID (1 net, 2 block, 4 entropy, 16 GPU, …). The PCI device ID is
    /// 0x1040 + this.
    fn device_id(&self) -> u16;

    /// PCI class code (base << 16 | sub << 8 | prog-if); 0xff0000 ("other") by default.
    fn class_code(&self) -> u32 {
        0xff_00_00
    }

    /// Device-specific feature bits offered to the driver; the transport adds
    /// [`TRANSPORT_FEATURES`].
    fn features(&self) -> u64 {
        0
    }

    /// The maximum size of each queue (a power of two, 1..=32768); the length is the number
    /// of queues (1..=[`MAX_QUEUES`]).
    fn queue_max_sizes(&self) -> Vec<u16>;

    /// Bytes of device-specific config space (0..=4096).
    fn config_size(&self) -> u64 {
        0
    }

    /// Read device config at `offset` (inside `config_size`); unwritten bytes read as 0.
    fn config_read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    /// Write device config at `offset` (inside `config_size`); any value may arrive.
    fn config_write(&mut self, _offset: u64, _data: &[u8]) {}

    /// Largest number of device-readable (and, separately, device-writable) bytes one chain
    /// may have; a longer chain is a driver error.
    fn max_chain_bytes(&self) -> u64 {
        DEFAULT_MAX_CHAIN_BYTES
    }

    /// The driver set `DRIVER_OK`: start working on the queues. An error sets
    /// `DEVICE_NEEDS_RESET`.
    fn activate(&mut self, activation: Activation) -> Result<(), VirtioError>;

    /// The driver notified queue `index` (only after activation, only for enabled queues).
    fn queue_notify(&mut self, _index: u16) {}

    /// Reset (status 0, DEVICE_RESET, FLR): drop every queue and pin, stop workers, return
    /// to the state before activation. After it returns, no old queue is used (the
    /// transport also makes old [`Virtqueue`]s refuse to touch memory).
    fn reset(&mut self) {}

    /// DMA unmap notifier: drop every pin in `[iova, iova + size)` before returning.
    fn dma_unmap(&mut self, _iova: u64, _size: u64) {}

    /// The client went away (device state is kept).
    fn disconnected(&mut self) {}

    /// The device's live migration, if it has any (`None`: [`VirtioPci`] does not offer
    /// migration for it). See "Migration" in the module docs.
    fn migration(&mut self) -> Option<&mut dyn VirtioMigrate> {
        None
    }
}
