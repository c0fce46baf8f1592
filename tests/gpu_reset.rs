//! DEVICE_RESET quiesces the GPU, through a real socket: a raw-client VMM (it serves the
//! device's DMA_READs for fd-less memory) publishes a long ring of FENCE and drawing
//! commands and sends DEVICE_RESET while the worker executes them. After the reset reply,
//! nothing queued before it may show: no FENCE_VALUE, no IRQ_STATUS or error bit, no
//! interrupt eventfd (not even when the guest enables interrupts again), no framebuffer
//! write, no DMA_READ on the wire. Each race is repeated a few hundred times.

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use umdev::device::{irq_index, region_index};
use umdev::pci::PciAdapter;
use umdev::protocol::Command as Wire;
use umdev::testing::{memfd, DeviceAccess, FdlessMemory, RawClient, TestServer, Vmm, DEFAULT_CAPS};
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig, GpuHandle};

const BAR: u32 = region_index::BAR0;
const RING_GPA: u64 = 0x1000_0000;
const W: u32 = 64;
const H: u32 = 64;
/// Races per test: the original code lost 11 of 200 (fences) and 19 of 20 (DMA_READs).
const ROUNDS: u32 = 250;

/// A GPU served on a fresh socket, the raw VMM connected with `caps`, and an observer.
fn start(caps: &str) -> (TestServer<PciAdapter<Gpu>>, Vmm, GpuHandle) {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let handle = gpu.handle();
    let served = TestServer::builder_pci(gpu).unwrap().start().unwrap();
    let (c, _) = RawClient::negotiated(served.path(), caps);
    (served, Vmm::from_client(c), handle)
}

/// What the guest driver does after a reset: bus master, mode, ring, interrupt causes.
fn init(vmm: &mut Vmm, ring_size: u32, irq_enable: u32) {
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    for (off, v) in [
        (REG_MODE_WIDTH, W),
        (REG_MODE_HEIGHT, H),
        (REG_MODE_STRIDE, W * 4),
        (REG_MODE_FORMAT, FORMAT_XRGB8888),
        (REG_MODE_CTRL, 1),
        (REG_RING_BASE_LO, RING_GPA as u32),
        (REG_RING_BASE_HI, (RING_GPA >> 32) as u32),
        (REG_RING_SIZE, ring_size),
        (REG_RING_CTRL, 1),
        (REG_IRQ_ENABLE, irq_enable),
    ] {
        vmm.write32(BAR, off, v).unwrap();
    }
    assert_eq!(vmm.read32(BAR, REG_RING_CTRL).unwrap(), 1, "ring rejected");
}

/// A ring's worth of work: FENCEs with values that are never 0, a full-screen fill in a
/// new color every `fill_every` commands (0: none), and an out-of-bounds fill (an error)
/// every 16.
fn long_ring(ring_size: u32, fill_every: u32) -> Vec<u8> {
    let mut cmds = Vec::new();
    let mut bytes = 0usize;
    for k in 1u32.. {
        let (cmd, len) = if fill_every > 0 && k % fill_every == 0 {
            let color = (k * 0x01_0203) & 0x00ff_ffff;
            let fill = Command::FillRect {
                x: 0,
                y: 0,
                w: W,
                h: H,
                color,
            };
            (fill, 24)
        } else if k % 16 == 7 {
            let oob = Command::FillRect {
                x: W,
                y: 0,
                w: 1,
                h: 1,
                color: 0,
            };
            (oob, 24)
        } else {
            (
                Command::Fence {
                    value: 0x1_0000 | k,
                },
                8,
            )
        };
        if bytes + len > ring_size as usize - 4 {
            break;
        }
        bytes += len;
        cmds.push(cmd);
    }
    let encoded = Command::encode_bytes(&cmds);
    assert_eq!(encoded.len(), bytes);
    encoded
}

/// The visible framebuffer.
fn screen(gpu: &GpuHandle) -> Vec<u8> {
    let mut px = vec![0u8; (W * H * 4) as usize];
    assert!(gpu.framebuffer().read(0, &mut px));
    px
}

fn reset(vmm: &mut Vmm) {
    let m = vmm.call(Wire::DeviceReset, &[], &[]).unwrap();
    assert!(
        !m.header.is_error(),
        "DEVICE_RESET errno {}",
        m.header.error
    );
}

/// Registers that a command queued before the reset would change, all at reset value.
fn assert_reset_values(vmm: &mut Vmm, round: u32, when: &str) {
    for (reg, name) in [
        (REG_FENCE_VALUE, "FENCE_VALUE"),
        (REG_IRQ_STATUS, "IRQ_STATUS"),
        (REG_ERROR_CODE, "ERROR_CODE"),
        (REG_ERROR_COUNT, "ERROR_COUNT"),
        (REG_RING_HEAD, "RING_HEAD"),
    ] {
        let v = vmm.read32(BAR, reg).unwrap();
        assert_eq!(
            v, 0,
            "round {round}, {when}: {name} = {v:#x} after the reset reply"
        );
    }
}

/// Publish `len` bytes of commands (already in the ring), wait until the worker works on
/// them (RING_HEAD moved, or it sent a DMA_READ), and reset. True if the worker was seen
/// in the middle of the ring just before the reset was sent.
fn publish_and_reset(vmm: &mut Vmm, len: usize) -> bool {
    let before = vmm.requests();
    vmm.write32(BAR, REG_RING_TAIL, len as u32).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mid_ring = loop {
        let head = vmm.read32(BAR, REG_RING_HEAD).unwrap() as usize;
        if head != 0 || vmm.requests() > before {
            break head < len;
        }
        assert!(Instant::now() < deadline, "the worker never started");
    };
    reset(vmm);
    mid_ring
}

/// Most rounds really raced: the worker was seen mid-ring just before the reset.
fn assert_raced(mid_ring: u32) {
    assert!(
        mid_ring >= ROUNDS / 2,
        "only {mid_ring} of {ROUNDS} resets were sent while the worker was mid-ring"
    );
}

/// The long ring in a memfd mapped at RING_GPA; returns the memfd and the published length.
fn fd_ring(vmm: &mut Vmm, ring_size: u32, fill_every: u32) -> (std::fs::File, usize) {
    let ring = memfd(u64::from(ring_size)).unwrap();
    let bytes = long_ring(ring_size, fill_every);
    ring.write_all_at(&bytes, 0).unwrap();
    vmm.dma_map_fd(RING_GPA, u64::from(ring_size), ring.as_fd(), 0)
        .expect("DMA_MAP");
    (ring, bytes.len())
}

#[test]
fn test_gpu_reset_during_long_ring_no_register_or_framebuffer_change_after_reply() {
    let ring_size = 64 * 1024;
    let (served, mut vmm, gpu) = start(DEFAULT_CAPS);
    let (_ring, len) = fd_ring(&mut vmm, ring_size, 64);
    // The ring run to its end once: its last fill is what a reset that let the whole ring
    // run would leave on the screen.
    init(&mut vmm, ring_size, 0);
    vmm.write32(BAR, REG_RING_TAIL, len as u32).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while vmm.read32(BAR, REG_RING_HEAD).unwrap() as usize != len {
        assert!(Instant::now() < deadline, "the ring never drained");
    }
    let end_of_ring = screen(&gpu);
    reset(&mut vmm);
    let (mut mid_ring, mut stopped_early) = (0, 0);
    for round in 1..=ROUNDS {
        init(&mut vmm, ring_size, 0);
        mid_ring += u32::from(publish_and_reset(&mut vmm, len));
        let at_reply = screen(&gpu);
        stopped_early += u32::from(at_reply != end_of_ring);
        assert_reset_values(&mut vmm, round, "at once");
        std::thread::sleep(Duration::from_micros(300));
        assert_reset_values(&mut vmm, round, "300 µs later");
        assert!(
            screen(&gpu) == at_reply,
            "round {round}: the framebuffer changed after the reset reply"
        );
    }
    assert_raced(mid_ring);
    // The reset stopped the ring at a command boundary, it did not let it run to its end.
    assert!(
        stopped_early >= ROUNDS / 2,
        "only {stopped_early} of {ROUNDS} resets stopped the ring before its last fill"
    );
    served.assert_space_unpinned();
}

#[test]
fn test_gpu_reset_during_long_ring_no_interrupt_after_reply() {
    let ring_size = 64 * 1024;
    let (_served, mut vmm, _gpu) = start(DEFAULT_CAPS);
    let (_ring, len) = fd_ring(&mut vmm, ring_size, 0);
    // After a reset MSI and MSI-X are off: the device interrupts through INTx.
    let intx = vmm.attach_eventfd(irq_index::INTX).unwrap();
    let mut fired_before = 0;
    let mut mid_ring = 0;
    for round in 1..=ROUNDS {
        // Odd rounds: the commands interrupt as they complete. Even rounds: no cause is
        // enabled, the commands only set IRQ_STATUS bits.
        let enable = if round % 2 == 1 { IRQ_ALL } else { 0 };
        init(&mut vmm, ring_size, enable);
        mid_ring += u32::from(publish_and_reset(&mut vmm, len));
        // Whatever fired before the reply was legitimate.
        if intx.read().is_ok() {
            fired_before += 1;
        }
        // The guest enables every cause: a cause left pending by old work would interrupt
        // now.
        vmm.write32(BAR, REG_IRQ_ENABLE, IRQ_ALL).unwrap();
        std::thread::sleep(Duration::from_micros(300));
        let status = vmm.read32(BAR, REG_IRQ_STATUS).unwrap();
        assert!(
            intx.read().is_err(),
            "round {round}: INTx fired after the reset reply (IRQ_STATUS {status:#x})"
        );
        assert_eq!(status, 0, "round {round}: IRQ_STATUS after the reset reply");
        vmm.write32(BAR, REG_IRQ_ENABLE, 0).unwrap();
    }
    assert_raced(mid_ring);
    // The eventfd was live: the commands before the resets did interrupt.
    assert!(fired_before > 0, "no interrupt in {ROUNDS} rounds");
}

/// Capabilities with a small max_data_xfer_size: a ring fetch is many DMA_READs.
const SMALL_XFER_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":256,\"pgsizes\":4096,\"max_dma_maps\":65535}}";

#[test]
fn test_gpu_reset_fdless_ring_no_dma_read_after_reply() {
    let ring_size = 16 * 1024;
    let (_served, mut vmm, gpu) = start(SMALL_XFER_CAPS);
    let bytes = long_ring(ring_size, 4);
    vmm.set_fdless(FdlessMemory::new(RING_GPA, ring_size as usize));
    vmm.mem_mut()[..bytes.len()].copy_from_slice(&bytes);
    vmm.dma_map_fdless(RING_GPA, u64::from(ring_size)).unwrap();
    let mut mid_ring = 0;
    for round in 1..=ROUNDS {
        init(&mut vmm, ring_size, 0);
        mid_ring += u32::from(publish_and_reset(&mut vmm, bytes.len()));
        let at_reply = vmm.requests();
        let screen_at_reply = screen(&gpu);
        assert_reset_values(&mut vmm, round, "at once");
        std::thread::sleep(Duration::from_micros(500));
        // This call serves (and counts) whatever DMA_READ arrived meanwhile.
        assert_eq!(
            vmm.read32(BAR, REG_STATUS).unwrap(),
            0,
            "round {round}: STATUS"
        );
        assert_eq!(
            vmm.requests() - at_reply,
            0,
            "round {round}: DMA_READs after the reset reply"
        );
        assert!(
            screen(&gpu) == screen_at_reply,
            "round {round}: framebuffer"
        );
    }
    // The device was reading the ring over the socket when the resets came.
    assert_raced(mid_ring);
}
