//! ccw live migration, device level: the device's `Migrate` implementation driven
//! directly (stop / save on the source, load / resume on a fresh device on the same image,
//! which is shared storage), the guest's memory copied at STOP as a VMM's last pass does.
//! A data set written across a migration reads back intact, and the program in flight at
//! STOP completes exactly once, whatever phase STOP caught it in.

mod ccw_support;

use std::time::{Duration, Instant};

use ccw_support::*;
use umdev::migration::{decode_header, decode_state, encode_state, Migrate, MigrationError};
use umdev::pci::PciDevice;
use umdev_devices::ccw::driver::{self, regs, CcwWord, OperationBlock, StatusBlock};
use umdev_devices::ccw::migration::{CcwStateV1, InFlightV1, STATE_FORMAT, STATE_VERSION};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::testing::{ccw_chain, CCW_CHUNK};
use vmm_sys_util::eventfd::EventFd;

/// The device's migration interface, as the framework reaches it.
fn mig(rig: &mut Rig) -> &mut dyn Migrate {
    rig.dev
        .device_mut()
        .migration()
        .expect("the ccw device migrates")
}

/// Instantaneous count of `efd` (0 if it was not signalled).
fn fired(efd: &EventFd) -> u64 {
    efd.read().unwrap_or(0)
}

/// The data set written while the migration happens: 40 chained CCWs, 1.25 MiB.
const BIG_CCWS: u64 = 40;
/// Where each part of the data set goes on the image (blocks).
const BLOCK_A: u64 = 0;
const BLOCK_B: u64 = 64;
const BLOCK_C: u64 = 4096;
/// A small part's guest buffer.
const SMALL: u64 = DATA + 0x18_0000;

/// Place `program` and its operation block (status at STATUS) and START it; no wait.
fn start(rig: &mut Rig, program: &[CcwWord], block: u64) {
    rig.guest_write(PROGRAM, &driver::encode_program(program));
    let opb = OperationBlock {
        program: PROGRAM,
        block,
        status: STATUS,
        flags: 0,
        reserved: 0,
    };
    rig.guest_write(OPB, &opb.to_bytes());
    rig.guest_write(STATUS, &[0xee; 32]);
    rig.set_reg(regs::OPB_ADDR_LO, OPB as u32);
    rig.set_reg(regs::OPB_ADDR_HI, 0);
    rig.set_reg(regs::START, 1);
}

/// A fresh device on the source's image (shared storage) with a copy of the source's
/// guest memory, taken now (the source is stopped).
fn destination(src: &Rig) -> Rig {
    let dst = Rig::with_image(
        RigOptions::default(),
        tempfile::tempdir().unwrap(),
        src.image.clone(),
    );
    dst.guest_write(RAM, &src.guest_read(RAM, RAM_SIZE as usize));
    dst.guest_write(ROM, &src.guest_read(ROM, ROM_SIZE as usize));
    dst
}

/// The program in flight the saved state carries.
fn in_flight(state: &[u8]) -> Option<InFlightV1> {
    let (_, s): (u32, CcwStateV1) =
        decode_state(STATE_FORMAT, STATE_VERSION, STATE_VERSION, state).unwrap();
    s.in_flight
}

/// Where STOP catches the program writing part B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Catch {
    /// START comes while stopped.
    BeforeStart,
    /// STOP `micros` after START.
    After { micros: u64 },
    /// STOP once the program holds its pins (its I/O under way).
    WhilePinned,
    /// STOP after the program completed (interrupt not acknowledged yet).
    Completed,
}

/// What one migration round saw.
#[derive(Debug)]
struct Seen {
    on_source: u64,
    on_destination: u64,
    carried: Option<InFlightV1>,
}

/// Write part A, then part B around a migration (caught as `catch`), part C on the
/// destination; check exactly one completion of B, then read the whole data set back on
/// the destination.
fn round(seed: u64, catch: Catch) -> Seen {
    let mut src = Rig::new();
    let mut rng = seeded(seed);
    let a = rng.bytes(CCW_CHUNK as usize);
    let b = rng.bytes((BIG_CCWS * CCW_CHUNK) as usize);
    let c = rng.bytes(CCW_CHUNK as usize);
    src.guest_write(SMALL, &a);
    assert!(src.run(&ccw_chain(true, SMALL, 1), BLOCK_A).is_ok());
    src.guest_write(DATA, &b);
    let big = ccw_chain(true, DATA, BIG_CCWS);
    match catch {
        Catch::BeforeStart => {
            mig(&mut src).stop().unwrap();
            start(&mut src, &big, BLOCK_B);
        }
        Catch::After { micros } => {
            start(&mut src, &big, BLOCK_B);
            let until = Instant::now() + Duration::from_micros(micros);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            mig(&mut src).stop().unwrap();
        }
        Catch::WhilePinned => {
            start(&mut src, &big, BLOCK_B);
            let deadline = Instant::now() + Duration::from_secs(5);
            while src.dev.device().pins_held() == 0 && src.dev.device().is_busy() {
                assert!(Instant::now() < deadline, "the program never pinned");
                std::hint::spin_loop();
            }
            mig(&mut src).stop().unwrap();
        }
        Catch::Completed => {
            start(&mut src, &big, BLOCK_B);
            assert!(src.wait_irq(Duration::from_secs(5)));
            // Counted as a source completion below.
            src.msi.write(1).unwrap();
            mig(&mut src).stop().unwrap();
        }
    }
    // No pins, nothing running, no more interrupts on the source from here on.
    src.assert_no_pins();
    let on_source = fired(&src.msi);
    let state = mig(&mut src).save().unwrap();
    let carried = in_flight(&state);
    let mut dst = destination(&src);
    mig(&mut dst).stop().unwrap();
    mig(&mut dst).load(&state).unwrap();
    assert_eq!(
        dst.reg(regs::STATUS) & regs::STATUS_BUSY != 0,
        carried.is_some(),
        "BUSY follows the program in flight"
    );
    mig(&mut dst).resume().unwrap();
    let on_destination = if on_source == 0 {
        umdev::testing::wait_eventfd(&dst.msi, Duration::from_secs(5)).unwrap_or(0)
    } else {
        0
    };
    std::thread::sleep(Duration::from_millis(10));
    let late = (fired(&src.msi), fired(&dst.msi));
    assert_eq!(
        (on_source + on_destination, late),
        (1, (0, 0)),
        "{catch:?}: B completed {on_source}× on the source, {on_destination}× on the \
         destination, then {late:?} more (state carried {carried:?})"
    );
    // B's completion as the guest sees it on the destination: one status block, the
    // second program of the device's life.
    let st: StatusBlock = dst.status();
    assert!(st.is_ok(), "{catch:?}: {st:?}");
    assert_eq!((st.sequence, st.transferred), (2, BIG_CCWS * CCW_CHUNK));
    assert_eq!(dst.reg(regs::COMPLETED), 2);
    assert_eq!(dst.reg(regs::IRQ_STATUS), regs::IRQ_DONE);
    dst.set_reg(regs::IRQ_STATUS, regs::IRQ_ALL);
    assert_eq!(dst.reg(regs::STATUS) & regs::STATUS_BUSY, 0);

    // Part C on the destination, then everything read back there.
    dst.guest_write(SMALL, &c);
    assert!(dst.run(&ccw_chain(true, SMALL, 1), BLOCK_C).is_ok());
    for (block, expect, area, ccws) in [
        (BLOCK_A, &a, SMALL, 1),
        (BLOCK_B, &b, DATA, BIG_CCWS),
        (BLOCK_C, &c, SMALL, 1),
    ] {
        dst.guest_write(area, &vec![0u8; expect.len()]);
        let st = dst.run(&ccw_chain(false, area, ccws), block);
        assert!(st.is_ok(), "{st:?}");
        assert!(
            dst.guest_read(area, expect.len()) == *expect,
            "{catch:?}: data at block {block} differs"
        );
    }
    assert_eq!(dst.reg(regs::COMPLETED), 6);
    dst.assert_no_pins();
    Seen {
        on_source,
        on_destination,
        carried,
    }
}

#[test]
fn test_ccw_migration_data_set_across_stop_reads_back_with_one_completion() {
    let mut seen = Vec::new();
    let fixed = [Catch::BeforeStart, Catch::WhilePinned, Catch::Completed];
    for (i, &catch) in fixed.iter().enumerate() {
        seen.push((catch, round(i as u64, catch)));
    }
    // A program caught while it holds pins finishes its I/O at STOP and its completion is
    // carried. On a loaded machine the program may finish before this thread sees its
    // pins: repeat the race (bounded) until it is caught in flight.
    for i in 0..60u64 {
        let s = round(200 + i, Catch::WhilePinned);
        let caught = matches!(s.carried, Some(InFlightV1::Deliver { .. }));
        seen.push((Catch::WhilePinned, s));
        if caught {
            break;
        }
    }
    for i in 0..12u64 {
        let catch = Catch::After {
            micros: [0, 20, 100, 300][i as usize % 4] * (1 + i / 4),
        };
        seen.push((catch, round(100 + i, catch)));
    }
    for (catch, s) in &seen {
        println!("{catch:?}: {s:?}");
    }
    let carried =
        |f: fn(&Option<InFlightV1>) -> bool| seen.iter().filter(|(_, s)| f(&s.carried)).count();
    // Each way a program can be in flight at STOP happened at least once.
    assert!(carried(|c| matches!(c, Some(InFlightV1::Start { .. }))) >= 1);
    assert!(carried(|c| matches!(c, Some(InFlightV1::Deliver { .. }))) >= 1);
    assert!(carried(|c| c.is_none()) >= 1);
    assert!(seen.iter().any(|(_, s)| s.on_destination == 1));
    assert!(seen.iter().any(|(_, s)| s.on_source == 1));
}

#[test]
fn test_ccw_stop_then_resume_on_source_completes_held_program_once() {
    for catch in [Catch::BeforeStart, Catch::WhilePinned] {
        let mut rig = Rig::new();
        let mut rng = seeded(7);
        let b = rng.bytes((BIG_CCWS * CCW_CHUNK) as usize);
        rig.guest_write(DATA, &b);
        let big = ccw_chain(true, DATA, BIG_CCWS);
        if catch == Catch::BeforeStart {
            mig(&mut rig).stop().unwrap();
            start(&mut rig, &big, BLOCK_B);
        } else {
            start(&mut rig, &big, BLOCK_B);
            while rig.dev.device().pins_held() == 0 && rig.dev.device().is_busy() {
                std::hint::spin_loop();
            }
            mig(&mut rig).stop().unwrap();
        }
        let early = fired(&rig.msi);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(fired(&rig.msi), 0, "{catch:?}: an interrupt while stopped");
        // An aborted migration: the source runs again.
        mig(&mut rig).resume().unwrap();
        let late = if early == 0 {
            umdev::testing::wait_eventfd(&rig.msi, Duration::from_secs(5)).unwrap_or(0)
        } else {
            0
        };
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!((early + late, fired(&rig.msi)), (1, 0), "{catch:?}");
        assert_eq!(rig.reg(regs::COMPLETED), 1);
        assert!(rig.status().is_ok());
        assert_eq!(rig.image_bytes(BLOCK_B * 512, b.len()), b);
    }
}

#[test]
fn test_ccw_migration_newer_version_cut_short_or_other_image_refused_destination_works() {
    let mut src = Rig::new();
    let mut rng = seeded(3);
    let a = rng.bytes(CCW_CHUNK as usize);
    src.guest_write(SMALL, &a);
    assert!(src.run(&ccw_chain(true, SMALL, 1), BLOCK_A).is_ok());
    mig(&mut src).stop().unwrap();
    start(&mut src, &ccw_chain(true, SMALL, 1), BLOCK_C);
    let state = mig(&mut src).save().unwrap();

    let mut dst = destination(&src);
    mig(&mut dst).stop().unwrap();
    let (_, body) = decode_header(STATE_FORMAT, STATE_VERSION, STATE_VERSION, &state).unwrap();
    let mut newer = encode_state(STATE_FORMAT, STATE_VERSION + 1, &()).unwrap();
    newer.extend_from_slice(body);
    assert!(matches!(
        mig(&mut dst).load(&newer),
        Err(MigrationError::UnsupportedVersion { found, .. }) if found == STATE_VERSION + 1
    ));
    let mut other = encode_state("umdev-gpu", STATE_VERSION, &()).unwrap();
    other.extend_from_slice(body);
    assert!(matches!(
        mig(&mut dst).load(&other),
        Err(MigrationError::WrongFormat { .. })
    ));
    for cut in 0..state.len() {
        assert!(
            mig(&mut dst).load(&state[..cut]).is_err(),
            "a state cut at {cut} of {} bytes was accepted",
            state.len()
        );
        // Refused means reset: nothing of the state, no program held.
        assert_eq!(dst.reg(regs::COMPLETED), 0, "cut at {cut}");
        assert_eq!(dst.reg(regs::STATUS), 0, "cut at {cut}");
    }
    let mut long = state.clone();
    long.push(0);
    assert!(matches!(
        mig(&mut dst).load(&long),
        Err(MigrationError::Malformed { .. })
    ));
    // An image of another size is another image.
    let dir = tempfile::tempdir().unwrap();
    let small = Ccw::new(CcwConfig::new(dir.path().join("small.img")).with_capacity(64)).unwrap();
    let mut small = umdev::pci::PciAdapter::new(small).unwrap();
    let m = small.device_mut().migration().unwrap();
    m.stop().unwrap();
    assert!(matches!(
        m.load(&state),
        Err(MigrationError::Incompatible(_))
    ));

    // The destination still works: the good state loads, the held START runs there.
    mig(&mut dst).load(&state).unwrap();
    mig(&mut dst).resume().unwrap();
    assert!(dst.wait_irq(Duration::from_secs(5)));
    let st = dst.status();
    assert!(st.is_ok() && st.sequence == 2, "{st:?}");
    assert_eq!(dst.image_bytes(BLOCK_C * 512, a.len()), a);
    assert_eq!(fired(&src.msi), 0, "the source ran it too");
    // And a device that only saw refusals works as a fresh one.
    let mut fresh = destination(&src);
    mig(&mut fresh).stop().unwrap();
    assert!(mig(&mut fresh).load(&state[..state.len() / 2]).is_err());
    mig(&mut fresh).resume().unwrap();
    assert!(fresh
        .run(&ccw_chain(false, SMALL + CCW_CHUNK, 1), BLOCK_A)
        .is_ok());
    assert_eq!(fresh.guest_read(SMALL + CCW_CHUNK, a.len()), a);
}

#[test]
fn test_ccw_reset_while_stopped_drops_held_program() {
    let mut rig = Rig::new();
    mig(&mut rig).stop().unwrap();
    start(&mut rig, &ccw_chain(true, SMALL, 1), BLOCK_A);
    assert_ne!(rig.reg(regs::STATUS) & regs::STATUS_BUSY, 0);
    PciDevice::reset(rig.dev.device_mut());
    let state = mig(&mut rig).save().unwrap();
    assert_eq!(in_flight(&state), None);
    mig(&mut rig).resume().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(fired(&rig.msi), 0, "a program from before the reset ran");
    assert_eq!(rig.reg(regs::COMPLETED), 0);
}
