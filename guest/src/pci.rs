//! PCI functions as a guest driver sees them through sysfs: config space through the
//! `config` file, BARs through `resourceN` mmaps, driver binding through `driver_override`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use umdev_devices::gpu::driver::RegisterAccess;

/// Command register bits.
pub mod command {
    /// Memory space decoding.
    pub const MEMORY: u16 = 1 << 1;
    /// Bus Master Enable.
    pub const BUS_MASTER: u16 = 1 << 2;
    /// Interrupt Disable (INTx).
    pub const INTX_DISABLE: u16 = 1 << 10;
}

/// Status register: Interrupt Status (the INTx line is asserted).
pub const STATUS_INTERRUPT: u16 = 1 << 3;

const REG_COMMAND: u64 = 0x04;
const REG_STATUS: u64 = 0x06;

fn read_hex(path: &Path) -> io::Result<u64> {
    let s = std::fs::read_to_string(path)?;
    u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {e}", path.display()),
        )
    })
}

/// One PCI function under /sys/bus/pci/devices.
pub struct PciDev {
    /// Its sysfs directory.
    pub dir: PathBuf,
    /// Its address, e.g. `0000:00:03.0`.
    pub bdf: String,
    config: File,
}

impl PciDev {
    /// Every function with this vendor and device ID, in bus order.
    pub fn find_all(vendor: u16, device: u16) -> io::Result<Vec<PciDev>> {
        let mut found = Vec::new();
        let mut entries: Vec<_> = std::fs::read_dir("/sys/bus/pci/devices")?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .collect();
        entries.sort();
        for dir in entries {
            let v = read_hex(&dir.join("vendor"))?;
            let d = read_hex(&dir.join("device"))?;
            if v == u64::from(vendor) && d == u64::from(device) {
                let config = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(dir.join("config"))?;
                let bdf = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                found.push(PciDev { dir, bdf, config });
            }
        }
        Ok(found)
    }

    /// The one function with this vendor and device ID.
    pub fn find(vendor: u16, device: u16) -> io::Result<PciDev> {
        Self::find_all(vendor, device)?
            .into_iter()
            .next()
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no PCI device {vendor:04x}:{device:04x}"),
                )
            })
    }

    /// Read config space at `off`.
    pub fn config_read(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.config.read_exact_at(buf, off)
    }

    /// Write config space at `off`.
    pub fn config_write(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.config.write_all_at(data, off)
    }

    /// A 16-bit config register.
    pub fn config16(&self, off: u64) -> io::Result<u16> {
        let mut b = [0u8; 2];
        self.config_read(off, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// The command register.
    pub fn command(&self) -> io::Result<u16> {
        self.config16(REG_COMMAND)
    }

    /// Write the command register.
    pub fn set_command(&self, value: u16) -> io::Result<()> {
        self.config_write(REG_COMMAND, &value.to_le_bytes())
    }

    /// Set and clear command register bits (read-modify-write).
    pub fn update_command(&self, set: u16, clear: u16) -> io::Result<u16> {
        let v = (self.command()? | set) & !clear;
        self.set_command(v)?;
        Ok(v)
    }

    /// The status register.
    pub fn status(&self) -> io::Result<u16> {
        self.config16(REG_STATUS)
    }

    /// mmap BAR `n` (its `resourceN` file).
    pub fn bar(&self, n: usize) -> io::Result<Mmio> {
        Mmio::map(&self.dir.join(format!("resource{n}")))
    }

    /// Bind the function to `driver` (through `driver_override`), unbinding it first.
    pub fn bind(&self, driver: &str) -> io::Result<()> {
        if self.dir.join("driver").exists() {
            std::fs::write(self.dir.join("driver/unbind"), &self.bdf)?;
        }
        std::fs::write(self.dir.join("driver_override"), driver)?;
        std::fs::write("/sys/bus/pci/drivers_probe", &self.bdf)?;
        let bound = std::fs::read_link(self.dir.join("driver"))?;
        if bound.file_name().is_some_and(|n| n == driver) {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "{} bound to {} instead of {driver}",
                self.bdf,
                bound.display()
            )))
        }
    }

    /// The IOMMU group number, if the function is behind an IOMMU.
    pub fn iommu_group(&self) -> io::Result<u32> {
        let link = std::fs::read_link(self.dir.join("iommu_group"))?;
        link.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad iommu_group link"))
    }
}

/// A mapped BAR: 32-bit volatile register accesses.
pub struct Mmio {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is device memory owned by this value; accesses are volatile and
// bounds-checked, so sharing the pointer between threads is as safe as sharing the BAR.
unsafe impl Send for Mmio {}

impl Mmio {
    fn map(path: &Path) -> io::Result<Mmio> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let len = f.metadata()?.len() as usize;
        Self::map_fd(&f, 0, len)
    }

    /// mmap `len` bytes of `f` at `offset` (a sysfs resource file or a VFIO device fd).
    pub fn map_fd(f: &impl std::os::fd::AsRawFd, offset: u64, len: usize) -> io::Result<Mmio> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty BAR"));
        }
        // SAFETY: a fresh shared mapping of a device resource; the kernel checks the range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mmio {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    fn at(&self, off: u64, size: usize) -> io::Result<*mut u8> {
        let end = (off as usize).checked_add(size);
        if !off.is_multiple_of(size as u64) || end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("BAR access {off:#x}+{size} outside {:#x} bytes", self.len),
            ));
        }
        // SAFETY: off + size <= len: inside the mapping.
        Ok(unsafe { self.ptr.add(off as usize) })
    }

    /// Read 32 bits at `off`.
    pub fn read32(&self, off: u64) -> io::Result<u32> {
        let p = self.at(off, 4)?;
        // SAFETY: aligned, inside the mapping; device memory needs a volatile access.
        Ok(unsafe { std::ptr::read_volatile(p.cast::<u32>()) })
    }

    /// Write 32 bits at `off`.
    pub fn write32(&self, off: u64, v: u32) -> io::Result<()> {
        let p = self.at(off, 4)?;
        // SAFETY: aligned, inside the mapping; device memory needs a volatile access.
        unsafe { std::ptr::write_volatile(p.cast::<u32>(), v) };
        Ok(())
    }
}

impl Drop for Mmio {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl RegisterAccess for Mmio {
    fn read32(&mut self, off: u64) -> io::Result<u32> {
        Mmio::read32(self, off)
    }

    fn write32(&mut self, off: u64, val: u32) -> io::Result<()> {
        Mmio::write32(self, off, val)
    }
}
