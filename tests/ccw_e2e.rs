//! ccw end to end through a real vfio-user socket: the independent `vfio_user::Client` is the
//! VMM (DMA_MAP of memfd guest RAM, config space, SET_IRQS with an MSI eventfd, region
//! accesses), the test is the guest driver (channel programs built with
//! `umdev_devices::ccw::driver`), and umdev's server runs `PciAdapter<Ccw>` on an image file.

#[path = "common/independent_client.rs"]
mod independent;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use independent::find_capability;
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy};
use umdev::pci::PciAdapter;
use umdev::testing::{memfd, wait_eventfd, TestServer};
use umdev_devices::ccw::driver::{
    self, cstat, dstat, regs, CcwWord, Fault, OperationBlock, StatusBlock,
};
use umdev_devices::ccw::{Ccw, CcwConfig};
use vfio_bindings::bindings::vfio::{VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD};
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const RAM: u64 = 0x100_0000;
const RAM_SIZE: u64 = 4 << 20;
const HOLE: u64 = 0x4000_0000;
const OPB: u64 = RAM;
const STATUS: u64 = RAM + 0x100;
const PROGRAM: u64 = RAM + 0x1000;
const IDAWS: u64 = RAM + 0x2000;
const DATA: u64 = RAM + 0x10000;
const BLOCKS: u64 = 8192;
const PAGE: u64 = 4096;
const MSI_CAP_ID: u8 = 0x05;
const CONFIG: u32 = umdev::device::region_index::CONFIG;
const MSI_INDEX: u32 = umdev::device::irq_index::MSI;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn shuffled_pages(&mut self, first: u64, n: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).map(|i| first + i * PAGE).collect();
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// One server + client session on `image`.
struct Session {
    server: TestServer<PciAdapter<Ccw>>,
    client: Client,
    space: Arc<DmaSpace>,
    ram: File,
    msi: EventFd,
}

impl Session {
    fn start(image: &Path, policy: PinPolicy) -> Session {
        let ccw = Ccw::new(CcwConfig::new(image).with_capacity(BLOCKS)).unwrap();
        let server = TestServer::builder_pci(ccw)
            .unwrap()
            .dma_config(DmaConfig {
                policy,
                lock_limit_bytes: Some(1 << 20),
                ..DmaConfig::default()
            })
            .start()
            .unwrap();
        let space = server.dma().clone();
        let mut client = Client::new(server.path()).expect("connect");
        let ram = memfd(RAM_SIZE).unwrap();
        client.dma_map(0, RAM, RAM_SIZE, ram.as_raw_fd()).unwrap();

        // Memory + bus master, then MSI enable, then the eventfd.
        client.region_write(CONFIG, 4, &6u16.to_le_bytes()).unwrap();
        let cap = find_capability(&mut client, MSI_CAP_ID).expect("MSI capability");
        let mut ctl = [0u8; 2];
        client.region_read(CONFIG, cap + 2, &mut ctl).unwrap();
        let ctl = u16::from_le_bytes(ctl) | 1;
        client
            .region_write(CONFIG, cap + 2, &ctl.to_le_bytes())
            .unwrap();
        let msi = EventFd::new(EFD_NONBLOCK).unwrap();
        client
            .set_irqs(
                MSI_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                1,
                &[msi.as_raw_fd()],
            )
            .unwrap();
        Session {
            server,
            client,
            space,
            ram,
            msi,
        }
    }

    fn write(&self, iova: u64, data: &[u8]) {
        self.ram.write_all_at(data, iova - RAM).unwrap();
    }

    fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.ram.read_exact_at(&mut v, iova - RAM).unwrap();
        v
    }

    fn reg(&mut self, off: u64) -> u32 {
        independent::bar0_read32(&mut self.client, off)
    }

    fn set_reg(&mut self, off: u64, v: u32) {
        independent::bar0_write32(&mut self.client, off, v)
    }

    fn wait_msi(&self) -> bool {
        wait_eventfd(&self.msi, Duration::from_secs(5)).is_some()
    }

    /// Run a program at `block` with the status block at `status`; returns IRQ_STATUS.
    fn submit(&mut self, program: &[CcwWord], block: u64, status: u64) -> u32 {
        self.write(PROGRAM, &driver::encode_program(program));
        let opb = OperationBlock {
            program: PROGRAM,
            block,
            status,
            flags: 0,
            reserved: 0,
        };
        self.write(OPB, &opb.to_bytes());
        self.set_reg(regs::OPB_ADDR_LO, OPB as u32);
        self.set_reg(regs::OPB_ADDR_HI, (OPB >> 32) as u32);
        self.set_reg(regs::START, 1);
        assert!(self.wait_msi(), "MSI did not fire");
        let irq = self.reg(regs::IRQ_STATUS);
        self.set_reg(regs::IRQ_STATUS, irq);
        irq
    }

    fn run(&mut self, program: &[CcwWord], block: u64) -> StatusBlock {
        self.write(STATUS, &[0xee; 32]);
        let irq = self.submit(program, block, STATUS);
        assert_eq!(irq, regs::IRQ_DONE);
        StatusBlock::from_bytes(&self.read(STATUS, 32).try_into().unwrap())
    }

    fn assert_no_pins(&self) {
        let st = self.space.stats();
        assert_eq!(st.pinned_pages, 0, "pinned pages left");
        assert_eq!(st.locked_pages, 0, "locked pages left");
        assert_eq!(st.leaked_pins_released, 0, "device leaked pins");
    }

    /// Disconnect and stop the server; returns the DMA space for post-mortem checks.
    fn stop(self) -> Arc<DmaSpace> {
        let _ = self.client.shutdown();
        self.server.shutdown().unwrap();
        self.space
    }
}

/// Scatter `data` over the places an IDAW list names.
fn scatter(s: &Session, idaws: &[u64], data: &[u8]) {
    let mut off = 0;
    for (i, &a) in idaws.iter().enumerate() {
        let room = if i == 0 { PAGE - a % PAGE } else { PAGE } as usize;
        let n = room.min(data.len() - off);
        s.write(a, &data[off..off + n]);
        off += n;
    }
}

fn gather(s: &Session, idaws: &[u64], len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, &a) in idaws.iter().enumerate() {
        let room = if i == 0 { PAGE - a % PAGE } else { PAGE } as usize;
        let n = room.min(len - out.len());
        out.extend(s.read(a, n));
    }
    out
}

fn tmp() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    (dir, image)
}

#[test]
fn test_ccw_e2e_contiguous_scattered_mixed_roundtrip_and_persists_across_restart() {
    let (_dir, image) = tmp();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let a = rng.bytes(40000); // direct, contiguous
    let b = rng.bytes(30000); // scattered IDA
    let c = rng.bytes(20000); // mixed: direct data-chained to IDA
    {
        let mut s = Session::start(&image, PinPolicy::Translate);
        // Contiguous.
        s.write(DATA, &a);
        assert!(s.run(&[CcwWord::write(40000, DATA)], 0).is_ok());
        // Scattered.
        let pages = rng.shuffled_pages(DATA + 0x20000, 32);
        let lb = driver::idaws_over_pages(&pages, 0x321, 30000).unwrap();
        scatter(&s, &lb, &b);
        s.write(IDAWS, &driver::encode_idaws(&lb));
        let st = s.run(&[CcwWord::write(30000, IDAWS).ida(lb.len() as u32)], 100);
        assert!(st.is_ok(), "{st:?}");
        // Mixed: 5000 direct + 15000 scattered, one data-chained WRITE.
        let pages = rng.shuffled_pages(DATA + 0x60000, 16);
        let lc = driver::idaws_over_pages(&pages, 0, 15000).unwrap();
        s.write(DATA + 0x50000, &c[..5000]);
        scatter(&s, &lc, &c[5000..]);
        s.write(IDAWS + 0x800, &driver::encode_idaws(&lc));
        let st = s.run(
            &[
                CcwWord::write(5000, DATA + 0x50000).chain_data(),
                CcwWord::write(15000, IDAWS + 0x800).ida(lc.len() as u32),
            ],
            200,
        );
        assert!(st.is_ok(), "{st:?}");
        assert_eq!(st.transferred, 20000);

        // Read everything back within this session, into other places.
        let st = s.run(&[CcwWord::read(40000, DATA + 0x100000)], 0);
        assert!(st.is_ok(), "{st:?}");
        assert_eq!(s.read(DATA + 0x100000, 40000), a);
        s.assert_no_pins();
        s.stop();
    }
    // Restart the server on the same image: the data is there.
    let mut s = Session::start(&image, PinPolicy::Lock);
    let pages = rng.shuffled_pages(DATA + 0x200000, 16);
    let rb = driver::idaws_over_pages(&pages, 0x10, 30000).unwrap();
    s.write(IDAWS, &driver::encode_idaws(&rb));
    let st = s.run(&[CcwWord::read(30000, IDAWS).ida(rb.len() as u32)], 100);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(gather(&s, &rb, 30000), b);
    let st = s.run(
        &[
            CcwWord::nop().chain(),
            CcwWord::read(20000, DATA + 0x300000),
        ],
        200,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(s.read(DATA + 0x300000, 20000), c);
    let st = s.run(&[CcwWord::read(40000, DATA)], 0);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(s.read(DATA, 40000), a);
    s.assert_no_pins();
    s.stop();
}

#[test]
fn test_ccw_e2e_bad_programs_end_in_documented_status() {
    let (_dir, image) = tmp();
    let mut s = Session::start(&image, PinPolicy::Lock);
    let ends = dstat::CHANNEL_END | dstat::DEVICE_END;
    type Setup = fn(&Session) -> Vec<CcwWord>;
    let cases: Vec<(&str, Setup, Fault, u8)> = vec![
        (
            "loop",
            |_| vec![CcwWord::nop().chain(), CcwWord::tic(PROGRAM)],
            Fault::Loop,
            cstat::PROGRAM_CHECK,
        ),
        (
            "tic to tic",
            |s| {
                s.write(PROGRAM + 0x400, &CcwWord::tic(PROGRAM + 0x500).to_bytes());
                vec![CcwWord::nop().chain(), CcwWord::tic(PROGRAM + 0x400)]
            },
            Fault::TicToTic,
            cstat::PROGRAM_CHECK,
        ),
        (
            "bad data address",
            |_| vec![CcwWord::read(512, HOLE)],
            Fault::DataAddressInvalid,
            cstat::PROGRAM_CHECK,
        ),
        (
            "count past idaw list",
            |s| {
                s.write(IDAWS, &driver::encode_idaws(&[DATA, DATA + 0x5000]));
                vec![CcwWord::read(8193, IDAWS).ida(2)]
            },
            Fault::CountPastIdawList,
            cstat::PROGRAM_CHECK,
        ),
        (
            "unaligned idaw",
            |s| {
                s.write(IDAWS, &driver::encode_idaws(&[DATA, DATA + 0x5008]));
                vec![CcwWord::read(5000, IDAWS).ida(2)]
            },
            Fault::IdawUnaligned,
            cstat::PROGRAM_CHECK,
        ),
        (
            "unaligned idaw list",
            |s| {
                s.write(IDAWS + 4, &driver::encode_idaws(&[DATA]));
                vec![CcwWord::read(100, IDAWS + 4).ida(1)]
            },
            Fault::IdawListUnaligned,
            cstat::PROGRAM_CHECK,
        ),
        (
            "zero count",
            |_| vec![CcwWord::write(0, DATA)],
            Fault::ZeroCount,
            cstat::PROGRAM_CHECK,
        ),
        (
            "lock limit",
            |_| {
                // 20 × 16 distinct pages = 320 pages > the 256-page lock limit.
                (0..20u64)
                    .map(|i| CcwWord::read(65535, DATA + i * 0x10000).chain())
                    .chain(std::iter::once(CcwWord::nop()))
                    .collect()
            },
            Fault::PinFailed,
            cstat::CHANNEL_CONTROL_CHECK,
        ),
    ];
    for (name, setup, fault, cs) in cases {
        let program = setup(&s);
        let st = s.run(&program, 0);
        assert_eq!(st.fault(), Some(fault), "{name}: {st:?}");
        assert_eq!(st.channel_status, cs, "{name}");
        assert_eq!(st.device_status, ends, "{name}");
        assert_eq!(st.transferred, 0, "{name}");
        s.assert_no_pins();
    }
    // Unmapped status block: no status stored, STATUS_LOST, LAST_STATUS says why.
    let irq = s.submit(&[CcwWord::nop()], 0, HOLE);
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    let (_, c, f) = driver::decode_last_status(s.reg(regs::LAST_STATUS));
    assert_eq!(
        (c, f),
        (cstat::PROGRAM_CHECK, Some(Fault::StatusBlockInvalid))
    );
    // Past the end of the image: unit check.
    let st = s.run(&[CcwWord::read(1024, DATA)], BLOCKS - 1);
    assert_eq!(st.fault(), Some(Fault::OutOfRange));
    assert_eq!(st.device_status, ends | dstat::UNIT_CHECK);
    s.assert_no_pins();
    s.stop();
}

/// Start a long program (60 × 64 KiB READs).
fn start_long_program(s: &mut Session) {
    let words: Vec<CcwWord> = (0..60)
        .map(|i| CcwWord::read(65535, DATA + (i % 8) * 0x10000).chain())
        .chain(std::iter::once(CcwWord::nop()))
        .collect();
    s.write(PROGRAM, &driver::encode_program(&words));
    s.write(
        OPB,
        &OperationBlock {
            program: PROGRAM,
            block: 0,
            status: STATUS,
            flags: 0,
            reserved: 0,
        }
        .to_bytes(),
    );
    s.set_reg(regs::OPB_ADDR_LO, OPB as u32);
    s.set_reg(regs::START, 1);
}

#[test]
fn test_ccw_e2e_dma_unmap_during_program_leaves_no_pins() {
    let (_dir, image) = tmp();
    let mut s = Session::start(&image, PinPolicy::Lock);
    start_long_program(&mut s);
    s.client.dma_unmap(RAM, RAM_SIZE).unwrap();
    // The unmap reply means the device released whatever it pinned in RAM.
    s.assert_no_pins();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.reg(regs::STATUS) & regs::STATUS_BUSY != 0 {
        assert!(std::time::Instant::now() < deadline, "device stayed busy");
        std::thread::sleep(Duration::from_millis(1));
    }
    s.assert_no_pins();
    s.stop();
}

#[test]
fn test_ccw_e2e_disconnect_during_program_leaves_no_pins() {
    let (_dir, image) = tmp();
    let mut s = Session::start(&image, PinPolicy::Lock);
    start_long_program(&mut s);
    let space = s.stop();
    let st = space.stats();
    assert_eq!((st.pinned_pages, st.locked_pages), (0, 0));
    assert_eq!(
        st.leaked_pins_released, 0,
        "device leaked pins at disconnect"
    );
    assert_eq!(st.maps, 0);
}
