//! The immutable, sorted snapshot of all mappings that readers search without a lock.
//!
//! Writers (DMA_MAP / DMA_UNMAP on the connection thread) build a new [`MapTable`] and publish
//! it through an `ArcSwap`; readers (device threads) load the current one and binary-search it.
//! To keep a write cheap with hundreds of thousands of 4 KiB mappings (a vIOMMU guest), the
//! table is a two-level sorted array: chunks of at most `2 * CHUNK` regions shared (`Arc`)
//! between snapshots, plus the first IOVA of each chunk. An insert or remove copies the outer
//! index (n / CHUNK pointers) and one chunk, not the whole table; a lookup is two binary
//! searches, O(log n).
//!
//! DMA_UNMAP of a range (type1v2 semantics, see `mapping.rs`) is two lookups for the mappings
//! the range would split ([`MapTable::split_by`]), an iteration over the mappings starting
//! inside it ([`MapTable::starting_in`]), and one rebuild that drops them all
//! ([`MapTable::without_span`]): O(log n + k) plus one copy of the outer index and of at most
//! two chunks, however many of the k mappings it removes. Ranges are given as an inclusive
//! `[first, last]` so that one ending exactly at 2^64 (`last == u64::MAX`) is representable;
//! a mapping itself never reaches 2^64 (its exclusive `end` is a u64).

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

    /// A mapping that the range `[first, last]` (inclusive) splits: one containing `first`
    /// that starts before it, or one containing `last` that ends after it. Such a range
    /// cannot be unmapped (type1v2: EINVAL, nothing removed).
    pub(crate) fn split_by(&self, first: u64, last: u64) -> Option<&Arc<Region>> {
        if let Some(r) = self.find(first).filter(|r| r.iova < first) {
            return Some(r);
        }
        // `r.end - 1` is the last byte of `r` (a region is never empty, so `end > iova`).
        self.find(last).filter(|r| r.end - 1 > last)
    }

    /// Regions starting in `[first, last]` (inclusive), in IOVA order. When
    /// [`MapTable::split_by`] found nothing, these are exactly the regions the range covers.
    pub(crate) fn starting_in(&self, first: u64, last: u64) -> impl Iterator<Item = &Arc<Region>> {
        // The chunk holding the first region at or after `first`: the last chunk starting at
        // or before `first` (its tail may lie past `first`), else the first chunk.
        let ci = self
            .firsts
            .partition_point(|&f| f <= first)
            .saturating_sub(1);
        let ri = self
            .chunks
            .get(ci)
            .map_or(0, |c| c.partition_point(|r| r.iova < first));
        self.chunks
            .iter()
            .skip(ci)
            .enumerate()
            .flat_map(move |(k, c)| c.iter().skip(if k == 0 { ri } else { 0 }))
            .take_while(move |r| r.iova <= last)
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

    /// This table without the regions starting in `[first, last]` (inclusive). Chunks wholly
    /// outside the span are shared with `self`, chunks wholly inside are dropped, and the (at
    /// most two) chunks the span's edges fall in are rebuilt; the two remnants are merged into
    /// one chunk when they fit, so repeated sweeps do not leave a trail of tiny chunks.
    pub(crate) fn without_span(&self, first: u64, last: u64) -> MapTable {
        let mut t = MapTable {
            chunks: Vec::with_capacity(self.chunks.len()),
            firsts: Vec::with_capacity(self.chunks.len()),
            len: 0,
        };
        // Index in `t` of a rebuilt remnant the next remnant may merge into.
        let mut remnant: Option<usize> = None;
        for c in &self.chunks {
            let (lo, hi) = (c[0].iova, c[c.len() - 1].iova);
            if hi < first || lo > last {
                t.firsts.push(lo);
                t.len += c.len();
                t.chunks.push(c.clone());
                remnant = None;
                continue;
            }
            let kept: Vec<Arc<Region>> = c
                .iter()
                .filter(|r| r.iova < first || r.iova > last)
                .cloned()
                .collect();
            if kept.is_empty() {
                continue;
            }
            t.len += kept.len();
            match remnant {
                Some(i) if t.chunks[i].len() + kept.len() <= 2 * CHUNK => {
                    let mut v = t.chunks[i].to_vec();
                    v.extend(kept);
                    t.chunks[i] = Arc::from(v);
                }
                _ => {
                    t.firsts.push(kept[0].iova);
                    t.chunks.push(Arc::from(kept));
                    remnant = Some(t.chunks.len() - 1);
                }
            }
        }
        t
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
            t = t.without_span(slot * 0x2000, slot * 0x2000);
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

    /// A table of `regions` (sorted, disjoint) built chunk by chunk, as inserts would.
    fn table_of(regions: Vec<Arc<Region>>) -> MapTable {
        let mut t = MapTable::default();
        for c in regions.chunks(CHUNK) {
            t.firsts.push(c[0].iova);
            t.chunks.push(Arc::from(c.to_vec()));
            t.len += c.len();
        }
        t
    }

    /// The structure is sound: sorted, disjoint, no empty or oversized chunk, `firsts` and
    /// `len` agree with the chunks.
    fn assert_well_formed(t: &MapTable) {
        assert_eq!(t.chunks.len(), t.firsts.len());
        for (c, &f) in t.chunks.iter().zip(&t.firsts) {
            assert!(
                !c.is_empty() && c.len() <= 2 * CHUNK,
                "chunk of {}",
                c.len()
            );
            assert_eq!(c[0].iova, f);
        }
        let all: Vec<&Arc<Region>> = t.iter().collect();
        assert_eq!(all.len(), t.len());
        assert!(all.windows(2).all(|w| w[0].end <= w[1].iova));
    }

    #[test]
    fn test_split_by_straddled_start_or_end_reports_that_mapping() {
        let t = MapTable::default();
        let t = t.with_inserted(region(0x10000, 0x4000)).unwrap();
        let t = t.with_inserted(region(0x20000, 0x1000)).unwrap();
        // Covering exactly, covering more, or touching nothing splits nothing.
        assert!(t.split_by(0x10000, 0x13fff).is_none());
        assert!(t.split_by(0x0, 0x20fff).is_none());
        assert!(t.split_by(0x14000, 0x1ffff).is_none());
        assert!(t.split_by(0x0, u64::MAX).is_none());
        // Start strictly inside, end strictly inside, or both.
        assert_eq!(t.split_by(0x11000, 0x1ffff).unwrap().iova, 0x10000);
        assert_eq!(t.split_by(0x0, 0x12fff).unwrap().iova, 0x10000);
        assert_eq!(t.split_by(0x11000, 0x11fff).unwrap().iova, 0x10000);
        assert_eq!(t.split_by(0x14000, 0x20000).unwrap().iova, 0x20000);
    }

    #[test]
    fn test_starting_in_spans_chunks_and_reaches_top_of_address_space() {
        let n = 1000u64;
        let t = table_of((0..n).map(|k| region(k * 0x2000, 0x1000)).collect());
        let got: Vec<u64> = t.starting_in(0x1000, 0x6000).map(|r| r.iova).collect();
        assert_eq!(got, vec![0x2000, 0x4000, 0x6000]);
        // A span across several chunk boundaries.
        let got: Vec<u64> = t
            .starting_in(100 * 0x2000, 700 * 0x2000 - 1)
            .map(|r| r.iova)
            .collect();
        assert_eq!(got, (100..700).map(|k| k * 0x2000).collect::<Vec<_>>());
        // Ending at 2^64 (inclusive last = u64::MAX) reaches the last region.
        assert_eq!(t.starting_in(0, u64::MAX).count(), n as usize);
        assert_eq!(
            t.starting_in((n - 1) * 0x2000, u64::MAX)
                .map(|r| r.iova)
                .collect::<Vec<_>>(),
            vec![(n - 1) * 0x2000]
        );
        assert_eq!(t.starting_in(n * 0x2000, u64::MAX).count(), 0);
        assert_eq!(MapTable::default().starting_in(0, u64::MAX).count(), 0);
    }

    #[test]
    fn test_without_span_matches_filter_for_many_spans() {
        let n = 3000u64;
        let base = table_of((0..n).map(|k| region(k * 0x3000, 0x1000)).collect());
        let mut t = base.clone();
        let mut model: Vec<u64> = (0..n).map(|k| k * 0x3000).collect();
        // Spans of every shape: inside one chunk, across many, empty, at both ends.
        let mut x = 12345u64;
        for i in 0..400u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let first = (x >> 20) % (n * 0x3000 + 0x10000);
            let len = match i % 4 {
                0 => 0x1000,
                1 => (x >> 8) % 0x40000,
                2 => (x >> 8) % (n * 0x3000),
                _ => u64::MAX - first,
            };
            let last = first.saturating_add(len);
            let before = t.clone();
            t = t.without_span(first, last);
            model.retain(|&a| a < first || a > last);
            assert_well_formed(&t);
            assert_eq!(t.iter().map(|r| r.iova).collect::<Vec<_>>(), model);
            // The snapshot readers may still hold is untouched.
            assert_eq!(before.iter().count(), before.len());
            if model.is_empty() {
                t = base.clone();
                model = (0..n).map(|k| k * 0x3000).collect();
            }
        }
    }

    #[test]
    fn test_without_span_100k_regions_copies_at_most_two_chunks() {
        // A vIOMMU guest: 100k one-page mappings. A sweep over half of them must share every
        // chunk it does not touch with the previous snapshot and rebuild at most the two
        // chunks its edges fall in (no per-removed-mapping copy of the table).
        let n = 100_000u64;
        let t = table_of((0..n).map(|k| region(k * 0x2000, 0x1000)).collect());
        let (first, last) = (25_000 * 0x2000 + 0x1000, 75_000 * 0x2000 - 1);
        let u = t.without_span(first, last);
        assert_well_formed(&u);
        assert_eq!(u.len(), 50_001);
        let shared = u
            .chunks
            .iter()
            .filter(|c| t.chunks.iter().any(|o| Arc::ptr_eq(o, c)))
            .count();
        assert!(
            u.chunks.len() - shared <= 2,
            "{} chunks rebuilt",
            u.chunks.len() - shared
        );
        assert_eq!(u.find(25_000 * 0x2000).unwrap().iova, 25_000 * 0x2000);
        assert!(u.find(25_001 * 0x2000).is_none());
        assert!(u.find(74_999 * 0x2000).is_none());
        assert_eq!(u.find(75_000 * 0x2000).unwrap().iova, 75_000 * 0x2000);
    }
}
