//! The DMA layer: map table, page pinning with coalescing, `dma_rw`, dirty log.
//!
//! The server applies DMA_MAP / DMA_UNMAP / dirty-logging requests to a [`DmaSpace`]; a
//! device keeps a [`DmaHandle`] (cheap to clone, `Send + Sync`) and from any thread
//! - pins arrays of IOVA pages ([`DmaHandle::pin_pages`], coalesced into runs, refcounted,
//!   all-or-nothing, resident per [`PinPolicy`]) and gets host addresses back,
//! - or copies by IOVA ([`DmaHandle::read`] / [`DmaHandle::write`]).
//!
//! Files: `map_table` (lock-free sorted snapshot of mappings), `region` (one mapping),
//! `pin_table` (per-page refcounts in lazy chunks), `coalesce` (splitting arrays into runs),
//! `pin` (the pin/unpin engine), `residency` (mlock/madvise), `naive` (the per-page reference),
//! `rw` (`dma_rw`), `dirty` / `dirty_log` (dirty logging), `mapping` (map/unmap protocol),
//! `sigbus` (surviving a client that shrinks a mapped file), `budget` (the process-wide
//! budget of fd-backed maps: VMAs and SIGBUS slots shared by every space of the process,
//! a guarantee and a cap per space; see [`MapPool`]), `pinned_copy` (copies between
//! pinned page arrays at any page offsets, and the [`PinnedPages`] guard that makes them safe).
//!
//! # Which mappings an unmap removes
//! [`DmaSpace::unmap`] follows the kernel's type1v2 (`vfio_dma_do_unmap` in
//! `drivers/vfio/vfio_iommu_type1.c`), because QEMU's vIOMMU replay assumes it and sends
//! ranges that are not one mapping (power-of-two sweeps, whole sections, ranges ending at
//! 2^64): every mapping the range fully covers goes; a range covering none succeeds and
//! removes nothing; a range that would split a mapping (its start or end strictly inside
//! one) is an error and removes nothing. Answering a sweep with an error instead would leave
//! stale mappings behind, into which the device would keep doing DMA after the guest reused
//! the memory. The vfio-user spec's "must match exactly a previous mapping" is the special
//! case of one mapping covered exactly. A mapping never reaches 2^64 (`DmaSpace::map`
//! refuses one), so a range ending there is only ever an unmap.
//!
//! # Concurrency
//! Lookups (pins, `dma_rw`) read an `ArcSwap` snapshot of the map table: no lock. Pin and
//! unpin calls serialize on one pin lock per space (as type1 serializes on `iommu->lock`),
//! which makes multi-page, multi-region calls all-or-nothing and the accounting exact.
//! Map/unmap/dirty-logging serialize on a map lock taken only by the connection thread.
//!
//! # Residency and the kernel
//! `Lock` mlocks runs of a `MAP_SHARED` mapping; the kernel splits the mapping's VMA at each
//! locked run's edges, so many scattered locked pages cost VMAs (bounded by
//! `vm.max_map_count`, 65530 by default: about 32 Ki scattered locked runs). Coalesced runs
//! keep that number down. mlock also needs RLIMIT_MEMLOCK (or CAP_IPC_LOCK) at least as large
//! as umdev's own limit, otherwise pins fail with the kernel's errno.
//!
//! # Host addresses of pinned pages
//! A host address returned by `pin_pages`/`pin_range` points into a `MAP_SHARED` mapping of
//! the client's memory; pages that are consecutive in IOVA *and* in one mapping are
//! consecutive in host memory (`pin_range` returns the start of such a range). It may be
//! accessed (with raw/volatile accesses only: the guest writes it concurrently) until the
//! matching unpin. If the device still holds pins when the mapping is unmapped, umdev
//! force-releases them and replaces the range with private scratch memory that stays mapped
//! for the life of the space, so a buggy device scribbles on scratch, never on freed or
//! reused memory. See [`DmaHandle::pinned_slice`].
//!
//! # Bus Master
//! A PCI device masters the bus only while the guest has Bus Master Enable (BME) set in its
//! command register; drivers clear it on unbind, shutdown and kexec so the device stops
//! touching memory. [`DmaSpace::set_bus_master`] is that switch (the PCI adapter drives it
//! from the command register; a space starts enabled, so non-PCI users never see it). While
//! it is clear every device DMA — `pin_pages`/`pin_range` (both paths), `read`/`write` and
//! `read_obj`/`write_obj`, fd-backed or fd-less (no DMA_READ/DMA_WRITE is sent) — fails
//! with [`DmaError::BusMasterDisabled`] (EACCES) before it looks at the map table; unpinning
//! always works, so a device can release what it holds. Nothing is revoked: pins taken and
//! copies started while BME was set stay valid and finish. The check is one relaxed load; a
//! call that raced with the change may see either value.

mod backing;
mod budget;
#[cfg(test)]
mod bus_master_tests;
mod coalesce;
mod dirty;
mod dirty_log;
mod error;
mod map_table;
mod mapping;
mod naive;
mod pin;
mod pin_table;
mod pinned_copy;
mod region;
mod residency;
mod rw;
mod sigbus;

use std::os::fd::OwnedFd;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use arc_swap::ArcSwap;
use vm_memory::ByteValued;

pub use budget::{
    capacity_for, BudgetRefusal, MapPool, PoolUsage, DEFAULT_MAP_GUARANTEE, VMAS_PER_MAP,
};
pub use error::DmaError;
pub use naive::NaiveDma;
pub use pinned_copy::{copy_pinned, copy_segments, PinnedIoError, PinnedPages};
/// The volatile view of guest memory that [`DmaHandle::pinned_slice`] returns (vm-memory's,
/// re-exported so that a device crate needs no vm-memory dependency of its own).
pub use vm_memory::VolatileSlice;

use map_table::MapTable;
use region::HostMem;

/// Page size the pin API works in (IOVA page numbers are `iova >> PAGE_SHIFT`).
pub const PAGE_SIZE: u64 = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

/// Access permission of a mapping or a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Prot {
    /// Readable by the device.
    pub read: bool,
    /// Writable by the device.
    pub write: bool,
}

impl Prot {
    /// Read only.
    pub const READ: Prot = Prot {
        read: true,
        write: false,
    };
    /// Write only.
    pub const WRITE: Prot = Prot {
        read: false,
        write: true,
    };
    /// Read and write.
    pub const RW: Prot = Prot {
        read: true,
        write: true,
    };

    /// True if every permission in `need` is in `self`.
    pub fn allows(self, need: Prot) -> bool {
        (self.read || !need.read) && (self.write || !need.write)
    }
}

/// How a pinned page is made resident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PinPolicy {
    /// Refcount + address only.
    #[default]
    Translate,
    /// mlock each run, counted against a locked-memory limit.
    Lock,
    /// Prefault each run with MADV_POPULATE_READ/WRITE.
    Populate,
}

/// Configuration of a [`DmaSpace`].
#[derive(Clone, Debug)]
pub struct DmaConfig {
    /// Residency policy for pins.
    pub policy: PinPolicy,
    /// Locked-memory limit in bytes for `Lock`; `None` means RLIMIT_MEMLOCK.
    pub lock_limit_bytes: Option<u64>,
    /// Maximum number of simultaneous DMA mappings (negotiated max_dma_maps).
    pub max_dma_maps: u32,
    /// The budget of fd-backed maps this space draws from; `None` (default): the
    /// process's ([`MapPool::process`], sized from `vm.max_map_count`; see `budget`).
    pub map_pool: Option<Arc<MapPool>>,
    /// Fd-backed maps reserved for this space in the pool (default
    /// [`DEFAULT_MAP_GUARANTEE`]; the instance registry lowers it so that all its
    /// instances fit).
    pub map_guarantee: u64,
    /// Most fd-backed maps this space may hold; `None` (default): the pool's capacity.
    pub map_cap: Option<u64>,
}

impl Default for DmaConfig {
    fn default() -> Self {
        DmaConfig {
            policy: PinPolicy::Translate,
            lock_limit_bytes: None,
            max_dma_maps: 65535,
            map_pool: None,
            map_guarantee: DEFAULT_MAP_GUARANTEE,
            map_cap: None,
        }
    }
}

/// One DMA_MAP request, already decoded and validated by the protocol layer.
#[derive(Debug)]
pub struct DmaMapping {
    /// Guest IOVA of the start.
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
    /// Permission granted to the device.
    pub prot: Prot,
    /// The backing file, or `None` for an fd-less mapping (reached via DMA_READ/DMA_WRITE).
    pub fd: Option<OwnedFd>,
    /// Offset of `iova` within `fd`.
    pub offset: u64,
}

/// Server→client DMA for fd-less regions; implemented by the server.
pub trait RemoteDma: Send + Sync {
    /// DMA_READ `buf.len()` bytes (≤ [`RemoteDma::max_xfer`]) from `iova`.
    fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError>;
    /// DMA_WRITE `data` (≤ [`RemoteDma::max_xfer`] bytes) to `iova`.
    fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError>;
    /// Negotiated max_data_xfer_size.
    fn max_xfer(&self) -> usize;
    /// Fail at once the requests in flight that target `[iova, iova + size)`, so that
    /// their `dma_read`/`dma_write` return `DmaError::Remote` with errno ECANCELED instead
    /// of waiting for the client. DMA_UNMAP calls it for a removed fd-less mapping, again
    /// and again until the mapping's in-flight accesses have drained (a request that
    /// starts just after one call is caught by the next); it must not block. The default
    /// cancels nothing (the unmap then waits for the client, or the remote timeout).
    fn cancel(&self, iova: u64, size: u64) {
        let _ = (iova, size);
    }
}

/// Counters of a [`DmaSpace`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaStats {
    /// Current number of mappings.
    pub maps: u64,
    /// Fd-backed mappings held (each a VMA and a SIGBUS slot of the process, counted
    /// against its map budget), including those kept as scratch after leaked pins.
    pub fd_maps: u64,
    /// Distinct pages with pin refcount > 0.
    pub pinned_pages: u64,
    /// Pages currently locked (policy `Lock`).
    pub locked_pages: u64,
    /// Pins found at unmap time and force-released (device bugs).
    pub leaked_pins_released: u64,
    /// Residency syscalls issued so far (mlock/munlock/madvise), for benchmarks.
    pub residency_syscalls: u64,
}

/// Observer of every successful `pin_pages` call (the array as the device passed it), used by
/// `umdev run --record-pins` to capture real pin patterns.
pub type PinRecorder = Arc<dyn Fn(&[u64], Prot) + Send + Sync>;

/// What an unmap did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnmapReport {
    /// Mappings removed.
    pub maps_removed: u64,
    /// Bytes of the mappings removed (what type1 writes back into the unmap's size field).
    pub bytes_removed: u64,
    /// Pins the device left behind, force-released.
    pub leftover_pins: u64,
}

/// Counters shared by the paths.
#[derive(Default)]
struct Counters {
    maps: AtomicU64,
    pinned_pages: AtomicU64,
    locked_pages: AtomicU64,
    leaked_pins_released: AtomicU64,
    residency_syscalls: AtomicU64,
}

/// The DMA map table of one device server; lives as long as the server (across client
/// reconnects). The server applies DMA_MAP/DMA_UNMAP here; devices use a [`DmaHandle`].
pub struct DmaSpace {
    table: ArcSwap<MapTable>,
    /// Serializes map/unmap/dirty logging (the connection thread).
    map_lock: Mutex<()>,
    /// Serializes pin/unpin calls and the forced release at unmap.
    pin_lock: Mutex<()>,
    policy: AtomicU8,
    lock_limit_pages: AtomicU64,
    max_dma_maps: AtomicU32,
    counters: Counters,
    remote: RwLock<Option<Arc<dyn RemoteDma>>>,
    recorder: RwLock<Option<PinRecorder>>,
    has_recorder: AtomicBool,
    dirty_active: AtomicBool,
    dirty_shift: AtomicU32,
    /// Mappings replaced by scratch memory after a device leaked pins (see module docs).
    graveyard: Mutex<Vec<HostMem>>,
    /// Bus Master Enable: device DMA is refused while false (see module docs).
    bus_master: AtomicBool,
    /// This space's account in the budget of fd-backed maps (see `budget`).
    maps_account: Arc<budget::MapAccount>,
    /// Map fds of any file, not only tmpfs/hugetlbfs ones (`backing.rs`).
    allow_any_file_maps: AtomicBool,
}

fn policy_to_u8(p: PinPolicy) -> u8 {
    match p {
        PinPolicy::Translate => 0,
        PinPolicy::Lock => 1,
        PinPolicy::Populate => 2,
    }
}

fn lock_limit_pages(bytes: Option<u64>) -> u64 {
    match bytes {
        Some(b) => b >> PAGE_SHIFT,
        None => residency::default_lock_limit_pages(),
    }
}

impl DmaSpace {
    /// A new, empty map table.
    pub fn new(config: DmaConfig) -> Arc<DmaSpace> {
        let pool = config.map_pool.clone().unwrap_or_else(MapPool::process);
        let cap = config.map_cap.unwrap_or(pool.capacity());
        let maps_account = budget::MapAccount::join(pool, config.map_guarantee, cap);
        Arc::new(DmaSpace {
            table: ArcSwap::from_pointee(MapTable::default()),
            map_lock: Mutex::new(()),
            pin_lock: Mutex::new(()),
            policy: AtomicU8::new(policy_to_u8(config.policy)),
            lock_limit_pages: AtomicU64::new(lock_limit_pages(config.lock_limit_bytes)),
            max_dma_maps: AtomicU32::new(config.max_dma_maps),
            counters: Counters::default(),
            remote: RwLock::new(None),
            recorder: RwLock::new(None),
            has_recorder: AtomicBool::new(false),
            dirty_active: AtomicBool::new(false),
            dirty_shift: AtomicU32::new(PAGE_SHIFT),
            graveyard: Mutex::new(Vec::new()),
            bus_master: AtomicBool::new(true),
            maps_account,
            allow_any_file_maps: AtomicBool::new(false),
        })
    }

    /// This space's share of its budget of fd-backed maps: (guarantee, cap), in maps.
    pub fn map_share(&self) -> (u64, u64) {
        (self.maps_account.guarantee(), self.maps_account.cap())
    }

    /// The handle devices keep.
    pub fn handle(self: &Arc<Self>) -> DmaHandle {
        DmaHandle {
            space: self.clone(),
        }
    }

    fn map_lock(&self) -> MutexGuard<'_, ()> {
        self.map_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pin_lock(&self) -> MutexGuard<'_, ()> {
        self.pin_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn policy(&self) -> PinPolicy {
        match self.policy.load(Relaxed) {
            1 => PinPolicy::Lock,
            2 => PinPolicy::Populate,
            _ => PinPolicy::Translate,
        }
    }

    /// DMA_MAP. EEXIST on overlap, ENOSPC past max_dma_maps, ENOMEM ([`DmaError::MapBudget`])
    /// for an fd-backed map beyond this space's share of the process's map budget (checked
    /// before the mmap); iova, size and offset must be 4 KiB aligned and not overflow. An fd-backed mapping is mmap'd `MAP_SHARED` with the
    /// mapping's protection (the fd is closed afterwards; the mapping keeps the memory).
    pub fn map(&self, m: DmaMapping) -> Result<(), DmaError> {
        self.map_impl(m)
    }

    /// DMA_UNMAP of the range `[iova, iova + size)` with the kernel's type1v2 semantics
    /// (what QEMU assumes; see the module docs): every mapping the range fully covers is
    /// removed; a range covering none succeeds with nothing removed; a range whose start or
    /// end falls strictly inside a mapping fails with [`DmaError::SplitsMapping`] (EINVAL)
    /// and removes nothing. The range may end exactly at 2^64 (`iova + size` = 2^64);
    /// `size` must be non-zero and `iova`/`size` 4 KiB aligned (EINVAL otherwise).
    ///
    /// For each mapping removed it calls `notify(iova, size)` (the device's unmap notifier,
    /// with that mapping's own range) before removing, force-releases leftover pins, and
    /// waits for in-flight accesses. After it returns nothing touches the removed mappings.
    /// The report says how many mappings and bytes went.
    ///
    /// `notify` runs on the calling thread with the map lock held: it may unpin (from this
    /// or other threads) but must not call `map`/`unmap`/`dirty_*` on this space.
    pub fn unmap(
        &self,
        iova: u64,
        size: u64,
        notify: &mut dyn FnMut(u64, u64),
    ) -> Result<UnmapReport, DmaError> {
        self.unmap_impl(iova, size, notify)
    }

    /// Remove every mapping (client disconnect), with the same guarantees as `unmap`; also
    /// stops dirty logging (client state), so the next client can start it afresh.
    pub fn unmap_all(&self, notify: &mut dyn FnMut(u64, u64)) -> UnmapReport {
        self.unmap_all_impl(notify)
    }

    /// Install (or remove, on disconnect) the server→client path for fd-less mappings.
    pub fn set_remote(&self, remote: Option<Arc<dyn RemoteDma>>) {
        *self.remote.write().unwrap_or_else(|e| e.into_inner()) = remote;
    }

    /// DMA_LOGGING_START for `ranges` (iova, size) at `pgsize` (empty = everything).
    /// EBUSY if logging is already on; `pgsize` must be a power of two ≥ 4096.
    pub fn dirty_start(&self, pgsize: u64, ranges: &[(u64, u64)]) -> Result<(), DmaError> {
        self.dirty_start_impl(pgsize, ranges)
    }

    /// DMA_LOGGING_STOP.
    pub fn dirty_stop(&self) {
        self.dirty_stop_impl()
    }

    /// DMA_LOGGING_REPORT: fill `bitmap` (1 bit per `pgsize` page of `[iova, iova+size)`,
    /// LSB first) and clear the reported bits. On error no bit is cleared. `pgsize` is a
    /// power of two ≥ 4096, possibly different from the logging page size (bits are OR-ed or
    /// replicated); iova and size must be aligned to it.
    pub fn dirty_report(
        &self,
        iova: u64,
        size: u64,
        pgsize: u64,
        bitmap: &mut [u8],
    ) -> Result<(), DmaError> {
        self.dirty_report_impl(iova, size, pgsize, bitmap)
    }

    /// Counters.
    pub fn stats(&self) -> DmaStats {
        let c = &self.counters;
        DmaStats {
            maps: c.maps.load(Relaxed),
            fd_maps: self.maps_account.used(),
            pinned_pages: c.pinned_pages.load(Relaxed),
            locked_pages: c.locked_pages.load(Relaxed),
            leaked_pins_released: c.leaked_pins_released.load(Relaxed),
            residency_syscalls: c.residency_syscalls.load(Relaxed),
        }
    }

    /// Install or remove the pin recorder.
    pub fn set_pin_recorder(&self, recorder: Option<PinRecorder>) {
        let mut r = self.recorder.write().unwrap_or_else(|e| e.into_inner());
        self.has_recorder.store(recorder.is_some(), Relaxed);
        *r = recorder;
    }

    /// Change the residency policy. EBUSY while any page is pinned (a policy change under
    /// existing pins would make the locked-page accounting ambiguous).
    pub fn set_policy(&self, policy: PinPolicy) -> Result<(), DmaError> {
        let _pin = self.pin_lock();
        if self.counters.pinned_pages.load(Relaxed) != 0 {
            return Err(DmaError::Busy(
                "cannot change the pin policy while pages are pinned",
            ));
        }
        self.policy.store(policy_to_u8(policy), Relaxed);
        Ok(())
    }

    /// Change the locked-memory limit of `Lock` (`None` = RLIMIT_MEMLOCK). Existing locks
    /// stay; later pins are checked against the new limit.
    pub fn set_lock_limit(&self, bytes: Option<u64>) {
        let _pin = self.pin_lock();
        self.lock_limit_pages
            .store(lock_limit_pages(bytes), Relaxed);
    }

    /// Accept fd-backed DMA_MAPs of any mmappable file (`true`), or only of memfd,
    /// shmem/tmpfs and hugetlbfs files (`false`, the default): faults on other files are
    /// served by someone a client may control. Applies to later DMA_MAPs.
    pub fn set_allow_any_file_maps(&self, allow: bool) {
        self.allow_any_file_maps.store(allow, Relaxed);
    }

    /// Set the negotiated max_dma_maps (applies to later DMA_MAPs).
    pub fn set_max_dma_maps(&self, max: u32) {
        self.max_dma_maps.store(max, Relaxed);
    }

    /// The current limit on simultaneous mappings.
    pub fn max_dma_maps(&self) -> u32 {
        self.max_dma_maps.load(Relaxed)
    }

    /// Set the Bus Master switch (PCI command register bit 2); returns the previous value.
    /// While it is clear, device DMA (pins, `read`/`write`, fd-backed or fd-less) fails with
    /// [`DmaError::BusMasterDisabled`]; unpinning still works; nothing already pinned or in
    /// flight is revoked. A new space starts enabled.
    pub fn set_bus_master(&self, enabled: bool) -> bool {
        self.bus_master.swap(enabled, SeqCst)
    }

    /// True while device DMA is allowed (see [`DmaSpace::set_bus_master`]).
    pub fn bus_master(&self) -> bool {
        self.bus_master.load(Relaxed)
    }

    /// `Err(BusMasterDisabled)` while the Bus Master switch is clear; `iova` names the
    /// access for the error (only evaluated then). One relaxed load on the hot path.
    #[inline(always)]
    fn check_bus_master(&self, iova: impl FnOnce() -> u64) -> Result<(), DmaError> {
        if self.bus_master.load(Relaxed) {
            Ok(())
        } else {
            Err(bus_master_refused(iova()))
        }
    }

    /// Verify the accounting by a full scan (for tests and debugging; O(pinned chunks)):
    /// per-region and global pinned/locked counters equal the flags in the pin tables, and
    /// under `Lock` locked pages equal pinned pages.
    pub fn check_invariants(&self) -> Result<(), String> {
        let _pin = self.pin_lock();
        let table = self.table.load();
        let (mut pinned, mut locked) = (0u64, 0u64);
        for r in table.iter() {
            let (p, l, c) = r.pins.scan();
            if p != c {
                return Err(format!(
                    "region {:#x}: {p} pages flagged pinned but {c} with count > 0",
                    r.iova
                ));
            }
            if p != r.pins.pinned.load(Relaxed) || l != r.pins.locked.load(Relaxed) {
                return Err(format!(
                    "region {:#x}: scanned pinned/locked {p}/{l}, counters {}/{}",
                    r.iova,
                    r.pins.pinned.load(Relaxed),
                    r.pins.locked.load(Relaxed)
                ));
            }
            pinned += p;
            locked += l;
        }
        let s = self.stats();
        if s.pinned_pages != pinned || s.locked_pages != locked {
            return Err(format!(
                "global pinned/locked {}/{} but regions sum to {pinned}/{locked}",
                s.pinned_pages, s.locked_pages
            ));
        }
        if self.policy() == PinPolicy::Lock && locked != pinned {
            return Err(format!("policy Lock: {locked} locked != {pinned} pinned"));
        }
        if s.maps != table.len() as u64 {
            return Err(format!("maps counter {} != table {}", s.maps, table.len()));
        }
        Ok(())
    }

    fn record(&self, pfns: &[u64], prot: Prot) {
        if self.has_recorder.load(Relaxed) {
            let rec = self
                .recorder
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(rec) = rec {
                rec(pfns, prot);
            }
        }
    }
}

/// The error of a DMA refused because Bus Master Enable is clear (out of the hot path).
#[cold]
#[inline(never)]
fn bus_master_refused(iova: u64) -> DmaError {
    tracing::debug!(iova, "device DMA refused: Bus Master Enable is clear");
    DmaError::BusMasterDisabled { iova }
}

/// A device's handle to DMA: cheap to clone, `Send + Sync`, usable from worker threads. It
/// stays valid across client reconnects (the space lives as long as the server).
#[derive(Clone)]
pub struct DmaHandle {
    space: Arc<DmaSpace>,
}

impl DmaHandle {
    /// Pin the pages `iova_pfns` (arbitrary order, duplicates allowed) with `prot`; write the
    /// host address of each page into `host_addrs[i]`. All-or-nothing: on error nothing
    /// pinned by the call stays pinned and the accounting is as before (pages pinned
    /// writable may stay marked dirty; `host_addrs` may be partly written). See the module
    /// docs for what a host address allows.
    #[inline]
    pub fn pin_pages(
        &self,
        iova_pfns: &[u64],
        prot: Prot,
        host_addrs: &mut [u64],
    ) -> Result<(), DmaError> {
        if self.space.has_recorder.load(Relaxed) {
            return self.pin_pages_recorded(iova_pfns, prot, host_addrs);
        }
        // Inlined into the caller, so without a recorder this is one load and a tail call:
        // a one-page call takes exactly the per-page path (seeds/01: it must not get slower;
        // measured with callgrind, see docs/benchmarks.md).
        if iova_pfns.len() == 1 {
            self.space.pin_impl::<false>(iova_pfns, prot, host_addrs)
        } else {
            self.space.pin_impl::<true>(iova_pfns, prot, host_addrs)
        }
    }

    /// `pin_pages` while a pin recorder is installed (`umdev run --record-pins`).
    #[cold]
    #[inline(never)]
    fn pin_pages_recorded(
        &self,
        iova_pfns: &[u64],
        prot: Prot,
        host_addrs: &mut [u64],
    ) -> Result<(), DmaError> {
        self.space.pin_impl::<true>(iova_pfns, prot, host_addrs)?;
        self.space.record(iova_pfns, prot);
        Ok(())
    }

    /// Unpin pages pinned by `pin_pages`; all-or-nothing (an unpinned page is an error).
    #[inline]
    pub fn unpin_pages(&self, iova_pfns: &[u64]) -> Result<(), DmaError> {
        if iova_pfns.len() == 1 {
            self.space.unpin_impl::<false>(iova_pfns)
        } else {
            self.space.unpin_impl::<true>(iova_pfns)
        }
    }

    /// Pin `npages` consecutive pages from `iova_pfn`, which must lie in one mapping; returns
    /// the host address of the first page (the pages are consecutive in host memory).
    pub fn pin_range(&self, iova_pfn: u64, npages: u64, prot: Prot) -> Result<u64, DmaError> {
        self.space.pin_range_impl(iova_pfn, npages, prot)
    }

    /// Unpin what `pin_range` pinned; all-or-nothing.
    pub fn unpin_range(&self, iova_pfn: u64, npages: u64) -> Result<(), DmaError> {
        self.space.unpin_range_impl(iova_pfn, npages)
    }

    /// Copy guest memory at `iova` into `buf`.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.space.read_impl(iova, buf)
    }

    /// Copy `data` into guest memory at `iova`.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        self.space.write_impl(iova, data)
    }

    /// Read a plain-data object at `iova`.
    pub fn read_obj<T: ByteValued>(&self, iova: u64) -> Result<T, DmaError> {
        // SAFETY: ByteValued types are valid for every bit pattern, including all zeroes.
        let mut v: T = unsafe { std::mem::zeroed() };
        self.read(iova, v.as_mut_slice())?;
        Ok(v)
    }

    /// Write a plain-data object at `iova`.
    pub fn write_obj<T: ByteValued>(&self, iova: u64, v: &T) -> Result<(), DmaError> {
        self.write(iova, v.as_slice())
    }

    /// A volatile view of `len` bytes of pinned memory at `host_addr`.
    ///
    /// # Safety
    /// `[host_addr, host_addr + len)` must lie within pages that this handle's space returned
    /// from `pin_pages`/`pin_range` (consecutive pages of one mapping are consecutive in host
    /// memory), and they must stay pinned while the slice is used. The slice is guest memory
    /// shared with another process: use only its volatile accessors.
    pub unsafe fn pinned_slice(&self, host_addr: u64, len: usize) -> VolatileSlice<'_> {
        // SAFETY: the caller guarantees the range is pinned, hence mapped and valid for
        // volatile reads/writes for as long as it stays pinned (and mapped, possibly to
        // scratch, for the space's lifetime, which the borrow of `self` covers).
        unsafe { VolatileSlice::new(host_addr as *mut u8, len) }
    }

    /// Counters of the underlying space.
    pub fn stats(&self) -> DmaStats {
        self.space.stats()
    }

    /// True while the guest lets the device master the bus (see
    /// [`DmaSpace::set_bus_master`]); DMA fails with [`DmaError::BusMasterDisabled`]
    /// otherwise.
    pub fn bus_master(&self) -> bool {
        self.space.bus_master()
    }

    /// The space this handle belongs to.
    pub fn space(&self) -> &Arc<DmaSpace> {
        &self.space
    }

    /// The per-page reference path (no coalescing): same semantics and accounting as
    /// `pin_pages`/`unpin_pages`; the baseline for property tests and benchmarks.
    pub fn naive(&self) -> NaiveDma<'_> {
        NaiveDma { handle: self }
    }
}
