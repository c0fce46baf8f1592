//! The server's own memory stays bounded under a client that maps and unmaps forever:
//! VmRSS of this process (server in-process) before and after N DMA_MAP/DMA_UNMAP cycles
//! over the socket, alternating fd-backed and fd-less maps at moving addresses and sizes.
//! 10 000 cycles take about a second in a debug build; `--nocapture` prints the numbers.
//! (The test device records every unmap notification, 16 bytes each, inside the budget.)

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::os::fd::AsRawFd;
use std::time::Instant;

use common::TestServer;
use hostile::*;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::wire::Put;
use umdev::protocol::Command;
use umdev::testing::{memfd, RawClient};

/// Most RSS growth tolerated between the warmed-up state and the end (allocator noise).
const MAX_GROWTH_KIB: u64 = 4 * 1024;

fn cycle(c: &mut RawClient, mem: &std::fs::File, i: u64) {
    let iova = 0x1000_0000 + (i % 64) * 0x10_0000;
    let size = 0x1000 * (1 + i % 16);
    let map = DmaMapRequest {
        flags: 3,
        offset: 0,
        iova,
        size,
    };
    let fds = if i.is_multiple_of(2) {
        vec![mem.as_raw_fd()]
    } else {
        vec![]
    };
    let r = c.call(Command::DmaMap as u16, 0, &map.encode(), &fds);
    assert!(!r.header.is_error(), "map {i}: errno {}", r.header.error);
    let mut p = Vec::new();
    p.put_u32(24);
    p.put_u32(0);
    p.put_u64(iova);
    p.put_u64(size);
    let r = c.call(Command::DmaUnmap as u16, 0, &p, &[]);
    assert!(!r.header.is_error(), "unmap {i}: errno {}", r.header.error);
}

fn map_unmap_cycles(n: u64) {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10_0000).unwrap();
    let fds0 = open_fds();
    let warm = n / 10;
    for i in 0..warm {
        cycle(&mut c, &mem, i);
    }
    let rss0 = rss_kib();
    let t0 = Instant::now();
    for i in warm..n {
        cycle(&mut c, &mem, i);
    }
    let elapsed = t0.elapsed();
    let rss1 = rss_kib();
    eprintln!(
        "{} map/unmap cycles in {elapsed:?} ({} warm-up): VmRSS {rss0} KiB -> {rss1} KiB ({:+} KiB)",
        n - warm,
        warm,
        rss1 as i64 - rss0 as i64
    );
    settle_dma(ts.dma(), 0, "after the cycles");
    settle_fds(fds0, "after the cycles");
    assert!(
        rss1 <= rss0 + MAX_GROWTH_KIB,
        "RSS grew from {rss0} KiB to {rss1} KiB over {n} cycles"
    );
    assert_eq!(ts.state().unmaps.len() as u64, n, "every unmap notified");
}

#[test]
fn test_memory_10000_map_unmap_cycles_rss_bounded() {
    map_unmap_cycles(10_000);
}
