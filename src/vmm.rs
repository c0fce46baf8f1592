//! An embedded VMM for demos and tests: connects to a umdev socket with the independent
//! `vfio_user::Client` (rust-vmm), provides memfd-backed "guest RAM" mapped into the
//! device with DMA_MAP, and does what a guest's PCI code would do (enable memory decoding
//! and bus mastering, enable MSI, attach interrupt eventfds).
//!
//! This is test and demo code: it plays the roles that QEMU and the guest kernel play in
//! production, so a newcomer can see a device work without either.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev::device::{irq_index, region_index};
use umdev::pci::SharedMemory;
use umdev_devices::ccw::driver::{
    self as ccw, regs as ccw_regs, CcwWord, OperationBlock, StatusBlock,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// PCI command register bits the VMM sets: memory decoding and bus mastering.
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
const PCI_CAP_PTR: u64 = 0x34;
const PCI_CAP_ID_MSI: u8 = 0x05;
const PCI_CAP_ID_MSIX: u8 = 0x11;

/// VFIO SET_IRQS flags (as the vfio_user client passes them through).
const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
const IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Guest RAM: shared memory (a sealed memfd, [`SharedMemory`]) mapped into this process and,
/// with DMA_MAP, into the device.
pub struct GuestRam {
    mem: SharedMemory,
    base: u64,
}

impl GuestRam {
    /// `size` bytes of zeroed guest RAM at guest physical address `base`.
    pub fn new(base: u64, size: usize) -> io::Result<GuestRam> {
        let mem = SharedMemory::new("guest-ram", size as u64)?;
        Ok(GuestRam { mem, base })
    }

    /// Guest physical address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.mem.len() as usize
    }

    /// The memfd (for DMA_MAP).
    pub fn fd(&self) -> Arc<OwnedFd> {
        self.mem.fd()
    }

    fn offset(&self, gpa: u64) -> io::Result<u64> {
        gpa.checked_sub(self.base)
            .ok_or_else(|| other(format!("gpa {gpa:#x} below guest RAM")))
    }

    /// Copy `data` into guest RAM at `gpa`.
    pub fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()> {
        self.mem.write_at(self.offset(gpa)?, data)
    }

    /// Copy guest RAM at `gpa` into `buf`.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        self.mem.read_at(self.offset(gpa)?, buf)
    }
}

/// The VMM side of a connection: the vfio-user client plus guest RAM.
pub struct Vmm {
    /// The independent vfio-user client.
    pub client: vfio_user::Client,
    /// Guest RAM, DMA-mapped into the device.
    pub ram: GuestRam,
}

impl Vmm {
    /// Connect to `socket` (retrying for up to 5 s while the server starts), create guest
    /// RAM of `size` bytes at `base` and DMA_MAP it read/write.
    pub fn connect(socket: &Path, base: u64, size: usize) -> io::Result<Vmm> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut client = loop {
            match vfio_user::Client::new(socket) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("waiting for server: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(other(format!("connect {}: {e}", socket.display()))),
            }
        };
        let ram = GuestRam::new(base, size)?;
        client
            .dma_map(0, base, size as u64, ram.fd().as_raw_fd())
            .map_err(other)?;
        Ok(Vmm { client, ram })
    }

    /// Read a little-endian u32 from `region` at `offset`.
    pub fn read32(&mut self, region: u32, offset: u64) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.client
            .region_read(region, offset, &mut b)
            .map_err(other)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Write a little-endian u32 to `region` at `offset`.
    pub fn write32(&mut self, region: u32, offset: u64, val: u32) -> io::Result<()> {
        self.client
            .region_write(region, offset, &val.to_le_bytes())
            .map_err(other)
    }

    fn config_read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.client
            .region_read(region_index::CONFIG, offset, buf)
            .map_err(other)
    }

    fn config_write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.client
            .region_write(region_index::CONFIG, offset, data)
            .map_err(other)
    }

    /// Walk the capability list; the config offset of capability `id`.
    pub fn find_capability(&mut self, id: u8) -> io::Result<Option<u64>> {
        let mut b = [0u8; 1];
        self.config_read(PCI_CAP_PTR, &mut b)?;
        let mut ptr = u64::from(b[0] & !3);
        for _ in 0..48 {
            if ptr == 0 {
                return Ok(None);
            }
            let mut hdr = [0u8; 2];
            self.config_read(ptr, &mut hdr)?;
            if hdr[0] == id {
                return Ok(Some(ptr));
            }
            ptr = u64::from(hdr[1] & !3);
        }
        Err(other("capability list does not terminate"))
    }

    /// Enable memory decoding and bus mastering, as a guest driver does at probe.
    pub fn enable_device(&mut self) -> io::Result<()> {
        let mut b = [0u8; 2];
        self.config_read(PCI_COMMAND, &mut b)?;
        let cmd = u16::from_le_bytes(b) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        self.config_write(PCI_COMMAND, &cmd.to_le_bytes())
    }

    /// Attach a fresh non-blocking eventfd to vector 0 of IRQ `index`.
    pub fn irq_eventfd(&mut self, index: u32) -> io::Result<EventFd> {
        let efd = EventFd::new(EFD_NONBLOCK)?;
        self.client
            .set_irqs(
                index,
                IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER,
                0,
                1,
                &[efd.as_raw_fd()],
            )
            .map_err(other)?;
        Ok(efd)
    }

    /// Enable MSI (single vector) in config space and attach an eventfd to it.
    pub fn enable_msi(&mut self) -> io::Result<EventFd> {
        let cap = self
            .find_capability(PCI_CAP_ID_MSI)?
            .ok_or_else(|| other("device has no MSI capability"))?;
        let efd = self.irq_eventfd(irq_index::MSI)?;
        let mut b = [0u8; 2];
        self.config_read(cap + 2, &mut b)?;
        let ctrl = u16::from_le_bytes(b) | 1;
        self.config_write(cap + 2, &ctrl.to_le_bytes())?;
        Ok(efd)
    }

    /// True if the device has an MSI-X capability.
    pub fn has_msix(&mut self) -> io::Result<bool> {
        Ok(self.find_capability(PCI_CAP_ID_MSIX)?.is_some())
    }
}

impl Vmm {
    /// Act as the ccw guest driver: place `program`, an operation block and a status block
    /// at the start of guest RAM (operation block at +0, status at +0x80, program at
    /// +0x100), START it on `block`, wait for the completion interrupt on `irq`, acknowledge
    /// it and return the status block the device stored.
    pub fn run_ccw_program(
        &mut self,
        irq: &EventFd,
        program: &[CcwWord],
        block: u64,
    ) -> io::Result<StatusBlock> {
        let base = self.ram.base();
        let (opb, status, prog) = (base, base + 0x80, base + 0x100);
        self.ram.write(prog, &ccw::encode_program(program))?;
        let ob = OperationBlock {
            program: prog,
            block,
            status,
            flags: 0,
            reserved: 0,
        };
        self.ram.write(opb, &ob.to_bytes())?;
        self.write32(0, ccw_regs::OPB_ADDR_LO, opb as u32)?;
        self.write32(0, ccw_regs::OPB_ADDR_HI, (opb >> 32) as u32)?;
        self.write32(0, ccw_regs::START, 1)?;
        if wait_eventfd(irq, Duration::from_secs(5)).is_none() {
            return Err(other("ccw: no completion interrupt within 5 s"));
        }
        self.write32(0, ccw_regs::IRQ_STATUS, ccw_regs::IRQ_ALL)?;
        let mut sb = [0u8; ccw::STATUS_BLOCK_SIZE];
        self.ram.read(status, &mut sb)?;
        Ok(StatusBlock::from_bytes(&sb))
    }
}

/// Wait until `efd` has been signalled (or `timeout` passes); returns the counter.
pub fn wait_eventfd(efd: &EventFd, timeout: Duration) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        match efd.read() {
            Ok(n) => return Some(n),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return None,
        }
    }
}

impl umdev_devices::gpu::driver::GuestRam for GuestRam {
    fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()> {
        GuestRam::write(self, gpa, data)
    }
    fn read(&mut self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        GuestRam::read(self, gpa, buf)
    }
}

/// BAR0 of the device through the vfio-user client, for the example devices' guest drivers.
pub struct Bar0<'a>(pub &'a mut vfio_user::Client);

impl umdev_devices::gpu::driver::RegisterAccess for Bar0<'_> {
    fn read32(&mut self, off: u64) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.0.region_read(0, off, &mut b).map_err(other)?;
        Ok(u32::from_le_bytes(b))
    }
    fn write32(&mut self, off: u64, val: u32) -> io::Result<()> {
        self.0
            .region_write(0, off, &val.to_le_bytes())
            .map_err(other)
    }
}
