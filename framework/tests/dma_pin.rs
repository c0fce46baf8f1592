//! Pin/unpin behaviour of the DMA layer through the public API.

mod dma_util;

use dma_util::*;
use umdev::dma::{DmaError, DmaMapping, PinPolicy, Prot, PAGE_SIZE};
use vm_memory::Bytes;

#[test]
fn test_pin_contiguous_returns_consecutive_host_addresses() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0x100, 16, Prot::RW);
    let h = s.handle();
    let pfns: Vec<u64> = (0x100..0x110).collect();
    let mut addrs = vec![0u64; pfns.len()];
    h.pin_pages(&pfns, Prot::RW, &mut addrs).unwrap();
    for w in addrs.windows(2) {
        assert_eq!(w[1], w[0] + PAGE_SIZE);
    }
    assert_eq!(h.stats().pinned_pages, 16);
    h.unpin_pages(&pfns).unwrap();
    assert_eq!(h.stats().pinned_pages, 0);
    s.check_invariants().unwrap();
}

#[test]
fn test_pin_host_address_sees_dma_write() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0x10, 4, Prot::RW);
    let h = s.handle();
    h.write(0x12 * PAGE_SIZE + 8, &0xdead_beef_u64.to_le_bytes())
        .unwrap();
    let mut addr = [0u64; 1];
    h.pin_pages(&[0x12], Prot::READ, &mut addr).unwrap();
    // SAFETY: page 0x12 is pinned; we read 8 bytes inside it.
    let slice = unsafe { h.pinned_slice(addr[0], PAGE_SIZE as usize) };
    let v: u64 = slice.read_obj(8).unwrap();
    assert_eq!(v, 0xdead_beef);
    h.unpin_pages(&[0x12]).unwrap();
}

#[test]
fn test_pin_duplicates_need_two_unpins() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, 0, 8, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 3];
    h.pin_pages(&[3, 3, 4], Prot::READ, &mut a).unwrap();
    assert_eq!(a[0], a[1]);
    assert_eq!(h.stats().pinned_pages, 2);
    assert_eq!(h.stats().locked_pages, 2);
    h.unpin_pages(&[3]).unwrap();
    assert_eq!(h.stats().pinned_pages, 2);
    h.unpin_pages(&[3, 4]).unwrap();
    assert_eq!(h.stats().pinned_pages, 0);
    assert_eq!(h.stats().locked_pages, 0);
    s.check_invariants().unwrap();
}

#[test]
fn test_pin_limit_exceeded_mid_array_leaves_nothing_pinned() {
    let s = space(PinPolicy::Lock, 10);
    map_pages(&s, 0, 64, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 4];
    h.pin_pages(&[0, 1, 2, 3], Prot::RW, &mut a).unwrap();
    let before = h.stats();
    assert_eq!(before.locked_pages, 4);
    // Runs {10..14} (4 new, ok: 8 locked) then {20..24} (4 new: 12 > 10, fails).
    let pfns: Vec<u64> = (10..14).chain(20..24).collect();
    let mut a = vec![0u64; pfns.len()];
    let e = h.pin_pages(&pfns, Prot::RW, &mut a).unwrap_err();
    assert!(
        matches!(e, DmaError::LimitExceeded { limit: 10, .. }),
        "{e}"
    );
    assert_eq!(e.errno(), libc::ENOMEM);
    let after = h.stats();
    assert_eq!(after.locked_pages, before.locked_pages);
    assert_eq!(after.pinned_pages, before.pinned_pages);
    // Nothing of the failed call stays pinned: unpinning page 10 fails.
    assert!(matches!(
        h.unpin_pages(&[10]),
        Err(DmaError::NotPinned { pfn: 10 })
    ));
    s.check_invariants().unwrap();
}

#[test]
fn test_pin_limit_checked_before_syscall() {
    let s = space(PinPolicy::Lock, 4);
    map_pages(&s, 0, 64, Prot::RW);
    let h = s.handle();
    let mut a = vec![0u64; 8];
    let before = h.stats().residency_syscalls;
    let pfns: Vec<u64> = (0..8).collect();
    assert!(h.pin_pages(&pfns, Prot::RW, &mut a).is_err());
    // The run of 8 exceeds the limit: refused before any mlock.
    assert_eq!(h.stats().residency_syscalls, before);
}

#[test]
fn test_pin_across_two_adjacent_regions_succeeds() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, 0x20, 4, Prot::RW);
    map_pages(&s, 0x24, 4, Prot::RW);
    let h = s.handle();
    let pfns: Vec<u64> = (0x22..0x26).collect();
    let mut a = vec![0u64; 4];
    let sys0 = h.stats().residency_syscalls;
    h.pin_pages(&pfns, Prot::RW, &mut a).unwrap();
    // Two runs, one per region: two mlocks.
    assert_eq!(h.stats().residency_syscalls - sys0, 2);
    assert_eq!(a[1], a[0] + PAGE_SIZE);
    assert_eq!(a[3], a[2] + PAGE_SIZE);
    assert_eq!(h.stats().locked_pages, 4);
    h.unpin_pages(&pfns).unwrap();
    assert_eq!(h.stats().locked_pages, 0);
    s.check_invariants().unwrap();
}

#[test]
fn test_pin_unmapped_page_fails_not_mapped() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 3];
    let e = h.pin_pages(&[1, 2, 9], Prot::READ, &mut a).unwrap_err();
    assert!(matches!(e, DmaError::NotMapped { iova: 0x9000 }), "{e}");
    assert_eq!(h.stats().pinned_pages, 0);
}

#[test]
fn test_pin_fdless_page_fails_with_memfd_hint() {
    let s = space(PinPolicy::Translate, 0);
    map_fdless(&s, 0x40, 4, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 1];
    let e = h.pin_pages(&[0x41], Prot::READ, &mut a).unwrap_err();
    assert!(matches!(e, DmaError::FdLess { .. }));
    assert!(e.to_string().contains("memory-backend-memfd"));
}

#[test]
fn test_pin_readonly_mapping_with_write_fails_permission() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::READ);
    let h = s.handle();
    let mut a = [0u64; 2];
    h.pin_pages(&[0, 1], Prot::READ, &mut a).unwrap();
    let e = h.pin_pages(&[2, 3], Prot::RW, &mut a).unwrap_err();
    assert!(matches!(e, DmaError::Permission { .. }));
    assert_eq!(e.errno(), libc::EPERM);
    assert_eq!(h.stats().pinned_pages, 2);
}

#[test]
fn test_unpin_not_pinned_page_fails_without_underflow() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, 0, 8, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 2];
    h.pin_pages(&[1, 2], Prot::RW, &mut a).unwrap();
    // 1, 2 are pinned once; the duplicate 2 fails the whole call.
    let e = h.unpin_pages(&[1, 2, 2]).unwrap_err();
    assert!(matches!(e, DmaError::NotPinned { pfn: 2 }));
    assert_eq!(h.stats().pinned_pages, 2);
    assert_eq!(h.stats().locked_pages, 2);
    assert!(matches!(
        h.unpin_pages(&[5]),
        Err(DmaError::NotPinned { pfn: 5 })
    ));
    h.unpin_pages(&[2, 1]).unwrap();
    assert_eq!(h.stats().pinned_pages, 0);
    s.check_invariants().unwrap();
}

#[test]
fn test_pin_range_and_unpin_range_round_trip() {
    let s = space(PinPolicy::Populate, 0);
    map_pages(&s, 0x80, 32, Prot::RW);
    let h = s.handle();
    let sys0 = h.stats().residency_syscalls;
    let addr = h.pin_range(0x84, 16, Prot::RW).unwrap();
    assert_eq!(h.stats().residency_syscalls - sys0, 1);
    let mut a = [0u64; 1];
    h.pin_pages(&[0x85], Prot::READ, &mut a).unwrap();
    assert_eq!(a[0], addr + PAGE_SIZE);
    assert!(matches!(
        h.pin_range(0x90, 32, Prot::READ),
        Err(DmaError::InvalidArgument(_))
    ));
    h.unpin_range(0x84, 16).unwrap();
    assert_eq!(h.stats().pinned_pages, 1);
    assert!(h.unpin_range(0x84, 16).is_err());
    h.unpin_pages(&[0x85]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn test_map_overlap_misaligned_and_limit_errors() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0x10, 4, Prot::RW);
    let m = |iova: u64, size: u64| DmaMapping {
        iova,
        size,
        prot: Prot::RW,
        fd: Some(memfd(size.max(PAGE_SIZE))),
        offset: 0,
    };
    assert_eq!(s.map(m(0x13000, 0x2000)).unwrap_err().errno(), libc::EEXIST);
    assert_eq!(s.map(m(0x20800, 0x1000)).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(
        s.map(m(u64::MAX - 0xfff, 0x2000)).unwrap_err().errno(),
        libc::EINVAL
    );
    // A file shorter than offset + size is refused (it would SIGBUS).
    let short = DmaMapping {
        iova: 0x40000,
        size: 0x4000,
        prot: Prot::RW,
        fd: Some(memfd(0x1000)),
        offset: 0,
    };
    assert_eq!(s.map(short).unwrap_err().errno(), libc::EINVAL);
    s.set_max_dma_maps(2);
    map_pages(&s, 0x100, 1, Prot::RW);
    assert_eq!(
        s.map(m(0x200000, 0x1000)).unwrap_err().errno(),
        libc::ENOSPC
    );
    assert_eq!(s.stats().maps, 2);
}

#[test]
fn test_map_fd_offset_is_honoured() {
    let s = space(PinPolicy::Translate, 0);
    let fd = memfd(4 * PAGE_SIZE);
    // Write a marker at file offset 2 pages through a first mapping of the whole file.
    let dup = fd.try_clone().unwrap();
    s.map(DmaMapping {
        iova: 0,
        size: 4 * PAGE_SIZE,
        prot: Prot::RW,
        fd: Some(fd),
        offset: 0,
    })
    .unwrap();
    let h = s.handle();
    h.write(2 * PAGE_SIZE, b"marker").unwrap();
    s.map(DmaMapping {
        iova: 0x100000,
        size: 2 * PAGE_SIZE,
        prot: Prot::READ,
        fd: Some(dup),
        offset: 2 * PAGE_SIZE,
    })
    .unwrap();
    let mut buf = [0u8; 6];
    h.read(0x100000, &mut buf).unwrap();
    assert_eq!(&buf, b"marker");
}

#[test]
fn test_unmap_splitting_a_mapping_fails_einval() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0x10, 4, Prot::RW);
    let e = s.unmap(0x10000, 0x1000, &mut no_notify()).unwrap_err();
    assert!(matches!(e, DmaError::SplitsMapping { .. }));
    assert_eq!(e.errno(), libc::EINVAL);
    assert_eq!(s.stats().maps, 1);
}

#[test]
fn test_pin_recorder_sees_successful_calls_only() {
    use std::sync::{Arc, Mutex};
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::RW);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    s.set_pin_recorder(Some(Arc::new(move |p: &[u64], _| {
        seen2.lock().unwrap().push(p.to_vec())
    })));
    let h = s.handle();
    let mut a = [0u64; 2];
    h.pin_pages(&[1, 2], Prot::READ, &mut a).unwrap();
    assert!(h.pin_pages(&[3, 9], Prot::READ, &mut a).is_err());
    assert_eq!(*seen.lock().unwrap(), vec![vec![1, 2]]);
}

#[test]
fn test_huge_mapping_pins_without_upfront_state() {
    // A sparse 64 GiB memfd: mapping and pinning its last page must be cheap.
    let s = space(PinPolicy::Translate, 0);
    let size = 64u64 << 30;
    s.map(DmaMapping {
        iova: 1 << 40,
        size,
        prot: Prot::RW,
        fd: Some(memfd(size)),
        offset: 0,
    })
    .unwrap();
    let h = s.handle();
    let last = ((1u64 << 40) + size) / PAGE_SIZE - 1;
    let mut a = [0u64; 2];
    h.pin_pages(&[last - 1, last], Prot::RW, &mut a).unwrap();
    assert_eq!(h.stats().pinned_pages, 2);
    h.unpin_pages(&[last - 1, last]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn test_set_policy_busy_while_pinned() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::RW);
    let h = s.handle();
    let mut a = [0u64; 1];
    h.pin_pages(&[0], Prot::READ, &mut a).unwrap();
    assert_eq!(
        s.set_policy(PinPolicy::Lock).unwrap_err().errno(),
        libc::EBUSY
    );
    h.unpin_pages(&[0]).unwrap();
    s.set_policy(PinPolicy::Lock).unwrap();
}

#[test]
fn test_map_20k_small_regions_lookup_and_unmap_correct() {
    // A vIOMMU guest maps many 4 KiB regions: inserts in scattered order, lookups of mapped
    // pages and of the gaps, unmaps of every other one, then unmap_all.
    let s = space(PinPolicy::Translate, 0);
    s.set_max_dma_maps(200_000);
    let n = 20_000u64;
    for k in 0..n {
        // Scattered insertion order.
        let slot = (k * 48_271) % n;
        map_fdless(&s, 2 * slot, 1, Prot::RW);
    }
    assert_eq!(s.stats().maps, n);
    let h = s.handle();
    let mut a = [0u64; 1];
    for slot in (0..n).step_by(97) {
        assert!(matches!(
            h.pin_pages(&[2 * slot], Prot::READ, &mut a),
            Err(DmaError::FdLess { .. })
        ));
        assert!(matches!(
            h.pin_pages(&[2 * slot + 1], Prot::READ, &mut a),
            Err(DmaError::NotMapped { .. })
        ));
    }
    for slot in (0..n).step_by(2) {
        s.unmap(2 * slot * PAGE_SIZE, PAGE_SIZE, &mut no_notify())
            .unwrap();
    }
    assert_eq!(s.stats().maps, n / 2);
    let report = s.unmap_all(&mut no_notify());
    assert_eq!(report.maps_removed, n / 2);
    s.check_invariants().unwrap();
}

#[test]
fn test_huge_fdless_mapping_allocates_no_pin_or_dirty_state() {
    // A client may record a 1 PiB fd-less mapping: nothing per page may be allocated.
    let s = space(PinPolicy::Translate, 0);
    s.map(DmaMapping {
        iova: 1 << 52,
        size: 1 << 50,
        prot: Prot::RW,
        fd: None,
        offset: 0,
    })
    .unwrap();
    s.dirty_start(PAGE_SIZE, &[]).unwrap();
    let h = s.handle();
    let mut a = [0u64; 1];
    assert!(matches!(
        h.pin_pages(&[(1 << 40) + 5], Prot::READ, &mut a),
        Err(DmaError::FdLess { .. })
    ));
    assert!(matches!(
        h.unpin_pages(&[(1 << 40) + 5]),
        Err(DmaError::NotPinned { .. })
    ));
    let mut bm = [0u8; 1];
    s.dirty_report(1 << 52, 8 * PAGE_SIZE, PAGE_SIZE, &mut bm)
        .unwrap();
    assert_eq!(bm[0], 0);
    s.unmap(1 << 52, 1 << 50, &mut no_notify()).unwrap();
}
