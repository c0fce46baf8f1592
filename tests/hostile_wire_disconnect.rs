//! A client that hangs up at every message boundary of a scripted session (and in the
//! middle of messages, and while the device waits for a DMA_READ it issued): afterwards the
//! server holds no DMA map, no pin, no IRQ fd and no socket fd of that client, and the next
//! client can connect and use the device, including server→client DMA. Run with and without
//! twin-socket mode.

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use common::test_device::{REG_DMA_IOVA, REG_DMA_LEN, REG_DMA_OP, REG_DMA_STATUS, REG_DOORBELL};
use common::TestServer;
use hostile::*;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::set_irqs::encode_set_irqs;
use umdev::protocol::wire::Put;
use umdev::protocol::{encode_message, Command, FLAGS_NO_REPLY, HEADER_SIZE};
use umdev::server::socket_io::send_message;
use umdev::testing::{memfd, Msg, RawClient, DEFAULT_CAPS};
use vfio_bindings::bindings::vfio::*;
use vmm_sys_util::eventfd::EventFd;

const FD_IOVA: u64 = 0x10_0000;
const FDLESS_IOVA: u64 = 0x80_0000;
const SIZE: u64 = 0x4000;

const TWIN_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"twin_socket\":{\"supported\":true},\"write_multiple\":true}}";

/// Where the client hangs up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stop {
    Connected,
    HalfHeader,
    Version,
    VersionHalfPayload,
    DmaMapFd,
    DmaMapFdless,
    GetInfo,
    RegionInfoWithFd,
    SetIrqs,
    RegionAccess,
    WriteHalfPayload,
    DuringDmaRead,
    EndOfScript,
}

const STOPS: [Stop; 13] = [
    Stop::Connected,
    Stop::HalfHeader,
    Stop::Version,
    Stop::VersionHalfPayload,
    Stop::DmaMapFd,
    Stop::DmaMapFdless,
    Stop::GetInfo,
    Stop::RegionInfoWithFd,
    Stop::SetIrqs,
    Stop::RegionAccess,
    Stop::WriteHalfPayload,
    Stop::DuringDmaRead,
    Stop::EndOfScript,
];

/// What a client holds until it hangs up.
struct Session {
    c: RawClient,
    twin: Option<UnixStream>,
    _keep: Vec<OwnedFd>,
    _efds: Vec<EventFd>,
}

fn ok(m: &Msg, what: &str) {
    assert!(!m.header.is_error(), "{what}: errno {}", m.header.error);
}

fn map(flags: u32, iova: u64) -> Vec<u8> {
    DmaMapRequest {
        flags,
        offset: 0,
        iova,
        size: SIZE,
    }
    .encode()
}

fn reg_write(c: &mut RawClient, off: u64, data: &[u8]) {
    let m = c.region_write(0, off, data, 0).unwrap();
    ok(&m, "register write");
}

/// Program the test device's DMA engine: `op` 1 reads guest memory into BAR0 scratch. The
/// op write is posted, as QEMU posts MMIO writes: fd-less DMA done on the connection thread
/// while the client waits for a reply fails fast (protocol-docs/server-dma.md).
fn start_dma(c: &mut RawClient, iova: u64, len: u32, op: u32) -> u16 {
    reg_write(c, REG_DMA_IOVA, &iova.to_le_bytes());
    reg_write(c, REG_DMA_LEN, &len.to_le_bytes());
    let a = umdev::protocol::region_access::RegionAccess {
        offset: REG_DMA_OP,
        region: 0,
        count: 4,
    };
    let mut p = a.encode();
    p.extend_from_slice(&op.to_le_bytes());
    c.send(Command::RegionWrite as u16, FLAGS_NO_REPLY, &p, &[])
}

/// Run the script up to `stop`; return what the client holds.
fn script(path: &std::path::Path, stop: Stop, twin: bool) -> Session {
    let mut s = Session {
        c: RawClient::connect(path),
        twin: None,
        _keep: vec![],
        _efds: vec![],
    };
    if stop == Stop::Connected {
        return s;
    }
    let caps = if twin { TWIN_CAPS } else { DEFAULT_CAPS };
    let mut vp = vec![0, 0, 0, 0];
    vp.extend_from_slice(caps.as_bytes());
    vp.push(0);
    let vmsg = encode_message(
        &umdev::protocol::Header::command(1, Command::Version, vp.len()),
        &vp,
    );
    if stop == Stop::HalfHeader {
        s.c.send_raw(&vmsg[..8], &[]);
        return s;
    }
    if stop == Stop::VersionHalfPayload {
        s.c.send_raw(&vmsg[..HEADER_SIZE + 10], &[]);
        return s;
    }
    s.c.send_raw(&vmsg, &[]);
    let mut r = s.c.recv();
    ok(&r, "VERSION");
    if twin {
        let fd = r.fds.pop().expect("twin socket fd");
        s.twin = Some(UnixStream::from(fd));
    }
    if stop == Stop::Version {
        return s;
    }
    let mem = memfd(SIZE).unwrap();
    ok(
        &s.c.call(
            Command::DmaMap as u16,
            0,
            &map(3, FD_IOVA),
            &[mem.as_raw_fd()],
        ),
        "DMA_MAP fd",
    );
    s._keep.push(mem.into());
    if stop == Stop::DmaMapFd {
        return s;
    }
    ok(
        &s.c.call(Command::DmaMap as u16, 0, &map(3, FDLESS_IOVA), &[]),
        "DMA_MAP fd-less",
    );
    if stop == Stop::DmaMapFdless {
        return s;
    }
    let mut p = Vec::new();
    p.put_u32(16);
    p.extend_from_slice(&[0; 12]);
    ok(
        &s.c.call(Command::DeviceGetInfo as u16, 0, &p, &[]),
        "GET_INFO",
    );
    if stop == Stop::GetInfo {
        return s;
    }
    let mut p = Vec::new();
    for v in [256u32, 0, 2, 0] {
        p.put_u32(v);
    }
    p.extend_from_slice(&[0; 16]);
    let mut r = s.c.call(Command::DeviceGetRegionInfo as u16, 0, &p, &[]);
    ok(&r, "GET_REGION_INFO");
    assert_eq!(r.fds.len(), 1, "region 2 comes with its fd");
    s._keep.append(&mut r.fds);
    if stop == Stop::RegionInfoWithFd {
        return s;
    }
    let efds: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    let msi = encode_set_irqs(flags, 1, 0, 2, &[]);
    let fds = [efds[0].as_raw_fd(), efds[1].as_raw_fd()];
    ok(
        &s.c.call(Command::DeviceSetIrqs as u16, 0, &msi, &fds),
        "SET_IRQS MSI",
    );
    let intx = encode_set_irqs(flags, 0, 0, 1, &[]);
    let fds = [efds[2].as_raw_fd()];
    ok(
        &s.c.call(Command::DeviceSetIrqs as u16, 0, &intx, &fds),
        "SET_IRQS INTx",
    );
    s._efds = efds;
    if stop == Stop::SetIrqs {
        return s;
    }
    reg_write(&mut s.c, REG_DOORBELL, &1u32.to_le_bytes());
    assert_eq!(s._efds[1].read().unwrap(), 1, "MSI 1 fired");
    assert_eq!(s.c.region_read(7, 0, 4), vec![0, 1, 2, 3]);
    if stop == Stop::RegionAccess {
        return s;
    }
    if stop == Stop::WriteHalfPayload {
        let a = umdev::protocol::region_access::RegionAccess {
            offset: 0,
            region: 0,
            count: 64,
        };
        let mut p = a.encode();
        p.extend_from_slice(&[9; 64]);
        let m = encode_message(
            &umdev::protocol::Header::command(77, Command::RegionWrite, p.len()),
            &p,
        );
        s.c.send_raw(&m[..HEADER_SIZE + 40], &[]);
        return s;
    }
    if stop == Stop::DuringDmaRead {
        // The device reads fd-less guest memory: the server sends DMA_READ to us and the
        // connection thread waits for the answer, which never comes.
        start_dma(&mut s.c, FDLESS_IOVA, 16, 1);
        let req = match &s.twin {
            Some(t) => RawClient::recv_on(t),
            None => s.c.recv(),
        };
        assert_eq!(
            req.header.command,
            Command::DmaRead as u16,
            "DMA_READ expected"
        );
        return s;
    }
    s
}

/// A full session by a fresh client: negotiate, map, let the device DMA from both maps
/// (answering the DMA_READ), fire an IRQ; then hang up.
fn full_session(ts: &TestServer, twin: bool) {
    let caps = if twin { TWIN_CAPS } else { DEFAULT_CAPS };
    let (mut c, mut vr) = RawClient::negotiated(ts.path(), caps);
    let twin_sock = vr.fds.pop().map(UnixStream::from);
    assert_eq!(twin_sock.is_some(), twin);
    let mem = memfd(SIZE).unwrap();
    {
        use std::os::unix::fs::FileExt;
        mem.write_all_at(b"fd-backed", 0).unwrap();
    }
    ok(
        &c.call(
            Command::DmaMap as u16,
            0,
            &map(3, FD_IOVA),
            &[mem.as_raw_fd()],
        ),
        "next client DMA_MAP",
    );
    ok(
        &c.call(Command::DmaMap as u16, 0, &map(3, FDLESS_IOVA), &[]),
        "next client fd-less DMA_MAP",
    );
    start_dma(&mut c, FD_IOVA, 9, 1);
    // A round trip: the posted write was handled before it.
    c.region_read(0, REG_DMA_STATUS, 4);
    assert_eq!(ts.state().reg32(REG_DMA_STATUS), 0, "DMA from the fd map");
    start_dma(&mut c, FDLESS_IOVA + 0x10, 8, 1);
    let req = match &twin_sock {
        Some(t) => RawClient::recv_on(t),
        None => c.recv(),
    };
    assert_eq!(req.header.command, Command::DmaRead as u16);
    let mut p = Vec::new();
    p.put_u64(FDLESS_IOVA + 0x10);
    p.put_u64(8);
    p.extend_from_slice(b"from-cli");
    let reply = encode_message(&req.header.reply(p.len()), &p);
    match &twin_sock {
        Some(t) => send_message(t, &reply, &[]).unwrap(),
        None => c.send_raw(&reply, &[]),
    }
    c.region_read(0, REG_DMA_STATUS, 4);
    assert_eq!(ts.state().reg32(REG_DMA_STATUS), 0, "DMA_READ answered");
    assert_eq!(&ts.state().regs[0x800..0x808], b"from-cli");
}

fn check_released(ts: &TestServer, baseline: usize, disconnects: u32, what: &str) {
    // The server notices the hang-up asynchronously (a bare connect may not even have
    // been accepted yet when the client closes).
    ts.wait_for(what, |st| st.disconnects >= disconnects);
    settle_dma(ts.dma(), 0, what);
    settle_fds(baseline, what);
    let st = ts.state();
    assert_eq!(st.disconnects, disconnects, "{what}: disconnect not seen");
    assert!(st.eventfds.is_empty(), "{what}: IRQ fds kept");
}

fn every_boundary(twin: bool) {
    let _g = serial();
    let ts = TestServer::start();
    let baseline = open_fds();
    let mut disconnects = 0;
    for stop in STOPS {
        let what = format!("hang-up at {stop:?} (twin {twin})");
        drop(script(ts.path(), stop, twin));
        disconnects += 1;
        check_released(&ts, baseline, disconnects, &what);
        full_session(&ts, twin);
        disconnects += 1;
        check_released(&ts, baseline, disconnects, &format!("session after {what}"));
    }
    assert_eq!(ts.dma().stats().leaked_pins_released, 0);
}

#[test]
fn test_hostile_disconnect_every_boundary_releases_all_next_client_ok() {
    every_boundary(false);
}

#[test]
fn test_hostile_disconnect_every_boundary_twin_socket_releases_all() {
    every_boundary(true);
}

#[test]
fn test_hostile_disconnect_200_reconnects_no_fd_thread_or_rss_growth() {
    let _g = serial();
    let ts = TestServer::start();
    // One session first so lazily created state (log subscriber, ...) exists.
    full_session(&ts, false);
    ts.wait_for("first session gone", |s| s.disconnects == 1);
    let fds = open_fds();
    let threads = thread_count();
    let mut rss_warm = 0;
    for i in 0..200u32 {
        if i == 40 {
            rss_warm = rss_kib();
        }
        let stop = STOPS[i as usize % STOPS.len()];
        drop(script(ts.path(), stop, i % 2 == 1));
        ts.wait_for("hang-up seen", |s| s.disconnects == 2 + i);
    }
    settle_dma(ts.dma(), 0, "after 200 reconnects");
    settle_fds(fds, "after 200 reconnects");
    let after = settle_threads(threads);
    assert!(after <= threads, "threads grew from {threads} to {after}");
    let rss = rss_kib();
    eprintln!("200 reconnects: VmRSS {rss_warm} KiB after 40, {rss} KiB after 200");
    assert!(
        rss <= rss_warm + 2048,
        "RSS grew from {rss_warm} KiB to {rss} KiB over 160 sessions"
    );
}
