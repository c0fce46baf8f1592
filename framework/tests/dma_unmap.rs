//! Unmap with pins held, and concurrency between pinning threads and map/unmap.

mod dma_util;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use dma_util::*;
use umdev::dma::{DmaError, PinPolicy, Prot, PAGE_SIZE};

#[test]
fn test_unmap_device_releases_in_notifier_no_leak() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, 0x10, 8, Prot::RW);
    let h = s.handle();
    let pfns: Vec<u64> = (0x10..0x18).collect();
    let mut a = vec![0u64; 8];
    h.pin_pages(&pfns, Prot::RW, &mut a).unwrap();
    let h2 = h.clone();
    let mut notified = Vec::new();
    let report = s
        .unmap(0x10000, 0x8000, &mut |iova, size| {
            notified.push((iova, size));
            h2.unpin_pages(&pfns).unwrap();
        })
        .unwrap();
    assert_eq!(notified, vec![(0x10000, 0x8000)]);
    assert_eq!(report.leftover_pins, 0);
    assert_eq!(report.maps_removed, 1);
    let st = s.stats();
    assert_eq!(
        (st.pinned_pages, st.locked_pages, st.leaked_pins_released),
        (0, 0, 0)
    );
    assert_eq!(st.maps, 0);
    s.check_invariants().unwrap();
}

#[test]
fn test_unmap_device_ignores_notifier_pins_force_released() {
    let s = space(PinPolicy::Lock, 64);
    map_pages(&s, 0x10, 8, Prot::RW);
    map_pages(&s, 0x20, 8, Prot::RW);
    let h = s.handle();
    let mut a = vec![0u64; 4];
    h.pin_pages(&[0x11, 0x12, 0x12, 0x21], Prot::RW, &mut a)
        .unwrap();
    let report = s.unmap(0x10000, 0x8000, &mut no_notify()).unwrap();
    assert_eq!(report.leftover_pins, 2);
    let st = s.stats();
    assert_eq!(st.leaked_pins_released, 2);
    assert_eq!(st.pinned_pages, 1);
    assert_eq!(st.locked_pages, 1);
    s.check_invariants().unwrap();
    // The stale host address still points at valid (scratch) memory, not guest memory.
    // SAFETY: the test deliberately uses a stale pinned address; umdev keeps it mapped to
    // scratch memory for the space's lifetime.
    unsafe { std::ptr::write_volatile(a[0] as *mut u8, 1) };
    // The device's later unpin of the released pages fails cleanly.
    assert!(matches!(
        h.unpin_pages(&[0x11]),
        Err(DmaError::NotMapped { .. })
    ));
    h.unpin_pages(&[0x21]).unwrap();
    assert_eq!(s.stats().locked_pages, 0);
}

#[test]
fn test_unmap_all_removes_everything_and_reports() {
    let s = space(PinPolicy::Translate, 0);
    for k in 0..10 {
        map_pages(&s, k * 4, 2, Prot::RW);
    }
    let h = s.handle();
    let mut a = [0u64; 1];
    h.pin_pages(&[8], Prot::READ, &mut a).unwrap();
    let mut n = 0;
    let report = s.unmap_all(&mut |_, _| n += 1);
    assert_eq!(n, 10);
    assert_eq!(report.maps_removed, 10);
    assert_eq!(report.leftover_pins, 1);
    assert_eq!(s.stats().maps, 0);
    assert_eq!(s.stats().pinned_pages, 0);
    // The handle stays usable for the next client.
    map_pages(&s, 0, 1, Prot::RW);
    h.write(0, b"again").unwrap();
}

#[test]
fn test_pin_during_unmap_notifier_is_refused() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 4, Prot::RW);
    let h = s.handle();
    let mut result = None;
    s.unmap(0, 4 * PAGE_SIZE, &mut |_, _| {
        let mut a = [0u64; 1];
        result = Some(h.pin_pages(&[1], Prot::READ, &mut a));
    })
    .unwrap();
    assert!(matches!(result, Some(Err(DmaError::NotMapped { .. }))));
    assert_eq!(s.stats().leaked_pins_released, 0);
}

/// 4 threads pin/unpin and dma_rw on a stable region and on regions that a fifth thread
/// maps and unmaps; the device's notifier waits until workers dropped their pins in the
/// range. Afterwards the counts are exact and nothing leaked.
#[test]
fn test_concurrent_pin_unpin_with_map_unmap_no_lost_update() {
    let s = space(PinPolicy::Lock, 1 << 20);
    map_pages(&s, 0, 64, Prot::RW); // stable
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    // Workers inside the churned range (pfn 0x1000..0x1010); the notifier raises `quiesce`
    // and waits for them to leave, like a device quiescing its DMA.
    let held = Arc::new(AtomicU64::new(0));
    let quiesce = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for t in 0..4u64 {
        let h = s.handle();
        let stop = stop.clone();
        let ops = ops.clone();
        let held = held.clone();
        let quiesce = quiesce.clone();
        workers.push(std::thread::spawn(move || {
            let mut a = [0u64; 8];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let base = (t * 8 + i % 5) % 56;
                let pfns: Vec<u64> = (base..base + 8).collect();
                h.pin_pages(&pfns, Prot::RW, &mut a).unwrap();
                h.write(base * PAGE_SIZE, &[t as u8; 64]).unwrap();
                h.unpin_pages(&pfns).unwrap();
                // Churned range: may be unmapped at any time.
                held.fetch_add(1, Ordering::SeqCst);
                let pfn = 0x1000 + (i % 16);
                if !quiesce.load(Ordering::SeqCst)
                    && h.pin_pages(&[pfn, pfn], Prot::READ, &mut a[..2]).is_ok()
                {
                    let mut buf = [0u8; 16];
                    let _ = h.read(pfn * PAGE_SIZE, &mut buf);
                    h.unpin_pages(&[pfn, pfn]).unwrap();
                }
                held.fetch_sub(1, Ordering::SeqCst);
                ops.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    // The workers must really run during the churn, however loaded the machine is: wait
    // for them to start, and churn until they made progress during at least 40 rounds.
    let wait_for = |n: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while ops.load(Ordering::Relaxed) < n {
            assert!(std::time::Instant::now() < deadline, "workers never ran");
            std::thread::yield_now();
        }
    };
    wait_for(4);
    let at_start = ops.load(Ordering::Relaxed);
    for round in 0.. {
        if round >= 40 && ops.load(Ordering::Relaxed) > at_start + 40 {
            break;
        }
        assert!(round < 100_000, "workers made no progress during the churn");
        map_pages(&s, 0x1000, 16, Prot::RW);
        std::thread::yield_now();
        let report = s
            .unmap(0x1000 * PAGE_SIZE, 16 * PAGE_SIZE, &mut |_, _| {
                quiesce.store(true, Ordering::SeqCst);
                while held.load(Ordering::SeqCst) != 0 {
                    std::thread::yield_now();
                }
            })
            .unwrap();
        quiesce.store(false, Ordering::SeqCst);
        assert_eq!(report.leftover_pins, 0);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert!(ops.load(Ordering::Relaxed) > at_start);
    let st = s.stats();
    assert_eq!(st.pinned_pages, 0);
    assert_eq!(st.locked_pages, 0);
    assert_eq!(st.leaked_pins_released, 0);
    s.check_invariants().unwrap();
}

// Which mappings an unmap removes: the kernel's type1v2 rules (QEMU's vIOMMU replay sends
// sweeps, whole sections and ranges ending at 2^64, not one mapping at a time).

/// Four mappings with gaps: pfn 0x10 (4 pages), 0x20 (8), 0x40 (1), 0x100 (2).
fn four_maps(policy: PinPolicy, limit_pages: u64) -> Arc<umdev::dma::DmaSpace> {
    let s = space(policy, limit_pages);
    for (pfn, n) in [(0x10, 4), (0x20, 8), (0x40, 1), (0x100, 2)] {
        map_pages(&s, pfn, n, Prot::RW);
    }
    s
}

#[test]
fn test_unmap_sweep_removes_every_covered_map_notifies_each_reports_bytes() {
    let s = four_maps(PinPolicy::Translate, 0);
    let mut notified = Vec::new();
    // [0x8000, 0x80000): three maps and the gaps between them, not the one at 0x100000.
    let report = s
        .unmap(0x8000, 0x78000, &mut |iova, size| {
            notified.push((iova, size))
        })
        .unwrap();
    assert_eq!(
        notified,
        vec![(0x10000, 0x4000), (0x20000, 0x8000), (0x40000, 0x1000)]
    );
    assert_eq!(report.maps_removed, 3);
    assert_eq!(report.bytes_removed, 13 * PAGE_SIZE);
    assert_eq!(report.leftover_pins, 0);
    assert_eq!(s.stats().maps, 1);
    let h = s.handle();
    assert!(matches!(
        h.read(0x20000, &mut [0u8; 4]),
        Err(DmaError::NotMapped { .. })
    ));
    h.write(0x100000, b"kept").unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn test_unmap_range_splitting_a_map_einval_nothing_removed_then_exact_works() {
    for (iova, size, split) in [
        (0x11000, 0x40000, 0x10000), // starts inside the first map
        (0x0, 0x24000, 0x20000),     // ends inside the second
        (0x21000, 0x1000, 0x20000),  // strictly inside one map
        (0x12000, 0x10000, 0x10000), // starts in one map, ends in the next
    ] {
        let s = four_maps(PinPolicy::Translate, 0);
        let mut notified = 0;
        let e = s.unmap(iova, size, &mut |_, _| notified += 1).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{iova:#x}+{size:#x}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("[{split:#x}, +")),
            "{iova:#x}+{size:#x} should name the map at {split:#x}: {msg}"
        );
        assert_eq!(notified, 0, "a refused unmap notified the device");
        assert_eq!(s.stats().maps, 4, "a refused unmap removed something");
        s.handle().write(split, b"still mapped").unwrap();
        // An exact unmap of the map still works.
        let size = if split == 0x10000 { 0x4000 } else { 0x8000 };
        let report = s.unmap(split, size, &mut no_notify()).unwrap();
        assert_eq!(report.maps_removed, 1);
        assert_eq!(report.bytes_removed, size);
        s.check_invariants().unwrap();
    }
}

#[test]
fn test_unmap_range_covering_no_map_succeeds_removes_nothing() {
    let s = four_maps(PinPolicy::Translate, 0);
    let mut notified = 0;
    for (iova, size) in [(0x0, 0x10000), (0x14000, 0xc000), (0x200000, 1 << 40)] {
        let report = s.unmap(iova, size, &mut |_, _| notified += 1).unwrap();
        assert_eq!(report, Default::default(), "{iova:#x}+{size:#x}");
    }
    assert_eq!(notified, 0);
    assert_eq!(s.stats().maps, 4);
}

#[test]
fn test_unmap_whole_address_space_and_ranges_ending_at_2_pow_64() {
    let top = u64::MAX - 0xfff; // the last page
    let s = four_maps(PinPolicy::Translate, 0);
    // A map just below the last page (a map cannot end at 2^64 itself).
    map_pages(&s, (top >> 12) - 4, 4, Prot::RW);
    // The upper half, ending exactly at 2^64: only the top map.
    let report = s.unmap(1 << 63, 1 << 63, &mut no_notify()).unwrap();
    assert_eq!((report.maps_removed, report.bytes_removed), (1, 0x4000));
    // The last page alone, ending at 2^64: nothing there.
    assert_eq!(
        s.unmap(top, 0x1000, &mut no_notify()).unwrap().maps_removed,
        0
    );
    // The largest aligned range from 0: everything else.
    let report = s.unmap(0, top, &mut no_notify()).unwrap();
    assert_eq!(
        (report.maps_removed, report.bytes_removed),
        (4, 15 * PAGE_SIZE)
    );
    assert_eq!(s.stats().maps, 0);
    s.check_invariants().unwrap();
    // Past 2^64, size 0, unaligned: EINVAL, as before.
    for (iova, size) in [(top, 0x2000), (0x10000, 0), (0x10800, 0x1000), (0, 0x800)] {
        let e = s.unmap(iova, size, &mut no_notify()).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{iova:#x}+{size:#x}");
    }
}

#[test]
fn test_unmap_sweep_pins_released_by_notifier_before_return() {
    let s = four_maps(PinPolicy::Lock, 64);
    let h = s.handle();
    let pfns = [0x11, 0x12, 0x20, 0x27, 0x40, 0x100];
    let mut a = [0u64; 6];
    h.pin_pages(&pfns, Prot::RW, &mut a).unwrap();
    assert_eq!(s.stats().locked_pages, 6);
    // The device drops the pins inside each notified map, as a real device does.
    let h2 = h.clone();
    let mut dropped = Vec::new();
    let report = s
        .unmap(0x0, 0x80000, &mut |iova, size| {
            let inside: Vec<u64> = pfns
                .iter()
                .copied()
                .filter(|&p| p * PAGE_SIZE >= iova && p * PAGE_SIZE < iova + size)
                .collect();
            h2.unpin_pages(&inside).unwrap();
            dropped.extend(inside);
        })
        .unwrap();
    assert_eq!(dropped, vec![0x11, 0x12, 0x20, 0x27, 0x40]);
    assert_eq!(report.maps_removed, 3);
    assert_eq!(report.leftover_pins, 0);
    let st = s.stats();
    assert_eq!(
        (st.pinned_pages, st.locked_pages, st.leaked_pins_released),
        (1, 1, 0)
    );
    s.check_invariants().unwrap();
    h.unpin_pages(&[0x100]).unwrap();
}

#[test]
fn test_unmap_sweep_device_ignoring_notifier_pins_force_released_in_every_map() {
    let s = four_maps(PinPolicy::Lock, 64);
    let h = s.handle();
    let mut a = [0u64; 4];
    h.pin_pages(&[0x11, 0x20, 0x20, 0x40], Prot::RW, &mut a)
        .unwrap();
    let report = s.unmap(0x0, 0x80000, &mut no_notify()).unwrap();
    assert_eq!(report.maps_removed, 3);
    assert_eq!(report.leftover_pins, 3, "distinct pages left pinned");
    let st = s.stats();
    assert_eq!((st.pinned_pages, st.locked_pages), (0, 0));
    assert_eq!(st.leaked_pins_released, 3);
    s.check_invariants().unwrap();
}

/// A guest with 20k small maps (a vIOMMU replay's worth): sweeps of random power-of-two
/// ranges agree with a model of type1v2 (remove what is covered, refuse a split), and the
/// table stays consistent.
#[test]
fn test_unmap_random_sweeps_over_many_maps_match_model() {
    const N: u64 = 20_000;
    // Two-page fd-less maps 5 pages apart (no memfd or mmap per map: cheap to build).
    let s = space(PinPolicy::Translate, 0);
    for k in 0..N {
        map_fdless(&s, k * 5, 2, Prot::RW);
    }
    let mut model: std::collections::BTreeMap<u64, u64> =
        (0..N).map(|k| (k * 0x5000, 0x2000)).collect();
    let (mut removed, mut refused) = (0, 0);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = 1u64 << (12 + x % 16); // 4 KiB .. 128 MiB
        let iova = ((x >> 20) % (N * 0x5000)) & !(size - 1);
        let last = iova + size - 1;
        let starts_inside = model
            .range(..iova)
            .next_back()
            .is_some_and(|(&a, &l)| a + l > iova);
        let ends_inside = model
            .range(..=last)
            .next_back()
            .is_some_and(|(&a, &l)| a + l - 1 > last);
        let covered: Vec<u64> = model.range(iova..=last).map(|(&a, _)| a).collect();
        match s.unmap(iova, size, &mut no_notify()) {
            Ok(r) => {
                assert!(!starts_inside && !ends_inside, "{iova:#x}+{size:#x}");
                assert_eq!(r.maps_removed, covered.len() as u64);
                assert_eq!(r.bytes_removed, covered.len() as u64 * 0x2000);
                for a in covered {
                    model.remove(&a);
                    removed += 1;
                }
            }
            Err(e) => {
                assert!(starts_inside || ends_inside, "{iova:#x}+{size:#x}: {e}");
                assert_eq!(e.errno(), libc::EINVAL);
                refused += 1;
            }
        }
        assert_eq!(s.stats().maps, model.len() as u64);
    }
    s.check_invariants().unwrap();
    assert!(
        removed > 0 && refused > 0,
        "{removed} removed, {refused} refused"
    );
}
