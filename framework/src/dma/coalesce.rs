//! Splitting an array of IOVA page numbers into runs: the one place coalescing happens.
//!
//! A run is a maximal slice `pfns[i..j]` of consecutive page numbers (`pfns[k] ==
//! pfns[k-1] + 1`) inside one mapping: `{1,5,6,7,9}` → `{1} {5,6,7} {9}`. Each run costs at
//! most one table lookup (none when it starts in the previous run's mapping: a last-hit
//! check of two compares); the caller then does one permission check, one limit check and one residency
//! operation for it. The cheapest test (`pfn == prev + 1`) comes first, the region-end test
//! second; nothing is allocated, so a one-page array costs one lookup and one callback, exactly
//! what the per-page reference path ([`for_each_run`] with `COALESCE = false`, which looks up every page) costs.

use std::sync::Arc;

use super::map_table::MapTable;
use super::region::Region;
use super::DmaError;

/// Call `f(region, i, j)` for each run `pfns[i..j]` in array order, stopping at the first
/// error (a lookup failure or `f`'s). With `COALESCE = false` every run is one page.
#[inline]
pub(crate) fn for_each_run<'t, const COALESCE: bool, F>(
    table: &'t MapTable,
    pfns: &[u64],
    mut f: F,
) -> Result<(), DmaError>
where
    F: FnMut(&'t Arc<Region>, usize, usize) -> Result<(), DmaError>,
{
    let n = pfns.len();
    let mut i = 0;
    let mut last: Option<&'t Arc<Region>> = None;
    while i < n {
        let pfn = pfns[i];
        let region = match last {
            // Last-hit cache: a run that starts in the previous run's region needs no
            // table search (scattered pages of one big mapping).
            Some(r) if COALESCE && pfn.wrapping_sub(r.start_pfn) < r.end_pfn - r.start_pfn => r,
            _ => table.find_pfn(pfn)?,
        };
        last = Some(region);
        let mut j = i + 1;
        if COALESCE {
            let end_pfn = region.end_pfn;
            // pfns[j - 1] lies in the region, so + 1 cannot overflow.
            while j < n && pfns[j] == pfns[j - 1] + 1 && pfns[j] < end_pfn {
                j += 1;
            }
        }
        f(region, i, j)?;
        i = j;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::Prot;

    fn table() -> MapTable {
        let t = MapTable::default();
        let t = t
            .with_inserted(Arc::new(Region::new(0, 0x8000, Prot::RW, None)))
            .unwrap();
        t.with_inserted(Arc::new(Region::new(0x8000, 0x8000, Prot::RW, None)))
            .unwrap()
    }

    fn runs<const C: bool>(pfns: &[u64]) -> Result<Vec<(u64, usize, usize)>, DmaError> {
        let t = table();
        let mut out = Vec::new();
        for_each_run::<C, _>(&t, pfns, |r, i, j| {
            out.push((r.iova, i, j));
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn test_runs_kernel_example_splits_into_three() {
        let r = runs::<true>(&[1, 5, 6, 7, 9]).unwrap();
        assert_eq!(r, vec![(0, 0, 1), (0, 1, 4), (0x8000, 4, 5)]);
    }

    #[test]
    fn test_runs_split_at_region_boundary_and_duplicates() {
        // 6,7 | 8,9 cross the region boundary at pfn 8; 9,9 is a duplicate.
        let r = runs::<true>(&[6, 7, 8, 9, 9]).unwrap();
        assert_eq!(r, vec![(0, 0, 2), (0x8000, 2, 4), (0x8000, 4, 5)]);
    }

    #[test]
    fn test_runs_naive_one_page_each() {
        let r = runs::<false>(&[2, 3, 4]).unwrap();
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn test_runs_unmapped_page_stops_with_error() {
        let e = runs::<true>(&[1, 2, 16]).unwrap_err();
        assert!(matches!(e, DmaError::NotMapped { iova: 0x10000 }));
    }
}
