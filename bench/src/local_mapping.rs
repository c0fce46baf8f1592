//! Shared-memory helpers of the benches: memfds and a local mapping of one.
//!
//! The DMA layer maps client fds itself; the benches create those fds (a memfd stands in for
//! the VMM's guest RAM) and sometimes map them a second time locally (to prefault transparent
//! huge pages, or to copy the same memory with plain memcpy as the physical limit). The local
//! mapping is vm-memory's [`MmapRegion`], as the DMA layer's own.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use vm_memory::{FileOffset, MmapRegion};

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
    let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.set_len(size)?;
    Ok(file.into())
}

/// A `MAP_SHARED` read/write mapping of a file, unmapped on drop.
pub struct LocalMapping {
    region: MmapRegion,
}

impl LocalMapping {
    /// Map `len` bytes of `fd` from offset 0.
    pub fn new(fd: &OwnedFd, len: usize) -> io::Result<LocalMapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let file = File::from(fd.try_clone()?);
        let region = MmapRegion::from_file(FileOffset::new(file, 0), len).map_err(|e| match e {
            vm_memory::mmap::MmapRegionError::Mmap(io) => io,
            other => io::Error::other(other),
        })?;
        Ok(LocalMapping { region })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.region.size()
    }

    /// Always false: an empty mapping is refused.
    pub fn is_empty(&self) -> bool {
        self.region.size() == 0
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }

    /// Copy the first `buf.len()` bytes of the mapping into `buf`: a plain memcpy, the
    /// physical limit the benches hold dma_rw against.
    ///
    /// # Panics
    /// If `buf` is longer than the mapping.
    pub fn copy_to(&self, buf: &mut [u8]) {
        assert!(buf.len() <= self.len(), "copy beyond the local mapping");
        // SAFETY: `buf.len()` bytes are inside our live mapping (checked above) and inside
        // `buf`; a mapping and a Rust buffer never overlap. Raw copies, never a slice of the
        // shared memory.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    }

    /// Copy `data` to the start of the mapping: a plain memcpy (see [`Self::copy_to`]).
    ///
    /// # Panics
    /// If `data` is longer than the mapping.
    pub fn copy_from(&self, data: &[u8]) {
        assert!(data.len() <= self.len(), "copy beyond the local mapping");
        // SAFETY: as in `copy_to`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr(), data.len()) };
    }

    /// `madvise(advice)` over the whole mapping.
    pub fn advise(&self, advice: libc::c_int) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping; advice does not unmap it.
        if unsafe { libc::madvise(self.as_ptr().cast(), self.len(), advice) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Write one byte per `stride` bytes, faulting the memory in.
    pub fn touch(&self, stride: usize) {
        let stride = stride.max(1);
        let mut off = 0;
        while off < self.len() {
            // SAFETY: `off < len`, inside our read/write mapping; a volatile write because
            // the memory is shared.
            unsafe { self.as_ptr().add(off).write_volatile(1) };
            off += stride;
        }
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
