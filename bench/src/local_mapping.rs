//! Shared-memory helpers of the benches: memfds and an RAII `mmap` of one.
//!
//! The DMA layer maps client fds itself; the benches create those fds (a memfd stands in for
//! the VMM's guest RAM) and sometimes map them a second time locally (to prefault transparent
//! huge pages, or to copy the same memory with plain memcpy as the physical limit).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// Create a memfd named `name` with `flags` (MFD_CLOEXEC is added) and size it to `size`
/// bytes (sparse: no memory is allocated until touched).
pub fn memfd(name: &str, flags: libc::c_uint, size: u64) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), flags | libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A `MAP_SHARED` read/write mapping of a file, unmapped on drop.
pub struct LocalMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; access goes through raw
// pointers by the caller, who is responsible for synchronisation, as with any shared memory.
unsafe impl Send for LocalMapping {}

impl LocalMapping {
    /// Map `len` bytes of `fd` from offset 0.
    pub fn new(fd: &OwnedFd, len: usize) -> io::Result<LocalMapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint) overlaps nothing we own;
        // the result is checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        Ok(LocalMapping { ptr, len })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copy the first `buf.len()` bytes of the mapping into `buf`: a plain memcpy, the
    /// physical limit the benches hold dma_rw against.
    ///
    /// # Panics
    /// If `buf` is longer than the mapping.
    pub fn copy_to(&self, buf: &mut [u8]) {
        assert!(buf.len() <= self.len, "copy beyond the local mapping");
        // SAFETY: `buf.len()` bytes are inside our live mapping (checked above) and inside
        // `buf`; a mapping and a Rust buffer never overlap. Raw copies, never a slice of the
        // shared memory.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    }

    /// Copy `data` to the start of the mapping: a plain memcpy (see [`Self::copy_to`]).
    ///
    /// # Panics
    /// If `data` is longer than the mapping.
    pub fn copy_from(&self, data: &[u8]) {
        assert!(data.len() <= self.len, "copy beyond the local mapping");
        // SAFETY: as in `copy_to`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr(), data.len()) };
    }

    /// `madvise(advice)` over the whole mapping.
    pub fn advise(&self, advice: libc::c_int) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping; advice does not unmap it.
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Write one byte per `stride` bytes, faulting the memory in.
    pub fn touch(&self, stride: usize) {
        let stride = stride.max(1);
        let mut off = 0;
        while off < self.len {
            // SAFETY: `off < len`, inside our read/write mapping; a volatile write because
            // the memory is shared.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(1) };
            off += stride;
        }
    }
}

impl Drop for LocalMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value owns, once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_memfd_mapping_touch_writes_shared_memory() {
        let fd = memfd("t", 0, 8192).unwrap();
        let a = LocalMapping::new(&fd, 8192).unwrap();
        let b = LocalMapping::new(&fd, 8192).unwrap();
        a.touch(4096);
        // SAFETY: in bounds of the mapping.
        let v = unsafe { b.as_ptr().add(4096).read_volatile() };
        assert_eq!(v, 1);
    }

    #[test]
    fn test_copy_from_and_copy_to_see_the_same_memory() {
        let fd = memfd("t", 0, 8192).unwrap();
        let a = LocalMapping::new(&fd, 8192).unwrap();
        let b = LocalMapping::new(&fd, 8192).unwrap();
        a.copy_from(&[7, 8, 9]);
        let mut got = [0u8; 4];
        b.copy_to(&mut got);
        assert_eq!(got, [7, 8, 9, 0]);
    }

    #[test]
    #[should_panic(expected = "beyond the local mapping")]
    fn test_copy_to_longer_than_mapping_panics() {
        let fd = memfd("t", 0, 4096).unwrap();
        let a = LocalMapping::new(&fd, 4096).unwrap();
        a.copy_to(&mut [0u8; 4097]);
    }

    #[test]
    fn test_local_mapping_zero_length_is_error() {
        let fd = memfd("t", 0, 4096).unwrap();
        assert!(LocalMapping::new(&fd, 0).is_err());
    }
}
