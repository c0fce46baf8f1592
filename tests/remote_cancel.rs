//! A client that behaves like QEMU 10.x never has to wait for umdev's remote DMA timeout.
//!
//! QEMU answers server→client DMA_READ/DMA_WRITE in a main-loop bottom half, which cannot
//! run while a QEMU thread holding the BQL waits for one of umdev's replies; a reply later
//! than 5 s corrupts QEMU's stream. The raw VMM here does the same (`Vmm::qemu_like`:
//! a request that arrives while it waits for a reply is answered after that reply), and
//! the server's remote DMA timeout is QEMU's 5 s. Each test asserts that the reply comes
//! well before that: a DEVICE_RESET while the GPU worker waits in a DMA_READ of an fd-less
//! ring (and while the ccw worker waits in the read of its operation block), a DMA_UNMAP
//! of that ring (while a DMA_READ to another fd-less mapping waits too, and must still
//! complete), and fd-less DMA done on the connection thread by a region handler while the
//! client waits for a reply.

mod common;

use std::time::{Duration, Instant};

use common::test_device::{DMA_SCRATCH, REG_DMA_IOVA, REG_DMA_LEN, REG_DMA_OP, REG_DMA_STATUS};
use umdev::device::{irq_index, region_index};
use umdev::pci::PciAdapter;
use umdev::protocol::dma_map::DmaUnmapRequest;
use umdev::protocol::Command as Wire;
use umdev::testing::{DeviceAccess, DmaRequest, FdlessMemory, RawClient, TestServer, Vmm};
use umdev_devices::ccw::{regs as ccw_regs, Ccw, CcwConfig};
use umdev_devices::gpu::error::ERR_RING_FAULT;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};

const BAR: u32 = region_index::BAR0;
/// The fd-less ring, and another fd-less mapping right after it.
const RING_GPA: u64 = 0x1000_0000;
const RING_SIZE: u32 = 16 * 1024;
const OTHER_GPA: u64 = RING_GPA + RING_SIZE as u64;
const OTHER_SIZE: u64 = 0x1000;
/// QEMU's `x-msg-timeout` and umdev's default remote DMA timeout.
const QEMU_TIMEOUT: Duration = Duration::from_secs(5);
/// What "well before the timeout" means here (machines are slow, CI is slower).
const FAST: Duration = Duration::from_secs(2);
/// A small max_data_xfer_size: a ring fetch is many DMA_READs.
const SMALL_XFER_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":256,\"pgsizes\":4096,\"max_dma_maps\":65535}}";

/// A GPU served with QEMU's remote timeout, a QEMU-like VMM whose fd-less memory holds a
/// ring of FENCEs at RING_GPA (mapped) and a pattern at OTHER_GPA (mapped); returns the
/// published ring length too.
fn gpu_on_fdless_ring() -> (TestServer<PciAdapter<Gpu>>, Vmm, usize) {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let served = TestServer::builder_pci(gpu)
        .unwrap()
        .configure(|c| c.remote_dma_timeout = QEMU_TIMEOUT)
        .start()
        .unwrap();
    let (c, _) = RawClient::negotiated(served.path(), SMALL_XFER_CAPS);
    let mut vmm = Vmm::from_client(c)
        .with_fdless(FdlessMemory::new(
            RING_GPA,
            (RING_SIZE as u64 + OTHER_SIZE) as usize,
        ))
        .qemu_like()
        .unwrap();
    let cmds: Vec<Command> = (1..=(RING_SIZE / 8 - 1))
        .map(|k| Command::Fence { value: k })
        .collect();
    let ring = Command::encode_bytes(&cmds);
    vmm.mem_mut()[..ring.len()].copy_from_slice(&ring);
    for (i, b) in vmm.mem_mut()[RING_SIZE as usize..].iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    vmm.dma_map_fdless(RING_GPA, RING_SIZE.into())
        .expect("DMA_MAP ring");
    vmm.dma_map_fdless(OTHER_GPA, OTHER_SIZE)
        .expect("DMA_MAP other");
    (served, vmm, ring.len())
}

/// What the guest driver does after a reset: bus master, ring on.
fn init_ring(vmm: &mut Vmm) {
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    for (off, v) in [
        (REG_RING_BASE_LO, RING_GPA as u32),
        (REG_RING_BASE_HI, (RING_GPA >> 32) as u32),
        (REG_RING_SIZE, RING_SIZE),
        (REG_RING_CTRL, 1),
    ] {
        vmm.write32(BAR, off, v).unwrap();
    }
    assert_eq!(vmm.read32(BAR, REG_RING_CTRL).unwrap(), 1, "ring rejected");
}

/// The guest publishes the ring with a posted MMIO write; the worker's first DMA_READ of
/// it arrives and is left unanswered, as QEMU would leave it when a vCPU takes the BQL
/// to reset the device (or the memory layout changes) right after.
fn publish_and_hold_fetch(vmm: &mut Vmm, len: usize) {
    vmm.write32_posted(BAR, REG_RING_TAIL, len as u32).unwrap();
    let DmaRequest {
        command: cmd, iova, ..
    } = vmm.hold_request().unwrap();
    assert_eq!(cmd, Wire::DmaRead as u16);
    assert!(
        (RING_GPA..OTHER_GPA).contains(&iova),
        "ring fetch at {iova:#x}"
    );
}

/// Requests that arrived after the reply: answer like QEMU's idle main loop for a while,
/// then one more round trip.
fn requests_after(vmm: &mut Vmm, at_reply: usize) -> Vec<DmaRequest> {
    vmm.serve_idle(Duration::from_millis(50), |_| false)
        .unwrap();
    vmm.read32(BAR, REG_ID).unwrap();
    vmm.log()[at_reply..].to_vec()
}

#[test]
fn test_gpu_reset_qemu_like_client_fetch_waiting_reply_fast_no_dma_read_after() {
    let (_served, mut vmm, len) = gpu_on_fdless_ring();
    let intx = vmm.attach_eventfd(irq_index::INTX).unwrap();
    for round in 1..=10 {
        init_ring(&mut vmm);
        // A failed fetch would raise the error interrupt: the cancelled one must not.
        vmm.write32(BAR, REG_IRQ_ENABLE, IRQ_ERROR).unwrap();
        publish_and_hold_fetch(&mut vmm, len);
        let start = Instant::now();
        let id = vmm.send(Wire::DeviceReset, &[], &[]).unwrap();
        let m = vmm.wait_reply().unwrap();
        let took = start.elapsed();
        assert_eq!(
            m.header.msg_id, id,
            "round {round}: reply to another message"
        );
        assert!(
            !m.header.is_error(),
            "round {round}: DEVICE_RESET errno {}",
            m.header.error
        );
        assert!(
            took < FAST,
            "round {round}: the DEVICE_RESET reply took {took:?} (the worker's DMA_READ was \
             waited for)"
        );
        assert!(
            intx.read().is_err(),
            "round {round}: an interrupt fired during the reset (the cancelled fetch was \
             reported as a ring fault)"
        );
        // Received before the reply; now QEMU's bottom half answers them (late replies).
        let at_reply = vmm.requests();
        vmm.answer_deferred().unwrap();
        let after = requests_after(&mut vmm, at_reply);
        assert!(
            after.is_empty(),
            "round {round}: requests after the DEVICE_RESET reply: {after:x?}"
        );
        assert_eq!(
            vmm.read32(BAR, REG_RING_CTRL).unwrap(),
            0,
            "round {round}: ring off"
        );
        assert_eq!(
            vmm.read32(BAR, REG_FENCE_VALUE).unwrap(),
            0,
            "round {round}: fence"
        );
    }
}

#[test]
fn test_gpu_dma_unmap_fdless_ring_during_fetch_reply_fast_other_region_read_completes() {
    let (served, mut vmm, len) = gpu_on_fdless_ring();
    init_ring(&mut vmm);
    publish_and_hold_fetch(&mut vmm, len);
    // Another device thread reads the other fd-less mapping; its DMA_READ waits too.
    let handle = served.dma().handle();
    let other = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64];
        handle.read(OTHER_GPA + 0x100, &mut buf).map(|()| buf)
    });
    let DmaRequest {
        command: cmd, iova, ..
    } = vmm.hold_request().unwrap();
    assert_eq!((cmd, iova), (Wire::DmaRead as u16, OTHER_GPA + 0x100));
    let unmap = DmaUnmapRequest {
        argsz: 24,
        all: false,
        iova: RING_GPA,
        size: RING_SIZE.into(),
    }
    .encode();
    let start = Instant::now();
    let id = vmm.send(Wire::DmaUnmap, &unmap, &[]).unwrap();
    let m = vmm.wait_reply().unwrap();
    let took = start.elapsed();
    assert_eq!(m.header.msg_id, id, "reply to another message");
    assert!(!m.header.is_error(), "DMA_UNMAP errno {}", m.header.error);
    assert!(
        took < FAST,
        "the DMA_UNMAP reply took {took:?} (the ring's DMA_READ was waited for)"
    );
    let at_reply = vmm.requests();
    // QEMU's bottom half runs now: it answers the ring read (too late, dropped) and the
    // other read, which was not cancelled and completes.
    vmm.answer_deferred().unwrap();
    let data = other
        .join()
        .unwrap()
        .expect("DMA_READ of the other mapping");
    assert_eq!(data, vmm.mem()[RING_SIZE as usize + 0x100..][..64].to_vec());
    // The worker's fetch failed: RING_FAULT at the head, as the GPU documents.
    let deadline = Instant::now() + Duration::from_secs(2);
    while vmm.read32(BAR, REG_ERROR_CODE).unwrap() != ERR_RING_FAULT {
        assert!(Instant::now() < deadline, "no RING_FAULT after the unmap");
    }
    assert_eq!(
        vmm.read32(BAR, REG_FENCE_VALUE).unwrap(),
        0,
        "a command ran"
    );
    let after = requests_after(&mut vmm, at_reply);
    assert!(
        after
            .iter()
            .all(|r| !(RING_GPA..OTHER_GPA).contains(&r.iova)),
        "requests to the unmapped ring after the reply: {after:x?}"
    );
}

#[test]
fn test_ccw_reset_qemu_like_client_opb_read_waiting_reply_fast_no_trace_after() {
    const RAM: u64 = 0x40_0000;
    let dir = tempfile::tempdir().unwrap();
    let ccw = Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(64)).unwrap();
    let served = TestServer::builder_pci(ccw)
        .unwrap()
        .in_dir(dir)
        .configure(|c| c.remote_dma_timeout = QEMU_TIMEOUT)
        .start()
        .unwrap();
    let c = RawClient::new_default(served.path());
    let mut vmm = Vmm::from_client(c)
        .with_fdless(FdlessMemory::new(RAM, 0x4000))
        .qemu_like()
        .unwrap();
    vmm.dma_map_fdless(RAM, 0x4000).unwrap();
    let intx = vmm.attach_eventfd(irq_index::INTX).unwrap();
    for round in 1..=5 {
        vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
            .unwrap();
        vmm.write32(BAR, ccw_regs::OPB_ADDR_LO, RAM as u32).unwrap();
        vmm.write32(BAR, ccw_regs::OPB_ADDR_HI, 0).unwrap();
        // START, posted; the worker's read of the operation block waits for the client.
        vmm.write32_posted(BAR, ccw_regs::START, 1).unwrap();
        let DmaRequest {
            command: cmd, iova, ..
        } = vmm.hold_request().unwrap();
        assert_eq!((cmd, iova), (Wire::DmaRead as u16, RAM), "round {round}");
        let start = Instant::now();
        let m = vmm.call(Wire::DeviceReset, &[], &[]).unwrap();
        let took = start.elapsed();
        assert!(
            !m.header.is_error(),
            "round {round}: DEVICE_RESET errno {}",
            m.header.error
        );
        assert!(
            took < FAST,
            "round {round}: the DEVICE_RESET reply took {took:?} (the worker was waited for)"
        );
        assert!(
            intx.read().is_err(),
            "round {round}: the cancelled program completed with an interrupt during the reset"
        );
        // Counted on arrival: all of these came before the reply (`call` answered them
        // after it, as QEMU would).
        let at_reply = vmm.requests();
        let after = requests_after(&mut vmm, at_reply);
        assert!(
            after.is_empty(),
            "round {round}: requests after the reply: {after:x?}"
        );
        for (reg, name) in [
            (ccw_regs::STATUS, "STATUS"),
            (ccw_regs::IRQ_STATUS, "IRQ_STATUS"),
            (ccw_regs::LAST_STATUS, "LAST_STATUS"),
            (ccw_regs::COMPLETED, "COMPLETED"),
        ] {
            assert_eq!(
                vmm.read32(BAR, reg).unwrap(),
                0,
                "round {round}: {name} after the reset"
            );
        }
    }
}

const FDLESS: u64 = 0x40_0000;

fn test_device_dma(vmm: &mut Vmm, iova: u64, len: u32) {
    vmm.write_bytes(0, REG_DMA_IOVA, &iova.to_le_bytes())
        .unwrap();
    vmm.write32(0, REG_DMA_LEN, len).unwrap();
}

#[test]
fn test_connection_thread_fdless_dma_client_waiting_fails_fast_posted_alone_works() {
    let ts = common::TestServer::start_with(|c| c.remote_dma_timeout = QEMU_TIMEOUT);
    let c = RawClient::new_default(ts.path());
    let mut vmm = Vmm::from_client(c)
        .with_fdless(FdlessMemory::new(FDLESS, 0x2000))
        .qemu_like()
        .unwrap();
    for (i, b) in vmm.mem_mut().iter_mut().enumerate() {
        *b = (i % 241) as u8;
    }
    vmm.dma_map_fdless(FDLESS, 0x2000).unwrap();
    test_device_dma(&mut vmm, FDLESS + 0x10, 32);

    // 1. A REGION_WRITE that expects a reply: the client cannot answer the device's
    //    DMA_READ before that reply, so the read fails at once, without a request.
    let start = Instant::now();
    vmm.write32(0, REG_DMA_OP, 1).unwrap();
    let took = start.elapsed();
    assert!(took < FAST, "the REGION_WRITE reply took {took:?}");
    assert_eq!(
        vmm.read32(0, REG_DMA_STATUS).unwrap(),
        libc::EDEADLK as u32,
        "DMA_STATUS after a non-posted write"
    );
    assert_eq!(vmm.requests(), 0, "a DMA_READ was sent");

    // 2. A posted write and nothing else: the client is idle and answers; the DMA works
    //    (what examples/hello.rs relies on under QEMU).
    vmm.write32_posted(0, REG_DMA_OP, 1).unwrap();
    vmm.serve_idle(FAST, |v| v.requests() == 1).unwrap();
    assert_eq!(vmm.requests(), 1, "the device's DMA_READ never came");
    assert_eq!(
        vmm.read32(0, REG_DMA_STATUS).unwrap(),
        0,
        "DMA_STATUS after a posted write"
    );
    let got = vmm.client().region_read(0, DMA_SCRATCH, 32);
    assert_eq!(got, vmm.mem()[0x10..0x30].to_vec());

    // 3. A posted write, then a command that expects a reply before the client answers
    //    the DMA_READ: the read fails as soon as that command arrives.
    vmm.write32(0, REG_DMA_STATUS, 0x7777).unwrap();
    vmm.write32_posted(0, REG_DMA_OP, 1).unwrap();
    let DmaRequest {
        command: cmd, iova, ..
    } = vmm.hold_request().unwrap();
    assert_eq!((cmd, iova), (Wire::DmaRead as u16, FDLESS + 0x10));
    let start = Instant::now();
    let status = vmm.read32(0, REG_DMA_STATUS).unwrap();
    let took = start.elapsed();
    assert!(took < FAST, "the REGION_READ reply took {took:?}");
    assert_eq!(status, libc::EDEADLK as u32, "DMA_STATUS");
    // The held DMA_READ was answered after that reply (a late reply, dropped); the
    // connection goes on.
    assert_eq!(vmm.read32(0, REG_DMA_STATUS).unwrap(), libc::EDEADLK as u32);
}
