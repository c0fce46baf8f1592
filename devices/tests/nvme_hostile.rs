//! NVMe: a hostile guest. Every bad field gets the spec's status code (or Controller Fatal
//! Status for queue memory the controller cannot reach), never a panic, and no page stays
//! pinned once the guest lets go.

mod nvme_support;

use std::time::Duration;

use nvme_support::*;
use umdev::testing::{DeviceAccess, Rng, PCI_COMMAND_MASTER};
use umdev_devices::nvme::regs::{self, Doorbell};
use umdev_devices::nvme::spec::{admin_op, io_op, Command, Status};

fn cmd(opcode: u8, cdw: [u32; 6]) -> Command {
    Command {
        opcode,
        cdw,
        ..Default::default()
    }
}

#[test]
fn test_create_queue_with_bad_fields_gets_spec_status() {
    let mut g = Guest::new();
    g.enable();
    assert!(g.set_queues(2).status.is_success());
    let cq = io_cq(1);
    assert_eq!(g.create_cq_at(0, 16, 0, cq), Status::INVALID_QID, "qid 0");
    assert_eq!(
        g.create_cq_at(3, 16, 0, cq),
        Status::INVALID_QID,
        "past the grant"
    );
    assert_eq!(g.create_cq_at(0xffff, 16, 0, cq), Status::INVALID_QID);
    assert_eq!(
        g.create_cq_at(1, 1, 0, cq),
        Status::INVALID_QUEUE_SIZE,
        "one entry"
    );
    assert_eq!(
        g.create_cq_at(1, 2000, 0, cq),
        Status::INVALID_QUEUE_SIZE,
        "past MQES"
    );
    assert_eq!(g.create_cq_at(1, 16, 0, cq + 8), Status::PRP_OFFSET_INVALID);
    assert_eq!(g.create_cq_at(1, 16, 99, cq), Status::INVALID_VECTOR);
    assert_eq!(
        g.create_cq_at(1, 1000, 0, !0xfff_u64),
        Status::INVALID_FIELD,
        "wraps"
    );
    let not_contiguous = Command {
        prp1: cq,
        ..cmd(admin_op::CREATE_CQ, [1 | 15 << 16, 0b10, 0, 0, 0, 0])
    };
    assert_eq!(g.admin(not_contiguous), Status::INVALID_FIELD);
    assert_eq!(
        g.create_sq_at(1, 16, 1, io_sq(1)),
        Status::CQ_INVALID,
        "CQ 1 missing"
    );
    assert_eq!(
        g.create_sq_at(1, 16, 0, io_sq(1)),
        Status::CQ_INVALID,
        "the admin CQ"
    );
    assert_eq!(g.create_cq_at(1, 16, 0, cq), Status::SUCCESS);
    assert_eq!(g.create_cq_at(1, 16, 0, cq), Status::INVALID_QID, "exists");
    assert_eq!(g.create_sq_at(1, 16, 1, io_sq(1)), Status::SUCCESS);
    assert_eq!(
        g.create_sq_at(1, 16, 1, io_sq(1)),
        Status::INVALID_QID,
        "exists"
    );
    g.assert_no_panics();
}

#[test]
fn test_delete_queues_checks_ids_and_order() {
    let mut g = Guest::new();
    g.bring_up(1, 16);
    let del = |op, qid: u32| cmd(op, [qid, 0, 0, 0, 0, 0]);
    assert_eq!(g.admin(del(admin_op::DELETE_SQ, 0)), Status::INVALID_QID);
    assert_eq!(g.admin(del(admin_op::DELETE_SQ, 2)), Status::INVALID_QID);
    assert_eq!(g.admin(del(admin_op::DELETE_CQ, 0)), Status::INVALID_QID);
    assert_eq!(
        g.admin(del(admin_op::DELETE_CQ, 1)),
        Status::INVALID_QUEUE_DELETION
    );
    assert_eq!(g.admin(del(admin_op::DELETE_SQ, 1)), Status::SUCCESS);
    assert_eq!(g.admin(del(admin_op::DELETE_SQ, 1)), Status::INVALID_QID);
    assert_eq!(g.admin(del(admin_op::DELETE_CQ, 1)), Status::SUCCESS);
    assert_eq!(g.pins().0, 0);
    // Recreated many times: nothing accumulates.
    for _ in 0..20 {
        assert_eq!(g.create_cq_at(1, 16, 1, io_cq(1)), Status::SUCCESS);
        assert_eq!(g.create_sq_at(1, 16, 1, io_sq(1)), Status::SUCCESS);
        assert_eq!(g.admin(del(admin_op::DELETE_SQ, 1)), Status::SUCCESS);
        assert_eq!(g.admin(del(admin_op::DELETE_CQ, 1)), Status::SUCCESS);
    }
}

#[test]
fn test_io_with_bad_fields_gets_spec_status_and_leaves_no_pin() {
    let mut g = Guest::new();
    g.bring_up(1, 64);
    let blocks = NS_BYTES / 512;
    let cases: Vec<(Command, Status, &str)> = vec![
        (
            Command {
                nsid: 2,
                ..Guest::rw(false, 0, 1, DATA, 0)
            },
            Status::INVALID_NAMESPACE,
            "nsid",
        ),
        (
            Command {
                nsid: 0,
                ..Guest::rw(true, 0, 1, DATA, 0)
            },
            Status::INVALID_NAMESPACE,
            "nsid 0",
        ),
        (
            Guest::rw(false, blocks, 1, DATA, 0),
            Status::LBA_OUT_OF_RANGE,
            "past the end",
        ),
        (
            Guest::rw(false, blocks - 1, 2, DATA, 0),
            Status::LBA_OUT_OF_RANGE,
            "straddles",
        ),
        (
            Guest::rw(true, u64::MAX, 1, DATA, 0),
            Status::LBA_OUT_OF_RANGE,
            "slba overflow",
        ),
        (
            Guest::rw(false, 0, 1024, DATA, PRP_LISTS),
            Status::INVALID_FIELD,
            "past MDTS",
        ),
        (
            Guest::rw(false, 0, 1, DATA + 2, 0),
            Status::PRP_OFFSET_INVALID,
            "PRP1 unaligned",
        ),
        (
            Guest::rw(false, 0, 16, DATA, DATA + 0x1010),
            Status::PRP_OFFSET_INVALID,
            "PRP2 offset",
        ),
        (
            Guest::rw(false, 0, 24, DATA, HOLE),
            Status::DATA_TRANSFER_ERROR,
            "list unmapped",
        ),
        (
            Guest::rw(false, 0, 8, HOLE, 0),
            Status::DATA_TRANSFER_ERROR,
            "data unmapped",
        ),
        (
            Guest::rw(true, 0, 16, DATA, HOLE),
            Status::DATA_TRANSFER_ERROR,
            "PRP2 unmapped",
        ),
        (
            Command {
                flags: 0x40,
                ..Guest::rw(false, 0, 1, DATA, 0)
            },
            Status::INVALID_FIELD,
            "SGL",
        ),
        (
            Command {
                flags: 0x01,
                ..Guest::rw(false, 0, 1, DATA, 0)
            },
            Status::INVALID_FIELD,
            "fused",
        ),
        (
            Command {
                nsid: 1,
                ..cmd(0x7f, [0; 6])
            },
            Status::INVALID_OPCODE,
            "opcode",
        ),
        (
            Command {
                nsid: 5,
                ..cmd(io_op::FLUSH, [0; 6])
            },
            Status::INVALID_NAMESPACE,
            "flush nsid",
        ),
        (
            Command {
                nsid: 1,
                ..cmd(io_op::WRITE_ZEROES, [blocks as u32, 0, 0, 0, 0, 0])
            },
            Status::LBA_OUT_OF_RANGE,
            "wz",
        ),
    ];
    for (c, want, what) in cases {
        let got = g.run(1, c).status;
        assert_eq!(got, want, "{what}");
        assert_eq!(g.pins().0, 0, "{what}: data pins left");
    }
    // A PRP list whose second entry has an offset; a list chained into a hole.
    g.write_u64s(PRP_LISTS, &[DATA + 0x1000, DATA + 0x2008]);
    assert_eq!(
        g.run(1, Guest::rw(false, 0, 24, DATA, PRP_LISTS)).status,
        Status::PRP_OFFSET_INVALID
    );
    let mut chain: Vec<u64> = (1..512).map(|i| DATA + i * 0x1000).collect();
    chain.push(HOLE);
    g.write_u64s(PRP_LISTS, &chain);
    g.set_reg32(0, 0); // read-only register: ignored
    let c = Guest::rw(false, 0, 513 * 8, DATA, PRP_LISTS);
    assert_eq!(
        g.run(1, c).status,
        Status::INVALID_FIELD,
        "past MDTS before any list read"
    );
    // DSM ranges outside the namespace, or in a hole.
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&(blocks - 4).to_le_bytes());
    g.mem_write(DATA, &range);
    let dsm = Command {
        nsid: 1,
        prp1: DATA,
        ..cmd(io_op::DSM, [0, 4, 0, 0, 0, 0])
    };
    assert_eq!(g.run(1, dsm).status, Status::LBA_OUT_OF_RANGE);
    assert_eq!(
        g.run(1, Command { prp1: HOLE, ..dsm }).status,
        Status::DATA_TRANSFER_ERROR
    );
    // Still healthy.
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(4, 4096)),
        Status::SUCCESS
    );
    assert_eq!(g.csts() & regs::CSTS_CFS, 0);
    assert_eq!(g.pins().0, 0);
    g.assert_no_panics();
}

#[test]
fn test_admin_with_bad_fields_gets_spec_status() {
    let mut g = Guest::new();
    g.enable();
    assert_eq!(g.identify(0x55, 0, DATA), Status::INVALID_FIELD, "CNS");
    assert_eq!(g.identify(0, 0, DATA), Status::INVALID_NAMESPACE);
    assert_eq!(g.identify(0, 2, DATA), Status::INVALID_NAMESPACE);
    assert_eq!(g.identify(3, 7, DATA), Status::INVALID_NAMESPACE);
    assert_eq!(g.identify(1, 0, HOLE), Status::DATA_TRANSFER_ERROR);
    assert_eq!(g.identify(1, 0, DATA + 1), Status::PRP_OFFSET_INVALID);
    let log = |lid: u32, numd: u32, off: u32| Command {
        prp1: DATA,
        ..cmd(admin_op::GET_LOG_PAGE, [lid | numd << 16, 0, off, 0, 0, 0])
    };
    assert_eq!(g.admin(log(0x42, 127, 0)), Status::INVALID_LOG_PAGE);
    assert_eq!(
        g.admin(log(2, 127, 4096)),
        Status::INVALID_FIELD,
        "offset past the page"
    );
    assert_eq!(
        g.admin(log(2, 127, 2)),
        Status::INVALID_FIELD,
        "offset not dword aligned"
    );
    let (p1, p2) = g.prps(DATA, 256 << 10);
    let full = Command {
        prp1: p1,
        prp2: p2,
        ..cmd(admin_op::GET_LOG_PAGE, [2 | 0xffff << 16, 0, 0, 0, 0, 0])
    };
    assert_eq!(g.admin(full), Status::SUCCESS, "256 KiB is MDTS");
    let big = Command {
        prp1: DATA,
        ..cmd(admin_op::GET_LOG_PAGE, [2 | 0xffff << 16, 1, 0, 0, 0, 0])
    };
    assert_eq!(g.admin(big), Status::INVALID_FIELD, "past MDTS");
    let set_q = |v: u32| cmd(admin_op::SET_FEATURES, [7, v, 0, 0, 0, 0]);
    assert_eq!(g.admin(set_q(0xffff)), Status::INVALID_FIELD);
    assert_eq!(
        g.admin(cmd(admin_op::SET_FEATURES, [7 | 1 << 31, 0, 0, 0, 0, 0])),
        Status::FEATURE_NOT_SAVEABLE
    );
    assert_eq!(
        g.admin(cmd(admin_op::GET_FEATURES, [0x77, 0, 0, 0, 0, 0])),
        Status::INVALID_FIELD
    );
    assert_eq!(
        g.admin(cmd(admin_op::GET_FEATURES, [9, 500, 0, 0, 0, 0])),
        Status::INVALID_FIELD,
        "vector"
    );
    assert_eq!(
        g.admin(cmd(admin_op::GET_FEATURES, [6 | 5 << 8, 0, 0, 0, 0, 0])),
        Status::INVALID_FIELD,
        "SEL"
    );
    assert_eq!(g.admin(cmd(0xee, [0; 6])), Status::INVALID_OPCODE);
    assert_eq!(
        g.admin(Command {
            flags: 0x80,
            ..cmd(admin_op::IDENTIFY, [1, 0, 0, 0, 0, 0])
        }),
        Status::INVALID_FIELD
    );
    // Four AERs are the limit (AERL = 3); the fifth fails at once.
    for _ in 0..4 {
        g.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    }
    assert!(g.reap_within(0, Duration::from_millis(30)).is_none());
    g.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    assert_eq!(g.reap(0).status, Status::AER_LIMIT);
    g.assert_no_panics();
}

#[test]
fn test_doorbell_of_missing_queue_is_an_async_event() {
    let mut g = Guest::new();
    g.enable();
    let aer = g.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    g.ring(Doorbell::SqTail(3), 1);
    let c = g.reap(0);
    assert_eq!(
        (c.cid, c.result),
        (aer, 0x01 << 16),
        "invalid doorbell register"
    );
    // Masked until the error log is read: a second event waits.
    let aer2 = g.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    g.ring(Doorbell::CqHead(9), 0);
    assert!(g.reap_within(0, Duration::from_millis(30)).is_none());
    let log = Command {
        prp1: DATA,
        ..cmd(admin_op::GET_LOG_PAGE, [1 | 15 << 16, 0, 0, 0, 0, 0])
    };
    assert_eq!(g.admin(log), Status::SUCCESS);
    g.ring(Doorbell::CqHead(9), 0);
    let c = g.reap(0);
    assert_eq!(c.cid, aer2);
}

#[test]
fn test_bad_enable_is_controller_fatal_and_reset_recovers() {
    let mut g = Guest::new();
    for cc in [
        0x0046_0001 | 1 << 7,
        0x0046_0001 | 1 << 4,
        0x0046_0001 | 1 << 11,
    ] {
        g.try_enable(cc);
        assert!(g.wait_csts(regs::CSTS_CFS, regs::CSTS_CFS), "CC {cc:#x}");
        assert_eq!(g.csts() & regs::CSTS_RDY, 0);
    }
    g.set_reg32(regs::CC, 0);
    assert!(g.wait_csts(0xf, 0));
    // Admin queue not page aligned.
    g.set_reg32(regs::CC, 0);
    g.vmm.write64(0, regs::ASQ_LO, ASQ + 0x40).unwrap();
    g.set_reg32(regs::CC, 0x0046_0001);
    assert!(g.wait_csts(regs::CSTS_CFS, regs::CSTS_CFS));
    g.enable();
    assert_eq!(g.admin(cmd(admin_op::KEEP_ALIVE, [0; 6])), Status::SUCCESS);
}

#[test]
fn test_admin_queue_in_unmapped_memory_is_fatal_without_pins() {
    let mut g = Guest::new();
    g.set_reg32(regs::AQA, 15 | 15 << 16);
    g.vmm.write64(0, regs::ASQ_LO, HOLE).unwrap();
    g.vmm.write64(0, regs::ACQ_LO, ACQ).unwrap();
    g.set_reg32(regs::CC, 0x0046_0001);
    assert!(g.wait_csts(regs::CSTS_RDY, regs::CSTS_RDY));
    g.ring(Doorbell::SqTail(0), 1);
    assert!(
        g.wait_csts(regs::CSTS_CFS, regs::CSTS_CFS),
        "fetch from a hole"
    );
    // Doorbells after CFS are ignored.
    g.ring(Doorbell::SqTail(0), 2);
    g.set_reg32(regs::CC, 0);
    assert!(g.wait_csts(0xf, 0));
    assert_eq!(g.pins(), (0, 0, 0));
    g.assert_no_panics();
}

#[test]
fn test_unmap_with_queues_live_drops_ring_pins_then_fatal() {
    let mut g = Guest::new();
    g.bring_up(2, 32);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(1, 65536)),
        Status::SUCCESS
    );
    assert!(g.pins().1 >= 4, "rings pinned");
    g.vmm.dma_unmap(RAM, RAM_SIZE).unwrap();
    g.server.assert_space_unpinned();
    assert_eq!(
        g.server.dma().stats().leaked_pins_released,
        0,
        "notifier dropped every pin"
    );
    assert_eq!(g.pins().1, 0);
    // The guest rings anyway: the ring cannot be pinned again -> fatal.
    g.ring(Doorbell::SqTail(1), 5);
    assert!(g.wait_csts(regs::CSTS_CFS, regs::CSTS_CFS));
    g.assert_no_panics();
}

#[test]
fn test_unmap_and_remap_under_io_never_leaks_pins() {
    let mut g = Guest::new();
    g.bring_up(2, 64);
    let fd = g.vmm.ram().try_clone_fd().unwrap();
    use std::os::fd::AsFd;
    for round in 0..30 {
        // Queue up I/O on both queues, then pull the memory away under it.
        for q in 1..=2u16 {
            for i in 0..8u64 {
                g.push(
                    q,
                    Guest::rw(round % 2 == 0, i * 64, 64, DATA + i * 0x8000, PRP_LISTS),
                );
            }
            g.kick(q);
        }
        g.vmm.dma_unmap(RAM, RAM_SIZE).unwrap();
        assert_eq!(
            g.server.dma().stats().leaked_pins_released,
            0,
            "round {round}"
        );
        g.vmm.dma_map_fd(RAM, RAM_SIZE, fd.as_fd(), 0).unwrap();
        if g.csts() & regs::CSTS_CFS != 0 {
            g.vmm.reset().unwrap();
            g.vmm.enable_device().unwrap();
            g.bring_up(2, 64);
        } else {
            // Drain what completed; the rest completes now that memory is back.
            std::thread::sleep(Duration::from_millis(2));
            g.disable();
            g.bring_up(2, 64);
        }
    }
    g.disable();
    g.server.assert_space_unpinned();
    g.assert_no_panics();
}

#[test]
fn test_bus_master_cleared_stops_dma_as_fatal() {
    let mut g = Guest::new();
    g.bring_up(1, 16);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(1, 4096)),
        Status::SUCCESS
    );
    let cmd = g.vmm.command().unwrap();
    g.vmm.set_command(cmd & !PCI_COMMAND_MASTER).unwrap();
    g.mem_write(DATA, &[0xaa; 4096]);
    let before = g.mem_read(io_cq(1), 256);
    g.submit(1, Guest::rw(true, 0, 8, DATA, 0));
    assert!(
        g.wait_csts(regs::CSTS_CFS, regs::CSTS_CFS),
        "DMA with Bus Master clear"
    );
    assert_eq!(g.mem_read(io_cq(1), 256), before, "nothing posted");
    assert_eq!(
        image_bytes(&g.image, 0, 4096).unwrap(),
        pattern(1, 4096),
        "nothing written"
    );
    assert_eq!(g.pins().0, 0);
}

#[test]
fn test_full_completion_queue_holds_back_until_reaped() {
    let mut g = Guest::new();
    g.enable();
    assert!(g.set_queues(1).status.is_success());
    g.mem_write(io_cq(1), &[0u8; 64]);
    assert_eq!(g.create_cq_at(1, 4, 1, io_cq(1)), Status::SUCCESS);
    assert_eq!(g.create_sq_at(1, 16, 1, io_sq(1)), Status::SUCCESS);
    g.queues.push(Queue {
        qid: 1,
        sq: io_sq(1),
        cq: io_cq(1),
        size: 4,
        tail: 0,
        head: 0,
        phase: true,
    });
    // The SQ side has 16 entries but the driver's Queue tracks the CQ: push by hand.
    let mut cids = Vec::new();
    for i in 0..12u64 {
        let mut c = Guest::rw(false, i, 1, DATA + i * 0x1000, 0);
        c.cid = 100 + i as u16;
        g.mem_write(io_sq(1) + i * 64, &c.encode());
        cids.push(c.cid);
    }
    g.ring(Doorbell::SqTail(1), 12);
    let mut got = Vec::new();
    for _ in 0..12 {
        got.push(g.reap(1).cid);
    }
    got.sort_unstable();
    assert_eq!(
        got, cids,
        "each exactly once, none lost while the CQ was full"
    );
}

#[test]
fn test_random_register_writes_never_panic() {
    let mut g = Guest::new();
    g.bring_up(1, 16);
    let mut rng = Rng::new(0x5eed);
    for _ in 0..2000 {
        let off = rng.below(0x1100) & !3;
        let v = rng.next_u64();
        match rng.below(3) {
            0 => {
                let _ = g.vmm.write32(0, off, v as u32);
            }
            1 => {
                let _ = g.vmm.write64(0, off & !7, v);
            }
            _ => {
                let _ = g.vmm.read32(0, off);
            }
        }
        if rng.chance(1) {
            let _ = g.vmm.write8(0, rng.below(0x2000), v as u8);
        }
    }
    g.set_reg32(regs::CC, 0);
    assert!(g.wait_csts(regs::CSTS_RDY, 0));
    g.assert_no_panics();
    g.enable();
    assert_eq!(g.admin(cmd(admin_op::KEEP_ALIVE, [0; 6])), Status::SUCCESS);
}

#[test]
fn test_doorbells_on_a_disabled_controller_do_nothing() {
    let mut g = Guest::new();
    // Before any enable: no queue exists, nothing runs, nothing is reported later.
    g.ring(Doorbell::SqTail(0), 5);
    g.ring(Doorbell::CqHead(0), 3);
    g.ring(Doorbell::SqTail(1), 1);
    assert_eq!(g.csts(), 0);
    g.enable();
    // The admin queue starts empty: the first command is the one at index 0.
    assert_eq!(g.admin(cmd(admin_op::KEEP_ALIVE, [0; 6])), Status::SUCCESS);
    // Disabled again with I/O queues: their doorbells are ignored too.
    g.bring_up(1, 16);
    g.disable();
    g.ring(Doorbell::SqTail(1), 3);
    assert_eq!(g.csts(), 0);
    assert_eq!(g.pins(), (0, 0, 0));
    g.assert_no_panics();
}

#[test]
fn test_random_commands_never_panic_or_leak_pins() {
    let mut g = Guest::new();
    g.bring_up(2, 32);
    let mut rng = Rng::new(0xc0ffee);
    // Data addresses: valid, unaligned, a list area with stale contents, unmapped, the top of
    // the address space (the test's queues are left out, so the driver's view stays valid).
    let addrs = [0, DATA, DATA + 4, DATA + 0x1ff8, PRP_LISTS, HOLE, !3u64];
    for i in 0..600u32 {
        // Admin commands: those that cannot take the test's queues away (no create/delete,
        // no Doorbell Buffer Config); I/O commands: any opcode.
        let admin = rng.chance(30);
        let opcode = if admin {
            rng.pick(&[0x02u8, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x18, 0x80, 0xff])
        } else {
            rng.below(256) as u8
        };
        let mut cdw = [0u32; 6];
        for d in &mut cdw {
            *d = match rng.below(4) {
                0 => 0,
                1 => rng.below(64) as u32,
                2 => u32::MAX,
                _ => rng.next_u64() as u32,
            };
        }
        let c = Command {
            opcode,
            flags: if rng.chance(10) {
                rng.below(256) as u8
            } else {
                0
            },
            nsid: rng.pick(&[0, 1, 1, 1, 2, u32::MAX]),
            prp1: rng.pick(&addrs),
            prp2: rng.pick(&addrs),
            cdw,
            ..Default::default()
        };
        let qid = if admin { 0 } else { 1 + (i % 2) as u16 };
        // An AER stays outstanding: keep at most a few, and never wait for them.
        if admin && opcode == 0x0c {
            continue;
        }
        let cid = g.submit(qid, c);
        let done = g.reap(qid);
        assert_eq!((done.sq_id, done.cid), (qid, cid), "command {i}: {c:?}");
        assert_eq!(g.csts() & regs::CSTS_CFS, 0, "command {i}: {c:?}");
    }
    assert_eq!(g.pins().0, 0);
    g.assert_no_panics();
}
