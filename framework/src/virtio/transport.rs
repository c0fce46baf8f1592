//! [`VirtioPci`]: a [`VirtioDevice`] as a PCI device (layout in the module docs of
//! [`crate::virtio`]).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use crate::dma::DmaHandle;
use crate::irq::Interrupts;
use crate::pci::{BarKind, BarSpec, MsixSpec, PciConfig, PciDevice, PciIds, RegisterRange};

use super::common_cfg::{Action, CommonCfg, QueueRegs, COMMON_CFG_SIZE};
use super::error::VirtioError;
use super::queue::{QueueSetup, Virtqueue};
use super::signal::{Position, Shared};
use super::{
    status, Activation, VirtioDevice, MAX_QUEUES, TRANSPORT_FEATURES, VIRTIO_F_VERSION_1,
    VIRTIO_MSI_NO_VECTOR, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};

/// Size of BAR0, which holds every virtio structure and the MSI-X table and PBA.
pub const BAR0_SIZE: u64 = 0x8000;
const COMMON: u64 = 0x0000;
const ISR: u64 = 0x1000;
const DEVICE: u64 = 0x2000;
const NOTIFY: u64 = 0x3000;
const MSIX_TABLE: u64 = 0x4000;
const MSIX_PBA: u64 = 0x5000;
/// Bytes between two queues' notify addresses.
const NOTIFY_MULTIPLIER: u32 = 4;
/// Largest device config.
const MAX_CONFIG: u64 = 0x1000;
/// PCI vendor ID of virtio devices.
const VIRTIO_VENDOR: u16 = 0x1af4;
/// PCI device ID of modern virtio device 0.
const MODERN_DEVICE_BASE: u16 = 0x1040;

/// `cfg_type` of the virtio PCI capabilities.
const CAP_COMMON: u8 = 1;
const CAP_NOTIFY: u8 = 2;
const CAP_ISR: u8 = 3;
const CAP_DEVICE: u8 = 4;

/// Raises the configuration-change interrupt and bumps `config_generation`, from any
/// thread (for example after a host-side resize changed the device config).
#[derive(Clone, Debug)]
pub struct ConfigNotifier {
    shared: Arc<Shared>,
}

impl ConfigNotifier {
    /// The device configuration changed: tell the driver.
    pub fn notify(&self) {
        self.shared.config_changed();
    }

    /// The device cannot go on: set `DEVICE_NEEDS_RESET` and tell the driver.
    pub fn needs_reset(&self, why: &str) {
        self.shared.needs_reset(&why);
    }
}

/// A [`VirtioDevice`] served as a PCI function: serve it with
/// `PciAdapter::new(VirtioPci::new(device)?)`.
pub struct VirtioPci<D> {
    dev: D,
    pub(super) cfg: CommonCfg,
    pub(super) shared: Arc<Shared>,
    dma: Option<DmaHandle>,
    config_size: u64,
    max_chain_bytes: u64,
    active: bool,
    /// The device's [`super::VirtioMigrate::max_state_size`] (0: it does not migrate).
    pub(crate) device_max_state: u64,
    /// Migration: stopped, and what resumes (`migration.rs`).
    pub(crate) mig: super::migration::TransportMig,
}

fn bad(msg: String) -> VirtioError {
    VirtioError::Device(format!("invalid virtio device: {msg}"))
}

impl<D: VirtioDevice> VirtioPci<D> {
    /// Wrap `dev`; checks its queue sizes (1..=[`MAX_QUEUES`] queues, each size a power of
    /// two ≤ 32768) and its config size (≤ 4096).
    pub fn new(mut dev: D) -> Result<VirtioPci<D>, VirtioError> {
        let device_max_state = dev.migration().map_or(0, |m| m.max_state_size());
        let sizes = dev.queue_max_sizes();
        if sizes.is_empty() || sizes.len() > MAX_QUEUES {
            return Err(bad(format!("{} queues (1..={MAX_QUEUES})", sizes.len())));
        }
        if let Some(s) = sizes.iter().find(|s| !s.is_power_of_two() || **s > 32768) {
            return Err(bad(format!("queue size {s} (a power of two ≤ 32768)")));
        }
        let config_size = dev.config_size();
        if config_size > MAX_CONFIG {
            return Err(bad(format!("config size {config_size} (≤ {MAX_CONFIG})")));
        }
        let offered = dev.features() | TRANSPORT_FEATURES;
        // ≤ MAX_QUEUES + 1 vectors: fits.
        let vectors = sizes.len() as u16 + 1;
        Ok(VirtioPci {
            cfg: CommonCfg::new(offered, &sizes, vectors),
            shared: Arc::new(Shared::new(sizes.len())),
            max_chain_bytes: dev.max_chain_bytes(),
            dev,
            dma: None,
            config_size,
            active: false,
            device_max_state,
            mig: Default::default(),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The device, mutably.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// A handle that raises the config-change interrupt.
    pub fn config_notifier(&self) -> ConfigNotifier {
        ConfigNotifier {
            shared: self.shared.clone(),
        }
    }

    /// The device status register as the driver reads it.
    pub fn status(&self) -> u8 {
        self.shared.status.load(SeqCst)
    }

    /// The features the driver acknowledged.
    pub fn driver_features(&self) -> u64 {
        self.cfg.driver_features
    }

    fn msix(&self) -> MsixSpec {
        MsixSpec {
            vectors: self.cfg.queues.len() as u16 + 1,
            table_bar: 0,
            table_offset: MSIX_TABLE,
            pba_bar: 0,
            pba_offset: MSIX_PBA,
        }
    }

    fn notify_len(&self) -> u64 {
        self.cfg.queues.len() as u64 * u64::from(NOTIFY_MULTIPLIER)
    }

    pub(crate) fn full_reset(&mut self) {
        self.shared.epoch.fetch_add(1, SeqCst);
        self.dev.reset();
        self.cfg.reset();
        self.active = false;
        self.mig = Default::default();
        for p in &self.shared.positions {
            p.store(Position::default());
        }
        self.shared.status.store(0, SeqCst);
        self.shared.isr.store(0, SeqCst);
        self.shared
            .config_vector
            .store(VIRTIO_MSI_NO_VECTOR, SeqCst);
        for v in &self.shared.queue_vectors {
            v.store(VIRTIO_MSI_NO_VECTOR, SeqCst);
        }
        if let Some(irq) = self.shared.irq.get() {
            irq.lower_intx();
        }
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.full_reset();
            return;
        }
        let old = self.shared.status.load(SeqCst);
        let driver_bits = old & !status::DEVICE_NEEDS_RESET;
        if v & driver_bits != driver_bits {
            tracing::warn!(
                "virtio: status {v:#x} clears bits of {old:#x} without a reset: ignored"
            );
            return;
        }
        let mut new = v & !status::DEVICE_NEEDS_RESET;
        if new & status::FEATURES_OK != 0 && old & status::FEATURES_OK == 0 {
            let f = self.cfg.driver_features;
            if f & !self.cfg.offered != 0 || f & VIRTIO_F_VERSION_1 == 0 {
                tracing::warn!(
                    "virtio: features {f:#x} refused (offered {:#x}; VERSION_1 required)",
                    self.cfg.offered
                );
                new &= !status::FEATURES_OK;
            }
        }
        self.shared.status.fetch_or(new, SeqCst);
        if new & status::DRIVER_OK != 0 && old & status::DRIVER_OK == 0 {
            if new & status::FEATURES_OK == 0 {
                self.shared.needs_reset(&"DRIVER_OK without FEATURES_OK");
            } else {
                self.activate(false);
            }
        }
    }

    /// Hand the enabled queues to the device: from the reset position for a new
    /// activation, or (`restore`, after a migration stop) from where they were.
    pub(crate) fn activate(&mut self, restore: bool) {
        let Some(dma) = self.dma.clone() else {
            self.shared
                .needs_reset(&"DRIVER_OK before the device was attached");
            return;
        };
        let features = self.cfg.driver_features;
        let epoch = self.shared.epoch.load(SeqCst);
        let queues = self
            .cfg
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                q.enabled.then(|| {
                    let setup = QueueSetup {
                        index: i as u16,
                        size: q.size,
                        desc: q.desc,
                        avail: q.driver,
                        used: q.device,
                        event_idx: features & VIRTIO_RING_F_EVENT_IDX != 0,
                        indirect: features & VIRTIO_RING_F_INDIRECT_DESC != 0,
                        max_chain_bytes: self.max_chain_bytes,
                    };
                    let at = if restore {
                        self.shared.positions[i].load()
                    } else {
                        Position::default()
                    };
                    Virtqueue::new(setup, dma.clone(), self.shared.clone(), epoch, at)
                })
            })
            .collect();
        let activation = Activation {
            features,
            queues,
            dma,
            config: self.config_notifier(),
        };
        match self.dev.activate(activation) {
            Ok(()) => self.active = true,
            Err(e) => self
                .shared
                .needs_reset(&format_args!("activation failed: {e}")),
        }
    }

    fn enable_queue(&mut self, index: u16) {
        let running = self.shared.status.load(SeqCst) & status::DRIVER_OK != 0;
        let Some(q) = self.cfg.queues.get_mut(usize::from(index)) else {
            return;
        };
        if q.enabled || running {
            return;
        }
        match check_queue(q) {
            Ok(()) => q.enabled = true,
            Err(why) => self
                .shared
                .needs_reset(&format_args!("queue {index} not enabled: {why}")),
        }
    }

    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    pub(crate) fn set_inactive(&mut self) {
        self.active = false;
    }

    pub(crate) fn has_dma(&self) -> bool {
        self.dma.is_some()
    }

    fn caps(&self) -> Vec<Vec<u8>> {
        let cap = |cfg_type: u8, offset: u64, length: u64, extra: Option<u32>| {
            let len = if extra.is_some() { 20u8 } else { 16 };
            // Offsets and lengths are below BAR0_SIZE: they fit u32.
            let mut b = vec![len, cfg_type, 0, 0, 0, 0];
            b.extend_from_slice(&(offset as u32).to_le_bytes());
            b.extend_from_slice(&(length as u32).to_le_bytes());
            if let Some(x) = extra {
                b.extend_from_slice(&x.to_le_bytes());
            }
            b
        };
        let mut caps = vec![
            cap(CAP_COMMON, COMMON, COMMON_CFG_SIZE, None),
            cap(
                CAP_NOTIFY,
                NOTIFY,
                self.notify_len(),
                Some(NOTIFY_MULTIPLIER),
            ),
            cap(CAP_ISR, ISR, 4, None),
        ];
        if self.config_size > 0 {
            caps.push(cap(CAP_DEVICE, DEVICE, self.config_size, None));
        }
        caps
    }
}

/// A queue may be enabled: aligned areas that do not wrap.
pub(crate) fn check_queue(q: &QueueRegs) -> Result<(), &'static str> {
    let size = u64::from(q.size);
    if !q.size.is_power_of_two() {
        return Err("size is not a power of two");
    }
    if !q.desc.is_multiple_of(16) || !q.driver.is_multiple_of(2) || !q.device.is_multiple_of(4) {
        return Err("misaligned ring");
    }
    let fits = |base: u64, len: u64| base.checked_add(len).is_some();
    if !fits(q.desc, 16 * size) || !fits(q.driver, 6 + 2 * size) || !fits(q.device, 6 + 8 * size) {
        return Err("ring wraps the address space");
    }
    Ok(())
}

/// `[offset, offset + len)` relative to a structure at `base` of `size` bytes.
fn inside(offset: u64, len: usize, base: u64, size: u64) -> Option<u64> {
    let rel = offset.checked_sub(base)?;
    (rel.checked_add(len as u64)? <= size).then_some(rel)
}

impl<D: VirtioDevice> PciDevice for VirtioPci<D> {
    fn config(&self) -> PciConfig {
        let id = MODERN_DEVICE_BASE.wrapping_add(self.dev.device_id());
        let mut registers = vec![
            RegisterRange {
                bar: 0,
                offset: COMMON,
                size: COMMON_CFG_SIZE,
            },
            RegisterRange {
                bar: 0,
                offset: ISR,
                size: 4,
            },
            RegisterRange {
                bar: 0,
                offset: NOTIFY,
                size: self.notify_len(),
            },
        ];
        if self.config_size > 0 {
            registers.push(RegisterRange {
                bar: 0,
                offset: DEVICE,
                size: self.config_size,
            });
        }
        PciConfig {
            ids: PciIds {
                vendor: VIRTIO_VENDOR,
                device: id,
                subsystem_vendor: VIRTIO_VENDOR,
                subsystem: id,
                class_code: self.dev.class_code(),
                revision: 1,
            },
            bars: vec![BarSpec {
                index: 0,
                size: BAR0_SIZE,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 0,
            msix: Some(self.msix()),
            registers,
            vendor_capabilities: self.caps(),
        }
    }

    fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(rel) = inside(offset, data.len(), COMMON, COMMON_CFG_SIZE) {
            self.cfg.read(&self.shared, rel, data);
        } else if offset == ISR && !data.is_empty() {
            data[0] = self.shared.isr.swap(0, SeqCst);
            if let Some(irq) = self.shared.irq.get() {
                irq.lower_intx();
            }
        } else if let Some(rel) = inside(offset, data.len(), DEVICE, self.config_size) {
            self.dev.config_read(rel, data);
        }
    }

    fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
        if let Some(rel) = inside(offset, data.len(), COMMON, COMMON_CFG_SIZE) {
            match self.cfg.write(&self.shared, rel, data) {
                Action::None => {}
                Action::Status(v) => self.write_status(v),
                Action::Enable(q) => self.enable_queue(q),
            }
        } else if let Some(rel) = inside(offset, data.len(), DEVICE, self.config_size) {
            self.dev.config_write(rel, data);
        } else if let Some(rel) = inside(offset, data.len(), NOTIFY, self.notify_len()) {
            let index = (rel / u64::from(NOTIFY_MULTIPLIER)) as u16;
            let enabled = self
                .cfg
                .queues
                .get(usize::from(index))
                .is_some_and(|q| q.enabled);
            if self.mig.stopped {
                // A VMM does not run the guest while the device is stopped; the queues
                // are looked at again when it resumes.
                tracing::debug!("virtio: notify of queue {index} while stopped: deferred");
            } else if self.active && enabled {
                self.dev.queue_notify(index);
            } else {
                tracing::debug!("virtio: notify of queue {index} while not live: ignored");
            }
        } else {
            tracing::debug!("virtio: BAR0 write {offset:#x}+{} ignored", data.len());
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        self.dma = Some(dma);
        if self.shared.irq.set(irq).is_err() {
            tracing::warn!("virtio: attached twice; the first interrupt handle stays");
        }
        // A state loaded and resumed before attach (a daemon loads an instance before its
        // server runs) activates now.
        if self.mig.resume_at_attach {
            self.mig.resume_at_attach = false;
            self.reactivate();
        }
    }

    fn reset(&mut self) {
        self.full_reset();
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.dev.dma_unmap(iova, size);
    }

    fn disconnected(&mut self) {
        self.dev.disconnected();
    }

    /// The transport itself when the device migrates ([`super::VirtioDevice::migration`]):
    /// it saves and loads its own state around the device's section (`migration.rs`).
    fn migration(&mut self) -> Option<&mut dyn crate::migration::Migrate> {
        if self.dev.migration().is_some() {
            Some(self)
        } else {
            None
        }
    }
}
