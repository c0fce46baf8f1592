//! A minimal guest-side driver for the GPU, shared by the tests, the end-to-end tests and
//! `umdev demo gpu`, so that all of them use the device's own command encoding.
//!
//! It talks to BAR0 through [`RegisterAccess`] (a `PciAdapter` in device tests, a vfio-user
//! client in end-to-end tests) and writes the ring through [`GuestRam`] (e.g. a
//! [`GuestMemfd`], memfd-backed guest memory that is also DMA-mapped for the device).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::commands::Command;
use super::regs::*;

/// 32-bit access to BAR0.
pub trait RegisterAccess {
    /// Read the register at `off`.
    fn read32(&mut self, off: u64) -> io::Result<u32>;
    /// Write the register at `off`.
    fn write32(&mut self, off: u64, val: u32) -> io::Result<()>;
    /// Write a 64-bit GTT entry (default: high dword first, then the low dword that holds
    /// the VALID bit).
    fn write64(&mut self, off: u64, val: u64) -> io::Result<()> {
        self.write32(off + 4, (val >> 32) as u32)?;
        self.write32(off, val as u32)
    }
}

/// Guest memory as the guest driver sees it (by guest physical / IOVA address).
pub trait GuestRam {
    /// Write `data` at `gpa`.
    fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()>;
    /// Read `buf.len()` bytes at `gpa`.
    fn read(&mut self, gpa: u64, buf: &mut [u8]) -> io::Result<()>;
}

fn timeout_err(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("gpu driver: timed out {what}"),
    )
}

/// The guest driver: mode set, GTT, ring submission, fences.
pub struct Driver<R: RegisterAccess> {
    regs: R,
    ring_base: u64,
    ring_size: u32,
    tail: u32,
    timeout: Duration,
}

impl<R: RegisterAccess> Driver<R> {
    /// A driver over `regs`; checks the ID register.
    pub fn probe(mut regs: R) -> io::Result<Driver<R>> {
        let id = regs.read32(REG_ID)?;
        if id != ID_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("gpu driver: bad ID {id:#x}"),
            ));
        }
        Ok(Driver {
            regs,
            ring_base: 0,
            ring_size: 0,
            tail: 0,
            timeout: Duration::from_secs(5),
        })
    }

    /// The register access (for raw register pokes).
    pub fn regs(&mut self) -> &mut R {
        &mut self.regs
    }

    /// Read a register.
    pub fn read(&mut self, off: u64) -> io::Result<u32> {
        self.regs.read32(off)
    }

    /// Write a register.
    pub fn write(&mut self, off: u64, val: u32) -> io::Result<()> {
        self.regs.write32(off, val)
    }

    /// Set and enable an XRGB8888 mode; fails if the device rejects it.
    pub fn set_mode(&mut self, width: u32, height: u32, stride: u32) -> io::Result<()> {
        self.regs.write32(REG_MODE_CTRL, 0)?;
        self.regs.write32(REG_MODE_WIDTH, width)?;
        self.regs.write32(REG_MODE_HEIGHT, height)?;
        self.regs.write32(REG_MODE_STRIDE, stride)?;
        self.regs.write32(REG_MODE_FORMAT, FORMAT_XRGB8888)?;
        self.regs.write32(REG_MODE_CTRL, 1)?;
        if self.regs.read32(REG_MODE_CTRL)? & 1 == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "gpu driver: mode rejected",
            ));
        }
        Ok(())
    }

    /// Enable interrupt causes (`IRQ_*`).
    pub fn enable_irqs(&mut self, bits: u32) -> io::Result<()> {
        self.regs.write32(REG_IRQ_ENABLE, bits)
    }

    /// Acknowledge interrupt causes.
    pub fn ack(&mut self, bits: u32) -> io::Result<()> {
        self.regs.write32(REG_IRQ_ACK, bits)
    }

    /// `(ERROR_CODE, ERROR_INFO)`.
    pub fn error(&mut self) -> io::Result<(u32, u32)> {
        Ok((
            self.regs.read32(REG_ERROR_CODE)?,
            self.regs.read32(REG_ERROR_INFO)?,
        ))
    }

    /// Configure and enable the ring at `base` (`size` bytes, power of two).
    pub fn setup_ring(&mut self, base: u64, size: u32) -> io::Result<()> {
        self.regs.write32(REG_RING_CTRL, 0)?;
        self.regs.write32(REG_RING_BASE_LO, base as u32)?;
        self.regs.write32(REG_RING_BASE_HI, (base >> 32) as u32)?;
        self.regs.write32(REG_RING_SIZE, size)?;
        self.regs.write32(REG_RING_CTRL, 1)?;
        if self.regs.read32(REG_RING_CTRL)? & 1 == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "gpu driver: ring rejected",
            ));
        }
        self.ring_base = base;
        self.ring_size = size;
        self.tail = 0;
        Ok(())
    }

    /// Point GTT entry `index` at the guest page `gpa` (page aligned).
    pub fn set_gtt(&mut self, index: u32, gpa: u64, writable: bool) -> io::Result<()> {
        let mut e = (gpa & GTT_ADDR_MASK) | GTT_VALID;
        if writable {
            e |= GTT_WRITABLE;
        }
        self.regs.write64(GTT_BASE + u64::from(index) * 8, e)
    }

    /// Invalidate GTT entries `start..start+count` with one batch invalidation (the device
    /// drops its pins on them in one array call).
    pub fn clear_gtt(&mut self, start: u32, count: u32) -> io::Result<()> {
        self.regs.write32(REG_GTT_INVAL_START, start)?;
        self.regs.write32(REG_GTT_INVAL_COUNT, count)
    }

    /// Write `cmds` into the ring and publish them with one doorbell. Waits for ring space.
    pub fn submit(&mut self, mem: &mut dyn GuestRam, cmds: &[Command]) -> io::Result<()> {
        let bytes = Command::encode_bytes(cmds);
        let size = self.ring_size as usize;
        if size == 0 || bytes.len() > size - 4 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "gpu driver: commands do not fit the ring",
            ));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let head = self.regs.read32(REG_RING_HEAD)?;
            let used = (self.tail.wrapping_sub(head) & (self.ring_size - 1)) as usize;
            if size - 4 - used >= bytes.len() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(timeout_err("waiting for ring space"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let tail = self.tail as usize;
        let first = bytes.len().min(size - tail);
        mem.write(self.ring_base + tail as u64, &bytes[..first])?;
        if first < bytes.len() {
            mem.write(self.ring_base, &bytes[first..])?;
        }
        self.tail = ((tail + bytes.len()) % size) as u32;
        self.regs.write32(REG_RING_TAIL, self.tail)
    }

    /// Poll until `FENCE_VALUE == value`.
    pub fn wait_fence(&mut self, value: u32) -> io::Result<()> {
        let deadline = Instant::now() + self.timeout;
        while self.regs.read32(REG_FENCE_VALUE)? != value {
            if Instant::now() >= deadline {
                return Err(timeout_err("waiting for a fence"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// Poll until the device has executed everything published (`RING_HEAD == tail`).
    pub fn wait_idle(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + self.timeout;
        while self.regs.read32(REG_RING_HEAD)? != self.tail {
            if Instant::now() >= deadline {
                return Err(timeout_err("waiting for the ring to drain"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

/// memfd-backed guest memory at guest address `base`, mapped in this process too.
pub struct GuestMemfd {
    fd: OwnedFd,
    ptr: *mut u8,
    base: u64,
    size: usize,
}

// SAFETY: the mapping is owned by this value and only reached through raw copies.
unsafe impl Send for GuestMemfd {}

impl GuestMemfd {
    /// `size` bytes (page multiple) of zeroed memory at guest address `base`.
    pub fn new(base: u64, size: usize) -> io::Result<GuestMemfd> {
        if size == 0 || !size.is_multiple_of(4096) || base.checked_add(size as u64).is_none() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: the name is a valid NUL-terminated C string; flags are valid.
        let raw = unsafe { libc::memfd_create(c"umdev-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of `size` bytes of our memfd; no existing memory is
        // affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(GuestMemfd {
            fd,
            ptr: ptr.cast(),
            base,
            size,
        })
    }

    /// Guest address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The memfd (to DMA-map it for the device).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A duplicate of the memfd.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    fn offset(&self, gpa: u64, len: usize) -> io::Result<usize> {
        let off = gpa.checked_sub(self.base).filter(|&o| {
            o.checked_add(len as u64)
                .is_some_and(|e| e <= self.size as u64)
        });
        off.map(|o| o as usize)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))
    }

    /// Fill `[gpa, gpa + len)` with `byte`.
    pub fn fill(&mut self, gpa: u64, len: usize, byte: u8) -> io::Result<()> {
        let off = self.offset(gpa, len)?;
        // SAFETY: `off + len <= size` was checked; the mapping is alive and writable.
        unsafe { std::ptr::write_bytes(self.ptr.add(off), byte, len) };
        Ok(())
    }
}

impl GuestRam for GuestMemfd {
    fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()> {
        let off = self.offset(gpa, data.len())?;
        // SAFETY: bounds checked; the mapping is alive and writable; `data` is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
        Ok(())
    }

    fn read(&mut self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        let off = self.offset(gpa, buf.len())?;
        // SAFETY: bounds checked; the mapping is alive and readable; `buf` is ours.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
}

impl Drop for GuestMemfd {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`size` are exactly the mapping created in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.size) };
    }
}
