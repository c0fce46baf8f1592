//! Hostile arguments to the DMA layer (what a buggy or hostile device or guest can make a
//! device pass): empty, huge, wrapping, duplicated and mismatched arrays; and the exact
//! accounting rule of seeds/02: pages already pinned are never counted again, neither
//! against the lock limit nor in `locked_pages`, whatever the run shape.

mod dma_util;

use dma_util::{map_pages, space};
use umdev::dma::{DmaError, DmaSpace, PinPolicy, Prot, PAGE_SHIFT, PAGE_SIZE};

const PFN: u64 = 0x100;

fn counts(s: &DmaSpace) -> (u64, u64) {
    let st = s.stats();
    (st.pinned_pages, st.locked_pages)
}

fn range(lo: u64, hi: u64) -> Vec<u64> {
    (PFN + lo..PFN + hi).collect()
}

#[test]
fn test_edges_degenerate_arrays_and_addresses_fail_cleanly() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, PFN, 32, Prot::RW);
    let h = s.handle();
    let mut addrs = [0u64; 4];
    h.pin_pages(&[], Prot::RW, &mut []).unwrap();
    assert_eq!(counts(&s), (0, 0));
    // Output array shorter than the input: an error, nothing pinned.
    assert!(h
        .pin_pages(&range(0, 4), Prot::RW, &mut addrs[..3])
        .is_err());
    assert_eq!(counts(&s), (0, 0));
    // Page numbers whose byte address does not fit 64 bits, or that wrap a run.
    for bad in [[u64::MAX], [u64::MAX >> PAGE_SHIFT], [1 << 60]] {
        assert!(
            h.pin_pages(&bad, Prot::RW, &mut addrs[..1]).is_err(),
            "{bad:x?}"
        );
    }
    assert!(h
        .pin_pages(&[u64::MAX - 1, u64::MAX], Prot::RW, &mut addrs[..2])
        .is_err());
    assert!(h.pin_range(u64::MAX, 2, Prot::RW).is_err());
    assert!(h.pin_range(PFN + 30, u64::MAX, Prot::RW).is_err());
    assert!(h.pin_range(PFN, 33, Prot::RW).is_err(), "past the mapping");
    assert!(h.unpin_range(u64::MAX, 2).is_err());
    // Neither read nor write: not a meaningful pin.
    assert!(h
        .pin_pages(&range(0, 1), Prot::default(), &mut addrs[..1])
        .is_err());
    assert_eq!(counts(&s), (0, 0));
    // Copies that wrap the address space or run off the mapping.
    let mut buf = [0u8; 8];
    assert!(matches!(
        h.read(u64::MAX - 3, &mut buf),
        Err(DmaError::Overflow { .. }) | Err(DmaError::NotMapped { .. })
    ));
    assert!(h.write(u64::MAX - 3, &buf).is_err());
    let end = (PFN + 32) * PAGE_SIZE;
    assert!(h.write(end - 4, &buf).is_err(), "straddles the mapping end");
    assert!(h.read(end - 4, &mut buf).is_err());
    s.check_invariants().unwrap();
}

#[test]
fn test_edges_zero_page_range_pins_nothing() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, PFN, 8, Prot::RW);
    let h = s.handle();
    // Either refused or a no-op, never a pin.
    let _ = h.pin_range(PFN, 0, Prot::RW);
    assert_eq!(counts(&s), (0, 0));
    let _ = h.unpin_range(PFN, 0);
    assert_eq!(counts(&s), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn test_edges_failed_unpin_with_duplicates_changes_nothing() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, PFN, 8, Prot::RW);
    let h = s.handle();
    let mut addrs = [0u64; 4];
    h.pin_pages(&range(0, 2), Prot::RW, &mut addrs[..2])
        .unwrap();
    // Page 0 is pinned once: unpinning it twice in one call must fail as a whole.
    let err = h.unpin_pages(&[PFN + 1, PFN, PFN]).unwrap_err();
    assert!(matches!(err, DmaError::NotPinned { .. }), "{err:?}");
    assert_eq!(counts(&s), (2, 2));
    s.check_invariants().unwrap();
    h.unpin_pages(&range(0, 2)).unwrap();
    assert_eq!(counts(&s), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn test_edges_run_half_already_pinned_counts_only_new_pages_against_limit() {
    // seeds/02: a batched run that contains externally pinned pages must only account the
    // new ones. Limit 16 pages: 8 pinned, then a 16-page run over them needs 8 more = 16.
    let s = space(PinPolicy::Lock, 16);
    map_pages(&s, PFN, 64, Prot::RW);
    let h = s.handle();
    let mut addrs = [0u64; 32];
    let odd: Vec<u64> = (0..16).filter(|i| i % 2 == 1).map(|i| PFN + i).collect();
    h.pin_pages(&odd, Prot::RW, &mut addrs[..8]).unwrap();
    assert_eq!(counts(&s), (8, 8));
    h.pin_pages(&range(0, 16), Prot::RW, &mut addrs[..16])
        .expect("8 new pages fit the 16-page limit");
    assert_eq!(counts(&s), (16, 16));
    // The same run again: nothing new, so no limit problem and no count change.
    h.pin_pages(&range(0, 16), Prot::READ, &mut addrs[..16])
        .unwrap();
    assert_eq!(counts(&s), (16, 16));
    // Duplicates of a new page inside one call count once; one new page is one too many.
    let err = h
        .pin_pages(&[PFN + 20, PFN + 20, PFN + 20], Prot::RW, &mut addrs[..3])
        .unwrap_err();
    assert!(
        matches!(err, DmaError::LimitExceeded { more: 1, .. }),
        "{err:?}"
    );
    assert_eq!(counts(&s), (16, 16));
    s.check_invariants().unwrap();
    // Undo in another order and shape: odd pages were pinned 3 times, even ones twice.
    h.unpin_pages(&range(0, 16)).unwrap();
    h.unpin_pages(&odd).unwrap();
    assert_eq!(counts(&s), (16, 16), "the second 0..16 pin still holds");
    h.unpin_range(PFN, 16).unwrap();
    assert_eq!(counts(&s), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn test_edges_run_across_adjacent_mappings_with_partial_pins_counts_exactly() {
    let s = space(PinPolicy::Lock, 12);
    map_pages(&s, PFN, 8, Prot::RW);
    map_pages(&s, PFN + 8, 8, Prot::RW);
    let h = s.handle();
    let mut addrs = [0u64; 16];
    h.pin_pages(&range(6, 10), Prot::RW, &mut addrs[..4])
        .unwrap();
    assert_eq!(counts(&s), (4, 4));
    // 4..12 crosses the boundary, 4 of its 8 pages are pinned: 4 new → 8 locked.
    h.pin_pages(&range(4, 12), Prot::RW, &mut addrs[..8])
        .unwrap();
    assert_eq!(counts(&s), (8, 8));
    // 0..16 needs 8 more: 16 > 12, refused; the part in the first mapping is rolled back.
    assert!(matches!(
        h.pin_pages(&range(0, 16), Prot::RW, &mut addrs[..16]),
        Err(DmaError::LimitExceeded { .. })
    ));
    assert_eq!(counts(&s), (8, 8));
    s.check_invariants().unwrap();
    h.unpin_pages(&range(4, 12)).unwrap();
    h.unpin_pages(&range(6, 10)).unwrap();
    assert_eq!(counts(&s), (0, 0));
    s.check_invariants().unwrap();
}
