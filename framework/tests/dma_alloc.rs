//! The one-page pin/unpin path allocates nothing (seeds/01: no allocation for npage == 1),
//! checked with a counting global allocator that counts only this thread's allocations.

mod dma_util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use dma_util::*;
use umdev::dma::{PinPolicy, Prot};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

#[test]
fn test_one_page_pin_unpin_allocates_nothing() {
    for policy in [PinPolicy::Translate, PinPolicy::Lock, PinPolicy::Populate] {
        let s = space(policy, 1024);
        map_pages(&s, 0x100, 64, Prot::RW);
        let h = s.handle();
        let mut a = [0u64; 1];
        // Warm up: the first pin allocates the page's chunk of pin counters (which also
        // shows the counter works).
        let w0 = allocs();
        h.pin_pages(&[0x101], Prot::RW, &mut a).unwrap();
        assert!(allocs() > w0);
        h.unpin_pages(&[0x101]).unwrap();
        let before = allocs();
        for _ in 0..100 {
            h.pin_pages(&[0x102], Prot::RW, &mut a).unwrap();
            h.unpin_pages(&[0x102]).unwrap();
            h.naive().pin_pages(&[0x103], Prot::READ, &mut a).unwrap();
            h.naive().unpin_pages(&[0x103]).unwrap();
        }
        // Multi-page arrays of any pattern allocate nothing either.
        let pfns = [0x110, 0x111, 0x112, 0x120, 0x105, 0x106];
        let mut many = [0u64; 6];
        h.pin_pages(&pfns, Prot::RW, &mut many).unwrap();
        h.unpin_pages(&pfns).unwrap();
        assert_eq!(allocs() - before, 0, "policy {policy:?} allocated");
    }
}
