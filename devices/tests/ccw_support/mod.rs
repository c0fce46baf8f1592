//! What the ccw device-level tests share beyond umdev's harness: a `PciAdapter<Ccw>` driven
//! in-process (no socket), a real `DmaSpace` with the test layout of guest memory (RAM and a
//! read-only window), and the test acting as guest driver (guest memory through
//! `GuestMemory`, registers through `region_write`).
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use umdev::device::{irq_index, region_index, Device};
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy, Prot};
use umdev::pci::PciAdapter;
use umdev::testing::{wait_eventfd, DeviceAccess, GuestMemory};
use umdev_devices::ccw::driver::{self, regs, CcwWord, OperationBlock, StatusBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use umdev::testing::Rng;

/// IOVA of the read/write guest RAM.
pub const RAM: u64 = 0x10_0000;
/// Size of the read/write guest RAM.
pub const RAM_SIZE: u64 = 2 << 20;
/// IOVA of a read-only mapping (device may read, not write).
pub const ROM: u64 = 0x80_0000;
/// Size of the read-only mapping.
pub const ROM_SIZE: u64 = 64 << 10;
/// An IOVA nothing is mapped at.
pub const HOLE: u64 = 0x60_0000;

/// Fixed guest layout inside RAM.
pub const OPB: u64 = RAM;
/// Status block.
pub const STATUS: u64 = RAM + 0x100;
/// Sense buffer.
pub const SENSE_BUF: u64 = RAM + 0x200;
/// Channel program area (4 KiB).
pub const PROGRAM: u64 = RAM + 0x1000;
/// IDAW list area (8 KiB).
pub const IDAWS: u64 = RAM + 0x2000;
/// First data page (the rest of RAM).
pub const DATA: u64 = RAM + 0x10000;

/// Image capacity used by the rig (blocks).
pub const CAPACITY_BLOCKS: u64 = 32768;

/// The generator the ccw tests use for `seed`: umdev's xorshift64* from state `seed | 1`.
pub fn seeded(seed: u64) -> Rng {
    Rng::from_state(seed | 1)
}

/// The rig.
pub struct Rig {
    /// DMA space.
    pub space: Arc<DmaSpace>,
    /// The device under test.
    pub dev: PciAdapter<Ccw>,
    /// Guest RAM (the guest's view).
    pub ram: GuestMemory,
    /// Read-only mapping's backing.
    pub rom: GuestMemory,
    /// MSI eventfd.
    pub msi: EventFd,
    /// Image path.
    pub image: PathBuf,
    /// Keeps the temp dir alive.
    pub dir: tempfile::TempDir,
}

/// Options of [`Rig::with`].
#[derive(Clone, Copy, Debug)]
pub struct RigOptions {
    /// Pin policy.
    pub policy: PinPolicy,
    /// Lock limit.
    pub lock_limit: Option<u64>,
    /// Use INTx instead of MSI.
    pub intx: bool,
}

impl Default for RigOptions {
    fn default() -> Self {
        RigOptions {
            policy: PinPolicy::Translate,
            lock_limit: None,
            intx: false,
        }
    }
}

impl Rig {
    /// Default rig: Translate policy, MSI.
    pub fn new() -> Rig {
        Rig::with(RigOptions::default())
    }

    /// Rig with options.
    pub fn with(opts: RigOptions) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("ccw.img");
        Rig::with_image(opts, dir, image)
    }

    /// Rig on an existing image path (a new device on the same image).
    pub fn with_image(opts: RigOptions, dir: tempfile::TempDir, image: PathBuf) -> Rig {
        let space = DmaSpace::new(DmaConfig {
            policy: opts.policy,
            lock_limit_bytes: opts.lock_limit,
            ..DmaConfig::default()
        });
        let ccw = Ccw::new(CcwConfig::new(&image).with_capacity(CAPACITY_BLOCKS)).unwrap();
        let mut dev = PciAdapter::new(ccw).unwrap();
        dev.attach(space.handle());

        let ram = GuestMemory::new(RAM, RAM_SIZE as usize).unwrap();
        let rom = GuestMemory::new(ROM, ROM_SIZE as usize).unwrap();
        space
            .map(ram.dma_mapping(RAM, RAM_SIZE, Prot::RW).unwrap())
            .unwrap();
        space
            .map(rom.dma_mapping(ROM, ROM_SIZE, Prot::READ).unwrap())
            .unwrap();

        // Replaced by `enable_irq` below.
        let msi = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut rig = Rig {
            space,
            dev,
            ram,
            rom,
            msi,
            image,
            dir,
        };
        rig.enable_irq(opts.intx);
        rig
    }

    /// Enable memory space, bus mastering and MSI (or INTx), and attach a fresh eventfd.
    pub fn enable_irq(&mut self, intx: bool) {
        self.dev.enable_device().unwrap();
        self.msi = if intx {
            self.dev.attach_eventfd(irq_index::INTX)
        } else {
            self.dev.enable_msi()
        }
        .unwrap();
    }

    /// Offset of the capability with `id` in config space.
    pub fn find_cap(&mut self, id: u8) -> Option<u64> {
        self.dev.find_capability(id).unwrap()
    }

    /// Map the RAM window again (after a test unmapped it).
    pub fn remap_ram(&self) {
        self.space
            .map(self.ram.dma_mapping(RAM, RAM_SIZE, Prot::RW).unwrap())
            .unwrap();
    }

    /// Guest memory write (RAM or ROM window).
    pub fn guest_write(&self, iova: u64, data: &[u8]) {
        self.backing(iova, data.len()).write(iova, data).unwrap();
    }

    /// Guest memory read.
    pub fn guest_read(&self, iova: u64, len: usize) -> Vec<u8> {
        self.backing(iova, len).read_vec(iova, len).unwrap()
    }

    fn backing(&self, iova: u64, len: usize) -> &GuestMemory {
        let end = iova + len as u64;
        if iova >= RAM && end <= RAM + RAM_SIZE {
            &self.ram
        } else if iova >= ROM && end <= ROM + ROM_SIZE {
            &self.rom
        } else {
            panic!("guest access outside test memory: {iova:#x}+{len}");
        }
    }

    /// 32-bit register read.
    pub fn reg(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev
            .region_read(region_index::BAR0, off, &mut b)
            .unwrap();
        u32::from_le_bytes(b)
    }

    /// 32-bit register write.
    pub fn set_reg(&mut self, off: u64, v: u32) {
        self.dev
            .region_write(region_index::BAR0, off, &v.to_le_bytes())
            .unwrap();
    }

    /// Wait for the interrupt eventfd (true if it fired within `timeout`).
    pub fn wait_irq(&self, timeout: Duration) -> bool {
        wait_eventfd(&self.msi, timeout).is_some()
    }

    /// Write the operation block at `opb` and START; wait for the interrupt; ack it.
    /// Returns the IRQ_STATUS seen before the ack.
    pub fn submit_at(&mut self, opb_addr: u64) -> u32 {
        self.set_reg(regs::OPB_ADDR_LO, opb_addr as u32);
        self.set_reg(regs::OPB_ADDR_HI, (opb_addr >> 32) as u32);
        self.set_reg(regs::START, 1);
        assert!(
            self.wait_irq(Duration::from_secs(5)),
            "no interrupt after START"
        );
        let irq = self.reg(regs::IRQ_STATUS);
        self.set_reg(regs::IRQ_STATUS, irq);
        assert_eq!(self.reg(regs::STATUS) & regs::STATUS_BUSY, 0);
        irq
    }

    /// Run `program` (placed at PROGRAM) at `block`; returns the status block.
    pub fn run(&mut self, program: &[CcwWord], block: u64) -> StatusBlock {
        self.run_opb(
            program,
            OperationBlock {
                program: PROGRAM,
                block,
                status: STATUS,
                flags: 0,
                reserved: 0,
            },
        )
    }

    /// Run `program` (placed at PROGRAM) with an explicit operation block.
    pub fn run_opb(&mut self, program: &[CcwWord], opb: OperationBlock) -> StatusBlock {
        self.guest_write(PROGRAM, &driver::encode_program(program));
        self.guest_write(OPB, &opb.to_bytes());
        self.guest_write(STATUS, &[0xee; 32]);
        let irq = self.submit_at(OPB);
        assert_eq!(irq, regs::IRQ_DONE, "status block should be stored");
        self.status()
    }

    /// The stored status block.
    pub fn status(&self) -> StatusBlock {
        let b = self.guest_read(STATUS, 32);
        StatusBlock::from_bytes(&b.try_into().unwrap())
    }

    /// Assert the device and the DMA space hold no pins.
    pub fn assert_no_pins(&self) {
        assert_eq!(self.dev.device().pins_held(), 0, "device holds pins");
        let st = self.space.stats();
        assert_eq!(st.pinned_pages, 0, "DMA space has pinned pages");
        assert_eq!(st.locked_pages, 0, "DMA space has locked pages");
    }

    /// Image bytes at `offset`.
    pub fn image_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let f = File::open(&self.image).unwrap();
        let mut v = vec![0u8; len];
        f.read_exact_at(&mut v, offset).unwrap();
        v
    }
}

impl Default for Rig {
    fn default() -> Self {
        Rig::new()
    }
}
