//! Memory shared with the client: a sealed memfd mapped in this process, offered to the
//! client with the sparse-mmap capability so it maps the same pages (a framebuffer, a
//! doorbell page) and accesses them without a message per access.
//!
//! The client (and through it the guest) writes this memory concurrently, so it is never
//! exposed as a Rust slice: [`SharedMemory::read_at`]/[`SharedMemory::write_at`] copy with
//! volatile accesses, and [`SharedMemory::as_volatile_slice`] gives vm-memory's
//! [`VolatileSlice`] for anything else. The memfd is sealed against shrinking and growing,
//! so a hostile client cannot truncate it under us (which would turn our accesses into
//! SIGBUS).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use vm_memory::{Bytes, VolatileSlice};

/// Memory shared with the client (a memfd), mapped in this process too.
#[derive(Debug)]
pub struct SharedMemory {
    fd: Arc<OwnedFd>,
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and lives until drop; every access through
// `&self` is a volatile copy, which is sound with concurrent writers (the same contract
// VolatileSlice relies on), so sharing and sending the owner between threads is sound.
unsafe impl Send for SharedMemory {}
// SAFETY: see the `Send` impl: `&self` accesses are volatile copies only.
unsafe impl Sync for SharedMemory {}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

fn out_of_range(offset: u64, len: usize, size: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("access {offset:#x}+{len:#x} outside shared memory of {size:#x} bytes"),
    )
}

impl SharedMemory {
    /// Create `size` bytes (rounded up to the page size) of zeroed shared memory.
    pub fn new(name: &str, size: u64) -> io::Result<SharedMemory> {
        let page = page_size();
        let len = usize::try_from(size)
            .ok()
            .filter(|&s| s > 0)
            .and_then(|s| s.checked_next_multiple_of(page))
            .filter(|&s| i64::try_from(s).is_ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("shared memory size {size:#x} is zero or too large"),
                )
            })?;
        let cname = CString::new(format!("umdev-{name}"))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // `len` fits i64 (checked above).
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl F_ADD_SEALS on an fd we own, with a valid seal mask.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of `len` bytes of our memfd (exactly its size);
        // the kernel chooses the address, so no existing mapping is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let addr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null address"))?;
        tracing::debug!(name, len, "shared memory created");
        Ok(SharedMemory {
            fd: Arc::new(fd),
            addr,
            len,
        })
    }

    /// Size in bytes (a multiple of the page size).
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always false: shared memory is at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to hand to the client with GET_REGION_INFO.
    pub fn fd(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }

    /// Copy `buf.len()` bytes at `offset` into `buf` (volatile reads).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = self.check(offset, buf.len())?;
        self.as_volatile_slice()
            .read_slice(buf, start)
            .map_err(|_| out_of_range(offset, buf.len(), self.len))
    }

    /// Copy `data` to `offset` (volatile writes).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let start = self.check(offset, data.len())?;
        self.as_volatile_slice()
            .write_slice(data, start)
            .map_err(|_| out_of_range(offset, data.len(), self.len))
    }

    /// The whole mapping as a vm-memory [`VolatileSlice`] (volatile accesses only).
    pub fn as_volatile_slice(&self) -> VolatileSlice<'_> {
        // SAFETY: `addr..addr+len` is our live mapping, valid for as long as `&self`
        // (unmapped only in drop); all our accesses to it are volatile and the other users
        // (the client's mappings) are another process.
        unsafe { VolatileSlice::new(self.addr.as_ptr(), self.len) }
    }

    /// The mapping's start address in this process.
    ///
    /// # Safety
    ///
    /// The pointer is valid for `len()` bytes while `self` is alive. The memory is written
    /// concurrently by the client: the caller must access it only with volatile or atomic
    /// operations and never form a `&[u8]`/`&mut [u8]` over it.
    pub unsafe fn as_ptr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        usize::try_from(offset)
            .ok()
            .filter(|&o| o.checked_add(len).is_some_and(|end| end <= self.len))
            .ok_or_else(|| out_of_range(offset, len, self.len))
    }
}

impl AsRawFd for SharedMemory {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` describe the mapping made in `new`, which nothing else unmaps;
        // no `VolatileSlice` can outlive `&self`.
        unsafe {
            libc::munmap(self.addr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_shared_memory_size_rounds_up_to_page() {
        let m = SharedMemory::new("t", 10).unwrap();
        assert_eq!(m.len(), page_size() as u64);
        assert!(!m.is_empty());
    }

    #[test]
    fn test_shared_memory_zero_size_is_rejected() {
        assert!(SharedMemory::new("t", 0).is_err());
        assert!(SharedMemory::new("t", u64::MAX).is_err());
        assert!(SharedMemory::new("bad\0name", 4096).is_err());
    }

    #[test]
    fn test_shared_memory_write_then_read_round_trips() {
        let m = SharedMemory::new("t", 8192).unwrap();
        m.write_at(4094, &[1, 2, 3, 4]).unwrap();
        let mut buf = [0u8; 6];
        m.read_at(4093, &mut buf).unwrap();
        assert_eq!(buf, [0, 1, 2, 3, 4, 0]);
    }

    #[test]
    fn test_shared_memory_out_of_range_access_fails() {
        let m = SharedMemory::new("t", 4096).unwrap();
        let mut buf = [0u8; 2];
        assert!(m.read_at(4095, &mut buf).is_err());
        assert!(m.write_at(u64::MAX, &buf).is_err());
        assert!(m.read_at(4094, &mut buf).is_ok());
    }

    #[test]
    fn test_shared_memory_visible_through_a_second_mapping_of_the_fd() {
        let m = SharedMemory::new("t", 4096).unwrap();
        m.write_at(100, b"hello").unwrap();
        let mut buf = [0u8; 5];
        // SAFETY: pread into a local buffer from a valid fd.
        let n = unsafe { libc::pread(m.as_raw_fd(), buf.as_mut_ptr().cast(), 5, 100) };
        assert_eq!(n, 5);
        assert_eq!(&buf, b"hello");
    }

    #[test]
    fn test_shared_memory_client_cannot_truncate() {
        let m = SharedMemory::new("t", 4096).unwrap();
        // SAFETY: ftruncate on a valid fd; expected to fail because of the seals.
        let rc = unsafe { libc::ftruncate(m.as_raw_fd(), 0) };
        assert_ne!(rc, 0);
    }
}
