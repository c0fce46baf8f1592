//! What the GPU device-level tests share beyond umdev's harness: a `PciAdapter<Gpu>` driven
//! in-process (no socket) by the reference guest driver, a real `DmaSpace` with the test
//! layout of guest memory, and a reference model of the drawing commands.
#![allow(dead_code)]

use std::sync::Arc;

use umdev::device::{region_index, Device, IrqAction, IrqData, SetIrqs};
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy, Prot};
use umdev::pci::PciAdapter;
use umdev::testing::{DeviceAccess, GuestMemory};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};
use umdev_devices::testing::Bar0;
use vmm_sys_util::eventfd::EventFd;

/// Guest address of the guest RAM.
pub const RAM_BASE: u64 = 0x1000_0000;
/// Guest RAM size.
pub const RAM_SIZE: usize = 4 << 20;
/// Ring location and size.
pub const RING_GPA: u64 = RAM_BASE;
/// Ring size.
pub const RING_SIZE: u32 = 64 * 1024;
/// First guest page usable for surfaces (a separate DMA mapping, read-write).
pub const SURFACE_GPA: u64 = RAM_BASE + 0x10_0000;
/// Size of the surface mapping.
pub const SURFACE_SIZE: u64 = 0x20_0000;
/// A DMA mapping the device may only read.
pub const RO_GPA: u64 = RAM_BASE + 0x30_0000;
/// A guest address nothing maps.
pub const UNMAPPED_GPA: u64 = 0x2000_0000;
/// The test mode.
pub const W: u32 = 320;
/// The test mode.
pub const H: u32 = 240;

/// Everything a test needs.
pub struct Rig {
    pub drv: Driver<Bar0<PciAdapter<Gpu>>>,
    pub space: Arc<DmaSpace>,
    pub ram: GuestMemory,
}

impl Rig {
    /// A GPU with the given pin policy, attached to a DMA space with the guest RAM mapped
    /// read-write, the test mode set and the ring enabled.
    pub fn new(policy: PinPolicy) -> Rig {
        let space = DmaSpace::new(DmaConfig {
            policy,
            lock_limit_bytes: Some(2 << 20),
            ..DmaConfig::default()
        });
        let ram = GuestMemory::new(RAM_BASE, RAM_SIZE).unwrap();
        // Three mappings of one memfd: ring area, surfaces (RW), read-only area.
        for (iova, size, prot) in [
            (RAM_BASE, SURFACE_GPA - RAM_BASE, Prot::RW),
            (SURFACE_GPA, SURFACE_SIZE, Prot::RW),
            (RO_GPA, RAM_BASE + RAM_SIZE as u64 - RO_GPA, Prot::READ),
        ] {
            space
                .map(ram.dma_mapping(iova, size, prot).unwrap())
                .unwrap();
        }
        let mut adapter = PciAdapter::new(Gpu::new(GpuConfig::default()).unwrap()).unwrap();
        Device::attach(&mut adapter, space.handle());
        // Memory space + bus master.
        adapter
            .region_write(region_index::CONFIG, 4, &0x0006u16.to_le_bytes())
            .unwrap();
        let mut drv = Driver::probe(Bar0(adapter)).unwrap();
        drv.set_mode(W, H, W * 4).unwrap();
        drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
        Rig { drv, space, ram }
    }

    /// Memory space + Bus Master in the command register, as a guest driver does at probe
    /// and again after a reset (which clears it; without it every ring fetch is refused).
    pub fn enable_device(&mut self) {
        self.config_write(4, &0x0006u16.to_le_bytes());
    }

    pub fn adapter(&mut self) -> &mut PciAdapter<Gpu> {
        &mut self.drv.regs().0
    }

    pub fn gpu(&mut self) -> &Gpu {
        self.drv.regs().0.device()
    }

    /// Submit and wait until executed.
    pub fn run(&mut self, cmds: &[Command]) {
        self.drv.submit(&mut self.ram, cmds).unwrap();
        self.drv.wait_idle().unwrap();
    }

    /// Submit `cmds` followed by FENCE(fence) and wait for the fence value.
    pub fn run_fenced(&mut self, cmds: &[Command], fence: u32) {
        let current = self.drv.read(REG_FENCE_VALUE).unwrap();
        assert_ne!(
            current, fence,
            "test bug: fence value reused, the wait would not wait"
        );
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: fence });
        self.drv.submit(&mut self.ram, &all).unwrap();
        self.drv.wait_fence(fence).unwrap();
    }

    /// Read the visible framebuffer of the test mode.
    pub fn screen(&mut self) -> Vec<u32> {
        let gpu = self.gpu();
        let mode = gpu.mode();
        let mut out = Vec::with_capacity((mode.width * mode.height) as usize);
        let mut row = vec![0u8; mode.width as usize * 4];
        for y in 0..mode.height as usize {
            assert!(gpu.framebuffer().read(y * mode.stride as usize, &mut row));
            out.extend(
                row.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        out
    }

    /// Attach an eventfd to vector 0 of `index` (INTX / MSI / MSIX).
    pub fn irq_eventfd(&mut self, index: u32) -> EventFd {
        self.adapter().attach_eventfd(index).unwrap()
    }

    pub fn config_read(&mut self, off: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        self.adapter()
            .region_read(region_index::CONFIG, off, &mut b[..len])
            .unwrap();
        u32::from_le_bytes(b)
    }

    pub fn config_write(&mut self, off: u64, data: &[u8]) {
        self.adapter()
            .region_write(region_index::CONFIG, off, data)
            .unwrap();
    }

    /// Enable MSI-X in config space and unmask vector 0 in the table; the eventfd of vector 0.
    pub fn enable_msix(&mut self) -> EventFd {
        self.adapter().enable_msix().unwrap()
    }

    /// Enable MSI (1 vector) in config space; the eventfd of vector 0.
    pub fn enable_msi(&mut self) -> EventFd {
        self.adapter().enable_msi().unwrap()
    }

    /// Unmap the surface mapping through the device's notifier (as the server does).
    pub fn unmap_surfaces(&mut self) -> umdev::dma::UnmapReport {
        let space = self.space.clone();
        let adapter = self.adapter();
        space
            .unmap(SURFACE_GPA, SURFACE_SIZE, &mut |iova, size| {
                adapter.dma_unmap(iova, size)
            })
            .unwrap()
    }

    /// Point GTT entries `start..` at `pages`.
    pub fn map_gtt(&mut self, start: u32, pages: &[u64], writable: bool) {
        for (i, &p) in pages.iter().enumerate() {
            self.drv.set_gtt(start + i as u32, p, writable).unwrap();
        }
    }

    /// Tear-down check: invalidate the GTT, then no pin and no locked page may remain.
    pub fn assert_no_pins_after_gtt_clear(&mut self) {
        self.drv.clear_gtt(0, GTT_ENTRIES).unwrap();
        assert_eq!(self.gpu().pins_held(), 0);
        let stats = self.space.stats();
        assert_eq!(stats.pinned_pages, 0, "{stats:?}");
        assert_eq!(stats.locked_pages, 0, "{stats:?}");
        self.space.check_invariants().unwrap();
    }

    /// SET_IRQS unmask (no data) of vector 0 of `index`.
    pub fn unmask(&mut self, index: u32) {
        self.adapter()
            .set_irqs(SetIrqs {
                index,
                start: 0,
                count: 1,
                action: IrqAction::Unmask,
                data: IrqData::None,
            })
            .unwrap();
    }

    /// `(ERROR_CODE, ERROR_INFO)` then ack the error.
    pub fn take_error(&mut self) -> (u32, u32) {
        let e = self.drv.error().unwrap();
        self.drv.ack(IRQ_ERROR).unwrap();
        e
    }
}

/// True if `efd` fired within `timeout`.
pub fn wait_eventfd(efd: &EventFd, timeout: std::time::Duration) -> bool {
    umdev::testing::wait_eventfd(efd, timeout).is_some()
}

/// Surface pixel pattern.
pub fn pattern(x: u32, y: u32) -> u32 {
    (x.wrapping_mul(2654435761) ^ y.wrapping_mul(40503)) & 0x00ff_ffff
}

/// Write a `w`×`h` surface with rows `stride` apart into the guest pages `pages` (the GTT
/// order), i.e. surface byte `o` lives at `pages[o / 4096] + o % 4096`.
pub fn write_surface(ram: &GuestMemory, pages: &[u64], stride: u32, w: u32, h: u32) {
    for y in 0..h {
        for x in 0..w {
            let o = u64::from(y) * u64::from(stride) + u64::from(x) * 4;
            let gpa = pages[(o / 4096) as usize] + o % 4096;
            ram.write(gpa, &pattern(x, y).to_le_bytes()).unwrap();
        }
    }
}

/// Reference model of the framebuffer.
pub struct Model {
    pub w: u32,
    pub h: u32,
    pub px: Vec<u32>,
}

impl Model {
    pub fn new(w: u32, h: u32) -> Model {
        Model {
            w,
            h,
            px: vec![0; (w * h) as usize],
        }
    }

    pub fn fill(&mut self, x: u32, y: u32, w: u32, h: u32, c: u32) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.px[(yy * self.w + xx) as usize] = c;
            }
        }
    }

    pub fn copy(&mut self, sx: u32, sy: u32, dx: u32, dy: u32, w: u32, h: u32) {
        let src = self.px.clone();
        for yy in 0..h {
            for xx in 0..w {
                self.px[((dy + yy) * self.w + dx + xx) as usize] =
                    src[((sy + yy) * self.w + sx + xx) as usize];
            }
        }
    }

    pub fn blit_pattern(&mut self, w: u32, h: u32, dx: u32, dy: u32) {
        for yy in 0..h {
            for xx in 0..w {
                self.px[((dy + yy) * self.w + dx + xx) as usize] = pattern(xx, yy);
            }
        }
    }
}
