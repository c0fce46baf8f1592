//! A tiny [`PciDevice`] and helpers for the adapter's unit tests.

use std::collections::HashMap;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::{BarKind, BarSpec, MsixSpec, PciAdapter, PciConfig, PciDevice, PciIds, SharedMemory};
use crate::device::{Device, IrqAction, IrqData, SetIrqs};
use crate::dma::{DmaHandle, DmaSpace};
use crate::irq::Interrupts;

/// Records what the adapter forwarded; BAR registers are sparse bytes reading 0 by default.
#[derive(Default)]
pub(crate) struct TestDevice {
    pub(crate) config: PciConfig,
    pub(crate) regs: HashMap<(usize, u64), u8>,
    pub(crate) accesses: Vec<(usize, u64, usize, bool)>,
    pub(crate) irq: Option<Interrupts>,
    pub(crate) resets: u32,
    pub(crate) disconnects: u32,
    pub(crate) unmaps: Vec<(u64, u64)>,
}

impl PciDevice for TestDevice {
    fn config(&self) -> PciConfig {
        self.config.clone()
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        self.accesses.push((bar, offset, data.len(), false));
        for (i, b) in data.iter_mut().enumerate() {
            *b = self
                .regs
                .get(&(bar, offset + i as u64))
                .copied()
                .unwrap_or(0);
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        self.accesses.push((bar, offset, data.len(), true));
        for (i, b) in data.iter().enumerate() {
            self.regs.insert((bar, offset + i as u64), *b);
        }
    }
    fn attach(&mut self, _dma: DmaHandle, irq: Interrupts) {
        self.irq = Some(irq);
    }
    fn reset(&mut self) {
        self.resets += 1;
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.unmaps.push((iova, size));
    }
    fn disconnected(&mut self) {
        self.disconnects += 1;
    }
}

/// A memory or I/O BAR without shared memory.
pub(crate) fn bar(index: usize, size: u64, kind: BarKind, prefetchable: bool) -> BarSpec {
    BarSpec {
        index,
        size,
        kind,
        prefetchable,
        shared: None,
    }
}

/// BAR0 32-bit 16 KiB (MSI-X table at 0x2000, PBA at 0x3000), BAR2 64-bit prefetchable
/// 8 GiB, BAR4 I/O 32 bytes, BAR5 32-bit 8 KiB shared memory; INTx, 4 MSI, 8 MSI-X.
pub(crate) fn full_config() -> PciConfig {
    let shm = Arc::new(SharedMemory::new("test-bar5", 0x2000).unwrap());
    let mut bar5 = bar(5, 0x2000, BarKind::Mmio32, false);
    bar5.shared = Some(shm);
    PciConfig {
        ids: PciIds {
            vendor: 0x1af4,
            device: 0x10f0,
            subsystem_vendor: 0x1234,
            subsystem: 0x5678,
            class_code: 0x03_00_01,
            revision: 2,
        },
        bars: vec![
            bar(0, 0x4000, BarKind::Mmio32, false),
            bar(2, 0x2_0000_0000, BarKind::Mmio64, true),
            bar(4, 32, BarKind::Io, false),
            bar5,
        ],
        intx: true,
        msi_vectors: 4,
        msix: Some(MsixSpec {
            vectors: 8,
            table_bar: 0,
            table_offset: 0x2000,
            pba_bar: 0,
            pba_offset: 0x3000,
        }),
        registers: Vec::new(),
        vendor_capabilities: Vec::new(),
    }
}

/// An attached adapter around a [`TestDevice`] with `config`.
pub(crate) fn adapter(config: PciConfig) -> PciAdapter<TestDevice> {
    let mut a = PciAdapter::new(TestDevice {
        config,
        ..Default::default()
    })
    .unwrap();
    a.attach(DmaSpace::new(Default::default()).handle());
    a
}

/// The Interrupts handle the device got at attach.
pub(crate) fn irq_of(a: &PciAdapter<TestDevice>) -> Interrupts {
    a.device().irq.clone().expect("attached")
}

pub(crate) fn cfg_read(a: &mut PciAdapter<TestDevice>, offset: u64, len: usize) -> u64 {
    let mut buf = [0u8; 8];
    a.region_read(7, offset, &mut buf[..len]).unwrap();
    u64::from_le_bytes(buf)
}

pub(crate) fn cfg_write(a: &mut PciAdapter<TestDevice>, offset: u64, len: usize, value: u64) {
    a.region_write(7, offset, &value.to_le_bytes()[..len])
        .unwrap();
}

/// Set memory decoding and Bus Master (MSI/MSI-X are sent only with BME set).
pub(crate) fn bus_master_on(a: &mut PciAdapter<TestDevice>) {
    cfg_write(a, 0x04, 2, 0x0006);
}

pub(crate) fn bar_read32(a: &mut PciAdapter<TestDevice>, bar: u32, offset: u64) -> u32 {
    let mut buf = [0u8; 4];
    a.region_read(bar, offset, &mut buf).unwrap();
    u32::from_le_bytes(buf)
}

pub(crate) fn bar_write32(a: &mut PciAdapter<TestDevice>, bar: u32, offset: u64, value: u32) {
    a.region_write(bar, offset, &value.to_le_bytes()).unwrap();
}

/// (capability ID, offset) along the capability list.
pub(crate) fn walk_caps(a: &mut PciAdapter<TestDevice>) -> Vec<(u8, u8)> {
    let mut out = Vec::new();
    let mut ptr = cfg_read(a, 0x34, 1) as u8;
    while ptr != 0 && out.len() < 48 {
        let id = cfg_read(a, u64::from(ptr), 1) as u8;
        out.push((id, ptr));
        ptr = cfg_read(a, u64::from(ptr) + 1, 1) as u8;
    }
    out
}

pub(crate) fn efd() -> EventFd {
    EventFd::new(libc::EFD_NONBLOCK).unwrap()
}

/// True if the eventfd was signalled (and consumes the count).
pub(crate) fn fired(fd: &EventFd) -> bool {
    fd.read().is_ok()
}

/// Attach fresh eventfds to `count` vectors of `index`; returns our clones.
pub(crate) fn attach_eventfds(
    a: &mut PciAdapter<TestDevice>,
    index: u32,
    count: u32,
) -> Vec<EventFd> {
    let fds: Vec<EventFd> = (0..count).map(|_| efd()).collect();
    let data = fds.iter().map(|f| Some(f.try_clone().unwrap())).collect();
    a.set_irqs(SetIrqs {
        index,
        start: 0,
        count,
        action: IrqAction::Trigger,
        data: IrqData::Eventfd(data),
    })
    .unwrap();
    fds
}

/// A SET_IRQS request with no data.
pub(crate) fn irqs(index: u32, start: u32, count: u32, action: IrqAction) -> SetIrqs {
    SetIrqs {
        index,
        start,
        count,
        action,
        data: IrqData::None,
    }
}
