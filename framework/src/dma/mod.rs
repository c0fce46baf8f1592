//! The DMA layer: map table, page pinning with coalescing, `dma_rw`, dirty log.
//!
//! SKELETON — the public API below is the contract other modules code against; the
//! implementation is being written. Signatures may grow, but should not change shape.

use std::os::fd::OwnedFd;
use std::sync::Arc;

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
}

impl Default for DmaConfig {
    fn default() -> Self {
        DmaConfig {
            policy: PinPolicy::Translate,
            lock_limit_bytes: None,
            max_dma_maps: 65535,
        }
    }
}

/// Errors of the DMA layer.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// No mapping covers the address.
    #[error("iova {iova:#x} is not mapped")]
    NotMapped {
        /// The address.
        iova: u64,
    },
}

impl DmaError {
    /// The errno this error is reported with.
    pub fn errno(&self) -> i32 {
        match self {
            DmaError::NotMapped { .. } => libc::EFAULT,
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
}

/// Counters of a [`DmaSpace`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaStats {
    /// Current number of mappings.
    pub maps: u64,
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
    /// Pins the device left behind, force-released.
    pub leftover_pins: u64,
}

/// The DMA map table of one device server; lives as long as the server (across client
/// reconnects). The server applies DMA_MAP/DMA_UNMAP here; devices use a [`DmaHandle`].
pub struct DmaSpace {
    _config: DmaConfig,
}

impl DmaSpace {
    /// A new, empty map table.
    pub fn new(config: DmaConfig) -> Arc<DmaSpace> {
        Arc::new(DmaSpace { _config: config })
    }

    /// The handle devices keep.
    pub fn handle(self: &Arc<Self>) -> DmaHandle {
        DmaHandle {
            _space: self.clone(),
        }
    }

    /// DMA_MAP. EEXIST on overlap, ENOSPC past max_dma_maps.
    pub fn map(&self, _m: DmaMapping) -> Result<(), DmaError> {
        todo!("dma: map")
    }

    /// DMA_UNMAP of exactly an earlier mapping. Calls `notify(iova, size)` (the device's
    /// unmap notifier) before removing, force-releases leftover pins, waits for in-flight
    /// accesses. After it returns nothing touches the range.
    pub fn unmap(
        &self,
        _iova: u64,
        _size: u64,
        _notify: &mut dyn FnMut(u64, u64),
    ) -> Result<UnmapReport, DmaError> {
        todo!("dma: unmap")
    }

    /// Remove every mapping (client disconnect), with the same guarantees as `unmap`.
    pub fn unmap_all(&self, _notify: &mut dyn FnMut(u64, u64)) -> UnmapReport {
        todo!("dma: unmap_all")
    }

    /// Install (or remove, on disconnect) the server→client path for fd-less mappings.
    pub fn set_remote(&self, _remote: Option<Arc<dyn RemoteDma>>) {
        todo!("dma: set_remote")
    }

    /// DMA_LOGGING_START for `ranges` (iova, size) at `pgsize` (empty = everything).
    pub fn dirty_start(&self, _pgsize: u64, _ranges: &[(u64, u64)]) -> Result<(), DmaError> {
        todo!("dma: dirty_start")
    }

    /// DMA_LOGGING_STOP.
    pub fn dirty_stop(&self) {
        todo!("dma: dirty_stop")
    }

    /// DMA_LOGGING_REPORT: fill `bitmap` (1 bit per `pgsize` page of `[iova, iova+size)`)
    /// and clear the reported bits. On error no bit is cleared.
    pub fn dirty_report(
        &self,
        _iova: u64,
        _size: u64,
        _pgsize: u64,
        _bitmap: &mut [u8],
    ) -> Result<(), DmaError> {
        todo!("dma: dirty_report")
    }

    /// Counters.
    pub fn stats(&self) -> DmaStats {
        todo!("dma: stats")
    }

    /// Install or remove the pin recorder.
    pub fn set_pin_recorder(&self, _recorder: Option<PinRecorder>) {
        todo!("dma: set_pin_recorder")
    }
}

/// A device's handle to DMA: cheap to clone, `Send + Sync`, usable from worker threads.
#[derive(Clone)]
pub struct DmaHandle {
    _space: Arc<DmaSpace>,
}

impl DmaHandle {
    /// Pin the pages `iova_pfns` (arbitrary order, duplicates allowed) with `prot`; write the
    /// host address of each page into `host_addrs[i]`. All-or-nothing.
    pub fn pin_pages(
        &self,
        _iova_pfns: &[u64],
        _prot: Prot,
        _host_addrs: &mut [u64],
    ) -> Result<(), DmaError> {
        todo!("dma: pin_pages")
    }

    /// Unpin pages pinned by `pin_pages`; all-or-nothing (an unpinned page is an error).
    pub fn unpin_pages(&self, _iova_pfns: &[u64]) -> Result<(), DmaError> {
        todo!("dma: unpin_pages")
    }

    /// Copy guest memory at `iova` into `buf`.
    pub fn read(&self, _iova: u64, _buf: &mut [u8]) -> Result<(), DmaError> {
        todo!("dma: read")
    }

    /// Copy `data` into guest memory at `iova`.
    pub fn write(&self, _iova: u64, _data: &[u8]) -> Result<(), DmaError> {
        todo!("dma: write")
    }

    /// Counters of the underlying space.
    pub fn stats(&self) -> DmaStats {
        self._space.stats()
    }

    /// The per-page reference path (no coalescing): same semantics and accounting as
    /// `pin_pages`/`unpin_pages`; the baseline for property tests and benchmarks.
    pub fn naive(&self) -> NaiveDma<'_> {
        NaiveDma { _handle: self }
    }
}

/// The per-page reference implementation of pinning (see [`DmaHandle::naive`]).
pub struct NaiveDma<'a> {
    _handle: &'a DmaHandle,
}

impl NaiveDma<'_> {
    /// Per-page `pin_pages`: one lookup, check and residency operation per page.
    pub fn pin_pages(
        &self,
        _iova_pfns: &[u64],
        _prot: Prot,
        _host_addrs: &mut [u64],
    ) -> Result<(), DmaError> {
        todo!("dma: naive pin_pages")
    }

    /// Per-page `unpin_pages`.
    pub fn unpin_pages(&self, _iova_pfns: &[u64]) -> Result<(), DmaError> {
        todo!("dma: naive unpin_pages")
    }
}
