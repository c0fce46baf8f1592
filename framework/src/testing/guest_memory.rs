//! Guest RAM the way a VMM backs it for QEMU's `memory-backend-memfd,share=on`: a memfd,
//! mapped in this process (umdev's sealed [`SharedMemory`], accessed with volatile copies
//! only, since the device writes it concurrently) and DMA-mapped for the device with its fd.
//!
//! Addresses are guest physical addresses (IOVAs): `base` is where the memory starts.
//! Every access is bounds-checked; outside the memory is `EFAULT`. A `GuestMemory` is cheap
//! to clone: clones share the same memory, so a test can hand one to a guest driver while
//! the VMM keeps another.
//!
//! **The CPU dirty log** stands in for KVM's dirty log, the half of a live migration's RAM
//! tracking that a device's DMA_LOGGING does not cover: while it is on
//! ([`GuestMemory::cpu_dirty_start`]), every write through any clone ([`GuestMemory::write`],
//! [`GuestMemory::fill`], [`GuestMemory::write_u64`]) marks the 4 KiB pages it touched
//! *after* the bytes are copied, and [`GuestMemory::cpu_dirty_take`] reads and clears the
//! bits. A migration driver takes the bits and then copies the pages they name: a write
//! whose mark was taken is already in memory when the copy reads it, and a write whose mark
//! came after the take stays marked for the next pass, so no write is lost. Writes the device makes through its own mapping are not seen
//! here; the server's DMA_LOGGING_REPORT covers those.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};
use std::sync::Arc;

use crate::dma::{DmaMapping, Prot};
use crate::pci::SharedMemory;

/// memfd-backed guest memory at a guest address.
#[derive(Clone, Debug)]
pub struct GuestMemory {
    mem: Arc<SharedMemory>,
    fd: Arc<OwnedFd>,
    base: u64,
    dirty: Arc<CpuDirtyLog>,
}

/// Pages written through [`GuestMemory`] while logging is on: bit n of word n / 64 is the
/// page at offset n × 4096.
#[derive(Debug)]
struct CpuDirtyLog {
    on: AtomicBool,
    bits: Vec<AtomicU64>,
}

impl CpuDirtyLog {
    /// Mark the pages of `[off, off + len)` (in bounds, checked by the caller).
    fn mark(&self, off: u64, len: u64) {
        if len == 0 || !self.on.load(Acquire) {
            return;
        }
        let (first, last) = (off / PAGE, (off + len - 1) / PAGE);
        for page in first..=last {
            if let Some(w) = self.bits.get((page / 64) as usize) {
                w.fetch_or(1 << (page % 64), AcqRel);
            }
        }
    }
}

const PAGE: u64 = 4096;

fn efault() -> io::Error {
    io::Error::from_raw_os_error(libc::EFAULT)
}

impl GuestMemory {
    /// `size` bytes (a multiple of 4 KiB) of zeroed memory at guest address `base`.
    pub fn new(base: u64, size: usize) -> io::Result<GuestMemory> {
        if size == 0 || !size.is_multiple_of(4096) || base.checked_add(size as u64).is_none() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mem = SharedMemory::new("guest-ram", size as u64)?;
        let fd = mem.fd();
        let words = (size as u64 / PAGE).div_ceil(64) as usize;
        Ok(GuestMemory {
            mem: Arc::new(mem),
            fd,
            base,
            dirty: Arc::new(CpuDirtyLog {
                on: AtomicBool::new(false),
                bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
            }),
        })
    }

    /// Start the CPU dirty log with every page clean (see the module doc).
    pub fn cpu_dirty_start(&self) {
        for w in &self.dirty.bits {
            w.store(0, Release);
        }
        self.dirty.on.store(true, Release);
    }

    /// Stop the CPU dirty log.
    pub fn cpu_dirty_stop(&self) {
        self.dirty.on.store(false, Release);
    }

    /// The pages written since the start or the last take (bit n of word n / 64 is the page
    /// at `base() + n × 4096`), cleared as they are read.
    pub fn cpu_dirty_take(&self) -> Vec<u64> {
        self.dirty.bits.iter().map(|w| w.swap(0, AcqRel)).collect()
    }

    /// Guest address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.mem.len() as usize
    }

    /// The memfd (to DMA-map it for the device).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A duplicate of the memfd.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Offset inside the memfd of `[gpa, gpa + len)`, or EFAULT if that is not all inside.
    pub fn offset_of(&self, gpa: u64, len: u64) -> io::Result<u64> {
        gpa.checked_sub(self.base)
            .filter(|&o| o.checked_add(len).is_some_and(|e| e <= self.mem.len()))
            .ok_or_else(efault)
    }

    /// Copy `data` into guest memory at `gpa`.
    pub fn write(&self, gpa: u64, data: &[u8]) -> io::Result<()> {
        let off = self.offset_of(gpa, data.len() as u64)?;
        self.mem.write_at(off, data)?;
        self.dirty.mark(off, data.len() as u64);
        Ok(())
    }

    /// Copy guest memory at `gpa` into `buf`.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        let off = self.offset_of(gpa, buf.len() as u64)?;
        self.mem.read_at(off, buf)
    }

    /// `len` bytes of guest memory at `gpa`.
    pub fn read_vec(&self, gpa: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(gpa, &mut v)?;
        Ok(v)
    }

    /// The little-endian u64 at `gpa`.
    pub fn read_u64(&self, gpa: u64) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Store `v` little-endian at `gpa`.
    pub fn write_u64(&self, gpa: u64, v: u64) -> io::Result<()> {
        self.write(gpa, &v.to_le_bytes())
    }

    /// Fill `[gpa, gpa + len)` with `byte`.
    pub fn fill(&self, gpa: u64, len: usize, byte: u8) -> io::Result<()> {
        let mut off = self.offset_of(gpa, len as u64)?;
        let (start, total) = (off, len as u64);
        let chunk = [byte; 4096];
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            self.mem.write_at(off, &chunk[..n])?;
            off += n as u64;
            left -= n;
        }
        self.dirty.mark(start, total);
        Ok(())
    }

    /// A DMA mapping of `[gpa, gpa + size)` of this memory with `prot`, for a
    /// [`crate::dma::DmaSpace`] driven without a socket (device-level tests).
    pub fn dma_mapping(&self, gpa: u64, size: u64, prot: Prot) -> io::Result<DmaMapping> {
        let offset = self.offset_of(gpa, size)?;
        Ok(DmaMapping {
            iova: gpa,
            size,
            prot,
            fd: Some(self.try_clone_fd()?),
            offset,
        })
    }
}
