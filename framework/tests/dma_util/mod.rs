//! Helpers shared by the DMA integration tests: memfd-backed mappings.
#![allow(dead_code)]

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use umdev::dma::{DmaConfig, DmaMapping, DmaSpace, PinPolicy, Prot, PAGE_SIZE};

/// A memfd of `size` bytes.
pub fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a static NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"umdev-dma-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own fd.
    let rc = unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), size as i64) };
    assert_eq!(rc, 0);
    fd
}

/// A space with `policy` and a lock limit of `limit_pages` pages.
pub fn space(policy: PinPolicy, limit_pages: u64) -> Arc<DmaSpace> {
    DmaSpace::new(DmaConfig {
        policy,
        lock_limit_bytes: Some(limit_pages * PAGE_SIZE),
        max_dma_maps: 65535,
        ..DmaConfig::default()
    })
}

/// Map `npages` pages of a fresh memfd at page `pfn`.
pub fn map_pages(space: &DmaSpace, pfn: u64, npages: u64, prot: Prot) {
    space
        .map(DmaMapping {
            iova: pfn * PAGE_SIZE,
            size: npages * PAGE_SIZE,
            prot,
            fd: Some(memfd(npages * PAGE_SIZE)),
            offset: 0,
        })
        .expect("map");
}

/// Record an fd-less mapping of `npages` pages at page `pfn`.
pub fn map_fdless(space: &DmaSpace, pfn: u64, npages: u64, prot: Prot) {
    space
        .map(DmaMapping {
            iova: pfn * PAGE_SIZE,
            size: npages * PAGE_SIZE,
            prot,
            fd: None,
            offset: 0,
        })
        .expect("map fd-less");
}

/// A notifier that does nothing.
pub fn no_notify() -> impl FnMut(u64, u64) {
    |_, _| {}
}
