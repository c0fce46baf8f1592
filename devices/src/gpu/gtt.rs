//! The GTT: guest-written entries mapping GTT pages to guest IOVA pages, and the pin cache
//! behind them.
//!
//! Pinning policy (documented in `protocol-docs/devices/gpu.md`): a page is pinned the
//! first time a command uses its entry — all missing entries of the surface in **one**
//! `pin_pages` array call, so a surface backed by contiguous guest pages costs one coalesced
//! run and a scattered one costs one run per piece — and stays pinned (gvt-style) until the
//! entry is rewritten, the device is reset, the client disconnects, or the client unmaps
//! the page (unmap notifier).
//!
//! Locking: the worker never calls `pin_pages` while holding the GTT lock (it pins unlocked
//! and installs the pins only if no invalidation happened meanwhile, tracked by an epoch
//! counter; stale pins are released). It holds the lock while it copies pixels from pinned
//! pages, so an invalidation (which takes the lock) waits for the copy and no pinned page is
//! touched after its pin is dropped. The unmap notifier, reset and disconnect also wait for
//! pin calls in flight ([`GttCell::quiesce`]): when they return, the device holds no DMA pin
//! that is not in the table.

use std::sync::{Condvar, Mutex, MutexGuard};

use umdev::dma::{DmaHandle, Prot, PAGE_SHIFT, PAGE_SIZE};

use super::error::GpuError;
use super::regs::{GTT_ADDR_MASK, GTT_VALID, GTT_WRITABLE};
use super::render::Surface;

/// How often the worker retries pinning when invalidations race with it.
const PIN_RETRIES: u32 = 8;

/// One pinned page behind a GTT entry.
#[derive(Clone, Copy, Debug)]
struct Pin {
    /// IOVA page number that was pinned.
    pfn: u64,
    /// Host address of the page.
    host: u64,
    /// Pinned with write permission.
    writable: bool,
}

/// The GTT entries and their pins.
#[derive(Debug)]
pub struct Gtt {
    entries: Vec<u64>,
    pins: Vec<Option<Pin>>,
    pinned: usize,
    epoch: u64,
    /// `pin_pages` calls in flight (worker), not yet installed or released.
    pinning: u32,
}

/// Lock a mutex, tolerating poisoning (a panicked holder must not take the device down).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Release `pfns` (one array call), logging a failure (which would be a bookkeeping bug).
pub fn release(dma: Option<&DmaHandle>, pfns: &[u64]) {
    if pfns.is_empty() {
        return;
    }
    match dma {
        Some(dma) => {
            if let Err(e) = dma.unpin_pages(pfns) {
                tracing::warn!(error = %e, count = pfns.len(), "gpu: unpin failed");
            }
        }
        None => tracing::warn!(count = pfns.len(), "gpu: pins without a DMA handle"),
    }
}

impl Gtt {
    /// `n` invalid entries.
    pub fn new(n: u32) -> Gtt {
        Gtt {
            entries: vec![0; n as usize],
            pins: vec![None; n as usize],
            pinned: 0,
            epoch: 0,
            pinning: 0,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> u32 {
        self.entries.len() as u32
    }

    /// True if the GTT has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entry `i` (0 past the end).
    pub fn entry(&self, i: u32) -> u64 {
        self.entries.get(i as usize).copied().unwrap_or(0)
    }

    /// Number of entries holding a pin.
    pub fn pins_held(&self) -> usize {
        self.pinned
    }

    fn take_pin(&mut self, i: usize) -> Option<u64> {
        let p = self.pins.get_mut(i)?.take()?;
        self.pinned -= 1;
        Some(p.pfn)
    }

    /// Guest write of entry `i`. Returns the pfn whose pin the change dropped (the caller
    /// unpins it after releasing the lock).
    pub fn set_entry(&mut self, i: u32, value: u64) -> Option<u64> {
        let i = i as usize;
        let old = *self.entries.get(i)?;
        if old == value {
            return None;
        }
        self.entries[i] = value;
        self.epoch = self.epoch.wrapping_add(1);
        self.take_pin(i)
    }

    /// Invalidate entries `start..start+count` (clamped to the table); returns the pfns of
    /// the pins this dropped.
    pub fn invalidate(&mut self, start: u32, count: u32) -> Vec<u64> {
        let end = start.saturating_add(count).min(self.len());
        let mut out = Vec::new();
        for i in start.min(end)..end {
            self.entries[i as usize] = 0;
            out.extend(self.take_pin(i as usize));
        }
        self.epoch = self.epoch.wrapping_add(1);
        out
    }

    /// Drop every pin of a page in `[first_pfn, last_pfn]`; returns the pfns to unpin.
    pub fn take_pins_in(&mut self, first_pfn: u64, last_pfn: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for i in 0..self.pins.len() {
            if matches!(self.pins[i], Some(p) if (first_pfn..=last_pfn).contains(&p.pfn)) {
                out.extend(self.take_pin(i));
            }
        }
        self.epoch = self.epoch.wrapping_add(1);
        out
    }

    /// Drop every pin; returns the pfns to unpin.
    pub fn take_all_pins(&mut self) -> Vec<u64> {
        self.take_pins_in(0, u64::MAX)
    }

    /// Reset: invalidate every entry. Pins must have been taken first.
    pub fn clear_entries(&mut self) {
        self.entries.fill(0);
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Every entry, in order (what live migration saves: the entries, not the pins).
    pub fn entries(&self) -> &[u64] {
        &self.entries
    }

    /// Live migration load: replace every entry with `entries` (one per entry, checked by
    /// the caller). Pins must have been taken first; pages are pinned again on first use.
    pub fn load_entries(&mut self, entries: &[u64]) {
        debug_assert_eq!(entries.len(), self.entries.len());
        debug_assert_eq!(self.pinned, 0, "pins must be taken before a load");
        let n = entries.len().min(self.entries.len());
        self.entries[..n].copy_from_slice(&entries[..n]);
        self.entries[n..].fill(0);
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Check entries `start..start+count` for a command; returns the (entry index, pfn) of
    /// those that still need a pin with the requested access.
    fn missing(&self, start: u32, count: u32, write: bool) -> Result<Vec<(usize, u64)>, GpuError> {
        let end = start.checked_add(count).ok_or(GpuError::GttRange)?;
        if end > self.len() {
            return Err(GpuError::GttRange);
        }
        let mut missing = Vec::new();
        for i in start..end {
            let e = self.entries[i as usize];
            if e & GTT_VALID == 0 {
                return Err(GpuError::GttInvalid(i));
            }
            if write && e & GTT_WRITABLE == 0 {
                return Err(GpuError::GttReadOnly(i));
            }
            let pfn = (e & GTT_ADDR_MASK) >> PAGE_SHIFT;
            match self.pins[i as usize] {
                Some(p) if p.pfn == pfn && (p.writable || !write) => {}
                _ => missing.push((i as usize, pfn)),
            }
        }
        Ok(missing)
    }
}

/// The GTT behind its lock, with a condition variable for pin calls in flight.
#[derive(Debug)]
pub struct GttCell {
    gtt: Mutex<Gtt>,
    pins_done: Condvar,
}

impl GttCell {
    /// `n` invalid entries.
    pub fn new(n: u32) -> GttCell {
        GttCell {
            gtt: Mutex::new(Gtt::new(n)),
            pins_done: Condvar::new(),
        }
    }

    /// Lock the table.
    pub fn lock(&self) -> MutexGuard<'_, Gtt> {
        lock(&self.gtt)
    }

    /// Invalidate pin calls in flight and wait until they have been released; returns the
    /// table locked, with no pin call in flight.
    pub fn quiesce(&self) -> MutexGuard<'_, Gtt> {
        let mut g = self.lock();
        g.epoch = g.epoch.wrapping_add(1);
        while g.pinning > 0 {
            g = match self.pins_done.wait(g) {
                Ok(g) => g,
                Err(e) => e.into_inner(),
            };
        }
        g
    }

    /// Pin (if needed) GTT entries `start..start+count` and return them locked, ready for
    /// pixel copies. `write` asks for write access (READBACK).
    pub fn acquire<'a>(
        &'a self,
        dma: &DmaHandle,
        start: u32,
        count: u32,
        write: bool,
    ) -> Result<PinnedSurface<'a>, GpuError> {
        let prot = if write { Prot::RW } else { Prot::READ };
        let fault = |source| GpuError::GttFault {
            start,
            end: start.saturating_add(count),
            source,
        };
        for _ in 0..PIN_RETRIES {
            let mut guard = self.lock();
            let missing = guard.missing(start, count, write)?;
            if missing.is_empty() {
                return Ok(PinnedSurface {
                    guard,
                    start: start as usize,
                    count: count as usize,
                });
            }
            let epoch = guard.epoch;
            guard.pinning += 1;
            drop(guard);

            let pfns: Vec<u64> = missing.iter().map(|&(_, pfn)| pfn).collect();
            let mut hosts = vec![0u64; pfns.len()];
            let result = dma.pin_pages(&pfns, prot, &mut hosts);

            let mut guard = self.lock();
            let stale = guard.epoch != epoch;
            let mut to_release = Vec::new();
            if result.is_ok() {
                if stale {
                    // Something was invalidated while we pinned: our view may be stale.
                    to_release.clone_from(&pfns);
                } else {
                    for (&(i, pfn), &host) in missing.iter().zip(&hosts) {
                        let pin = Pin {
                            pfn,
                            host,
                            writable: write,
                        };
                        match guard.pins[i].replace(pin) {
                            // A read-only pin upgraded to read-write.
                            Some(old) => to_release.push(old.pfn),
                            None => guard.pinned += 1,
                        }
                    }
                }
            }
            if !to_release.is_empty() {
                drop(guard);
                release(Some(dma), &to_release);
                guard = self.lock();
            }
            guard.pinning -= 1;
            self.pins_done.notify_all();
            drop(guard);
            result.map_err(fault)?;
            // Next round: everything is pinned (or re-validate after an invalidation).
        }
        Err(fault(umdev::dma::DmaError::NotMapped {
            iova: u64::from(start) << PAGE_SHIFT,
        }))
    }
}

/// GTT entries `start..start+count`, all pinned, with the GTT lock held.
pub struct PinnedSurface<'a> {
    guard: MutexGuard<'a, Gtt>,
    start: usize,
    count: usize,
}

impl PinnedSurface<'_> {
    /// Walk `[off, off + len)` page by page: `f(host_addr, buf_offset, n)`.
    fn walk(&self, off: u64, len: usize, mut f: impl FnMut(u64, usize, usize)) -> bool {
        let Some(end) = off.checked_add(len as u64) else {
            return false;
        };
        if end > (self.count as u64) * PAGE_SIZE {
            return false;
        }
        let mut pos = off;
        let mut done = 0usize;
        while done < len {
            let page = (pos / PAGE_SIZE) as usize;
            let in_page = pos % PAGE_SIZE;
            let n = ((PAGE_SIZE - in_page) as usize).min(len - done);
            let Some(Some(pin)) = self.guard.pins.get(self.start + page) else {
                return false;
            };
            f(pin.host + in_page, done, n);
            done += n;
            pos += n as u64;
        }
        true
    }
}

impl Surface for PinnedSurface<'_> {
    fn read(&self, off: u64, buf: &mut [u8]) -> bool {
        let dst = buf.as_mut_ptr();
        self.walk(off, buf.len(), |host, at, n| {
            // SAFETY: `host..host+n` lies in one page pinned by `pin_pages` (the pin is in
            // the table and cannot be dropped while we hold the GTT lock), so the mapping is
            // alive and readable; `at + n <= buf.len()` by construction of `walk`. Guest
            // memory is copied with a raw copy, never referenced.
            unsafe { std::ptr::copy_nonoverlapping(host as *const u8, dst.add(at), n) };
        })
    }

    fn write(&self, off: u64, data: &[u8]) -> bool {
        // `acquire(write = true)` pinned every entry writable; refuse otherwise.
        let all_writable = self.guard.pins[self.start..self.start + self.count]
            .iter()
            .all(|p| p.is_some_and(|p| p.writable));
        if !all_writable {
            return false;
        }
        let src = data.as_ptr();
        self.walk(off, data.len(), |host, at, n| {
            // SAFETY: as in `read`, and the page was pinned with write permission (checked
            // above), so the mapping is writable.
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), host as *mut u8, n) };
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_set_entry_same_value_keeps_pin() {
        let mut g = Gtt::new(4);
        g.set_entry(1, 0x5000 | GTT_VALID);
        g.pins[1] = Some(Pin {
            pfn: 5,
            host: 0,
            writable: false,
        });
        g.pinned = 1;
        assert_eq!(g.set_entry(1, 0x5000 | GTT_VALID), None);
        assert_eq!(g.pins_held(), 1);
        assert_eq!(g.set_entry(1, 0x6000 | GTT_VALID), Some(5));
        assert_eq!(g.pins_held(), 0);
    }

    #[test]
    fn test_set_entry_past_end_is_ignored() {
        let mut g = Gtt::new(2);
        assert_eq!(g.set_entry(2, 1), None);
        assert_eq!(g.entry(2), 0);
    }

    #[test]
    fn test_missing_reports_invalid_readonly_and_range() {
        let mut g = Gtt::new(4);
        g.set_entry(0, 0x1000 | GTT_VALID);
        g.set_entry(1, 0x2000 | GTT_VALID | GTT_WRITABLE);
        assert!(matches!(
            g.missing(0, 3, false),
            Err(GpuError::GttInvalid(2))
        ));
        assert!(matches!(
            g.missing(0, 2, true),
            Err(GpuError::GttReadOnly(0))
        ));
        assert!(matches!(g.missing(3, 2, false), Err(GpuError::GttRange)));
        assert!(matches!(
            g.missing(u32::MAX, 2, false),
            Err(GpuError::GttRange)
        ));
        assert_eq!(g.missing(0, 2, false).unwrap(), vec![(0, 1), (1, 2)]);
    }

    #[test]
    fn test_invalidate_clamps_and_returns_pins_in_order() {
        let mut g = Gtt::new(4);
        for i in 0..4u32 {
            g.set_entry(i, (0x1000 * u64::from(i + 1)) | GTT_VALID);
            g.pins[i as usize] = Some(Pin {
                pfn: u64::from(i + 1),
                host: 0,
                writable: false,
            });
        }
        g.pinned = 4;
        assert_eq!(g.invalidate(2, u32::MAX), vec![3, 4]);
        assert_eq!(
            (g.entry(2), g.entry(3), g.entry(1)),
            (0, 0, 0x2000 | GTT_VALID)
        );
        assert_eq!(g.invalidate(7, 3), Vec::<u64>::new());
        assert_eq!(g.pins_held(), 2);
    }

    #[test]
    fn test_take_pins_in_only_takes_range() {
        let mut g = Gtt::new(3);
        for (i, pfn) in [(0usize, 10u64), (1, 20), (2, 30)] {
            g.pins[i] = Some(Pin {
                pfn,
                host: 0,
                writable: false,
            });
        }
        g.pinned = 3;
        assert_eq!(g.take_pins_in(15, 25), vec![20]);
        assert_eq!(g.pins_held(), 2);
        let mut rest = g.take_all_pins();
        rest.sort();
        assert_eq!(rest, vec![10, 30]);
        assert_eq!(g.pins_held(), 0);
    }
}
