//! PciAdapter tests: the command register's BUS_MASTER bit drives the DMA space's switch
//! (attach, config writes, reset) and a change is logged at info level exactly once.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;

use super::test_device::*;
use super::PciAdapter;
use crate::device::Device;
use crate::dma::{DmaError, DmaSpace};

/// Counts the info-level events of the PCI layer on the thread it is installed on.
struct InfoCounter(Arc<AtomicU32>);

impl tracing::Subscriber for InfoCounter {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let m = event.metadata();
        if *m.level() == tracing::Level::INFO && m.target().starts_with("umdev::pci") {
            self.0.fetch_add(1, SeqCst);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn attached(space: &Arc<DmaSpace>) -> PciAdapter<TestDevice> {
    let mut a = PciAdapter::new(TestDevice {
        config: full_config(),
        ..Default::default()
    })
    .unwrap();
    a.attach(space.handle());
    a
}

#[test]
fn test_bus_master_bit_drives_dma_switch_and_logs_each_change_once() {
    let space = DmaSpace::new(Default::default());
    assert!(space.bus_master(), "a bare space allows DMA");
    let infos = Arc::new(AtomicU32::new(0));
    let counter = InfoCounter(infos.clone());
    tracing::subscriber::with_default(counter, || {
        let mut a = attached(&space);
        assert!(
            !space.bus_master(),
            "attach applies the reset value: BME clear"
        );
        assert_eq!(infos.load(SeqCst), 0, "attach is not a guest toggle");
        let mut buf = [0u8; 4];
        assert!(matches!(
            space.handle().read(0, &mut buf),
            Err(DmaError::BusMasterDisabled { .. })
        ));

        cfg_write(&mut a, 0x04, 2, 0x0006);
        assert!(space.bus_master());
        assert_eq!(infos.load(SeqCst), 1);
        // Accesses that leave the bit alone: no log, no change.
        for _ in 0..5 {
            cfg_write(&mut a, 0x04, 2, 0x0406);
            cfg_write(&mut a, 0x3c, 1, 0x0b);
            cfg_write(&mut a, 0x04, 1, 0x07);
        }
        assert!(space.bus_master());
        assert_eq!(infos.load(SeqCst), 1, "one line per change, not per access");

        cfg_write(&mut a, 0x04, 2, 0x0002);
        assert!(!space.bus_master(), "guest cleared BME");
        assert_eq!(infos.load(SeqCst), 2);
        cfg_write(&mut a, 0x04, 1, 0x04);
        assert!(
            space.bus_master(),
            "a byte write of the command register counts too"
        );
        assert_eq!(infos.load(SeqCst), 3);

        a.reset().unwrap();
        assert!(!space.bus_master(), "reset clears BME");
        assert_eq!(cfg_read(&mut a, 0x04, 2), 0);
        assert_eq!(infos.load(SeqCst), 4);
    });
}
