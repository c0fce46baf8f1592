//! Bus Master Enable through a real socket: a guest that clears BME in the command register
//! (as drivers do on unbind, shutdown and kexec, and `uio_pci_generic` when its device file
//! closes) must not have its memory touched. umdev's server serves the example devices, the
//! independent `vfio_user::Client` (or a raw client serving fd-less memory) is the VMM, the
//! test is the guest driver. With BME clear the work fails with the device's documented
//! error and guest memory stays as it was; with BME set again the same work succeeds.

#[path = "common/independent_client.rs"]
mod independent;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use independent::{client_map, enable_device, SocketRegs};
use umdev::device::region_index;
use umdev::pci::PciAdapter;
use umdev::testing::{
    memfd, wait_until, DeviceAccess, FdlessMemory, GuestMemory, RawClient, TestServer, Vmm,
};
use umdev_devices::ccw::driver::{self, cstat, dstat, regs, CcwWord, Fault, OperationBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::error::{ERR_NONE, ERR_RING_FAULT};
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};

/// Command register values a guest writes: memory decoding with and without Bus Master.
const CMD_MEM: u16 = 0x0002;
const CMD_MEM_BME: u16 = 0x0006;

fn set_command(client: &mut vfio_user::Client, cmd: u16) {
    client
        .region_write(region_index::CONFIG, 4, &cmd.to_le_bytes())
        .unwrap();
}

// ---------------------------------------------------------------------------------------
// ccw

const RAM: u64 = 0x10_0000;
const RAM_SIZE: u64 = 1 << 20;
const OPB: u64 = RAM;
const STATUS: u64 = RAM + 0x100;
const PROGRAM: u64 = RAM + 0x1000;
const DATA: u64 = RAM + 0x4000;
const DATA_LEN: usize = 8192;
const BLOCKS: u64 = 64;

struct CcwVm {
    served: TestServer<PciAdapter<Ccw>>,
    client: vfio_user::Client,
    ram: File,
}

impl CcwVm {
    fn new() -> CcwVm {
        let dir = tempfile::tempdir().unwrap();
        let ccw =
            Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(BLOCKS)).unwrap();
        let served = TestServer::builder_pci(ccw)
            .unwrap()
            .in_dir(dir)
            .start()
            .unwrap();
        let mut client = independent::connect(served.path());
        enable_device(&mut client);
        let ram = memfd(RAM_SIZE).unwrap();
        client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
        CcwVm {
            served,
            client,
            ram,
        }
    }

    fn reg(&mut self, off: u64) -> u32 {
        independent::bar0_read32(&mut self.client, off)
    }

    fn set_reg(&mut self, off: u64, v: u32) {
        independent::bar0_write32(&mut self.client, off, v)
    }

    /// START the operation block at OPB and wait until it completed; returns IRQ_STATUS
    /// (then acknowledged) and LAST_STATUS.
    fn start(&mut self) -> (u32, u32) {
        let done = self.reg(regs::COMPLETED);
        self.set_reg(regs::OPB_ADDR_LO, OPB as u32);
        self.set_reg(regs::OPB_ADDR_HI, 0);
        self.set_reg(regs::START, 1);
        assert!(
            wait_until(Duration::from_secs(5), || self.reg(regs::COMPLETED) != done
                && self.reg(regs::STATUS) & regs::STATUS_BUSY == 0),
            "program never completed"
        );
        let irq = self.reg(regs::IRQ_STATUS);
        self.set_reg(regs::IRQ_STATUS, irq);
        (irq, self.reg(regs::LAST_STATUS))
    }

    fn ram_snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; RAM_SIZE as usize];
        self.ram.read_exact_at(&mut v, 0).unwrap();
        v
    }
}

#[test]
fn test_ccw_socket_bus_master_clear_program_refused_then_runs_when_set() {
    let mut vm = CcwVm::new();
    // Image blocks the program reads, and guest memory it would overwrite.
    let pattern: Vec<u8> = (0..DATA_LEN).map(|i| (i * 37 + 11) as u8).collect();
    let image = vm.served.dir().join("ccw.img");
    let f = File::options().write(true).open(&image).unwrap();
    f.write_all_at(&pattern, 0).unwrap();
    let opb = OperationBlock {
        program: PROGRAM,
        block: 0,
        status: STATUS,
        flags: 0,
        reserved: 0,
    };
    vm.ram.write_all_at(&opb.to_bytes(), OPB - RAM).unwrap();
    let prog = driver::encode_program(&[CcwWord::read(DATA_LEN as u16, DATA)]);
    vm.ram.write_all_at(&prog, PROGRAM - RAM).unwrap();
    vm.ram.write_all_at(&[0xee; 32], STATUS - RAM).unwrap();
    vm.ram.write_all_at(&[0xee; DATA_LEN], DATA - RAM).unwrap();
    let before = vm.ram_snapshot();

    // The guest clears Bus Master (memory decoding stays on), then starts the program.
    set_command(&mut vm.client, CMD_MEM);
    let (irq, last) = vm.start();
    assert_eq!(
        driver::decode_last_status(last),
        (
            dstat::CHANNEL_END | dstat::DEVICE_END,
            cstat::CHANNEL_CONTROL_CHECK,
            Some(Fault::BusMasterOff)
        )
    );
    assert_eq!(
        irq,
        regs::IRQ_DONE | regs::IRQ_STATUS_LOST,
        "no status block can be stored without BME"
    );
    assert!(
        vm.ram_snapshot() == before,
        "guest memory changed while Bus Master was clear"
    );
    assert_eq!(vm.served.device().device().pins_held(), 0);
    vm.served.assert_space_unpinned();

    // Bus Master set again: the very same operation block runs.
    set_command(&mut vm.client, CMD_MEM_BME);
    let (irq, last) = vm.start();
    assert_eq!(irq, regs::IRQ_DONE);
    assert_eq!(driver::decode_last_status(last).2, Some(Fault::None));
    let mut status = [0u8; 32];
    vm.ram.read_exact_at(&mut status, STATUS - RAM).unwrap();
    let status = driver::StatusBlock::from_bytes(&status);
    assert!(status.is_ok(), "{status:?}");
    let mut data = vec![0u8; DATA_LEN];
    vm.ram.read_exact_at(&mut data, DATA - RAM).unwrap();
    assert!(data == pattern, "the READ did not land in guest memory");
    vm.served.assert_space_unpinned();
}

/// fd-less guest memory the raw client serves itself.
const FDLESS: u64 = 0x70_0000;
const FDLESS_SIZE: u64 = 0x1000;

#[test]
fn test_ccw_socket_bus_master_clear_sends_no_dma_read_for_fdless_memory() {
    let dir = tempfile::tempdir().unwrap();
    let ccw = Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(BLOCKS)).unwrap();
    let served = TestServer::builder_pci(ccw)
        .unwrap()
        .in_dir(dir)
        .start()
        .unwrap();
    let c = RawClient::new_default(served.path());
    let mut vmm = Vmm::from_client(c).with_fdless(FdlessMemory::new(FDLESS, FDLESS_SIZE as usize));
    vmm.dma_map_fdless(FDLESS, FDLESS_SIZE).unwrap();
    // Operation block, a NOP program and the status block, all in fd-less memory.
    let opb = OperationBlock {
        program: FDLESS + 0x100,
        block: 0,
        status: FDLESS + 0x200,
        flags: 0,
        reserved: 0,
    };
    vmm.mem_mut()[..32].copy_from_slice(&opb.to_bytes());
    let prog = driver::encode_program(&[CcwWord::nop()]);
    vmm.mem_mut()[0x100..0x100 + prog.len()].copy_from_slice(&prog);
    vmm.mem_mut()[0x200..0x220].fill(0xee);
    let bar = region_index::BAR0;
    let run = |vmm: &mut Vmm| -> (u32, u32) {
        let done = vmm.read32(bar, regs::COMPLETED).unwrap();
        vmm.write32(bar, regs::OPB_ADDR_LO, FDLESS as u32).unwrap();
        vmm.write32(bar, regs::OPB_ADDR_HI, 0).unwrap();
        vmm.write32(bar, regs::START, 1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while vmm.read32(bar, regs::COMPLETED).unwrap() == done
            || vmm.read32(bar, regs::STATUS).unwrap() & regs::STATUS_BUSY != 0
        {
            assert!(Instant::now() < deadline, "program never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        let irq = vmm.read32(bar, regs::IRQ_STATUS).unwrap();
        vmm.write32(bar, regs::IRQ_STATUS, irq).unwrap();
        (irq, vmm.read32(bar, regs::LAST_STATUS).unwrap())
    };

    vmm.write_bytes(region_index::CONFIG, 4, &CMD_MEM.to_le_bytes())
        .unwrap();
    let (irq, last) = run(&mut vmm);
    assert_eq!(
        vmm.requests(),
        0,
        "DMA requests with BME clear: {:?}",
        vmm.log()
    );
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    assert_eq!(
        driver::decode_last_status(last).2,
        Some(Fault::BusMasterOff)
    );
    assert_eq!(
        vmm.mem()[0x200..0x220],
        [0xee; 32],
        "status block untouched"
    );

    vmm.write_bytes(region_index::CONFIG, 4, &CMD_MEM_BME.to_le_bytes())
        .unwrap();
    let (irq, last) = run(&mut vmm);
    assert!(vmm.requests() > 0, "the device never asked the VMM");
    assert_eq!(irq, regs::IRQ_DONE);
    assert_eq!(driver::decode_last_status(last).2, Some(Fault::None));
    assert_ne!(vmm.mem()[0x200..0x220], [0xee; 32], "status block stored");
}

// ---------------------------------------------------------------------------------------
// GPU

const GPU_RAM: u64 = 0x1000_0000;
const GPU_RAM_SIZE: usize = 4 << 20;
const RING_GPA: u64 = GPU_RAM;
const RING_SIZE: u32 = 64 * 1024;
const SURF_GPA: u64 = GPU_RAM + (1 << 20);
const SURF_SIZE: u64 = 2 << 20;
const W: u32 = 64;
const H: u32 = 64;
const READBACK_GTT: u32 = 3;

#[test]
fn test_gpu_socket_bus_master_clear_ring_not_fetched_then_same_work_succeeds() {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let served = TestServer::builder_pci(gpu).unwrap().start().unwrap();
    let mut client = independent::connect(served.path());
    enable_device(&mut client);
    let mut ram = GuestMemory::new(GPU_RAM, GPU_RAM_SIZE).unwrap();
    let fd = ram.fd();
    client_map(&mut client, served.dma(), &fd, 0, RING_GPA, 1 << 20);
    client_map(
        &mut client,
        served.dma(),
        &fd,
        SURF_GPA - GPU_RAM,
        SURF_GPA,
        SURF_SIZE,
    );
    let mut drv = Driver::probe(SocketRegs::new(client)).unwrap();
    drv.set_mode(W, H, W * 4).unwrap();
    drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    drv.enable_irqs(IRQ_ERROR).unwrap();
    // READBACK writes the framebuffer into this guest page: if it ran, memory would change.
    let page = SURF_GPA;
    ram.fill(page, 4096, 0xee).unwrap();
    drv.set_gtt(READBACK_GTT, page, true).unwrap();
    let color = 0x0012_3456;
    let work = [
        Command::FillRect {
            x: 0,
            y: 0,
            w: 4,
            h: 4,
            color,
        },
        Command::Readback {
            src_x: 0,
            src_y: 0,
            w: 4,
            h: 1,
            gtt_index: READBACK_GTT,
            stride: 4096,
        },
        Command::Fence { value: 1 },
    ];
    let guest_page = |ram: &GuestMemory| {
        let mut b = vec![0u8; 4096];
        ram.read(page, &mut b).unwrap();
        b
    };

    set_command(&mut drv.regs().client, CMD_MEM);
    let head = drv.read(REG_RING_HEAD).unwrap();
    let ring_before = {
        let mut b = vec![0u8; RING_SIZE as usize];
        ram.read(RING_GPA, &mut b).unwrap();
        b
    };
    drv.submit(&mut ram, &work).unwrap();
    drv.wait_idle().unwrap();
    assert_eq!(
        drv.error().unwrap(),
        (ERR_RING_FAULT, head),
        "the ring fetch is refused and reported as a ring fault"
    );
    assert_ne!(drv.read(REG_IRQ_STATUS).unwrap() & IRQ_ERROR, 0);
    assert_eq!(drv.read(REG_FENCE_VALUE).unwrap(), 0, "no command ran");
    assert_eq!(
        served.device().device().pixel(0, 0),
        Some(0),
        "FILL did not run"
    );
    assert!(guest_page(&ram) == vec![0xee; 4096], "READBACK did not run");
    // The ring holds exactly what the driver published: the device wrote nothing.
    let mut expected = ring_before;
    let published = Command::encode_bytes(&work);
    expected[head as usize..head as usize + published.len()].copy_from_slice(&published);
    let mut ring_after = vec![0u8; RING_SIZE as usize];
    ram.read(RING_GPA, &mut ring_after).unwrap();
    assert!(ring_after == expected, "ring memory changed");
    assert_eq!(
        served.device().device().pins_held(),
        0,
        "nothing was pinned"
    );
    served.assert_space_unpinned();
    drv.ack(IRQ_ALL).unwrap();

    // Bus Master set again: the same commands, published again, run.
    set_command(&mut drv.regs().client, CMD_MEM_BME);
    drv.submit(&mut ram, &work).unwrap();
    drv.wait_fence(1).unwrap();
    drv.wait_idle().unwrap();
    assert_eq!(drv.error().unwrap(), (ERR_NONE, 0), "no new error");
    assert_eq!(drv.read(REG_IRQ_STATUS).unwrap() & IRQ_ERROR, 0);
    assert_eq!(served.device().device().pixel(3, 3), Some(color));
    let got = guest_page(&ram);
    for x in 0..4 {
        assert_eq!(got[x * 4..x * 4 + 4], color.to_le_bytes(), "pixel {x}");
    }
    assert_eq!(got[16..], vec![0xee; 4096 - 16][..]);
    drv.clear_gtt(0, GTT_ENTRIES).unwrap();
    served.assert_space_unpinned();
}
