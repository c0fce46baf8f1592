//! The guest's own VFIO type1 API (`/dev/vfio`), as a user-space driver uses it behind a
//! (virtual) IOMMU: container, group, device fd, regions, interrupts into eventfds,
//! DMA map/unmap at IOVAs the caller chooses.
//!
//! Structs and constants come from the `vfio-bindings` crate. It has no ioctl request
//! numbers, but every VFIO ioctl is `_IO(VFIO_TYPE, VFIO_BASE + n)` (no size, no direction:
//! `argsz` in the struct says how big it is), so the numbers are built from its
//! `VFIO_TYPE` and `VFIO_BASE` below, `n` as in `linux/vfio.h`.
//!
//! Invariants: every ioctl gets a struct whose `argsz` is its own size; a region access is
//! bounds-checked against the region's size before it reaches the device fd.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use umdev_devices::gpu::driver::RegisterAccess;
use vfio_bindings::bindings::vfio::{
    vfio_device_info, vfio_group_status, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap,
    vfio_iommu_type1_info, vfio_irq_info, vfio_irq_set, vfio_region_info, VFIO_TYPE1v2_IOMMU,
    VFIO_API_VERSION, VFIO_BASE, VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE,
    VFIO_GROUP_FLAGS_VIABLE, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_TYPE,
};

use crate::pci::Mmio;

/// `_IO(VFIO_TYPE, VFIO_BASE + nr)`.
const fn vfio_io(nr: u32) -> libc::c_ulong {
    ((VFIO_TYPE as libc::c_ulong) << 8) | (VFIO_BASE + nr) as libc::c_ulong
}

const VFIO_GET_API_VERSION: libc::c_ulong = vfio_io(0);
const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
const VFIO_SET_IOMMU: libc::c_ulong = vfio_io(2);
const VFIO_GROUP_GET_STATUS: libc::c_ulong = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = vfio_io(6);
const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: libc::c_ulong = vfio_io(10);
const VFIO_IOMMU_GET_INFO: libc::c_ulong = vfio_io(12);
const VFIO_IOMMU_MAP_DMA: libc::c_ulong = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = vfio_io(14);

fn argsz<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}

fn os_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// `ioctl(fd, req, arg)`; the return value (≥ 0) or the errno.
///
/// # Safety
/// `arg` must be what `req` expects (a pointer to a live struct of the right type with
/// `argsz` set, or an integer for the ioctls that take one).
unsafe fn ioctl(fd: &impl AsRawFd, req: libc::c_ulong, arg: usize, what: &str) -> io::Result<i32> {
    // SAFETY: the caller's contract.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) };
    if r < 0 {
        Err(os_err(what))
    } else {
        Ok(r)
    }
}

fn open_rw(path: &str) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// A VFIO container (`/dev/vfio/vfio`): the IOMMU context DMA maps live in.
pub struct Container {
    file: File,
}

impl Container {
    /// Open the container and check the API version and type1v2 support.
    pub fn open() -> io::Result<Container> {
        let file = open_rw("/dev/vfio/vfio")?;
        // SAFETY: GET_API_VERSION takes no argument.
        let v = unsafe { ioctl(&file, VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION")? };
        if v as u32 != VFIO_API_VERSION {
            return Err(io::Error::other(format!("VFIO API version {v}")));
        }
        // SAFETY: CHECK_EXTENSION takes the extension number by value.
        let has = unsafe {
            ioctl(
                &file,
                VFIO_CHECK_EXTENSION,
                VFIO_TYPE1v2_IOMMU as usize,
                "VFIO_CHECK_EXTENSION",
            )?
        };
        if has <= 0 {
            return Err(io::Error::other("the container has no VFIO_TYPE1v2_IOMMU"));
        }
        Ok(Container { file })
    }

    /// Select the type1v2 IOMMU (after a group was added).
    pub fn set_type1v2(&self) -> io::Result<()> {
        // SAFETY: SET_IOMMU takes the IOMMU type by value.
        unsafe {
            ioctl(
                &self.file,
                VFIO_SET_IOMMU,
                VFIO_TYPE1v2_IOMMU as usize,
                "VFIO_SET_IOMMU(TYPE1v2)",
            )?
        };
        Ok(())
    }

    /// `(flags, iova_pgsizes)` of the IOMMU.
    pub fn iommu_info(&self) -> io::Result<(u32, u64)> {
        let mut info = vfio_iommu_type1_info {
            argsz: argsz::<vfio_iommu_type1_info>(),
            ..Default::default()
        };
        // SAFETY: a live vfio_iommu_type1_info with its argsz.
        unsafe {
            ioctl(
                &self.file,
                VFIO_IOMMU_GET_INFO,
                &mut info as *mut _ as usize,
                "VFIO_IOMMU_GET_INFO",
            )?
        };
        Ok((info.flags, info.iova_pgsizes))
    }

    /// VFIO_IOMMU_MAP_DMA of `size` bytes of this process's memory at `vaddr` to `iova`,
    /// readable and writable by the device. The kernel pins the pages.
    pub fn map_dma(&self, vaddr: u64, iova: u64, size: u64) -> io::Result<()> {
        let mut m = vfio_iommu_type1_dma_map {
            argsz: argsz::<vfio_iommu_type1_dma_map>(),
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr,
            iova,
            size,
        };
        // SAFETY: a live vfio_iommu_type1_dma_map with its argsz; the kernel checks that
        // the user range is mapped in this process.
        unsafe {
            ioctl(
                &self.file,
                VFIO_IOMMU_MAP_DMA,
                &mut m as *mut _ as usize,
                &format!("VFIO_IOMMU_MAP_DMA iova={iova:#x} size={size:#x}"),
            )?
        };
        Ok(())
    }

    /// VFIO_IOMMU_UNMAP_DMA of `[iova, iova + size)`; returns the bytes the kernel says it
    /// unmapped (type1v2: every mapping the range covers).
    pub fn unmap_dma(&self, iova: u64, size: u64) -> io::Result<u64> {
        let mut u = vfio_iommu_type1_dma_unmap {
            argsz: argsz::<vfio_iommu_type1_dma_unmap>(),
            flags: 0,
            iova,
            size,
            ..Default::default()
        };
        // SAFETY: a live vfio_iommu_type1_dma_unmap with its argsz (no bitmap flag, so
        // the kernel reads no data after it).
        unsafe {
            ioctl(
                &self.file,
                VFIO_IOMMU_UNMAP_DMA,
                &mut u as *mut _ as usize,
                &format!("VFIO_IOMMU_UNMAP_DMA iova={iova:#x} size={size:#x}"),
            )?
        };
        Ok(u.size)
    }
}

/// A VFIO group (`/dev/vfio/N`).
pub struct Group {
    file: File,
}

impl Group {
    /// Open group `n`; it must be viable (every device in it bound to vfio or no driver).
    pub fn open(n: u32) -> io::Result<Group> {
        let file = open_rw(&format!("/dev/vfio/{n}"))?;
        let mut st = vfio_group_status {
            argsz: argsz::<vfio_group_status>(),
            flags: 0,
        };
        // SAFETY: a live vfio_group_status with its argsz.
        unsafe {
            ioctl(
                &file,
                VFIO_GROUP_GET_STATUS,
                &mut st as *mut _ as usize,
                "VFIO_GROUP_GET_STATUS",
            )?
        };
        if st.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(io::Error::other(format!(
                "VFIO group {n} is not viable (flags {:#x})",
                st.flags
            )));
        }
        Ok(Group { file })
    }

    /// Add the group to `c`.
    pub fn set_container(&self, c: &Container) -> io::Result<()> {
        let fd: libc::c_int = c.file.as_raw_fd();
        // SAFETY: SET_CONTAINER takes a pointer to the container's fd.
        unsafe {
            ioctl(
                &self.file,
                VFIO_GROUP_SET_CONTAINER,
                &fd as *const _ as usize,
                "VFIO_GROUP_SET_CONTAINER",
            )?
        };
        Ok(())
    }

    /// The device fd of `bdf` (e.g. `0000:00:03.0`).
    pub fn device(&self, bdf: &str) -> io::Result<Device> {
        let name = CString::new(bdf).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: GET_DEVICE_FD takes a NUL-terminated name.
        let fd = unsafe {
            ioctl(
                &self.file,
                VFIO_GROUP_GET_DEVICE_FD,
                name.as_ptr() as usize,
                "VFIO_GROUP_GET_DEVICE_FD",
            )?
        };
        // SAFETY: the ioctl returned a new fd that nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Device { file })
    }
}

/// One region of a device (BAR, config space) as VFIO_DEVICE_GET_REGION_INFO reports it.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// Region index (`VFIO_PCI_*_REGION_INDEX`).
    pub index: u32,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in the device fd.
    pub offset: u64,
}

/// A VFIO device fd.
pub struct Device {
    file: File,
}

/// One `vfio_irq_set` with one eventfd after it, as VFIO_DEVICE_SET_IRQS reads it.
#[repr(C)]
struct IrqSetOne {
    set: vfio_irq_set,
    fd: i32,
}

const _: () = assert!(
    std::mem::offset_of!(IrqSetOne, fd) == std::mem::offset_of!(vfio_irq_set, data)
        && std::mem::size_of::<vfio_irq_set>() == std::mem::offset_of!(vfio_irq_set, data)
);

impl Device {
    /// VFIO_DEVICE_GET_INFO.
    pub fn info(&self) -> io::Result<vfio_device_info> {
        let mut info = vfio_device_info {
            argsz: argsz::<vfio_device_info>(),
            ..Default::default()
        };
        // SAFETY: a live vfio_device_info with its argsz.
        unsafe {
            ioctl(
                &self.file,
                VFIO_DEVICE_GET_INFO,
                &mut info as *mut _ as usize,
                "VFIO_DEVICE_GET_INFO",
            )?
        };
        Ok(info)
    }

    /// VFIO_DEVICE_GET_REGION_INFO of region `index` (capabilities are not read).
    pub fn region(&self, index: u32) -> io::Result<Region> {
        let mut info = vfio_region_info {
            argsz: argsz::<vfio_region_info>(),
            index,
            ..Default::default()
        };
        // SAFETY: a live vfio_region_info with its argsz; with argsz = the bare struct the
        // kernel writes no capability chain after it.
        unsafe {
            ioctl(
                &self.file,
                VFIO_DEVICE_GET_REGION_INFO,
                &mut info as *mut _ as usize,
                &format!("VFIO_DEVICE_GET_REGION_INFO({index})"),
            )?
        };
        Ok(Region {
            index,
            flags: info.flags,
            size: info.size,
            offset: info.offset,
        })
    }

    /// VFIO_DEVICE_GET_IRQ_INFO of IRQ index `index`: `(flags, count)`.
    pub fn irq_info(&self, index: u32) -> io::Result<(u32, u32)> {
        let mut info = vfio_irq_info {
            argsz: argsz::<vfio_irq_info>(),
            index,
            ..Default::default()
        };
        // SAFETY: a live vfio_irq_info with its argsz.
        unsafe {
            ioctl(
                &self.file,
                VFIO_DEVICE_GET_IRQ_INFO,
                &mut info as *mut _ as usize,
                &format!("VFIO_DEVICE_GET_IRQ_INFO({index})"),
            )?
        };
        Ok((info.flags, info.count))
    }

    /// Route vector 0 of IRQ index `index` (MSI-X, MSI) into `efd` (enables it).
    pub fn set_irq_eventfd(&self, index: u32, efd: &EventFd) -> io::Result<()> {
        let mut s = IrqSetOne {
            set: vfio_irq_set {
                argsz: argsz::<IrqSetOne>(),
                flags: VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                index,
                start: 0,
                count: 1,
                ..Default::default()
            },
            fd: efd.fd.as_raw_fd(),
        };
        // SAFETY: a vfio_irq_set followed by `count` (1) eventfds, argsz covering both.
        unsafe {
            ioctl(
                &self.file,
                VFIO_DEVICE_SET_IRQS,
                &mut s as *mut _ as usize,
                &format!("VFIO_DEVICE_SET_IRQS({index}, eventfd)"),
            )?
        };
        Ok(())
    }

    /// Disable every vector of IRQ index `index`.
    pub fn disable_irqs(&self, index: u32) -> io::Result<()> {
        let mut s = vfio_irq_set {
            argsz: argsz::<vfio_irq_set>(),
            flags: VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            index,
            start: 0,
            count: 0,
            ..Default::default()
        };
        // SAFETY: a live vfio_irq_set with its argsz and no data (count 0).
        unsafe {
            ioctl(
                &self.file,
                VFIO_DEVICE_SET_IRQS,
                &mut s as *mut _ as usize,
                &format!("VFIO_DEVICE_SET_IRQS({index}, off)"),
            )?
        };
        Ok(())
    }

    fn region_check(r: &Region, off: u64, len: usize) -> io::Result<u64> {
        off.checked_add(len as u64)
            .filter(|&e| e <= r.size)
            .and_then(|_| r.offset.checked_add(off))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "access {off:#x}+{len} outside region {} ({:#x} bytes)",
                        r.index, r.size
                    ),
                )
            })
    }

    /// pread from region `r` at `off`.
    pub fn read_region(&self, r: &Region, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let at = Self::region_check(r, off, buf.len())?;
        self.file.read_exact_at(buf, at)
    }

    /// pwrite to region `r` at `off`.
    pub fn write_region(&self, r: &Region, off: u64, data: &[u8]) -> io::Result<()> {
        let at = Self::region_check(r, off, data.len())?;
        self.file.write_all_at(data, at)
    }

    /// The config space region.
    pub fn config(&self) -> io::Result<Region> {
        self.region(VFIO_PCI_CONFIG_REGION_INDEX)
    }

    /// Set and clear bits of the PCI command register through the config region;
    /// returns the value read back afterwards.
    pub fn update_command(&self, set: u16, clear: u16) -> io::Result<u16> {
        let cfg = self.config()?;
        let mut b = [0u8; 2];
        self.read_region(&cfg, 4, &mut b)?;
        let v = (u16::from_le_bytes(b) | set) & !clear;
        self.write_region(&cfg, 4, &v.to_le_bytes())?;
        self.read_region(&cfg, 4, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// BAR region `r` for 32-bit register access: an mmap of the device fd if the kernel
    /// allows it, else pread/pwrite.
    pub fn bar(&self, r: Region) -> io::Result<Bar> {
        let len = usize::try_from(r.size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "BAR too large"))?;
        if r.flags & vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_MMAP != 0 {
            if let Ok(m) = Mmio::map_fd(&self.file, r.offset, len) {
                return Ok(Bar::Mapped(m));
            }
        }
        Ok(Bar::Syscall {
            file: self.file.try_clone()?,
            region: r,
        })
    }
}

/// A BAR of a VFIO device, for the device crates' guest drivers.
pub enum Bar {
    /// mmap of the device fd at the region's offset: one trapped access per register.
    Mapped(Mmio),
    /// pread/pwrite of the device fd (one syscall per register).
    Syscall {
        /// A duplicate of the device fd.
        file: File,
        /// The region.
        region: Region,
    },
}

impl Bar {
    /// How registers are reached (for the log).
    pub fn how(&self) -> &'static str {
        match self {
            Bar::Mapped(_) => "mmap",
            Bar::Syscall { .. } => "pread/pwrite",
        }
    }
}

impl RegisterAccess for Bar {
    fn read32(&mut self, off: u64) -> io::Result<u32> {
        match self {
            Bar::Mapped(m) => m.read32(off),
            Bar::Syscall { file, region } => {
                let at = Device::region_check(region, off, 4)?;
                let mut b = [0u8; 4];
                file.read_exact_at(&mut b, at)?;
                Ok(u32::from_le_bytes(b))
            }
        }
    }

    fn write32(&mut self, off: u64, val: u32) -> io::Result<()> {
        match self {
            Bar::Mapped(m) => m.write32(off, val),
            Bar::Syscall { file, region } => {
                let at = Device::region_check(region, off, 4)?;
                file.write_all_at(&val.to_le_bytes(), at)
            }
        }
    }
}

/// An eventfd interrupts are routed into.
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A non-blocking eventfd.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: creates a new fd.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(os_err("eventfd"));
        }
        // SAFETY: a new fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// Wait up to `timeout` for the counter to become non-zero; returns the counter (the
    /// number of interrupts since the last wait) and resets it; 0 on timeout.
    pub fn wait(&self, timeout: Duration) -> io::Result<u64> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            return Err(os_err("poll(eventfd)"));
        }
        if n == 0 {
            return Ok(0);
        }
        self.take()
    }

    /// Read and reset the counter without waiting (0 if nothing arrived).
    pub fn take(&self) -> io::Result<u64> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            return Ok(v);
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(io::Error::new(e.kind(), format!("read(eventfd): {e}")))
        }
    }
}
