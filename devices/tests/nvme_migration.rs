//! NVMe live migration: a controller with admin and I/O queues moved by the harness's
//! VMM-side migration driver (`umdev::testing::migrate` / `Migration`: dirty-logged RAM
//! copy, STOP_COPY, load, RUNNING) to a second controller on the same image (shared
//! storage). The guest's driver state (queue positions, phases, command ids) moves with it;
//! the destination continues the same queues. Also: STOP with I/O in flight completes each
//! command exactly once (before STOP on the source or after RUNNING on the destination),
//! shadow doorbells keep working, and hostile streams are refused without a panic.

mod nvme_support;

use std::collections::BTreeMap;
use std::time::Duration;

use nvme_support::*;
use proptest::prelude::*;
use umdev::migration::{decode_state, encode_state, MigState, Migrate, MigrationError};
use umdev::pci::PciDevice;
use umdev::testing::{migrate, DeviceAccess, MigrateOptions, Migration};
use umdev_devices::nvme::migration::wire::{
    CompletionV1, NvmeStateV1, MAX_PENDING, STATE_FORMAT, STATE_VERSION,
};
use umdev_devices::nvme::regs::{self, Doorbell};
use umdev_devices::nvme::spec::{admin_op, Command, Status, CQE_SIZE, SQE_SIZE};
use umdev_devices::nvme::{Nvme, NvmeConfig};

const SHADOW: u64 = RAM + 0xa_0000;
const EVENTIDX: u64 = RAM + 0xa_1000;

fn cmd(opcode: u8, cdw: [u32; 6]) -> Command {
    Command {
        opcode,
        cdw,
        ..Default::default()
    }
}

/// Run `f` on the controller's migration interface (under the server's device lock).
fn with_mig<R>(g: &Guest, f: impl FnOnce(&mut dyn Migrate) -> R) -> R {
    let mut dev = g.server.device();
    f(dev.device_mut().migration().expect("nvme migrates"))
}

/// A destination guest on `src`'s image (shared storage), same configuration.
fn destination(src: &Guest, tune: impl FnOnce(&mut NvmeConfig)) -> Guest {
    Guest::migratable(Some(src.image.clone()), tune)
}

/// Migrate `src` to a fresh controller on its image, the guest not running meanwhile;
/// the destination guest has taken over the driver.
fn migrate_guest(src: &mut Guest, tune: impl FnOnce(&mut NvmeConfig)) -> Guest {
    let mut dst = destination(src, tune);
    migrate(
        &mut src.vmm,
        &mut dst.vmm,
        &MigrateOptions::default(),
        |_, _| Ok(()),
        |_| Ok(()),
    )
    .unwrap();
    dst.adopt_driver(src);
    dst
}

/// The saved state of `g`'s controller (stopped, saved, resumed).
fn saved(g: &Guest) -> Vec<u8> {
    with_mig(g, |m| {
        m.stop().unwrap();
        let s = m.save().unwrap();
        m.resume().unwrap();
        s
    })
}

fn state_of(bytes: &[u8]) -> NvmeStateV1 {
    decode_state(STATE_FORMAT, STATE_VERSION, STATE_VERSION, bytes)
        .unwrap()
        .1
}

#[test]
fn test_nvme_migration_queues_io_and_outstanding_aer_continue_on_destination() {
    let mut src = Guest::migratable(None, |_| {});
    src.bring_up(2, 8);
    // Enough I/O that queue 1's completion ring wraps (phase 0 now) and queue 2's does not.
    for i in 0..11u64 {
        let data = pattern(i, 4096);
        assert_eq!(src.write_blocks(1, i * 8, DATA, &data), Status::SUCCESS);
    }
    assert_eq!(
        src.write_blocks(2, 200, DATA, &pattern(99, 8192)),
        Status::SUCCESS
    );
    let aer = src.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    assert!(src.reap_within(0, Duration::from_millis(30)).is_none());
    assert!(!src.queues[1].phase, "queue 1 wrapped");
    let state = state_of(&saved(&src));
    assert_eq!(state.aer_outstanding, vec![aer], "the AER is outstanding");
    assert_eq!(state.sqs.len(), 3);
    let cq1 = state.cqs.iter().find(|c| c.id == 1).unwrap();
    assert_eq!(
        (cq1.tail, cq1.phase),
        (3, false),
        "11 posts on an 8-entry ring"
    );

    let mut dst = migrate_guest(&mut src, |_| {});
    assert_eq!(dst.csts() & regs::CSTS_RDY, regs::CSTS_RDY);
    // Data written on the source is read on the destination (the same image).
    for i in 0..11u64 {
        let (s, back) = dst.read_blocks(1, i * 8, DATA + 0x10000, 4096);
        assert_eq!(s, Status::SUCCESS);
        assert_eq!(back, pattern(i, 4096), "block {i}");
    }
    let (s, back) = dst.read_blocks(2, 200, DATA + 0x10000, 8192);
    assert_eq!((s, back), (Status::SUCCESS, pattern(99, 8192)));
    // New writes on the same queues complete with the right phase (reap waits for it).
    for i in 0..9u64 {
        let q = 1 + (i % 2) as u16;
        let data = pattern(1000 + i, 4096);
        assert_eq!(
            dst.write_blocks(q, 400 + i * 8, DATA, &data),
            Status::SUCCESS
        );
        let (s, back) = dst.read_blocks(q, 400 + i * 8, DATA + 0x10000, 4096);
        assert_eq!((s, back), (Status::SUCCESS, data));
    }
    // The AER from before the migration completes on the destination when an event comes.
    dst.ring(Doorbell::SqTail(5), 1);
    let c = dst.reap(0);
    assert_eq!((c.cid, c.result), (aer, 0x01 << 16), "the migrated AER");
    assert_eq!(
        dst.admin(cmd(admin_op::KEEP_ALIVE, [0; 6])),
        Status::SUCCESS
    );
    assert_eq!(dst.pins().0, 0);
    dst.assert_no_panics();
    src.assert_no_panics();
}

/// Read the completions `q`'s ring holds at `gpa` in `ram_of`'s memory from the driver's
/// head on with its phase, without consuming them: their command ids.
fn posted_cids(g: &Guest, q: &Queue) -> Vec<u16> {
    let mut out = Vec::new();
    let (mut head, mut phase) = (q.head, q.phase);
    loop {
        let b = g.mem_read(q.cq + u64::from(head) * CQE_SIZE, CQE_SIZE as usize);
        if (b[14] & 1 == 1) != phase {
            return out;
        }
        out.push(u16::from_le_bytes([b[12], b[13]]));
        head = (head + 1) % q.size;
        if head == 0 {
            phase = !phase;
        }
        if out.len() as u32 >= q.size {
            return out;
        }
    }
}

/// Publish `n` writes of `chunk` bytes on queue 1 at once and STOP the source `delay`
/// after the doorbell (RAM copied and dirty logging on before, so STOP follows at once);
/// check nothing completes after STOP, each command completes exactly once (on the source
/// before STOP or on the destination after RUNNING) and every write is on the image.
/// Returns how many completed on the destination.
fn stop_with_io_in_flight(n: u64, chunk: u64, delay: Duration) -> usize {
    let mut src = Guest::migratable(None, |c| c.size = Some(n * chunk));
    src.bring_up(1, 64);
    let mut cids = Vec::new();
    for i in 0..n {
        let buf = DATA + i * chunk;
        src.mem_write(buf, &pattern(i, chunk as usize));
        let list: Vec<u64> = (1..chunk / 4096).map(|p| buf + p * 4096).collect();
        let lp = PRP_LISTS + i * 4096;
        src.write_u64s(lp, &list);
        let c = Guest::rw(true, i * (chunk / 512), (chunk / 512) as u32, buf, lp);
        cids.push(src.push(1, c));
    }
    let mut dst = destination(&src, |_| {});
    let opts = MigrateOptions {
        pre_copy: false,
        ..MigrateOptions::default()
    };
    let mut m = Migration::start(&mut src.vmm, &mut dst.vmm, &opts).unwrap();
    src.kick(1);
    std::thread::sleep(delay);
    m.stop_copy(&mut src.vmm, &mut dst.vmm).unwrap();
    // Stopped: nothing in flight, nothing completes any more on the source.
    assert_eq!(src.server.device().device().data_pins(), 0, "I/O in flight");
    let q = src.queues[1];
    let before = posted_cids(&src, &q);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(posted_cids(&src, &q), before, "a completion after STOP");
    m.resume_destination(&mut src.vmm, &mut dst.vmm).unwrap();
    dst.adopt_driver(&src);
    let mut seen: BTreeMap<u16, u32> = BTreeMap::new();
    for _ in 0..n {
        let c = dst.reap(1);
        assert_eq!(c.status, Status::SUCCESS);
        *seen.entry(c.cid).or_default() += 1;
    }
    assert!(
        dst.reap_within(1, Duration::from_millis(50)).is_none(),
        "a duplicated completion"
    );
    let want: BTreeMap<u16, u32> = cids.iter().map(|&c| (c, 1)).collect();
    assert_eq!(seen, want, "each command completes exactly once");
    for i in 0..n {
        let back = image_bytes(&dst.image, i * chunk, chunk as usize).unwrap();
        assert!(back == pattern(i, chunk as usize), "write {i} on the image");
    }
    dst.assert_no_panics();
    src.assert_no_panics();
    n as usize - before.len()
}

#[test]
fn test_nvme_migration_stop_with_io_in_flight_completes_each_command_exactly_once() {
    // Each round checks exactly-once; the rounds go on (up to 20) until STOP has caught
    // commands not completed on the source at least once, over at least five delays.
    let mut on_destination = Vec::new();
    for round in 0..20 {
        let delay_us = [0, 100, 400, 1500, 5000][round % 5];
        on_destination.push(stop_with_io_in_flight(
            48,
            128 << 10,
            Duration::from_micros(delay_us),
        ));
        if round >= 4 && on_destination.iter().any(|&d| d > 0) {
            break;
        }
    }
    eprintln!("completed on the destination, by STOP delay: {on_destination:?}");
    assert!(
        on_destination.iter().any(|&d| d > 0),
        "STOP never caught I/O in flight: {on_destination:?}"
    );
}

/// A guest whose queue 1 (a 4-entry CQ under a 16-entry SQ, I/O on the queue worker) has
/// 12 reads published: the CQ fills after 3, the next completion waits in the worker for
/// room. Returns the guest and the command ids.
fn full_cq_guest() -> (Guest, Vec<u16>) {
    let mut src = Guest::migratable(None, |c| c.io_threads = 0);
    src.enable();
    assert!(src.set_queues(1).status.is_success());
    src.mem_write(io_cq(1), &[0u8; 64]);
    assert_eq!(src.create_cq_at(1, 4, 1, io_cq(1)), Status::SUCCESS);
    assert_eq!(src.create_sq_at(1, 16, 1, io_sq(1)), Status::SUCCESS);
    src.queues.push(Queue {
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
        src.mem_write(io_sq(1) + i * SQE_SIZE, &c.encode());
        cids.push(c.cid);
    }
    src.ring(Doorbell::SqTail(1), 12);
    let deadline = std::time::Instant::now() + WAIT;
    while posted_cids(&src, &src.queues[1]).len() < 3 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    (src, cids)
}

/// Reap the 12 completions of [`full_cq_guest`]'s queue 1 on `g`: each command once.
fn reap_all_once(g: &mut Guest, cids: &[u16]) {
    let mut got: Vec<u16> = (0..cids.len()).map(|_| g.reap(1).cid).collect();
    got.sort_unstable();
    assert_eq!(got, cids);
    assert!(g.reap_within(1, Duration::from_millis(50)).is_none());
}

#[test]
fn test_nvme_migration_full_cq_completions_held_at_stop_post_on_destination() {
    let (mut src, cids) = full_cq_guest();
    let state = state_of(&saved(&src));
    let sq1 = state.sqs.iter().find(|s| s.id == 1).unwrap();
    assert!(
        !sq1.pending.is_empty(),
        "a completion held for room: {sq1:?}"
    );
    let mut dst = migrate_guest(&mut src, |c| c.io_threads = 0);
    reap_all_once(&mut dst, &cids);
    dst.assert_no_panics();
}

#[test]
fn test_nvme_migration_aborted_after_stop_copy_source_posts_what_it_held() {
    let (mut src, cids) = full_cq_guest();
    let mut dst = destination(&src, |c| c.io_threads = 0);
    let opts = MigrateOptions {
        pre_copy: false,
        ..MigrateOptions::default()
    };
    let mut m = Migration::start(&mut src.vmm, &mut dst.vmm, &opts).unwrap();
    m.stop_copy(&mut src.vmm, &mut dst.vmm).unwrap();
    m.abort(&mut src.vmm, &mut dst.vmm).unwrap();
    reap_all_once(&mut src, &cids);
    src.assert_no_panics();
}

#[test]
fn test_nvme_migration_stopped_ignores_cc_and_reset_while_stopped_runs_again() {
    let mut g = Guest::migratable(None, |_| {});
    g.bring_up(1, 16);
    g.vmm.set_mig_state(MigState::Stop).unwrap();
    g.set_reg32(regs::CC, 0);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        g.csts() & regs::CSTS_RDY,
        regs::CSTS_RDY,
        "no reset while stopped"
    );
    // A doorbell while stopped is stored and served at RUNNING.
    let cid = g.submit(1, Guest::rw(false, 0, 1, DATA, 0));
    assert!(
        g.reap_within(1, Duration::from_millis(50)).is_none(),
        "ran while stopped"
    );
    g.vmm.set_mig_state(MigState::Running).unwrap();
    assert_eq!(g.reap(1).cid, cid);
    // DEVICE_RESET while stopped: the controller is reset and runs (the guest enables it).
    g.vmm.set_mig_state(MigState::Stop).unwrap();
    g.vmm.reset().unwrap();
    g.vmm.enable_device().unwrap();
    g.bring_up(1, 16);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(3, 4096)),
        Status::SUCCESS
    );
    g.assert_no_panics();
}

#[test]
fn test_nvme_migration_shadow_doorbells_survive_on_destination() {
    let mut src = Guest::migratable(None, |_| {});
    src.bring_up(1, 16);
    assert_eq!(src.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    for i in 0..5u64 {
        assert_eq!(
            src.write_blocks(1, i * 8, DATA, &pattern(i, 4096)),
            Status::SUCCESS
        );
    }
    assert_eq!(state_of(&saved(&src)).dbbuf, Some((SHADOW, EVENTIDX)));
    let mut dst = migrate_guest(&mut src, |_| {});
    let before = dst.mmio_doorbells;
    let n = 40u64;
    for i in 0..n {
        let data = pattern(100 + i, 4096);
        assert_eq!(
            dst.write_blocks(1, 64 + i * 8, DATA, &data),
            Status::SUCCESS
        );
        let (s, back) = dst.read_blocks(1, 64 + i * 8, DATA + 0x10000, 4096);
        assert_eq!((s, back), (Status::SUCCESS, data));
    }
    let cq_traps = dst.mmio_doorbells.1 - before.1;
    assert!(
        cq_traps <= 2 * n / 15 + 4,
        "CQ head traps {cq_traps}: the destination does not read the shadow heads"
    );
    // The destination moves the EventIdx itself: queue 1's SQ slot is its head (armed as
    // the worker goes to sleep).
    std::thread::sleep(Duration::from_millis(50));
    let ei = u32::from_le_bytes(dst.mem_read(EVENTIDX + 8, 4).try_into().unwrap());
    assert_eq!(ei, dst.queues[1].tail, "EventIdx armed by the destination");
    dst.assert_no_panics();
}

/// A controller not attached anywhere, on a fresh image of `NS_BYTES`.
fn bare(tune: impl FnOnce(&mut NvmeConfig)) -> (Nvme, tempfile::TempDir) {
    let (dev, dir, _) = controller(tune);
    (dev, dir)
}

fn refused(dev: &mut Nvme, bytes: &[u8]) -> MigrationError {
    dev.stop().unwrap();
    let e = dev.load(bytes).expect_err("a bad state was accepted");
    dev.resume().unwrap();
    e
}

/// A running controller with two queue pairs, a doorbell buffer and an AER: its state.
fn rich_state() -> (Guest, Vec<u8>) {
    let mut g = Guest::migratable(None, |_| {});
    g.bring_up(2, 16);
    assert_eq!(g.config_dbbuf(SHADOW, EVENTIDX), Status::SUCCESS);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(1, 4096)),
        Status::SUCCESS
    );
    g.submit(0, cmd(admin_op::ASYNC_EVENT, [0; 6]));
    let s = saved(&g);
    (g, s)
}

#[test]
fn test_nvme_migration_truncated_trailing_wrong_format_streams_refused() {
    let (_g, good) = rich_state();
    let (mut dev, _dir) = bare(|_| {});
    for cut in 0..good.len() {
        refused(&mut dev, &good[..cut]);
    }
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        refused(&mut dev, &long),
        MigrationError::Malformed { .. }
    ));
    let other = encode_state("umdev-ccw", 1, &state_of(&good)).unwrap();
    assert!(matches!(
        refused(&mut dev, &other),
        MigrationError::WrongFormat { .. }
    ));
    let newer = encode_state(STATE_FORMAT, STATE_VERSION + 1, &state_of(&good)).unwrap();
    assert!(matches!(
        refused(&mut dev, &newer),
        MigrationError::UnsupportedVersion { .. }
    ));
    // The good one loads (into a controller not attached yet: applied at attach).
    dev.stop().unwrap();
    dev.load(&good).unwrap();
    dev.resume().unwrap();
}

#[test]
fn test_nvme_migration_impossible_or_duplicated_states_refused() {
    let (_g, good) = rich_state();
    let s = state_of(&good);
    let (mut dev, _dir) = bare(|_| {});
    let mut cases: Vec<(&str, NvmeStateV1)> = Vec::new();
    let mut t = s.clone();
    t.sqs.push(t.sqs[1].clone());
    cases.push(("submission queue twice", t));
    let mut t = s.clone();
    t.cqs[2].id = 1;
    cases.push(("completion queue twice", t));
    let mut t = s.clone();
    t.sqs[1].id = 9;
    cases.push(("queue id past the limit", t));
    let mut t = s.clone();
    t.sqs[1].cqid = 3;
    cases.push(("SQ on a missing CQ", t));
    let mut t = s.clone();
    t.sqs[1].head = t.sqs[1].size;
    cases.push(("head past the ring", t));
    let mut t = s.clone();
    t.cqs[1].base = 0x1001;
    cases.push(("unaligned ring", t));
    let mut t = s.clone();
    t.cqs[1].size = 1 << 20;
    cases.push(("ring too large", t));
    let mut t = s.clone();
    t.cqs[1].vector = 50;
    cases.push(("vector past the table", t));
    let mut t = s.clone();
    t.sqs[1].pending = vec![
        CompletionV1 {
            result: 0,
            cid: 1,
            sct: 0,
            sc: 0,
            dnr: false
        };
        MAX_PENDING + 1
    ];
    cases.push(("too many pending completions", t));
    let mut t = s.clone();
    t.aer_outstanding = vec![1; 9];
    cases.push(("too many AERs", t));
    let mut t = s.clone();
    t.features.vector_config.push(true);
    cases.push(("vector table of another size", t));
    let mut t = s.clone();
    t.csts = 0;
    cases.push(("queues on a disabled controller", t));
    let mut t = s.clone();
    t.dbbuf = Some((SHADOW, SHADOW));
    cases.push(("doorbell pages the same", t));
    for (why, t) in cases {
        let bytes = encode_state(STATE_FORMAT, STATE_VERSION, &t).unwrap();
        let e = refused(&mut dev, &bytes);
        assert!(matches!(e, MigrationError::Malformed { .. }), "{why}: {e}");
    }
    // Configuration mismatches are Incompatible.
    let mut t = s.clone();
    t.blocks += 8;
    let e = refused(
        &mut dev,
        &encode_state(STATE_FORMAT, STATE_VERSION, &t).unwrap(),
    );
    assert!(matches!(e, MigrationError::Incompatible(_)), "{e}");
    let (mut no_db, _d) = bare(|c| c.shadow_doorbells = false);
    let e = refused(&mut no_db, &good);
    assert!(matches!(e, MigrationError::Incompatible(_)), "{e}");
    let (mut fewer, _d) = bare(|c| c.max_io_queues = 2);
    refused(&mut fewer, &good);
}

#[test]
fn test_nvme_migration_refused_state_leaves_an_attached_controller_reset() {
    let (mut g, good) = rich_state();
    let mut bad = state_of(&good);
    bad.sqs[2].cqid = 0;
    let bad = encode_state(STATE_FORMAT, STATE_VERSION, &bad).unwrap();
    let e = with_mig(&g, |m| {
        m.stop().unwrap();
        let e = m.load(&bad).unwrap_err();
        m.resume().unwrap();
        e
    });
    assert!(matches!(e, MigrationError::Malformed { .. }), "{e}");
    assert_eq!(g.csts(), 0, "reset after a refused state");
    assert_eq!(g.server.device().device().pinned_rings(), 0);
    // A good state loads into the same controller and its queues serve again.
    with_mig(&g, |m| {
        m.stop().unwrap();
        m.load(&good).unwrap();
        m.resume().unwrap();
    });
    assert_eq!(g.csts() & regs::CSTS_RDY, regs::CSTS_RDY);
    let (s, back) = g.read_blocks(1, 0, DATA + 0x10000, 4096);
    assert_eq!((s, back), (Status::SUCCESS, pattern(1, 4096)));
    g.assert_no_panics();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random bytes, and a good state with random bytes changed, cut or appended: an
    /// error or a state that passed every check, never a panic.
    #[test]
    fn prop_nvme_migration_random_streams_never_panic(
        junk in proptest::collection::vec(any::<u8>(), 0..512),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in any::<usize>(),
    ) {
        let (mut dev, _dir) = bare(|_| {});
        let _ = dev.load(&junk);
        let mut s = state_of(&good_state_bytes());
        s.aer_outstanding.push(3);
        let mut bytes = encode_state(STATE_FORMAT, STATE_VERSION, &s).unwrap();
        for (at, v) in edits {
            let n = bytes.len();
            bytes[at % n] = v;
        }
        let keep = cut % (bytes.len() + 1);
        bytes.truncate(keep.max(bytes.len() / 2));
        let _ = dev.load(&bytes);
        let _ = dev.save();
        prop_assert!(PciDevice::migration(&mut dev).is_some());
    }
}

/// A state of a running controller, made once.
fn good_state_bytes() -> Vec<u8> {
    static GOOD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    GOOD.get_or_init(|| rich_state().1).clone()
}
