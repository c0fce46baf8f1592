//! The transport and queues through a socket: a test virtio device ("echo": queue 0 and
//! queue 1 each copy a chain's readable bytes, reversed, into its writable bytes) driven by
//! the harness's guest driver [`VirtioDriver`], with MSI-X per queue, INTx, EVENT_IDX,
//! indirect chains, bad chains, reset and hostile register writes.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::pci::{PciAdapter, PciDevice};
use crate::testing::{DeviceAccess, EventFd, TestServer, VirtioDriver, Vmm};

const RAM: u64 = 0x10_0000;
const Q0: u64 = RAM;
const Q1: u64 = RAM + 0x2000;
const DATA: u64 = RAM + 0x1_0000;
const WAIT: Duration = Duration::from_secs(5);
const ECHO_ID: u16 = 0x7f;

/// What the test reads back from the device.
#[derive(Default, Debug)]
struct Counters {
    activations: AtomicU64,
    resets: AtomicU64,
    completed: AtomicU64,
}

#[derive(Default)]
struct Echo {
    queues: Vec<Option<Virtqueue>>,
    dma: Option<crate::dma::DmaHandle>,
    config: [u8; 8],
    counters: Arc<Counters>,
    notifier: Option<ConfigNotifier>,
}

impl VirtioDevice for Echo {
    fn device_id(&self) -> u16 {
        ECHO_ID
    }
    fn features(&self) -> u64 {
        1 << 0
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![16, 8]
    }
    fn config_size(&self) -> u64 {
        8
    }
    fn config_read(&mut self, offset: u64, data: &mut [u8]) {
        let at = offset as usize;
        data.copy_from_slice(&self.config[at..at + data.len()]);
    }
    fn config_write(&mut self, offset: u64, data: &[u8]) {
        // Bytes 0..4 are the driver's; writing byte 4 bumps the generation.
        let at = offset as usize;
        if at + data.len() <= 4 {
            self.config[at..at + data.len()].copy_from_slice(data);
        } else if at == 4 {
            self.config[4] = self.config[4].wrapping_add(1);
            if let Some(n) = &self.notifier {
                n.notify();
            }
        }
    }
    fn activate(&mut self, a: Activation) -> Result<(), VirtioError> {
        self.counters.activations.fetch_add(1, SeqCst);
        self.queues = a.queues;
        self.dma = Some(a.dma);
        self.notifier = Some(a.config);
        Ok(())
    }
    fn queue_notify(&mut self, index: u16) {
        let (Some(Some(q)), Some(dma)) = (self.queues.get_mut(usize::from(index)), &self.dma)
        else {
            return;
        };
        loop {
            while let Ok(Some(chain)) = q.pop() {
                let written = match chain.pin(dma) {
                    Ok(p) => {
                        let mut data = p.read_all().unwrap_or_default();
                        data.reverse();
                        data.truncate(p.writable_len() as usize);
                        p.write(0, &data).map(|_| data.len() as u32).unwrap_or(0)
                    }
                    Err(e) => {
                        q.fail(VirtioError::Dma(e));
                        return;
                    }
                };
                if q.add_used(chain.head(), written).is_err() {
                    return;
                }
                self.counters.completed.fetch_add(1, SeqCst);
            }
            if q.notify_if_needed().is_err() || !q.enable_notification().unwrap_or(false) {
                return;
            }
        }
    }
    fn reset(&mut self) {
        self.counters.resets.fetch_add(1, SeqCst);
        self.queues.clear();
        self.dma = None;
    }
    fn migration(&mut self) -> Option<&mut dyn VirtioMigrate> {
        Some(self)
    }
}

type Server = TestServer<PciAdapter<VirtioPci<Echo>>>;

struct Setup {
    server: Server,
    vmm: Vmm,
    drv: VirtioDriver,
    /// vector 0: config, 1: queue 0, 2: queue 1.
    msix: Vec<EventFd>,
    counters: Arc<Counters>,
}

fn start() -> (Server, Vmm, Arc<Counters>) {
    let echo = Echo::default();
    let counters = echo.counters.clone();
    let server = TestServer::start_pci(VirtioPci::new(echo).unwrap()).unwrap();
    let mut vmm = server.connect().unwrap().with_ram(RAM, 1 << 20).unwrap();
    vmm.enable_device().unwrap();
    (server, vmm, counters)
}

fn setup(features: u64) -> Setup {
    let (server, mut vmm, counters) = start();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    let msix = drv.enable_msix(&mut vmm, 3).unwrap();
    assert!(
        drv.negotiate(&mut vmm, features).unwrap(),
        "features refused"
    );
    drv.set_config_vector(&mut vmm, 0).unwrap();
    drv.setup_queue(&mut vmm, 0, 16, Q0, 1).unwrap();
    drv.setup_queue(&mut vmm, 1, 8, Q1, 2).unwrap();
    drv.driver_ok(&mut vmm).unwrap();
    Setup {
        server,
        vmm,
        drv,
        msix,
        counters,
    }
}

const ALL: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_RING_F_INDIRECT_DESC;

fn needs_reset(s: &mut Setup) -> bool {
    s.drv.status(&mut s.vmm).unwrap() & status::DEVICE_NEEDS_RESET != 0
}

#[path = "migration_tests.rs"]
mod migration_tests;

#[test]
fn test_virtio_probe_sees_modern_ids_capabilities_and_features() {
    let (_server, mut vmm, _) = start();
    assert_eq!(vmm.read16(7, 0).unwrap(), 0x1af4);
    assert_eq!(vmm.read16(7, 2).unwrap(), 0x1040 + ECHO_ID);
    assert_eq!(vmm.read8(7, 8).unwrap(), 1, "revision 1: modern only");
    let drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert_eq!(drv.num_queues(&mut vmm).unwrap(), 2);
    assert_eq!(drv.queue_max(&mut vmm, 0).unwrap(), 16);
    assert_eq!(drv.queue_max(&mut vmm, 1).unwrap(), 8);
    assert_eq!(drv.queue_max(&mut vmm, 2).unwrap(), 0, "no queue 2");
    let f = drv.device_features(&mut vmm).unwrap();
    assert_eq!(f, 1 | TRANSPORT_FEATURES);
}

#[test]
fn test_virtio_features_without_version_1_or_not_offered_are_refused() {
    let (_server, mut vmm, counters) = start();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert!(
        !drv.negotiate(&mut vmm, 0).unwrap(),
        "legacy (no VERSION_1)"
    );
    assert!(
        !drv.negotiate(&mut vmm, VIRTIO_F_VERSION_1 | 1 << 40)
            .unwrap(),
        "not offered"
    );
    assert!(drv.negotiate(&mut vmm, VIRTIO_F_VERSION_1 | 1).unwrap());
    // DRIVER_OK without FEATURES_OK is an error, not an activation.
    assert!(!drv.negotiate(&mut vmm, 0).unwrap());
    drv.driver_ok(&mut vmm).unwrap();
    assert_ne!(
        drv.status(&mut vmm).unwrap() & status::DEVICE_NEEDS_RESET,
        0
    );
    assert_eq!(counters.activations.load(SeqCst), 0);
}

#[test]
fn test_virtio_chain_across_pages_is_echoed_with_its_queue_vector() {
    let mut s = setup(ALL);
    let input: Vec<u8> = (0..0x1800u32).map(|i| (i * 7) as u8).collect();
    s.vmm.ram().write(DATA + 0xff0, &input).unwrap();
    // Readable: two buffers across a page edge; writable: two buffers, one unaligned.
    let bufs = [
        (DATA + 0xff0, 0x1000, false),
        (DATA + 0x1ff0, 0x800, false),
        (DATA + 0x8003, 0x1000, true),
        (DATA + 0xa000, 0x800, true),
    ];
    let head = s.drv.add_chain(&mut s.vmm, 1, &bufs).unwrap();
    s.drv.publish(&mut s.vmm, 1, head).unwrap();
    s.drv.kick(&mut s.vmm, 1).unwrap();
    assert!(
        s.vmm.wait_irq_serving(&s.msix[2], WAIT).unwrap(),
        "no queue-1 MSI-X"
    );
    assert_eq!(
        s.drv.take_used(&mut s.vmm, 1).unwrap(),
        Some((u32::from(head), 0x1800))
    );
    let mut out = s.vmm.ram().read_vec(DATA + 0x8003, 0x1000).unwrap();
    out.extend(s.vmm.ram().read_vec(DATA + 0xa000, 0x800).unwrap());
    let mut expect = input.clone();
    expect.reverse();
    assert_eq!(out, expect);
    assert!(!s
        .vmm
        .wait_irq_serving(&s.msix[1], Duration::from_millis(20))
        .unwrap());
    s.server.assert_space_unpinned();
}

#[test]
fn test_virtio_indirect_chain_is_echoed_and_refused_without_the_feature() {
    let mut s = setup(ALL);
    s.vmm.ram().write(DATA, b"abcdef").unwrap();
    let bufs = [(DATA, 6, false), (DATA + 0x100, 6, true)];
    let head = s
        .drv
        .add_indirect(&mut s.vmm, 0, DATA + 0x2000, &bufs)
        .unwrap();
    s.drv.publish(&mut s.vmm, 0, head).unwrap();
    s.drv.kick(&mut s.vmm, 0).unwrap();
    assert!(s.vmm.wait_irq_serving(&s.msix[1], WAIT).unwrap());
    assert_eq!(s.vmm.ram().read_vec(DATA + 0x100, 6).unwrap(), b"fedcba");

    let mut s = setup(VIRTIO_F_VERSION_1);
    let head = s
        .drv
        .add_indirect(&mut s.vmm, 0, DATA + 0x2000, &bufs)
        .unwrap();
    s.drv.publish(&mut s.vmm, 0, head).unwrap();
    s.drv.kick(&mut s.vmm, 0).unwrap();
    assert!(
        s.vmm.wait_irq_serving(&s.msix[0], WAIT).unwrap(),
        "no config MSI-X"
    );
    assert!(needs_reset(&mut s));
    assert_eq!(s.counters.completed.load(SeqCst), 0);
    s.server.assert_space_unpinned();
}

#[test]
fn test_virtio_looping_chain_sets_needs_reset_and_pins_nothing() {
    let mut s = setup(ALL);
    // 0 → 1 → 0 → …
    s.drv.write_desc(&mut s.vmm, 0, 0, (DATA, 8, 1, 1)).unwrap();
    s.drv
        .write_desc(&mut s.vmm, 0, 1, (DATA + 8, 8, 1, 0))
        .unwrap();
    s.drv.publish(&mut s.vmm, 0, 0).unwrap();
    s.drv.kick(&mut s.vmm, 0).unwrap();
    assert!(
        s.vmm.wait_irq_serving(&s.msix[0], WAIT).unwrap(),
        "no config MSI-X"
    );
    assert!(needs_reset(&mut s));
    // The stopped queue ignores further kicks; the other queue still works.
    s.drv.kick(&mut s.vmm, 0).unwrap();
    assert_eq!(s.drv.take_used(&mut s.vmm, 0).unwrap(), None);
    s.server.assert_space_unpinned();
    // A reset and a new negotiation bring the device back.
    assert!(s.drv.negotiate(&mut s.vmm, ALL).unwrap());
    assert!(!needs_reset(&mut s));
    // One reset at the first negotiation (status 0), one now.
    assert_eq!(s.counters.resets.load(SeqCst), 2);
}

#[test]
fn test_virtio_avail_index_jump_sets_needs_reset() {
    let mut s = setup(ALL);
    s.drv.set_avail_idx(&mut s.vmm, 1, 9).unwrap(); // queue size 8
    s.drv.kick(&mut s.vmm, 1).unwrap();
    assert!(s.vmm.wait_irq_serving(&s.msix[0], WAIT).unwrap());
    assert!(needs_reset(&mut s));
}

#[test]
fn test_virtio_event_idx_interrupts_only_at_used_event() {
    let mut s = setup(ALL);
    s.drv.set_used_event(&mut s.vmm, 0, 2).unwrap(); // interrupt when used idx passes 2
    for i in 0..3u64 {
        let head = s
            .drv
            .add_chain(
                &mut s.vmm,
                0,
                &[(DATA + 16 * i, 4, false), (DATA + 0x800, 4, true)],
            )
            .unwrap();
        s.drv.publish(&mut s.vmm, 0, head).unwrap();
        s.drv.kick(&mut s.vmm, 0).unwrap();
        let fired = s
            .vmm
            .wait_irq_serving(
                &s.msix[1],
                Duration::from_millis(if i == 2 { 5000 } else { 50 }),
            )
            .unwrap();
        // The first completion always interrupts (nothing signalled yet); then only the
        // one that moves the used index past used_event (idx 2 → 3).
        assert_eq!(fired, i == 0 || i == 2, "completion {i}");
        // The device asks to be notified at the next avail entry.
        assert_eq!(s.drv.avail_event(&mut s.vmm, 0).unwrap(), i as u16 + 1);
    }
    assert_eq!(s.counters.completed.load(SeqCst), 3);
}

#[test]
fn test_virtio_intx_fallback_sets_isr_and_reading_clears_it() {
    let (_server, mut vmm, _) = start();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    let intx = vmm.enable_intx().unwrap();
    assert!(drv.negotiate(&mut vmm, ALL).unwrap());
    drv.setup_queue(&mut vmm, 0, 16, Q0, VIRTIO_MSI_NO_VECTOR)
        .unwrap();
    drv.driver_ok(&mut vmm).unwrap();
    let head = drv
        .add_chain(&mut vmm, 0, &[(DATA, 4, false), (DATA + 64, 4, true)])
        .unwrap();
    drv.publish(&mut vmm, 0, head).unwrap();
    drv.kick(&mut vmm, 0).unwrap();
    assert!(vmm.wait_irq_serving(&intx, WAIT).unwrap(), "no INTx");
    assert_eq!(drv.read_isr(&mut vmm).unwrap(), 1, "queue bit");
    assert_eq!(drv.read_isr(&mut vmm).unwrap(), 0, "cleared by the read");
}

#[test]
fn test_virtio_device_config_and_generation_change_raise_config_vector() {
    let mut s = setup(ALL);
    s.drv.write_config(&mut s.vmm, 0, &[1, 2, 3, 4]).unwrap();
    let mut b = [0u8; 4];
    s.drv.read_config(&mut s.vmm, 0, &mut b).unwrap();
    assert_eq!(b, [1, 2, 3, 4]);
    let g = s.drv.generation(&mut s.vmm).unwrap();
    s.drv.write_config(&mut s.vmm, 4, &[0]).unwrap();
    assert!(s.vmm.wait_irq_serving(&s.msix[0], WAIT).unwrap());
    assert_eq!(s.drv.generation(&mut s.vmm).unwrap(), g.wrapping_add(1));
}

#[test]
fn test_virtio_reset_clears_registers_and_old_queues_stop() {
    let mut s = setup(ALL);
    let bar = s.drv.bar();
    let c = s.drv.common();
    s.drv.set_status(&mut s.vmm, 0).unwrap();
    assert_eq!(s.drv.status(&mut s.vmm).unwrap(), 0);
    s.vmm.write16(bar, c + 0x16, 0).unwrap();
    assert_eq!(s.vmm.read16(bar, c + 0x1c).unwrap(), 0, "queue disabled");
    assert_eq!(s.vmm.read16(bar, c + 0x1a).unwrap(), VIRTIO_MSI_NO_VECTOR);
    assert_eq!(
        s.counters.resets.load(SeqCst),
        2,
        "the negotiation's and this one"
    );
    // A kick after the reset reaches nothing.
    s.drv.kick(&mut s.vmm, 0).unwrap();
    assert_eq!(s.counters.completed.load(SeqCst), 0);
    // A vector beyond the MSI-X table reads back as NO_VECTOR.
    s.vmm.write16(bar, c + 0x1a, 3).unwrap();
    assert_eq!(s.vmm.read16(bar, c + 0x1a).unwrap(), VIRTIO_MSI_NO_VECTOR);
}

#[test]
fn test_virtio_misaligned_queue_is_not_enabled() {
    let (_server, mut vmm, _) = start();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert!(drv.negotiate(&mut vmm, ALL).unwrap());
    drv.setup_queue(&mut vmm, 0, 16, Q0 + 8, 0).unwrap(); // descriptors not 16-aligned
    let (bar, c) = (drv.bar(), drv.common());
    assert_eq!(vmm.read16(bar, c + 0x1c).unwrap(), 0);
    assert_ne!(
        drv.status(&mut vmm).unwrap() & status::DEVICE_NEEDS_RESET,
        0
    );
}

#[test]
fn test_virtio_queue_from_before_a_reset_touches_nothing() {
    let mut s = setup(ALL);
    // Take the device's queue out, reset, and use the old queue: refused.
    let mut old = s.server.device().device_mut().device_mut().queues[0]
        .take()
        .unwrap();
    s.drv.set_status(&mut s.vmm, 0).unwrap();
    assert!(old.is_stopped());
    assert!(matches!(old.pop(), Err(VirtioError::Stopped)));
    assert!(matches!(old.add_used(0, 0), Err(VirtioError::Stopped)));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any sequence of BAR0 writes of any width and value (then reads of everything):
    /// no panic, no pin left.
    #[test]
    fn test_virtio_hostile_register_writes_never_panic(
        writes in proptest::collection::vec((0u64..0x3100, 0usize..4, any::<u64>()), 1..64)
    ) {
        let mut a = PciAdapter::new(VirtioPci::new(Echo::default()).unwrap()).unwrap();
        let space = crate::dma::DmaSpace::new(Default::default());
        crate::device::Device::attach(&mut a, space.handle());
        for (offset, w, v) in writes {
            let len = [1usize, 2, 4, 8][w];
            a.device_mut().bar_write(0, offset, &v.to_le_bytes()[..len]);
        }
        let mut b = [0u8; 8];
        for offset in (0..0x3100).step_by(2) {
            a.device_mut().bar_read(0, offset, &mut b[..2]);
        }
        prop_assert_eq!(space.stats().pinned_pages, 0);
    }
}

#[test]
fn test_virtio_bus_master_off_refuses_ring_access_and_needs_reset() {
    let mut s = setup(ALL);
    let head = s
        .drv
        .add_chain(&mut s.vmm, 0, &[(DATA, 4, false), (DATA + 64, 4, true)])
        .unwrap();
    s.drv.publish(&mut s.vmm, 0, head).unwrap();
    let cmd = s.vmm.command().unwrap();
    s.vmm
        .set_command(cmd & !crate::testing::PCI_COMMAND_MASTER)
        .unwrap();
    s.drv.kick(&mut s.vmm, 0).unwrap();
    // The ring read is refused: nothing completes, the device asks for a reset, and no
    // MSI-X goes out (a message is a bus-master write).
    assert!(needs_reset(&mut s));
    assert_eq!(s.counters.completed.load(SeqCst), 0);
    assert_eq!(s.drv.take_used(&mut s.vmm, 0).unwrap(), None);
    assert!(!s
        .vmm
        .wait_irq_serving(&s.msix[1], Duration::from_millis(50))
        .unwrap());
    s.server.assert_space_unpinned();
}
