//! A minimal guest-side driver for the GPU, shared by the tests, the end-to-end tests and
//! `umdev demo gpu`, so that all of them use the device's own command encoding.
//!
//! It talks to BAR0 through [`RegisterAccess`] and writes the ring through [`GuestRam`]. With
//! the `testing` feature, `crate::testing` implements both over umdev's test harness: BAR0
//! of a `PciAdapter` in-process or of the embedded VMM through the socket, and umdev's
//! memfd-backed `GuestMemory` (also DMA-mapped for the device).

use std::io;
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
