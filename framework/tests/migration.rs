//! Live migration through the socket: the state machine's arcs against the kernel's table,
//! a device moved between two servers (with and without PRE_COPY), refused streams that
//! leave the destination usable, a device that keeps DMA-ing after STOP caught by poisoned
//! memory, migration while the client unmaps memory, MIG_DATA sizes, and a device without
//! migration.

mod migration_util;

use std::io;
use std::time::Duration;

use migration_util::{
    assert_counts_on, server, start_counting, Server, COUNT, COUNTER_AT, MEM_DATA, MEM_INDEX,
    MEM_SIZE, RAM, SCRATCH, TARGET,
};
use umdev::migration::stream::{write_start, write_start_version, STREAM_VERSION};
use umdev::migration::MigState::{self, *};
use umdev::protocol::migration::encode_mig_data_read;
use umdev::protocol::Command;
use umdev::testing::{
    wait_until, DeviceAccess, TestServer, TrivialDevice, Vmm, DEFAULT_CAPS, MIGRATION_CAPS,
};

const ALL: [MigState; 8] = [
    Error, Stop, Running, StopCopy, Resuming, RunningP2p, PreCopy, PreCopyP2p,
];

/// A VMM on `s`, the device enabled.
fn connect(s: &Server) -> Vmm {
    let mut vmm = migration_util::connect(s);
    vmm.enable_device().unwrap();
    vmm
}

fn errno(r: io::Result<impl std::fmt::Debug>) -> i32 {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("no errno in {e}")),
    }
}

/// The kernel's `vfio_from_fsm_table` (row: from, column: to, wire order), ERROR = no path.
const KERNEL_TABLE: [[MigState; 8]; 8] = [
    [Error, Error, Error, Error, Error, Error, Error, Error],
    [
        Error, Stop, RunningP2p, StopCopy, Resuming, RunningP2p, RunningP2p, RunningP2p,
    ],
    [
        Error, RunningP2p, Running, RunningP2p, RunningP2p, RunningP2p, PreCopy, RunningP2p,
    ],
    [Error, Stop, Stop, StopCopy, Stop, Stop, Error, Error],
    [Error, Stop, Stop, Stop, Resuming, Stop, Stop, Stop],
    [
        Error, Stop, Running, Stop, Stop, RunningP2p, Running, PreCopyP2p,
    ],
    [
        Error, Running, Running, PreCopyP2p, Running, Running, PreCopy, PreCopyP2p,
    ],
    [
        Error, RunningP2p, RunningP2p, StopCopy, RunningP2p, RunningP2p, PreCopy, PreCopyP2p,
    ],
];

/// The reference: the kernel's next-state function for a device without P2P.
fn supported(s: MigState, pre_copy: bool) -> bool {
    match s {
        RunningP2p | PreCopyP2p => false,
        PreCopy => pre_copy,
        _ => true,
    }
}

/// The kernel's path from `cur` to `new` (None: -EINVAL).
fn kernel_path(cur: MigState, new: MigState, pre_copy: bool) -> Option<Vec<MigState>> {
    if !supported(new, pre_copy) || cur == Error {
        return None;
    }
    let mut path = Vec::new();
    let mut s = cur;
    while s != new {
        let mut next = KERNEL_TABLE[s as usize][new as usize];
        while !supported(next, pre_copy) {
            next = KERNEL_TABLE[next as usize][new as usize];
        }
        if next == Error {
            return None;
        }
        path.push(next);
        s = next;
    }
    Some(path)
}

/// The device calls each arc of `path` (starting at `from`) must make.
fn expected_calls(from: MigState, path: &[MigState]) -> Vec<&'static str> {
    let mut calls = Vec::new();
    let mut cur = from;
    for &next in path {
        match (cur, next) {
            (Running, Stop) => calls.push("stop"),
            (Stop, Running) => calls.push("resume"),
            (Stop, StopCopy) => calls.push("save"),
            (PreCopy, StopCopy) => calls.extend(["stop", "save"]),
            (Resuming, Stop) => calls.push("load"),
            _ => {}
        }
        cur = next;
    }
    calls
}

/// A valid stream of this device type, taken from a fresh server.
fn good_stream() -> Vec<u8> {
    let s = server(false, false);
    let mut vmm = connect(&s);
    vmm.write32(0, SCRATCH, 0x5ca1ab1e).unwrap();
    vmm.set_mig_state(StopCopy).unwrap();
    let stream = vmm.mig_read_all().unwrap();
    vmm.set_mig_state(Running).unwrap();
    stream
}

/// Bring the device from RUNNING to `target` (writing `stream` if the path passes through
/// RESUMING into STOP); ERROR through a corrupted stream.
fn reach(vmm: &mut Vmm, target: MigState, stream: &[u8]) {
    assert_eq!(vmm.mig_state().unwrap(), Running);
    match target {
        Error => {
            vmm.set_mig_state(Resuming).unwrap();
            let _ = vmm.mig_write_all(&stream[..stream.len() / 2]);
            assert_eq!(errno(vmm.set_mig_state_raw(Stop as u32)), libc::EINVAL);
        }
        Stop | StopCopy | Resuming | PreCopy | Running => vmm.set_mig_state(target).unwrap(),
        _ => unreachable!(),
    }
    assert_eq!(vmm.mig_state().unwrap(), target);
}

#[test]
fn test_migration_every_arc_legal_and_illegal_matches_the_kernel_table() {
    let stream = good_stream();
    for pre_copy in [false, true] {
        let s = server(pre_copy, false);
        let mut vmm = connect(&s);
        for from in ALL
            .into_iter()
            .filter(|&f| f == Error || supported(f, pre_copy))
        {
            // Targets: every state, plus values that name none.
            for raw in (0..8u32).chain([8, 0xabcd, u32::MAX]) {
                vmm.reset().unwrap();
                reach(&mut vmm, from, &stream);
                s.device().device_mut().take_calls();
                let target = MigState::from_u32(raw);
                let want = target.and_then(|t| kernel_path(from, t, pre_copy));
                let what = format!("pre_copy={pre_copy} {from:?} -> {target:?} ({raw})");
                if from == Resuming && want.as_ref().is_some_and(|p| !p.is_empty()) {
                    vmm.mig_write_all(&stream).unwrap();
                }
                let got = vmm.set_mig_state_raw(raw);
                match want {
                    Some(path) => {
                        let t = target.unwrap();
                        assert_eq!(got.unwrap(), t, "{what}");
                        assert_eq!(vmm.mig_state().unwrap(), t, "{what}");
                        assert_eq!(
                            s.device().device_mut().take_calls(),
                            expected_calls(from, &path),
                            "{what}: path {path:?}"
                        );
                    }
                    None => {
                        assert_eq!(errno(got), libc::EINVAL, "{what}");
                        assert_eq!(vmm.mig_state().unwrap(), from, "{what}: state changed");
                        assert!(s.device().device_mut().take_calls().is_empty(), "{what}");
                    }
                }
            }
        }
        vmm.reset().unwrap();
        assert_eq!(vmm.mig_state().unwrap(), Running);
    }
}

#[test]
fn test_migration_failing_arc_goes_to_error_reset_leaves_it() {
    let stream = good_stream();
    let s = server(false, false);
    let mut vmm = connect(&s);
    vmm.set_mig_state(Resuming).unwrap();
    vmm.mig_write_all(&stream).unwrap();
    s.device().device_mut().fail_load = true;
    assert_eq!(errno(vmm.set_mig_state_raw(Running as u32)), libc::EIO);
    assert_eq!(vmm.mig_state().unwrap(), Error);
    for t in [Stop, Running, Resuming] {
        assert_eq!(errno(vmm.set_mig_state_raw(t as u32)), libc::EINVAL);
        assert_eq!(vmm.mig_state().unwrap(), Error);
    }
    vmm.reset().unwrap();
    assert_eq!(vmm.mig_state().unwrap(), Running);
    assert!(
        s.device().device_mut().take_calls().ends_with(&["resume"]),
        "a reset resumes the stopped device"
    );
}

/// Copy the source's guest RAM to the destination's, as the VMM does after STOP.
fn copy_ram(src: &Vmm, dst: &Vmm) {
    let ram = src.ram().read_vec(0, RAM).unwrap();
    dst.ram().write(0, &ram).unwrap();
}

fn migrate(pre_copy: bool) {
    let src = server(pre_copy, false);
    let dst = server(pre_copy, false);
    let mut a = connect(&src);
    let mut b = connect(&dst);
    let msix = a.enable_msix().unwrap();
    drop(msix);
    a.write32(0, SCRATCH, 0xfeed_f00d).unwrap();
    for (i, byte) in [(0u32, 0x11u8), (5000, 0x22), (MEM_SIZE as u32 - 1, 0x33)] {
        a.write32(0, MEM_INDEX, i).unwrap();
        a.write32(0, MEM_DATA, u32::from(byte)).unwrap();
    }
    start_counting(&mut a, &src);

    let mut stream = Vec::new();
    if pre_copy {
        a.set_mig_state(PreCopy).unwrap();
        stream.extend(a.mig_read_all().unwrap());
        // The guest changes device memory while PRE_COPY runs; the next round sends it.
        a.write32(0, MEM_INDEX, 6000).unwrap();
        a.write32(0, MEM_DATA, 0x44).unwrap();
        stream.extend(a.mig_read_all().unwrap());
        assert!(
            a.mig_read_all().unwrap().is_empty(),
            "a round with nothing dirty is empty"
        );
    }
    a.set_mig_state(StopCopy).unwrap();
    stream.extend(a.mig_read_all().unwrap());
    let count = a.read64(0, COUNT).unwrap();
    assert!(count > 3);
    let config = a.read_bytes_vec(7, 0, 256);
    copy_ram(&a, &b);

    b.set_mig_state(Resuming).unwrap();
    b.mig_write_all(&stream).unwrap();
    b.set_mig_state(Running).unwrap();
    assert_eq!(b.read32(0, SCRATCH).unwrap(), 0xfeed_f00d);
    assert_eq!(b.read_bytes_vec(7, 0, 256), config, "config space moved");
    {
        let d = dst.device();
        let mem = d.device().mem();
        assert_eq!((mem[0], mem[5000], mem[MEM_SIZE - 1]), (0x11, 0x22, 0x33));
        assert_eq!(mem[6000], if pre_copy { 0x44 } else { 0 });
    }
    // The counter goes on from the source's value, into the destination's RAM.
    assert!(b.read64(0, COUNT).unwrap() >= count);
    assert_counts_on(&b, count);
    let calls = dst.device().device_mut().take_calls();
    assert_eq!(
        calls.iter().filter(|c| **c == "load_precopy").count() > 0,
        pre_copy,
        "{calls:?}"
    );
    // The source stays stopped until told otherwise, then runs again (aborted migration).
    a.set_mig_state(Running).unwrap();
    let before = a.read64(0, COUNT).unwrap();
    assert!(wait_until(Duration::from_secs(5), || a
        .read64(0, COUNT)
        .unwrap()
        > before));
}

#[test]
fn test_migration_counter_moves_between_servers_stop_copy() {
    migrate(false);
}

#[test]
fn test_migration_counter_moves_between_servers_with_pre_copy() {
    migrate(true);
}

trait ReadVec {
    fn read_bytes_vec(&mut self, region: u32, offset: u64, len: usize) -> Vec<u8>;
}

impl ReadVec for Vmm {
    fn read_bytes_vec(&mut self, region: u32, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read_bytes(region, offset, &mut v).unwrap();
        // The status register's interrupt bit and MSI pending bits are computed; the
        // rest must match.
        v[6] &= !0x08;
        v
    }
}

/// After a refused stream the destination is in ERROR; a reset makes it usable: it runs
/// (a register works, the counter counts) and takes a good stream.
fn check_refused_then_usable(bad: &[u8], good: &[u8], what: &str) {
    let dst = server(false, false);
    let mut b = connect(&dst);
    b.set_mig_state(Resuming).unwrap();
    // Refused as soon as it is seen (header, CRC), or at the end (cut short).
    let written = b.mig_write_all(bad);
    if let Err(e) = &written {
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{what}: {e}");
    }
    assert_eq!(
        errno(b.set_mig_state_raw(Stop as u32)),
        libc::EINVAL,
        "{what}"
    );
    assert_eq!(b.mig_state().unwrap(), Error, "{what}");
    b.reset().unwrap();
    assert_eq!(b.mig_state().unwrap(), Running, "{what}");
    b.enable_device().unwrap();
    b.write32(0, SCRATCH, 7).unwrap();
    assert_eq!(b.read32(0, SCRATCH).unwrap(), 7, "{what}");
    start_counting(&mut b, &dst);
    b.set_mig_state(Resuming).unwrap();
    b.mig_write_all(good).unwrap();
    b.set_mig_state(Running).unwrap();
    assert_eq!(
        b.read32(0, SCRATCH).unwrap(),
        0x5ca1ab1e,
        "{what}: good stream loaded"
    );
}

#[test]
fn test_migration_stream_cut_short_corrupted_or_newer_refused_destination_usable() {
    let good = good_stream();
    let mut start = Vec::new();
    write_start(&mut start).unwrap();
    let mut newer = Vec::new();
    write_start_version(STREAM_VERSION + 1, &mut newer).unwrap();
    newer.extend_from_slice(&good[start.len()..]);
    let mut corrupted = good.clone();
    let mid = corrupted.len() / 2;
    corrupted[mid] ^= 0x40;
    let cases: [(&str, &[u8]); 5] = [
        ("empty", &[]),
        ("cut after the header", &good[..start.len()]),
        ("cut one byte short", &good[..good.len() - 1]),
        ("corrupted", &corrupted),
        ("newer version", &newer),
    ];
    for (what, bad) in cases {
        check_refused_then_usable(bad, &good, what);
    }
}

#[test]
fn test_migration_newer_version_refused_at_the_write_that_carries_it() {
    let good = good_stream();
    let mut start = Vec::new();
    write_start(&mut start).unwrap();
    let mut newer = Vec::new();
    write_start_version(STREAM_VERSION + 1, &mut newer).unwrap();
    let dst = server(false, false);
    let mut b = connect(&dst);
    b.set_mig_state(Resuming).unwrap();
    assert_eq!(errno(b.mig_data_write(&newer)), libc::EINVAL);
    // Poisoned: the rest of a good stream does not make it whole.
    let rest = &good[start.len()..];
    assert_eq!(errno(b.mig_data_write(&rest[..100])), libc::EINVAL);
    assert_eq!(b.mig_state().unwrap(), Resuming);
}

/// STOP the counter, poison the page it writes, and watch it for a while: true if the
/// device wrote after STOP (or during STOP_COPY).
fn writes_after_stop(leaky: bool) -> bool {
    let s = server(false, leaky);
    let mut vmm = connect(&s);
    start_counting(&mut vmm, &s);
    vmm.set_mig_state(Stop).unwrap();
    const POISON: u64 = 0xdead_beef_dead_beef;
    vmm.ram().write_u64(COUNTER_AT, POISON).unwrap();
    // Hundreds of the worker's 200 µs periods; a leaky device writes in the first one.
    let changed = wait_until(Duration::from_millis(150), || {
        vmm.ram().read_u64(COUNTER_AT).unwrap() != POISON
    });
    vmm.set_mig_state(StopCopy).unwrap();
    let changed_in_copy = wait_until(Duration::from_millis(50), || {
        vmm.ram().read_u64(COUNTER_AT).unwrap() != POISON
    });
    let _ = vmm.mig_read_all().unwrap();
    vmm.set_mig_state(Running).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || vmm
            .ram()
            .read_u64(COUNTER_AT)
            .unwrap()
            != POISON),
        "the device does not write again after RUNNING"
    );
    changed || changed_in_copy
}

#[test]
fn test_migration_device_dma_after_stop_caught_by_poisoned_memory() {
    assert!(
        !writes_after_stop(false),
        "the well-behaved counter wrote guest memory after STOP"
    );
    assert!(
        writes_after_stop(true),
        "the leaky counter's writes after STOP went unnoticed"
    );
}

#[test]
fn test_migration_while_the_client_unmaps_memory() {
    let src = server(true, false);
    let dst = server(true, false);
    let mut a = connect(&src);
    start_counting(&mut a, &src);
    a.write32(0, SCRATCH, 99).unwrap();
    // PRE_COPY: the device runs; the client unmaps its RAM and maps it again.
    a.set_mig_state(PreCopy).unwrap();
    let mut stream = a.mig_read_all().unwrap();
    assert_eq!(a.dma_unmap(0, RAM as u64).unwrap(), RAM as u64);
    src.assert_space_unpinned();
    let fd = a.ram().try_clone_fd().unwrap();
    a.dma_map_fd(0, RAM as u64, std::os::fd::AsFd::as_fd(&fd), 0)
        .unwrap();
    // STOP_COPY with the memory unmapped in the middle of the reads.
    a.set_mig_state(StopCopy).unwrap();
    stream.extend(a.mig_data_read(1000).unwrap());
    assert_eq!(a.dma_unmap(0, RAM as u64).unwrap(), RAM as u64);
    src.assert_space_unpinned();
    stream.extend(a.mig_read_all().unwrap());

    // The destination: memory mapped, unmapped and mapped again while RESUMING.
    let mut b = Vmm::connect_with_caps(dst.path(), MIGRATION_CAPS)
        .unwrap()
        .with_ram(0, RAM)
        .unwrap();
    b.set_mig_state(Resuming).unwrap();
    b.mig_write_all(&stream[..stream.len() / 2]).unwrap();
    assert_eq!(b.dma_unmap(0, RAM as u64).unwrap(), RAM as u64);
    let fd = b.ram().try_clone_fd().unwrap();
    b.dma_map_fd(0, RAM as u64, std::os::fd::AsFd::as_fd(&fd), 0)
        .unwrap();
    b.mig_write_all(&stream[stream.len() / 2..]).unwrap();
    b.set_mig_state(Running).unwrap();
    assert_eq!(b.read32(0, SCRATCH).unwrap(), 99);
    let c = b.read64(0, COUNT).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || b
            .ram()
            .read_u64(COUNTER_AT)
            .unwrap()
            > c),
        "the destination re-pins and goes on counting"
    );
    // The source, its memory gone, runs again when the migration is aborted, and writes
    // once the memory is back.
    a.set_mig_state(Running).unwrap();
    let fd = a.ram().try_clone_fd().unwrap();
    a.dma_map_fd(0, RAM as u64, std::os::fd::AsFd::as_fd(&fd), 0)
        .unwrap();
    a.ram().write_u64(COUNTER_AT, 0).unwrap();
    assert!(wait_until(Duration::from_secs(5), || a
        .ram()
        .read_u64(COUNTER_AT)
        .unwrap()
        > 0));
}

#[test]
fn test_migration_mig_data_sizes_over_the_limit_and_wrong_state_refused() {
    let s = server(false, false);
    let mut vmm = connect(&s);
    assert_eq!(vmm.max_data_xfer_size(), 4096);
    // Outside a saving or resuming session: EINVAL.
    assert_eq!(errno(vmm.mig_data_read(16)), libc::EINVAL);
    assert_eq!(errno(vmm.mig_data_write(&[0; 16])), libc::EINVAL);
    vmm.set_mig_state(StopCopy).unwrap();
    assert_eq!(errno(vmm.mig_data_read(4097)), libc::E2BIG);
    // argsz smaller than the reply it asks for.
    let mut p = encode_mig_data_read(64);
    p[..4].copy_from_slice(&(8u32 + 63).to_ne_bytes());
    let m = vmm.call(Command::MigDataRead, &p, &[]).unwrap();
    assert_eq!(m.header.error as i32, libc::EINVAL);
    // A full-size read works and the stream is still whole afterwards.
    let first = vmm.mig_data_read(4096).unwrap();
    assert_eq!(first.len(), 4096);
    let mut stream = first;
    stream.extend(vmm.mig_read_all().unwrap());
    vmm.set_mig_state(Stop).unwrap();
    vmm.set_mig_state(Resuming).unwrap();
    assert_eq!(errno(vmm.mig_data_write(&vec![0; 4097])), libc::E2BIG);
    // A write whose size field disagrees with its data.
    let mut w = umdev::protocol::migration::encode_mig_data(&[1, 2, 3]);
    w[4..8].copy_from_slice(&4u32.to_ne_bytes());
    let m = vmm.call(Command::MigDataWrite, &w, &[]).unwrap();
    assert_eq!(m.header.error as i32, libc::EINVAL);
    vmm.mig_write_all(&stream).unwrap();
    vmm.set_mig_state(Running).unwrap();
}

/// A PCI device without migration.
struct Plain;

impl umdev::pci::PciDevice for Plain {
    fn config(&self) -> umdev::pci::PciConfig {
        umdev::pci::PciConfig {
            bars: vec![umdev::pci::BarSpec {
                index: 0,
                size: 16,
                kind: umdev::pci::BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            ..Default::default()
        }
    }
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

fn check_no_migration(path: &std::path::Path) {
    let mut vmm = Vmm::connect_with_caps(path, MIGRATION_CAPS).unwrap();
    let caps = vmm.server_caps().unwrap();
    assert!(!caps.migration && caps.present.max_dma_maps, "{caps:?}");
    assert_eq!(errno(vmm.migration_flags()), libc::ENOTSUP);
    assert_eq!(errno(vmm.mig_state()), libc::ENOTSUP);
    assert_eq!(errno(vmm.set_mig_state_raw(Stop as u32)), libc::ENOTSUP);
    assert_eq!(errno(vmm.probe_feature(2, 1 << 17)), libc::ENOTSUP);
    assert_eq!(errno(vmm.probe_feature(1, 1 << 16)), libc::ENOTSUP);
    assert_eq!(errno(vmm.mig_data_read(16)), libc::ENOTSUP);
    assert_eq!(errno(vmm.mig_data_write(&[0; 4])), libc::ENOTSUP);
    // DMA logging is still there.
    vmm.probe_feature(6, 1 << 17).unwrap();
}

#[test]
fn test_migration_device_without_migrate_enotsup_and_no_version_migration() {
    let pci = TestServer::start_pci(Plain).unwrap();
    check_no_migration(pci.path());
    let raw = TestServer::start(TrivialDevice::default()).unwrap();
    check_no_migration(raw.path());
}

#[test]
fn test_migration_features_of_a_migrating_device() {
    for (pre_copy, flags) in [(false, 1u64), (true, 1 | 4)] {
        let s = server(pre_copy, false);
        let mut vmm = connect(&s);
        let caps = vmm.server_caps().unwrap().clone();
        assert!(caps.migration, "{caps:?}");
        assert_eq!(caps.migration_pgsize, Some(4096));
        assert_eq!(vmm.migration_flags().unwrap(), flags);
        assert_eq!(vmm.mig_state().unwrap(), Running);
        vmm.probe_feature(1, 1 << 16).unwrap();
        vmm.probe_feature(2, (1 << 16) | (1 << 17)).unwrap();
        assert_eq!(
            errno(vmm.probe_feature(1, 1 << 17)),
            libc::EINVAL,
            "SET of MIGRATION"
        );
        drop(vmm);
        // A client that does not offer `migration` gets none back.
        assert!(wait_until(Duration::from_secs(5), || !s.client_attached()));
        let vmm = Vmm::connect_with_caps(s.path(), DEFAULT_CAPS).unwrap();
        assert!(!vmm.server_caps().unwrap().migration);
    }
}

#[test]
fn test_migration_client_leaving_a_stopped_device_resumes_it() {
    let s = server(false, false);
    let mut vmm = connect(&s);
    start_counting(&mut vmm, &s);
    vmm.set_mig_state(StopCopy).unwrap();
    drop(vmm);
    let shared = s.device().device().shared().clone();
    let before = shared.counter.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        wait_until(Duration::from_secs(5), || !s.client_attached()),
        "teardown"
    );
    let mut vmm = connect(&s);
    assert_eq!(vmm.mig_state().unwrap(), Running);
    vmm.write64(0, TARGET, COUNTER_AT).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || shared
            .counter
            .load(std::sync::atomic::Ordering::SeqCst)
            > before),
        "the device runs again"
    );
}
