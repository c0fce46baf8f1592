//! The harness against umdev's own server: every piece a device author relies on.

use std::time::Duration;

use super::*;
use crate::device::{region_index, Device};
use crate::dma::Prot;
use crate::pci::test_device::{full_config, TestDevice};
use crate::pci::PciAdapter;
use crate::protocol::Command;

const FDLESS: u64 = 0x40_0000;
const WAIT: Duration = Duration::from_secs(2);

fn pci_server() -> TestServer<PciAdapter<TestDevice>> {
    TestServer::start_pci(TestDevice {
        config: full_config(),
        ..Default::default()
    })
    .unwrap()
}

/// Raise vector 0 the way the device would.
fn trigger(server: &TestServer<PciAdapter<TestDevice>>) {
    let irq = server.device().device().irq.clone().expect("attached");
    irq.trigger(0);
}

#[test]
fn test_vmm_enable_msi_then_device_interrupt_signals_eventfd() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let msi = vmm.enable_msi().unwrap();
    assert_eq!(wait_eventfd(&msi, Duration::from_millis(50)), None);
    trigger(&server);
    assert_eq!(wait_eventfd(&msi, WAIT), Some(1));
}

#[test]
fn test_vmm_enable_msix_unmasks_vector_0_device_interrupt_signals_eventfd() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let msix = vmm.enable_msix().unwrap();
    trigger(&server);
    assert_eq!(wait_eventfd(&msix, WAIT), Some(1));
}

#[test]
fn test_vmm_enable_intx_device_interrupt_signals_eventfd() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let intx = vmm.enable_intx().unwrap();
    trigger(&server);
    assert_eq!(wait_eventfd(&intx, WAIT), Some(1));
}

#[test]
fn test_device_access_in_process_and_through_socket_see_same_config() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    let mut local = PciAdapter::new(TestDevice {
        config: full_config(),
        ..Default::default()
    })
    .unwrap();
    for id in [PCI_CAP_ID_MSI, PCI_CAP_ID_MSIX, 0x09] {
        assert_eq!(
            local.find_capability(id).unwrap(),
            vmm.find_capability(id).unwrap(),
            "capability {id:#x}"
        );
    }
    assert!(vmm.find_capability(PCI_CAP_ID_MSIX).unwrap().is_some());
    assert_eq!(
        local.read32(region_index::CONFIG, 0).unwrap(),
        vmm.read32(region_index::CONFIG, 0).unwrap()
    );
    vmm.enable_device().unwrap();
    local.enable_device().unwrap();
    let want = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
    assert_eq!(vmm.command().unwrap() & want, want);
    assert_eq!(local.command().unwrap() & want, want);
}

#[test]
fn test_device_access_in_process_enable_msi_interrupt_signals_eventfd() {
    let mut local = PciAdapter::new(TestDevice {
        config: full_config(),
        ..Default::default()
    })
    .unwrap();
    local.attach(crate::dma::DmaSpace::new(Default::default()).handle());
    local.enable_device().unwrap();
    let msi = local.enable_msi().unwrap();
    local.device().irq.clone().unwrap().trigger(0);
    assert_eq!(wait_eventfd(&msi, WAIT), Some(1));
}

#[test]
fn test_test_server_device_visible_while_served() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.write32(0, 0x10, 0xdead_beef).unwrap();
    assert_eq!(
        server.device().device().regs.get(&(0, 0x10)).copied(),
        Some(0xef)
    );
    drop(vmm);
    assert!(wait_until(WAIT, || server.device().device().disconnects == 1));
}

#[test]
fn test_vmm_with_ram_device_dma_lands_in_guest_memory() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let vmm = server
        .connect()
        .unwrap()
        .with_ram(0x10_0000, 0x10000)
        .unwrap();
    assert_eq!(server.dma().stats().maps, 1);
    let h = server.dma().handle();
    h.write(0x10_0100, b"from the device").unwrap();
    assert_eq!(
        vmm.ram().read_vec(0x10_0100, 15).unwrap(),
        b"from the device"
    );
    assert_eq!(
        vmm.ram()
            .read(0x11_0000, &mut [0u8; 1])
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EFAULT)
    );
}

fn fdless_vmm(server: &TestServer<TrivialDevice>) -> Vmm {
    let mut vmm = server.connect().unwrap();
    vmm.set_fdless(FdlessMemory::with_pattern(FDLESS, 0x2000));
    vmm.dma_map_fdless(FDLESS, 0x2000).unwrap();
    vmm
}

/// A device-side read of 16 bytes at FDLESS + 0x10 on another thread.
fn device_read(
    server: &TestServer<TrivialDevice>,
) -> std::thread::JoinHandle<Result<Vec<u8>, i32>> {
    let h = server.dma().handle();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16];
        h.read(FDLESS + 0x10, &mut buf)
            .map(|()| buf)
            .map_err(|e| e.errno())
    })
}

#[test]
fn test_vmm_fdless_honest_answer_serves_bytes_and_logs_request() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut vmm = fdless_vmm(&server);
    let t = device_read(&server);
    assert!(vmm.serve_until(WAIT, |v| v.requests() == 1).unwrap());
    assert_eq!(t.join().unwrap().unwrap(), vmm.mem()[0x10..0x20].to_vec());
    assert_eq!(
        vmm.log(),
        &[DmaRequest {
            command: Command::DmaRead as u16,
            iova: FDLESS + 0x10,
            count: 16
        }]
    );
    assert_eq!(vmm.fdless().reads(), 1);
}

#[test]
fn test_vmm_fdless_error_answer_fails_device_read_with_efault() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut vmm = fdless_vmm(&server);
    vmm.set_answer(Answer::Errors);
    let t = device_read(&server);
    assert!(vmm.serve_until(WAIT, |v| v.requests() == 1).unwrap());
    assert_eq!(t.join().unwrap(), Err(libc::EFAULT));
    assert_eq!(vmm.fdless().reads(), 0);
}

#[test]
fn test_vmm_fdless_silent_answer_device_read_times_out() {
    let server = TestServer::builder(TrivialDevice::default())
        .configure(|c| c.remote_dma_timeout = Duration::from_millis(100))
        .start()
        .unwrap();
    let mut vmm = fdless_vmm(&server);
    vmm.set_answer(Answer::Silent);
    let t = device_read(&server);
    assert!(vmm.serve_until(WAIT, |v| v.requests() == 1).unwrap());
    assert_eq!(t.join().unwrap(), Err(libc::ETIMEDOUT));
}

#[test]
fn test_vmm_fdless_request_outside_memory_gets_efault_not_panic() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut vmm = server.connect().unwrap();
    vmm.set_fdless(FdlessMemory::new(FDLESS, 0x10));
    vmm.dma_map_fdless(FDLESS, 0x2000).unwrap();
    let t = device_read(&server);
    assert!(vmm.serve_until(WAIT, |v| v.requests() == 1).unwrap());
    assert_eq!(t.join().unwrap(), Err(libc::EFAULT));
}

#[test]
fn test_vmm_qemu_like_held_request_answered_only_after_next_reply() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut vmm = fdless_vmm(&server).qemu_like().unwrap();
    let t = device_read(&server);
    let r = vmm.hold_request().unwrap();
    assert_eq!((r.iova, r.count), (FDLESS + 0x10, 16));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!t.is_finished(), "the held request was answered");
    // The call's reply comes first; the held request is answered after it.
    assert_eq!(vmm.read32(0, 0x10).unwrap(), 0x1312_1110);
    assert_eq!(t.join().unwrap().unwrap(), vmm.mem()[0x10..0x20].to_vec());
}

#[test]
fn test_vmm_serve_in_background_answers_until_stopped() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let vmm = fdless_vmm(&server);
    let bg = vmm.serve_in_background().unwrap();
    let h = server.dma().handle();
    h.write(FDLESS + 8, &[5, 6, 7]).unwrap();
    let mut got = [0u8; 3];
    h.read(FDLESS + 8, &mut got).unwrap();
    assert_eq!(got, [5, 6, 7]);
    assert_eq!(bg.stop().unwrap(), 2);
}

#[test]
fn test_vmm_dma_unmap_reports_bytes_removed_and_error_carries_errno() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut vmm = server.connect().unwrap();
    vmm.dma_map_fdless(FDLESS, 0x2000).unwrap();
    assert_eq!(vmm.dma_unmap(FDLESS, 0x2000).unwrap(), 0x2000);
    assert_eq!(server.dma().stats().maps, 0);
    // A map with an iova that is not page aligned is refused with EINVAL.
    let e = vmm.dma_map_fdless(FDLESS + 1, 0x1000).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
}

#[test]
fn test_vmm_map_region_reads_shared_bar_through_its_fd() {
    let server = pci_server();
    let shm = server.device().device().config.bars[3]
        .shared
        .clone()
        .expect("BAR5 is shared memory");
    shm.write_at(0x100, b"shared").unwrap();
    let mut vmm = server.connect().unwrap();
    let bar5 = vmm.map_region(5).unwrap();
    assert_eq!(bar5.len(), 0x2000);
    let mut got = [0u8; 6];
    bar5.read(0x100, &mut got).unwrap();
    assert_eq!(&got, b"shared");
    assert!(bar5.read(0x1fff, &mut got).is_err());
}

#[test]
fn test_raw_client_expect_error_unknown_command_enosys() {
    let server = TestServer::start(TrivialDevice::default()).unwrap();
    let mut c = RawClient::new_default(server.path());
    assert_eq!(c.expect_error(0x7fff, &[], &[]), libc::ENOSYS as u32);
    // The connection goes on.
    assert_eq!(c.region_read(0, 0x20, 2), vec![0x20, 0x21]);
}

#[test]
fn test_trivial_device_registers_reset_and_bounds() {
    let mut d = TrivialDevice::default();
    let mut b = [0u8; 4];
    d.region_read(0, 8, &mut b).unwrap();
    assert_eq!(b, [8, 9, 10, 11]);
    d.region_write(0, 8, &[1, 2, 3, 4]).unwrap();
    d.region_read(0, 8, &mut b).unwrap();
    assert_eq!(b, [1, 2, 3, 4]);
    assert!(d.region_read(0, TRIVIAL_BAR0_SIZE - 2, &mut b).is_err());
    assert!(d.region_read(0, u64::MAX, &mut b).is_err());
    assert!(d.region_read(3, 0, &mut b).is_err());
    d.reset().unwrap();
    d.region_read(0, 8, &mut b).unwrap();
    assert_eq!(b, [8, 9, 10, 11]);
}

#[test]
fn test_guest_memory_dma_mapping_offset_and_bounds() {
    let ram = GuestMemory::new(0x1000_0000, 0x4000).unwrap();
    let m = ram.dma_mapping(0x1000_2000, 0x1000, Prot::READ).unwrap();
    assert_eq!((m.iova, m.size, m.offset), (0x1000_2000, 0x1000, 0x2000));
    assert!(ram.dma_mapping(0x1000_3000, 0x2000, Prot::RW).is_err());
    assert!(ram.dma_mapping(0x0fff_f000, 0x1000, Prot::RW).is_err());
    assert!(GuestMemory::new(0, 100).is_err());
}

#[test]
fn test_rng_same_seed_same_sequence_different_seed_differs() {
    let a: Vec<u64> = (0..8)
        .scan(Rng::new(7), |r, _| Some(r.next_u64()))
        .collect();
    let b: Vec<u64> = (0..8)
        .scan(Rng::new(7), |r, _| Some(r.next_u64()))
        .collect();
    let c: Vec<u64> = (0..8)
        .scan(Rng::new(8), |r, _| Some(r.next_u64()))
        .collect();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mut r = Rng::from_state(0);
    assert!((0..100).all(|_| r.below(10) < 10));
}

#[test]
fn test_memfd_is_sized_and_may_shrink() {
    let f = memfd(4096).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4096);
    f.set_len(0).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 0);
}

#[test]
fn test_guest_memory_cpu_dirty_log_marks_written_pages_only_while_on() {
    let ram = GuestMemory::new(0x10_0000, 256 * 4096).unwrap();
    let clone = ram.clone();
    ram.write(0x10_0000, &[1]).unwrap();
    assert!(
        ram.cpu_dirty_take().iter().all(|&w| w == 0),
        "logged while off"
    );
    ram.cpu_dirty_start();
    // A write across a page boundary, a fill through a clone, a u64 in page 200.
    ram.write(0x10_0000 + 4095, &[1, 2]).unwrap();
    clone.fill(0x10_0000 + 70 * 4096, 8192, 0xaa).unwrap();
    ram.write_u64(0x10_0000 + 200 * 4096 + 8, 5).unwrap();
    let bits = ram.cpu_dirty_take();
    let pages: Vec<u64> = (0..256u64)
        .filter(|p| bits[(p / 64) as usize] >> (p % 64) & 1 != 0)
        .collect();
    assert_eq!(pages, vec![0, 1, 70, 71, 200]);
    assert!(ram.cpu_dirty_take().iter().all(|&w| w == 0), "take clears");
    ram.read_vec(0x10_0000, 4096).unwrap();
    assert!(
        ram.cpu_dirty_take().iter().all(|&w| w == 0),
        "a read marks nothing"
    );
    ram.cpu_dirty_stop();
    ram.write(0x10_0000, &[1]).unwrap();
    assert!(
        ram.cpu_dirty_take().iter().all(|&w| w == 0),
        "logged after stop"
    );
}

#[test]
fn test_vmm_wait_irq_serving_answers_dma_before_the_interrupt_and_consumes_it() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.set_fdless(FdlessMemory::with_pattern(FDLESS, 0x2000));
    vmm.dma_map_fdless(FDLESS, 0x2000).unwrap();
    vmm.enable_device().unwrap();
    let msi = vmm.enable_msi().unwrap();
    // A worker that interrupts only once its DMA_READ has been answered.
    let dma = server.dma().handle();
    let irq = server.device().device().irq.clone().expect("attached");
    let worker = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        let r = dma.read(FDLESS, &mut buf);
        irq.trigger(0);
        r.map_err(|e| e.errno())
    });
    assert!(vmm.wait_irq_serving(&msi, WAIT).unwrap(), "no MSI");
    assert_eq!(worker.join().unwrap(), Ok(()));
    assert_eq!(vmm.requests(), 1);
    // Consumed: the next wait sees only a later interrupt.
    assert!(!vmm
        .wait_irq_serving(&msi, Duration::from_millis(30))
        .unwrap());
}

#[test]
fn test_vmm_serve_until_condition_true_without_a_message_is_seen_at_once() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = flag.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        f.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let start = std::time::Instant::now();
    let held = vmm
        .serve_until(Duration::from_secs(10), |_| {
            flag.load(std::sync::atomic::Ordering::SeqCst)
        })
        .unwrap();
    assert!(held);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    setter.join().unwrap();
    // A condition that never holds: false at the timeout, not Ok(()) as if it had.
    assert!(!vmm
        .serve_until(Duration::from_millis(20), |_| false)
        .unwrap());
}

/// Panics on every BAR write: a device bug.
struct Panicky;

impl crate::pci::PciDevice for Panicky {
    fn config(&self) -> crate::pci::PciConfig {
        let bar = crate::pci::BarSpec {
            index: 0,
            size: 16,
            kind: crate::pci::BarKind::Mmio32,
            prefetchable: false,
            shared: None,
        };
        crate::pci::PciConfig {
            bars: vec![bar],
            ..Default::default()
        }
    }
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&mut self, _bar: usize, offset: u64, _data: &[u8]) {
        panic!("planted bug at {offset:#x}");
    }
}

#[test]
fn test_test_server_device_panic_is_reported_with_the_test_name() {
    let server = TestServer::start_pci(Panicky).unwrap();
    let mut vmm = server.connect().unwrap();
    let err = vmm.write32(0, 4, 1).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let panics = server.device_panics();
    assert_eq!(panics.len(), 1, "{panics:?}");
    assert!(
        panics[0].contains("test_test_server_device_panic_is_reported_with_the_test_name")
            && panics[0].contains("region_write")
            && panics[0].contains("planted bug at 0x4"),
        "{}",
        panics[0]
    );
    // The server serves on: a new client works.
    let mut vmm = server.connect().unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), 0);
}

/// The MSI-X table and PBA of the device as (bar, table offset, pba offset), read from the
/// capability as a guest driver does.
fn msix_layout(vmm: &mut Vmm) -> (u32, u64, u32, u64) {
    let cap = vmm.find_capability(PCI_CAP_ID_MSIX).unwrap().unwrap();
    let table = vmm.read32(region_index::CONFIG, cap + 4).unwrap();
    let pba = vmm.read32(region_index::CONFIG, cap + 8).unwrap();
    (
        table & 7,
        u64::from(table & !7),
        pba & 7,
        u64::from(pba & !7),
    )
}

const QUIET: Duration = Duration::from_millis(50);

#[test]
fn test_msi_bus_master_clear_trigger_dropped_set_again_delivers() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let msi = vmm.enable_msi().unwrap();
    vmm.set_command(PCI_COMMAND_MEMORY).unwrap();
    trigger(&server);
    assert_eq!(wait_eventfd(&msi, QUIET), None, "no MSI while BME is clear");
    vmm.enable_device().unwrap();
    assert_eq!(
        wait_eventfd(&msi, QUIET),
        None,
        "dropped, not held until BME is set"
    );
    trigger(&server);
    assert_eq!(wait_eventfd(&msi, WAIT), Some(1));
}

#[test]
fn test_msix_bus_master_clear_unmasked_trigger_dropped_no_pending_bit() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let msix = vmm.enable_msix().unwrap();
    let (_, _, pba_bar, pba) = msix_layout(&mut vmm);
    vmm.set_command(PCI_COMMAND_MEMORY).unwrap();
    trigger(&server);
    assert_eq!(
        wait_eventfd(&msix, QUIET),
        None,
        "no MSI-X while BME is clear"
    );
    assert_eq!(
        vmm.read64(pba_bar, pba).unwrap(),
        0,
        "an unmasked vector does not pend"
    );
    vmm.enable_device().unwrap();
    assert_eq!(wait_eventfd(&msix, QUIET), None);
    trigger(&server);
    assert_eq!(wait_eventfd(&msix, WAIT), Some(1));
}

#[test]
fn test_msix_masked_vector_pends_while_bus_master_clear_sent_once_when_set() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let msix = vmm.enable_msix().unwrap();
    let (bar, table, pba_bar, pba) = msix_layout(&mut vmm);
    vmm.write32(bar, table + 12, 1).unwrap(); // mask vector 0
    vmm.set_command(PCI_COMMAND_MEMORY).unwrap();
    trigger(&server);
    assert_eq!(
        vmm.read64(pba_bar, pba).unwrap(),
        1,
        "masked: the PBA bit is set"
    );
    vmm.write32(bar, table + 12, 0).unwrap(); // unmask with BME still clear
    assert_eq!(
        wait_eventfd(&msix, QUIET),
        None,
        "not sent while BME is clear"
    );
    assert_eq!(
        vmm.read64(pba_bar, pba).unwrap(),
        1,
        "the pending bit stays until the message is sent"
    );
    vmm.enable_device().unwrap();
    assert_eq!(wait_eventfd(&msix, WAIT), Some(1), "sent when BME is set");
    assert_eq!(vmm.read64(pba_bar, pba).unwrap(), 0);
    assert_eq!(wait_eventfd(&msix, QUIET), None, "exactly once");
}

#[test]
fn test_intx_bus_master_clear_still_delivered() {
    let server = pci_server();
    let mut vmm = server.connect().unwrap();
    vmm.enable_device().unwrap();
    let intx = vmm.enable_intx().unwrap();
    let cmd = vmm.command().unwrap();
    vmm.set_command(cmd & !PCI_COMMAND_MASTER).unwrap();
    trigger(&server);
    assert_eq!(
        wait_eventfd(&intx, WAIT),
        Some(1),
        "INTx is not bus mastering"
    );
}
