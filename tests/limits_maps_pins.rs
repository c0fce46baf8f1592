//! Limits through a real socket: a client mapping up to max_dma_maps gets ENOSPC beyond it
//! (and a slot back after an unmap), refused maps leak no fd, and a device pinning up to the
//! locked-memory limit gets a clear LimitExceeded beyond it with nothing left pinned by the
//! failed call (checked against the kernel's own mlock count). Memory growth over many
//! map/unmap cycles is measured alone in `limits_rss.rs` (RSS is per process).

#[path = "common/independent_client.rs"]
mod independent;

use std::os::fd::AsRawFd;

use independent::{client_map, enable_device};
use umdev::dma::{DmaConfig, DmaError, PinPolicy, Prot, PAGE_SHIFT, PAGE_SIZE};
use umdev::pci::PciAdapter;
use umdev::protocol::dma_map::{
    DmaMapRequest, DmaUnmapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE,
};
use umdev::protocol::Command;
use umdev::testing::{memfd, open_fds, wait_until, RawClient, TestServer, DEFAULT_CAPS};
use umdev_devices::gpu::{Gpu, GpuConfig};

const MAX_MAPS: u32 = 256;

/// The fd counts are per process: the tests of this file run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
const BASE: u64 = 0x100_0000;

fn gpu() -> Gpu {
    Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap()
}

fn serve(
    dma: DmaConfig,
    tune: impl FnOnce(&mut umdev::server::ServerConfig),
) -> TestServer<PciAdapter<Gpu>> {
    TestServer::builder_pci(gpu())
        .unwrap()
        .dma_config(dma)
        .configure(tune)
        .start()
        .unwrap()
}

fn map_payload(iova: u64, size: u64, offset: u64) -> Vec<u8> {
    DmaMapRequest {
        flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
        offset,
        iova,
        size,
    }
    .encode()
}

fn unmap_payload(iova: u64, size: u64) -> Vec<u8> {
    DmaUnmapRequest {
        argsz: 24,
        all: false,
        iova,
        size,
    }
    .encode()
}

/// DMA_MAP one page of `fd` (at page `i` of it) to `BASE + i` pages; the reply's errno.
fn map_page(c: &mut RawClient, fd: &impl AsRawFd, i: u64) -> u32 {
    let p = map_payload(BASE + i * PAGE_SIZE, PAGE_SIZE, i * PAGE_SIZE);
    let m = c.call(Command::DmaMap as u16, 0, &p, &[fd.as_raw_fd()]);
    m.header.error
}

fn unmap_page(c: &mut RawClient, i: u64) -> u32 {
    let p = unmap_payload(BASE + i * PAGE_SIZE, PAGE_SIZE);
    c.call(Command::DmaUnmap as u16, 0, &p, &[]).header.error
}

/// Fill up to `limit` maps, check the next is ENOSPC and leaks no fd, unmap one, map again.
fn exercise_map_limit(served: &TestServer<PciAdapter<Gpu>>, limit: u32) {
    let mem = memfd(u64::from(limit + 2) * PAGE_SIZE).unwrap();
    let mut c = RawClient::new_default(served.path());
    for i in 0..u64::from(limit) {
        assert_eq!(map_page(&mut c, &mem, i), 0, "map {i} of {limit}");
    }
    assert_eq!(served.dma().stats().maps, u64::from(limit));
    let fds = open_fds();
    for _ in 0..3 {
        assert_eq!(
            map_page(&mut c, &mem, u64::from(limit)) as i32,
            libc::ENOSPC,
            "map past max_dma_maps"
        );
    }
    // (The server may close a refused fd just after its reply: allow it a moment.)
    assert!(
        wait_until(std::time::Duration::from_secs(2), || open_fds() == fds),
        "refused DMA_MAP leaked its fd: {} open, {fds} before",
        open_fds()
    );
    assert_eq!(served.dma().stats().maps, u64::from(limit));
    // One slot freed, one map fits again, the next is refused again.
    assert_eq!(unmap_page(&mut c, 7), 0);
    assert_eq!(map_page(&mut c, &mem, u64::from(limit)), 0);
    assert_eq!(
        map_page(&mut c, &mem, u64::from(limit) + 1) as i32,
        libc::ENOSPC
    );
    // The connection still works for everything else.
    assert_eq!(c.region_read(0, 0, 4), b"UGPU");
    served.dma().check_invariants().unwrap();
}

#[test]
fn test_limits_dma_config_max_maps_enospc_then_unmap_frees_slot() {
    let _serial = serial();
    let served = serve(
        DmaConfig {
            max_dma_maps: MAX_MAPS,
            ..DmaConfig::default()
        },
        |c| c.max_dma_maps = MAX_MAPS,
    );
    exercise_map_limit(&served, MAX_MAPS);
}

#[test]
fn test_limits_server_config_max_maps_is_enforced() {
    let _serial = serial();
    // Only the server's configuration says 256: the value it advertises in VERSION must be
    // the one it enforces, whatever the DMA space was built with.
    let served = serve(DmaConfig::default(), |c| c.max_dma_maps = MAX_MAPS);
    let (_, reply) = RawClient::negotiated(served.path(), DEFAULT_CAPS);
    let caps = String::from_utf8_lossy(&reply.payload[4..]).into_owned();
    assert!(
        caps.contains(&format!("\"max_dma_maps\":{MAX_MAPS}")),
        "advertised: {caps}"
    );
    drop(reply);
    wait_until(std::time::Duration::from_secs(2), || {
        served.dma().stats().maps == 0
    });
    exercise_map_limit(&served, MAX_MAPS);
}

/// KiB the kernel reports as mlocked in the VMAs overlapping `[start, start + len)`.
fn locked_kib(start: u64, len: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut inside, mut total) = (false, 0);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                inside = a < start + len && b > start;
                continue;
            }
        }
        if inside {
            if let Some(v) = line.strip_prefix("Locked:") {
                total += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
            }
        }
    }
    total
}

#[test]
fn test_limits_lock_limit_exceeded_leaves_counts_and_refcounts_unchanged() {
    let _serial = serial();
    const LIMIT: u64 = 16;
    let served = serve(
        DmaConfig {
            policy: PinPolicy::Lock,
            lock_limit_bytes: Some(LIMIT * PAGE_SIZE),
            ..DmaConfig::default()
        },
        |_| {},
    );
    let mut client = independent::connect(served.path());
    // The test pins through the device's DMA handle: the guest lets the device DMA.
    enable_device(&mut client);
    let mem = memfd(64 * PAGE_SIZE).unwrap();
    client_map(&mut client, served.dma(), &mem, 0, BASE, 64 * PAGE_SIZE);
    let h = served.dma().handle();
    let pfn0 = BASE >> PAGE_SHIFT;
    let pfns = |r: std::ops::Range<u64>| -> Vec<u64> { r.map(|i| pfn0 + i).collect() };
    let mut addrs = vec![0u64; 64];

    // Up to the limit exactly, in a scattered call and a contiguous one.
    let first: Vec<u64> = pfns(0..8).into_iter().rev().collect();
    h.pin_pages(&first, Prot::RW, &mut addrs[..8]).unwrap();
    h.pin_pages(&pfns(20..28), Prot::READ, &mut addrs[..8])
        .unwrap();
    let at_limit = served.dma().stats();
    let host0 = addrs[7] - 27 * PAGE_SIZE; // addrs[7] is page 27 of the mapping
    assert_eq!(locked_kib(host0, 64 * PAGE_SIZE), LIMIT * PAGE_SIZE / 1024);
    assert_eq!(
        (at_limit.pinned_pages, at_limit.locked_pages),
        (LIMIT, LIMIT)
    );

    // Re-pinning pages that are already locked needs no new locked memory.
    h.pin_pages(&pfns(0..4), Prot::READ, &mut addrs[..4])
        .expect("re-pinning locked pages must not count against the limit");
    assert_eq!(served.dma().stats().locked_pages, LIMIT);

    // Already-pinned pages first, then one new page: refused as a whole.
    let mut bad = pfns(0..8);
    bad.extend(pfns(20..28));
    bad.push(pfn0 + 40);
    let err = h
        .pin_pages(&bad, Prot::READ, &mut addrs[..17])
        .expect_err("pin past the lock limit");
    assert!(
        matches!(err, DmaError::LimitExceeded { limit: LIMIT, .. }),
        "{err:?}"
    );
    assert_eq!(err.errno(), libc::ENOMEM);
    let after = served.dma().stats();
    assert_eq!(
        (after.pinned_pages, after.locked_pages),
        (at_limit.pinned_pages, at_limit.locked_pages),
        "failed call changed the accounting"
    );
    // And the kernel agrees: the rollback did not munlock pages other pins still hold.
    assert_eq!(
        locked_kib(host0, 64 * PAGE_SIZE),
        LIMIT * PAGE_SIZE / 1024,
        "pages really mlocked after the failed call"
    );
    served.dma().check_invariants().unwrap();
    // A range pin past the limit fails the same way.
    assert!(matches!(
        h.pin_range(pfn0 + 40, 2, Prot::READ),
        Err(DmaError::LimitExceeded { .. })
    ));
    assert_eq!(served.dma().stats().pinned_pages, LIMIT);

    // Refcounts are exactly what the successful calls took: undo them and nothing is left
    // (a failed call that kept a reference would leave pages pinned here).
    h.unpin_pages(&pfns(0..4)).unwrap();
    h.unpin_pages(&first).unwrap();
    h.unpin_pages(&pfns(20..28)).unwrap();
    served.assert_space_unpinned();
    assert!(h.unpin_pages(&pfns(0..1)).is_err(), "refcount underflow");

    // The whole limit is usable again.
    let base = h.pin_range(pfn0 + 40, LIMIT, Prot::RW).unwrap();
    assert_eq!(base, host0 + 40 * PAGE_SIZE);
    assert_eq!(locked_kib(host0, 64 * PAGE_SIZE), LIMIT * PAGE_SIZE / 1024);
    h.unpin_range(pfn0 + 40, LIMIT).unwrap();
    served.assert_space_unpinned();
    assert_eq!(locked_kib(host0, 64 * PAGE_SIZE), 0, "munlock missing");
}
