//! GPU end to end: umdev's server on a temp-dir socket, the independent `vfio_user::Client`
//! as the VMM (DMA maps of memfd guest memory, config space, SET_IRQS, BAR accesses), and
//! the test as the guest driver (`umdev_devices::gpu::driver`). The framebuffer is checked
//! pixel for pixel through the client's mmap of BAR2.

#[path = "common/independent_client.rs"]
mod independent;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use independent::{find_capability, SocketRegs};
use umdev::dma::{DmaConfig, DmaSpace, DmaStats, PinPolicy};
use umdev::pci::PciAdapter;
use umdev::testing::{wait_eventfd, wait_until, GuestMemory, TestServer};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig, GpuHandle, BAR_FB};
use vfio_bindings::bindings::vfio::{VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD};
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const RAM_BASE: u64 = 0x4000_0000;
const RAM_SIZE: usize = 4 << 20;
/// Ring area mapping: [RAM_BASE, SURF_GPA).
const SURF_GPA: u64 = RAM_BASE + 0x10_0000;
const SURF_SIZE: u64 = 0x30_0000;
const RING_SIZE: u32 = 64 * 1024;
const W: u32 = 640;
const H: u32 = 480;
const CONFIG_REGION: u32 = umdev::device::region_index::CONFIG;
const IRQ_MSIX: u32 = umdev::device::irq_index::MSIX;

/// Dropped in field order: the server stops first, with the client still connected.
struct Setup {
    _server: TestServer<PciAdapter<Gpu>>,
    dma: Arc<DmaSpace>,
    gpu: GpuHandle,
    drv: Driver<SocketRegs>,
    ram: GuestMemory,
}

impl Setup {
    fn start(policy: PinPolicy) -> Setup {
        let gpu = Gpu::new(GpuConfig::default()).unwrap();
        let handle = gpu.handle();
        let server = TestServer::builder_pci(gpu)
            .unwrap()
            .dma_config(DmaConfig {
                policy,
                lock_limit_bytes: Some(2 << 20),
                ..DmaConfig::default()
            })
            .start()
            .unwrap();
        let dma = server.dma().clone();
        let mut client = Client::new(server.path()).expect("connect");
        let ram = GuestMemory::new(RAM_BASE, RAM_SIZE).unwrap();
        // Two DMA mappings of one memfd: the ring area and the surfaces.
        client
            .dma_map(0, RAM_BASE, SURF_GPA - RAM_BASE, ram.fd().as_raw_fd())
            .unwrap();
        client
            .dma_map(
                SURF_GPA - RAM_BASE,
                SURF_GPA,
                SURF_SIZE,
                ram.fd().as_raw_fd(),
            )
            .unwrap();
        // Memory space + bus master.
        client
            .region_write(CONFIG_REGION, 4, &0x0006u16.to_le_bytes())
            .unwrap();
        let mut drv = Driver::probe(SocketRegs {
            client,
            whole_64: true,
        })
        .unwrap();
        drv.set_mode(W, H, W * 4).unwrap();
        drv.setup_ring(RAM_BASE, RING_SIZE).unwrap();
        Setup {
            _server: server,
            dma,
            gpu: handle,
            drv,
            ram,
        }
    }

    fn client(&mut self) -> &mut Client {
        &mut self.drv.regs().client
    }

    fn config_read(&mut self, off: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        self.client()
            .region_read(CONFIG_REGION, off, &mut b[..len])
            .unwrap();
        u32::from_le_bytes(b)
    }

    /// Enable MSI-X in config space, unmask vector 0, attach an eventfd to it.
    fn msix_eventfd(&mut self) -> EventFd {
        let cap = find_capability(self.client(), 0x11).unwrap_or(0);
        assert_ne!(cap, 0, "MSI-X capability");
        let ctrl = self.config_read(cap + 2, 2) as u16;
        let ctrl = (ctrl | 0x8000) & !0x4000;
        let c = self.client();
        c.region_write(CONFIG_REGION, cap + 2, &ctrl.to_le_bytes())
            .unwrap();
        let entry = MSIX_TABLE_OFFSET;
        c.region_write(0, entry, &0xfee0_0000u32.to_le_bytes())
            .unwrap();
        c.region_write(0, entry + 8, &0x41u32.to_le_bytes())
            .unwrap();
        c.region_write(0, entry + 12, &0u32.to_le_bytes()).unwrap();
        let efd = EventFd::new(EFD_NONBLOCK).unwrap();
        c.set_irqs(
            IRQ_MSIX,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            1,
            &[efd.as_raw_fd()],
        )
        .unwrap();
        efd
    }

    /// The visible framebuffer, read through the client's mmap of BAR2's region fd.
    fn screen_via_mmap(&mut self) -> Vec<u32> {
        let region = self.client().region(BAR_FB as u32).expect("BAR2");
        assert_ne!(region.flags & umdev::device::REGION_FLAG_MMAP, 0);
        let fo = region.file_offset.as_ref().expect("BAR2 fd");
        let len = (W * H * 4) as usize;
        // SAFETY: a fresh read-only shared mapping of the region fd, unmapped below; read
        // with volatile loads only.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fo.file().as_raw_fd(),
                fo.start() as libc::off_t,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let words = p as *const u32;
        // SAFETY: `i < len / 4`, inside the mapping; volatile because another party writes it.
        let out = (0..len / 4)
            .map(|i| unsafe { words.add(i).read_volatile() })
            .collect();
        // SAFETY: exactly the mapping created above.
        unsafe { libc::munmap(p, len) };
        out
    }

    fn stats(&self) -> DmaStats {
        self.dma.stats()
    }
}

fn pattern(x: u32, y: u32) -> u32 {
    (x.wrapping_mul(2654435761) ^ y.wrapping_mul(40503)) & 0x00ff_ffff
}

/// Draw fills, overlapping copies and a blit from a scattered GTT surface; returns the
/// expected screen.
fn draw_scene(s: &mut Setup) -> Vec<u32> {
    let mut model = vec![0u32; (W * H) as usize];
    let fill = |m: &mut Vec<u32>, x: u32, y: u32, w: u32, h: u32, c: u32| {
        for yy in y..y + h {
            for xx in x..x + w {
                m[(yy * W + xx) as usize] = c;
            }
        }
    };
    // Surface 120×90, stride 480 bytes → 43,200 bytes = 11 pages, scattered.
    let (sw, sh, stride) = (120u32, 90u32, 480u32);
    let pages: Vec<u64> = (0..11u64)
        .map(|k| SURF_GPA + ((k * 5) % 11) * 3 * 4096)
        .collect();
    for y in 0..sh {
        for x in 0..sw {
            let o = u64::from(y * stride + x * 4);
            let gpa = pages[(o / 4096) as usize] + o % 4096;
            s.ram.write(gpa, &pattern(x, y).to_le_bytes()).unwrap();
        }
    }
    for (i, &p) in pages.iter().enumerate() {
        s.drv.set_gtt(40 + i as u32, p, false).unwrap();
    }
    let cmds = [
        Command::FillRect {
            x: 0,
            y: 0,
            w: W,
            h: H,
            color: 0x10_2030,
        },
        Command::FillRect {
            x: 50,
            y: 40,
            w: 200,
            h: 100,
            color: 0xff_8000,
        },
        Command::CopyRect {
            src_x: 50,
            src_y: 40,
            dst_x: 120,
            dst_y: 90,
            w: 200,
            h: 100,
        },
        Command::Blit {
            gtt_index: 40,
            stride,
            w: sw,
            h: sh,
            dst_x: 400,
            dst_y: 300,
        },
        Command::CopyRect {
            src_x: 400,
            src_y: 300,
            dst_x: 380,
            dst_y: 290,
            w: sw,
            h: sh,
        },
        Command::Fence { value: 1 },
    ];
    fill(&mut model, 0, 0, W, H, 0x10_2030);
    fill(&mut model, 50, 40, 200, 100, 0xff_8000);
    let snapshot = model.clone();
    for y in 0..100 {
        for x in 0..200 {
            model[((90 + y) * W + 120 + x) as usize] = snapshot[((40 + y) * W + 50 + x) as usize];
        }
    }
    for y in 0..sh {
        for x in 0..sw {
            model[((300 + y) * W + 400 + x) as usize] = pattern(x, y);
        }
    }
    let snapshot = model.clone();
    for y in 0..sh {
        for x in 0..sw {
            model[((290 + y) * W + 380 + x) as usize] =
                snapshot[((300 + y) * W + 400 + x) as usize];
        }
    }
    s.drv.submit(&mut s.ram, &cmds).unwrap();
    s.drv.wait_fence(1).unwrap();
    model
}

#[test]
fn test_gpu_e2e_scene_matches_pixels_and_msix_fires() {
    let mut s = Setup::start(PinPolicy::Lock);
    let efd = s.msix_eventfd();
    s.drv.enable_irqs(IRQ_FENCE | IRQ_ERROR).unwrap();
    let model = draw_scene(&mut s);
    assert!(
        wait_eventfd(&efd, Duration::from_secs(5)).is_some(),
        "MSI-X eventfd"
    );
    assert_eq!(s.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    let screen = s.screen_via_mmap();
    if let Some(i) = screen.iter().zip(&model).position(|(a, b)| a != b) {
        panic!(
            "pixel ({},{}) is {:#08x}, expected {:#08x}",
            i as u32 % W,
            i as u32 / W,
            screen[i],
            model[i]
        );
    }
    assert_eq!(s.gpu.pins_held(), 11);
    assert_eq!(s.stats().locked_pages, 11);
    // DMA_UNMAP of the surfaces: the device drops its pins in the notifier.
    s.client().dma_unmap(SURF_GPA, SURF_SIZE).unwrap();
    assert_eq!(s.gpu.pins_held(), 0);
    let st = s.stats();
    assert_eq!((st.pinned_pages, st.locked_pages), (0, 0));
    assert_eq!(st.leaked_pins_released, 0);
}

#[test]
fn test_gpu_e2e_bad_blit_reports_error_and_msix_fires() {
    let mut s = Setup::start(PinPolicy::Translate);
    let efd = s.msix_eventfd();
    s.drv.enable_irqs(IRQ_ERROR).unwrap();
    s.drv.set_gtt(0, 0x7000_0000, false).unwrap(); // not DMA-mapped
    s.drv
        .submit(
            &mut s.ram,
            &[
                Command::Blit {
                    gtt_index: 0,
                    stride: 64,
                    w: 16,
                    h: 16,
                    dst_x: 0,
                    dst_y: 0,
                },
                Command::Fence { value: 2 },
            ],
        )
        .unwrap();
    s.drv.wait_fence(2).unwrap();
    assert!(
        wait_eventfd(&efd, Duration::from_secs(5)).is_some(),
        "error IRQ"
    );
    assert_eq!(
        s.drv.error().unwrap(),
        (umdev_devices::gpu::error::ERR_GTT_FAULT, 0)
    );
    assert_eq!(s.stats().pinned_pages, 0);
}

#[test]
fn test_gpu_e2e_disconnect_releases_every_pin() {
    let mut s = Setup::start(PinPolicy::Lock);
    draw_scene(&mut s);
    assert!(s.stats().locked_pages > 0);
    s.client().shutdown().unwrap();
    let dma = s.dma.clone();
    let gpu = s.gpu.clone();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let st = dma.stats();
            gpu.pins_held() == 0 && st.pinned_pages == 0 && st.locked_pages == 0
        }),
        "timed out waiting for pins released after disconnect"
    );
    assert_eq!(dma.stats().leaked_pins_released, 0);
}

#[test]
fn test_gpu_e2e_device_reset_releases_pins_and_clears_registers() {
    let mut s = Setup::start(PinPolicy::Lock);
    draw_scene(&mut s);
    assert_eq!(s.gpu.pins_held(), 11);
    s.client().reset().unwrap();
    assert_eq!(s.gpu.pins_held(), 0);
    let st = s.stats();
    assert_eq!((st.pinned_pages, st.locked_pages), (0, 0));
    assert_eq!(s.drv.read(REG_MODE_CTRL).unwrap(), 0);
    assert_eq!(s.drv.read(REG_RING_CTRL).unwrap(), 0);
    assert_eq!(s.drv.read(GTT_BASE + 40 * 8).unwrap(), 0);
    // The guest driver re-initialises (reset cleared the command register: memory space and
    // Bus Master first, as a driver's probe does) and the device serves again.
    s.client()
        .region_write(CONFIG_REGION, 4, &0x0006u16.to_le_bytes())
        .unwrap();
    s.drv.set_mode(W, H, W * 4).unwrap();
    s.drv.setup_ring(RAM_BASE, RING_SIZE).unwrap();
    let model = draw_scene(&mut s);
    assert_eq!(s.screen_via_mmap(), model);
}

#[test]
fn test_gpu_e2e_fence_fires_intx_without_msi() {
    let mut s = Setup::start(PinPolicy::Translate);
    let efd = EventFd::new(EFD_NONBLOCK).unwrap();
    s.client()
        .set_irqs(
            0, // INTx
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            1,
            &[efd.as_raw_fd()],
        )
        .unwrap();
    s.drv.enable_irqs(IRQ_FENCE).unwrap();
    s.drv
        .submit(&mut s.ram, &[Command::Fence { value: 0x1f }])
        .unwrap();
    s.drv.wait_fence(0x1f).unwrap();
    assert!(
        wait_eventfd(&efd, Duration::from_secs(5)).is_some(),
        "INTx eventfd"
    );
    assert_eq!(s.drv.read(REG_IRQ_STATUS).unwrap(), IRQ_FENCE);
    s.drv.ack(IRQ_FENCE).unwrap();
    assert_eq!(s.drv.read(REG_IRQ_STATUS).unwrap(), 0);
}
