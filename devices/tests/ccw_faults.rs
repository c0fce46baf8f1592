//! Every bad-program case ends in its documented status (protocol-docs/devices/ccw.md,
//! "Faults"), moves no data, and leaves no pins — under Translate and under Lock with a
//! limit.

mod ccw_support;

use ccw_support::*;
use umdev::dma::PinPolicy;
use umdev_devices::ccw::driver::{
    self, cmd, cstat, dstat, flags, regs, CcwWord, Fault, OperationBlock, StatusBlock,
};

const ENDS: u8 = dstat::CHANNEL_END | dstat::DEVICE_END;

/// One bad-program scenario: set up guest memory, return the program to run.
struct Case {
    name: &'static str,
    setup: fn(&Rig) -> Vec<CcwWord>,
    fault: Fault,
    cstat: u8,
    /// Expected failing CCW address.
    ccw_addr: u64,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "tic loop",
            setup: |_| {
                vec![
                    CcwWord::nop().chain(),
                    CcwWord::nop().chain(),
                    CcwWord::tic(PROGRAM),
                ]
            },
            fault: Fault::Loop,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "tic to tic",
            setup: |rig| {
                rig.guest_write(PROGRAM + 0x200, &CcwWord::tic(PROGRAM + 0x300).to_bytes());
                rig.guest_write(PROGRAM + 0x300, &CcwWord::nop().to_bytes());
                vec![CcwWord::nop().chain(), CcwWord::tic(PROGRAM + 0x200)]
            },
            fault: Fault::TicToTic,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM + 0x200,
        },
        Case {
            name: "tic first",
            setup: |_| vec![CcwWord::tic(PROGRAM + 16), CcwWord::nop()],
            fault: Fault::TicFirst,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "program too long",
            setup: |_| {
                let mut v = vec![CcwWord::nop().chain(); 255];
                v.push(CcwWord::nop().chain());
                v.push(CcwWord::nop());
                v
            },
            fault: Fault::ProgramTooLong,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM + 256 * 16,
        },
        Case {
            name: "tic to unmapped ccw",
            setup: |_| vec![CcwWord::nop().chain(), CcwWord::tic(HOLE)],
            fault: Fault::CcwUnreadable,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: HOLE,
        },
        Case {
            name: "tic to unaligned ccw",
            setup: |_| vec![CcwWord::nop().chain(), CcwWord::tic(PROGRAM + 0x404)],
            fault: Fault::CcwUnaligned,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM + 0x404,
        },
        Case {
            name: "direct data address unmapped",
            setup: |_| vec![CcwWord::read(512, HOLE)],
            fault: Fault::DataAddressInvalid,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "second ccw data partially unmapped",
            setup: |_| {
                vec![
                    CcwWord::write(512, DATA).chain(),
                    CcwWord::write(8192, RAM + RAM_SIZE - 4096),
                ]
            },
            fault: Fault::DataAddressInvalid,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM + 16,
        },
        Case {
            name: "idaw page unmapped",
            setup: |rig| {
                rig.guest_write(IDAWS, &driver::encode_idaws(&[DATA, HOLE]));
                vec![CcwWord::write(8192, IDAWS).ida(2)]
            },
            fault: Fault::DataAddressInvalid,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "count past idaw list",
            setup: |rig| {
                rig.guest_write(IDAWS, &driver::encode_idaws(&[DATA + 0x800, DATA + 0x3000]));
                vec![CcwWord::read(0x800 + 4096 + 1, IDAWS).ida(2)]
            },
            fault: Fault::CountPastIdawList,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "unaligned later idaw",
            setup: |rig| {
                rig.guest_write(IDAWS, &driver::encode_idaws(&[DATA, DATA + 0x3010]));
                vec![CcwWord::read(6000, IDAWS).ida(2)]
            },
            fault: Fault::IdawUnaligned,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "unaligned idaw list address",
            setup: |rig| {
                rig.guest_write(IDAWS + 4, &driver::encode_idaws(&[DATA]));
                vec![CcwWord::read(100, IDAWS + 4).ida(1)]
            },
            fault: Fault::IdawListUnaligned,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "idaw list unmapped",
            setup: |_| vec![CcwWord::read(100, HOLE).ida(1)],
            fault: Fault::IdawListUnreadable,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "idaw count zero",
            setup: |_| vec![CcwWord::read(100, IDAWS).ida(0)],
            fault: Fault::IdawCountInvalid,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "zero count",
            setup: |_| vec![CcwWord::nop().chain(), CcwWord::write(0, DATA)],
            fault: Fault::ZeroCount,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM + 16,
        },
        Case {
            name: "invalid command",
            setup: |_| vec![CcwWord::new(0x42, 10, DATA)],
            fault: Fault::InvalidCommand,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "reserved flag",
            setup: |_| vec![CcwWord::read(10, DATA).with_flags(0x01)],
            fault: Fault::InvalidFlags,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "read into read-only page",
            setup: |_| vec![CcwWord::read(512, ROM)],
            fault: Fault::DataProtection,
            cstat: cstat::PROTECTION_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "sense into read-only page",
            setup: |_| {
                vec![
                    CcwWord::write(512, ROM).chain(),
                    CcwWord::sense(32, ROM + 0x1000),
                ]
            },
            fault: Fault::DataProtection,
            cstat: cstat::PROTECTION_CHECK,
            ccw_addr: PROGRAM + 16,
        },
        Case {
            name: "data address overflow",
            setup: |_| vec![CcwWord::read(512, u64::MAX - 100)],
            fault: Fault::DataAddressInvalid,
            cstat: cstat::PROGRAM_CHECK,
            ccw_addr: PROGRAM,
        },
        Case {
            name: "past end of image",
            setup: |_| {
                vec![
                    CcwWord::write(512, DATA).chain(),
                    CcwWord::read(65535, DATA),
                ]
            },
            fault: Fault::OutOfRange,
            cstat: 0,
            ccw_addr: PROGRAM + 16,
        },
    ]
}

fn check_case(rig: &mut Rig, case: &Case) {
    let program = (case.setup)(rig);
    // Past-end case: start near the end of the image.
    let block = if case.fault == Fault::OutOfRange {
        CAPACITY_BLOCKS - 64
    } else {
        0
    };
    let image_before = rig.image_bytes(0, 4096);
    let st = rig.run(&program, block);
    assert_eq!(st.fault(), Some(case.fault), "{}: {st:?}", case.name);
    assert_eq!(st.channel_status, case.cstat, "{}", case.name);
    let want_dstat = if case.fault == Fault::OutOfRange {
        ENDS | dstat::UNIT_CHECK
    } else {
        ENDS
    };
    assert_eq!(st.device_status, want_dstat, "{}", case.name);
    assert_eq!(st.ccw_addr, case.ccw_addr, "{}", case.name);
    assert_eq!(st.transferred, 0, "{}: no data may move", case.name);
    assert_eq!(rig.image_bytes(0, 4096), image_before, "{}", case.name);
    let (d, c, f) = driver::decode_last_status(rig.reg(regs::LAST_STATUS));
    assert_eq!(
        (d, c, f),
        (want_dstat, case.cstat, Some(case.fault)),
        "{}",
        case.name
    );
    rig.assert_no_pins();
}

#[test]
fn test_ccw_bad_programs_end_in_documented_status_translate() {
    let mut rig = Rig::new();
    for case in cases() {
        check_case(&mut rig, &case);
        // The device still works after each bad program.
        assert!(rig.run(&[CcwWord::nop()], 0).is_ok(), "after {}", case.name);
    }
    assert_eq!(rig.space.stats().leaked_pins_released, 0);
}

#[test]
fn test_ccw_bad_programs_end_in_documented_status_lock_with_limit() {
    let mut rig = Rig::with(RigOptions {
        policy: PinPolicy::Lock,
        lock_limit: Some(256 << 10),
        intx: false,
    });
    for case in cases() {
        check_case(&mut rig, &case);
    }
    assert_eq!(rig.space.stats().leaked_pins_released, 0);
}

#[test]
fn test_ccw_unmapped_status_block_sets_status_lost() {
    let mut rig = Rig::new();
    rig.guest_write(
        PROGRAM,
        &driver::encode_program(&[CcwWord::write(512, DATA)]),
    );
    let opb = OperationBlock {
        program: PROGRAM,
        block: 0,
        status: HOLE,
        flags: 0,
        reserved: 0,
    };
    rig.guest_write(OPB, &opb.to_bytes());
    let irq = rig.submit_at(OPB);
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    let (d, c, f) = driver::decode_last_status(rig.reg(regs::LAST_STATUS));
    assert_eq!(
        (d, c, f),
        (ENDS, cstat::PROGRAM_CHECK, Some(Fault::StatusBlockInvalid))
    );
    rig.assert_no_pins();
}

#[test]
fn test_ccw_read_only_status_block_sets_status_lost_after_io() {
    let mut rig = Rig::new();
    rig.guest_write(DATA, &[7u8; 512]);
    rig.guest_write(
        PROGRAM,
        &driver::encode_program(&[CcwWord::write(512, DATA)]),
    );
    let opb = OperationBlock {
        program: PROGRAM,
        block: 3,
        status: ROM + 0x100,
        flags: 0,
        reserved: 0,
    };
    rig.guest_write(OPB, &opb.to_bytes());
    let irq = rig.submit_at(OPB);
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    let (d, c, f) = driver::decode_last_status(rig.reg(regs::LAST_STATUS));
    assert_eq!((d, c, f), (ENDS, 0, Some(Fault::None)));
    assert_eq!(rig.image_bytes(3 * 512, 512), vec![7u8; 512]);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_unmapped_operation_block_sets_status_lost() {
    let mut rig = Rig::new();
    let irq = rig.submit_at(HOLE);
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    let (_, c, f) = driver::decode_last_status(rig.reg(regs::LAST_STATUS));
    assert_eq!(
        (c, f),
        (cstat::PROGRAM_CHECK, Some(Fault::OpBlockUnreadable))
    );
    let irq = rig.submit_at(OPB + 4);
    assert_eq!(irq, regs::IRQ_DONE | regs::IRQ_STATUS_LOST);
    let (_, _, f) = driver::decode_last_status(rig.reg(regs::LAST_STATUS));
    assert_eq!(f, Some(Fault::OpBlockUnaligned));
    rig.assert_no_pins();
}

#[test]
fn test_ccw_reserved_operation_block_flags_program_check() {
    let mut rig = Rig::new();
    let st = rig.run_opb(
        &[CcwWord::nop()],
        OperationBlock {
            program: PROGRAM,
            block: 0,
            status: STATUS,
            flags: 0x8000_0000,
            reserved: 0,
        },
    );
    assert_eq!(st.fault(), Some(Fault::OpBlockReserved));
    assert_eq!(st.channel_status, cstat::PROGRAM_CHECK);
}

#[test]
fn test_ccw_start_block_past_capacity_unit_check() {
    let mut rig = Rig::new();
    let st = rig.run(&[CcwWord::nop()], u64::MAX);
    assert_eq!(st.fault(), Some(Fault::OutOfRange));
    let st: StatusBlock = rig.run(&[CcwWord::nop()], CAPACITY_BLOCKS + 1);
    assert_eq!(st.fault(), Some(Fault::OutOfRange));
    assert_eq!(st.device_status & dstat::UNIT_CHECK, dstat::UNIT_CHECK);
}

#[test]
fn test_ccw_cd_on_sense_is_invalid_flags() {
    let mut rig = Rig::new();
    let st = rig.run(
        &[
            CcwWord::new(cmd::SENSE, 32, SENSE_BUF).with_flags(flags::CD),
            CcwWord::nop(),
        ],
        0,
    );
    assert_eq!(st.fault(), Some(Fault::InvalidFlags));
}

mod random_programs {
    use super::*;
    use proptest::prelude::*;

    /// Addresses a random CCW may point at: data pages, the IDAW area, the program area,
    /// the read-only window, a hole, misaligned and wrapping values.
    fn addr() -> impl Strategy<Value = u64> {
        prop_oneof![
            (0u64..64).prop_map(|i| DATA + i * 0x800),
            (0u64..8).prop_map(|i| IDAWS + i * 8),
            (0u64..16).prop_map(|i| PROGRAM + i * 16),
            (0u64..16).prop_map(|i| ROM + i * 0x400),
            Just(HOLE),
            any::<u64>(),
        ]
    }

    fn word() -> impl Strategy<Value = CcwWord> {
        (
            prop_oneof![
                Just(cmd::READ),
                Just(cmd::WRITE),
                Just(cmd::NOP),
                Just(cmd::SENSE),
                Just(cmd::TIC),
                any::<u8>()
            ],
            prop_oneof![
                Just(0u8),
                Just(flags::CC),
                Just(flags::CD),
                Just(flags::IDA | flags::CC),
                Just(flags::IDA),
                any::<u8>()
            ],
            prop_oneof![1u16..600, Just(0u16), any::<u16>()],
            prop_oneof![Just(0u32), 1u32..4, any::<u32>()],
            addr(),
        )
            .prop_map(|(cmd, flags, count, idaw_count, addr)| CcwWord {
                cmd,
                flags,
                count,
                idaw_count,
                addr,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Random programs and IDAW lists always end in a stored status with a documented
        /// fault code; the device never hangs and never keeps a pin.
        #[test]
        fn test_ccw_random_programs_end_with_documented_status_and_no_pins(
            words in prop::collection::vec(word(), 1..16),
            idaws in prop::collection::vec(addr(), 0..8),
            block in prop_oneof![0u64..64, Just(CAPACITY_BLOCKS - 1), any::<u64>()],
        ) {
            let mut rig = Rig::new();
            rig.guest_write(IDAWS, &driver::encode_idaws(&idaws));
            let st = rig.run(&words, block);
            let fault = st.fault();
            prop_assert!(fault.is_some(), "unknown fault code {}", st.fault);
            let (d, c) = fault.unwrap().status();
            prop_assert_eq!((st.device_status, st.channel_status), (d, c));
            rig.assert_no_pins();
        }
    }
}

/// A data page in a DMA mapping without a file descriptor cannot be pinned: the program
/// ends with DataAddressInvalid (program check) and moves nothing.
#[test]
fn test_ccw_data_in_fdless_mapping_program_check() {
    let mut rig = Rig::new();
    rig.space
        .map(umdev::dma::DmaMapping {
            iova: HOLE,
            size: 0x10000,
            prot: umdev::dma::Prot::RW,
            fd: None,
            offset: 0,
        })
        .unwrap();
    let st = rig.run(&[CcwWord::read(512, HOLE + 0x1000)], 0);
    assert_eq!(st.fault(), Some(Fault::DataAddressInvalid), "{st:?}");
    assert_eq!(st.channel_status, cstat::PROGRAM_CHECK);
    assert_eq!(st.transferred, 0);
    rig.assert_no_pins();
}
