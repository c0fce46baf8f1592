//! DEVICE_FEATURE DMA_LOGGING_START / STOP / REPORT on a [`DmaSpace`].
//!
//! START gives every fd-backed mapping (and every later one, while logging is on) a clean
//! [`DirtyBitmap`] at the requested page size. fd-less mappings are not logged: the client
//! performs DMA_WRITEs to them itself and sees them in its own dirty tracking. The requested ranges are validated but the
//! whole space is tracked (a superset is always correct). A page is dirty when `dma_rw`
//! wrote it, when it was pinned writable, or — at REPORT time — while it is still pinned
//! writable (the device may write it at any moment, as the kernel's type1 reports every
//! pinned page). REPORT validates everything first (logging on, page size, alignment,
//! overflow, bitmap length) and only then reads-and-clears bits, so an error clears none.
//! As for the kernel's `vfio_device_feature_dma_logging_report`, the report page size may
//! differ from the logging one: a larger report page ORs tracked pages, a smaller one
//! replicates a tracked page's bit (and a tracked page only partly inside the range is
//! reported but not cleared). Gaps between mappings report clean.

use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;

use super::dirty::DirtyBitmap;
use super::pin_table::{COUNT_MASK, WRITABLE};
use super::{DmaError, DmaSpace, PAGE_SHIFT, PAGE_SIZE};

impl DmaSpace {
    /// DMA_LOGGING_START.
    pub(crate) fn dirty_start_impl(
        &self,
        pgsize: u64,
        ranges: &[(u64, u64)],
    ) -> Result<(), DmaError> {
        if !pgsize.is_power_of_two() || pgsize < PAGE_SIZE {
            return Err(DmaError::InvalidArgument(
                "dirty page size must be a power of two of at least 4096",
            ));
        }
        for &(iova, size) in ranges {
            iova.checked_add(size).ok_or(DmaError::Overflow {
                what: "dirty logging range",
            })?;
        }
        let _w = self.map_lock();
        if self.dirty_active.load(Relaxed) {
            return Err(DmaError::Busy("dirty logging is already started"));
        }
        let shift = pgsize.trailing_zeros();
        // Build every bitmap first (allocation may fail), then install them.
        let table = self.table.load();
        let mut bitmaps = Vec::new();
        for r in table.iter().filter(|r| !r.is_fdless()) {
            bitmaps.push((r, Arc::new(DirtyBitmap::new(r.iova, r.end, shift)?)));
        }
        for (r, b) in bitmaps {
            r.dirty.store(Some(b));
        }
        self.dirty_shift.store(shift, Relaxed);
        self.dirty_active.store(true, Release);
        tracing::debug!(pgsize, nranges = ranges.len(), "dirty logging started");
        Ok(())
    }

    /// DMA_LOGGING_STOP (no-op when not started).
    pub(crate) fn dirty_stop_impl(&self) {
        let _w = self.map_lock();
        self.dirty_active.store(false, Release);
        for r in self.table.load().iter() {
            r.dirty.store(None);
        }
    }

    /// DMA_LOGGING_REPORT.
    pub(crate) fn dirty_report_impl(
        &self,
        iova: u64,
        size: u64,
        pgsize: u64,
        bitmap: &mut [u8],
    ) -> Result<(), DmaError> {
        let _w = self.map_lock();
        if !self.dirty_active.load(Relaxed) {
            return Err(DmaError::InvalidArgument("dirty logging is not started"));
        }
        if !pgsize.is_power_of_two() || pgsize < PAGE_SIZE {
            return Err(DmaError::InvalidArgument(
                "report page size must be a power of two of at least 4096",
            ));
        }
        let rshift = pgsize.trailing_zeros();
        if size == 0 || !iova.is_multiple_of(pgsize) || !size.is_multiple_of(pgsize) {
            return Err(DmaError::InvalidArgument(
                "report range must be non-empty and aligned to the report page size",
            ));
        }
        let end = iova.checked_add(size).ok_or(DmaError::Overflow {
            what: "dirty report range",
        })?;
        let nbytes = usize::try_from((size >> rshift).div_ceil(8)).unwrap_or(usize::MAX);
        if bitmap.len() < nbytes {
            return Err(DmaError::InvalidArgument(
                "dirty bitmap buffer is too small",
            ));
        }
        // No error past this point: bits are cleared only now.
        let out = &mut bitmap[..nbytes];
        out.fill(0);
        // Mark every report page overlapping [a, b) (a < b) dirty: one bit when the report
        // page is larger than the tracked page, replicated bits when it is smaller.
        let mut set = |a: u64, b: u64| {
            let (a, b) = (a.max(iova), b.min(end));
            if a < b {
                for bit in (a - iova) >> rshift..=(b - 1 - iova) >> rshift {
                    out[(bit / 8) as usize] |= 1 << (bit % 8);
                }
            }
        };
        let table = self.table.load();
        for r in table.overlapping(iova, end) {
            if let Some(b) = r.dirty.load_full() {
                let ts = b.shift;
                // Tracked pages wholly inside the range are read and cleared; a tracked page
                // straddling an edge of the range (report page smaller than the tracked one)
                // is only read: clearing it would lose the dirtiness of its other part.
                let (first, last) = (iova >> ts, (end - 1) >> ts);
                let full_lo = iova.div_ceil(1 << ts);
                let full_hi = end >> ts;
                for t in [first, last] {
                    if (t < full_lo || t >= full_hi) && b.peek(t) {
                        set(t << ts, (t + 1) << ts);
                    }
                }
                if full_lo < full_hi {
                    b.take(full_lo, full_hi, &mut |t| set(t << ts, (t + 1) << ts));
                }
            }
            if r.pins.pinned.load(Relaxed) > 0 {
                let first = (iova.max(r.iova) - r.iova) >> PAGE_SHIFT;
                let last = (end.min(r.end) - r.iova).div_ceil(PAGE_SIZE);
                for (lo, hi) in r.pins.allocated_ranges() {
                    for page in lo.max(first)..hi.min(last) {
                        let v = r.pins.get(page);
                        if v & COUNT_MASK != 0 && v & WRITABLE != 0 {
                            let a = r.iova + (page << PAGE_SHIFT);
                            set(a, a + PAGE_SIZE);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
