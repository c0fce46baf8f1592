//! [`NaiveDma`]: the per-page reference path. It runs the same engine as the coalesced path
//! with runs of exactly one page (one lookup, permission check, limit check and residency
//! syscall per page), so semantics and accounting are the same by construction, and property
//! tests and benches compare the two in the same process.

use super::{DmaError, DmaHandle, Prot};

/// The per-page reference implementation of pinning (see [`DmaHandle::naive`]).
pub struct NaiveDma<'a> {
    pub(crate) handle: &'a DmaHandle,
}

impl NaiveDma<'_> {
    /// Per-page `pin_pages`: one lookup, check and residency operation per page.
    pub fn pin_pages(
        &self,
        iova_pfns: &[u64],
        prot: Prot,
        host_addrs: &mut [u64],
    ) -> Result<(), DmaError> {
        self.handle
            .space
            .pin_impl::<false>(iova_pfns, prot, host_addrs)
    }

    /// Per-page `unpin_pages`.
    pub fn unpin_pages(&self, iova_pfns: &[u64]) -> Result<(), DmaError> {
        self.handle.space.unpin_impl::<false>(iova_pfns)
    }
}
