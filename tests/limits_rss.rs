//! The server's memory stays bounded under map/unmap churn: RSS and open fds before and
//! after 10 000 DMA_MAP/DMA_UNMAP cycles through a real socket. Alone in its own test binary
//! because RSS is per process and other tests would add their own allocations.

use std::os::fd::AsRawFd;

use umdev::dma::PAGE_SIZE;
use umdev::protocol::dma_map::{
    DmaMapRequest, DmaUnmapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE,
};
use umdev::protocol::Command;
use umdev::testing::{memfd, open_fds, wait_until, RawClient, TestServer};
use umdev_devices::gpu::{Gpu, GpuConfig};

const BASE: u64 = 0x100_0000;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page / 1024
}

#[test]
fn test_limits_10000_map_unmap_cycles_keep_rss_and_fds_bounded() {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let served = TestServer::builder_pci(gpu).unwrap().start().unwrap();
    let mem = memfd(16 * PAGE_SIZE).unwrap();
    let mut c = RawClient::new_default(served.path());
    let cycle = |c: &mut RawClient, i: u64| {
        let iova = BASE + (i % 4) * 16 * PAGE_SIZE;
        let p = DmaMapRequest {
            flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
            offset: 0,
            iova,
            size: 16 * PAGE_SIZE,
        }
        .encode();
        let m = c.call(Command::DmaMap as u16, 0, &p, &[mem.as_raw_fd()]);
        assert_eq!(m.header.error, 0, "map {i}");
        let m = c.call(
            Command::DmaUnmap as u16,
            0,
            &DmaUnmapRequest {
                argsz: 24,
                all: false,
                iova,
                size: 16 * PAGE_SIZE,
            }
            .encode(),
            &[],
        );
        assert_eq!(m.header.error, 0, "unmap {i}");
    };
    for i in 0..1000 {
        cycle(&mut c, i);
    }
    let (rss0, fds0) = (rss_kib(), open_fds());
    let t = std::time::Instant::now();
    for i in 0..10_000 {
        cycle(&mut c, i);
    }
    let (rss1, fds1) = (rss_kib(), open_fds());
    eprintln!(
        "10000 map/unmap cycles in {:?}: RSS {rss0} KiB -> {rss1} KiB, fds {fds0} -> {fds1}",
        t.elapsed()
    );
    assert!(
        fds1 == fds0 || wait_until(std::time::Duration::from_secs(2), || open_fds() == fds0),
        "fds leaked: {fds0} -> {}",
        open_fds()
    );
    assert!(
        rss1 < rss0 + 2048,
        "RSS grew by {} KiB over 10000 cycles",
        rss1.saturating_sub(rss0)
    );
    assert_eq!(served.dma().stats().maps, 0);
    served.dma().check_invariants().unwrap();
}
