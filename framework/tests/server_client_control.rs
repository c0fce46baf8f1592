//! What a running server tells and does about its client: attached or not, waiting for it
//! to leave, dropping it while the server keeps serving, asking it to release the device.

use std::time::Duration;

use umdev::device::irq_index;
use umdev::pci::{BarKind, BarSpec, PciConfig, PciDevice, PciIds};
use umdev::testing::{wait_eventfd, DeviceAccess, TestServer, TrivialDevice};

#[test]
fn test_running_server_disconnect_client_keeps_serving_the_next() {
    let mut server = TestServer::start(TrivialDevice::default()).unwrap();
    let running = server.take_running().unwrap();
    assert!(!running.client_attached());
    assert!(running.wait_client_gone(Duration::ZERO));
    assert!(!running.disconnect_client(), "no client to disconnect");

    let mut first = server.connect().unwrap().with_ram(0, 1 << 16).unwrap();
    assert!(running.client_attached());
    assert!(!running.wait_client_gone(Duration::from_millis(50)));
    assert_eq!(server.dma().stats().maps, 1);
    assert!(running.disconnect_client());
    assert!(running.wait_client_gone(Duration::from_secs(5)));
    // Teardown is done when the client counts as gone.
    assert_eq!(server.dma().stats().maps, 0);
    assert!(
        first.read8(0, 0x10).is_err(),
        "the first client was cut off"
    );

    let mut second = server.connect().unwrap();
    assert_eq!(second.read8(0, 0x10).unwrap(), 0x10);
    assert!(running.client_attached());
    drop(second);
    assert!(running.wait_client_gone(Duration::from_secs(5)));
    assert!(!running.is_finished());
    running.shutdown().unwrap();
}

/// A PCI device with nothing but a BAR.
struct Bare;

impl PciDevice for Bare {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds::default(),
            bars: vec![BarSpec {
                index: 0,
                size: 4096,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 0,
            msix: None,
            registers: Vec::new(),
            vendor_capabilities: Vec::new(),
        }
    }
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

#[test]
fn test_running_server_request_release_fires_request_irq_of_pci_device() {
    let mut server = TestServer::start_pci(Bare).unwrap();
    let running = server.take_running().unwrap();
    let mut vmm = server.connect().unwrap();
    assert!(
        !running.request_release(Duration::from_secs(1)),
        "no eventfd attached: not signalled"
    );
    let req = vmm.attach_eventfd(irq_index::REQ).unwrap();
    assert!(running.request_release(Duration::from_secs(1)));
    assert_eq!(wait_eventfd(&req, Duration::from_secs(1)), Some(1));
    // Only the request IRQ: the error IRQ stays quiet.
    let err = vmm.attach_eventfd(irq_index::ERR).unwrap();
    assert!(running.request_release(Duration::from_secs(1)));
    assert_eq!(wait_eventfd(&req, Duration::from_secs(1)), Some(1));
    assert_eq!(wait_eventfd(&err, Duration::from_millis(20)), None);
    drop(vmm);
    running.shutdown().unwrap();

    let mut plain = TestServer::start(TrivialDevice::default()).unwrap();
    let running = plain.take_running().unwrap();
    let _vmm = plain.connect().unwrap();
    assert!(
        !running.request_release(Duration::from_secs(1)),
        "a device without a request IRQ"
    );
}
