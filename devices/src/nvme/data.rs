//! Moving a command's data between a host buffer and the guest pages of its [`Transfer`].
//!
//! The pages are pinned with one `pin_pages` call on the whole array (so the DMA layer
//! coalesces a guest's contiguous buffer into one run) and copied through the pins with
//! [`PinnedPages`], under the submission queue's `pinning` lock (shared), which the unmap
//! notifier takes exclusively to wait for them; the pins are gone when the call returns. Memory mapped without
//! an fd cannot be pinned (`FdLess`): the data then goes through the DMA layer's copies
//! (DMA_READ/DMA_WRITE messages to the client), one per run of consecutive pages, without
//! the lock (the notifier must not wait for the client).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use umdev::dma::{DmaError, DmaHandle, PinnedPages, Prot, PAGE_SHIFT, PAGE_SIZE};

use super::prp::Transfer;

/// What a data copy needs from its queue.
pub struct DataPath<'a> {
    /// The controller's DMA handle.
    pub dma: &'a DmaHandle,
    /// The submission queue's `pinning` lock (shared: several of its commands may hold
    /// pins at once; the unmap notifier takes it exclusively).
    pub pinning: &'a RwLock<()>,
    /// Pages this controller holds pinned for data (for the tests' leak checks).
    pub pins_held: &'a AtomicU64,
}

impl DataPath<'_> {
    /// Copy `data` (exactly `t.len` bytes) into the guest pages of `t`.
    pub fn to_guest(&self, t: &Transfer, data: &[u8]) -> Result<(), DmaError> {
        debug_assert_eq!(data.len() as u64, t.len);
        if t.len == 0 {
            return Ok(());
        }
        {
            let _pinning = self.pinning.read().unwrap_or_else(|e| e.into_inner());
            match self.pin(t, Prot::WRITE) {
                Ok(p) => return self.unpin_after(p, |p| p.write(t.offset, data)),
                Err(DmaError::FdLess { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        for (iova, at, n) in runs(t) {
            self.dma.write(iova, &data[at..at + n])?;
        }
        Ok(())
    }

    /// Copy the guest pages of `t` into `buf` (exactly `t.len` bytes).
    pub fn from_guest(&self, t: &Transfer, buf: &mut [u8]) -> Result<(), DmaError> {
        debug_assert_eq!(buf.len() as u64, t.len);
        if t.len == 0 {
            return Ok(());
        }
        {
            let _pinning = self.pinning.read().unwrap_or_else(|e| e.into_inner());
            match self.pin(t, Prot::READ) {
                Ok(p) => return self.unpin_after(p, |p| p.read(t.offset, buf)),
                Err(DmaError::FdLess { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        for (iova, at, n) in runs(t) {
            self.dma.read(iova, &mut buf[at..at + n])?;
        }
        Ok(())
    }

    fn pin(&self, t: &Transfer, prot: Prot) -> Result<PinnedPages, DmaError> {
        let p = PinnedPages::pin(self.dma, &t.pfns, prot)?;
        self.pins_held
            .fetch_add(t.pfns.len() as u64, Ordering::SeqCst);
        Ok(p)
    }

    fn unpin_after(
        &self,
        p: PinnedPages,
        f: impl FnOnce(&PinnedPages) -> Result<(), DmaError>,
    ) -> Result<(), DmaError> {
        let r = f(&p);
        let n = p.pfns().len() as u64;
        let unpinned = p.unpin();
        self.pins_held.fetch_sub(n, Ordering::SeqCst);
        r.and(unpinned)
    }
}

/// The runs of consecutive pages of `t`: `(iova, position in the buffer, bytes)`.
pub fn runs(t: &Transfer) -> Vec<(u64, usize, usize)> {
    let mut out: Vec<(u64, usize, usize)> = Vec::new();
    let mut at = 0u64;
    let mut prev: Option<u64> = None;
    for (i, &pfn) in t.pfns.iter().enumerate() {
        let start = if i == 0 { t.offset } else { 0 };
        let n = (PAGE_SIZE - start).min(t.len - at);
        match (out.last_mut(), prev) {
            (Some(last), Some(p)) if p.checked_add(1) == Some(pfn) => last.2 += n as usize,
            _ => out.push(((pfn << PAGE_SHIFT) + start, at as usize, n as usize)),
        }
        prev = Some(pfn);
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_runs_merge_consecutive_pages_only() {
        let t = Transfer {
            pfns: vec![5, 6, 9, 10],
            offset: 0x800,
            len: 0x3000,
        };
        assert_eq!(
            runs(&t),
            vec![(0x5800, 0, 0x1800), (0x9000, 0x1800, 0x1800)]
        );
    }
}
