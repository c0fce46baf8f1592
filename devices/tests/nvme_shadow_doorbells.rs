//! NVMe shadow doorbells (Doorbell Buffer Config): the guest publishes tails and heads in
//! memory and traps only when the EventIdx says the controller sleeps (or waits for room).

mod nvme_support;

use nvme_support::*;
use umdev_devices::nvme::spec::{admin_op, Command, Status};

const SHADOW: u64 = RAM + 0xa_0000;
const EVENTIDX: u64 = RAM + 0xa_1000;

#[test]
fn test_oacs_advertises_doorbell_buffer_config() {
    let mut g = Guest::new();
    g.enable();
    assert_eq!(g.identify(1, 0, DATA), Status::SUCCESS);
    let oacs = u16::from_le_bytes(g.mem_read(DATA + 0x100, 2).try_into().unwrap());
    assert_eq!(oacs & 1 << 8, 1 << 8);
    let mut off = Guest::with(|c| c.shadow_doorbells = false, false);
    off.enable();
    assert_eq!(off.identify(1, 0, DATA), Status::SUCCESS);
    assert_eq!(off.mem_read(DATA + 0x100, 2), [0, 0]);
    assert_eq!(off.config_dbbuf(SHADOW, EVENTIDX), Status::INVALID_OPCODE);
}

#[test]
fn test_shadow_doorbells_carry_io_and_cq_heads_rarely_trap() {
    let mut g = Guest::new();
    g.bring_up(2, 16);
    // After the queues exist, as Linux's nvme_dbbuf_set does.
    assert_eq!(g.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    let before = g.mmio_doorbells;
    let n = 100u64;
    for i in 0..n {
        let q = 1 + (i % 2) as u16;
        let data = pattern(i, 4096);
        assert_eq!(g.write_blocks(q, i * 8, DATA, &data), Status::SUCCESS);
        let (s, back) = g.read_blocks(q, i * 8, DATA + 0x10000, 4096);
        assert_eq!(s, Status::SUCCESS);
        assert_eq!(back, data);
    }
    let (sq, cq) = (g.mmio_doorbells.0 - before.0, g.mmio_doorbells.1 - before.1);
    eprintln!("{} commands: {sq} SQ tail traps, {cq} CQ head traps", 2 * n);
    // Each command waits for its completion, so the worker sleeps in between: SQ tails
    // trap (at most once per command). CQ heads trap only when the EventIdx is crossed
    // (a wrap of the 16-entry ring), not per completion.
    assert!(sq <= 2 * n, "SQ traps {sq}");
    assert!(
        cq <= 2 * n / 15 + 4,
        "CQ head traps {cq} for {} completions",
        2 * n
    );
    assert_eq!(g.pins().0, 0);
    g.assert_no_panics();
}

#[test]
fn test_shadow_doorbells_burst_and_full_cq_wake_the_worker() {
    let mut g = Guest::new();
    g.enable();
    assert!(g.set_queues(1).status.is_success());
    assert_eq!(g.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    // Created after the config: starts on the buffer.
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
    let mut cids = Vec::new();
    for i in 0..12u64 {
        let mut c = Guest::rw(false, i, 1, DATA + i * 0x1000, 0);
        c.cid = 500 + i as u16;
        g.mem_write(io_sq(1) + i * 64, &c.encode());
        cids.push(c.cid);
    }
    g.publish(umdev_devices::nvme::regs::Doorbell::SqTail(1), 12);
    let mut got = Vec::new();
    for _ in 0..12 {
        got.push(g.reap(1).cid);
    }
    got.sort_unstable();
    assert_eq!(
        got, cids,
        "a worker waiting for room was woken through the EventIdx"
    );
}

#[test]
fn test_doorbell_buffer_config_checks_its_pages() {
    let mut g = Guest::new();
    g.enable();
    let cfg = |p1, p2| Command {
        opcode: admin_op::DBBUF_CONFIG,
        prp1: p1,
        prp2: p2,
        ..Default::default()
    };
    assert_eq!(g.admin(cfg(0, EVENTIDX)), Status::INVALID_FIELD);
    assert_eq!(g.admin(cfg(SHADOW + 8, EVENTIDX)), Status::INVALID_FIELD);
    assert_eq!(g.admin(cfg(SHADOW, SHADOW)), Status::INVALID_FIELD);
    assert_eq!(g.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    assert_eq!(g.admin(cfg(SHADOW, EVENTIDX)).sc, 0x0c, "once per reset");
    // A shadow page in a hole: the queues cannot read their tails -> fatal, no panic.
    g.disable();
    g.bring_up(1, 16);
    assert_eq!(g.admin(cfg(HOLE, EVENTIDX)), Status::DATA_TRANSFER_ERROR);
    g.assert_no_panics();
}

#[test]
fn test_shadow_doorbells_without_the_watch_arm_at_once_and_serve_every_command() {
    // `--poll off`: the worker arms the EventIdx as soon as it runs out of commands.
    let mut g = Guest::with(|c| c.shadow_poll = std::time::Duration::ZERO, false);
    g.bring_up(1, 16);
    assert_eq!(g.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    let before = g.mmio_doorbells;
    let n = 40u64;
    for i in 0..n {
        let data = pattern(i, 4096);
        assert_eq!(g.write_blocks(1, i * 8, DATA, &data), Status::SUCCESS);
        let (s, back) = g.read_blocks(1, i * 8, DATA + 0x10000, 4096);
        assert_eq!(s, Status::SUCCESS);
        assert_eq!(back, data);
    }
    // Each command found the worker asleep with the EventIdx armed: one trap per command.
    let sq = g.mmio_doorbells.0 - before.0;
    assert!(sq <= 2 * n, "SQ traps {sq}");
    assert_eq!(g.pins().0, 0);
    g.assert_no_panics();
}
