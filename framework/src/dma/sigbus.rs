//! Surviving a client that shrinks a file it DMA-mapped.
//!
//! A `MAP_SHARED` mapping of a file raises SIGBUS when a page past the file's end is
//! touched. A client may `ftruncate` its memfd after DMA_MAP (QEMU seals its memfds, a
//! hostile client does not), and the next device access would kill the whole server. So
//! every fd-backed mapping is registered here, and a SIGBUS handler, installed once when the
//! first mapping is created, replaces the faulting page of a registered mapping with a
//! private zero page and lets the access continue: the device reads zeros and its writes go
//! nowhere, as if the client had unmapped the memory. A SIGBUS anywhere else (or of another
//! kind, e.g. a hardware memory error) goes to the previous handler, or the default action.
//!
//! The registry is a fixed table of atomics, readable from the handler without locks or
//! allocation; the handler only does async-signal-safe work (atomic loads, `mmap`,
//! `sigaction`).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::sync::Once;

/// Most registered mappings at a time (beyond that, a mapping is served unprotected).
const SLOTS: usize = 1 << 16;
/// `si_code` of a SIGBUS for an access past the end of the mapped object.
const BUS_ADRERR: libc::c_int = 2;

struct Slot {
    /// Start address, published after `end`; 0 = free.
    start: AtomicUsize,
    /// One past the end; claimed first (0 → end) to own the slot.
    end: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// One past the highest slot ever used (bounds the handler's scan).
static USED: AtomicUsize = AtomicUsize::new(0);
/// SIGBUS faults turned into zero pages so far.
static RECOVERED: AtomicU64 = AtomicU64::new(0);
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();

/// The handler that was installed before ours.
struct Previous(UnsafeCell<MaybeUninit<libc::sigaction>>);
// SAFETY: written once inside `INSTALL.call_once` before our handler is installed, only read
// afterwards (by the handler).
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(MaybeUninit::zeroed()));

/// A registered mapping; unregisters on drop (drop it before unmapping the range).
pub(crate) struct Registration(usize);

impl Drop for Registration {
    fn drop(&mut self) {
        let slot = &TABLE[self.0];
        slot.start.store(0, Release);
        slot.end.store(0, Release);
    }
}

/// Protect `[start, start + len)` (an fd-backed `MAP_SHARED` mapping) against SIGBUS.
/// `None` if the table is full (the mapping then works, unprotected).
pub(crate) fn register(start: usize, len: usize) -> Option<Registration> {
    install();
    let end = start.checked_add(len)?;
    if start == 0 {
        return None;
    }
    for (i, slot) in TABLE.iter().enumerate() {
        if slot.end.load(Relaxed) == 0 && slot.end.compare_exchange(0, end, AcqRel, Relaxed).is_ok()
        {
            slot.start.store(start, Release);
            USED.fetch_max(i + 1, AcqRel);
            return Some(Registration(i));
        }
    }
    tracing::warn!(
        start,
        len,
        "SIGBUS registry full: DMA mapping not protected against a shrinking file"
    );
    None
}

/// SIGBUS faults recovered so far (process-wide).
#[cfg(test)]
pub(crate) fn recovered() -> u64 {
    RECOVERED.load(Relaxed)
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE.store(page as usize, Relaxed);
        }
        // SAFETY: we are inside call_once, the only writer of PREVIOUS, and our handler is
        // not installed yet, so nobody reads it concurrently; sigaction only writes the
        // struct we pass.
        let rc = unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), (*PREVIOUS.0.get()).as_mut_ptr()) };
        if rc != 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "cannot read the SIGBUS handler; DMA mappings stay unprotected");
            return;
        }
        // SAFETY: a zeroed sigaction is a valid value to fill in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: sa_mask is a valid sigset_t inside `action`.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: installs a handler that only performs async-signal-safe operations.
        let rc = unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) };
        if rc != 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "cannot install the SIGBUS handler; DMA mappings stay unprotected");
        }
    });
}

/// Replace the page at `addr` with a zero page if it lies in a registered mapping.
fn recover(addr: usize) -> bool {
    let used = USED.load(Acquire).min(SLOTS);
    for slot in &TABLE[..used] {
        let start = slot.start.load(Acquire);
        if start == 0 || addr < start || addr >= slot.end.load(Acquire) {
            continue;
        }
        let page = addr & !(PAGE.load(Relaxed) - 1);
        // SAFETY: MAP_FIXED over one page of a live registered mapping (the faulting access
        // proves it is mapped, and a registration is dropped before its range is unmapped).
        // No Rust reference points into guest memory (raw copies only), so replacing the
        // page under the interrupted copy is sound; mmap is async-signal-safe.
        let p = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                PAGE.load(Relaxed),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        RECOVERED.fetch_add(1, Relaxed);
        return true;
    }
    false
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == BUS_ADRERR && recover(addr) {
        return; // the access is retried on the zero page
    }
    // SAFETY: PREVIOUS was written before this handler was installed and is never written
    // again.
    let prev = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    let handler = prev.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // Fall back to the default action: restore it and return, the fault repeats.
        // SAFETY: a zeroed sigaction with SIG_DFL (0) is the default disposition.
        let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        dfl.sa_sigaction = libc::SIG_DFL;
        // SAFETY: sigaction is async-signal-safe; `dfl` is valid.
        unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
    } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: with SA_SIGINFO, sa_sigaction holds a three-argument handler.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: without SA_SIGINFO, sa_sigaction holds a one-argument handler.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

    #[test]
    fn test_sigbus_truncated_mapping_reads_zero_page_and_counts() {
        // SAFETY: memfd_create with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"sigbus-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own fd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 2 * 4096) }, 0);
        let mem =
            super::super::region::HostMem::map_fd(fd.as_fd(), 2 * 4096, 0, super::super::Prot::RW)
                .unwrap();
        let p = mem.addr() as *mut u8;
        // SAFETY: p..p+8192 is our live mapping; raw volatile accesses.
        unsafe { std::ptr::write_volatile(p.add(4096), 7) };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let before = recovered();
        // SAFETY: the page past EOF raises SIGBUS, which the handler turns into a zero page.
        let v = unsafe { std::ptr::read_volatile(p.add(4096)) };
        assert_eq!(v, 0);
        assert!(recovered() > before);
        // The page before EOF is still the file's.
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(p, 9) };
        let mut b = [0u8; 1];
        // SAFETY: pread into our buffer.
        let n = unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), 1, 0) };
        assert_eq!((n, b[0]), (1, 9));
        drop(mem);
    }
}
