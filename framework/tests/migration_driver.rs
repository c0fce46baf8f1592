//! The VMM-side migration driver (`umdev::testing::migrate`) through two real servers: a
//! counting device and the guest RAM it and the guest CPU write move together; a
//! destination that refuses aborts the migration with the source running; steps out of
//! order are refused.

mod migration_util;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use migration_util::{
    assert_counts_on, connect, server, start_counting, Server, COUNT, COUNTER_AT, MEM_DATA,
    MEM_INDEX, MEM_SIZE, RAM,
};
use umdev::migration::MigState;
use umdev::testing::{
    migrate, wait_until, DeviceAccess, MigrateError, MigrateOptions, Migration, Side, TestServer,
    TrivialDevice, Vmm,
};

/// Where the guest CPU writes a page per turn.
const CPU_PAGES: u64 = 0x8_0000;

/// A counting source and a fresh destination, both connected.
fn pair(pre_copy: bool) -> (Server, Vmm, Server, Vmm) {
    let src = server(pre_copy, false);
    let mut a = connect(&src);
    a.enable_device().unwrap();
    start_counting(&mut a, &src);
    let dst = server(pre_copy, false);
    let b = connect(&dst);
    (src, a, dst, b)
}

fn page_of(turn: usize) -> Vec<u8> {
    (0..4096).map(|i| (i * 7 + turn * 31) as u8).collect()
}

/// The guest's turn: a page of RAM from the CPU, a byte of device memory.
fn guest_turn(vmm: &mut Vmm, turn: usize) -> std::io::Result<()> {
    vmm.ram()
        .write(CPU_PAGES + turn as u64 * 4096, &page_of(turn))?;
    vmm.write32(0, MEM_INDEX, (turn * 4099 % MEM_SIZE) as u32)?;
    vmm.write32(0, MEM_DATA, 0x80 + turn as u32)
}

fn moves_and_counts_on(pre_copy: bool) {
    let (src, mut a, dst, mut b) = pair(pre_copy);
    let opts = MigrateOptions {
        pre_copy: true,
        max_rounds: 4,
        small_round_bytes: 0,
    };
    let report = migrate(&mut a, &mut b, &opts, guest_turn, |_| Ok(())).unwrap();
    println!("{report}");
    assert_eq!(report.pre_copy, pre_copy);
    assert_eq!(report.rounds.len(), 4, "{report}");
    assert_eq!(report.initial_ram_pages, RAM as u64 / 4096);
    // Each round copies at least the guest's page and the counter's (pinned writable).
    assert!(report.rounds.iter().all(|r| r.ram_pages >= 2), "{report}");
    if pre_copy {
        assert!(report.rounds[0].device_bytes >= MEM_SIZE as u64, "{report}");
    } else {
        assert!(report.rounds.iter().all(|r| r.device_bytes == 0));
        assert!(report.stop_copy_bytes >= MEM_SIZE as u64);
    }
    assert!(report.downtime >= report.stop_copy_time);

    // The source stays stopped, its counter where STOP left it.
    assert_eq!(a.mig_state().unwrap(), MigState::Stop);
    let count = a.read64(0, COUNT).unwrap();
    // The guest's CPU writes, the last one after the last round included.
    for turn in 0..=4 {
        let got = b
            .ram()
            .read_vec(CPU_PAGES + turn as u64 * 4096, 4096)
            .unwrap();
        assert!(got == page_of(turn), "CPU page of turn {turn} did not move");
    }
    {
        let d = dst.device();
        let mem = d.device().mem();
        for turn in 0..=4usize {
            assert_eq!(mem[turn * 4099 % MEM_SIZE], 0x80 + turn as u8);
        }
    }
    // The destination counts on from the source's value, into its own RAM.
    assert_counts_on(&b, count);
    assert_eq!(src.device().device().shared().counter.load(SeqCst), count);
}

#[test]
fn test_migration_driver_counter_and_guest_ram_move_destination_counts_on_pre_copy() {
    moves_and_counts_on(true);
}

#[test]
fn test_migration_driver_counter_and_guest_ram_move_destination_counts_on_stop_copy_only() {
    moves_and_counts_on(false);
}

#[test]
fn test_migration_driver_last_device_write_before_stop_reaches_destination_ram() {
    // The RAM is compared while both devices are stopped: between stop_copy and
    // resume_destination.
    for _ in 0..5 {
        let (_src, mut a, _dst, mut b) = pair(true);
        let mut m = Migration::start(&mut a, &mut b, &MigrateOptions::default()).unwrap();
        m.round(&mut a, &mut b).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        m.stop_copy(&mut a, &mut b).unwrap();
        let count = a.read64(0, COUNT).unwrap();
        assert_eq!(a.ram().read_u64(COUNTER_AT).unwrap(), count);
        assert_eq!(
            b.ram().read_u64(COUNTER_AT).unwrap(),
            count,
            "the counter's last write did not move"
        );
        m.resume_destination(&mut a, &mut b).unwrap();
    }
}

#[test]
fn test_migration_driver_destination_refuses_stream_source_runs_on() {
    let (src, mut a, dst, mut b) = pair(true);
    dst.device().device_mut().fail_load = true;
    let err = migrate(
        &mut a,
        &mut b,
        &MigrateOptions::default(),
        guest_turn,
        |_| Ok(()),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            MigrateError::Step {
                side: Side::Destination,
                step: "RESUMING -> STOP (load)",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.source_running());
    // The device's load failed: EIO (a stream the framework refuses would be EINVAL).
    assert_eq!(err.errno(), Some(libc::EIO));
    // The source runs again and counts on; logging is off.
    assert_eq!(a.mig_state().unwrap(), MigState::Running);
    let before = a.read64(0, COUNT).unwrap();
    assert!(wait_until(Duration::from_secs(5), || a
        .read64(0, COUNT)
        .unwrap()
        > before));
    assert!(
        a.dirty_report(0, RAM as u64, 4096).is_err(),
        "logging still on"
    );
    // The destination was reset: RUNNING, and it takes a second attempt.
    assert_eq!(b.mig_state().unwrap(), MigState::Running);
    let report = migrate(
        &mut a,
        &mut b,
        &MigrateOptions::default(),
        guest_turn,
        |_| Ok(()),
    )
    .unwrap();
    assert!(report.stop_copy_bytes > 0);
    assert_eq!(b.mig_state().unwrap(), MigState::Running);
    drop(src);
}

#[test]
fn test_migration_driver_destination_without_migration_refused_before_anything() {
    let src = server(true, false);
    let mut a = connect(&src);
    let other = TestServer::start(TrivialDevice::default()).unwrap();
    let mut b = Vmm::connect(other.path())
        .unwrap()
        .with_ram(0, RAM)
        .unwrap();
    let err = Migration::start(&mut a, &mut b, &MigrateOptions::default()).unwrap_err();
    assert!(
        matches!(err, MigrateError::NotMigrating(Side::Destination, _)),
        "{err:?}"
    );
    assert_eq!(a.mig_state().unwrap(), MigState::Running);
    // Different RAM is refused too.
    let third = server(true, false);
    let mut c = Vmm::connect(third.path())
        .unwrap()
        .with_ram(0, RAM / 2)
        .unwrap();
    let err = Migration::start(&mut a, &mut c, &MigrateOptions::default()).unwrap_err();
    assert!(matches!(err, MigrateError::RamMismatch { .. }), "{err:?}");
}

#[test]
fn test_migration_driver_steps_out_of_order_refused() {
    let (_src, mut a, _dst, mut b) = pair(true);
    let mut m = Migration::start(&mut a, &mut b, &MigrateOptions::default()).unwrap();
    m.stop_copy(&mut a, &mut b).unwrap();
    assert!(matches!(
        m.round(&mut a, &mut b),
        Err(MigrateError::OutOfOrder("round"))
    ));
    assert!(matches!(
        m.stop_copy(&mut a, &mut b),
        Err(MigrateError::OutOfOrder("stop_copy"))
    ));
    // Aborting a loaded migration puts the source back.
    m.abort(&mut a, &mut b).unwrap();
    assert_eq!(a.mig_state().unwrap(), MigState::Running);
    assert_eq!(b.mig_state().unwrap(), MigState::Running);
}
