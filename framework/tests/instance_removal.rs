//! Removing an instance a client holds: the device-request IRQ, waiting, Busy, force.

mod instance_util;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use instance_util::*;
use umdev::device::irq_index;
use umdev::instance::{InstanceError, Params, Registry};
use umdev::testing::{wait_eventfd, DeviceAccess, Vmm};

/// A registry with one probe served, and a client on it with RAM mapped and the device
/// enabled, its eventfd attached to the request IRQ.
fn attached(
    tune: impl FnOnce(&mut umdev::instance::RegistryConfig),
) -> (
    tempfile::TempDir,
    Arc<Registry>,
    String,
    Vmm,
    vmm_sys_util::eventfd::EventFd,
) {
    let (dir, reg) = registry_with(tune);
    reg.add_parent(Arc::new(ProbeParent::new("p", 2))).unwrap();
    let info = reg.create("probe", None, &Params::new()).unwrap();
    let mut vmm = Vmm::connect(&info.socket)
        .unwrap()
        .with_ram(1 << 30, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let req = vmm.attach_eventfd(irq_index::REQ).unwrap();
    assert!(reg.instance(&info.uuid).unwrap().client_attached);
    (dir, Arc::new(reg), info.uuid, vmm, req)
}

#[test]
fn test_remove_client_answers_request_irq_removal_succeeds() {
    let (_dir, reg, uuid, vmm, req) = attached(|c| c.release_timeout = Duration::from_secs(10));
    let remover = {
        let (reg, uuid) = (reg.clone(), uuid.clone());
        std::thread::spawn(move || reg.remove(&uuid, false))
    };
    // The client sees the request, as QEMU does, and lets go (QEMU unplugs the device).
    assert_eq!(
        wait_eventfd(&req, Duration::from_secs(5)),
        Some(1),
        "the request IRQ did not fire"
    );
    drop(vmm);
    let report = remover.join().unwrap().unwrap();
    assert!(report.client_was_attached && report.release_requested && !report.forced);
    assert!(report.waited < Duration::from_secs(10));
    assert_eq!(report.dma.maps, 0);
    assert!(matches!(
        reg.instance(&uuid),
        Err(InstanceError::NoSuchInstance(_))
    ));
    assert_eq!(available(&reg, "p", "probe"), 2);
}

#[test]
fn test_remove_client_ignores_request_irq_busy_and_still_served() {
    let (_dir, reg, uuid, mut vmm, req) =
        attached(|c| c.release_timeout = Duration::from_millis(400));
    let remover = {
        let (reg, uuid) = (reg.clone(), uuid.clone());
        std::thread::spawn(move || reg.remove(&uuid, false))
    };
    assert_eq!(wait_eventfd(&req, Duration::from_secs(5)), Some(1));
    // A second removal meanwhile does not start another round.
    let second = reg.remove(&uuid, false);
    let first = remover.join().unwrap();
    assert!(
        matches!(first, Err(InstanceError::Busy(ref u)) if *u == uuid),
        "{first:?}"
    );
    assert!(matches!(second, Err(InstanceError::Busy(_))), "{second:?}");
    // Nothing was torn down: the instance is listed, holds its slot, and serves its client.
    let listed = reg.instance(&uuid).unwrap();
    assert!(listed.client_attached);
    assert_eq!(listed.dma.maps, 1);
    assert_eq!(available(&reg, "p", "probe"), 1);
    assert_eq!(vmm.read32(0, REG_ID).unwrap(), MAGIC);
    vmm.ram().write_u64(1 << 30, 1).unwrap();
    vmm.write64(0, REG_ADDR, 1 << 30).unwrap();
    vmm.write32(0, REG_ADD, 1).unwrap();
    assert_eq!(vmm.ram().read_u64(1 << 30).unwrap(), 2);
    // A later removal asks again.
    let again = reg.remove(&uuid, false);
    assert!(matches!(again, Err(InstanceError::Busy(_))), "{again:?}");
    assert_eq!(wait_eventfd(&req, Duration::from_secs(1)), Some(1));
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn test_remove_forced_with_pins_held_releases_them_and_logs() {
    let (_dir, reg, uuid, mut vmm, req) =
        attached(|c| c.release_timeout = Duration::from_millis(200));
    vmm.write64(0, REG_ADDR, 1 << 30).unwrap();
    vmm.write32(0, REG_PIN, 4).unwrap();
    assert_eq!(reg.instance(&uuid).unwrap().dma.pinned_pages, 4);

    let logs = Capture::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .with_ansi(false)
        .finish();
    let report = tracing::subscriber::with_default(subscriber, || reg.remove(&uuid, true)).unwrap();
    assert_eq!(wait_eventfd(&req, Duration::from_secs(1)), Some(1));
    assert!(report.client_was_attached && report.release_requested && report.forced);
    assert_eq!(report.dma.pinned_pages, 0, "{:?}", report.dma);
    assert_eq!(report.dma.locked_pages, 0);
    assert_eq!(report.dma.maps, 0);
    assert_eq!(
        report.dma.leaked_pins_released, 4,
        "the probe keeps its pins through the unmap notifier: force-released"
    );
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = logs
        .lines()
        .find(|l| l.contains("forced removal"))
        .unwrap_or_else(|| panic!("no forced-removal line in:\n{logs}"));
    assert!(
        line.contains(&uuid) && line.contains("leaked_pins_released=4"),
        "{line}"
    );
    // The client was cut off.
    assert!(vmm.read32(0, REG_ID).is_err());
    assert!(matches!(
        reg.instance(&uuid),
        Err(InstanceError::NoSuchInstance(_))
    ));
    assert_eq!(available(&reg, "p", "probe"), 2);
}

#[test]
fn test_remove_client_without_request_irq_forced_after_timeout() {
    let (_dir, reg) = registry_with(|c| c.release_timeout = Duration::from_millis(200));
    reg.add_parent(Arc::new(ProbeParent::new("p", 1))).unwrap();
    let info = reg.create("probe", None, &Params::new()).unwrap();
    let mut vmm = Vmm::connect(&info.socket).unwrap();
    assert!(matches!(
        reg.remove(&info.uuid, false),
        Err(InstanceError::Busy(_))
    ));
    assert_eq!(vmm.read32(0, REG_ID).unwrap(), MAGIC);
    let report = reg.remove(&info.uuid, true).unwrap();
    assert!(report.client_was_attached && !report.release_requested && report.forced);
    assert!(report.waited >= Duration::from_millis(200));
    assert_eq!(available(&reg, "p", "probe"), 1);
}

#[test]
fn test_stop_all_disconnects_without_request_irq_and_releases_pins() {
    let (_dir, reg, uuid, mut vmm, req) = attached(|c| c.release_timeout = Duration::from_secs(30));
    vmm.write64(0, REG_ADDR, 1 << 30).unwrap();
    vmm.write32(0, REG_PIN, 2).unwrap();
    let idle = reg.create("probe", None, &Params::new()).unwrap();
    assert_eq!(reg.instance(&uuid).unwrap().dma.pinned_pages, 2);

    let start = std::time::Instant::now();
    let mut results = reg.stop_all();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "stop_all waited for the release timeout"
    );
    results.sort_by(|a, b| a.as_ref().unwrap().uuid.cmp(&b.as_ref().unwrap().uuid));
    assert_eq!(results.len(), 2);
    let by_uuid = |u: &str| {
        results
            .iter()
            .map(|r| r.as_ref().unwrap())
            .find(|r| r.uuid == u)
            .unwrap()
            .clone()
    };
    let held = by_uuid(&uuid);
    assert!(held.client_was_attached && held.forced && !held.release_requested);
    assert_eq!(held.dma.pinned_pages, 0, "{:?}", held.dma);
    assert_eq!(held.dma.maps, 0);
    assert_eq!(held.dma.leaked_pins_released, 2);
    let idle_report = by_uuid(&idle.uuid);
    assert!(!idle_report.client_was_attached && !idle_report.forced);
    // The client was cut off without being asked to let go.
    assert_eq!(wait_eventfd(&req, Duration::from_millis(100)), None);
    assert!(vmm.read32(0, REG_ID).is_err());
    assert!(reg.instances().is_empty());
    assert!(!idle.socket.exists(), "socket removed");
    assert_eq!(available(&reg, "p", "probe"), 2);
}
