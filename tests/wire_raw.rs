//! Raw-socket tests for what `vfio_user::Client` cannot send: version details, posted
//! writes, WRITE_MULTI, fd-less DMA served by the client (DMA_READ/DMA_WRITE), twin
//! socket, DMA logging.

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use common::test_device::*;
use common::TestServer;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::region_access::{encode_write_multi, RegionAccess, WriteOne};
use umdev::protocol::version::Version;
use umdev::protocol::{Command, FLAGS_NO_REPLY};
use umdev::testing::{memfd, FdlessMemory, Msg, RawClient, Vmm, DEFAULT_CAPS};

const QEMU_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":268435456},\"write_multiple\":true}}";

fn map_fdless(c: &mut RawClient, iova: u64, size: u64) {
    let m = DmaMapRequest {
        flags: 3,
        offset: 0,
        iova,
        size,
    };
    let r = c.call(Command::DmaMap as u16, 0, &m.encode(), &[]);
    assert!(!r.header.is_error(), "DMA_MAP errno {}", r.header.error);
}

/// A posted register write (No_reply, as QEMU sends MMIO writes) whose handler does fd-less
/// DMA on the connection thread: serve its one request while sending nothing else (a
/// command that expects a reply would make the request fail fast, as would a write that
/// expects one: tests/remote_cancel.rs), then a round trip.
fn write_reg_posted_serving(vmm: &mut Vmm, off: u64, data: &[u8]) {
    vmm.client().region_write(0, off, data, FLAGS_NO_REPLY);
    let m = vmm.client().recv();
    assert!(vmm.serve(&m).unwrap(), "expected a DMA request");
    vmm.client().region_read(0, REG_DMA_STATUS, 4);
}

/// A REGION_WRITE whose reply is awaited while the VMM serves DMA requests.
fn write_reg(vmm: &mut Vmm, off: u64, data: &[u8]) -> Msg {
    let a = RegionAccess {
        offset: off,
        region: 0,
        count: data.len() as u32,
    };
    let mut p = a.encode();
    p.extend_from_slice(data);
    vmm.call(Command::RegionWrite, &p, &[]).unwrap()
}

/// A VMM on `c` serving fd-less memory at `base` (holding `offset % 251`).
fn serving(c: RawClient, base: u64, size: usize) -> Vmm {
    let mut vmm = Vmm::from_client(c);
    vmm.set_fdless(FdlessMemory::with_pattern(base, size));
    vmm
}

#[test]
fn test_raw_version_qemu_proposal_reply_fits_request_buffer() {
    let ts = TestServer::start();
    let (_c, reply) = RawClient::negotiated(ts.path(), QEMU_CAPS);
    let request_size = 16 + 4 + QEMU_CAPS.len() + 1;
    assert!(reply.header.msg_size as usize <= request_size);
    let v = Version::decode(&reply.payload).unwrap();
    assert_eq!(v.major, 0);
    assert_eq!(v.minor, 0);
    assert!(!v.caps.migration, "migration is not echoed");
    assert!(
        !v.caps.write_multiple,
        "not answered by default (QEMU 10.2's USE_MULTI includes FORCE_QUEUED)"
    );
    assert_eq!(v.caps.pgsizes, 4096);
    assert!(reply.fds.is_empty(), "no twin socket unless asked");
}

#[test]
fn test_raw_posted_write_gets_no_reply_and_is_ordered_before_read() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    for i in 0..8u8 {
        c.region_write(0, 0x80 + i as u64, &[i + 1], FLAGS_NO_REPLY);
    }
    // The next message from the server must be this read's reply (call asserts the id).
    assert_eq!(c.region_read(0, 0x80, 8), vec![1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn test_raw_every_poll_mode_serves_in_order_after_idle_gaps() {
    use umdev::server::PollMode;
    for mode in [
        PollMode::Off,
        PollMode::Auto,
        PollMode::Fixed(Duration::from_micros(200)),
    ] {
        let ts = TestServer::start_with(|c| c.poll = mode);
        let mut c = RawClient::new_default(ts.path());
        for round in 0..4u8 {
            // Back to back (caught while spinning), then a gap longer than any budget
            // (the thread blocks and must still wake for the next message).
            for i in 0..8u8 {
                c.region_write(0, 0x80 + i as u64, &[round + i], FLAGS_NO_REPLY);
            }
            let want: Vec<u8> = (0..8).map(|i| round + i).collect();
            assert_eq!(c.region_read(0, 0x80, 8), want, "{mode}, round {round}");
            std::thread::sleep(Duration::from_millis(if round % 2 == 0 { 20 } else { 0 }));
        }
    }
}

#[test]
fn test_raw_posted_write_error_sends_nothing() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    c.region_write(0, BAR0_SIZE - 2, &[1, 2, 3, 4], FLAGS_NO_REPLY);
    assert_eq!(c.region_read(0, 0, 4), vec![0; 4]);
}

#[test]
fn test_raw_write_multi_applies_every_write() {
    let ts = TestServer::start_with(|c| c.write_multiple = true);
    let mut c = RawClient::new_default(ts.path());
    let w = |offset, count, v: u8| WriteOne {
        access: RegionAccess {
            offset,
            region: 0,
            count,
        },
        data: [v; 8],
    };
    let p = encode_write_multi(&[w(0x300, 4, 0x11), w(0x304, 2, 0x22), w(0x308, 8, 0x33)]);
    let r = c.call(Command::RegionWriteMulti as u16, 0, &p, &[]);
    assert!(!r.header.is_error());
    assert_eq!(r.payload, 3u64.to_ne_bytes());
    let got = c.region_read(0, 0x300, 16);
    assert_eq!(&got[..4], &[0x11; 4]);
    assert_eq!(&got[4..8], &[0x22, 0x22, 0, 0]);
    assert_eq!(&got[8..], &[0x33; 8]);
}

#[test]
fn test_raw_fdless_dma_device_read_on_connection_thread_served_by_client() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let mut vmm = serving(c, 0x40_0000, 0x2000);
    write_reg(&mut vmm, REG_DMA_IOVA, &0x40_0010u64.to_le_bytes());
    write_reg(&mut vmm, REG_DMA_LEN, &32u32.to_le_bytes());
    write_reg_posted_serving(&mut vmm, REG_DMA_OP, &1u32.to_le_bytes());
    assert_eq!(vmm.fdless().reads(), 1, "one DMA_READ served");
    assert_eq!(vmm.client().region_read(0, REG_DMA_STATUS, 4), vec![0; 4]);
    assert_eq!(
        vmm.client().region_read(0, DMA_SCRATCH, 32),
        vmm.mem()[0x10..0x30].to_vec()
    );
}

#[test]
fn test_raw_fdless_dma_device_write_served_by_client() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let mut vmm = serving(c, 0x40_0000, 0x2000);
    write_reg(&mut vmm, DMA_SCRATCH, b"written by the device");
    write_reg(&mut vmm, REG_DMA_IOVA, &0x40_1000u64.to_le_bytes());
    write_reg(&mut vmm, REG_DMA_LEN, &21u32.to_le_bytes());
    write_reg_posted_serving(&mut vmm, REG_DMA_OP, &2u32.to_le_bytes());
    assert_eq!(vmm.fdless().writes(), 1);
    assert_eq!(&vmm.mem()[0x1000..0x1015], b"written by the device");
}

#[test]
fn test_raw_fdless_dma_from_worker_thread_while_client_talks() {
    let ts = TestServer::start();
    let caps = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":4096}}";
    let (mut c, _) = RawClient::negotiated(ts.path(), caps);
    map_fdless(&mut c, 0x80_0000, 0x4000);
    let mut vmm = serving(c, 0x80_0000, 0x4000);
    let handle = ts.state().dma.clone().unwrap();
    let worker = std::thread::spawn(move || {
        let mut buf = vec![0u8; 10_000];
        handle.read(0x80_0100, &mut buf).map(|_| buf)
    });
    // Meanwhile the client keeps issuing its own commands.
    let a = RegionAccess {
        offset: 0,
        region: 7,
        count: 4,
    };
    let r = vmm.call(Command::RegionRead, &a.encode(), &[]).unwrap();
    assert_eq!(&r.payload[16..], &[0, 1, 2, 3]);
    while vmm.fdless().reads() < 3 {
        let m = vmm.client().recv();
        assert!(vmm.serve(&m).unwrap(), "unexpected message");
    }
    let buf = worker.join().unwrap().expect("worker DMA");
    assert_eq!(buf, vmm.mem()[0x100..0x100 + 10_000].to_vec());
    assert!(
        vmm.fdless().largest() <= 4096,
        "transfers split to max_data_xfer_size"
    );
}

#[test]
fn test_raw_fdless_dma_read_pieces_stay_under_qemu_socket_buffer_despite_1mib_xfer() {
    let ts = TestServer::start();
    // QEMU offers 1 MiB transfers, but cuts a reply larger than its socket send buffer
    // (~208 KiB): DMA_READs must ask for at most 64 KiB each.
    let (mut c, _) = RawClient::negotiated(ts.path(), QEMU_CAPS);
    let mut mem = FdlessMemory::with_pattern(0x100_0000, 0x60000);
    mem.set_layout(umdev::protocol::dma_rw::DmaRwLayout::Qemu);
    map_fdless(&mut c, 0x100_0000, 0x60000);
    let handle = ts.state().dma.clone().unwrap();
    let worker = std::thread::spawn(move || {
        let mut buf = vec![0u8; 300 * 1024];
        handle.read(0x100_0010, &mut buf).map(|_| buf)
    });
    while mem.reads() < 5 {
        let m = c.recv();
        assert!(mem.serve(c.stream(), &m).unwrap(), "unexpected message");
    }
    let buf = worker.join().unwrap().expect("worker DMA");
    assert_eq!(buf, mem.bytes()[0x10..0x10 + 300 * 1024].to_vec());
    assert_eq!(mem.largest(), 64 * 1024, "largest DMA_READ piece");
}

#[test]
fn test_raw_fdless_dma_qemu_client_gets_qemu_layout() {
    let ts = TestServer::start();
    let (mut c, _) = RawClient::negotiated(ts.path(), QEMU_CAPS);
    let mut mem = FdlessMemory::with_pattern(0x40_0000, 0x2000);
    mem.set_layout(umdev::protocol::dma_rw::DmaRwLayout::Qemu);
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let handle = ts.state().dma.clone().unwrap();
    let worker = std::thread::spawn(move || {
        handle.write(0x40_0100, b"qemu layout")?;
        let mut buf = [0u8; 24];
        handle.read(0x40_00f8, &mut buf).map(|_| buf)
    });
    while mem.reads() < 1 {
        let m = c.recv();
        assert!(mem.serve(c.stream(), &m).unwrap(), "unexpected message");
    }
    let buf = worker.join().unwrap().expect("worker DMA");
    assert_eq!(&mem.bytes()[0x100..0x10b], b"qemu layout");
    assert_eq!(&buf[8..19], b"qemu layout");
    assert_eq!(buf[..8].to_vec(), mem.bytes()[0xf8..0x100].to_vec());
}

#[test]
fn test_raw_fdless_dma_client_error_reaches_device() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let mut vmm = serving(c, 0x40_0000, 0x2000);
    write_reg(&mut vmm, REG_DMA_IOVA, &0x40_0000u64.to_le_bytes());
    write_reg(&mut vmm, REG_DMA_LEN, &8u32.to_le_bytes());
    let c = vmm.client();
    let a = RegionAccess {
        offset: REG_DMA_OP,
        region: 0,
        count: 4,
    };
    let mut p = a.encode();
    p.extend_from_slice(&1u32.to_le_bytes());
    // Posted, as QEMU sends MMIO writes (the client is free to answer the DMA_READ).
    c.send(Command::RegionWrite as u16, FLAGS_NO_REPLY, &p, &[]);
    let req = c.recv();
    assert_eq!(req.header.command, Command::DmaRead as u16);
    c.reply_error(&req.header, libc::EFAULT);
    let status = c.region_read(0, REG_DMA_STATUS, 4);
    assert_eq!(
        u32::from_le_bytes(status.try_into().unwrap()),
        libc::EFAULT as u32
    );
}

#[test]
fn test_raw_fdless_dma_unanswered_times_out() {
    let ts = TestServer::start_with(|c| c.remote_dma_timeout = Duration::from_millis(200));
    let mut c = RawClient::new_default(ts.path());
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let handle = ts.state().dma.clone().unwrap();
    let t = std::time::Instant::now();
    let mut buf = [0u8; 8];
    let e = handle.read(0x40_0000, &mut buf).unwrap_err();
    assert_eq!(e.errno(), libc::ETIMEDOUT);
    assert!(t.elapsed() < Duration::from_secs(2));
    // The late request is still in the socket; the connection keeps working.
    let m = c.recv();
    assert_eq!(m.header.command, Command::DmaRead as u16);
    assert_eq!(c.region_read(0, 0, 4), vec![0; 4]);
}

#[test]
fn test_raw_fdless_dma_pending_fails_on_disconnect() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let handle = ts.state().dma.clone().unwrap();
    let worker = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        handle.read(0x40_0000, &mut buf)
    });
    let m = c.recv();
    assert_eq!(m.header.command, Command::DmaRead as u16);
    let t = std::time::Instant::now();
    drop(c);
    assert!(worker.join().unwrap().is_err());
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "failed fast, not by timeout"
    );
}

#[test]
fn test_raw_twin_socket_carries_server_requests() {
    let ts = TestServer::start();
    let caps = "{\"capabilities\":{\"max_msg_fds\":16,\"twin_socket\":{\"supported\":true}}}";
    let (mut c, reply) = RawClient::negotiated(ts.path(), caps);
    let v = Version::decode(&reply.payload).unwrap();
    assert!(v.caps.twin_socket);
    assert_eq!(v.caps.twin_socket_fd_index, Some(0));
    assert_eq!(reply.fds.len(), 1);
    let twin = std::os::unix::net::UnixStream::from(reply.fds.into_iter().next().unwrap());
    twin.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    let mut mem = FdlessMemory::with_pattern(0x40_0000, 0x2000);
    map_fdless(&mut c, 0x40_0000, 0x2000);
    let handle = ts.state().dma.clone().unwrap();
    let worker = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        handle.read(0x40_0020, &mut buf).map(|_| buf)
    });
    let m = RawClient::recv_on(&twin);
    assert!(mem.serve(&twin, &m).unwrap());
    assert_eq!(
        worker.join().unwrap().unwrap().to_vec(),
        mem.bytes()[0x20..0x30].to_vec()
    );
    // The main socket saw nothing but its own traffic.
    assert_eq!(c.region_read(0, 0, 4), vec![0; 4]);
}

#[test]
fn test_raw_dma_logging_reports_device_writes() {
    use umdev::protocol::feature::encode_feature;
    use umdev::protocol::wire::Put;
    use vfio_bindings::bindings::vfio::*;
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x10000).unwrap();
    let m = DmaMapRequest {
        flags: 3,
        offset: 0,
        iova: 0x100_0000,
        size: 0x10000,
    };
    let r = c.call(Command::DmaMap as u16, 0, &m.encode(), &[mem.as_raw_fd()]);
    assert!(!r.header.is_error());
    let probe = encode_feature(
        8,
        VFIO_DEVICE_FEATURE_PROBE | VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
        &[],
    );
    let r = c.call(Command::DeviceFeature as u16, 0, &probe, &[]);
    assert!(!r.header.is_error());
    assert_eq!(r.payload, probe);
    let mut d = Vec::new();
    d.put_u64(4096);
    d.put_u32(0);
    d.put_u32(0);
    let start = encode_feature(
        8 + 16,
        VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
        &d,
    );
    let r = c.call(Command::DeviceFeature as u16, 0, &start, &[]);
    assert!(!r.header.is_error(), "start errno {}", r.header.error);
    let handle = ts.state().dma.clone().unwrap();
    handle.write(0x100_0000 + 3 * 4096 + 5, b"x").unwrap();
    let mut d = Vec::new();
    d.put_u64(0x100_0000);
    d.put_u64(0x10000);
    d.put_u64(4096);
    let report = encode_feature(
        8 + 24 + 8,
        VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT,
        &d,
    );
    let r = c.call(Command::DeviceFeature as u16, 0, &report, &[]);
    assert!(!r.header.is_error(), "report errno {}", r.header.error);
    assert_eq!(r.payload.len(), 8 + 24 + 8);
    let bitmap = u64::from_ne_bytes(r.payload[32..40].try_into().unwrap());
    assert_eq!(bitmap, 1 << 3);
    let stop = encode_feature(
        8,
        VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP,
        &[],
    );
    let r = c.call(Command::DeviceFeature as u16, 0, &stop, &[]);
    assert!(!r.header.is_error());
}

#[test]
fn test_raw_default_caps_write_multiple_off_by_default_on_when_configured() {
    let ts = TestServer::start();
    let (_c, reply) = RawClient::negotiated(ts.path(), DEFAULT_CAPS);
    assert!(!Version::decode(&reply.payload).unwrap().caps.write_multiple);
    let ts = TestServer::start_with(|c| c.write_multiple = true);
    let (_c, reply) = RawClient::negotiated(ts.path(), DEFAULT_CAPS);
    assert!(Version::decode(&reply.payload).unwrap().caps.write_multiple);
}

#[test]
fn test_raw_device_panic_answers_eio_and_ends_only_that_connection() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let m = c.region_write(0, REG_PANIC, &[1, 0, 0, 0], 0).unwrap();
    assert!(m.header.is_error());
    assert_eq!(m.header.error, libc::EIO as u32);
    ts.wait_for("teardown after the panic", |s| s.disconnects == 1);
    let mut c = RawClient::new_default(ts.path());
    assert_eq!(c.region_read(7, 0, 2), vec![0, 1], "server still serves");
}

#[test]
fn test_raw_dma_unmap_flag_all_removes_every_map() {
    use umdev::protocol::wire::Put;
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x4000).unwrap();
    for iova in [0x10_0000u64, 0x20_0000] {
        let m = DmaMapRequest {
            flags: 3,
            offset: 0,
            iova,
            size: 0x4000,
        };
        let r = c.call(Command::DmaMap as u16, 0, &m.encode(), &[mem.as_raw_fd()]);
        assert!(!r.header.is_error());
    }
    map_fdless(&mut c, 0x30_0000, 0x1000);
    assert_eq!(ts.dma().stats().maps, 3);
    // QEMU's unmap_all: flags VFIO_DMA_UNMAP_FLAG_ALL, iova 0, size 0.
    let mut p = Vec::new();
    p.put_u32(24);
    p.put_u32(2);
    p.put_u64(0);
    p.put_u64(0);
    let r = c.call(Command::DmaUnmap as u16, 0, &p, &[]);
    assert!(!r.header.is_error(), "errno {}", r.header.error);
    // The entry comes back with the bytes removed in its size field (type1 writes the
    // unmapped size back; QEMU's client reads only the errno).
    assert_eq!(r.payload[..16], p[..16], "argsz, flags and iova are echoed");
    assert_eq!(
        r.payload[16..],
        (0x9000u64).to_ne_bytes(),
        "size = bytes removed"
    );
    assert_eq!(ts.dma().stats().maps, 0);
    assert_eq!(ts.state().unmaps.len(), 3, "device notified for each map");
}

#[test]
fn test_raw_region_access_over_negotiated_xfer_size_e2big() {
    let ts = TestServer::start();
    // The server offers 1 MiB; the client only 1024 (libvfio-user's sample client does):
    // the negotiated 1024 bounds what the server accepts, as region-access.md says.
    let caps = "{\"capabilities\":{\"max_msg_fds\":8,\"max_data_xfer_size\":1024}}";
    let (mut c, _) = RawClient::negotiated(ts.path(), caps);
    let r = c.region_write(2, 0, &vec![0x5a; 12 * 1024], 0).unwrap();
    assert!(r.header.is_error(), "a 12 KiB REGION_WRITE must be refused");
    assert_eq!(r.header.error, libc::E2BIG as u32);
    let read = RegionAccess {
        offset: 0,
        region: 2,
        count: 1025,
    };
    assert_eq!(
        c.expect_error(Command::RegionRead as u16, &read.encode(), &[]),
        libc::E2BIG as u32
    );
    let r = c.region_write(2, 0, &[0xa5; 1024], 0).unwrap();
    assert!(!r.header.is_error(), "1024 bytes fit");
    assert_eq!(c.region_read(2, 0, 1024), vec![0xa5; 1024]);
}
