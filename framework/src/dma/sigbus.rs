//! Surviving a client that shrinks a file it DMA-mapped.
//!
//! A `MAP_SHARED` mapping of a file raises SIGBUS (`BUS_ADRERR`) when a page past the file's
//! end is touched. A client may `ftruncate` its memfd after DMA_MAP (QEMU seals its memfds
//! with `F_SEAL_SHRINK`, a hostile client does not), and the next device access (`dma_rw`,
//! or a device writing through a pinned host address) would kill the whole server.
//!
//! # What is protected, and how
//! Every fd-backed DMA mapping is registered here with its range, its page size (the huge
//! page size on hugetlbfs) and its protection. A SIGBUS handler, installed once when the
//! first mapping is created, handles a kernel-raised `BUS_ADRERR` whose address lies in a
//! registered range: it replaces **from the faulting page (aligned down to the mapping's page
//! size) to the end of the range** with private anonymous zero memory of the same protection
//! (`MAP_FIXED | MAP_NORESERVE`), and the access continues: the device reads zeros and its
//! writes go nowhere, as if the client had unmapped that memory.
//! - Bounded cost. Pages past the end of a file stay past it (a shrink only moves the end
//!   down), so everything above the faulting page would fault too. One replacement splits the
//!   mapping into at most two VMAs (file below, zeros above); a later fault lower down
//!   replaces a superset, which swallows the previous replacement. Whatever the guest makes
//!   the device touch, a shrunken mapping costs at most one extra VMA (a few more only while
//!   faults on several threads race), never one per page touched. (A client that grows the
//!   file again does not get the replaced range back: the device keeps seeing zeros there.)
//! - hugetlbfs. A hugetlb VMA can only be split at a huge page boundary (the kernel refuses a
//!   4 KiB `MAP_FIXED` inside it with EINVAL), so the replacement starts at the faulting huge
//!   page; the file can only shrink in whole huge pages, so that page is past the end too.
//!   The registered range is the whole VMA (mmap rounds a hugetlb length up).
//! - Seals. A memfd sealed with `F_SEAL_SHRINK` cannot shrink, but umdev neither requires
//!   the seal (files on hugetlbfs/tmpfs that QEMU's `memory-backend-file` passes have none)
//!   nor skips protection when it is present: a sealed hugetlb memfd can still fault (a hole
//!   punched by the client, then no free huge page or a hugetlb cgroup limit), as can a
//!   regular file on an I/O error. The same replacement applies to any `BUS_ADRERR` in a
//!   registered range, whatever its cause: the device loses that mapping's tail, the server
//!   lives.
//!
//! # Every other SIGBUS
//! goes where it went before umdev was loaded: to the previous handler if there was one (and
//! umdev's handler stays installed), otherwise to the default action. Taking the default
//! action means: a fault the kernel raised for an access (`si_code > 0`, except the
//! asynchronous `BUS_MCEERR_AO`) gets the default disposition restored and the access
//! repeats, so the kernel kills the process with the original siginfo (even if SIGBUS was
//! ignored, as the kernel does for a forced fault); a SIGBUS sent by `kill`/`raise`/
//! `sigqueue`, or a `BUS_MCEERR_AO` notification, is re-raised with the default disposition,
//! and the process dies. A sent SIGBUS that was ignored stays ignored; one the default action
//! does not kill (init of a PID namespace) is dropped; either way umdev's handler stays
//! installed. A previous handler that returns after resetting SIGBUS to the default
//! disposition asked for the default action and gets it, for a sent signal too: Rust's
//! runtime installs such a handler (for stack overflows) in every Rust program, and without
//! this a `kill -BUS` would be swallowed. If the replacement itself fails (`mmap` error), a
//! line is written to stderr and the fault goes the same way as one outside any mapping.
//!
//! # Limits
//! The handler is process-wide: an embedding application that installs its own SIGBUS
//! handler after umdev's must chain to it. A previous handler runs with umdev's signal mask;
//! its own `sa_mask` and flags other than `SA_SIGINFO` are not applied. At most 65 536
//! mappings are protected at a time, process-wide; the budget of fd-backed maps (`budget`)
//! never lets the DMA spaces of one pool hold more, and gives each space its share, so one
//! client cannot leave another's mappings unprotected (beyond the table, with several pools,
//! a mapping would work unprotected and a warning is logged).
//!
//! # Signal safety
//! The registry is a fixed table of atomics, each slot guarded by a sequence counter (a
//! seqlock) so the handler never acts on a torn (start, end) of a slot being reused; it is
//! read without locks or allocation. The handler only does async-signal-safe work: atomic
//! loads and stores, `mmap`, `sigaction`, `pthread_sigmask`, `raise`, `write`.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{
    fence, AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::sync::Once;

/// Most registered mappings at a time (beyond that, a mapping is served unprotected).
pub(crate) const SLOTS: usize = 1 << 16;
/// Bits of [`Slot::meta`] holding log2 of the mapping's page size; the mmap protection bits
/// sit above them.
const SHIFT_BITS: u32 = 8;

struct Slot {
    /// Even: stable; odd: being (un)registered. Every change of the slot adds 2.
    seq: AtomicUsize,
    /// Start address; 0 = free.
    start: AtomicUsize,
    /// One past the end.
    end: AtomicUsize,
    /// log2 of the page size | mmap protection bits << [`SHIFT_BITS`].
    meta: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    seq: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    meta: AtomicUsize::new(0),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// One past the highest slot ever used (bounds the handler's scan).
static USED: AtomicUsize = AtomicUsize::new(0);
/// SIGBUS faults turned into zero memory so far.
static RECOVERED: AtomicU64 = AtomicU64::new(0);
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
        // We own the slot: nobody else writes it until `start` is 0 again.
        let seq = slot.seq.load(Relaxed);
        slot.seq.store(seq.wrapping_add(1), Relaxed);
        fence(Release);
        slot.start.store(0, Relaxed);
        slot.end.store(0, Relaxed);
        slot.meta.store(0, Relaxed);
        slot.seq.store(seq.wrapping_add(2), Release);
    }
}

/// Protect `[start, start + len)`, an fd-backed `MAP_SHARED` mapping (the whole VMA: `len` a
/// multiple of `page_size`) with mmap protection `prot`, against SIGBUS. `None` if the table
/// is full or the arguments are unusable (the mapping then works, unprotected).
pub(crate) fn register(
    start: usize,
    len: usize,
    page_size: usize,
    prot: libc::c_int,
) -> Option<Registration> {
    install();
    let end = start.checked_add(len)?;
    if start == 0
        || !page_size.is_power_of_two()
        || !start.is_multiple_of(page_size)
        || !len.is_multiple_of(page_size)
    {
        tracing::warn!(
            start,
            len,
            page_size,
            "unaligned DMA mapping not protected against a shrinking file"
        );
        return None;
    }
    let meta = page_size.trailing_zeros() as usize | (prot as usize) << SHIFT_BITS;
    for (i, slot) in TABLE.iter().enumerate() {
        let seq = slot.seq.load(Acquire);
        if seq & 1 != 0 || slot.start.load(Relaxed) != 0 {
            continue;
        }
        // Any change since `seq` was read makes this fail.
        if slot
            .seq
            .compare_exchange(seq, seq.wrapping_add(1), Acquire, Relaxed)
            .is_err()
        {
            continue;
        }
        fence(Release);
        slot.end.store(end, Relaxed);
        slot.meta.store(meta, Relaxed);
        slot.start.store(start, Relaxed);
        slot.seq.store(seq.wrapping_add(2), Release);
        USED.fetch_max(i + 1, AcqRel);
        return Some(Registration(i));
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

/// Our `sigaction`.
fn our_action() -> libc::sigaction {
    // SAFETY: a zeroed sigaction is a valid value to fill in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: sa_mask is a valid sigset_t inside `action`.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    action
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: we are inside call_once, the only writer of PREVIOUS, and our handler is
        // not installed yet, so nobody reads it concurrently; sigaction only writes the
        // struct we pass.
        let rc = unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), (*PREVIOUS.0.get()).as_mut_ptr()) };
        if rc != 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "cannot read the SIGBUS handler; DMA mappings stay unprotected");
            return;
        }
        let action = our_action();
        // SAFETY: installs a handler that only performs async-signal-safe operations.
        let rc = unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) };
        if rc != 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "cannot install the SIGBUS handler; DMA mappings stay unprotected");
        }
    });
}

/// What [`recover`] did with a fault address.
enum Recovery {
    /// The address is in no registered mapping.
    NotOurs,
    /// Replaced with zero memory: the access can be retried.
    Replaced,
    /// In a registered mapping, but the replacement failed.
    Failed,
}

/// A consistent snapshot of slot `slot` (start, end, meta), or `None` if it is free or
/// changing (a mapping being registered is not accessed yet, one being unregistered no
/// longer: neither can be the one that faulted).
fn read_slot(slot: &Slot) -> Option<(usize, usize, usize)> {
    let seq = slot.seq.load(Acquire);
    if seq & 1 != 0 {
        return None;
    }
    let start = slot.start.load(Relaxed);
    let end = slot.end.load(Relaxed);
    let meta = slot.meta.load(Relaxed);
    fence(Acquire);
    if start == 0 || slot.seq.load(Relaxed) != seq {
        return None;
    }
    Some((start, end, meta))
}

/// Replace `addr`'s page (of the mapping's page size) and everything above it in its
/// registered mapping with zero memory.
fn recover(addr: usize) -> Recovery {
    let used = USED.load(Acquire).min(SLOTS);
    for slot in &TABLE[..used] {
        let Some((start, end, meta)) = read_slot(slot) else {
            continue;
        };
        if addr < start || addr >= end {
            continue;
        }
        let page_size = 1usize << (meta & ((1 << SHIFT_BITS) - 1));
        let prot = (meta >> SHIFT_BITS) as libc::c_int;
        // `start` and `end` are multiples of the page size (checked at registration).
        let from = addr & !(page_size - 1);
        // SAFETY: MAP_FIXED over the tail of a live registered mapping (the faulting access
        // proves it is mapped, and a registration is dropped before its range is unmapped),
        // starting at a page boundary of that mapping and ending at its end. No Rust
        // reference points into guest memory (raw copies only), so replacing pages under an
        // interrupted copy is sound; mmap is async-signal-safe.
        let p = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                end - from,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Recovery::Failed;
        }
        RECOVERED.fetch_add(1, Relaxed);
        return Recovery::Replaced;
    }
    Recovery::NotOurs
}

/// Write `msg` to stderr (async-signal-safe; errors ignored: nothing else to do).
fn say(msg: &[u8]) {
    // SAFETY: write from a valid buffer of `msg.len()` bytes.
    let _ = unsafe { libc::write(libc::STDERR_FILENO, msg.as_ptr().cast(), msg.len()) };
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler (si_addr is
    // meaningful for a kernel-raised SIGBUS only, and only then used).
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == libc::BUS_ADRERR {
        match recover(addr) {
            Recovery::Replaced => return, // the access is retried on zero memory
            Recovery::Failed => say(
                b"umdev: SIGBUS in a DMA mapping: replacing it with zero memory failed (mmap)\n",
            ),
            Recovery::NotOurs => {}
        }
    }
    pass_on(sig, info, ctx, code);
}

/// Give a SIGBUS we do not handle to whoever would have had it without umdev.
fn pass_on(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
    code: libc::c_int,
) {
    // A fault the kernel raised for an access repeats when the handler returns; anything else
    // (kill, raise, sigqueue: si_code <= 0; an asynchronous memory-error notice) does not.
    let access_fault = code > 0 && code != libc::BUS_MCEERR_AO;
    // SAFETY: PREVIOUS was written before this handler was installed and is never written
    // again.
    let prev = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    let handler = prev.sa_sigaction;
    if handler == libc::SIG_IGN && !access_fault {
        return; // ignored, as it was before umdev
    }
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        default_action(sig, access_fault);
        return;
    }
    if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: with SA_SIGINFO, sa_sigaction holds a three-argument handler.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: without SA_SIGINFO, sa_sigaction holds a one-argument handler.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
    // A previous handler that returned after resetting SIGBUS to the default disposition
    // asked for the default action, counting on the access to repeat (Rust's runtime does
    // this for every SIGBUS that is not a stack overflow): give it, also to a sent signal.
    // SAFETY: a zeroed sigaction is a valid buffer for sigaction to fill in.
    let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: sigaction only writes `now`; it is async-signal-safe.
    let rc = unsafe { libc::sigaction(sig, std::ptr::null(), &mut now) };
    if rc == 0 && now.sa_sigaction == libc::SIG_DFL {
        default_action(sig, access_fault);
    }
}

/// Let the default action of `sig` happen.
fn default_action(sig: libc::c_int, access_fault: bool) {
    // SAFETY: a zeroed sigaction with SIG_DFL (0) is the default disposition.
    let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
    dfl.sa_sigaction = libc::SIG_DFL;
    // SAFETY: sigaction is async-signal-safe; `dfl` is valid.
    unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
    if access_fault {
        // The access repeats on return and the kernel delivers the fault again, now with the
        // default action (it forces it even where a sent signal would be ignored).
        return;
    }
    // SAFETY: a zeroed sigset_t is valid input for sigemptyset, which fills it in.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; pthread_sigmask and raise are async-signal-safe.
    // Unblocked (it is blocked while its handler runs), the raised signal is delivered
    // before raise returns.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
    // Still alive: the default action did not kill us (init of a PID namespace ignores it).
    // Put the handler back for later faults; returning restores the signal mask.
    let action = our_action();
    // SAFETY: reinstalls our handler; sigaction is async-signal-safe.
    unsafe { libc::sigaction(sig, &action, std::ptr::null_mut()) };
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
