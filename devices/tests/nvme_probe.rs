//! NVMe: what Linux's `nvme` driver does at probe and in normal I/O, through the socket.

mod nvme_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvme_support::*;
use umdev::dma::{DmaConfig, PinPolicy};
use umdev::testing::DeviceAccess;
use umdev_devices::nvme::regs::{self, Doorbell};
use umdev_devices::nvme::spec::{admin_op, io_op, Command, Status};

#[test]
fn test_pci_identity_is_nvme_class_with_msix() {
    let mut g = Guest::new();
    let class = g.vmm.read32(7, 0x08).unwrap() >> 8;
    assert_eq!(class, 0x01_08_02);
    assert!(
        g.vmm.find_capability(0x11).unwrap().is_some(),
        "MSI-X capability"
    );
}

#[test]
fn test_registers_after_reset_match_nvme_1_4() {
    let mut g = Guest::new();
    let cap = u64::from(g.reg32(regs::CAP_LO)) | u64::from(g.reg32(regs::CAP_HI)) << 32;
    assert_eq!(cap & 0xffff, 1023, "MQES");
    assert_eq!((cap >> 16) & 1, 1, "CQR");
    assert_eq!((cap >> 32) & 0xf, 0, "DSTRD");
    assert_eq!((cap >> 37) & 1, 1, "CSS NVM");
    assert_eq!(g.reg32(regs::VS), 0x0001_0400);
    assert_eq!(g.csts(), 0);
    // 8-byte read of CAP, as lo_hi_readq's halves.
    assert_eq!(g.vmm.read64(0, regs::CAP_LO).unwrap(), cap);
}

#[test]
fn test_enable_identify_and_queues_like_linux_probe() {
    let mut g = Guest::new();
    g.enable();
    let buf = DATA;
    assert_eq!(g.identify(1, 0, buf), Status::SUCCESS);
    let id = g.mem_read(buf, 4096);
    assert_eq!(&id[0x200..0x202], &[0x66, 0x44], "SQES/CQES");
    assert_eq!(
        u32::from_le_bytes(id[0x204..0x208].try_into().unwrap()),
        1,
        "NN"
    );
    assert_eq!(
        u32::from_le_bytes(id[0x50..0x54].try_into().unwrap()),
        0x10400,
        "VER"
    );
    assert_eq!(id[0x4d], 6, "MDTS");
    assert_eq!(
        u32::from_le_bytes(id[0x218..0x21c].try_into().unwrap()),
        0,
        "SGLS"
    );

    assert_eq!(g.identify(2, 0, buf), Status::SUCCESS);
    assert_eq!(
        &g.mem_read(buf, 8),
        &[1, 0, 0, 0, 0, 0, 0, 0],
        "active list"
    );
    assert_eq!(g.identify(2, 1, buf), Status::SUCCESS);
    assert_eq!(&g.mem_read(buf, 4), &[0, 0, 0, 0]);
    assert_eq!(g.identify(3, 1, buf), Status::SUCCESS);
    assert_eq!(g.mem_read(buf, 2), [2, 16], "NGUID descriptor");
    assert_eq!(g.identify(0, 1, buf), Status::SUCCESS);
    let ns = g.mem_read(buf, 4096);
    let nsze = u64::from_le_bytes(ns[0..8].try_into().unwrap());
    assert_eq!(nsze, NS_BYTES / 512);
    assert_eq!(ns[0x82], 9, "LBADS");

    let c = g.set_queues(2);
    assert!(c.status.is_success());
    assert_eq!(c.result, 1 | 1 << 16);
    g.create_pair(1, 64);
    g.create_pair(2, 64);
    g.assert_no_panics();
}

#[test]
fn test_set_queues_grants_at_most_the_configured_limit() {
    let mut g = Guest::new();
    g.enable();
    let c = g.set_queues(64);
    assert_eq!(c.result, 3 | 3 << 16, "4 I/O queues configured");
    // Queue 5 is past the grant.
    assert_eq!(g.create_cq_at(5, 16, 0, io_cq(5)), Status::INVALID_QID);
}

#[test]
fn test_write_read_verify_and_image_holds_data() {
    let mut g = Guest::new();
    g.bring_up(2, 64);
    // 1, 2 and 32 pages, with a PRP1 offset, on both queues.
    for (i, (len, off)) in [
        (512usize, 0u64),
        (8192, 0),
        (128 << 10, 0x200),
        (4096, 0x800),
    ]
    .into_iter()
    .enumerate()
    {
        let qid = 1 + (i % 2) as u16;
        let data = pattern(i as u64, len);
        let slba = 64 * i as u64 + 1;
        assert_eq!(
            g.write_blocks(qid, slba, DATA + off, &data),
            Status::SUCCESS
        );
        let (s, back) = g.read_blocks(qid, slba, DATA + 0x20_0000 + off, len);
        assert_eq!(s, Status::SUCCESS);
        assert_eq!(back, data, "read back {len} bytes");
        assert_eq!(image_bytes(&g.image, slba * 512, len).unwrap(), data);
    }
    let flush = Command {
        opcode: io_op::FLUSH,
        nsid: 1,
        ..Default::default()
    };
    assert_eq!(g.run(1, flush).status, Status::SUCCESS);
    assert_eq!(g.pins().0, 0, "no data page left pinned");
    g.assert_no_panics();
}

#[test]
fn test_contiguous_128k_io_is_one_pinned_run() {
    // Populate: one residency syscall per coalesced run.
    let dma = DmaConfig {
        policy: PinPolicy::Populate,
        ..DmaConfig::default()
    };
    let mut g = Guest::with_dma(|_| {}, false, dma);
    g.bring_up(1, 16);
    // Warm up: the queue rings are pinned at their first use, and stay pinned.
    assert_eq!(g.read_blocks(1, 0, DATA, 512).0, Status::SUCCESS);
    let arrays = Arc::new(Mutex::new(Vec::new()));
    let seen = arrays.clone();
    g.server
        .dma()
        .set_pin_recorder(Some(Arc::new(move |pfns: &[u64], _| {
            seen.lock().unwrap().push(pfns.to_vec());
        })));
    let before = g.server.dma().stats().residency_syscalls;
    let data = pattern(9, 128 << 10);
    assert_eq!(g.write_blocks(1, 0, DATA, &data), Status::SUCCESS);
    let after = g.server.dma().stats().residency_syscalls;
    let arrays = arrays.lock().unwrap().clone();
    assert_eq!(
        arrays.len(),
        1,
        "one pin_pages call for the command: {arrays:?}"
    );
    let first = DATA >> 12;
    assert_eq!(arrays[0], (first..first + 32).collect::<Vec<_>>());
    assert_eq!(after - before, 1, "32 contiguous pages are one run");
}

#[test]
fn test_write_zeroes_and_deallocate_read_back_zeroes() {
    let mut g = Guest::new();
    g.bring_up(1, 16);
    let data = pattern(3, 8192);
    assert_eq!(g.write_blocks(1, 10, DATA, &data), Status::SUCCESS);
    let wz = Command {
        opcode: io_op::WRITE_ZEROES,
        nsid: 1,
        cdw: [10, 0, 7, 0, 0, 0],
        ..Default::default()
    };
    assert_eq!(g.run(1, wz).status, Status::SUCCESS);
    let (_, back) = g.read_blocks(1, 10, DATA + 0x10000, 8192);
    assert_eq!(&back[..4096], &[0u8; 4096][..]);
    assert_eq!(&back[4096..], &data[4096..]);
    // Deallocate blocks 18..26 with one range.
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&18u64.to_le_bytes());
    g.mem_write(DATA + 0x30000, &range);
    let dsm = Command {
        opcode: io_op::DSM,
        nsid: 1,
        prp1: DATA + 0x30000,
        cdw: [0, 1 << 2, 0, 0, 0, 0],
        ..Default::default()
    };
    assert_eq!(g.run(1, dsm).status, Status::SUCCESS);
    let (_, back) = g.read_blocks(1, 18, DATA + 0x10000, 4096);
    assert_eq!(back, vec![0u8; 4096]);
}

#[test]
fn test_msix_vector_fires_for_an_io_completion() {
    let mut g = Guest::new();
    let irq = g.vmm.enable_msix().unwrap(); // table entry 0
    g.enable();
    assert!(g.set_queues(1).status.is_success());
    // Drain the admin completions' interrupts.
    let _ = g.vmm.wait_irq_serving(&irq, Duration::from_millis(10));
    let size = 16;
    g.mem_write(io_cq(1), &vec![0u8; 256]);
    assert_eq!(g.create_cq_at(1, size, 0, io_cq(1)), Status::SUCCESS);
    assert_eq!(g.create_sq_at(1, size, 1, io_sq(1)), Status::SUCCESS);
    g.queues.push(Queue {
        qid: 1,
        sq: io_sq(1),
        cq: io_cq(1),
        size,
        tail: 0,
        head: 0,
        phase: true,
    });
    let _ = g.vmm.wait_irq_serving(&irq, Duration::from_millis(10));
    g.submit(1, Guest::rw(false, 0, 1, DATA, 0));
    assert!(
        g.vmm.wait_irq_serving(&irq, WAIT).unwrap(),
        "no MSI-X for the read"
    );
    assert!(g.reap(1).status.is_success());
}

#[test]
fn test_intx_fires_and_lowers_when_cq_drained() {
    let mut g = Guest::new();
    let irq = g.vmm.enable_intx().unwrap();
    g.enable();
    g.submit(
        0,
        Command {
            opcode: admin_op::KEEP_ALIVE,
            ..Default::default()
        },
    );
    assert!(g.vmm.wait_irq_serving(&irq, WAIT).unwrap(), "no INTx");
    assert!(g.reap(0).status.is_success());
}

#[test]
fn test_disable_clears_ready_and_drops_every_pin() {
    let mut g = Guest::new();
    g.bring_up(2, 32);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(1, 4096)),
        Status::SUCCESS
    );
    assert!(g.pins().1 > 0, "rings pinned while enabled");
    g.disable();
    assert_eq!(g.pins(), (0, 0, 0));
    // Enabled again, from scratch.
    g.bring_up(1, 16);
    let (s, back) = g.read_blocks(1, 0, DATA + 0x1000, 4096);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(back, pattern(1, 4096));
}

#[test]
fn test_shutdown_notification_reports_complete() {
    let mut g = Guest::new();
    g.bring_up(1, 16);
    assert_eq!(
        g.write_blocks(1, 5, DATA, &pattern(5, 512)),
        Status::SUCCESS
    );
    let cc = g.reg32(regs::CC);
    g.set_reg32(regs::CC, cc | 1 << 14);
    assert!(g.wait_csts(regs::CSTS_SHST_MASK, regs::CSTS_SHST_COMPLETE));
    assert_eq!(
        image_bytes(&g.image, 5 * 512, 512).unwrap(),
        pattern(5, 512)
    );
}

#[test]
fn test_device_reset_stops_queues_and_unpins() {
    let mut g = Guest::new();
    g.bring_up(2, 32);
    assert_eq!(
        g.write_blocks(2, 0, DATA, &pattern(2, 8192)),
        Status::SUCCESS
    );
    g.vmm.reset().unwrap();
    assert_eq!(g.csts(), 0);
    assert_eq!(g.pins(), (0, 0, 0));
    g.vmm.enable_device().unwrap();
    g.bring_up(1, 16);
    let (_, back) = g.read_blocks(1, 0, DATA + 0x4000, 8192);
    assert_eq!(back, pattern(2, 8192));
}

#[test]
fn test_get_log_pages_and_features_linux_reads() {
    let mut g = Guest::new();
    g.enable();
    for lid in [1u32, 2, 3] {
        let c = Command {
            opcode: admin_op::GET_LOG_PAGE,
            prp1: DATA + u64::from(lid) * 0x1000,
            cdw: [lid | 127 << 16, 0, 0, 0, 0, 0],
            ..Default::default()
        };
        assert_eq!(g.admin(c), Status::SUCCESS, "log {lid}");
    }
    let smart = g.mem_read(DATA + 0x2000, 512);
    assert_eq!(g.mem_read(DATA + 0x3000, 1), [1], "firmware slot 1 active");
    assert_eq!(smart[3], 100, "available spare");
    let get = |fid: u32, dw11: u32| Command {
        opcode: admin_op::GET_FEATURES,
        cdw: [fid, dw11, 0, 0, 0, 0],
        ..Default::default()
    };
    for fid in [1u32, 2, 4, 5, 6, 7, 8, 9, 0xa, 0xb] {
        assert_eq!(
            g.run(0, get(fid, 0)).status,
            Status::SUCCESS,
            "feature {fid:#x}"
        );
    }
    assert_eq!(g.run(0, get(4, 0)).result, 343, "temperature threshold");
    assert_eq!(
        g.run(0, get(0x0e, 0)).status,
        Status::INVALID_FIELD,
        "no timestamp"
    );
    let set = |fid: u32, dw11: u32| Command {
        opcode: admin_op::SET_FEATURES,
        cdw: [fid, dw11, 0, 0, 0, 0],
        ..Default::default()
    };
    assert_eq!(g.run(0, set(6, 0)).status, Status::SUCCESS);
    assert_eq!(g.run(0, get(6, 0)).result, 0, "write cache off");
    assert_eq!(g.run(0, set(0x0b, 0x1ff)).status, Status::SUCCESS);
    assert_eq!(g.run(0, get(0x0b, 0)).result, 0x1ff);
    assert_eq!(
        g.run(0, set(2, 1)).status,
        Status::INVALID_FIELD,
        "one power state"
    );
}

#[test]
fn test_doorbell_past_queue_size_is_reported_by_async_event() {
    let mut g = Guest::new();
    g.enable();
    let aer = g.push(
        0,
        Command {
            opcode: admin_op::ASYNC_EVENT,
            ..Default::default()
        },
    );
    g.kick(0);
    assert!(
        g.reap_within(0, Duration::from_millis(50)).is_none(),
        "AER held"
    );
    g.ring(Doorbell::SqTail(0), 1000);
    let c = g.reap(0);
    assert_eq!(c.cid, aer);
    assert_eq!(c.result & 7, 0, "error event");
    assert_eq!((c.result >> 8) & 0xff, 1, "invalid doorbell write value");
    assert_eq!((c.result >> 16) & 0xff, 1, "error log page");
    // The controller is still usable.
    assert_eq!(
        g.admin(Command {
            opcode: admin_op::KEEP_ALIVE,
            ..Default::default()
        }),
        Status::SUCCESS
    );
}

/// Submit 16 reads in one doorbell on an MSI-X queue; the interrupts they raised.
fn burst_interrupts(coalescing: Option<u32>) -> u64 {
    // I/O on the queue's worker (no pool): the 16 completions are one burst of one pass.
    let mut g = Guest::with(|c| c.io_threads = 0, false);
    let irq = g.vmm.enable_msix().unwrap();
    g.enable();
    assert!(g.set_queues(1).status.is_success());
    if let Some(v) = coalescing {
        let set = Command {
            opcode: admin_op::SET_FEATURES,
            cdw: [8, v, 0, 0, 0, 0],
            ..Default::default()
        };
        assert_eq!(g.admin(set), Status::SUCCESS);
    }
    g.mem_write(io_cq(1), &[0u8; 32 * 16]);
    assert_eq!(g.create_cq_at(1, 32, 0, io_cq(1)), Status::SUCCESS);
    assert_eq!(g.create_sq_at(1, 32, 1, io_sq(1)), Status::SUCCESS);
    g.queues.push(Queue {
        qid: 1,
        sq: io_sq(1),
        cq: io_cq(1),
        size: 32,
        tail: 0,
        head: 0,
        phase: true,
    });
    std::thread::sleep(Duration::from_millis(20));
    let _ = umdev::testing::wait_eventfd(&irq, Duration::ZERO);
    for i in 0..16 {
        g.push(1, Guest::rw(false, i, 1, DATA + i * 4096, 0));
    }
    g.kick(1);
    for _ in 0..16 {
        assert!(g.reap(1).status.is_success());
    }
    std::thread::sleep(Duration::from_millis(20));
    umdev::testing::wait_eventfd(&irq, Duration::ZERO).unwrap_or(0)
}

#[test]
fn test_interrupt_coalescing_threshold_splits_a_burst() {
    assert_eq!(burst_interrupts(None), 1, "one interrupt per burst");
    assert_eq!(burst_interrupts(Some(3)), 4, "THR = 3: every 4 completions");
}
