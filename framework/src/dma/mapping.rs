//! DMA_MAP and DMA_UNMAP: validating and mmapping a mapping, choosing which mappings an unmap
//! removes, and the unmap protocol (close → notify → verify and force-release → unpublish →
//! drain in-flight → release memory).
//!
//! Draining an fd-less mapping cancels its DMA_READ/DMA_WRITE pieces that wait for the
//! client (`RemoteDma::cancel`, repeated until the in-flight count is 0): the client may be
//! one that answers no request while it waits for the DMA_UNMAP reply (QEMU), and DMA to
//! memory that is going away has to fail anyway. The device sees ECANCELED for such a
//! piece, EFAULT (not mapped) for one that starts after; requests to other mappings are
//! left alone.
//!
//! Which mappings go (type1v2, see the `dma` module docs): for a range `[first, last]`
//! (inclusive, so it may end at 2^64), first look for a mapping the range splits (the one
//! containing `first` if it starts before it, the one containing `last` if it ends after it);
//! if there is one, fail with nothing changed. Otherwise the mappings removed are exactly
//! those starting in `[first, last]`: consecutive in the sorted table, so they are found with
//! one lookup and unpublished with one table rebuild, whatever their number. All of this runs
//! under the map lock, so the table cannot change between the check and the removal.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

use super::dirty::DirtyBitmap;
use super::map_table::MapTable;
use super::region::{HostMem, Region};
use super::{DmaError, DmaMapping, DmaSpace, UnmapReport, PAGE_SIZE};

impl DmaSpace {
    /// DMA_MAP.
    pub(crate) fn map_impl(&self, m: DmaMapping) -> Result<(), DmaError> {
        let DmaMapping {
            iova,
            size,
            prot,
            fd,
            offset,
        } = m;
        if size == 0 {
            return Err(DmaError::InvalidArgument("DMA mapping size is 0"));
        }
        if iova % PAGE_SIZE != 0 || size % PAGE_SIZE != 0 || offset % PAGE_SIZE != 0 {
            return Err(DmaError::InvalidArgument(
                "DMA mapping iova, size and offset must be 4 KiB aligned",
            ));
        }
        let end = iova.checked_add(size).ok_or(DmaError::Overflow {
            what: "DMA mapping iova + size",
        })?;
        let len = usize::try_from(size)
            .ok()
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or(DmaError::Overflow {
                what: "DMA mapping size",
            })?;
        let _w = self.map_lock();
        let table = self.table.load_full();
        let limit = self.max_dma_maps.load(Relaxed);
        if table.len() >= limit as usize {
            return Err(DmaError::TooManyMaps { limit });
        }
        let mem = match fd {
            Some(fd) => {
                // The process's map budget, before anything is mapped (see `budget`).
                let charge = self.maps_account.charge().map_err(DmaError::MapBudget)?;
                let mut mem = map_fd(&fd, len, offset, size, prot, &self.allow_any_file_maps)?;
                mem.hold(charge);
                Some(mem)
            }
            None => None,
        };
        let region = Arc::new(Region::new(iova, size, prot, mem));
        if self.dirty_active.load(Acquire) && !region.is_fdless() {
            let shift = self.dirty_shift.load(Relaxed);
            let bitmap = DirtyBitmap::new(iova, end, shift)?;
            region.dirty.store(Some(Arc::new(bitmap)));
        }
        let new = table.with_inserted(region)?;
        self.table.store(Arc::new(new));
        self.counters.maps.fetch_add(1, Relaxed);
        tracing::debug!(iova, size, ?prot, offset, "DMA map");
        Ok(())
    }

    /// DMA_UNMAP of `[iova, iova + size)`: every mapping the range covers, none if it splits
    /// one (see the module docs).
    pub(crate) fn unmap_impl(
        &self,
        iova: u64,
        size: u64,
        notify: &mut dyn FnMut(u64, u64),
    ) -> Result<UnmapReport, DmaError> {
        if size == 0 {
            return Err(DmaError::InvalidArgument("DMA unmap size is 0"));
        }
        if !iova.is_multiple_of(PAGE_SIZE) || !size.is_multiple_of(PAGE_SIZE) {
            return Err(DmaError::InvalidArgument(
                "DMA unmap iova and size must be 4 KiB aligned",
            ));
        }
        // Inclusive end: a range ending exactly at 2^64 is valid (type1 checks
        // `iova + size - 1` for wrap-around).
        let last = iova.checked_add(size - 1).ok_or(DmaError::Overflow {
            what: "DMA unmap iova + size",
        })?;
        let _w = self.map_lock();
        let table = self.table.load_full();
        if let Some(r) = table.split_by(iova, last) {
            return Err(DmaError::SplitsMapping {
                iova,
                size,
                map_iova: r.iova,
                map_size: r.size,
            });
        }
        let regions: Vec<Arc<Region>> = table.starting_in(iova, last).cloned().collect();
        drop(table);
        Ok(self.remove_regions(&regions, notify))
    }

    /// Remove every mapping.
    pub(crate) fn unmap_all_impl(&self, notify: &mut dyn FnMut(u64, u64)) -> UnmapReport {
        let _w = self.map_lock();
        let regions: Vec<Arc<Region>> = self.table.load().iter().cloned().collect();
        let report = self.remove_regions(&regions, notify);
        // Dirty logging is the departed client's state too: the next client starts clean.
        self.dirty_active.store(false, Release);
        report
    }

    /// The unmap protocol for `regions`: consecutive regions of the current table, in IOVA
    /// order, with no other region of the table starting between the first and the last
    /// (one mapping, a covered span, or all). The caller holds the map lock.
    fn remove_regions(
        &self,
        regions: &[Arc<Region>],
        notify: &mut dyn FnMut(u64, u64),
    ) -> UnmapReport {
        let mut report = UnmapReport::default();
        if regions.is_empty() {
            return report;
        }
        // 1. No new pins from here on (ordered against pin calls by the pin lock).
        {
            let _pin = self.pin_lock();
            for r in regions {
                r.closing.store(true, Relaxed);
            }
        }
        // 2. The device drops its pins (it may unpin from this or other threads).
        for r in regions {
            notify(r.iova, r.size);
        }
        // 3. Verify: leftovers are a device bug, logged, counted and force-released.
        let mut leftovers = Vec::with_capacity(regions.len());
        {
            let _pin = self.pin_lock();
            for r in regions {
                let left = self.force_release(r);
                if left > 0 {
                    tracing::error!(
                        iova = r.iova,
                        size = r.size,
                        pages = left,
                        "device left pages pinned at DMA unmap; force-released"
                    );
                    self.counters.leaked_pins_released.fetch_add(left, Relaxed);
                }
                leftovers.push(left);
            }
        }
        // 4. Unpublish: new lookups fail.
        let table = self.table.load_full();
        let new = if regions.len() == table.len() {
            MapTable::default()
        } else {
            // One rebuild for the whole span (not one table copy per region).
            table.without_span(regions[0].iova, regions[regions.len() - 1].iova)
        };
        debug_assert_eq!(new.len() + regions.len(), table.len());
        self.table.store(Arc::new(new));
        // 5. Wait for in-flight accesses (cancelling the fd-less pieces waiting for the
        //    client), then release the memory.
        let remote = if regions.iter().any(|r| r.is_fdless()) {
            self.remote
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        } else {
            None
        };
        for (r, &left) in regions.iter().zip(&leftovers) {
            match &remote {
                Some(remote) if r.is_fdless() => {
                    r.remove_and_drain_cancelling(|| remote.cancel(r.iova, r.size))
                }
                _ => r.remove_and_drain(),
            }
            let mem = r.mem.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(mem) = mem {
                if left > 0 {
                    // A device that ignored the notifier may still hold host addresses: keep
                    // the address range reserved (as scratch memory) for the space's lifetime.
                    if let Err(e) = mem.replace_with_scratch() {
                        tracing::error!(err = %e, "cannot replace leaked DMA mapping with scratch memory; keeping it mapped");
                    }
                    self.graveyard
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(mem);
                } else {
                    drop(mem);
                }
            }
            let (p, l, c) = r.pins.scan();
            if p != 0 || l != 0 || c != 0 {
                tracing::error!(
                    iova = r.iova,
                    pinned = p,
                    locked = l,
                    counted = c,
                    "pin accounting invariant broken after unmap"
                );
            }
            self.counters.maps.fetch_sub(1, Relaxed);
            report.maps_removed += 1;
            // Disjoint mappings below 2^64: the sum cannot overflow.
            report.bytes_removed += r.size;
            report.leftover_pins += left;
            tracing::debug!(iova = r.iova, size = r.size, leftover = left, "DMA unmap");
        }
        report
    }
}

/// Check the file is one whose faults no client stalls (unless `allow_any`: `backing.rs`)
/// and large enough, and mmap it.
fn map_fd(
    fd: &OwnedFd,
    len: usize,
    offset: u64,
    size: u64,
    prot: super::Prot,
    allow_any: &std::sync::atomic::AtomicBool,
) -> Result<HostMem, DmaError> {
    super::backing::check_backing(fd.as_fd(), allow_any.load(Relaxed))?;
    let need = offset.checked_add(size).ok_or(DmaError::Overflow {
        what: "DMA mapping offset + size",
    })?;
    // SAFETY: fstat writes into the zeroed struct we pass; the fd is valid (owned).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(DmaError::Mmap(std::io::Error::last_os_error()));
    }
    // A regular file (memfd, tmpfs, hugetlbfs) shorter than the mapping would SIGBUS on
    // access; refuse it up front. (A client that shrinks the file later makes the device see
    // zeros from the faulting page on: see `sigbus`.)
    if st.st_mode & libc::S_IFMT == libc::S_IFREG && (st.st_size as u64) < need {
        return Err(DmaError::InvalidArgument(
            "DMA mapping extends past the end of its file",
        ));
    }
    HostMem::map_fd(fd.as_fd(), len, offset, prot).map_err(DmaError::Mmap)
}

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};

    use super::super::{DmaConfig, Prot, RemoteDma};
    use super::*;

    /// A client that answers nothing: every request waits until `cancel` covers it (then
    /// ECANCELED) or `answer_all` (then Ok), at most 5 s (then ETIMEDOUT).
    #[derive(Default)]
    struct Unanswering {
        /// (first byte, last byte, outcome: None = waiting, Some(cancelled?)).
        waiting: Mutex<Vec<(u64, u64, Option<bool>)>>,
        changed: Condvar,
    }

    impl Unanswering {
        fn wait(&self, iova: u64, len: usize) -> Result<(), DmaError> {
            let mut w = self.waiting.lock().unwrap();
            w.push((iova, iova + len as u64 - 1, None));
            let i = w.len() - 1;
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match w[i].2 {
                    Some(true) => {
                        return Err(DmaError::Remote {
                            iova,
                            errno: libc::ECANCELED,
                        })
                    }
                    Some(false) => return Ok(()),
                    None => {}
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(DmaError::Remote {
                        iova,
                        errno: libc::ETIMEDOUT,
                    });
                }
                w = self.changed.wait_timeout(w, left).unwrap().0;
            }
        }

        fn waiting_at(&self, iova: u64) -> bool {
            let w = self.waiting.lock().unwrap();
            w.iter().any(|&(f, _, o)| f == iova && o.is_none())
        }

        fn answer_all(&self) {
            for e in self.waiting.lock().unwrap().iter_mut() {
                e.2.get_or_insert(false);
            }
            self.changed.notify_all();
        }
    }

    impl RemoteDma for Unanswering {
        fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
            self.wait(iova, buf.len())
        }
        fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
            self.wait(iova, data.len())
        }
        fn max_xfer(&self) -> usize {
            4096
        }
        fn cancel(&self, iova: u64, size: u64) {
            let last = iova + size - 1;
            for e in self.waiting.lock().unwrap().iter_mut() {
                if e.0 <= last && iova <= e.1 && e.2.is_none() {
                    e.2 = Some(true);
                }
            }
            self.changed.notify_all();
        }
    }

    fn map_fdless(space: &DmaSpace, iova: u64, size: u64) {
        space
            .map(DmaMapping {
                iova,
                size,
                prot: Prot::RW,
                fd: None,
                offset: 0,
            })
            .unwrap();
    }

    #[test]
    fn test_unmap_fdless_cancels_waiting_piece_leaves_other_region_alone() {
        let space = DmaSpace::new(DmaConfig::default());
        let remote = Arc::new(Unanswering::default());
        space.set_remote(Some(remote.clone()));
        map_fdless(&space, 0x10000, 0x4000);
        map_fdless(&space, 0x20000, 0x4000);
        let reader = |iova: u64| {
            let h = space.handle();
            std::thread::spawn(move || h.read(iova, &mut [0u8; 64]))
        };
        let doomed = reader(0x11000);
        let other = reader(0x21000);
        while !(remote.waiting_at(0x11000) && remote.waiting_at(0x21000)) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let start = Instant::now();
        let report = space.unmap(0x10000, 0x4000, &mut |_, _| {}).unwrap();
        assert_eq!(report.maps_removed, 1);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "unmap waited for the client"
        );
        let e = doomed.join().unwrap().unwrap_err();
        assert_eq!(e.errno(), libc::ECANCELED, "{e:?}");
        assert!(
            remote.waiting_at(0x21000),
            "the other region's request was cancelled"
        );
        remote.answer_all();
        assert!(other.join().unwrap().is_ok());
    }

    #[test]
    fn test_unmap_fdless_racing_readers_all_cancelled_none_waits_for_timeout() {
        // Readers enter the region just before it is removed and register their request
        // just after a cancel pass: the drain loop's later passes must catch them.
        let space = DmaSpace::new(DmaConfig::default());
        let remote = Arc::new(Unanswering::default());
        space.set_remote(Some(remote.clone()));
        for _ in 0..40 {
            map_fdless(&space, 0x10000, 0x4000);
            let readers: Vec<_> = (0..3)
                .map(|k| {
                    let h = space.handle();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16];
                        while h.read(0x10000 + k * 0x1000, &mut buf).is_ok() {}
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_micros(100));
            let start = Instant::now();
            space.unmap(0x10000, 0x4000, &mut |_, _| {}).unwrap();
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "unmap waited for the client"
            );
            for r in readers {
                r.join().unwrap();
            }
        }
    }
}
