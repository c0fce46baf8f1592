//! Residency syscalls for pinned runs (mlock / munlock / MADV_POPULATE_*) and the default
//! locked-memory limit. Each call covers a whole run: that is what coalescing saves.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{DmaError, PAGE_SHIFT};

/// mlock `npages` pages at `addr`.
pub(crate) fn lock(addr: u64, npages: u64, count: &AtomicU64) -> Result<(), DmaError> {
    count.fetch_add(1, Relaxed);
    // SAFETY: mlock only changes residency of pages inside a mapping this space owns (the
    // caller passes a range inside a live region, with the pin lock held so it cannot be
    // unmapped concurrently); it creates no Rust reference.
    let rc = unsafe { libc::mlock(addr as *const libc::c_void, (npages << PAGE_SHIFT) as usize) };
    if rc != 0 {
        return Err(DmaError::Residency {
            op: "mlock",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// munlock `npages` pages at `addr`; a failure is logged (the pin is released regardless).
pub(crate) fn unlock(addr: u64, npages: u64, count: &AtomicU64) {
    count.fetch_add(1, Relaxed);
    // SAFETY: as for `lock`: residency change of a range of a live region we own.
    let rc = unsafe { libc::munlock(addr as *const libc::c_void, (npages << PAGE_SHIFT) as usize) };
    if rc != 0 {
        tracing::error!(addr, npages, err = %io::Error::last_os_error(), "munlock failed");
    }
}

/// Prefault `npages` pages at `addr` (MADV_POPULATE_WRITE if `write`, else _READ).
pub(crate) fn populate(
    addr: u64,
    npages: u64,
    write: bool,
    count: &AtomicU64,
) -> Result<(), DmaError> {
    count.fetch_add(1, Relaxed);
    let (advice, op) = if write {
        (libc::MADV_POPULATE_WRITE, "madvise(MADV_POPULATE_WRITE)")
    } else {
        (libc::MADV_POPULATE_READ, "madvise(MADV_POPULATE_READ)")
    };
    // SAFETY: populating only faults pages of a live region we own in; no Rust reference is
    // created and the contents are not changed.
    let rc = unsafe {
        libc::madvise(
            addr as *mut libc::c_void,
            (npages << PAGE_SHIFT) as usize,
            advice,
        )
    };
    if rc != 0 {
        return Err(DmaError::Residency {
            op,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// RLIMIT_MEMLOCK in pages (u64::MAX when unlimited).
pub(crate) fn default_lock_limit_pages() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    if rc != 0 {
        return 0;
    }
    if rl.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    rl.rlim_cur >> PAGE_SHIFT
}
