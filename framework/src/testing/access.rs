//! What a guest driver reaches of a device, and the PCI steps every driver takes, written
//! once for both ways a test reaches a device: through the socket ([`super::Vmm`]) or
//! in-process, calling a [`PciAdapter`] directly (device-level tests without a server).
//!
//! A transport implements three calls ([`DeviceAccess::read_bytes`],
//! [`DeviceAccess::write_bytes`], [`DeviceAccess::set_irq_eventfd`]); everything else is
//! provided: little-endian 8/16/32/64-bit accesses, the capability walk, the command
//! register, and enabling MSI, MSI-X or INTx with an eventfd to wait on.

use std::io;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::{irq_index, region_index, Device, IrqAction, IrqData, SetIrqs};
use crate::pci::{PciAdapter, PciDevice};

/// Config-space offset of the command register.
pub const PCI_COMMAND: u64 = 0x04;
/// Command register: memory space decoding.
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: Bus Master Enable.
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Command register: INTx disable.
pub const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Config-space offset of the capability pointer.
pub const PCI_CAPABILITY_LIST: u64 = 0x34;
/// Capability ID of MSI.
pub const PCI_CAP_ID_MSI: u8 = 0x05;
/// Capability ID of MSI-X.
pub const PCI_CAP_ID_MSIX: u8 = 0x11;

/// The message address a guest programs into MSI and MSI-X (x86's interrupt window).
const MSI_ADDRESS: u32 = 0xfee0_0000;
/// The message data of vector 0.
const MSI_DATA: u32 = 0x41;
/// Capability-list entries walked before giving up (a loop in the list is an error).
const MAX_CAPABILITIES: usize = 48;

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// A device as a guest driver sees it: regions by (index, offset), interrupt eventfds.
pub trait DeviceAccess {
    /// Read `data.len()` bytes of `region` at `offset`.
    fn read_bytes(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()>;

    /// Write `data` to `region` at `offset`.
    fn write_bytes(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()>;

    /// Attach `efd` as the trigger of `vector` of IRQ `index` (SET_IRQS, DATA_EVENTFD).
    fn set_irq_eventfd(&mut self, index: u32, vector: u32, efd: &EventFd) -> io::Result<()>;

    /// The byte at `offset` of `region`.
    fn read8(&mut self, region: u32, offset: u64) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_bytes(region, offset, &mut b)?;
        Ok(b[0])
    }

    /// The little-endian u16 at `offset` of `region`.
    fn read16(&mut self, region: u32, offset: u64) -> io::Result<u16> {
        let mut b = [0u8; 2];
        self.read_bytes(region, offset, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// The little-endian u32 at `offset` of `region`.
    fn read32(&mut self, region: u32, offset: u64) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read_bytes(region, offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// The little-endian u64 at `offset` of `region` (one 8-byte access).
    fn read64(&mut self, region: u32, offset: u64) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read_bytes(region, offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Write the byte `v` at `offset` of `region`.
    fn write8(&mut self, region: u32, offset: u64, v: u8) -> io::Result<()> {
        self.write_bytes(region, offset, &[v])
    }

    /// Write `v` little-endian at `offset` of `region`.
    fn write16(&mut self, region: u32, offset: u64, v: u16) -> io::Result<()> {
        self.write_bytes(region, offset, &v.to_le_bytes())
    }

    /// Write `v` little-endian at `offset` of `region`.
    fn write32(&mut self, region: u32, offset: u64, v: u32) -> io::Result<()> {
        self.write_bytes(region, offset, &v.to_le_bytes())
    }

    /// Write `v` little-endian at `offset` of `region` (one 8-byte access).
    fn write64(&mut self, region: u32, offset: u64, v: u64) -> io::Result<()> {
        self.write_bytes(region, offset, &v.to_le_bytes())
    }

    /// Walk the capability list; the config offset of capability `id`, if present.
    fn find_capability(&mut self, id: u8) -> io::Result<Option<u64>> {
        let mut ptr = u64::from(self.read8(region_index::CONFIG, PCI_CAPABILITY_LIST)? & !3);
        for _ in 0..MAX_CAPABILITIES {
            if ptr == 0 {
                return Ok(None);
            }
            let mut hdr = [0u8; 2];
            self.read_bytes(region_index::CONFIG, ptr, &mut hdr)?;
            if hdr[0] == id {
                return Ok(Some(ptr));
            }
            ptr = u64::from(hdr[1] & !3);
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "capability list does not terminate",
        ))
    }

    /// The command register.
    fn command(&mut self) -> io::Result<u16> {
        self.read16(region_index::CONFIG, PCI_COMMAND)
    }

    /// Write the command register.
    fn set_command(&mut self, v: u16) -> io::Result<()> {
        self.write16(region_index::CONFIG, PCI_COMMAND, v)
    }

    /// Enable memory decoding and Bus Master, as a guest driver does at probe (and again
    /// after a reset, which clears them).
    fn enable_device(&mut self) -> io::Result<()> {
        let cmd = self.command()?;
        self.set_command(cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
    }

    /// Attach a fresh non-blocking eventfd as the trigger of vector 0 of IRQ `index`.
    fn attach_eventfd(&mut self, index: u32) -> io::Result<EventFd> {
        let efd = EventFd::new(EFD_NONBLOCK)?;
        self.set_irq_eventfd(index, 0, &efd)?;
        Ok(efd)
    }

    /// Enable MSI with one vector (message address and data programmed, as a guest does)
    /// and return the eventfd its vector 0 signals. Messages are sent only while Bus
    /// Master is set ([`DeviceAccess::enable_device`]), as on PCI.
    fn enable_msi(&mut self) -> io::Result<EventFd> {
        let cap = self
            .find_capability(PCI_CAP_ID_MSI)?
            .ok_or_else(|| errno(libc::ENODEV))?;
        let efd = self.attach_eventfd(irq_index::MSI)?;
        self.write32(region_index::CONFIG, cap + 4, MSI_ADDRESS)?;
        let ctrl = self.read16(region_index::CONFIG, cap + 2)?;
        // Enable, one vector (Multiple Message Enable 0).
        self.write16(region_index::CONFIG, cap + 2, (ctrl | 1) & !0x70)?;
        Ok(efd)
    }

    /// Enable MSI-X (function not masked), program and unmask table entry 0 in the BAR the
    /// capability names, and return the eventfd vector 0 signals. Messages are sent only
    /// while Bus Master is set ([`DeviceAccess::enable_device`]), as on PCI.
    fn enable_msix(&mut self) -> io::Result<EventFd> {
        let cap = self
            .find_capability(PCI_CAP_ID_MSIX)?
            .ok_or_else(|| errno(libc::ENODEV))?;
        let table = self.read32(region_index::CONFIG, cap + 4)?;
        let (bar, entry) = (table & 7, u64::from(table & !7));
        let ctrl = self.read16(region_index::CONFIG, cap + 2)?;
        // Enable (bit 15), Function Mask (bit 14) clear.
        self.write16(region_index::CONFIG, cap + 2, (ctrl | 0x8000) & !0x4000)?;
        self.write32(bar, entry, MSI_ADDRESS)?;
        self.write32(bar, entry + 4, 0)?;
        self.write32(bar, entry + 8, MSI_DATA)?;
        self.write32(bar, entry + 12, 0)?;
        self.attach_eventfd(irq_index::MSIX)
    }

    /// Let the device use INTx (Interrupt Disable clear) and return the eventfd it
    /// signals.
    fn enable_intx(&mut self) -> io::Result<EventFd> {
        let efd = self.attach_eventfd(irq_index::INTX)?;
        let cmd = self.command()?;
        self.set_command(cmd & !PCI_COMMAND_INTX_DISABLE)?;
        Ok(efd)
    }
}

impl<A: DeviceAccess + ?Sized> DeviceAccess for &mut A {
    fn read_bytes(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        (**self).read_bytes(region, offset, data)
    }
    fn write_bytes(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        (**self).write_bytes(region, offset, data)
    }
    fn set_irq_eventfd(&mut self, index: u32, vector: u32, efd: &EventFd) -> io::Result<()> {
        (**self).set_irq_eventfd(index, vector, efd)
    }
}

/// In-process: the calls the server would make, without a socket. Errors are the errno the
/// server would reply with.
impl<D: PciDevice> DeviceAccess for PciAdapter<D> {
    fn read_bytes(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.region_read(region, offset, data)
            .map_err(|e| errno(e.errno()))
    }
    fn write_bytes(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.region_write(region, offset, data)
            .map_err(|e| errno(e.errno()))
    }
    fn set_irq_eventfd(&mut self, index: u32, vector: u32, efd: &EventFd) -> io::Result<()> {
        self.set_irqs(SetIrqs {
            index,
            start: vector,
            count: 1,
            action: IrqAction::Trigger,
            data: IrqData::Eventfd(vec![Some(efd.try_clone()?)]),
        })
        .map_err(|e| errno(e.errno()))
    }
}
