//! Hostile guest against the ccw channel device, through a real socket: umdev's server serves
//! the device, the independent `vfio_user::Client` is the VMM, the test is the guest driver.
//! Random register writes and random channel programs; operation blocks, programs, IDAW lists
//! and data at unmapped, read-only, wrapping or straddling addresses; loops. The device ends
//! every program with its documented fault (protocol-docs/devices/ccw.md), the server keeps
//! serving (a following good program works) and no pin survives a program.

#[path = "common/independent_client.rs"]
mod independent;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use independent::{client_map, enable_device};
use umdev::device::region_index;
use umdev::dma::{DmaConfig, DmaMapping, PinPolicy, Prot};
use umdev::pci::PciAdapter;
use umdev::testing::{
    memfd, wait_until, Answer, DeviceAccess, FdlessMemory, RawClient, Rng, TestServer, Vmm,
};
use umdev_devices::ccw::driver::{
    self, cmd, flags, regs, CcwWord, Fault, OperationBlock, StatusBlock,
};
use umdev_devices::ccw::{Ccw, CcwConfig};

/// Read-write guest RAM (mapped through the client).
const RAM: u64 = 0x10_0000;
const RAM_SIZE: u64 = 2 << 20;
/// Read-only guest memory (mapped straight into the DMA space).
const ROM: u64 = 0x80_0000;
const ROM_SIZE: u64 = 64 << 10;
/// Nothing is mapped here.
const HOLE: u64 = 0x60_0000;
/// The last page of the 64-bit IOVA space.
const LAST_PAGE: u64 = 0xffff_ffff_ffff_f000;

const OPB: u64 = RAM;
const STATUS: u64 = RAM + 0x100;
const PROGRAM: u64 = RAM + 0x1000;
const IDAWS: u64 = RAM + 0x3000;
/// Scratch area the random storm fills with garbage and random programs.
const GARBAGE: u64 = RAM + 0x1_0000;
const GARBAGE_SIZE: u64 = 0x1_0000;
const DATA: u64 = RAM + 0x4_0000;
const CAPACITY_BLOCKS: u64 = 4096;

struct CcwVm {
    served: TestServer<PciAdapter<Ccw>>,
    client: vfio_user::Client,
    ram: File,
    rom: File,
}

impl CcwVm {
    fn new(policy: PinPolicy, lock_limit: Option<u64>) -> CcwVm {
        let dir = tempfile::tempdir().unwrap();
        let ccw =
            Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(CAPACITY_BLOCKS))
                .unwrap();
        let dma = DmaConfig {
            policy,
            lock_limit_bytes: lock_limit,
            ..DmaConfig::default()
        };
        let served = TestServer::builder_pci(ccw)
            .unwrap()
            .dma_config(dma)
            .in_dir(dir)
            .start()
            .unwrap();
        let mut client = independent::connect(served.path());
        enable_device(&mut client);
        let ram = memfd(RAM_SIZE).unwrap();
        let rom = memfd(ROM_SIZE).unwrap();
        client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
        served
            .dma()
            .map(DmaMapping {
                iova: ROM,
                size: ROM_SIZE,
                prot: Prot::READ,
                fd: Some(rom.try_clone().unwrap().into()),
                offset: 0,
            })
            .unwrap();
        CcwVm {
            served,
            client,
            ram,
            rom,
        }
    }

    fn reg(&mut self, off: u64) -> u32 {
        independent::bar0_read32(&mut self.client, off)
    }

    fn set_reg(&mut self, off: u64, v: u32) {
        independent::bar0_write32(&mut self.client, off, v)
    }

    fn write(&self, iova: u64, data: &[u8]) {
        if (RAM..RAM + RAM_SIZE).contains(&iova) {
            self.ram.write_all_at(data, iova - RAM).unwrap();
        } else {
            self.rom.write_all_at(data, iova - ROM).unwrap();
        }
    }

    fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        if (RAM..RAM + RAM_SIZE).contains(&iova) {
            self.ram.read_exact_at(&mut v, iova - RAM).unwrap();
        } else {
            self.rom.read_exact_at(&mut v, iova - ROM).unwrap();
        }
        v
    }

    fn wait_not_busy(&mut self) {
        assert!(
            wait_until(Duration::from_secs(5), || self.reg(regs::STATUS)
                & regs::STATUS_BUSY
                == 0),
            "device stuck busy"
        );
    }

    /// START the operation block at `opb`; wait until it completed. Returns IRQ_STATUS
    /// (acked) and LAST_STATUS.
    fn start(&mut self, opb: u64) -> (u32, u32) {
        self.wait_not_busy();
        let done = self.reg(regs::COMPLETED);
        self.set_reg(regs::OPB_ADDR_LO, opb as u32);
        self.set_reg(regs::OPB_ADDR_HI, (opb >> 32) as u32);
        self.set_reg(regs::START, 1);
        assert!(
            wait_until(Duration::from_secs(5), || self.reg(regs::COMPLETED) != done),
            "program at {opb:#x} never completed"
        );
        self.wait_not_busy();
        let irq = self.reg(regs::IRQ_STATUS);
        self.set_reg(regs::IRQ_STATUS, irq);
        (irq, self.reg(regs::LAST_STATUS))
    }

    /// Run `program` placed at `at` with the standard operation block; the status block.
    fn run_at(&mut self, program: &[CcwWord], at: u64, block: u64) -> StatusBlock {
        self.write(at, &driver::encode_program(program));
        self.run_opb(OperationBlock {
            program: at,
            block,
            status: STATUS,
            flags: 0,
            reserved: 0,
        })
    }

    fn run_opb(&mut self, opb: OperationBlock) -> StatusBlock {
        self.write(OPB, &opb.to_bytes());
        self.write(STATUS, &[0xee; 32]);
        let (irq, _) = self.start(OPB);
        assert_eq!(irq, regs::IRQ_DONE, "status block not stored");
        StatusBlock::from_bytes(&self.read(STATUS, 32).try_into().unwrap())
    }

    fn assert_no_pins(&self) {
        assert_eq!(
            self.served.device().device().pins_held(),
            0,
            "device holds pins"
        );
        self.served.assert_space_unpinned();
    }

    /// A good program still works: write a pattern to the image (with chaining and a
    /// TIC), then read it back with a second program.
    fn assert_serving(&mut self) {
        let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
        self.write(DATA, &pattern);
        self.write(DATA + 0x1000, &[0u8; 1024]);
        let sb = self.run_at(
            &[
                CcwWord::nop().chain(),
                CcwWord::tic(PROGRAM + 0x40),
                CcwWord::nop(),
                CcwWord::nop(),
                CcwWord::write(1024, DATA),
            ],
            PROGRAM,
            7,
        );
        assert!(sb.is_ok(), "good WRITE program failed: {sb:?}");
        let sb = self.run_at(&[CcwWord::read(1024, DATA + 0x1000)], PROGRAM, 7);
        assert!(sb.is_ok(), "good READ program failed: {sb:?}");
        assert_eq!(sb.transferred, 1024);
        assert_same(
            &self.read(DATA + 0x1000, 1024),
            &pattern,
            "data did not round-trip",
        );
        self.assert_no_pins();
    }
}

/// Compare byte buffers, reporting the first difference only.
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} is {:#x}, want {:#x}", got[i], want[i]);
    }
}

/// Assert the status block ends with `fault` and its documented device/channel status.
fn assert_fault(sb: &StatusBlock, fault: Fault, what: &str) {
    assert_eq!(sb.fault(), Some(fault), "{what}: {sb:?}");
    assert_eq!(
        (sb.device_status, sb.channel_status),
        fault.status(),
        "{what}: {sb:?}"
    );
    if fault != Fault::ImageIo && fault != Fault::IncorrectLength {
        assert_eq!(sb.transferred, 0, "{what}: data moved before the fault");
    }
}

#[test]
fn test_ccw_socket_unreadable_operation_blocks_lose_status_and_recover() {
    let mut vm = CcwVm::new(PinPolicy::Translate, None);
    for (opb, fault) in [
        (HOLE, Fault::OpBlockUnreadable),
        (0xffff_ffff_ffff_fff8, Fault::OpBlockUnreadable),
        (RAM + RAM_SIZE - 16, Fault::OpBlockUnreadable),
        (RAM + 4, Fault::OpBlockUnaligned),
    ] {
        let (irq, last) = vm.start(opb);
        assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST, "opb {opb:#x}");
        let (d, c, f) = driver::decode_last_status(last);
        assert_eq!(f, Some(fault), "opb {opb:#x}");
        assert_eq!((d, c), fault.status(), "opb {opb:#x}");
        vm.assert_no_pins();
        vm.assert_serving();
    }
}

#[test]
fn test_ccw_socket_status_block_unmapped_nothing_runs() {
    let mut vm = CcwVm::new(PinPolicy::Translate, None);
    vm.write(DATA, &[0x11; 512]);
    vm.write(
        PROGRAM,
        &driver::encode_program(&[CcwWord::read(512, DATA)]),
    );
    for status in [HOLE, LAST_PAGE + 0xff0] {
        vm.write(
            OPB,
            &OperationBlock {
                program: PROGRAM,
                block: 0,
                status,
                flags: 0,
                reserved: 0,
            }
            .to_bytes(),
        );
        let (irq, last) = vm.start(OPB);
        assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
        assert_eq!(
            driver::decode_last_status(last).2,
            Some(Fault::StatusBlockInvalid)
        );
        assert_same(&vm.read(DATA, 512), &[0x11; 512], "program ran anyway");
        vm.assert_no_pins();
    }
    vm.assert_serving();
}

/// Each hostile program, with the fault it must end with.
fn hostile_programs() -> Vec<(&'static str, Vec<CcwWord>, Fault)> {
    let far = RAM + 0x2_0000;
    vec![
        (
            "loop through TIC",
            vec![CcwWord::nop().chain(), CcwWord::tic(PROGRAM)],
            Fault::Loop,
        ),
        (
            "loop after a data transfer",
            vec![
                CcwWord::read(16, DATA).chain(),
                CcwWord::nop().chain(),
                CcwWord::tic(PROGRAM + 16),
            ],
            Fault::Loop,
        ),
        (
            "TIC first",
            vec![CcwWord::tic(PROGRAM + 16), CcwWord::nop()],
            Fault::TicFirst,
        ),
        (
            "TIC to unmapped",
            vec![CcwWord::nop().chain(), CcwWord::tic(HOLE)],
            Fault::CcwUnreadable,
        ),
        (
            "TIC to the last bytes of the address space",
            vec![CcwWord::nop().chain(), CcwWord::tic(0xffff_ffff_ffff_fff8)],
            Fault::CcwUnreadable,
        ),
        (
            "chain runs off the end of RAM",
            vec![CcwWord::nop().chain(), CcwWord::tic(RAM + RAM_SIZE - 16)],
            Fault::CcwUnreadable,
        ),
        (
            "TIC unaligned",
            vec![CcwWord::nop().chain(), CcwWord::tic(far + 4)],
            Fault::CcwUnaligned,
        ),
        (
            "READ into read-only memory",
            vec![CcwWord::read(512, ROM)],
            Fault::DataProtection,
        ),
        (
            "SENSE into read-only memory",
            vec![CcwWord::sense(32, ROM + 64)],
            Fault::DataProtection,
        ),
        (
            "READ into unmapped memory",
            vec![CcwWord::read(512, HOLE)],
            Fault::DataAddressInvalid,
        ),
        (
            "WRITE from unmapped memory",
            vec![CcwWord::write(512, HOLE)],
            Fault::DataAddressInvalid,
        ),
        (
            "READ whose address + count wraps",
            vec![CcwWord::read(0x200, 0xffff_ffff_ffff_ff00)],
            Fault::DataAddressInvalid,
        ),
        (
            "READ straddling the end of RAM",
            vec![CcwWord::read(0x200, RAM + RAM_SIZE - 0x100)],
            Fault::DataAddressInvalid,
        ),
        (
            "good READ then READ into unmapped memory",
            vec![CcwWord::read(512, DATA).chain(), CcwWord::read(512, HOLE)],
            Fault::DataAddressInvalid,
        ),
        (
            "IDAW list in unmapped memory",
            vec![CcwWord::read(512, HOLE).ida(1)],
            Fault::IdawListUnreadable,
        ),
        (
            "IDAW list wrapping the address space",
            vec![CcwWord::read(512, 0xffff_ffff_ffff_fff8).ida(2)],
            Fault::IdawListUnreadable,
        ),
        (
            "IDAW count zero",
            vec![CcwWord::read(512, IDAWS).ida(0)],
            Fault::IdawCountInvalid,
        ),
        (
            "IDAW count huge",
            vec![CcwWord::read(512, IDAWS).ida(u32::MAX)],
            Fault::IdawCountInvalid,
        ),
        ("zero count", vec![CcwWord::read(0, DATA)], Fault::ZeroCount),
        (
            "unknown command",
            vec![CcwWord::new(0x77, 16, DATA)],
            Fault::InvalidCommand,
        ),
        (
            "reserved flags",
            vec![CcwWord::read(16, DATA).with_flags(flags::RESERVED)],
            Fault::InvalidFlags,
        ),
    ]
}

#[test]
fn test_ccw_socket_hostile_programs_end_in_documented_fault_no_pins() {
    let mut vm = CcwVm::new(PinPolicy::Lock, Some(1 << 20));
    vm.write(ROM, &[0x5a; 4096]);
    vm.write(DATA, &[0x33; 4096]);
    // The last CCW slot of RAM chains on into unmapped memory.
    vm.write(RAM + RAM_SIZE - 16, &CcwWord::nop().chain().to_bytes());
    for (what, program, fault) in hostile_programs() {
        let sb = vm.run_at(&program, PROGRAM, 0);
        assert_fault(&sb, fault, what);
        assert_same(
            &vm.read(ROM, 4096),
            &[0x5a; 4096],
            &format!("{what}: ROM written"),
        );
        if fault != Fault::None {
            assert_same(
                &vm.read(DATA, 4096),
                &[0x33; 4096],
                &format!("{what}: data moved"),
            );
        }
        vm.assert_no_pins();
        vm.write(DATA, &[0x33; 4096]);
    }
    vm.assert_serving();
}

#[test]
fn test_ccw_socket_idaws_at_unmapped_and_wrapping_pages_data_address_invalid() {
    let mut vm = CcwVm::new(PinPolicy::Lock, Some(1 << 20));
    for idaws in [
        vec![DATA, HOLE],
        vec![HOLE + 0x800, DATA],
        vec![DATA + 0x800, LAST_PAGE],
        vec![DATA, ROM],
    ] {
        vm.write(IDAWS, &driver::encode_idaws(&idaws));
        let sb = vm.run_at(&[CcwWord::read(6000, IDAWS).ida(2)], PROGRAM, 0);
        let want = if idaws[1] == ROM {
            Fault::DataProtection
        } else {
            Fault::DataAddressInvalid
        };
        assert_fault(&sb, want, &format!("{idaws:x?}"));
        vm.assert_no_pins();
    }
    vm.assert_serving();
}

#[test]
fn test_ccw_socket_program_too_long_and_self_overwriting_program() {
    let mut vm = CcwVm::new(PinPolicy::Translate, None);
    let max = vm.reg(regs::MAX_CCWS) as usize;
    let mut long = vec![CcwWord::nop().chain(); max];
    long.push(CcwWord::nop());
    let sb = vm.run_at(&long, RAM + 0x2_0000, 0);
    assert_fault(&sb, Fault::ProgramTooLong, "MAX_CCWS + 1 NOPs");
    vm.assert_no_pins();

    // A READ that overwrites its own program and an aliased second READ to the same page:
    // the program was fetched before any data moved, duplicates are pinned twice.
    let fill: Vec<u8> = (0..512u32).map(|i| (i % 251) as u8).collect();
    vm.write(DATA, &fill);
    let sb = vm.run_at(&[CcwWord::write(512, DATA)], PROGRAM, 3);
    assert!(sb.is_ok(), "{sb:?}");
    let sb = vm.run_at(
        &[
            CcwWord::read(512, PROGRAM).chain(),
            CcwWord::read(512, DATA + 0x1000).chain(),
            CcwWord::read(512, DATA + 0x1000),
        ],
        PROGRAM,
        3,
    );
    assert!(sb.is_ok(), "{sb:?}");
    assert_same(
        &vm.read(PROGRAM, 512),
        &fill,
        "program area not overwritten",
    );
    vm.assert_no_pins();
    vm.assert_serving();
}

#[test]
fn test_ccw_socket_lock_limit_pin_failed_nothing_pinned_then_smaller_program_works() {
    // 16 KiB lock limit: a 32 KiB READ cannot be pinned, an 8 KiB one can.
    let mut vm = CcwVm::new(PinPolicy::Lock, Some(16 << 10));
    vm.write(DATA, &[0x44; 32 << 10]);
    let sb = vm.run_at(&[CcwWord::read(32 << 10, DATA)], PROGRAM, 0);
    assert_fault(&sb, Fault::PinFailed, "32 KiB under a 16 KiB lock limit");
    assert_same(
        &vm.read(DATA, 32 << 10),
        &[0x44; 32 << 10],
        "failed READ moved data",
    );
    vm.assert_no_pins();
    let sb = vm.run_at(&[CcwWord::read(8 << 10, DATA)], PROGRAM, 0);
    assert!(sb.is_ok(), "{sb:?}");
    vm.assert_no_pins();
    vm.assert_serving();
}

/// A random CCW aimed at the interesting cases.
fn hostile_ccw(rng: &mut Rng, base: u64) -> CcwWord {
    let r = rng.next_u64();
    let addr = match rng.below(8) {
        0 => HOLE + rng.below(0x1000),
        1 => ROM + rng.below(ROM_SIZE),
        2 => LAST_PAGE + rng.below(0x1000),
        3 => base + rng.below(16) * 16,
        4 => rng.next_u64(),
        _ => DATA + rng.below(0x8000),
    };
    let code = rng.pick(&[cmd::READ, cmd::WRITE, cmd::NOP, cmd::SENSE, cmd::TIC, 0x55]);
    let mut w = CcwWord::new(code, rng.pick(&[0, 1, 32, 512, 4096, 0xffff]), addr);
    w.flags = rng.pick(&[
        flags::CC,
        flags::CC,
        flags::CD,
        0,
        flags::CC | flags::IDA,
        flags::SKIP | flags::CC,
        flags::SLI,
        r as u8,
    ]);
    if w.flags & flags::IDA != 0 {
        w.idaw_count = rng.pick(&[0, 1, 2, 33, r as u32]);
        w.addr = rng.pick(&[IDAWS, HOLE, base]);
    }
    w
}

/// One seeded storm of random BAR0 writes against a guest memory full of random programs.
fn random_register_storm(seed: u64, steps: usize) -> u64 {
    let mut vm = CcwVm::new(PinPolicy::Lock, Some(1 << 20));
    let mut rng = Rng::new(seed);
    // Random operation blocks at GARBAGE + k * 0x400, their programs right after them.
    for k in 0..(GARBAGE_SIZE / 0x400) {
        let opb = GARBAGE + k * 0x400;
        let prog = opb + 0x40;
        let r = rng.next_u64();
        let n = 1 + rng.below(12) as usize;
        let mut words: Vec<CcwWord> = if rng.chance(50) {
            // A plausible program with at most one hostile CCW in it.
            (0..n)
                .map(|_| {
                    let addr = DATA + rng.below(64) * 512;
                    let count = rng.pick(&[512u16, 100, 4096, 9000]);
                    CcwWord::new(rng.pick(&[cmd::READ, cmd::WRITE]), count, addr).chain()
                })
                .collect()
        } else {
            Vec::new()
        };
        if words.is_empty() || rng.chance(50) {
            let at = rng.below(n as u64) as usize;
            words.insert(at.min(words.len()), hostile_ccw(&mut rng, prog));
        }
        if rng.chance(80) {
            if let Some(last) = words.last_mut() {
                last.flags &= !(flags::CC | flags::CD);
            }
        }
        vm.write(prog, &driver::encode_program(&words));
        let status = rng.pick(&[STATUS, STATUS, HOLE, ROM, opb + 0x20, r]);
        let block = rng.pick(&[0, 0, 1, 9, CAPACITY_BLOCKS - 1, CAPACITY_BLOCKS, r]);
        let program = rng.pick(&[prog, prog, prog, prog + 4, HOLE, r]);
        let flags = rng.pick(&[0, 0, 1, 2, r as u32]);
        vm.write(
            opb,
            &OperationBlock {
                program,
                block,
                status,
                flags,
                reserved: rng.pick(&[0, 0, 0, 0, 0, 1]),
            }
            .to_bytes(),
        );
    }
    let idaws: Vec<u64> = (0..40)
        .map(|_| {
            let r = rng.next_u64();
            rng.pick(&[DATA, DATA + 0x3000, HOLE, ROM, LAST_PAGE, r])
        })
        .collect();
    vm.write(IDAWS, &driver::encode_idaws(&idaws));
    let reg_offsets = [
        regs::OPB_ADDR_LO,
        regs::OPB_ADDR_HI,
        regs::START,
        regs::START,
        regs::STATUS,
        regs::IRQ_STATUS,
        regs::LAST_STATUS,
        regs::COMPLETED,
        regs::MAX_CCWS,
    ];
    for step in 0..steps {
        if rng.chance(15) {
            let opb = GARBAGE + rng.below(GARBAGE_SIZE / 0x400) * 0x400;
            vm.set_reg(regs::OPB_ADDR_LO, opb as u32);
            vm.set_reg(regs::OPB_ADDR_HI, 0);
            if rng.chance(50) {
                vm.wait_not_busy();
            }
            vm.set_reg(regs::START, 1);
            continue;
        }
        let off = if rng.chance(80) {
            rng.pick(&reg_offsets)
        } else {
            rng.below(regs::BAR0_SIZE)
        };
        let value = match rng.below(10) {
            0..=3 => GARBAGE + rng.below(GARBAGE_SIZE / 0x400) * 0x400,
            4..=5 => 1,
            6 => rng.pick(&[HOLE, ROM, RAM + RAM_SIZE - 8, 0xffff_ffff_ffff_fff8]),
            _ => rng.next_u64(),
        };
        let size = rng
            .pick(&[1usize, 2, 4, 4, 4, 8])
            .min((regs::BAR0_SIZE - off) as usize);
        vm.client
            .region_write(region_index::BAR0, off, &value.to_le_bytes()[..size])
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: write {off:#x}: {e}"));
        if step % 64 == 0 {
            assert_eq!(vm.reg(regs::ID), regs::MAGIC, "seed {seed} step {step}");
        }
    }
    vm.wait_not_busy();
    let completed = vm.reg(regs::COMPLETED);
    let syscalls = vm.served.dma().stats().residency_syscalls;
    eprintln!("seed {seed}: {completed} programs completed, {syscalls} mlock/munlock calls");
    assert!(completed > 0, "seed {seed}: no program ran");
    vm.assert_no_pins();
    let irq = vm.reg(regs::IRQ_STATUS);
    vm.set_reg(regs::IRQ_STATUS, irq);
    vm.assert_serving();
    syscalls
}

#[test]
fn test_ccw_socket_random_register_writes_keep_serving_and_return_pins() {
    let pin_syscalls: u64 = (1..=3).map(|seed| random_register_storm(seed, 600)).sum();
    assert!(pin_syscalls > 0, "the storm never reached the pin path");
}

/// fd-less guest memory the raw client serves itself.
const FDLESS: u64 = 0x70_0000;
const FDLESS_SIZE: u64 = 0x1000;

#[test]
fn test_ccw_socket_opb_in_fdless_memory_honest_lying_and_silent_vmm() {
    use std::os::fd::AsFd;
    let dir = tempfile::tempdir().unwrap();
    let ccw = Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(CAPACITY_BLOCKS))
        .unwrap();
    let served = TestServer::builder_pci(ccw)
        .unwrap()
        .in_dir(dir)
        .configure(|c| c.remote_dma_timeout = Duration::from_millis(300))
        .start()
        .unwrap();
    let c = RawClient::new_default(served.path());
    let mut vmm = Vmm::from_client(c).with_fdless(FdlessMemory::new(FDLESS, FDLESS_SIZE as usize));
    let ram = memfd(RAM_SIZE).unwrap();
    vmm.dma_map_fd(RAM, RAM_SIZE, ram.as_fd(), 0).unwrap();
    vmm.dma_map_fdless(FDLESS, FDLESS_SIZE).unwrap();
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    // The operation block and the program live in fd-less memory, served by the VMM.
    let opb = OperationBlock {
        program: FDLESS + 0x100,
        block: 0,
        status: STATUS,
        flags: 0,
        reserved: 0,
    };
    vmm.mem_mut()[..32].copy_from_slice(&opb.to_bytes());
    let prog = driver::encode_program(&[CcwWord::write(512, DATA)]);
    vmm.mem_mut()[0x100..0x100 + prog.len()].copy_from_slice(&prog);
    let run = |vmm: &mut Vmm| -> (u32, u32) {
        let bar = region_index::BAR0;
        let done = vmm.read32(bar, regs::COMPLETED).unwrap();
        vmm.write32(bar, regs::OPB_ADDR_LO, FDLESS as u32).unwrap();
        vmm.write32(bar, regs::OPB_ADDR_HI, 0).unwrap();
        vmm.write32(bar, regs::START, 1).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while vmm.read32(bar, regs::COMPLETED).unwrap() == done {
            assert!(
                std::time::Instant::now() < deadline,
                "program never completed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let irq = vmm.read32(bar, regs::IRQ_STATUS).unwrap();
        vmm.write32(bar, regs::IRQ_STATUS, irq).unwrap();
        (irq, vmm.read32(bar, regs::LAST_STATUS).unwrap())
    };
    for answer in [
        Answer::Honest,
        Answer::Errors,
        Answer::Silent,
        Answer::Honest,
    ] {
        vmm.set_answer(answer);
        let before = vmm.requests();
        let (irq, last) = run(&mut vmm);
        assert!(
            vmm.requests() > before,
            "{answer:?}: the device never asked the VMM"
        );
        let fault = driver::decode_last_status(last).2;
        if answer == Answer::Honest {
            assert_eq!(
                (irq, fault),
                (regs::IRQ_DONE, Some(Fault::None)),
                "{answer:?}"
            );
        } else {
            assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST, "{answer:?}");
            assert_eq!(fault, Some(Fault::OpBlockUnreadable), "{answer:?}");
        }
        assert_eq!(served.device().device().pins_held(), 0);
        served.assert_space_unpinned();
    }
    // Reset while the worker waits for a DMA_READ the VMM never answers: bounded by the
    // remote DMA timeout; no status, no pins, and the next program works.
    vmm.set_answer(Answer::Silent);
    let bar = region_index::BAR0;
    vmm.write32(bar, regs::OPB_ADDR_LO, FDLESS as u32).unwrap();
    let before = vmm.requests();
    vmm.write32(bar, regs::START, 1).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while vmm.requests() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "no DMA_READ for the OPB"
        );
        vmm.read32(bar, regs::STATUS).unwrap();
    }
    let started = std::time::Instant::now();
    let m = vmm
        .call(umdev::protocol::Command::DeviceReset, &[], &[])
        .unwrap();
    assert!(!m.header.is_error(), "reset errno {}", m.header.error);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "reset took {:?}",
        started.elapsed()
    );
    assert_eq!(
        vmm.read32(bar, regs::STATUS).unwrap() & regs::STATUS_BUSY,
        0
    );
    assert_eq!(served.device().device().pins_held(), 0);
    vmm.set_answer(Answer::Honest);
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    let (irq, last) = run(&mut vmm);
    assert_eq!(irq, regs::IRQ_DONE);
    assert_eq!(driver::decode_last_status(last).2, Some(Fault::None));

    // Data pages in fd-less memory cannot be pinned: the program ends with a data fault.
    let prog = driver::encode_program(&[CcwWord::read(512, FDLESS + 0x800)]);
    vmm.mem_mut()[0x100..0x100 + prog.len()].copy_from_slice(&prog);
    let (_, last) = run(&mut vmm);
    assert_eq!(
        driver::decode_last_status(last).2,
        Some(Fault::DataAddressInvalid)
    );
    assert_eq!(served.device().device().pins_held(), 0);
    served.assert_space_unpinned();
}

#[test]
fn test_ccw_socket_random_config_space_writes_keep_serving() {
    let mut vm = CcwVm::new(PinPolicy::Translate, None);
    let mut rng = Rng::new(78);
    for step in 0..1500 {
        let off = if rng.chance(50) {
            rng.pick(&[
                0x04u64, 0x06, 0x0c, 0x10, 0x14, 0x30, 0x3c, 0x3d, 0x40, 0x42, 0x44,
            ])
        } else {
            rng.below(256)
        };
        let size = rng.pick(&[1usize, 2, 4]).min((256 - off) as usize);
        let v = rng.next_u64().to_le_bytes();
        let _ = vm
            .client
            .region_write(region_index::CONFIG, off, &v[..size]);
        if step % 100 == 0 {
            let mut b = [0u8; 4];
            vm.client
                .region_read(region_index::CONFIG, 0, &mut b)
                .unwrap();
            assert_eq!(u32::from_le_bytes(b), 0x0cc1_1234, "vendor/device changed");
        }
    }
    enable_device(&mut vm.client);
    let irq = vm.reg(regs::IRQ_STATUS);
    vm.set_reg(regs::IRQ_STATUS, irq);
    vm.assert_serving();
}
