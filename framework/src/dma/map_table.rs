//! The immutable, sorted snapshot of all mappings that readers search without a lock.
//!
//! Writers (DMA_MAP / DMA_UNMAP on the connection thread) build a new [`MapTable`] and publish
//! it through an `ArcSwap`; readers (device threads) load the current one and binary-search it.
//! To keep a write cheap with hundreds of thousands of 4 KiB mappings (a vIOMMU guest), the
//! table is a two-level sorted array: chunks of at most `2 * CHUNK` regions shared (`Arc`)
//! between snapshots, plus the first IOVA of each chunk. An insert or remove copies the outer
//! index (n / CHUNK pointers) and one chunk, not the whole table; a lookup is two binary
//! searches, O(log n).

use std::sync::Arc;

use super::region::Region;
use super::{DmaError, PAGE_SHIFT};

/// Target chunk size; a chunk splits past `2 * CHUNK` regions.
const CHUNK: usize = 128;

/// Largest IOVA page number (`pfn << PAGE_SHIFT` fits in a u64).
pub(crate) const MAX_PFN: u64 = u64::MAX >> PAGE_SHIFT;

/// One published snapshot of the map table.
#[derive(Default, Clone)]
pub(crate) struct MapTable {
    chunks: Vec<Arc<[Arc<Region>]>>,
    firsts: Vec<u64>,
    len: usize,
}

impl MapTable {
    /// Number of mappings.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Index of the last region starting strictly before `x`, as (chunk, index).
    #[inline]
    fn pred(&self, x: u64) -> Option<(usize, usize)> {
        let ci = self.firsts.partition_point(|&f| f < x).checked_sub(1)?;
        let ri = self.chunks[ci]
            .partition_point(|r| r.iova < x)
            .checked_sub(1)?;
        Some((ci, ri))
    }

    /// The region containing `iova`.
    #[inline]
    pub(crate) fn find(&self, iova: u64) -> Option<&Arc<Region>> {
        let (ci, ri) = self.pred(iova.checked_add(1)?)?;
        let r = &self.chunks[ci][ri];
        (iova < r.end).then_some(r)
    }

    /// The region containing page `pfn`, or the error a pin of it reports.
    #[inline]
    pub(crate) fn find_pfn(&self, pfn: u64) -> Result<&Arc<Region>, DmaError> {
        if pfn > MAX_PFN {
            return Err(DmaError::Overflow { what: "iova pfn" });
        }
        let iova = pfn << PAGE_SHIFT;
        self.find(iova).ok_or(DmaError::NotMapped { iova })
    }

    /// The region exactly `[iova, iova + size)`.
    pub(crate) fn find_exact(&self, iova: u64, size: u64) -> Option<&Arc<Region>> {
        self.find(iova).filter(|r| r.iova == iova && r.size == size)
    }

    /// Regions overlapping `[lo, hi)`, in IOVA order.
    pub(crate) fn overlapping(&self, lo: u64, hi: u64) -> impl Iterator<Item = &Arc<Region>> {
        // Start at the region containing or preceding `lo`.
        let (ci, ri) = self.pred(lo.saturating_add(1)).unwrap_or((0, 0));
        self.chunks
            .iter()
            .skip(ci)
            .enumerate()
            .flat_map(move |(k, c)| c.iter().skip(if k == 0 { ri } else { 0 }))
            .skip_while(move |r| r.end <= lo)
            .take_while(move |r| r.iova < hi)
    }

    /// All regions in IOVA order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Region>> {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    /// A new table with `region` added; `Overlap` if it intersects an existing one.
    pub(crate) fn with_inserted(&self, region: Arc<Region>) -> Result<MapTable, DmaError> {
        // The last region starting before the new end must end at or before the new start.
        if let Some((ci, ri)) = self.pred(region.end) {
            if self.chunks[ci][ri].end > region.iova {
                return Err(DmaError::Overlap {
                    iova: region.iova,
                    size: region.size,
                });
            }
        }
        let mut t = self.clone();
        if t.chunks.is_empty() {
            t.chunks.push(Arc::from(vec![region.clone()]));
            t.firsts.push(region.iova);
            t.len = 1;
            return Ok(t);
        }
        let ci = t
            .firsts
            .partition_point(|&f| f <= region.iova)
            .saturating_sub(1);
        let mut v: Vec<Arc<Region>> = t.chunks[ci].to_vec();
        let pos = v.partition_point(|r| r.iova < region.iova);
        v.insert(pos, region);
        t.len += 1;
        t.replace_chunk(ci, v);
        Ok(t)
    }

    /// This table without the region starting at `iova` (unchanged if there is none).
    pub(crate) fn without(mut self, iova: u64) -> MapTable {
        let Some((ci, ri)) = self.pred(iova.saturating_add(1)) else {
            return self;
        };
        if self.chunks[ci][ri].iova != iova {
            return self;
        }
        let mut v = self.chunks[ci].to_vec();
        v.remove(ri);
        self.len -= 1;
        self.replace_chunk(ci, v);
        self
    }

    /// Put `v` in place of chunk `ci`, splitting a large chunk or dropping an empty one.
    fn replace_chunk(&mut self, ci: usize, v: Vec<Arc<Region>>) {
        if v.is_empty() {
            self.chunks.remove(ci);
            self.firsts.remove(ci);
        } else if v.len() > 2 * CHUNK {
            let (a, b) = v.split_at(v.len() / 2);
            self.firsts[ci] = a[0].iova;
            self.chunks[ci] = Arc::from(a);
            self.chunks.insert(ci + 1, Arc::from(b));
            self.firsts.insert(ci + 1, b[0].iova);
        } else {
            self.firsts[ci] = v[0].iova;
            self.chunks[ci] = Arc::from(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::Prot;

    fn region(iova: u64, size: u64) -> Arc<Region> {
        Arc::new(Region::new(iova, size, Prot::RW, None))
    }

    #[test]
    fn test_insert_overlap_rejected_adjacent_accepted() {
        let t = MapTable::default();
        let t = t.with_inserted(region(0x10000, 0x2000)).unwrap();
        assert!(matches!(
            t.with_inserted(region(0x11000, 0x1000)),
            Err(DmaError::Overlap { .. })
        ));
        assert!(matches!(
            t.with_inserted(region(0xf000, 0x2000)),
            Err(DmaError::Overlap { .. })
        ));
        assert!(matches!(
            t.with_inserted(region(0x0, 0x100000)),
            Err(DmaError::Overlap { .. })
        ));
        let t = t.with_inserted(region(0x12000, 0x1000)).unwrap();
        let t = t.with_inserted(region(0xf000, 0x1000)).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.find(0x12fff).unwrap().iova, 0x12000);
        assert!(t.find(0x13000).is_none());
        assert!(t.find(0xefff).is_none());
    }

    #[test]
    fn test_many_regions_lookup_and_remove_stay_consistent() {
        let mut t = MapTable::default();
        // Insert 3000 one-page regions in a scattered order, leaving gaps.
        let n = 3000u64;
        for k in 0..n {
            let slot = (k * 7919) % n;
            t = t.with_inserted(region(slot * 0x2000, 0x1000)).unwrap();
        }
        assert_eq!(t.len(), n as usize);
        for slot in 0..n {
            assert_eq!(t.find(slot * 0x2000 + 5).unwrap().iova, slot * 0x2000);
            assert!(t.find(slot * 0x2000 + 0x1000).is_none());
        }
        let all: Vec<u64> = t.iter().map(|r| r.iova).collect();
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        for slot in (0..n).step_by(2) {
            t = t.without(slot * 0x2000);
        }
        assert_eq!(t.len(), (n / 2) as usize);
        assert!(t.find(0).is_none());
        assert_eq!(t.find(0x2000).unwrap().iova, 0x2000);
        let ov: Vec<u64> = t.overlapping(0x2000, 0x8000).map(|r| r.iova).collect();
        assert_eq!(ov, vec![0x2000, 0x6000]);
    }

    #[test]
    fn test_find_pfn_huge_pfn_is_overflow_error() {
        let t = MapTable::default();
        assert!(matches!(
            t.find_pfn(u64::MAX),
            Err(DmaError::Overflow { .. })
        ));
        assert!(matches!(
            t.find_pfn(5),
            Err(DmaError::NotMapped { iova: 0x5000 })
        ));
    }
}
