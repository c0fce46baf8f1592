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
    for _ in 0..40 {
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
    assert!(ops.load(Ordering::Relaxed) > 0);
    let st = s.stats();
    assert_eq!(st.pinned_pages, 0);
    assert_eq!(st.locked_pages, 0);
    assert_eq!(st.leaked_pins_released, 0);
    s.check_invariants().unwrap();
}
