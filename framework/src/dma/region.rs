//! One DMA mapping: its range, permission, host mapping (if fd-backed), pin table, dirty
//! log, and the in-flight counter that lets unmap wait for accesses to finish.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;

use arc_swap::ArcSwapOption;

use super::dirty::DirtyBitmap;
use super::pin_table::PinTable;
use super::{Prot, PAGE_SHIFT};

/// An owned `mmap` of client memory (or, after a forced release, of scratch memory);
/// unmapped on drop.
pub(crate) struct HostMem {
    addr: *mut libc::c_void,
    /// Length of the whole VMA: the mapped length rounded up to the file's page size (mmap
    /// rounds a hugetlbfs length up to the huge page size, and munmap / `MAP_FIXED` over a
    /// hugetlb VMA need huge-page-aligned bounds).
    len: usize,
    /// SIGBUS protection of the range (a client shrinking the file); released before unmap.
    sigbus: Option<super::sigbus::Registration>,
    /// Its share of the process's map budget; released after the munmap (field drop).
    charge: Option<super::budget::MapCharge>,
}

// SAFETY: HostMem is only an owned address range; it is never dereferenced through this
// type, and munmap may be called from any thread.
unsafe impl Send for HostMem {}

impl HostMem {
    /// `mmap(MAP_SHARED)` `len` bytes of `fd` at `offset` with `prot`, protected against a
    /// shrinking file (see `sigbus`). On hugetlbfs, `offset` must be a multiple of the huge
    /// page size (else EINVAL) and the mapping covers `len` rounded up to it.
    pub(crate) fn map_fd(
        fd: BorrowedFd<'_>,
        len: usize,
        offset: u64,
        prot: Prot,
    ) -> io::Result<Self> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let page_size = file_page_size(fd)?;
        let len = len
            .checked_next_multiple_of(page_size)
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let prot = prot_bits(prot);
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL, no MAP_FIXED): it cannot
        // alias any Rust object; the fd is valid for the call.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let sigbus = super::sigbus::register(addr as usize, len, page_size, prot);
        Ok(HostMem {
            addr,
            len,
            sigbus,
            charge: None,
        })
    }

    /// Keep `charge` (this mapping's share of the map budget) until the range is unmapped.
    pub(crate) fn hold(&mut self, charge: super::budget::MapCharge) {
        self.charge = Some(charge);
    }

    /// Start address.
    pub(crate) fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Replace the whole range, in place, with private anonymous zero memory, dropping this
    /// process's reference to the client's pages. Used when a device left pins behind at
    /// unmap: its stale host addresses keep pointing at valid (scratch) memory that aliases
    /// neither guest memory nor any other allocation. On failure the original mapping stays.
    pub(crate) fn replace_with_scratch(&self) -> io::Result<()> {
        // SAFETY: MAP_FIXED over a range this HostMem owns exclusively (no other mapping can
        // live there); no Rust reference points into it (guest memory is only accessed by raw
        // copies, and in-flight accesses were waited for by the caller).
        let addr = unsafe {
            libc::mmap(
                self.addr,
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // Unregister first: once unmapped, the range may be reused by someone else.
        drop(self.sigbus.take());
        // SAFETY: the range was mapped by us and is owned by this value only; callers drop it
        // only once no access can be in flight (see DmaSpace::unmap).
        let rc = unsafe { libc::munmap(self.addr, self.len) };
        if rc != 0 {
            tracing::error!(addr = ?self.addr, len = self.len, err = %io::Error::last_os_error(), "munmap of a DMA mapping failed");
        }
    }
}

/// Page size of a `MAP_SHARED` mapping of `fd`: the huge page size on hugetlbfs, else the
/// system page size.
fn file_page_size(fd: BorrowedFd<'_>) -> io::Result<usize> {
    // SAFETY: fstatfs writes into the zeroed struct we pass; the fd is valid for the call.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let size = if fs.f_type as u32 == libc::HUGETLBFS_MAGIC as u32 {
        // hugetlbfs reports its huge page size as the block size.
        usize::try_from(fs.f_bsize).unwrap_or(0)
    } else {
        // SAFETY: sysconf has no memory-safety preconditions.
        usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(0)
    };
    if !size.is_power_of_two() || size < super::PAGE_SIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(size)
}

/// mmap protection bits of a [`Prot`].
pub(crate) fn prot_bits(prot: Prot) -> libc::c_int {
    let mut bits = libc::PROT_NONE;
    if prot.read {
        bits |= libc::PROT_READ;
    }
    if prot.write {
        bits |= libc::PROT_WRITE;
    }
    bits
}

/// One DMA mapping.
pub(crate) struct Region {
    /// First IOVA.
    pub(crate) iova: u64,
    /// Size in bytes (multiple of the page size).
    pub(crate) size: u64,
    /// One past the last IOVA (`iova + size`, checked at map time).
    pub(crate) end: u64,
    /// First IOVA page number.
    pub(crate) start_pfn: u64,
    /// One past the last IOVA page number.
    pub(crate) end_pfn: u64,
    /// Permission granted by the client.
    pub(crate) prot: Prot,
    /// Host address of `iova`, or 0 for an fd-less mapping.
    pub(crate) host: u64,
    /// The owned mapping; taken by unmap.
    pub(crate) mem: Mutex<Option<HostMem>>,
    /// Per-page pin state.
    pub(crate) pins: PinTable,
    /// Set (under the pin lock) when unmap starts: no new pins.
    pub(crate) closing: AtomicBool,
    /// Set when the region left the map table: no new accesses.
    pub(crate) removed: AtomicBool,
    /// Accesses currently in flight: dma_rw copies, and DMA_READ/DMA_WRITE pieces of an
    /// fd-less region waiting for the client.
    pub(crate) inflight: AtomicU64,
    /// Dirty log while logging is on.
    pub(crate) dirty: ArcSwapOption<DirtyBitmap>,
}

impl Region {
    /// A region for `[iova, iova + size)`, validated by the caller.
    pub(crate) fn new(iova: u64, size: u64, prot: Prot, mem: Option<HostMem>) -> Region {
        let end = iova + size;
        // An fd-less mapping can never be pinned: no pin state at all, whatever its size.
        let pin_pages = if mem.is_some() { size >> PAGE_SHIFT } else { 0 };
        Region {
            iova,
            size,
            end,
            start_pfn: iova >> PAGE_SHIFT,
            end_pfn: end >> PAGE_SHIFT,
            prot,
            host: mem.as_ref().map_or(0, HostMem::addr),
            mem: Mutex::new(mem),
            pins: PinTable::new(pin_pages),
            closing: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            dirty: ArcSwapOption::empty(),
        }
    }

    /// True for a mapping the client sent without an fd.
    #[inline]
    pub(crate) fn is_fdless(&self) -> bool {
        self.host == 0
    }

    /// Register an access to the host mapping; `None` if the region is being removed.
    #[inline]
    pub(crate) fn enter(&self) -> Option<InflightGuard<'_>> {
        self.inflight.fetch_add(1, SeqCst);
        let guard = InflightGuard { region: self };
        if self.removed.load(SeqCst) {
            return None; // guard drops and decrements
        }
        Some(guard)
    }

    /// Mark removed and wait until no access is in flight (pairs with [`Region::enter`]).
    pub(crate) fn remove_and_drain(&self) {
        self.remove_and_drain_cancelling(|| {});
    }

    /// As [`Region::remove_and_drain`], calling `cancel` while accesses are still in
    /// flight: once before the first wait, then before every sleep. For an fd-less region
    /// it fails the DMA_READ/DMA_WRITE pieces waiting for the client (`RemoteDma::cancel`);
    /// a piece that entered before `removed` was set but registered its request after a
    /// call is caught by a later call, since the loop only ends when the count is 0.
    pub(crate) fn remove_and_drain_cancelling(&self, mut cancel: impl FnMut()) {
        self.removed.store(true, SeqCst);
        let mut spins = 0u32;
        while self.inflight.load(SeqCst) != 0 {
            spins = spins.saturating_add(1);
            if spins == 1 {
                cancel();
            }
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 1024 {
                std::thread::yield_now();
            } else {
                cancel();
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// An access in flight; decrements the counter on drop.
pub(crate) struct InflightGuard<'a> {
    region: &'a Region,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.region.inflight.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    fn memfd(flags: libc::c_uint) -> Option<OwnedFd> {
        // SAFETY: memfd_create with a static NUL-terminated name; checked.
        let fd = unsafe { libc::memfd_create(c"umdev-page-size".as_ptr(), flags) };
        // SAFETY: a fresh fd we own.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }

    #[test]
    fn test_file_page_size_hugetlb_memfd_is_huge_page_size() {
        let plain = memfd(libc::MFD_CLOEXEC).unwrap();
        // SAFETY: sysconf has no memory-safety preconditions.
        let system = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        assert_eq!(file_page_size(plain.as_fd()).unwrap(), system);
        // Creating a hugetlb memfd needs no free huge page (mapping it does).
        let Some(huge) = memfd(libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB) else {
            println!(
                "SKIPPED hugetlb part: memfd_create(MFD_HUGETLB): {}",
                io::Error::last_os_error()
            );
            return;
        };
        assert_eq!(file_page_size(huge.as_fd()).unwrap(), 2 << 20);
    }
}
