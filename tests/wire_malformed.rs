//! For every command, malformed variants (short, oversized, wrong argsz, bad flags,
//! missing or extra fds) get an error reply with a real errno and the connection stays
//! usable.

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::os::fd::{AsRawFd, RawFd};

use common::TestServer;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::feature::encode_feature;
use umdev::protocol::region_access::{encode_write_multi, RegionAccess, WriteOne};
use umdev::protocol::set_irqs::encode_set_irqs;
use umdev::protocol::wire::Put;
use umdev::protocol::{Command, Header};
use umdev::testing::{memfd, RawClient};
use vfio_bindings::bindings::vfio::*;
use vmm_sys_util::eventfd::EventFd;

fn usable(c: &mut RawClient) {
    assert_eq!(
        c.region_read(7, 0, 4),
        vec![0, 1, 2, 3],
        "connection still usable"
    );
}

fn u32s(v: &[u32]) -> Vec<u8> {
    let mut p = Vec::new();
    for &x in v {
        p.put_u32(x);
    }
    p
}

fn efd() -> EventFd {
    EventFd::new(libc::EFD_NONBLOCK).unwrap()
}

const EINVAL: u32 = libc::EINVAL as u32;

#[test]
fn test_malformed_version_variants_rejected_and_connection_closed() {
    let ts = TestServer::start();
    // Each refused negotiation gets its errno, then the server closes the connection (it
    // would otherwise hold the single client slot until the negotiation timeout).
    let major1 = [1u8, 0, 0, 0];
    let mut bad_json = vec![0, 0, 0, 0];
    bad_json.extend_from_slice(b"{oops\0");
    let e = efd();
    // (what, command, payload, fds, errno; 0 = accepted)
    type Case<'a> = (&'a str, Command, &'a [u8], &'a [RawFd], u32);
    let cases: [Case; 7] = [
        (
            "a command before VERSION",
            Command::DeviceReset,
            &[],
            &[],
            EINVAL,
        ),
        ("short", Command::Version, &[0, 0], &[], EINVAL),
        ("bad JSON", Command::Version, &bad_json, &[], EINVAL),
        ("missing NUL", Command::Version, b"\0\0\0\0{}", &[], EINVAL),
        (
            "major 1",
            Command::Version,
            &major1,
            &[],
            libc::ENOTSUP as u32,
        ),
        (
            "fds attached",
            Command::Version,
            &[0, 0, 0, 0],
            &[e.as_raw_fd()],
            EINVAL,
        ),
        ("no capabilities", Command::Version, &[0, 0, 0, 0], &[], 0),
    ];
    for (what, cmd, payload, fds, errno) in cases {
        let mut c = RawClient::connect(ts.path());
        if errno == 0 {
            // The baseline: a minimal VERSION is accepted and the connection stays up.
            let r = c.call(cmd as u16, 0, payload, fds);
            assert!(!r.header.is_error(), "{what}: errno {}", r.header.error);
            usable(&mut c);
            continue;
        }
        assert_eq!(c.expect_error(cmd as u16, payload, fds), errno, "{what}");
        assert!(
            hostile::closed_by_peer(c.stream()),
            "{what}: connection kept open after a refused negotiation"
        );
    }
    // A good VERSION, then a second one: refused, and the negotiated session goes on.
    let mut c = RawClient::connect(ts.path());
    let r = c.call(
        Command::Version as u16,
        0,
        b"\0\0\0\0{\"capabilities\":{}}\0",
        &[],
    );
    assert!(!r.header.is_error());
    assert_eq!(
        c.expect_error(Command::Version as u16, &[0, 0, 0, 0], &[]),
        EINVAL
    );
    usable(&mut c);
}

#[test]
fn test_malformed_dma_map_variants_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mem = memfd(0x4000).unwrap();
    let fd: RawFd = mem.as_raw_fd();
    let good = DmaMapRequest {
        flags: 3,
        offset: 0,
        iova: 0x10_0000,
        size: 0x4000,
    };
    let cmd = Command::DmaMap as u16;
    assert_eq!(
        c.expect_error(cmd, &good.encode()[..24], &[fd]),
        EINVAL,
        "short"
    );
    let mut long = good.encode();
    long.extend_from_slice(&[0; 8]);
    assert_eq!(c.expect_error(cmd, &long, &[fd]), EINVAL, "oversized");
    let mut argsz = good.encode();
    argsz[0] = 24;
    assert_eq!(c.expect_error(cmd, &argsz, &[fd]), EINVAL, "argsz");
    let flags = DmaMapRequest {
        flags: 0x10,
        ..good
    };
    assert_eq!(c.expect_error(cmd, &flags.encode(), &[fd]), EINVAL, "flags");
    let unaligned = DmaMapRequest {
        iova: 0x10_0800,
        ..good
    };
    assert_eq!(
        c.expect_error(cmd, &unaligned.encode(), &[fd]),
        EINVAL,
        "alignment"
    );
    assert_eq!(
        c.expect_error(cmd, &good.encode(), &[fd, fd]),
        EINVAL,
        "two fds"
    );
    let r = c.call(cmd, 0, &good.encode(), &[fd]);
    assert!(!r.header.is_error());
    let overlap = DmaMapRequest {
        iova: 0x10_2000,
        ..good
    };
    assert_eq!(
        c.expect_error(cmd, &overlap.encode(), &[fd]),
        libc::EEXIST as u32,
        "overlap"
    );
    assert_eq!(ts.dma().stats().maps, 1);
    usable(&mut c);
}

#[test]
fn test_malformed_dma_unmap_variants_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DmaUnmap as u16;
    let unmap = |flags: u32, iova: u64, size: u64| {
        let mut p = u32s(&[24, flags]);
        p.put_u64(iova);
        p.put_u64(size);
        p
    };
    assert_eq!(
        c.expect_error(cmd, &unmap(0, 0, 0x1000)[..20], &[]),
        EINVAL,
        "short"
    );
    assert_eq!(
        c.expect_error(cmd, &unmap(4, 0, 0x1000), &[]),
        libc::ENOTSUP as u32,
        "vfio_user crate UNMAP_ALL"
    );
    assert_eq!(
        c.expect_error(cmd, &unmap(0x100, 0, 0x1000), &[]),
        EINVAL,
        "flags"
    );
    // type1v2: a range covering no mapping is not an error; it removes nothing (size 0).
    let r = c.call(cmd, 0, &unmap(0, 0x5000, 0x1000), &[]);
    assert!(
        !r.header.is_error(),
        "no such mapping: errno {}",
        r.header.error
    );
    assert_eq!(r.payload, unmap(0, 0x5000, 0), "no such mapping: reply");
    let e = efd();
    assert_eq!(
        c.expect_error(cmd, &unmap(0, 0, 0x1000), &[e.as_raw_fd()]),
        EINVAL,
        "fd"
    );
    usable(&mut c);
}

#[test]
fn test_malformed_device_info_and_irq_info_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let info = Command::DeviceGetInfo as u16;
    assert_eq!(
        c.expect_error(info, &u32s(&[8, 0, 0, 0]), &[]),
        EINVAL,
        "argsz"
    );
    assert_eq!(c.expect_error(info, &u32s(&[16, 0]), &[]), EINVAL, "short");
    let r = c.call(info, 0, &u32s(&[16, 0, 0, 0]), &[]);
    assert_eq!(r.payload.len(), 16, "reply fits 16 bytes");
    let irq = Command::DeviceGetIrqInfo as u16;
    assert_eq!(
        c.expect_error(irq, &u32s(&[16, 0, 9, 0]), &[]),
        EINVAL,
        "index"
    );
    assert_eq!(
        c.expect_error(irq, &u32s(&[8, 0, 0, 0]), &[]),
        EINVAL,
        "argsz"
    );
    usable(&mut c);
}

#[test]
fn test_malformed_region_info_and_argsz_negotiation() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DeviceGetRegionInfo as u16;
    let req = |argsz: u32, index: u32| {
        let mut p = u32s(&[argsz, 0, index, 0]);
        p.put_u64(0);
        p.put_u64(0);
        p
    };
    assert_eq!(c.expect_error(cmd, &req(16, 0), &[]), EINVAL, "argsz");
    assert_eq!(c.expect_error(cmd, &req(32, 99), &[]), EINVAL, "index");
    assert_eq!(c.expect_error(cmd, &req(32, 0)[..16], &[]), EINVAL, "short");
    // Caps do not fit in 32 bytes: the reply says how much is needed.
    let r = c.call(cmd, 0, &req(32, 2), &[]);
    assert_eq!(r.payload.len(), 32);
    let needed = u32::from_ne_bytes(r.payload[0..4].try_into().unwrap());
    assert_eq!(needed, 32 + 16 + 16);
    let r = c.call(cmd, 0, &req(needed, 2), &[]);
    assert_eq!(r.payload.len(), needed as usize);
    let flags = u32::from_ne_bytes(r.payload[4..8].try_into().unwrap());
    assert_ne!(flags & VFIO_REGION_INFO_FLAG_CAPS, 0);
    assert_ne!(flags & VFIO_REGION_INFO_FLAG_MMAP, 0);
    usable(&mut c);
}

#[test]
fn test_region_info_short_reply_no_fd_full_reply_one_fd() {
    // libvfio-user's client probes with argsz 32 and no room for a control message; an fd
    // on that reply truncates it (MSG_CTRUNC) and the client fails with EFAULT.
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DeviceGetRegionInfo as u16;
    let probe = c.call(cmd, 0, &u32s(&[32, 0, 2, 0, 0, 0, 0, 0]), &[]);
    assert!(!probe.header.is_error());
    let needed = u32::from_ne_bytes(probe.payload[0..4].try_into().unwrap());
    assert!(needed > 32, "region 2 has a sparse-mmap capability");
    assert_eq!(probe.fds.len(), 0, "no fd with the short reply");
    let mut full_req = u32s(&[needed, 0, 2, 0, 0, 0, 0, 0]);
    full_req.resize(needed as usize, 0);
    let full = c.call(cmd, 0, &full_req, &[]);
    assert_eq!(full.payload.len(), needed as usize);
    assert_eq!(full.fds.len(), 1, "the full reply carries the region fd");
    let config = c.call(cmd, 0, &u32s(&[32, 0, 7, 0, 0, 0, 0, 0]), &[]);
    assert_eq!(
        config.fds.len(),
        0,
        "a region that is not mappable has no fd"
    );
    usable(&mut c);
}

#[test]
fn test_info_requests_argsz_bytes_long_accepted() {
    // The kernel ioctl semantics: argsz is the reply buffer; a client sending argsz bytes
    // (libvfio-user's does) sends trailing bytes, which are ignored.
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let mut region = u32s(&[64, 0, 7, 0, 0, 0, 0, 0]);
    region.resize(64, 0);
    let r = c.call(Command::DeviceGetRegionInfo as u16, 0, &region, &[]);
    assert!(!r.header.is_error(), "64-byte GET_REGION_INFO accepted");
    assert_eq!(r.payload.len(), 32);
    assert_eq!(u32::from_ne_bytes(r.payload[8..12].try_into().unwrap()), 7);
    let r = c.call(
        Command::DeviceGetIrqInfo as u16,
        0,
        &u32s(&[32, 0, 3, 0, 0, 0, 0, 0]),
        &[],
    );
    assert!(!r.header.is_error(), "32-byte GET_IRQ_INFO accepted");
    assert_eq!(r.payload.len(), 16);
    let r = c.call(
        Command::DeviceGetInfo as u16,
        0,
        &u32s(&[32, 0, 0, 0, 0, 0, 0, 0]),
        &[],
    );
    assert!(!r.header.is_error(), "32-byte GET_INFO accepted");
    assert_eq!(r.payload.len(), 16);
    let r = c.call(
        Command::DeviceGetRegionIoFds as u16,
        0,
        &u32s(&[32, 0, 0, 0, 0, 0, 0, 0]),
        &[],
    );
    assert!(!r.header.is_error(), "32-byte GET_REGION_IO_FDS accepted");
    usable(&mut c);
}

#[test]
fn test_malformed_region_io_fds_rejected_valid_gets_zero_fds() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DeviceGetRegionIoFds as u16;
    let r = c.call(cmd, 0, &u32s(&[16, 0, 0, 0]), &[]);
    assert!(!r.header.is_error());
    assert_eq!(r.payload, u32s(&[16, 0, 0, 0]));
    assert!(r.fds.is_empty());
    assert_eq!(
        c.expect_error(cmd, &u32s(&[16, 1, 0, 0]), &[]),
        EINVAL,
        "flags"
    );
    assert_eq!(
        c.expect_error(cmd, &u32s(&[16, 0, 50, 0]), &[]),
        EINVAL,
        "index"
    );
    assert_eq!(
        c.expect_error(cmd, &u32s(&[4, 0, 0, 0]), &[]),
        EINVAL,
        "argsz"
    );
    usable(&mut c);
}

#[test]
fn test_malformed_set_irqs_variants_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DeviceSetIrqs as u16;
    let (e0, e1) = (efd(), efd());
    let (f0, f1) = (e0.as_raw_fd(), e1.as_raw_fd());
    let ev = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    let none = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER;
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(none, 1, 0, 1, &[]), &[f0]),
        EINVAL,
        "extra fd"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(ev, 1, 0, 2, &[]), &[f0]),
        EINVAL,
        "missing fd"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(ev, 1, 1, 2, &[]), &[f0, f1]),
        EINVAL,
        "range"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(ev, 7, 0, 1, &[]), &[f0]),
        EINVAL,
        "index"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(ev | 1, 1, 0, 1, &[]), &[f0]),
        EINVAL,
        "flags"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_set_irqs(ev, 1, 0, 1, &[])[..12], &[]),
        EINVAL,
        "short"
    );
    assert_eq!(ts.state().set_irqs_calls, 0, "nothing reached the device");
    // A valid one, then the disable (count 0, DATA_NONE, TRIGGER).
    let r = c.call(cmd, 0, &encode_set_irqs(ev, 1, 0, 2, &[]), &[f0, f1]);
    assert!(!r.header.is_error());
    assert!(ts.state().trigger(1, 1));
    let r = c.call(cmd, 0, &encode_set_irqs(none, 1, 0, 0, &[]), &[]);
    assert!(!r.header.is_error());
    assert!(!ts.state().trigger(1, 1), "disabled");
    usable(&mut c);
}

#[test]
fn test_malformed_region_access_variants_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let read = Command::RegionRead as u16;
    let a = |region, offset, count| RegionAccess {
        offset,
        region,
        count,
    };
    assert_eq!(
        c.expect_error(read, &a(0, 4094, 4).encode(), &[]),
        EINVAL,
        "beyond region"
    );
    assert_eq!(
        c.expect_error(read, &a(5, 0, 4).encode(), &[]),
        EINVAL,
        "empty region"
    );
    assert_eq!(
        c.expect_error(read, &a(42, 0, 4).encode(), &[]),
        EINVAL,
        "no such region"
    );
    assert_eq!(
        c.expect_error(read, &a(0, 0, 2 << 20).encode(), &[]),
        libc::E2BIG as u32,
        "oversized count"
    );
    assert_eq!(
        c.expect_error(read, &a(0, 0, 4).encode()[..12], &[]),
        EINVAL,
        "short"
    );
    let e = efd();
    assert_eq!(
        c.expect_error(read, &a(0, 0, 4).encode(), &[e.as_raw_fd()]),
        EINVAL,
        "fd"
    );
    let write = Command::RegionWrite as u16;
    let mut p = a(0, 0, 4).encode();
    p.extend_from_slice(&[1, 2, 3]);
    assert_eq!(
        c.expect_error(write, &p, &[]),
        EINVAL,
        "data shorter than count"
    );
    let mut p = a(0, u64::MAX - 1, 4).encode();
    p.extend_from_slice(&[1, 2, 3, 4]);
    assert_eq!(c.expect_error(write, &p, &[]), EINVAL, "offset wraps");
    assert!(ts.state().writes.is_empty(), "nothing reached the device");
    usable(&mut c);
}

#[test]
fn test_malformed_write_multi_variants_rejected() {
    let ts = TestServer::start_with(|c| c.write_multiple = true);
    // Not negotiated: ENOTSUP.
    let caps = "{\"capabilities\":{\"max_msg_fds\":16}}";
    let (mut c, _) = RawClient::negotiated(ts.path(), caps);
    let cmd = Command::RegionWriteMulti as u16;
    let w = |region, offset, count| WriteOne {
        access: RegionAccess {
            offset,
            region,
            count,
        },
        data: [1; 8],
    };
    let good = encode_write_multi(&[w(0, 0, 4)]);
    assert_eq!(c.expect_error(cmd, &good, &[]), libc::ENOTSUP as u32);
    drop(c);
    ts.wait_for("disconnect", |s| s.disconnects == 1);
    let mut c = RawClient::new_default(ts.path());
    assert_eq!(
        c.expect_error(cmd, &encode_write_multi(&[]), &[]),
        EINVAL,
        "wr_cnt 0"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_write_multi(&[w(0, 0, 9)]), &[]),
        libc::E2BIG as u32,
        "count 9"
    );
    assert_eq!(
        c.expect_error(cmd, &good[..good.len() - 1], &[]),
        EINVAL,
        "short"
    );
    assert_eq!(
        c.expect_error(cmd, &encode_write_multi(&[w(0, 0, 4), w(0, 4095, 4)]), &[]),
        EINVAL,
        "second write out of bounds"
    );
    assert!(ts.state().writes.is_empty(), "all-or-nothing bounds check");
    usable(&mut c);
}

#[test]
fn test_malformed_reset_feature_mig_and_direction_rejected() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    assert_eq!(
        c.expect_error(Command::DeviceReset as u16, &[0; 4], &[]),
        EINVAL
    );
    let e = efd();
    assert_eq!(
        c.expect_error(Command::DeviceReset as u16, &[], &[e.as_raw_fd()]),
        EINVAL
    );
    assert_eq!(ts.state().resets, 0);
    let f = Command::DeviceFeature as u16;
    // Well formed (argsz covers the 8-byte reply data), to a device without migration.
    let mig = encode_feature(
        16,
        VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIGRATION,
        &[],
    );
    assert_eq!(
        c.expect_error(f, &mig, &[]),
        libc::ENOTSUP as u32,
        "migration feature"
    );
    assert_eq!(
        c.expect_error(f, &encode_feature(8, 6, &[]), &[]),
        EINVAL,
        "no operation bit"
    );
    assert_eq!(c.expect_error(f, &[8, 0], &[]), EINVAL, "short");
    assert_eq!(
        c.expect_error(Command::MigDataRead as u16, &u32s(&[24, 16]), &[]),
        libc::ENOTSUP as u32,
        "well-formed MIG_DATA_READ to a device without migration"
    );
    assert_eq!(
        c.expect_error(Command::DmaRead as u16, &[0; 16], &[]),
        EINVAL,
        "wrong direction"
    );
    assert_eq!(
        c.expect_error(99, &[], &[]),
        libc::ENOSYS as u32,
        "unknown command"
    );
    usable(&mut c);
}

#[test]
fn test_malformed_headers_oversized_drained_and_too_many_fds() {
    let ts = TestServer::start_with(|c| c.max_data_xfer_size = 4096);
    let mut c = RawClient::new_default(ts.path());
    // A message larger than the server accepts: drained, answered E2BIG.
    let big = vec![0u8; 4096 + 64 * 1024 + 16];
    let m = c.call(Command::RegionWrite as u16, 0, &big, &[]);
    assert!(m.header.is_error());
    assert_eq!(m.header.error, libc::E2BIG as u32);
    // Unknown header flag bits.
    let id = c.send(Command::DeviceReset as u16, 1 << 8, &[], &[]);
    let m = c.recv();
    assert_eq!((m.header.msg_id, m.header.error), (id, EINVAL));
    // More fds than the control buffer holds.
    let e = efd();
    let fds = vec![e.as_raw_fd(); 40];
    assert_eq!(
        c.expect_error(Command::DeviceReset as u16, &[], &fds),
        EINVAL
    );
    usable(&mut c);
}

#[test]
fn test_malformed_header_size_below_16_closes_connection() {
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let h = Header {
        msg_id: 7,
        command: Command::DeviceReset as u16,
        msg_size: 8,
        flags: 0,
        error: 0,
    };
    c.send_raw(&h.encode(), &[]);
    let m = c.recv();
    assert_eq!((m.header.msg_id, m.header.error), (7, EINVAL));
    ts.wait_for("disconnect", |s| s.disconnects == 1);
}
