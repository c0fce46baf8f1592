//! ccw device data path: channel programs with direct, contiguous-IDA, scattered-IDA and
//! mixed data areas write random data and read it back; persistence across devices on the
//! same image; MSI/INTx; pin policies.

mod ccw_support;

use std::time::Duration;

use ccw_support::*;
use umdev::device::{irq_index, region_index, Device, IrqAction, IrqData, SetIrqs};
use umdev::dma::PinPolicy;
use umdev_devices::ccw::driver::{
    self, cstat, dstat, opb_flags, regs, sense, CcwWord, Fault, OperationBlock,
};

const PAGE: u64 = 4096;

/// `n` distinct data pages (page-aligned IOVAs) from the DATA area, shuffled.
fn scattered_pages(rng: &mut Rng, n: usize, area_first: u64, area_pages: u64) -> Vec<u64> {
    let mut all: Vec<u64> = (0..area_pages).map(|i| area_first + i * PAGE).collect();
    for i in (1..all.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

/// Write `data` to the guest at the places an IDAW list describes.
fn scatter(rig: &Rig, idaws: &[u64], data: &[u8]) {
    let mut off = 0usize;
    for (i, &a) in idaws.iter().enumerate() {
        if off == data.len() {
            break;
        }
        let room = if i == 0 {
            (PAGE - a % PAGE) as usize
        } else {
            PAGE as usize
        };
        let n = room.min(data.len() - off);
        rig.guest_write(a, &data[off..off + n]);
        off += n;
    }
}

/// Read back what an IDAW list describes.
fn gather(rig: &Rig, idaws: &[u64], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for (i, &a) in idaws.iter().enumerate() {
        if out.len() == len {
            break;
        }
        let room = if i == 0 {
            (PAGE - a % PAGE) as usize
        } else {
            PAGE as usize
        };
        let n = room.min(len - out.len());
        out.extend(rig.guest_read(a, n));
    }
    out
}

#[test]
fn test_ccw_direct_contiguous_write_then_read_equal() {
    let mut rig = Rig::new();
    let mut rng = seeded(1);
    let data = rng.bytes(16384);
    rig.guest_write(DATA, &data);
    let st = rig.run(&[CcwWord::write(16384, DATA)], 8);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(st.transferred, 16384);
    assert_eq!(st.ccw_addr, PROGRAM);
    assert_eq!(rig.image_bytes(8 * 512, 16384), data);
    rig.assert_no_pins();

    let st = rig.run(&[CcwWord::read(16384, DATA + 0x40000)], 8);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.guest_read(DATA + 0x40000, 16384), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_ida_contiguous_list_roundtrip_equal() {
    let mut rig = Rig::new();
    let mut rng = seeded(2);
    let len = 20000usize;
    let first = DATA + 0x300; // mid-page start
    let n = driver::idaws_needed(first, len as u32);
    let idaws: Vec<u64> = (0..u64::from(n))
        .map(|i| if i == 0 { first } else { DATA + i * PAGE })
        .collect();
    let data = rng.bytes(len);
    scatter(&rig, &idaws, &data);
    rig.guest_write(IDAWS, &driver::encode_idaws(&idaws));
    let st = rig.run(&[CcwWord::write(len as u16, IDAWS).ida(n)], 100);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.image_bytes(100 * 512, len), data);

    // Clear the pages and read back through the same list.
    scatter(&rig, &idaws, &vec![0u8; len]);
    let st = rig.run(&[CcwWord::read(len as u16, IDAWS).ida(n)], 100);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(gather(&rig, &idaws, len), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_ida_scattered_list_roundtrip_equal() {
    let mut rig = Rig::new();
    let mut rng = seeded(3);
    let len = 60000usize;
    let pages = scattered_pages(&mut rng, 16, DATA, 64);
    let wr = driver::idaws_over_pages(&pages, 0x9a8, len as u32).unwrap();
    let data = rng.bytes(len);
    scatter(&rig, &wr, &data);
    rig.guest_write(IDAWS, &driver::encode_idaws(&wr));
    let st = rig.run(
        &[CcwWord::write(len as u16, IDAWS).ida(wr.len() as u32)],
        40,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.image_bytes(40 * 512, len), data);

    // Read into a different scattering.
    let pages2 = scattered_pages(&mut rng, 16, DATA + 64 * PAGE, 64);
    let rd = driver::idaws_over_pages(&pages2, 0x10, len as u32).unwrap();
    rig.guest_write(IDAWS + 0x1000, &driver::encode_idaws(&rd));
    let st = rig.run(
        &[CcwWord::read(len as u16, IDAWS + 0x1000).ida(rd.len() as u32)],
        40,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(gather(&rig, &rd, len), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_mixed_program_chain_data_tic_nop_roundtrip_equal() {
    let mut rig = Rig::new();
    let mut rng = seeded(4);
    // Program 1: WRITE 3000 bytes direct, data-chained to 9000 bytes through a scattered IDAW
    // list, then NOP, then TIC to a final NOP. Program 2: NOP, TIC to a READ of the same
    // 12000 bytes split the other way (7000 scattered IDA, data-chained to 5000 direct).
    let a = rng.bytes(3000);
    let b = rng.bytes(9000);
    rig.guest_write(DATA + 0x100, &a);
    let pages = scattered_pages(&mut rng, 4, DATA + 8 * PAGE, 24);
    let wl = driver::idaws_over_pages(&pages, 0x700, 9000).unwrap();
    scatter(&rig, &wl, &b);
    rig.guest_write(IDAWS, &driver::encode_idaws(&wl));

    let rpages = scattered_pages(&mut rng, 4, DATA + 40 * PAGE, 24);
    let rl = driver::idaws_over_pages(&rpages, 0, 7000).unwrap();
    rig.guest_write(IDAWS + 0x400, &driver::encode_idaws(&rl));
    let second = PROGRAM + 0x800;
    rig.guest_write(
        second,
        &driver::encode_program(&[
            CcwWord::read(7000, IDAWS + 0x400)
                .ida(rl.len() as u32)
                .chain_data(),
            CcwWord::read(5000, DATA + 80 * PAGE),
        ]),
    );
    rig.guest_write(PROGRAM + 0x400, &CcwWord::nop().to_bytes());
    let st = rig.run(
        &[
            CcwWord::write(3000, DATA + 0x100).chain_data(),
            CcwWord::write(9000, IDAWS).ida(wl.len() as u32).chain(),
            CcwWord::nop().chain(),
            CcwWord::tic(PROGRAM + 0x400),
        ],
        0,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(st.transferred, 12000);
    assert_eq!(st.ccw_addr, PROGRAM + 0x400);
    let mut want = a.clone();
    want.extend_from_slice(&b);
    assert_eq!(rig.image_bytes(0, 12000), want);

    // Read back through a program whose data-chained READ lives behind a TIC.
    let st = rig.run(&[CcwWord::nop().chain(), CcwWord::tic(second)], 0);
    assert!(st.is_ok(), "{st:?}");
    let mut got = gather(&rig, &rl, 7000);
    got.extend(rig.guest_read(DATA + 80 * PAGE, 5000));
    assert_eq!(got, want);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_random_programs_match_image_model() {
    let mut rig = Rig::new();
    let mut rng = seeded(5);
    let cap = (CAPACITY_BLOCKS * 512) as usize;
    let mut model = vec![0u8; cap];
    for round in 0..12 {
        let block = rng.below(CAPACITY_BLOCKS - 200);
        let len = 1 + rng.below(40000) as usize;
        let data = rng.bytes(len);
        let scattered = round % 3 != 0;
        let (ccw, place): (CcwWord, Vec<u64>) = if scattered {
            let n = driver::idaws_needed(rng.below(PAGE), len as u32) as usize;
            let pages = scattered_pages(&mut rng, n, DATA, 128);
            let l = driver::idaws_over_pages(&pages, rng.below(PAGE), len as u32).unwrap_or_else(
                || {
                    let mut p = pages.clone();
                    p.push(DATA + 200 * PAGE);
                    driver::idaws_over_pages(&p, 0, len as u32).unwrap()
                },
            );
            rig.guest_write(IDAWS, &driver::encode_idaws(&l));
            (CcwWord::write(len as u16, IDAWS).ida(l.len() as u32), l)
        } else {
            let addr = DATA + rng.below(0x10000);
            (CcwWord::write(len as u16, addr), vec![addr])
        };
        if scattered {
            scatter(&rig, &place, &data);
        } else {
            rig.guest_write(place[0], &data);
        }
        let st = rig.run(&[ccw], block);
        assert!(st.is_ok(), "round {round}: {st:?}");
        let off = (block * 512) as usize;
        model[off..off + len].copy_from_slice(&data);
        rig.assert_no_pins();

        // Read a random window back and compare with the model.
        let rblock = rng.below(CAPACITY_BLOCKS - 200);
        let rlen = 1 + rng.below(30000) as usize;
        let st = rig.run(&[CcwWord::read(rlen as u16, DATA + 0x100000)], rblock);
        assert!(st.is_ok(), "round {round}: {st:?}");
        let roff = (rblock * 512) as usize;
        assert_eq!(
            rig.guest_read(DATA + 0x100000, rlen),
            model[roff..roff + rlen],
            "round {round}"
        );
    }
    rig.assert_no_pins();
}

#[test]
fn test_ccw_data_persists_in_image_after_new_device() {
    let mut rng = seeded(6);
    let data = rng.bytes(8192);
    let rig = {
        let mut rig = Rig::new();
        rig.guest_write(DATA, &data);
        let st = rig.run_opb(
            &[CcwWord::write(8192, DATA)],
            OperationBlock {
                program: PROGRAM,
                block: 1000,
                status: STATUS,
                flags: opb_flags::FLUSH,
                reserved: 0,
            },
        );
        assert!(st.is_ok(), "{st:?}");
        rig
    };
    let Rig {
        dev, dir, image, ..
    } = rig;
    drop(dev);
    let mut rig2 = Rig::with_image(RigOptions::default(), dir, image);
    let st = rig2.run(&[CcwWord::read(8192, DATA + 0x8000)], 1000);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig2.guest_read(DATA + 0x8000, 8192), data);
    rig2.assert_no_pins();
}

#[test]
fn test_ccw_intx_fires_when_msi_not_enabled() {
    let mut rig = Rig::with(RigOptions {
        intx: true,
        ..RigOptions::default()
    });
    let st = rig.run(&[CcwWord::nop()], 0);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.reg(regs::COMPLETED), 1);
}

#[test]
fn test_ccw_msi_fires_once_per_program() {
    let mut rig = Rig::new();
    for i in 1..=3u32 {
        let st = rig.run(&[CcwWord::nop()], 0);
        assert_eq!(st.sequence, i);
        assert!(!rig.wait_irq(Duration::from_millis(20)), "extra interrupt");
    }
    assert_eq!(rig.reg(regs::COMPLETED), 3);
    assert_eq!(rig.reg(regs::IRQ_STATUS), 0);
}

#[test]
fn test_ccw_lock_policy_roundtrip_leaves_no_locked_pages() {
    let mut rig = Rig::with(RigOptions {
        policy: PinPolicy::Lock,
        lock_limit: Some(1 << 20),
        intx: false,
    });
    let mut rng = seeded(7);
    let data = rng.bytes(32768);
    rig.guest_write(DATA, &data);
    let pages = scattered_pages(&mut rng, 9, DATA + 16 * PAGE, 32);
    let l = driver::idaws_over_pages(&pages, 0x123, 32768).unwrap();
    rig.guest_write(IDAWS, &driver::encode_idaws(&l));
    // The image position advances through a program, so the read-back is a second one.
    let st = rig.run(&[CcwWord::write(32768, DATA)], 20);
    assert!(st.is_ok(), "{st:?}");
    let st = rig.run(&[CcwWord::read(32768, IDAWS).ida(l.len() as u32)], 20);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(gather(&rig, &l, 32768), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_lock_limit_exceeded_channel_control_check_no_pins() {
    let mut rig = Rig::with(RigOptions {
        policy: PinPolicy::Lock,
        lock_limit: Some(4 * PAGE),
        intx: false,
    });
    let st = rig.run(&[CcwWord::read(8 * PAGE as u16, DATA)], 0);
    assert_eq!(st.fault(), Some(Fault::PinFailed), "{st:?}");
    assert_eq!(st.channel_status, cstat::CHANNEL_CONTROL_CHECK);
    assert_eq!(st.transferred, 0);
    assert_eq!(st.ccw_addr, PROGRAM);
    rig.assert_no_pins();
    // A program within the limit still works.
    let st = rig.run(&[CcwWord::read(2 * PAGE as u16, DATA)], 0);
    assert!(st.is_ok(), "{st:?}");
    rig.assert_no_pins();
}

#[test]
fn test_ccw_populate_policy_roundtrip_equal() {
    let mut rig = Rig::with(RigOptions {
        policy: PinPolicy::Populate,
        lock_limit: None,
        intx: false,
    });
    let data = seeded(8).bytes(5000);
    rig.guest_write(DATA + 0x10, &data);
    let st = rig.run(&[CcwWord::write(5000, DATA + 0x10)], 3);
    assert!(st.is_ok(), "{st:?}");
    let st = rig.run(&[CcwWord::read(5000, DATA + 0x20000)], 3);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.guest_read(DATA + 0x20000, 5000), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_sense_after_out_of_range_reports_command_reject() {
    let mut rig = Rig::new();
    let st = rig.run(&[CcwWord::read(1024, DATA)], CAPACITY_BLOCKS - 1);
    assert_eq!(st.fault(), Some(Fault::OutOfRange));
    assert_eq!(
        st.device_status,
        dstat::CHANNEL_END | dstat::DEVICE_END | dstat::UNIT_CHECK
    );
    assert_eq!(st.residual, 1024);
    assert_eq!(st.transferred, 0);
    let st = rig.run(&[CcwWord::sense(32, SENSE_BUF)], 0);
    assert!(st.is_ok(), "{st:?}");
    let s = rig.guest_read(SENSE_BUF, 32);
    assert_eq!(s[0], sense::COMMAND_REJECT);
    assert_eq!(s[1], Fault::OutOfRange.code() as u8);
    // Sense is cleared once read.
    let st = rig.run(&[CcwWord::sense(32, SENSE_BUF)], 0);
    assert!(st.is_ok());
    assert_eq!(rig.guest_read(SENSE_BUF, 32), vec![0u8; 32]);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_sense_short_count_incorrect_length_unless_sli() {
    let mut rig = Rig::new();
    let st = rig.run(&[CcwWord::sense(8, SENSE_BUF).chain(), CcwWord::nop()], 0);
    assert_eq!(st.fault(), Some(Fault::IncorrectLength));
    assert_eq!(st.channel_status, cstat::INCORRECT_LENGTH);
    assert_eq!(st.ccw_addr, PROGRAM);
    let st = rig.run(
        &[
            CcwWord::sense(64, SENSE_BUF)
                .with_flags(driver::flags::SLI)
                .chain(),
            CcwWord::nop(),
        ],
        0,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(st.ccw_addr, PROGRAM + 16);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_write_from_read_only_mapping_ok() {
    let mut rig = Rig::new();
    let data = seeded(9).bytes(4096);
    rig.guest_write(ROM, &data);
    let st = rig.run(&[CcwWord::write(4096, ROM)], 5);
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.image_bytes(5 * 512, 4096), data);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_skip_read_advances_without_storing() {
    let mut rig = Rig::new();
    let data = seeded(10).bytes(1024);
    rig.guest_write(DATA, &data);
    assert!(rig.run(&[CcwWord::write(1024, DATA)], 0).is_ok());
    rig.guest_write(DATA + 0x4000, &[0xaa; 512]);
    let st = rig.run(
        &[
            CcwWord::read(512, DATA + 0x4000)
                .with_flags(driver::flags::SKIP)
                .chain(),
            CcwWord::read(512, DATA + 0x5000),
        ],
        0,
    );
    assert!(st.is_ok(), "{st:?}");
    assert_eq!(rig.guest_read(DATA + 0x4000, 512), vec![0xaa; 512]);
    assert_eq!(rig.guest_read(DATA + 0x5000, 512), data[512..].to_vec());
    rig.assert_no_pins();
}

#[test]
fn test_ccw_pci_identity_in_config_space() {
    let mut rig = Rig::new();
    let mut id = [0u8; 4];
    rig.dev
        .region_read(region_index::CONFIG, 0, &mut id)
        .unwrap();
    assert_eq!(u16::from_le_bytes([id[0], id[1]]), 0x1234);
    assert_eq!(u16::from_le_bytes([id[2], id[3]]), 0x0cc1);
    let mut class = [0u8; 4];
    rig.dev
        .region_read(region_index::CONFIG, 8, &mut class)
        .unwrap();
    assert_eq!(u32::from_le_bytes(class) >> 8, 0x018000);
    assert_eq!(rig.reg(regs::ID), regs::MAGIC);
    assert_eq!(
        u64::from(rig.reg(regs::CAPACITY_LO)) | u64::from(rig.reg(regs::CAPACITY_HI)) << 32,
        CAPACITY_BLOCKS
    );
}

/// Start a NOP program and wait (by polling COMPLETED) until it finished, without
/// relying on the interrupt.
fn run_polled(rig: &mut Rig) {
    let before = rig.reg(regs::COMPLETED);
    rig.guest_write(PROGRAM, &driver::encode_program(&[CcwWord::nop()]));
    rig.guest_write(
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
    rig.set_reg(regs::OPB_ADDR_LO, OPB as u32);
    rig.set_reg(regs::START, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while rig.reg(regs::COMPLETED) == before || rig.reg(regs::STATUS) & regs::STATUS_BUSY != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "program did not finish"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn unmask_intx(rig: &mut Rig) {
    rig.dev
        .set_irqs(SetIrqs {
            index: irq_index::INTX,
            start: 0,
            count: 1,
            action: IrqAction::Unmask,
            data: IrqData::None,
        })
        .unwrap();
}

/// INTx is a level: a completion while the line is masked fires at unmask if still
/// unacknowledged, and is forgotten if the guest acknowledged IRQ_STATUS first.
#[test]
fn test_ccw_intx_masked_completion_fires_on_unmask_unless_acked() {
    let mut rig = Rig::with(RigOptions {
        intx: true,
        ..RigOptions::default()
    });
    assert!(rig.run(&[CcwWord::nop()], 0).is_ok()); // fires, INTx now auto-masked
    run_polled(&mut rig); // completes while masked
    assert!(!rig.wait_irq(Duration::from_millis(20)));
    unmask_intx(&mut rig);
    assert!(
        rig.wait_irq(Duration::from_secs(1)),
        "pending level fires on unmask"
    );
    rig.set_reg(regs::IRQ_STATUS, regs::IRQ_ALL);

    run_polled(&mut rig); // completes while masked again
    rig.set_reg(regs::IRQ_STATUS, regs::IRQ_ALL); // guest handles it by polling
    unmask_intx(&mut rig);
    assert!(
        !rig.wait_irq(Duration::from_millis(50)),
        "an acknowledged completion must not fire"
    );
    assert!(
        rig.run(&[CcwWord::nop()], 0).is_ok(),
        "next completion fires"
    );
}
