//! The page arrays of a channel program and their pinning — the user-space twin of
//! vfio-ccw's `page_array_pin`.
//!
//! Every data page of a validated program is collected, in program order and with
//! duplicates kept (the DMA layer refcounts them), into at most two arrays: pages the
//! device writes (READ, SENSE → pinned with [`Prot::WRITE`]) and pages it reads (WRITE →
//! pinned with [`Prot::READ`]). Each array is pinned with one `pin_pages` call, so the DMA
//! layer's coalescing sees the whole program at once. [`PinnedPages`] unpins on drop, so no
//! path can leak a pin.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use umdev::dma::{DmaError, DmaHandle, Prot, PAGE_SIZE};

use super::program::{Op, Program};

/// Which array a page belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// The device writes the page (READ, SENSE).
    ToGuest,
    /// The device reads the page (WRITE).
    FromGuest,
}

impl Dir {
    /// The permission the page must be pinned with.
    pub fn prot(self) -> Prot {
        match self {
            Dir::ToGuest => Prot::WRITE,
            Dir::FromGuest => Prot::READ,
        }
    }
}

/// Where an extent's pages sit in its direction's array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentPages {
    /// The array.
    pub dir: Dir,
    /// Index of the extent's first page in that array; its pages follow consecutively.
    pub first: usize,
}

/// The page arrays of one program.
#[derive(Debug, Default)]
pub struct ProgramPages {
    /// Pages the device writes, as IOVA page numbers.
    pub to_guest: Vec<u64>,
    /// Pages the device reads.
    pub from_guest: Vec<u64>,
    /// Per step, per extent: where its pages are.
    pub extents: Vec<Vec<ExtentPages>>,
}

impl ProgramPages {
    /// Collect the data pages of `program`.
    pub fn collect(program: &Program) -> ProgramPages {
        let mut pages = ProgramPages::default();
        for step in &program.steps {
            let dir = match step.op {
                Op::Read | Op::Sense => Dir::ToGuest,
                Op::Write | Op::Nop => Dir::FromGuest,
            };
            let arr = match dir {
                Dir::ToGuest => &mut pages.to_guest,
                Dir::FromGuest => &mut pages.from_guest,
            };
            let mut per_extent = Vec::with_capacity(step.extents.len());
            for e in &step.extents {
                let (first_pfn, last_pfn) = e.page_span();
                per_extent.push(ExtentPages {
                    dir,
                    first: arr.len(),
                });
                arr.extend(first_pfn..=last_pfn);
            }
            pages.extents.push(per_extent);
        }
        pages
    }

    /// Total entries over both arrays.
    pub fn len(&self) -> usize {
        self.to_guest.len() + self.from_guest.len()
    }

    /// True if the program has no data pages.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sorted, deduplicated page numbers of both arrays (for range-intersection checks).
    pub fn sorted_pfns(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .to_guest
            .iter()
            .chain(self.from_guest.iter())
            .copied()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The step owning the first occurrence of page `pfn` in `dir`'s array, if any.
    pub fn step_of(&self, dir: Dir, pfn: u64) -> Option<usize> {
        let arr = match dir {
            Dir::ToGuest => &self.to_guest,
            Dir::FromGuest => &self.from_guest,
        };
        let idx = arr.iter().position(|&p| p == pfn)?;
        // The owner is the last extent starting at or before idx.
        let mut owner = None;
        for (s, exts) in self.extents.iter().enumerate() {
            for ep in exts {
                if ep.dir == dir && ep.first <= idx {
                    owner = Some(s);
                }
            }
        }
        owner
    }
}

/// True if any page of sorted `pfns` lies in `[iova, iova + size)`.
pub fn range_intersects(pfns: &[u64], iova: u64, size: u64) -> bool {
    if size == 0 {
        return false;
    }
    let first = iova / PAGE_SIZE;
    let last = iova.saturating_add(size - 1) / PAGE_SIZE;
    let i = pfns.partition_point(|&p| p < first);
    pfns.get(i).is_some_and(|&p| p <= last)
}

/// A failed pin: which array and the DMA layer's error.
#[derive(Debug)]
pub struct PinFailure {
    /// The array whose `pin_pages` call failed.
    pub dir: Dir,
    /// The error (nothing of that call stays pinned).
    pub error: DmaError,
}

/// The pinned pages of a program; unpinned on [`PinnedPages::release`] or drop.
pub struct PinnedPages {
    dma: DmaHandle,
    pages: ProgramPages,
    to_guest_hosts: Vec<u64>,
    from_guest_hosts: Vec<u64>,
    held: Arc<AtomicU64>,
    pinned: bool,
}

impl PinnedPages {
    /// Pin both arrays (one `pin_pages` call each, skipped when empty). All-or-nothing: if
    /// the second call fails, the first is unpinned before returning. `held` counts the
    /// entries this device holds pinned.
    pub fn pin(
        dma: &DmaHandle,
        pages: ProgramPages,
        held: &Arc<AtomicU64>,
    ) -> Result<PinnedPages, (ProgramPages, PinFailure)> {
        let mut to_hosts = vec![0u64; pages.to_guest.len()];
        let mut from_hosts = vec![0u64; pages.from_guest.len()];
        if !pages.to_guest.is_empty() {
            if let Err(error) = dma.pin_pages(&pages.to_guest, Prot::WRITE, &mut to_hosts) {
                let dir = Dir::ToGuest;
                return Err((pages, PinFailure { dir, error }));
            }
            held.fetch_add(pages.to_guest.len() as u64, Ordering::SeqCst);
        }
        if !pages.from_guest.is_empty() {
            if let Err(error) = dma.pin_pages(&pages.from_guest, Prot::READ, &mut from_hosts) {
                if !pages.to_guest.is_empty() {
                    unpin_counted(dma, &pages.to_guest, held);
                }
                let dir = Dir::FromGuest;
                return Err((pages, PinFailure { dir, error }));
            }
            held.fetch_add(pages.from_guest.len() as u64, Ordering::SeqCst);
        }
        Ok(PinnedPages {
            dma: dma.clone(),
            pages,
            to_guest_hosts: to_hosts,
            from_guest_hosts: from_hosts,
            held: held.clone(),
            pinned: true,
        })
    }

    /// The DMA handle the pages were pinned through.
    pub fn dma(&self) -> &DmaHandle {
        &self.dma
    }

    /// The page arrays.
    pub fn pages(&self) -> &ProgramPages {
        &self.pages
    }

    /// Host addresses of the pages of extent `extent` of step `step`, `npages` long.
    /// `None` if the indexes do not describe a pinned extent.
    pub fn hosts(&self, step: usize, extent: usize, npages: usize) -> Option<&[u64]> {
        let ep = self.pages.extents.get(step)?.get(extent)?;
        let arr = match ep.dir {
            Dir::ToGuest => &self.to_guest_hosts,
            Dir::FromGuest => &self.from_guest_hosts,
        };
        arr.get(ep.first..ep.first.checked_add(npages)?)
    }

    /// Unpin everything now.
    pub fn release(mut self) {
        self.unpin();
    }

    fn unpin(&mut self) {
        if !self.pinned {
            return;
        }
        self.pinned = false;
        if !self.pages.to_guest.is_empty() {
            unpin_counted(&self.dma, &self.pages.to_guest, &self.held);
        }
        if !self.pages.from_guest.is_empty() {
            unpin_counted(&self.dma, &self.pages.from_guest, &self.held);
        }
    }
}

impl Drop for PinnedPages {
    fn drop(&mut self) {
        self.unpin();
    }
}

fn unpin_counted(dma: &DmaHandle, pfns: &[u64], held: &AtomicU64) {
    match dma.unpin_pages(pfns) {
        Ok(()) => {
            held.fetch_sub(pfns.len() as u64, Ordering::SeqCst);
        }
        Err(e) => {
            // The DMA layer rejected the whole call; the pages stay counted as held so the
            // leak is visible through `pins_held()` (and the DMA layer force-releases them
            // at unmap).
            tracing::error!(error = %e, pages = pfns.len(), "ccw: unpin_pages failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ccw::idal::Extent;
    use crate::ccw::program::Step;

    fn step(op: Op, extents: Vec<Extent>) -> Step {
        Step {
            ccw_addr: 0,
            op,
            count: 1,
            extents,
            image_offset: 0,
            residual: 0,
        }
    }

    #[test]
    fn test_collect_splits_directions_and_keeps_duplicates() {
        let p = Program {
            steps: vec![
                step(
                    Op::Read,
                    vec![
                        Extent {
                            iova: 0x1ff0,
                            len: 0x20,
                        },
                        Extent {
                            iova: 0x5000,
                            len: 16,
                        },
                    ],
                ),
                step(Op::Nop, vec![]),
                step(
                    Op::Write,
                    vec![Extent {
                        iova: 0x1000,
                        len: 4096,
                    }],
                ),
            ],
            incorrect_length: false,
        };
        let pages = ProgramPages::collect(&p);
        assert_eq!(pages.to_guest, vec![1, 2, 5]);
        assert_eq!(pages.from_guest, vec![1]);
        assert_eq!(pages.extents[0][1].first, 2);
        assert_eq!(pages.extents[2][0].dir, Dir::FromGuest);
        assert_eq!(pages.sorted_pfns(), vec![1, 2, 5]);
        assert_eq!(pages.step_of(Dir::ToGuest, 5), Some(0));
        assert_eq!(pages.step_of(Dir::FromGuest, 1), Some(2));
        assert_eq!(pages.step_of(Dir::FromGuest, 9), None);
    }

    #[test]
    fn test_range_intersects_edges() {
        let pfns = [3, 7];
        assert!(range_intersects(&pfns, 3 * 4096, 1));
        assert!(range_intersects(&pfns, 4 * 4096, 4 * 4096));
        assert!(!range_intersects(&pfns, 4 * 4096, 3 * 4096));
        assert!(!range_intersects(&pfns, 0, 0));
        assert!(range_intersects(&pfns, 0, u64::MAX));
        assert!(!range_intersects(&pfns, 8 * 4096, u64::MAX));
    }
}
