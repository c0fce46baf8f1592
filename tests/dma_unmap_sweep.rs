//! DMA_UNMAP through the socket with the kernel's type1v2 semantics, the way QEMU 10.2's
//! vIOMMU replay (`intel-iommu,caching-mode=on`) uses it: sweeps over several maps and empty
//! space, whole-address-space ranges, ranges ending exactly at 2^64. Every covered map goes
//! (its pins dropped by the device's notifier before the reply), a range that splits a map is
//! EINVAL and changes nothing, a range covering nothing succeeds with size 0 in the reply.
//! Before, a sweep was ENOENT and the stale maps survived a guest reboot: the next kernel's
//! DMA_MAPs at the same IOVAs got EEXIST and device DMA went to the old memory.

mod common;

use std::os::fd::{AsRawFd, RawFd};

use common::test_device::*;
use common::TestServer;
use umdev::protocol::dma_map::{
    DmaMapRequest, DmaUnmapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE, DMA_UNMAP_FLAG_ALL,
};
use umdev::protocol::Command;
use umdev::testing::{memfd, Msg, RawClient};

const PAGE: u64 = 4096;
/// The last page of the IOVA space: a range starting here with size 0x1000 ends at 2^64.
const TOP_PAGE: u64 = u64::MAX - 0xfff;

fn map(c: &mut RawClient, iova: u64, size: u64, fd: Option<RawFd>) -> Msg {
    let p = DmaMapRequest {
        flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
        offset: 0,
        iova,
        size,
    }
    .encode();
    let fds: Vec<RawFd> = fd.into_iter().collect();
    c.call(Command::DmaMap as u16, 0, &p, &fds)
}

fn map_ok(c: &mut RawClient, iova: u64, size: u64, fd: Option<RawFd>) {
    let r = map(c, iova, size, fd);
    assert!(
        !r.header.is_error(),
        "DMA_MAP {iova:#x}+{size:#x}: errno {}",
        r.header.error
    );
}

fn unmap(c: &mut RawClient, iova: u64, size: u64) -> Msg {
    let p = DmaUnmapRequest {
        argsz: 24,
        all: false,
        iova,
        size,
    }
    .encode();
    c.call(Command::DmaUnmap as u16, 0, &p, &[])
}

/// DMA_UNMAP that must succeed; returns the reply's size field (bytes removed) after
/// checking the rest of the entry is echoed.
fn unmap_ok(c: &mut RawClient, iova: u64, size: u64) -> u64 {
    let r = unmap(c, iova, size);
    assert!(
        !r.header.is_error(),
        "DMA_UNMAP {iova:#x}+{size:#x}: errno {}",
        r.header.error
    );
    reply_size(&r, 0, iova)
}

/// The size field of a DMA_UNMAP reply whose argsz, flags and iova are as expected.
fn reply_size(r: &Msg, flags: u32, iova: u64) -> u64 {
    assert_eq!(r.payload.len(), 24, "DMA_UNMAP reply payload");
    let u32_at = |o: usize| u32::from_ne_bytes(r.payload[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_ne_bytes(r.payload[o..o + 8].try_into().unwrap());
    assert_eq!((u32_at(0), u32_at(4), u64_at(8)), (24, flags, iova));
    u64_at(16)
}

/// The device reads 4 bytes at `iova` by DMA; returns DMA_STATUS (0 or an errno).
fn device_read(c: &mut RawClient, iova: u64) -> u32 {
    c.region_write(0, REG_DMA_IOVA, &iova.to_le_bytes(), 0);
    c.region_write(0, REG_DMA_LEN, &4u32.to_le_bytes(), 0);
    c.region_write(0, REG_DMA_OP, &1u32.to_le_bytes(), 0);
    u32::from_le_bytes(c.region_read(0, REG_DMA_STATUS, 4).try_into().unwrap())
}

/// The device pins the page at `iova` (it keeps the pin until its unmap notifier).
fn device_pin(c: &mut RawClient, iova: u64) {
    c.region_write(0, REG_PIN_PFN, &(iova / PAGE).to_le_bytes(), 0);
    c.region_write(0, REG_PIN_OP, &1u32.to_le_bytes(), 0);
    let status = u32::from_le_bytes(c.region_read(0, REG_DMA_STATUS, 4).try_into().unwrap());
    assert_eq!(status, 0, "pin of {iova:#x}");
}

/// Three fd-backed maps with gaps under 2 MiB, plus one at 4 MiB:
/// [0x10000, +16K), [0x40000, +64K), [0x100000, +4K), [0x400000, +32K).
const MAPS: [(u64, u64); 4] = [
    (0x1_0000, 0x4000),
    (0x4_0000, 0x1_0000),
    (0x10_0000, 0x1000),
    (0x40_0000, 0x8000),
];

fn map_all(c: &mut RawClient, mem: &std::fs::File) {
    for (iova, size) in MAPS {
        map_ok(c, iova, size, Some(mem.as_raw_fd()));
    }
}

#[test]
fn test_sweep_power_of_two_over_maps_and_gaps_removes_covered_reply_bytes() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    map_all(&mut c, &mem);
    // [0, 2 MiB): the first three maps and the space around them.
    let removed = unmap_ok(&mut c, 0, 0x20_0000);
    assert_eq!(removed, 0x4000 + 0x1_0000 + 0x1000);
    assert_eq!(ts.dma().stats().maps, 1);
    assert_eq!(
        ts.state().unmaps,
        vec![
            (0x1_0000, 0x4000),
            (0x4_0000, 0x1_0000),
            (0x10_0000, 0x1000)
        ],
        "the device is notified once per removed map"
    );
    assert_eq!(device_read(&mut c, 0x4_0000), libc::EFAULT as u32);
    assert_eq!(
        device_read(&mut c, 0x40_0000),
        0,
        "the map outside survives"
    );
    // The next guest kernel maps the same IOVAs again: no EEXIST.
    for (iova, size) in &MAPS[..3] {
        map_ok(&mut c, *iova, *size, Some(mem.as_raw_fd()));
    }
    assert_eq!(ts.dma().stats().maps, 4);
    ts.dma().check_invariants().unwrap();
}

#[test]
fn test_sweep_whole_address_space_removes_every_map() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    map_all(&mut c, &mem);
    map_ok(&mut c, 0x8000_0000_0000_0000, 0x1000, None);
    // The two halves of the address space, the upper one ending at 2^64.
    assert_eq!(unmap_ok(&mut c, 1 << 63, 1 << 63), 0x1000);
    assert_eq!(ts.dma().stats().maps, 4);
    assert_eq!(unmap_ok(&mut c, 0, 1 << 63), 0x1_d000);
    assert_eq!(ts.dma().stats().maps, 0);
    // The largest range a u64 size allows: everything but the last page.
    map_all(&mut c, &mem);
    assert_eq!(unmap_ok(&mut c, 0, TOP_PAGE), 0x1_d000);
    assert_eq!(ts.dma().stats().maps, 0);
    assert_eq!(ts.state().unmaps.len(), 9);
}

#[test]
fn test_sweep_range_ending_at_2_pow_64_accepted() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x4000).unwrap();
    // The highest map possible: it ends one page below 2^64 (a map cannot end at 2^64).
    let top_map = TOP_PAGE - 0x4000;
    map_ok(&mut c, top_map, 0x4000, Some(mem.as_raw_fd()));
    // Nothing in the last page itself.
    assert_eq!(unmap_ok(&mut c, TOP_PAGE, 0x1000), 0);
    assert_eq!(ts.dma().stats().maps, 1);
    // From the map to 2^64.
    assert_eq!(unmap_ok(&mut c, top_map, 0x5000), 0x4000);
    assert_eq!(ts.dma().stats().maps, 0);
    assert_eq!(ts.state().unmaps, vec![(top_map, 0x4000)]);
    // One page past 2^64 still wraps.
    let r = unmap(&mut c, TOP_PAGE, 0x2000);
    assert_eq!(r.header.error, libc::EINVAL as u32);
}

#[test]
fn test_sweep_splitting_a_map_einval_nothing_removed_then_exact_unmap_works() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    map_all(&mut c, &mem);
    for (iova, size) in [
        (0x4_8000, 0x1000),    // inside the 64 KiB map
        (0x0, 0x4_8000),       // covers the first map, ends inside the second
        (0x4_8000, 0x20_0000), // starts inside the second, covers the third
    ] {
        let r = unmap(&mut c, iova, size);
        assert!(r.header.is_error(), "{iova:#x}+{size:#x} accepted");
        assert_eq!(r.header.error, libc::EINVAL as u32, "{iova:#x}+{size:#x}");
        assert_eq!(
            ts.dma().stats().maps,
            4,
            "{iova:#x}+{size:#x} removed a map"
        );
        assert!(
            ts.state().unmaps.is_empty(),
            "device notified of a refused unmap"
        );
        assert_eq!(device_read(&mut c, 0x1_0000), 0);
        assert_eq!(device_read(&mut c, 0x4_8000), 0);
    }
    // The exact range of the map still unmaps it.
    assert_eq!(unmap_ok(&mut c, 0x4_0000, 0x1_0000), 0x1_0000);
    assert_eq!(ts.dma().stats().maps, 3);
    assert_eq!(ts.state().unmaps, vec![(0x4_0000, 0x1_0000)]);
}

#[test]
fn test_sweep_empty_range_succeeds_zero_bytes_nothing_notified() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    map_all(&mut c, &mem);
    for (iova, size) in [(0x0, 0x1_0000), (0x1_4000, 0x2_c000), (0x80_0000, 1 << 40)] {
        assert_eq!(unmap_ok(&mut c, iova, size), 0, "{iova:#x}+{size:#x}");
    }
    assert_eq!(ts.dma().stats().maps, 4);
    assert!(ts.state().unmaps.is_empty());
}

#[test]
fn test_sweep_pinned_pages_released_by_notifier_before_reply() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    map_all(&mut c, &mem);
    let pinned = [0x1_1000, 0x4_0000, 0x4_f000, 0x10_0000, 0x40_0000];
    for iova in pinned {
        device_pin(&mut c, iova);
    }
    assert_eq!(ts.dma().stats().pinned_pages, 5);
    // The reply comes after the notifier ran: by the time the client sees it, every pin in
    // the swept maps is gone and none had to be forced.
    unmap_ok(&mut c, 0, 0x20_0000);
    let st = ts.dma().stats();
    assert_eq!(st.pinned_pages, 1, "{st:?}");
    assert_eq!(
        st.leaked_pins_released, 0,
        "pins forced, not dropped by the notifier"
    );
    let dev = ts.state();
    assert_eq!(
        dev.notifier_unpins,
        vec![0x11, 0x40, 0x4f, 0x100],
        "pages the notifier unpinned"
    );
    assert_eq!(dev.pins, vec![0x400]);
    drop(dev);
    ts.dma().check_invariants().unwrap();
}

#[test]
fn test_sweep_frees_mapped_bytes_budget_by_bytes_removed() {
    let ts = TestServer::start_with(|c| c.max_dma_mapped_bytes = 1 << 30);
    let mut c = RawClient::new_default(ts.path());
    let half = 1u64 << 29;
    map_ok(&mut c, 0, half, None);
    map_ok(&mut c, 2 * half, half, None);
    let over = |c: &mut RawClient| map(c, 8 << 30, 0x1000, None).header.error;
    assert_eq!(over(&mut c), libc::ENOSPC as u32);
    // A range covering nothing frees nothing, however large.
    assert_eq!(unmap_ok(&mut c, 4 << 30, 4 << 30), 0);
    assert_eq!(over(&mut c), libc::ENOSPC as u32);
    // A sweep over both maps frees both.
    assert_eq!(unmap_ok(&mut c, 0, 4 << 30), 2 * half);
    map_ok(&mut c, 8 << 30, 1 << 30, None);
}

#[test]
fn test_unmap_all_reply_size_is_bytes_removed_and_frees_budget() {
    let ts = TestServer::start_with(|c| c.max_dma_mapped_bytes = 1 << 30);
    let mut c = RawClient::new_default(ts.path());
    map_ok(&mut c, 0, 1 << 29, None);
    map_ok(&mut c, 1 << 32, 1 << 29, None);
    let p = DmaUnmapRequest {
        argsz: 24,
        all: true,
        iova: 0,
        size: 0,
    }
    .encode();
    let r = c.call(Command::DmaUnmap as u16, 0, &p, &[]);
    assert!(!r.header.is_error(), "errno {}", r.header.error);
    assert_eq!(reply_size(&r, DMA_UNMAP_FLAG_ALL, 0), 1 << 30);
    assert_eq!(ts.dma().stats().maps, 0);
    map_ok(&mut c, 0, 1 << 30, None);
}
