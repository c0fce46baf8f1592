//! Dirty logging (DMA_LOGGING_START / REPORT / STOP) semantics.

mod dma_util;

use dma_util::*;
use umdev::dma::{DmaError, PinPolicy, Prot, PAGE_SIZE};

fn bits(bitmap: &[u8], n: usize) -> Vec<usize> {
    (0..n)
        .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
        .collect()
}

#[test]
fn test_dirty_report_returns_written_pages_then_clears() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 16, Prot::RW);
    let h = s.handle();
    h.write(0, &[1]).unwrap(); // before start: not logged
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    h.write(3 * PAGE_SIZE + 10, &[1u8; 5000]).unwrap(); // pages 3, 4
    h.write(9 * PAGE_SIZE, &[1]).unwrap();
    let mut bm = [0xffu8; 2];
    s.dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 16), vec![3, 4, 9]);
    s.dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 16), Vec::<usize>::new());
    s.dirty_stop();
    assert!(s
        .dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .is_err());
}

#[test]
fn test_dirty_report_subrange_leaves_other_bits() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 16, Prot::RW);
    let h = s.handle();
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    h.write(PAGE_SIZE, &[1]).unwrap();
    h.write(12 * PAGE_SIZE, &[1]).unwrap();
    let mut bm = [0u8; 1];
    s.dirty_report(0, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 8), vec![1]);
    s.dirty_report(8 * PAGE_SIZE, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 8), vec![4]);
}

#[test]
fn test_dirty_report_error_clears_no_bit() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 64, Prot::RW);
    let h = s.handle();
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    h.write(5 * PAGE_SIZE, &[1]).unwrap();
    // Bitmap too small, misaligned range, smaller page size, overflow: all fail.
    let mut small = [0u8; 1];
    assert!(s
        .dirty_report(0, 64 * PAGE_SIZE, PAGE_SIZE, &mut small)
        .is_err());
    let mut bm = [0u8; 8];
    assert!(s
        .dirty_report(100, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .is_err());
    assert!(s.dirty_report(0, 8 * PAGE_SIZE, 2048, &mut bm).is_err());
    assert!(matches!(
        s.dirty_report(u64::MAX - PAGE_SIZE + 1, 2 * PAGE_SIZE, PAGE_SIZE, &mut bm),
        Err(DmaError::Overflow { .. })
    ));
    s.dirty_report(0, 64 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 64), vec![5]);
}

#[test]
fn test_dirty_writable_pin_reported_while_pinned() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 8, Prot::RW);
    let h = s.handle();
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    let mut a = [0u64; 2];
    h.pin_pages(&[2, 3], Prot::RW, &mut a).unwrap();
    h.pin_pages(&[6], Prot::READ, &mut a[..1]).unwrap();
    let mut bm = [0u8; 1];
    for _ in 0..2 {
        // Reported dirty on every report while pinned writable (the device may write).
        s.dirty_report(0, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
            .unwrap();
        assert_eq!(bits(&bm, 8), vec![2, 3]);
    }
    h.unpin_pages(&[2, 3]).unwrap();
    s.dirty_report(0, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 8), Vec::<usize>::new());
}

#[test]
fn test_dirty_larger_report_pgsize_folds_pages() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 16, Prot::RW);
    let h = s.handle();
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    assert_eq!(
        s.dirty_start(PAGE_SIZE, &[]).unwrap_err().errno(),
        libc::EBUSY
    );
    h.write(5 * PAGE_SIZE, &[1]).unwrap();
    let mut bm = [0u8; 1];
    s.dirty_report(0, 16 * PAGE_SIZE, 4 * PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 4), vec![1]);
}

#[test]
fn test_dirty_region_mapped_after_start_is_logged() {
    let s = space(PinPolicy::Translate, 0);
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    map_pages(&s, 8, 8, Prot::RW);
    let h = s.handle();
    h.write(10 * PAGE_SIZE, &[1]).unwrap();
    let mut bm = [0u8; 2];
    // The range also covers unmapped pages 0..8: reported clean.
    s.dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 16), vec![10]);
}

#[test]
fn test_dirty_unmap_all_stops_logging_for_next_client() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::RW);
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    s.unmap_all(&mut no_notify());
    // A reconnecting client can start logging again.
    map_pages(&s, 0, 4, Prot::RW);
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    let mut bm = [0u8; 1];
    s.dirty_report(0, 4 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bm[0], 0);
}

#[test]
fn test_dirty_smaller_report_pgsize_replicates_and_keeps_edge_bits() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 16, Prot::RW);
    let h = s.handle();
    // Track at 16 KiB, report at 4 KiB.
    s.dirty_start(4 * PAGE_SIZE, &[]).unwrap();
    h.write(5 * PAGE_SIZE, &[1]).unwrap(); // tracked page 1 = 4 KiB pages 4..8
    let mut bm = [0u8; 1];
    // A report over pages 6..8 covers only half of tracked page 1: reported, not cleared.
    s.dirty_report(6 * PAGE_SIZE, 2 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 2), vec![0, 1]);
    let mut bm = [0u8; 2];
    s.dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 16), vec![4, 5, 6, 7]);
    // Now it was wholly inside a report: cleared.
    s.dirty_report(0, 16 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bits(&bm, 16), Vec::<usize>::new());
}
