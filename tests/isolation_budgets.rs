//! Isolation budgets: two servers in one process, one client attacking, one measured. What
//! the process shares — memory maps (VMAs, SIGBUS slots), the fd table, a connection's
//! backlog, time waiting for a client — must stay bounded per server, and the victim must
//! keep serving (DMA_MAP with an fd, region access, creating a memfd) while the process
//! lives. Budgets are set small through the configuration so each test takes seconds.

mod common;

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::test_device::{
    DeviceState, TestDevice, REG_DMA_IOVA, REG_DMA_LEN, REG_DMA_OP, REG_PIN_OP, REG_PIN_PFN,
};
use umdev::dma::{DmaConfig, MapPool, PAGE_SIZE};
use umdev::protocol::dma_map::{DmaMapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE};
use umdev::protocol::set_irqs::encode_set_irqs;
use umdev::protocol::{Command, FLAGS_NO_REPLY};
use umdev::server::{BacklogLimits, ServerConfig};
use umdev::testing::{memfd, open_fds, wait_until, RawClient, TestServer};

/// The fd counts are per process: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const BASE: u64 = 0x100_0000;

struct Served {
    server: TestServer<TestDevice>,
    state: Arc<Mutex<DeviceState>>,
}

fn serve(dma: DmaConfig, tune: impl FnOnce(&mut ServerConfig)) -> Served {
    let (device, state) = TestDevice::new();
    let server = TestServer::builder(device)
        .dma_config(dma)
        .configure(tune)
        .start()
        .unwrap();
    Served { server, state }
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

/// DMA_MAP page `i` of `fd` at `BASE + i` pages; the reply's errno.
fn map_page(c: &mut RawClient, fd: &impl AsRawFd, i: u64) -> i32 {
    let p = map_payload(BASE + i * PAGE_SIZE, PAGE_SIZE, i * PAGE_SIZE);
    c.call(Command::DmaMap as u16, 0, &p, &[fd.as_raw_fd()])
        .header
        .error as i32
}

/// The victim still serves: a new memfd, a DMA_MAP of it, a region read.
#[track_caller]
fn assert_victim_serves(victim: &mut RawClient, page: u64) {
    let mem = memfd(PAGE_SIZE).expect("creating a memfd in the attacked process");
    let p = map_payload(0x4000_0000 + page * PAGE_SIZE, PAGE_SIZE, 0);
    let r = victim.call(Command::DmaMap as u16, 0, &p, &[mem.as_raw_fd()]);
    assert_eq!(r.header.error, 0, "the victim's DMA_MAP failed");
    assert_eq!(victim.region_read(7, 4, 4), vec![4, 5, 6, 7]);
}

#[test]
fn test_isolation_maps_attacker_beyond_share_enomem_victim_guarantee_serves() {
    let _serial = serial();
    // A pool of 300 maps, 50 guaranteed to each server.
    let pool = MapPool::with_capacity(300);
    let dma = || DmaConfig {
        map_pool: Some(pool.clone()),
        map_guarantee: 50,
        ..DmaConfig::default()
    };
    let victim_srv = serve(dma(), |_| {});
    let attacker_srv = serve(dma(), |_| {});
    let mut victim = RawClient::new_default(victim_srv.server.path());
    let mut attacker = RawClient::new_default(attacker_srv.server.path());
    let mem = memfd(400 * PAGE_SIZE).unwrap();
    let mut mapped = 0;
    let errno = loop {
        match map_page(&mut attacker, &mem, mapped) {
            0 => mapped += 1,
            e => break e,
        }
        assert!(mapped <= 300, "the attacker mapped past the whole pool");
    };
    // Everything but the victim's guarantee, then ENOMEM (before any mmap: no fd kept).
    assert_eq!((mapped, errno), (250, libc::ENOMEM));
    assert_eq!(attacker_srv.server.dma().stats().fd_maps, 250);
    let fds = open_fds();
    for _ in 0..3 {
        assert_eq!(map_page(&mut attacker, &mem, mapped), libc::ENOMEM);
    }
    assert!(
        wait_until(Duration::from_secs(2), || open_fds() <= fds),
        "refused maps leaked fds"
    );
    // The attacker's connection still works for the rest.
    assert_eq!(attacker.region_read(7, 0, 2), vec![0, 1]);
    // The victim gets its whole guarantee, and keeps serving.
    let vmem = memfd(50 * PAGE_SIZE).unwrap();
    for i in 0..49 {
        assert_eq!(map_page(&mut victim, &vmem, i), 0, "victim map {i}");
    }
    assert_victim_serves(&mut victim, 0);
    assert_eq!(map_page(&mut victim, &vmem, 49), libc::ENOMEM);
    // The attacker leaves: its maps go back to the pool, the victim may borrow them.
    drop(attacker);
    assert!(wait_until(Duration::from_secs(5), || {
        attacker_srv.server.dma().stats().fd_maps == 0
    }));
    assert_eq!(map_page(&mut victim, &vmem, 49), 0);
    assert_eq!(pool.usage().held, 51 + 50);
}

/// Make the attacker's device issue a DMA_READ (on its connection thread, from a posted
/// write) to the fd-less map at `iova`, which the attacker never answers.
fn start_unanswered_dma_read(attacker: &mut RawClient, iova: u64) {
    let p = map_payload(iova, 0x1000, 0);
    let r = attacker.call(Command::DmaMap as u16, 0, &p, &[]);
    assert_eq!(r.header.error, 0);
    attacker.region_write(0, REG_DMA_IOVA, &iova.to_le_bytes(), FLAGS_NO_REPLY);
    attacker.region_write(0, REG_DMA_LEN, &64u32.to_le_bytes(), FLAGS_NO_REPLY);
    attacker.region_write(0, REG_DMA_OP, &1u32.to_le_bytes(), FLAGS_NO_REPLY);
    let req = attacker.recv();
    assert!(req.is_request(), "expected the DMA_READ");
    assert_eq!(req.header.command, Command::DmaRead as u16);
}

#[test]
fn test_isolation_backlog_flood_with_fds_while_dma_read_waits_fds_bounded_victim_serves() {
    let _serial = serial();
    let victim_srv = serve(DmaConfig::default(), |_| {});
    let attacker_srv = serve(DmaConfig::default(), |c| {
        c.remote_dma_timeout = Duration::from_secs(4);
        c.backlog = BacklogLimits {
            messages: 256,
            bytes: 8 << 20,
            fds: 64,
        };
    });
    let mut victim = RawClient::new_default(victim_srv.server.path());
    let mut attacker = RawClient::new_default(attacker_srv.server.path());
    let baseline = open_fds();
    start_unanswered_dma_read(&mut attacker, 0x2000_0000);
    // 600 posted SET_IRQS with 16 fds each: 9 600 fds if the server kept them all.
    let null = std::fs::File::open("/dev/null").unwrap();
    let fds = [null.as_raw_fd(); 16];
    let set_irqs = encode_set_irqs(0x4 | 0x20, 1, 0, 16, &[]);
    attacker
        .stream()
        .set_write_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let started = Instant::now();
    let mut sent = 0;
    while sent < 600
        && attacker
            .try_send(
                Command::DeviceSetIrqs as u16,
                FLAGS_NO_REPLY,
                &set_irqs,
                &fds,
            )
            .is_ok()
    {
        sent += 1;
    }
    let peak = open_fds().saturating_sub(baseline);
    // While the DMA_READ still waits: the victim serves, the fds stay bounded.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "flood took too long"
    );
    assert_victim_serves(&mut victim, 0);
    let held = open_fds().saturating_sub(baseline);
    assert!(
        peak.max(held) <= 64 + 16 + 8,
        "the attacker's backlog holds {} fds ({sent} messages sent)",
        peak.max(held)
    );
    let b = attacker_srv.server.dma().stats();
    assert_eq!(b.maps, 1);
    drop(attacker);
    assert!(wait_until(Duration::from_secs(10), || !attacker_srv
        .server
        .client_attached()));
    assert!(wait_until(Duration::from_secs(2), || open_fds() <= baseline + 2));
    assert_victim_serves(&mut victim, 1);
    drop(null);
    drop(victim_srv.state);
}

#[test]
fn test_isolation_client_not_reading_replies_disconnected_after_send_timeout_pins_released() {
    let _serial = serial();
    let victim_srv = serve(DmaConfig::default(), |_| {});
    let attacker_srv = serve(DmaConfig::default(), |c| {
        c.send_timeout = Duration::from_millis(500);
    });
    let mut victim = RawClient::new_default(victim_srv.server.path());
    let mut attacker = RawClient::new_default(attacker_srv.server.path());
    // The attacker's device holds a pin of its memory.
    let mem = memfd(PAGE_SIZE).unwrap();
    let p = map_payload(BASE, PAGE_SIZE, 0);
    assert_eq!(
        attacker
            .call(Command::DmaMap as u16, 0, &p, &[mem.as_raw_fd()])
            .header
            .error,
        0
    );
    attacker.region_write(
        0,
        REG_PIN_PFN,
        &(BASE / PAGE_SIZE).to_le_bytes(),
        FLAGS_NO_REPLY,
    );
    attacker.region_write(0, REG_PIN_OP, &1u32.to_le_bytes(), FLAGS_NO_REPLY);
    assert!(wait_until(Duration::from_secs(2), || {
        attacker_srv.server.dma().stats().pinned_pages == 1
    }));
    // Then it asks for replies it never reads: 16 KiB region reads until its own sends
    // block (the server no longer reads either).
    attacker
        .stream()
        .set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let read = umdev::protocol::region_access::RegionAccess {
        offset: 0,
        region: 2,
        count: 0x4000,
    }
    .encode();
    let started = Instant::now();
    while attacker
        .try_send(Command::RegionRead as u16, 0, &read, &[])
        .is_ok()
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "sends never blocked"
        );
    }
    // The victim is not concerned meanwhile.
    assert_victim_serves(&mut victim, 0);
    // Disconnected within the send timeout (plus the teardown), pins released.
    assert!(
        wait_until(Duration::from_secs(5), || !attacker_srv
            .server
            .client_attached()),
        "the client that reads no replies is still attached"
    );
    assert!(started.elapsed() < Duration::from_secs(6));
    let s = attacker_srv.server.dma().stats();
    assert_eq!((s.maps, s.pinned_pages, s.fd_maps), (0, 0, 0), "{s:?}");
    assert_eq!(attacker_srv.state.lock().unwrap().pins.len(), 0);
    // The server serves the next client.
    let mut again = RawClient::new_default(attacker_srv.server.path());
    assert_eq!(again.region_read(7, 0, 2), vec![0, 1]);
    assert_victim_serves(&mut victim, 1);
}
