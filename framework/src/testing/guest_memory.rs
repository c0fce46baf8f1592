//! Guest RAM the way a VMM backs it for QEMU's `memory-backend-memfd,share=on`: a memfd,
//! mapped in this process (umdev's sealed [`SharedMemory`], accessed with volatile copies
//! only, since the device writes it concurrently) and DMA-mapped for the device with its fd.
//!
//! Addresses are guest physical addresses (IOVAs): `base` is where the memory starts.
//! Every access is bounds-checked; outside the memory is `EFAULT`. A `GuestMemory` is cheap
//! to clone: clones share the same memory, so a test can hand one to a guest driver while
//! the VMM keeps another.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::dma::{DmaMapping, Prot};
use crate::pci::SharedMemory;

/// memfd-backed guest memory at a guest address.
#[derive(Clone, Debug)]
pub struct GuestMemory {
    mem: Arc<SharedMemory>,
    fd: Arc<OwnedFd>,
    base: u64,
}

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
        Ok(GuestMemory {
            mem: Arc::new(mem),
            fd,
            base,
        })
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
        self.mem.write_at(off, data)
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
        let chunk = [byte; 4096];
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            self.mem.write_at(off, &chunk[..n])?;
            off += n as u64;
            left -= n;
        }
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
