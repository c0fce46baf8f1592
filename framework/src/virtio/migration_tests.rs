//! The transport's migration with the echo device: queues continue on a second device at
//! their saved positions (a chain published before STOP without a notify is taken at
//! RUNNING), the device's section travels, interrupts go to the re-attached eventfds, and
//! streams that do not fit (other features, bad queues, chains in flight, cut short,
//! random bytes) are refused with the device left reset.

use super::*;
use crate::device::irq_index;
use crate::migration::{decode_state, encode_state, Decoder, Migrate, MigrationError};
use crate::testing::{migrate, MigrateOptions, MIGRATION_CAPS};
use crate::virtio::migration::{TransportStateV1, TRANSPORT_FORMAT, TRANSPORT_VERSION};

impl VirtioMigrate for Echo {
    fn max_state_size(&self) -> u64 {
        64
    }
    fn stop(&mut self) -> Result<(), MigrationError> {
        // Chains are echoed on the connection thread: none is in flight.
        self.queues.clear();
        self.dma = None;
        Ok(())
    }
    fn save(&mut self, out: &mut Vec<u8>) -> Result<(), MigrationError> {
        out.extend(encode_state("umdev-echo", 1, &self.config)?);
        Ok(())
    }
    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        let (_, config): (u32, [u8; 8]) = decode_state("umdev-echo", 1, 1, state)?;
        self.config = config;
        Ok(())
    }
}

fn migratable_start() -> (Server, Vmm, Arc<Counters>) {
    let echo = Echo::default();
    let counters = echo.counters.clone();
    let server = TestServer::start_pci(VirtioPci::new(echo).unwrap()).unwrap();
    let mut vmm = Vmm::connect_with_caps(server.path(), MIGRATION_CAPS)
        .unwrap()
        .with_ram(RAM, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    (server, vmm, counters)
}

fn migratable_setup() -> Setup {
    let (server, mut vmm, counters) = migratable_start();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    let msix = drv.enable_msix(&mut vmm, 3).unwrap();
    assert!(drv.negotiate(&mut vmm, ALL).unwrap());
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

/// Post a 16-byte chain on queue 0 (readable `tag`, writable 16 bytes); its head.
fn post(s: &mut Setup, tag: u8, kick: bool) -> u16 {
    let at = DATA + u64::from(tag) * 0x100;
    s.vmm.ram().write(at, &[tag; 16]).unwrap();
    let bufs = [(at, 16, false), (at + 0x80, 16, true)];
    let head = s.drv.add_chain(&mut s.vmm, 0, &bufs).unwrap();
    s.drv.publish(&mut s.vmm, 0, head).unwrap();
    if kick {
        s.drv.kick(&mut s.vmm, 0).unwrap();
    }
    head
}

fn saved(s: &Setup) -> Vec<u8> {
    let mut dev = s.server.device();
    let pci = dev.device_mut();
    pci.stop().unwrap();
    let b = pci.save().unwrap();
    pci.resume().unwrap();
    b
}

/// Split a saved state into the transport's section and the device's.
fn split(bytes: &[u8]) -> (TransportStateV1, Vec<u8>) {
    let (_, d) = Decoder::new(TRANSPORT_FORMAT, 1, 1, bytes).unwrap();
    let (st, rest): (TransportStateV1, &[u8]) = postcard::take_from_bytes(d.into_rest()).unwrap();
    (st, rest.to_vec())
}

fn join(st: &TransportStateV1, device: &[u8]) -> Vec<u8> {
    let mut b = encode_state(TRANSPORT_FORMAT, TRANSPORT_VERSION, st).unwrap();
    b.extend_from_slice(device);
    b
}

#[test]
fn test_virtio_migration_queues_continue_at_saved_positions_on_destination() {
    let mut s = migratable_setup();
    s.drv.write_config(&mut s.vmm, 0, &[1, 2, 3, 4]).unwrap();
    for tag in 1..=3 {
        let head = post(&mut s, tag, true);
        let used = s.drv.wait_used(&mut s.vmm, 0, WAIT).unwrap();
        assert_eq!(used, Some((u32::from(head), 16)));
    }
    // Published without a notify (the driver relies on EVENT_IDX): taken at RUNNING.
    let pending = post(&mut s, 4, false);
    let (dst_server, mut dst, dst_counters) = migratable_start();
    let msix = std::mem::take(&mut s.msix);
    migrate(
        &mut s.vmm,
        &mut dst,
        &MigrateOptions::default(),
        |_, _| Ok(()),
        |dst| {
            for (v, efd) in msix.iter().enumerate() {
                dst.set_irq_eventfd(irq_index::MSIX, v as u32, efd)?;
            }
            Ok(())
        },
    )
    .unwrap();
    let mut d = Setup {
        server: dst_server,
        vmm: dst,
        drv: s.drv,
        msix,
        counters: dst_counters,
    };
    assert_eq!(
        d.drv.wait_used(&mut d.vmm, 0, WAIT).unwrap(),
        Some((u32::from(pending), 16)),
        "the chain published before STOP"
    );
    let out = d.vmm.ram().read_vec(DATA + 4 * 0x100 + 0x80, 16).unwrap();
    assert_eq!(out, [4; 16]);
    let head = post(&mut d, 5, true);
    assert!(
        d.vmm.wait_irq_serving(&d.msix[1], WAIT).unwrap(),
        "no queue-0 MSI-X"
    );
    assert_eq!(
        d.drv.take_used(&mut d.vmm, 0).unwrap(),
        Some((u32::from(head), 16))
    );
    let mut used_idx = [0u8; 2];
    let q = d.drv.queue_layout(0).unwrap();
    d.vmm.ram().read(q.used + 2, &mut used_idx).unwrap();
    assert_eq!(u16::from_le_bytes(used_idx), 5, "the used ring continued");
    assert_eq!(s.counters.completed.load(SeqCst), 3);
    assert_eq!(d.counters.completed.load(SeqCst), 2);
    let mut cfg = [0u8; 4];
    d.drv.read_config(&mut d.vmm, 0, &mut cfg).unwrap();
    assert_eq!(cfg, [1, 2, 3, 4], "the device's section");
    assert_eq!(
        d.drv.status(&mut d.vmm).unwrap(),
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK
    );
    d.server.assert_space_unpinned();
}

#[test]
fn test_virtio_migration_stop_drops_notifies_and_resume_takes_them() {
    let mut s = migratable_setup();
    s.server.device().device_mut().stop().unwrap();
    let head = post(&mut s, 1, true);
    assert_eq!(
        s.drv
            .wait_used(&mut s.vmm, 0, Duration::from_millis(50))
            .unwrap(),
        None,
        "a chain completed while stopped"
    );
    s.server.device().device_mut().resume().unwrap();
    assert_eq!(
        s.drv.wait_used(&mut s.vmm, 0, WAIT).unwrap(),
        Some((u32::from(head), 16))
    );
}

#[test]
fn test_virtio_migration_unfit_transport_states_are_refused_and_reset() {
    let s = migratable_setup();
    let good = saved(&s);
    let (st, device) = split(&good);
    let mut bad: Vec<(&str, TransportStateV1)> = Vec::new();
    let mut push = |what, f: &dyn Fn(&mut TransportStateV1)| {
        let mut t = st.clone();
        f(&mut t);
        bad.push((what, t));
    };
    push("other features offered", &|t| t.offered |= 1 << 5);
    push("features not offered", &|t| t.driver_features |= 1 << 40);
    push("no VERSION_1", &|t| {
        t.driver_features &= !VIRTIO_F_VERSION_1
    });
    push("unknown status bit", &|t| t.status |= 0x20);
    push("active without DRIVER_OK", &|t| {
        t.status &= !status::DRIVER_OK
    });
    push("queue size not a power of two", &|t| t.queues[0].size = 3);
    push("queue larger than its maximum", &|t| t.queues[1].size = 16);
    push("misaligned ring", &|t| t.queues[0].desc += 8);
    push("wrapping ring", &|t| t.queues[0].device = u64::MAX - 3);
    push("vector beyond the table", &|t| t.queues[0].vector = 3);
    push("chains in flight", &|t| t.queues[0].next_avail += 2);
    push("one queue missing", &|t| {
        t.queues.pop();
    });
    push("disabled queue with positions", &|t| {
        t.queues[1].enabled = false;
        t.queues[1].next_used = 1;
        t.queues[1].next_avail = 1;
    });
    for (what, t) in bad {
        let (dst, _vmm, _) = migratable_start();
        let mut dev = dst.device();
        let pci = dev.device_mut();
        assert!(pci.load(&join(&t, &device)).is_err(), "{what}: accepted");
        assert_eq!(pci.status(), 0, "{what}: not reset");
        pci.resume().unwrap();
    }
    for cut in 0..good.len() {
        let (dst, _vmm, _) = migratable_start();
        let mut dev = dst.device();
        assert!(
            dev.device_mut().load(&good[..cut]).is_err(),
            "cut at {cut} of {}",
            good.len()
        );
    }
    let (dst, _vmm, _) = migratable_start();
    dst.device().device_mut().load(&good).unwrap();
    assert_ne!(dst.device().device().status(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn test_virtio_migration_random_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        flip in any::<(usize, u8)>(),
    ) {
        let echo = Echo::default();
        let mut pci = VirtioPci::new(echo).unwrap();
        let _ = pci.load(&bytes);
        // A valid header with random bytes behind it.
        let mut b = encode_state(TRANSPORT_FORMAT, TRANSPORT_VERSION, &()).unwrap();
        b.extend_from_slice(&bytes);
        if !b.is_empty() {
            let at = flip.0 % b.len();
            b[at] ^= flip.1;
        }
        let _ = pci.load(&b);
        pci.resume().unwrap();
    }
}

#[test]
fn test_virtio_migration_device_never_driven_saves_and_loads() {
    let (src, _vmm, _) = migratable_start();
    let bytes = {
        let mut dev = src.device();
        let pci = dev.device_mut();
        pci.stop().unwrap();
        pci.save().unwrap()
    };
    let (dst, _vmm2, counters) = migratable_start();
    let mut dev = dst.device();
    let pci = dev.device_mut();
    pci.load(&bytes).unwrap();
    pci.resume().unwrap();
    assert_eq!(pci.status(), 0);
    assert_eq!(counters.activations.load(SeqCst), 0, "nothing to activate");
}
