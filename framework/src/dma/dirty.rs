//! Dirty-page log of one region: one bit per tracked page (the page size negotiated by
//! DMA_LOGGING_START), set with atomic OR by writers and read-and-cleared with atomic AND by
//! DMA_LOGGING_REPORT, so no bit set concurrently with a report is lost.

use super::DmaError;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{AcqRel, Acquire},
};

/// Largest bitmap of one region (8 TiB of 4 KiB pages).
pub(crate) const MAX_BITMAP_BYTES: u64 = 256 << 20;

/// The bitmap of one region.
pub(crate) struct DirtyBitmap {
    /// log2 of the tracked page size.
    pub(crate) shift: u32,
    /// Global index (`iova >> shift`) of the first tracked page.
    pub(crate) base: u64,
    /// Tracked pages.
    pub(crate) npages: u64,
    words: Box<[AtomicU64]>,
}

impl DirtyBitmap {
    /// A clean bitmap for the region `[iova, end)` (end > iova) at `1 << shift` bytes a page.
    /// Fails (ENOMEM) past [`MAX_BITMAP_BYTES`] or when the allocation fails: the size is
    /// client-controlled.
    pub(crate) fn new(iova: u64, end: u64, shift: u32) -> Result<DirtyBitmap, DmaError> {
        let base = iova >> shift;
        let npages = ((end - 1) >> shift) - base + 1;
        let nwords = npages.div_ceil(64);
        if nwords.saturating_mul(8) > MAX_BITMAP_BYTES {
            return Err(DmaError::NoMemory(
                "dirty bitmap of this mapping would exceed 256 MiB at this page size",
            ));
        }
        let mut words = Vec::new();
        words
            .try_reserve_exact(nwords as usize)
            .map_err(|_| DmaError::NoMemory("cannot allocate a dirty bitmap"))?;
        words.extend((0..nwords).map(|_| AtomicU64::new(0)));
        Ok(DirtyBitmap {
            shift,
            base,
            npages,
            words: words.into_boxed_slice(),
        })
    }

    /// Mark `[iova, iova + len)` (inside the region, len > 0) dirty.
    pub(crate) fn mark(&self, iova: u64, len: u64) {
        let first = (iova >> self.shift) - self.base;
        let last = ((iova + len - 1) >> self.shift) - self.base;
        let mut page = first;
        while page <= last {
            let word = (page / 64) as usize;
            let bit = page % 64;
            let n = (64 - bit).min(last - page + 1);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if let Some(w) = self.words.get(word) {
                w.fetch_or(mask, AcqRel);
            }
            page += n;
        }
    }

    /// Whether global page `t` is dirty (without clearing it).
    pub(crate) fn peek(&self, t: u64) -> bool {
        if t < self.base || t >= self.base + self.npages {
            return false;
        }
        let page = t - self.base;
        self.words[(page / 64) as usize].load(Acquire) & (1 << (page % 64)) != 0
    }

    /// Read and clear the bits of global pages `[lo, hi)` (clamped to this bitmap), calling
    /// `f(global page)` for each bit that was set.
    pub(crate) fn take(&self, lo: u64, hi: u64, f: &mut dyn FnMut(u64)) {
        let lo = lo.max(self.base) - self.base;
        let hi = hi.min(self.base + self.npages).saturating_sub(self.base);
        let mut page = lo;
        while page < hi {
            let word = (page / 64) as usize;
            let bit = page % 64;
            let n = (64 - bit).min(hi - page);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            let old = self.words[word].fetch_and(!mask, AcqRel) & mask;
            let mut bits = old;
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                f(self.base + word as u64 * 64 + b);
                bits &= bits - 1;
            }
            page += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_mark_then_take_returns_and_clears() {
        let b = DirtyBitmap::new(0x10000, 0x10000 + 200 * 4096, 12).unwrap();
        b.mark(0x10000 + 4096 * 63, 3 * 4096); // pages 63..66
        b.mark(0x10000 + 4096 * 150 + 10, 1);
        let mut got = Vec::new();
        b.take(0, u64::MAX, &mut |p| got.push(p - 0x10));
        assert_eq!(got, vec![63, 64, 65, 150]);
        got.clear();
        b.take(0, u64::MAX, &mut |p| got.push(p));
        assert!(got.is_empty());
    }

    #[test]
    fn test_new_huge_region_is_refused_not_allocated() {
        assert!(matches!(
            DirtyBitmap::new(0, 1 << 46, 12),
            Err(DmaError::NoMemory(_))
        ));
    }

    #[test]
    fn test_take_subrange_leaves_other_bits() {
        let b = DirtyBitmap::new(0, 128 * 4096, 12).unwrap();
        b.mark(0, 128 * 4096);
        let mut n = 0;
        b.take(10, 20, &mut |_| n += 1);
        assert_eq!(n, 10);
        let mut rest = 0;
        b.take(0, 128, &mut |_| rest += 1);
        assert_eq!(rest, 118);
    }
}
