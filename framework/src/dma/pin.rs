//! The pin/unpin engine shared by the coalesced path (`COALESCE = true`) and the per-page
//! reference path (`COALESCE = false`): one code path, the run length is the only difference.
//!
//! `pin`: for each run (see [`super::coalesce`]): closing/fd-less/permission checks, count
//! the pages going 0→1 (and refcount overflow), check the lock limit for exactly those pages
//! *before* touching anything, one residency syscall, then commit the refcounts. On any
//! failure the runs already pinned by this call are released through the unpin path, so the
//! accounting is exactly as before the call (dirty bits set by the call stay set: never
//! report a page clean by mistake).
//!
//! `unpin`: phase 1 decrements every run's counts without side effects (a page not pinned
//! restores what this call decremented and fails the call); phase 2 releases pages whose
//! count reached zero, with one munlock per maximal locked sub-range. Duplicated pages in one
//! array are handled because phase 1 sees each decrement in order and phase 2 releases each
//! page once (its flags are cleared the first time).
//!
//! Both pin entry points refuse first if Bus Master Enable is clear (one relaxed load, see
//! the module docs of [`super`]); the unpin paths never do.
//!
//! All of it runs under the space's pin lock (the analog of type1's `iommu->lock`), which
//! orders pins against unmap's closing and forced release; lookups inside are lock-free.

use std::sync::atomic::Ordering::{Acquire, Relaxed};

use super::coalesce::for_each_run;
use super::map_table::MapTable;
use super::pin_table::{add_locked, sub_locked};
use super::region::Region;
use super::residency;
use super::{DmaError, DmaSpace, PinPolicy, Prot, PAGE_SHIFT};

impl DmaSpace {
    /// `pin_pages` through either path. Never inlined, so a one-page `pin_pages` and the
    /// per-page path run the very same machine code (`pin_impl::<false>`).
    #[inline(never)]
    pub(crate) fn pin_impl<const COALESCE: bool>(
        &self,
        pfns: &[u64],
        prot: Prot,
        out: &mut [u64],
    ) -> Result<(), DmaError> {
        if out.len() < pfns.len() {
            return Err(DmaError::InvalidArgument(
                "host_addrs is shorter than iova_pfns",
            ));
        }
        check_pin_prot(prot)?;
        self.check_bus_master(|| pfns.first().map_or(0, |&p| p << PAGE_SHIFT))?;
        if pfns.is_empty() {
            return Ok(());
        }
        let _pin = self.pin_lock();
        let table = self.table.load();
        let policy = self.policy();
        let mut done = 0usize;
        let res = for_each_run::<COALESCE, _>(&table, pfns, |region, i, j| {
            let out = &mut out[i..j];
            if j == i + 1 {
                // Lets the compiler specialise the one-page run (n == 1) of scattered arrays.
                self.pin_run(region, pfns[i], 1, prot, policy, Some(out))?;
            } else {
                self.pin_run(region, pfns[i], (j - i) as u64, prot, policy, Some(out))?;
            }
            done = j;
            Ok(())
        });
        if let Err(e) = res {
            if done > 0 {
                if let Err(e2) = self.unpin_locked::<COALESCE>(&table, &pfns[..done]) {
                    tracing::error!(err = %e2, "releasing a failed pin call's pages failed");
                }
            }
            tracing::debug!(err = %e, npages = pfns.len(), "pin_pages failed, call undone");
            return Err(e);
        }
        Ok(())
    }

    /// Pin `[first, first + n)` (inside `region`) and write per-page host addresses to `out`.
    /// Caller holds the pin lock.
    #[inline]
    fn pin_run(
        &self,
        region: &Region,
        first: u64,
        n: u64,
        prot: Prot,
        policy: PinPolicy,
        out: Option<&mut [u64]>,
    ) -> Result<(), DmaError> {
        let iova = first << PAGE_SHIFT;
        if region.closing.load(Relaxed) {
            return Err(DmaError::NotMapped { iova });
        }
        if region.is_fdless() {
            return Err(DmaError::FdLess { iova });
        }
        if !region.prot.allows(prot) {
            return Err(DmaError::Permission {
                iova,
                need: prot,
                have: region.prot,
            });
        }
        let lo = first - region.start_pfn;
        let hi = lo + n;
        let new = region
            .pins
            .count_new(lo, hi)
            .map_err(|p| DmaError::PinCountOverflow {
                pfn: region.start_pfn + p,
            })?;
        let lock = policy == PinPolicy::Lock;
        if new > 0 {
            let addr = region.host + (lo << PAGE_SHIFT);
            let syscalls = &self.counters.residency_syscalls;
            match policy {
                PinPolicy::Translate => {}
                PinPolicy::Lock => {
                    let locked = self.counters.locked_pages.load(Relaxed);
                    let limit = self.lock_limit_pages.load(Relaxed);
                    if locked.checked_add(new).is_none_or(|t| t > limit) {
                        return Err(DmaError::LimitExceeded {
                            locked,
                            more: new,
                            limit,
                        });
                    }
                    if let Err(e) = residency::lock(addr, n, syscalls) {
                        // mlock may have locked part of the run before failing: unlock the
                        // pages no pin holds locked, so the kernel's view matches ours.
                        let host = region.host;
                        region.pins.unlocked_subranges(lo, hi, &mut |a, b| {
                            residency::unlock(host + (a << PAGE_SHIFT), b - a, syscalls)
                        });
                        return Err(e);
                    }
                }
                PinPolicy::Populate => residency::populate(addr, n, prot.write, syscalls)?,
            }
        }
        let added = region.pins.commit_pin(lo, hi, lock, prot.write);
        add_locked(&self.counters.pinned_pages, added);
        if lock {
            add_locked(&self.counters.locked_pages, added);
        }
        if prot.write {
            self.mark_dirty(region, iova, n << PAGE_SHIFT);
        }
        if let Some(out) = out {
            let mut addr = region.host + (lo << PAGE_SHIFT);
            for slot in out.iter_mut() {
                *slot = addr;
                addr += 1 << PAGE_SHIFT;
            }
        }
        Ok(())
    }

    /// `unpin_pages` through either path (never inlined, see `pin_impl`).
    #[inline(never)]
    pub(crate) fn unpin_impl<const COALESCE: bool>(&self, pfns: &[u64]) -> Result<(), DmaError> {
        if pfns.is_empty() {
            return Ok(());
        }
        let _pin = self.pin_lock();
        let table = self.table.load();
        self.unpin_locked::<COALESCE>(&table, pfns)
    }

    /// Unpin with the pin lock held (also the undo of a failed pin call).
    fn unpin_locked<const COALESCE: bool>(
        &self,
        table: &MapTable,
        pfns: &[u64],
    ) -> Result<(), DmaError> {
        // Phase 1: decrement, no side effects.
        let mut done = 0usize;
        let mut runs = 0usize;
        let mut single: Option<(&Region, u64, u64)> = None;
        let res = for_each_run::<COALESCE, _>(table, pfns, |region, i, j| {
            let lo = pfns[i] - region.start_pfn;
            let hi = lo + (j - i) as u64;
            let dec = if j == i + 1 {
                region.pins.decrement(lo, lo + 1)
            } else {
                region.pins.decrement(lo, hi)
            };
            dec.map_err(|p| DmaError::NotPinned {
                pfn: region.start_pfn + p,
            })?;
            done = j;
            runs += 1;
            single = Some((region, lo, hi));
            Ok(())
        });
        if let Err(e) = res {
            let undo = for_each_run::<COALESCE, _>(table, &pfns[..done], |region, i, j| {
                let lo = pfns[i] - region.start_pfn;
                region.pins.increment_back(lo, lo + (j - i) as u64);
                Ok(())
            });
            if let Err(e2) = undo {
                tracing::error!(err = %e2, "undoing a failed unpin call failed");
            }
            return Err(e);
        }
        // Phase 2: release pages whose count reached zero.
        match (runs, single) {
            (1, Some((region, lo, hi))) => self.release_run(region, lo, hi),
            _ => {
                let res = for_each_run::<COALESCE, _>(table, pfns, |region, i, j| {
                    let lo = pfns[i] - region.start_pfn;
                    if j == i + 1 {
                        self.release_run(region, lo, lo + 1);
                    } else {
                        self.release_run(region, lo, lo + (j - i) as u64);
                    }
                    Ok(())
                });
                if let Err(e) = res {
                    tracing::error!(err = %e, "releasing unpinned pages failed");
                }
            }
        }
        Ok(())
    }

    /// Release the zero-count pages of `[lo, hi)` of `region` (munlock, counters).
    #[inline]
    fn release_run(&self, region: &Region, lo: u64, hi: u64) {
        let syscalls = &self.counters.residency_syscalls;
        let host = region.host;
        let rel = region.pins.release_zeroed(lo, hi, &mut |a, b| {
            residency::unlock(host + (a << PAGE_SHIFT), b - a, syscalls)
        });
        sub_locked(&self.counters.pinned_pages, rel.pinned);
        sub_locked(&self.counters.locked_pages, rel.locked);
    }

    /// `pin_range`: pin `npages` consecutive pages inside one mapping.
    pub(crate) fn pin_range_impl(
        &self,
        iova_pfn: u64,
        npages: u64,
        prot: Prot,
    ) -> Result<u64, DmaError> {
        check_pin_prot(prot)?;
        self.check_bus_master(|| iova_pfn << PAGE_SHIFT)?;
        let _pin = self.pin_lock();
        let table = self.table.load();
        let region = range_region(&table, iova_pfn, npages)?;
        self.pin_run(region, iova_pfn, npages, prot, self.policy(), None)?;
        Ok(region.host + ((iova_pfn - region.start_pfn) << PAGE_SHIFT))
    }

    /// `unpin_range`: the inverse of `pin_range`, all-or-nothing.
    pub(crate) fn unpin_range_impl(&self, iova_pfn: u64, npages: u64) -> Result<(), DmaError> {
        let _pin = self.pin_lock();
        let table = self.table.load();
        let region = range_region(&table, iova_pfn, npages)?;
        let lo = iova_pfn - region.start_pfn;
        region
            .pins
            .decrement(lo, lo + npages)
            .map_err(|p| DmaError::NotPinned {
                pfn: region.start_pfn + p,
            })?;
        self.release_run(region, lo, lo + npages);
        Ok(())
    }

    /// Forced release of every pin left in `region` (unmap). Caller holds the pin lock.
    /// Returns the number of pages that were still pinned.
    pub(crate) fn force_release(&self, region: &Region) -> u64 {
        if region.pins.pinned.load(Relaxed) == 0 {
            return 0;
        }
        let pages = region.pins.zero_all_counts();
        let ranges: Vec<(u64, u64)> = region.pins.allocated_ranges().collect();
        for (lo, hi) in ranges {
            self.release_run(region, lo, hi);
        }
        pages
    }

    /// Mark `[iova, iova + len)` of `region` dirty if logging is on.
    #[inline]
    pub(crate) fn mark_dirty(&self, region: &Region, iova: u64, len: u64) {
        if len != 0 && self.dirty_active.load(Acquire) {
            if let Some(b) = region.dirty.load().as_ref() {
                b.mark(iova, len);
            }
        }
    }
}

/// A pin needs READ or WRITE.
fn check_pin_prot(prot: Prot) -> Result<(), DmaError> {
    if !prot.read && !prot.write {
        return Err(DmaError::InvalidArgument(
            "pin prot must include READ or WRITE",
        ));
    }
    Ok(())
}

/// The region holding all of `[iova_pfn, iova_pfn + npages)`.
fn range_region(table: &MapTable, iova_pfn: u64, npages: u64) -> Result<&Region, DmaError> {
    if npages == 0 {
        return Err(DmaError::InvalidArgument("npages is 0"));
    }
    let end = iova_pfn.checked_add(npages).ok_or(DmaError::Overflow {
        what: "iova pfn + npages",
    })?;
    let region = table.find_pfn(iova_pfn)?;
    if end > region.end_pfn {
        return Err(DmaError::InvalidArgument(
            "page range crosses the end of its DMA mapping",
        ));
    }
    Ok(region)
}
