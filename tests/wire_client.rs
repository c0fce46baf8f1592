//! End-to-end tests of umdev's server driven by the independent `vfio_user::Client`.

mod common;

use common::test_device::*;
use common::TestServer;
use std::os::fd::AsRawFd;
use std::time::Duration;
use umdev::testing::{memfd, RawClient};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

#[test]
fn test_client_connect_negotiates_and_reads_device_info() {
    let ts = TestServer::start();
    let client = Client::new(ts.path()).expect("connect");
    let bar0 = client.region(0).expect("region 0");
    assert_eq!(bar0.size, BAR0_SIZE);
    let cfg = client.region(7).expect("config region");
    assert_eq!(cfg.size, 256);
    assert!(client.region(8).is_some(), "9 regions reported");
}

#[test]
fn test_client_region_read_write_roundtrip() {
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    client.region_write(0, 0x40, &[1, 2, 3, 4]).unwrap();
    let mut buf = [0u8; 4];
    client.region_read(0, 0x40, &mut buf).unwrap();
    assert_eq!(buf, [1, 2, 3, 4]);
    assert_eq!(&ts.state().regs[0x40..0x44], &[1, 2, 3, 4]);
    let mut cfg = [0u8; 2];
    client.region_read(7, 0x10, &mut cfg).unwrap();
    assert_eq!(cfg, [0x10, 0x11]);
}

#[test]
fn test_client_region_info_sparse_mmap_fd_is_mappable() {
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    let bar2 = client.region(2).expect("region 2");
    assert_eq!(bar2.size, BAR2_SIZE);
    assert_ne!(bar2.flags & umdev::device::REGION_FLAG_MMAP, 0);
    assert_eq!(bar2.sparse_areas.len(), 1);
    let area = bar2.sparse_areas[0];
    assert_eq!(
        (area.offset, area.size),
        (BAR2_MMAP_START, BAR2_SIZE - BAR2_MMAP_START)
    );
    let fo = bar2.file_offset.as_ref().expect("region fd");
    let len = area.size as usize;
    // SAFETY: a fresh shared mapping of the region fd; unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fo.file().as_raw_fd(),
            (fo.start() + area.offset) as libc::off_t,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: p maps len ≥ 4 bytes; volatile because the device shares the memory.
    unsafe { std::ptr::write_volatile(p as *mut u32, 0xfeed_beef) };
    let mut buf = [0u8; 4];
    client.region_read(2, BAR2_MMAP_START, &mut buf).unwrap();
    assert_eq!(u32::from_ne_bytes(buf), 0xfeed_beef);
    // And the other way: a trapped write through the socket shows in the mapping.
    client
        .region_write(2, BAR2_MMAP_START + 8, &7u32.to_ne_bytes())
        .unwrap();
    // SAFETY: as above.
    let v = unsafe { std::ptr::read_volatile((p as *const u8).add(8) as *const u32) };
    assert_eq!(v, 7);
    // SAFETY: p/len come from the mmap above.
    unsafe { libc::munmap(p, len) };
}

#[test]
fn test_client_irq_info_reports_counts_and_flags() {
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    let msi = client.get_irq_info(1).unwrap();
    assert_eq!((msi.index, msi.count), (1, 2));
    assert_ne!(msi.flags & umdev::device::IRQ_INFO_EVENTFD, 0);
    let err = client.get_irq_info(3).unwrap();
    assert_eq!(err.count, 1);
}

#[test]
fn test_client_set_irqs_eventfd_device_trigger_observed() {
    use vfio_bindings::bindings::vfio::{VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD};
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    let e0 = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let e1 = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    client
        .set_irqs(
            1,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            2,
            &[e0.as_raw_fd(), e1.as_raw_fd()],
        )
        .unwrap();
    // The guest rings the doorbell for vector 1: the device signals e1.
    client
        .region_write(0, REG_DOORBELL, &1u32.to_le_bytes())
        .unwrap();
    assert_eq!(e1.read().unwrap(), 1);
    assert!(e0.read().is_err(), "vector 0 must not fire");
    // The test asks the device directly.
    assert!(ts.state().trigger(1, 0));
    assert_eq!(e0.read().unwrap(), 1);
}

#[test]
fn test_client_dma_map_memfd_device_reads_then_unmap_notifies() {
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    let mem = memfd(0x10000).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&mem, b"guest data!", 0x100).unwrap();
    client
        .dma_map(0, 0x10_0000, 0x10000, mem.as_raw_fd())
        .unwrap();
    assert_eq!(ts.dma().stats().maps, 1);
    let handle = ts.state().dma.clone().unwrap();
    let mut buf = [0u8; 11];
    handle.read(0x10_0100, &mut buf).unwrap();
    assert_eq!(&buf, b"guest data!");
    handle.write(0x10_0200, b"dev").unwrap();
    let mut back = [0u8; 3];
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut back, 0x200).unwrap();
    assert_eq!(&back, b"dev");
    client.dma_unmap(0x10_0000, 0x10000).unwrap();
    assert_eq!(ts.state().unmaps, vec![(0x10_0000, 0x10000)]);
    assert_eq!(ts.dma().stats().maps, 0);
    assert!(handle.read(0x10_0100, &mut buf).is_err());
}

#[test]
fn test_client_reset_reaches_device() {
    let ts = TestServer::start();
    let mut client = Client::new(ts.path()).unwrap();
    client.region_write(0, 0x10, &[9]).unwrap();
    client.reset().unwrap();
    assert_eq!(ts.state().resets, 1);
    let mut b = [0xffu8; 1];
    client.region_read(0, 0x10, &mut b).unwrap();
    assert_eq!(b, [0]);
}

#[test]
fn test_client_reconnect_after_disconnect_keeps_device_state() {
    let ts = TestServer::start();
    {
        let mut client = Client::new(ts.path()).unwrap();
        let mem = memfd(0x4000).unwrap();
        client
            .dma_map(0, 0x20_0000, 0x4000, mem.as_raw_fd())
            .unwrap();
        client.region_write(0, 0x20, &[0xab]).unwrap();
        client.shutdown().unwrap();
    }
    ts.wait_for("disconnect", |s| s.disconnects == 1);
    assert_eq!(ts.dma().stats().maps, 0, "maps released at disconnect");
    let mut client = Client::new(ts.path()).expect("reconnect");
    let mut b = [0u8; 1];
    client.region_read(0, 0x20, &mut b).unwrap();
    assert_eq!(b, [0xab], "device state survives reconnect");
}

#[test]
fn test_client_second_simultaneous_client_refused_first_unaffected() {
    use std::io::Read;
    let ts = TestServer::start();
    let mut first = Client::new(ts.path()).unwrap();
    let mut second = RawClient::connect(ts.path());
    let errno = second.expect_error(
        umdev::protocol::Command::Version as u16,
        b"\0\0\0\0{}\0",
        &[],
    );
    assert_eq!(errno, libc::EBUSY as u32);
    second
        .stream()
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        second.stream().read(&mut b).unwrap(),
        0,
        "then it is closed"
    );
    let mut buf = [0u8; 4];
    first.region_read(0, 0, &mut buf).unwrap();
}
