//! The GPU through a real socket when the VMM unmaps guest memory with a sweep (QEMU's vIOMMU
//! replay: one DMA_UNMAP over several maps and empty space, here up to 2^64) while GTT entries
//! hold pins in it. The GPU's notifier must drop those pins before the reply, the next
//! command that uses the entries must fail with GTT_FAULT (protocol-docs/devices/gpu.md),
//! and once the VMM maps new memory at the same IOVAs the device must write into the new
//! memory, never into the old (which by then may belong to someone else). With the old
//! exact-match rule the sweep was refused, the pins and maps stayed, and a READBACK landed in
//! the old memory while the new DMA_MAP failed with EEXIST.

mod gpu_common;

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use gpu_common::{pattern, write_surface, RAM_BASE, RAM_SIZE, RING_GPA, RING_SIZE, SURFACE_GPA};
use umdev::device::region_index;
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy};
use umdev::pci::PciAdapter;
use umdev::protocol::dma_map::DmaUnmapRequest;
use umdev::protocol::Command as Cmd;
use umdev::testing::{DeviceAccess, GuestMemory, RawClient, TestServer, Vmm};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::error::*;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};
use umdev_devices::testing::Bar0;

/// The surface area is mapped as two 1 MiB maps (as a vIOMMU guest maps it piecewise).
const SURF_MAP: u64 = 0x10_0000;
/// Surface: 16×8 pixels, one row per page, so it spans 8 GTT entries.
const SW: u32 = 16;
const SH: u32 = 8;
const STRIDE: u32 = 4096;

struct Vm {
    drv: Driver<Bar0<Vmm>>,
    dma: Arc<DmaSpace>,
    ram: GuestMemory,
    fence: u32,
    _server: TestServer<PciAdapter<Gpu>>,
}

impl Vm {
    fn new() -> Vm {
        let server = TestServer::builder_pci(Gpu::new(GpuConfig::default()).unwrap())
            .unwrap()
            .dma_config(DmaConfig {
                policy: PinPolicy::Lock,
                lock_limit_bytes: Some(2 << 20),
                ..DmaConfig::default()
            })
            .start()
            .unwrap();
        let dma = server.dma().clone();
        let mut vmm = server.connect().unwrap();
        // Memory decoding and bus mastering, as the guest enables them.
        vmm.write16(region_index::CONFIG, 4, 6).unwrap();
        let ram = GuestMemory::new(RAM_BASE, RAM_SIZE).unwrap();
        let fd = ram.fd();
        map(&mut vmm, RAM_BASE, SURFACE_GPA - RAM_BASE, 0, fd);
        for k in 0..2 {
            let iova = SURFACE_GPA + k * SURF_MAP;
            map(&mut vmm, iova, SURF_MAP, iova - RAM_BASE, fd);
        }
        let mut drv = Driver::probe(Bar0(vmm)).unwrap();
        drv.set_mode(gpu_common::W, gpu_common::H, gpu_common::W * 4)
            .unwrap();
        drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
        Vm {
            drv,
            dma,
            ram,
            fence: 0,
            _server: server,
        }
    }

    fn client(&mut self) -> &mut RawClient {
        self.drv.regs().0.client()
    }

    /// Submit `cmds` and a fence, wait for it; `(ERROR_CODE, ERROR_COUNT)` after, error acked.
    fn run(&mut self, cmds: &[Command]) -> (u32, u32) {
        self.fence += 1;
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: self.fence });
        self.drv.submit(&mut self.ram, &all).unwrap();
        self.drv.wait_fence(self.fence).unwrap();
        let code = self.drv.read(REG_ERROR_CODE).unwrap();
        let count = self.drv.read(REG_ERROR_COUNT).unwrap();
        self.drv.ack(IRQ_ERROR).unwrap();
        (code, count)
    }
}

fn map(vmm: &mut Vmm, iova: u64, size: u64, offset: u64, fd: BorrowedFd<'_>) {
    vmm.dma_map_fd(iova, size, fd, offset)
        .unwrap_or_else(|e| panic!("DMA_MAP {iova:#x}+{size:#x}: {e}"));
}

fn blit() -> Command {
    Command::Blit {
        gtt_index: 0,
        stride: STRIDE,
        w: SW,
        h: SH,
        dst_x: 0,
        dst_y: 0,
    }
}

fn readback() -> Command {
    Command::Readback {
        src_x: 0,
        src_y: 0,
        w: SW,
        h: SH,
        gtt_index: 0,
        stride: STRIDE,
    }
}

/// The first `SW` pixels of each surface row in `mem`.
fn surface_rows(mem: &GuestMemory, pages: &[u64]) -> Vec<Vec<u8>> {
    pages
        .iter()
        .map(|&p| {
            let mut row = vec![0u8; SW as usize * 4];
            mem.read(p, &mut row).unwrap();
            row
        })
        .collect()
}

#[test]
fn test_gpu_sweep_to_2_pow_64_drops_gtt_pins_faults_then_new_memory_gets_readback() {
    let mut vm = Vm::new();
    // Eight GTT entries, four in each surface map, writable (READBACK needs it).
    let pages: Vec<u64> = (0..u64::from(SH))
        .map(|i| SURFACE_GPA + (i % 2) * SURF_MAP + (i / 2) * 0x2_0000)
        .collect();
    for (i, &p) in pages.iter().enumerate() {
        vm.drv.set_gtt(i as u32, p, true).unwrap();
    }
    write_surface(&vm.ram, &pages, STRIDE, SW, SH);
    assert_eq!(vm.run(&[blit()]), (ERR_NONE, 0));
    assert_eq!(
        vm.dma.stats().pinned_pages,
        8,
        "the BLIT pinned its entries"
    );
    let old = surface_rows(&vm.ram, &pages);
    assert_eq!(&old[1][..4], &pattern(0, 1).to_le_bytes());

    // The sweep: from the surface maps to 2^64, covering both maps and empty space.
    let size = 0u64.wrapping_sub(SURFACE_GPA);
    let p = DmaUnmapRequest {
        argsz: 24,
        all: false,
        iova: SURFACE_GPA,
        size,
    }
    .encode();
    let r = vm.client().call(Cmd::DmaUnmap as u16, 0, &p, &[]);
    assert!(!r.header.is_error(), "sweep: errno {}", r.header.error);
    assert_eq!(
        r.payload[16..],
        (2 * SURF_MAP).to_ne_bytes(),
        "bytes removed"
    );
    let st = vm.dma.stats();
    assert_eq!(st.maps, 1, "only the ring map is left");
    assert_eq!(st.pinned_pages, 0, "the GPU's notifier kept pins: {st:?}");
    assert_eq!(st.locked_pages, 0, "{st:?}");
    assert_eq!(
        st.leaked_pins_released, 0,
        "pins forced, not dropped: {st:?}"
    );

    // The entries still point at the unmapped pages: both directions fault.
    assert_eq!(vm.run(&[readback()]), (ERR_GTT_FAULT, 1));
    assert_eq!(vm.run(&[blit()]), (ERR_GTT_FAULT, 2));
    assert_eq!(vm.dma.stats().pinned_pages, 0);

    // The VMM maps new memory at the same IOVAs (the rebooted guest's DMA_MAP).
    let new = GuestMemory::new(SURFACE_GPA, 2 * SURF_MAP as usize).unwrap();
    new.fill(SURFACE_GPA, 2 * SURF_MAP as usize, 0xee).unwrap();
    map(&mut vm.drv.regs().0, SURFACE_GPA, 2 * SURF_MAP, 0, new.fd());
    let color = 0x0012_3456;
    let fill = Command::FillRect {
        x: 0,
        y: 0,
        w: SW,
        h: SH,
        color,
    };
    assert_eq!(vm.run(&[fill, readback()]), (ERR_NONE, 2));
    let want: Vec<u8> = (0..SW).flat_map(|_| color.to_le_bytes()).collect();
    for (i, row) in surface_rows(&new, &pages).iter().enumerate() {
        assert_eq!(row, &want, "row {i} of the new memory");
    }
    assert_eq!(
        surface_rows(&vm.ram, &pages),
        old,
        "the device wrote into the old memory"
    );
    // Releasing the entries leaves nothing pinned.
    vm.drv.clear_gtt(0, SH).unwrap();
    assert_eq!(vm.dma.stats().pinned_pages, 0);
    vm.dma.check_invariants().unwrap();
}
