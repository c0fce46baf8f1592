//! The trait the server drives, and the info types a device returns.
//!
//! [`Device`] is addressed by vfio-user region index and offset. PCI devices normally do not
//! implement it directly: they implement [`crate::pci::PciDevice`] and are wrapped in
//! [`crate::pci::PciAdapter`], which answers config space, BAR sizing and MSI/MSI-X itself.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use crate::dma::DmaHandle;

/// vfio-user / VFIO device flag: the device can be reset.
pub const DEVICE_FLAGS_RESET: u32 = 1 << 0;
/// vfio-user / VFIO device flag: this is a PCI device.
pub const DEVICE_FLAGS_PCI: u32 = 1 << 1;

/// Region flag: readable.
pub const REGION_FLAG_READ: u32 = 1 << 0;
/// Region flag: writable.
pub const REGION_FLAG_WRITE: u32 = 1 << 1;
/// Region flag: mmappable (an fd comes with GET_REGION_INFO).
pub const REGION_FLAG_MMAP: u32 = 1 << 2;
/// Region flag: a capability chain follows the region info.
pub const REGION_FLAG_CAPS: u32 = 1 << 3;

/// IRQ info flag: eventfds can be attached.
pub const IRQ_INFO_EVENTFD: u32 = 1 << 0;
/// IRQ info flag: vectors can be masked.
pub const IRQ_INFO_MASKABLE: u32 = 1 << 1;
/// IRQ info flag: the interrupt is masked automatically when it fires (INTx).
pub const IRQ_INFO_AUTOMASKED: u32 = 1 << 2;
/// IRQ info flag: the count cannot be changed after setup.
pub const IRQ_INFO_NORESIZE: u32 = 1 << 3;

/// VFIO PCI IRQ indexes.
pub mod irq_index {
    /// Legacy INTx.
    pub const INTX: u32 = 0;
    /// MSI.
    pub const MSI: u32 = 1;
    /// MSI-X.
    pub const MSIX: u32 = 2;
    /// Error notification.
    pub const ERR: u32 = 3;
    /// Device request.
    pub const REQ: u32 = 4;
    /// Number of PCI IRQ indexes.
    pub const COUNT: u32 = 5;
}

/// VFIO PCI region indexes.
pub mod region_index {
    /// BAR0..BAR5 are 0..=5.
    pub const BAR0: u32 = 0;
    /// Expansion ROM.
    pub const ROM: u32 = 6;
    /// PCI configuration space.
    pub const CONFIG: u32 = 7;
    /// VGA.
    pub const VGA: u32 = 8;
    /// Number of PCI region indexes.
    pub const COUNT: u32 = 9;
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
}
