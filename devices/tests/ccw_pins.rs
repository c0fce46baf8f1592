//! The ccw device pins like vfio-ccw's `page_array_pin`: every data page of a program,
//! collected into one array per direction, pinned with one `pin_pages` call each; the DMA
//! layer's coalescing turns host-contiguous runs into single residency syscalls.

mod ccw_support;

use std::sync::{Arc, Mutex};

use ccw_support::*;
use umdev::dma::{PinPolicy, Prot};
use umdev_devices::ccw::driver::{self, CcwWord};

type Calls = Arc<Mutex<Vec<(Vec<u64>, Prot)>>>;

fn record(rig: &Rig) -> Calls {
    let calls: Calls = Arc::default();
    let c = calls.clone();
    rig.space
        .set_pin_recorder(Some(Arc::new(move |pfns: &[u64], prot: Prot| {
            c.lock().unwrap().push((pfns.to_vec(), prot));
        })));
    calls
}

#[test]
fn test_ccw_program_pins_one_array_per_direction_in_program_order() {
    let mut rig = Rig::new();
    let calls = record(&rig);
    let pfn = |iova: u64| iova >> 12;
    // WRITE from a direct area crossing a page, READ through a scattered IDAW list, SENSE.
    let idaws = [DATA + 0x9800, DATA + 0x3000, DATA + 0x7000];
    rig.guest_write(IDAWS, &driver::encode_idaws(&idaws));
    let st = rig.run(
        &[
            CcwWord::write(0x1800, DATA + 0x800).chain(),
            CcwWord::read(0x800 + 2 * 4096, IDAWS).ida(3).chain(),
            CcwWord::sense(32, SENSE_BUF),
        ],
        0,
    );
    assert!(st.is_ok(), "{st:?}");
    let calls = calls.lock().unwrap();
    assert_eq!(
        calls.len(),
        2,
        "one pin_pages call per direction: {calls:?}"
    );
    let (to_guest, p0) = &calls[0];
    assert_eq!(*p0, Prot::WRITE);
    assert_eq!(
        *to_guest,
        vec![
            pfn(DATA + 0x9000),
            pfn(DATA + 0x3000),
            pfn(DATA + 0x7000),
            pfn(SENSE_BUF)
        ]
    );
    let (from_guest, p1) = &calls[1];
    assert_eq!(*p1, Prot::READ);
    assert_eq!(*from_guest, vec![pfn(DATA), pfn(DATA + 0x1000)]);
    rig.assert_no_pins();
}

#[test]
fn test_ccw_nop_only_program_pins_nothing() {
    let mut rig = Rig::new();
    let calls = record(&rig);
    let st = rig.run(&[CcwWord::nop().chain(), CcwWord::nop()], 0);
    assert!(st.is_ok());
    assert!(calls.lock().unwrap().is_empty());
}

/// Under `Lock`, a 16-page contiguous IDAW list costs one mlock + one munlock; the same 16
/// pages scattered cost one per page. (The count is the DMA layer's residency counter.)
#[test]
fn test_ccw_lock_contiguous_list_coalesces_to_one_mlock() {
    let mut rig = Rig::with(RigOptions {
        policy: PinPolicy::Lock,
        lock_limit: Some(1 << 20),
        intx: false,
    });
    let n = 16u64;
    let contiguous: Vec<u64> = (0..n).map(|i| DATA + i * 4096).collect();
    // Every other page, reversed: no two neighbours adjacent.
    let scattered: Vec<u64> = (0..n)
        .rev()
        .map(|i| DATA + 0x40000 + 2 * i * 4096)
        .collect();
    let count = (n * 4096 - 1) as u16;
    let mut syscalls = Vec::new();
    for list in [&contiguous, &scattered] {
        rig.guest_write(IDAWS, &driver::encode_idaws(list));
        let before = rig.space.stats().residency_syscalls;
        let st = rig.run(&[CcwWord::read(count, IDAWS).ida(n as u32)], 0);
        assert!(st.is_ok(), "{st:?}");
        syscalls.push(rig.space.stats().residency_syscalls - before);
        rig.assert_no_pins();
    }
    eprintln!(
        "residency syscalls per 16-page program: contiguous {}, scattered {}",
        syscalls[0], syscalls[1]
    );
    assert_eq!(syscalls[0], 2, "mlock + munlock for one run");
    assert_eq!(syscalls[1], 2 * n, "one mlock + munlock per page");
}

/// Measurement (ignored by default; run with `--ignored --nocapture`): mean time per
/// 64 KiB READ program whose 16-page IDAW list is contiguous vs scattered, under Translate
/// and Lock, measured in one run so the ratios compare like with like.
#[test]
#[ignore]
fn test_ccw_measure_program_time_contiguous_vs_scattered() {
    let n = 16u64;
    let contiguous: Vec<u64> = (0..n).map(|i| DATA + i * 4096).collect();
    let scattered: Vec<u64> = (0..n)
        .rev()
        .map(|i| DATA + 0x40000 + 2 * i * 4096)
        .collect();
    let iters = 300;
    for policy in [PinPolicy::Translate, PinPolicy::Lock] {
        let mut rig = Rig::with(RigOptions {
            policy,
            lock_limit: Some(1 << 20),
            intx: false,
        });
        let mut means = Vec::new();
        for list in [&contiguous, &scattered] {
            rig.guest_write(IDAWS, &driver::encode_idaws(list));
            let program = [CcwWord::read(65535, IDAWS).ida(n as u32)];
            for _ in 0..20 {
                assert!(rig.run(&program, 0).is_ok());
            }
            let sys0 = rig.space.stats().residency_syscalls;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                assert!(rig.run(&program, 0).is_ok());
            }
            let per = t.elapsed().as_secs_f64() * 1e6 / f64::from(iters);
            let sys = (rig.space.stats().residency_syscalls - sys0) as f64 / f64::from(iters);
            means.push((per, sys));
        }
        eprintln!(
            "{policy:?}: contiguous {:.1} us/program ({:.0} residency syscalls), scattered {:.1} us/program ({:.0}), scattered/contiguous = {:.2}",
            means[0].0,
            means[0].1,
            means[1].0,
            means[1].1,
            means[1].0 / means[0].0
        );
        rig.assert_no_pins();
    }
}
