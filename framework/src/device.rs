//! The trait the server drives, and the info types a device returns.
//!
//! [`Device`] is addressed by vfio-user region index and offset. PCI devices normally do not
//! implement it directly: they implement [`crate::pci::PciDevice`] and are wrapped in
//! [`crate::pci::PciAdapter`], which answers config space, BAR sizing and MSI/MSI-X itself.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vfio_bindings::bindings::vfio;
use vmm_sys_util::eventfd::EventFd;

use crate::dma::DmaHandle;

// The flag and index values are `linux/vfio.h`'s, which vfio-user reuses: they are taken
// from `vfio-bindings` so that there is one source of truth, under umdev's own names.

/// vfio-user / VFIO device flag: the device can be reset (`VFIO_DEVICE_FLAGS_RESET`).
pub const DEVICE_FLAGS_RESET: u32 = vfio::VFIO_DEVICE_FLAGS_RESET;
/// vfio-user / VFIO device flag: this is a PCI device (`VFIO_DEVICE_FLAGS_PCI`).
pub const DEVICE_FLAGS_PCI: u32 = vfio::VFIO_DEVICE_FLAGS_PCI;

/// Region flag: readable (`VFIO_REGION_INFO_FLAG_READ`).
pub const REGION_FLAG_READ: u32 = vfio::VFIO_REGION_INFO_FLAG_READ;
/// Region flag: writable (`VFIO_REGION_INFO_FLAG_WRITE`).
pub const REGION_FLAG_WRITE: u32 = vfio::VFIO_REGION_INFO_FLAG_WRITE;
/// Region flag: mmappable, an fd comes with GET_REGION_INFO (`VFIO_REGION_INFO_FLAG_MMAP`).
pub const REGION_FLAG_MMAP: u32 = vfio::VFIO_REGION_INFO_FLAG_MMAP;
/// Region flag: a capability chain follows the region info (`VFIO_REGION_INFO_FLAG_CAPS`).
pub const REGION_FLAG_CAPS: u32 = vfio::VFIO_REGION_INFO_FLAG_CAPS;

/// IRQ info flag: eventfds can be attached (`VFIO_IRQ_INFO_EVENTFD`).
pub const IRQ_INFO_EVENTFD: u32 = vfio::VFIO_IRQ_INFO_EVENTFD;
/// IRQ info flag: vectors can be masked (`VFIO_IRQ_INFO_MASKABLE`).
pub const IRQ_INFO_MASKABLE: u32 = vfio::VFIO_IRQ_INFO_MASKABLE;
/// IRQ info flag: the interrupt is masked automatically when it fires, as INTx is
/// (`VFIO_IRQ_INFO_AUTOMASKED`).
pub const IRQ_INFO_AUTOMASKED: u32 = vfio::VFIO_IRQ_INFO_AUTOMASKED;
/// IRQ info flag: the count cannot be changed after setup (`VFIO_IRQ_INFO_NORESIZE`).
pub const IRQ_INFO_NORESIZE: u32 = vfio::VFIO_IRQ_INFO_NORESIZE;

/// VFIO PCI IRQ indexes (`VFIO_PCI_*_IRQ_INDEX`).
pub mod irq_index {
    use vfio_bindings::bindings::vfio;

    /// Legacy INTx.
    pub const INTX: u32 = vfio::VFIO_PCI_INTX_IRQ_INDEX;
    /// MSI.
    pub const MSI: u32 = vfio::VFIO_PCI_MSI_IRQ_INDEX;
    /// MSI-X.
    pub const MSIX: u32 = vfio::VFIO_PCI_MSIX_IRQ_INDEX;
    /// Error notification.
    pub const ERR: u32 = vfio::VFIO_PCI_ERR_IRQ_INDEX;
    /// Device request.
    pub const REQ: u32 = vfio::VFIO_PCI_REQ_IRQ_INDEX;
    /// Number of PCI IRQ indexes (`VFIO_PCI_NUM_IRQS`).
    pub const COUNT: u32 = vfio::VFIO_PCI_NUM_IRQS;
}

/// VFIO PCI region indexes (`VFIO_PCI_*_REGION_INDEX`).
pub mod region_index {
    use vfio_bindings::bindings::vfio;

    /// BAR0..BAR5 are 0..=5.
    pub const BAR0: u32 = vfio::VFIO_PCI_BAR0_REGION_INDEX;
    /// Expansion ROM.
    pub const ROM: u32 = vfio::VFIO_PCI_ROM_REGION_INDEX;
    /// PCI configuration space.
    pub const CONFIG: u32 = vfio::VFIO_PCI_CONFIG_REGION_INDEX;
    /// VGA.
    pub const VGA: u32 = vfio::VFIO_PCI_VGA_REGION_INDEX;
    /// Number of PCI region indexes (`VFIO_PCI_NUM_REGIONS`).
    pub const COUNT: u32 = vfio::VFIO_PCI_NUM_REGIONS;
}

/// Shared memory behind a region that the client may mmap directly.
#[derive(Debug, Clone)]
pub struct RegionMmap {
    /// The file (normally a memfd) the client maps; passed with SCM_RIGHTS.
    pub fd: Arc<OwnedFd>,
    /// Offset of the region's start inside `fd`.
    pub file_offset: u64,
    /// Sparse mmap areas as (offset within region, size); must lie inside the region.
    pub areas: Vec<(u64, u64)>,
}

/// One region as reported by DEVICE_GET_REGION_INFO.
#[derive(Debug, Clone, Default)]
pub struct RegionInfo {
    /// Region index.
    pub index: u32,
    /// Size in bytes (0 = region not implemented).
    pub size: u64,
    /// `REGION_FLAG_*` bits (READ/WRITE/MMAP; CAPS is set by the server when needed).
    pub flags: u32,
    /// Direct-mapping information, if the region is backed by shared memory.
    pub mmap: Option<RegionMmap>,
}

/// One IRQ index as reported by DEVICE_GET_IRQ_INFO.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IrqInfo {
    /// IRQ index (see [`irq_index`]).
    pub index: u32,
    /// Number of vectors.
    pub count: u32,
    /// `IRQ_INFO_*` bits.
    pub flags: u32,
}

/// Everything DEVICE_GET_INFO, GET_REGION_INFO and GET_IRQ_INFO report.
#[derive(Debug, Clone, Default)]
pub struct DeviceInfo {
    /// `DEVICE_FLAGS_*` bits.
    pub flags: u32,
    /// Regions, indexed by position (`regions[i].index == i`).
    pub regions: Vec<RegionInfo>,
    /// IRQ indexes, indexed by position (`irqs[i].index == i`).
    pub irqs: Vec<IrqInfo>,
}

/// What a SET_IRQS request does to the selected vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqAction {
    /// Mask the vectors.
    Mask,
    /// Unmask the vectors.
    Unmask,
    /// Trigger / attach the trigger for the vectors.
    Trigger,
}

/// The data of a SET_IRQS request.
#[derive(Debug)]
pub enum IrqData {
    /// DATA_NONE: act on all selected vectors (count 0 with Trigger = disable the index).
    None,
    /// DATA_BOOL: one flag per vector; act where true.
    Bool(Vec<bool>),
    /// DATA_EVENTFD: one entry per vector; `None` (fd -1) detaches that vector's eventfd.
    Eventfd(Vec<Option<EventFd>>),
}

/// A decoded, validated SET_IRQS request.
#[derive(Debug)]
pub struct SetIrqs {
    /// IRQ index.
    pub index: u32,
    /// First vector.
    pub start: u32,
    /// Number of vectors (`start + count` is checked against the IRQ's count by the server).
    pub count: u32,
    /// Mask, unmask or trigger.
    pub action: IrqAction,
    /// The payload.
    pub data: IrqData,
}

/// Errors a device returns; each maps to one errno in the reply.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The operation is not supported by this device.
    #[error("operation not supported by the device")]
    Unsupported,
    /// An argument (region, offset, size, index) is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device is busy (e.g. reset while work is in flight that cannot be aborted).
    #[error("device busy")]
    Busy,
    /// An I/O error from the device's backend.
    #[error("device I/O error")]
    Io(#[source] std::io::Error),
}

impl DeviceError {
    /// The errno sent to the client for this error.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::Unsupported => libc::ENOTSUP,
            DeviceError::InvalidArgument(_) => libc::EINVAL,
            DeviceError::Busy => libc::EBUSY,
            DeviceError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// The trait the server drives. All methods are called from the connection thread, one at a
/// time; a device hands slow work to its own worker threads (which use the [`DmaHandle`] it
/// got in [`Device::attach`]) so that the connection thread never blocks for long.
pub trait Device: Send {
    /// Device flags, regions and IRQs. Called at attach and whenever the client asks.
    fn info(&self) -> DeviceInfo;

    /// Read `data.len()` bytes at `offset` of `region`. The server has checked that the
    /// access lies inside the region's reported size.
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8])
        -> Result<(), DeviceError>;

    /// Write `data` at `offset` of `region`. The server has checked the bounds.
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// Called once, before the first client connects, with the handle the device keeps for
    /// all its DMA (the handle stays valid across client reconnects).
    fn attach(&mut self, _dma: DmaHandle) {}

    /// SET_IRQS. The server has validated index, start+count and the data length.
    fn set_irqs(&mut self, _req: SetIrqs) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported)
    }

    /// DEVICE_RESET.
    fn reset(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    /// The client is unmapping `[iova, iova + size)`: drop every pin in that range before
    /// returning. Pins left behind are force-released and counted as a device bug.
    fn dma_unmap(&mut self, _iova: u64, _size: u64) {}

    /// The client disconnected: drop eventfds and per-connection state; keep device state.
    fn disconnected(&mut self) {}

    /// Ask the client to release the device, as VFIO's device request does: signal the
    /// request IRQ (index [`irq_index::REQ`]), which QEMU answers by hot-unplugging the
    /// device. Called when the device is about to be removed while a client is attached
    /// (by [`crate::server::RunningServer::request_release`], under the same lock as every
    /// other call, but not necessarily from the connection thread). True if the request was
    /// signalled (the client attached an eventfd to it). Default: false, no request IRQ;
    /// [`crate::pci::PciAdapter`] implements it.
    fn request_release(&mut self) -> bool {
        false
    }

    /// The device's live migration, if it migrates: the server drives the migration state
    /// machine (DEVICE_FEATURE MIGRATION / MIG_DEVICE_STATE, MIG_DATA_READ/WRITE) through it,
    /// under the same lock as every other call. Default `None`: the features answer ENOTSUP
    /// and VERSION offers no `migration`. [`crate::pci::PciAdapter`] returns itself when its
    /// [`crate::pci::PciDevice::migration`] is `Some`: the framework's PCI state plus the
    /// device's own.
    fn migration(&mut self) -> Option<&mut dyn crate::migration::Migrate> {
        None
    }
}

impl<T: Device + ?Sized> Device for Box<T> {
    fn info(&self) -> DeviceInfo {
        (**self).info()
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        (**self).region_read(region, offset, data)
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        (**self).region_write(region, offset, data)
    }
    fn attach(&mut self, dma: DmaHandle) {
        (**self).attach(dma)
    }
    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        (**self).set_irqs(req)
    }
    fn reset(&mut self) -> Result<(), DeviceError> {
        (**self).reset()
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        (**self).dma_unmap(iova, size)
    }
    fn disconnected(&mut self) {
        (**self).disconnected()
    }
    fn request_release(&mut self) -> bool {
        (**self).request_release()
    }
    fn migration(&mut self) -> Option<&mut dyn crate::migration::Migrate> {
        (**self).migration()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_device_constants_keep_their_wire_values() {
        // The literal values umdev had before they came from vfio-bindings: a change of
        // the bindings (or of which constant a name points at) would change the wire.
        let table: [(&str, u32, u32); 21] = [
            ("DEVICE_FLAGS_RESET", DEVICE_FLAGS_RESET, 1 << 0),
            ("DEVICE_FLAGS_PCI", DEVICE_FLAGS_PCI, 1 << 1),
            ("REGION_FLAG_READ", REGION_FLAG_READ, 1 << 0),
            ("REGION_FLAG_WRITE", REGION_FLAG_WRITE, 1 << 1),
            ("REGION_FLAG_MMAP", REGION_FLAG_MMAP, 1 << 2),
            ("REGION_FLAG_CAPS", REGION_FLAG_CAPS, 1 << 3),
            ("IRQ_INFO_EVENTFD", IRQ_INFO_EVENTFD, 1 << 0),
            ("IRQ_INFO_MASKABLE", IRQ_INFO_MASKABLE, 1 << 1),
            ("IRQ_INFO_AUTOMASKED", IRQ_INFO_AUTOMASKED, 1 << 2),
            ("IRQ_INFO_NORESIZE", IRQ_INFO_NORESIZE, 1 << 3),
            ("irq_index::INTX", irq_index::INTX, 0),
            ("irq_index::MSI", irq_index::MSI, 1),
            ("irq_index::MSIX", irq_index::MSIX, 2),
            ("irq_index::ERR", irq_index::ERR, 3),
            ("irq_index::REQ", irq_index::REQ, 4),
            ("irq_index::COUNT", irq_index::COUNT, 5),
            ("region_index::BAR0", region_index::BAR0, 0),
            ("region_index::ROM", region_index::ROM, 6),
            ("region_index::CONFIG", region_index::CONFIG, 7),
            ("region_index::VGA", region_index::VGA, 8),
            ("region_index::COUNT", region_index::COUNT, 9),
        ];
        for (name, value, wire) in table {
            assert_eq!(value, wire, "{name}");
        }
    }
}
