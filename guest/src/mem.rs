//! Guest memory a device can DMA to: locked pages whose guest-physical addresses come from
//! `/proc/self/pagemap` (root sees real frame numbers), or IOVAs the test chose when the
//! memory is mapped through the guest's VFIO (vIOMMU scenarios).
//!
//! The device writes these pages behind the CPU's back, so every access is volatile.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use umdev_devices::gpu::driver::GuestRam;

/// Page size of the addresses handed to devices.
pub const PAGE: usize = 4096;

/// Locked anonymous memory with the device-visible address of each 4 KiB page.
pub struct DmaBuf {
    ptr: *mut u8,
    len: usize,
    addrs: Vec<u64>,
}

// SAFETY: the mapping is owned by this value; all accesses are volatile and bounds-checked.
unsafe impl Send for DmaBuf {}

fn mmap_locked(len: usize, extra: libc::c_int) -> io::Result<*mut u8> {
    // SAFETY: a fresh private anonymous mapping; populated and locked so that the frames
    // stay where pagemap says they are while the device uses them.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE | libc::MAP_LOCKED | extra,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the mapping just created.
    if unsafe { libc::mlock(p, len) } != 0 {
        let e = io::Error::last_os_error();
        // SAFETY: as above.
        unsafe { libc::munmap(p, len) };
        return Err(e);
    }
    Ok(p.cast())
}

/// Guest-physical address of the page holding `va` (needs root).
fn gpa_of(pagemap: &File, va: usize) -> io::Result<u64> {
    let mut e = [0u8; 8];
    pagemap.read_exact_at(&mut e, (va / PAGE * 8) as u64)?;
    let e = u64::from_le_bytes(e);
    if e & (1 << 63) == 0 {
        return Err(io::Error::other(format!("page {va:#x} not present")));
    }
    let pfn = e & ((1 << 55) - 1);
    if pfn == 0 {
        return Err(io::Error::other("pagemap hides frame numbers (not root?)"));
    }
    Ok(pfn * PAGE as u64)
}

impl DmaBuf {
    /// `pages` locked 4 KiB pages (physically scattered in general), zeroed.
    pub fn new(pages: usize) -> io::Result<DmaBuf> {
        let len = pages
            .checked_mul(PAGE)
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "DmaBuf of 0 pages"))?;
        let ptr = mmap_locked(len, 0)?;
        let mut buf = DmaBuf {
            ptr,
            len,
            addrs: Vec::new(),
        };
        buf.addrs = buf.physical_addrs()?;
        Ok(buf)
    }

    /// `len` bytes (a multiple of 2 MiB) of physically contiguous memory from huge pages
    /// (the guest's /init reserves some); for rings and direct transfers.
    pub fn contiguous(len: usize) -> io::Result<DmaBuf> {
        const HUGE: usize = 2 << 20;
        if len == 0 || !len.is_multiple_of(HUGE) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a 2 MiB multiple",
            ));
        }
        let ptr = mmap_locked(len, libc::MAP_HUGETLB)?;
        let mut buf = DmaBuf {
            ptr,
            len,
            addrs: Vec::new(),
        };
        buf.addrs = buf.physical_addrs()?;
        for (i, w) in buf.addrs.windows(2).enumerate() {
            if w[1] != w[0] + PAGE as u64 && !((i + 1) * PAGE).is_multiple_of(HUGE) {
                return Err(io::Error::other("huge page is not physically contiguous"));
            }
        }
        Ok(buf)
    }

    /// Memory the caller will map at IOVAs of its choice (VFIO): the page addresses are
    /// `iova + k * PAGE`.
    pub fn at_iova(pages: usize, iova: u64) -> io::Result<DmaBuf> {
        let len = pages * PAGE;
        let ptr = mmap_locked(len, 0)?;
        Ok(DmaBuf {
            ptr,
            len,
            addrs: (0..pages as u64).map(|k| iova + k * PAGE as u64).collect(),
        })
    }

    fn physical_addrs(&self) -> io::Result<Vec<u64>> {
        let pagemap = File::open("/proc/self/pagemap")?;
        (0..self.len / PAGE)
            .map(|k| gpa_of(&pagemap, self.ptr as usize + k * PAGE))
            .collect()
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Number of 4 KiB pages.
    pub fn pages(&self) -> usize {
        self.len / PAGE
    }

    /// Device-visible address of page `k`.
    pub fn addr(&self, k: usize) -> u64 {
        self.addrs[k]
    }

    /// Device-visible address of byte `off` (must not cross into a page whose address is
    /// not consecutive; see [`DmaBuf::contiguous`]).
    pub fn addr_of(&self, off: usize) -> u64 {
        self.addrs[off / PAGE] + (off % PAGE) as u64
    }

    /// The host virtual address (for VFIO_IOMMU_MAP_DMA).
    pub fn vaddr(&self) -> u64 {
        self.ptr as u64
    }

    fn check(&self, off: usize, len: usize) -> io::Result<()> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{off:#x}+{len:#x} outside a {:#x}-byte buffer", self.len),
            ));
        }
        Ok(())
    }

    /// Copy `data` in at byte `off`.
    pub fn write_at(&self, off: usize, data: &[u8]) -> io::Result<()> {
        self.check(off, data.len())?;
        for (i, &b) in data.iter().enumerate() {
            // SAFETY: inside the mapping (checked); volatile because a device shares it.
            unsafe { std::ptr::write_volatile(self.ptr.add(off + i), b) };
        }
        Ok(())
    }

    /// Copy out `buf.len()` bytes from byte `off`.
    pub fn read_at(&self, off: usize, buf: &mut [u8]) -> io::Result<()> {
        self.check(off, buf.len())?;
        for (i, b) in buf.iter_mut().enumerate() {
            // SAFETY: inside the mapping (checked); volatile because a device shares it.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(off + i)) };
        }
        Ok(())
    }

    /// Fill `len` bytes at `off` with `byte`.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> io::Result<()> {
        self.check(off, len)?;
        for i in 0..len {
            // SAFETY: inside the mapping (checked); volatile because a device shares it.
            unsafe { std::ptr::write_volatile(self.ptr.add(off + i), byte) };
        }
        Ok(())
    }

    /// Read a little-endian u64 at `off`.
    pub fn read_u64(&self, off: usize) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(off, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Page `k`'s offset in the buffer if `addr` lies in it.
    fn offset_of(&self, addr: u64) -> Option<usize> {
        self.addrs
            .iter()
            .position(|&a| addr >= a && addr < a + PAGE as u64)
            .map(|k| k * PAGE + (addr % PAGE as u64) as usize)
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Several buffers seen as guest memory by device address, for the device crates' guest
/// drivers ([`GuestRam`]). Accesses may span pages only where the addresses are consecutive.
pub struct Ram<'a>(pub Vec<&'a DmaBuf>);

impl Ram<'_> {
    fn locate(&self, addr: u64, len: usize) -> io::Result<(&DmaBuf, usize)> {
        for b in &self.0 {
            if let Some(off) = b.offset_of(addr) {
                let last = addr + len.saturating_sub(1) as u64;
                if len <= 1 || b.offset_of(last) == Some(off + len - 1) {
                    return Ok((b, off));
                }
            }
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("guest address {addr:#x}+{len:#x} is not in one contiguous test buffer"),
        ))
    }
}

impl GuestRam for Ram<'_> {
    fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()> {
        let (b, off) = self.locate(gpa, data.len())?;
        b.write_at(off, data)
    }

    fn read(&mut self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        let (b, off) = self.locate(gpa, buf.len())?;
        b.read_at(off, buf)
    }
}
