//! [`DmaError`]: every way a DMA operation can fail, with its errno.

use super::Prot;

/// The message of [`DmaError::MapBudget`].
fn map_budget_message(r: &super::budget::BudgetRefusal) -> String {
    if r.pool {
        format!(
            "DMA mapping refused by the process's memory-map budget: this server holds {} \
             fd-backed maps and the budget its process's servers share has no room left \
             for another (the others keep their guarantees)",
            r.used
        )
    } else {
        format!(
            "DMA mapping refused by the process's memory-map budget: this server holds {} \
             fd-backed maps, its cap",
            r.used
        )
    }
}

/// Errors of the DMA layer. [`DmaError::errno`] is the one place that maps them to the errno
/// the protocol layer replies with.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// No mapping covers the address (EFAULT).
    #[error("iova {iova:#x} is not mapped")]
    NotMapped {
        /// The address.
        iova: u64,
    },
    /// The mapping does not grant the requested access (EPERM).
    #[error("access {need:?} at iova {iova:#x} is not permitted by the mapping ({have:?})")]
    Permission {
        /// The address.
        iova: u64,
        /// What the caller asked for.
        need: Prot,
        /// What the mapping grants.
        have: Prot,
    },
    /// The page lies in a mapping the client sent without a file descriptor, so the server
    /// cannot pin it (EFAULT).
    #[error(
        "iova {iova:#x} lies in a DMA mapping without a file descriptor, so its pages cannot be \
         pinned; give QEMU a shared memfd memory backend: `-object \
         memory-backend-memfd,id=mem,size=<guest RAM>,share=on -machine memory-backend=mem`"
    )]
    FdLess {
        /// The address.
        iova: u64,
    },
    /// DMA_MAP of a range overlapping an existing mapping (EEXIST).
    #[error("DMA mapping [{iova:#x}, +{size:#x}) overlaps an existing mapping")]
    Overlap {
        /// Start of the new mapping.
        iova: u64,
        /// Its size.
        size: u64,
    },
    /// DMA_UNMAP of a range whose start or end falls strictly inside a mapping (EINVAL, as
    /// type1v2 answers it). Nothing was unmapped.
    #[error(
        "DMA unmap of [{iova:#x}, +{size:#x}) would split the mapping [{map_iova:#x}, \
         +{map_size:#x}); nothing was unmapped"
    )]
    SplitsMapping {
        /// Start of the requested range.
        iova: u64,
        /// Its size.
        size: u64,
        /// Start of the mapping the range splits.
        map_iova: u64,
        /// Size of that mapping.
        map_size: u64,
    },
    /// Address or size arithmetic would overflow (EINVAL).
    #[error("{what} overflows the address space")]
    Overflow {
        /// What overflowed.
        what: &'static str,
    },
    /// Pinning would exceed the locked-memory limit of policy `Lock` (ENOMEM, as the kernel
    /// reports an exceeded RLIMIT_MEMLOCK for pins).
    #[error("locked-memory limit exceeded: {locked} pages locked, {more} more requested, limit {limit} pages")]
    LimitExceeded {
        /// Pages locked before the call's failing run.
        locked: u64,
        /// Newly locked pages the run needed.
        more: u64,
        /// The limit in pages.
        limit: u64,
    },
    /// Unpin of a page that is not pinned (EINVAL).
    #[error("iova pfn {pfn:#x} is not pinned")]
    NotPinned {
        /// The page number.
        pfn: u64,
    },
    /// A page's pin count would overflow (EOVERFLOW).
    #[error("pin count of iova pfn {pfn:#x} would overflow")]
    PinCountOverflow {
        /// The page number.
        pfn: u64,
    },
    /// More mappings than the negotiated max_dma_maps (ENOSPC).
    #[error("too many DMA mappings (limit {limit})")]
    TooManyMaps {
        /// The limit.
        limit: u32,
    },
    /// The process's budget of fd-backed maps refused the map (ENOMEM, what mmap answers
    /// when the process is out of map count), before anything was mapped: this space's cap,
    /// or what the pool leaves it after the others' holdings and guarantees (see
    /// `dma::budget`).
    #[error("{}", map_budget_message(.0))]
    MapBudget(super::budget::BudgetRefusal),
    /// mmap of the client's file descriptor failed (its errno, else EINVAL).
    #[error("mmap of the DMA mapping's file descriptor failed")]
    Mmap(#[source] std::io::Error),
    /// A residency syscall (mlock/madvise) failed (its errno, else EIO).
    #[error("{op} of pinned pages failed")]
    Residency {
        /// The syscall.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Server→client DMA_READ/DMA_WRITE failed. `errno` is what the client replied (EIO if
    /// it replied 0), or the server's own reason: ETIMEDOUT (no reply in time), EPROTO (a
    /// malformed reply), ECANCELED (the server cancelled the request because the client
    /// waits for a reply of ours: DEVICE_RESET, or a DMA_UNMAP of the range; see
    /// [`DmaError::is_cancelled`]), EDEADLK (requested from the connection thread while the
    /// client waits for its reply: do such DMA on a worker thread).
    #[error("server-to-client DMA at iova {iova:#x} failed (errno {errno})")]
    Remote {
        /// The address of the failing piece.
        iova: u64,
        /// The errno.
        errno: i32,
    },
    /// An fd-less mapping was accessed while no client is connected (ENOTCONN).
    #[error("no client is connected to serve DMA to an fd-less mapping")]
    Disconnected,
    /// A client-sized allocation was refused or failed (ENOMEM).
    #[error("out of memory: {0}")]
    NoMemory(&'static str),
    /// An fd-backed DMA_MAP of a file whose page faults someone else serves (EPERM; see
    /// `backing.rs`).
    #[error(
        "DMA_MAP fd refused: {what} (filesystem magic {magic:#x}); only memfd, shmem/tmpfs \
         (/dev/shm) and hugetlbfs files are accepted, since faults on other files are served by \
         someone a client may control (e.g. a FUSE daemon) and would stall device threads; \
         ServerConfig::allow_any_file_maps (`umdev run --allow-any-file-maps`) lifts this for \
         trusted clients, e.g. QEMU with memory-backend-file on a disk filesystem"
    )]
    BackingRefused {
        /// What the file is (a filesystem name, or "not a regular file").
        what: &'static str,
        /// `fstatfs` f_type.
        magic: i64,
    },
    /// A malformed argument (EINVAL).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The operation conflicts with the current state (EBUSY).
    #[error("busy: {0}")]
    Busy(&'static str),
    /// Device DMA while the guest has Bus Master Enable clear in the PCI command register
    /// (EACCES: the access itself is refused by the device's state, not by the mapping's
    /// permission, which is EPERM).
    #[error(
        "device DMA at iova {iova:#x} refused: the guest has cleared Bus Master Enable in the \
         PCI command register"
    )]
    BusMasterDisabled {
        /// The first address of the refused access.
        iova: u64,
    },
}

impl DmaError {
    /// True for a server→client request the server cancelled (ECANCELED): the guest did
    /// nothing wrong, the access was cut short by a reset or by an unmap of its range. A
    /// device should not report it as a guest error; retrying tells which it was (after an
    /// unmap the retry fails with [`DmaError::NotMapped`]; during a reset the device is
    /// being quiesced anyway).
    pub fn is_cancelled(&self) -> bool {
        matches!(self, DmaError::Remote { errno, .. } if *errno == libc::ECANCELED)
    }

    /// The errno this error is reported with.
    pub fn errno(&self) -> i32 {
        match self {
            DmaError::NotMapped { .. } => libc::EFAULT,
            DmaError::Permission { .. } => libc::EPERM,
            DmaError::FdLess { .. } => libc::EFAULT,
            DmaError::Overlap { .. } => libc::EEXIST,
            DmaError::SplitsMapping { .. } => libc::EINVAL,
            DmaError::Overflow { .. } => libc::EINVAL,
            DmaError::LimitExceeded { .. } => libc::ENOMEM,
            DmaError::NotPinned { .. } => libc::EINVAL,
            DmaError::PinCountOverflow { .. } => libc::EOVERFLOW,
            DmaError::TooManyMaps { .. } => libc::ENOSPC,
            DmaError::MapBudget(_) => libc::ENOMEM,
            DmaError::Mmap(e) => e.raw_os_error().unwrap_or(libc::EINVAL),
            DmaError::Residency { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            DmaError::Remote { errno, .. } => *errno,
            DmaError::Disconnected => libc::ENOTCONN,
            DmaError::NoMemory(_) => libc::ENOMEM,
            DmaError::InvalidArgument(_) => libc::EINVAL,
            DmaError::Busy(_) => libc::EBUSY,
            DmaError::BusMasterDisabled { .. } => libc::EACCES,
            DmaError::BackingRefused { .. } => libc::EPERM,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_errno_fdless_message_names_qemu_memfd_backend() {
        let e = DmaError::FdLess { iova: 0x1000 };
        assert_eq!(e.errno(), libc::EFAULT);
        let msg = e.to_string();
        assert!(msg.contains("memory-backend-memfd"), "{msg}");
        assert!(msg.contains("share=on"), "{msg}");
    }

    #[test]
    fn test_errno_each_variant_maps_to_expected_errno() {
        assert_eq!(DmaError::Overlap { iova: 0, size: 1 }.errno(), libc::EEXIST);
        let split = DmaError::SplitsMapping {
            iova: 0x1000,
            size: 0x1000,
            map_iova: 0,
            map_size: 0x4000,
        };
        assert_eq!(split.errno(), libc::EINVAL);
        let msg = split.to_string();
        assert!(msg.contains("[0x0, +0x4000)"), "{msg}");
        assert!(msg.contains("nothing was unmapped"), "{msg}");
        assert_eq!(
            DmaError::LimitExceeded {
                locked: 0,
                more: 1,
                limit: 0
            }
            .errno(),
            libc::ENOMEM
        );
        assert_eq!(DmaError::TooManyMaps { limit: 1 }.errno(), libc::ENOSPC);
        assert_eq!(DmaError::NotPinned { pfn: 1 }.errno(), libc::EINVAL);
        assert_eq!(DmaError::Disconnected.errno(), libc::ENOTCONN);
        assert_eq!(
            DmaError::BusMasterDisabled { iova: 0x1000 }.errno(),
            libc::EACCES
        );
        let io = std::io::Error::from_raw_os_error(libc::EAGAIN);
        assert_eq!(
            DmaError::Residency {
                op: "mlock",
                source: io
            }
            .errno(),
            libc::EAGAIN
        );
    }
}
