//! Shared by the instance tests: a probe device that can be made to misbehave on command,
//! its parent, and a registry in a temp dir.
#![allow(dead_code)]

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use umdev::device::Device;
use umdev::dma::{DmaHandle, Prot};
use umdev::instance::{
    CreateRequest, InstanceError, InstanceType, Params, Parent, Registry, RegistryConfig, Resource,
};
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, PciAdapter, PciConfig, PciDevice, PciIds};

/// `0x00` ID (read): [`MAGIC`].
pub const REG_ID: u64 = 0x00;
/// `0x08` ADDR (64-bit): a guest address.
pub const REG_ADDR: u64 = 0x08;
/// `0x10` ADD (write `n`): add `n` to the u64 at ADDR, on the connection thread (a failure
/// is counted in the parent's `dma_failures`).
pub const REG_ADD: u64 = 0x10;
/// `0x18` PIN (write `n`): pin `n` pages from ADDR and keep them (dropped only on reset:
/// the unmap notifier ignores them, like a buggy device).
pub const REG_PIN: u64 = 0x18;
/// `0x20` PANIC (write): the device panics.
pub const REG_PANIC: u64 = 0x20;
/// `0x28` STUCK (write): the device blocks until the test opens the parent's gate.
pub const REG_STUCK: u64 = 0x28;
/// `0x30` The parameter `tag` the instance was created with (read).
pub const REG_TAG: u64 = 0x30;
/// The ID register's value.
pub const MAGIC: u32 = 0x5052_4f42;

/// A gate a stuck device waits at.
#[derive(Default)]
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    /// Let every waiting device go, and every later one pass at once.
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }
}

/// The probe device.
pub struct Probe {
    addr: u64,
    tag: u32,
    dma: Option<DmaHandle>,
    pinned: Vec<u64>,
    gate: Arc<Gate>,
    dma_failures: Arc<std::sync::atomic::AtomicUsize>,
}

impl PciDevice for Probe {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: 0x1af4,
                device: 0x10f1,
                ..Default::default()
            },
            bars: vec![BarSpec {
                index: 0,
                size: 4096,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 1,
            msix: None,
            registers: Vec::new(),
            vendor_capabilities: Vec::new(),
        }
    }

    fn attach(&mut self, dma: DmaHandle, _irq: Interrupts) {
        self.dma = Some(dma);
    }

    fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        let v = match offset {
            REG_ID => u64::from(MAGIC),
            REG_ADDR => self.addr,
            REG_TAG => u64::from(self.tag),
            _ => 0,
        };
        let n = data.len().min(8);
        data[..n].copy_from_slice(&v.to_le_bytes()[..n]);
    }

    fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        let n = data.len().min(8);
        b[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(b);
        let Some(dma) = self.dma.clone() else { return };
        match offset {
            REG_ADDR => self.addr = v,
            REG_ADD => {
                let r = dma
                    .read_obj::<u64>(self.addr)
                    .and_then(|c| dma.write_obj(self.addr, &c.wrapping_add(v)));
                if let Err(e) = r {
                    tracing::warn!("probe: DMA at {:#x} failed: {e}", self.addr);
                    self.dma_failures
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
            REG_PIN => {
                let first = self.addr >> 12;
                let pfns: Vec<u64> = (first..first + v.min(64)).collect();
                let mut host = vec![0u64; pfns.len()];
                match dma.pin_pages(&pfns, Prot::RW, &mut host) {
                    Ok(()) => self.pinned.extend(pfns),
                    Err(e) => tracing::warn!("probe: pin failed: {e}"),
                }
            }
            REG_PANIC => panic!("probe: told to panic"),
            REG_STUCK => self.gate.wait(),
            _ => {}
        }
    }

    fn reset(&mut self) {
        if let Some(dma) = &self.dma {
            let _ = dma.unpin_pages(&self.pinned);
        }
        self.pinned.clear();
        self.addr = 0;
    }
}

/// A parent of probes: `slots` slots; type `probe` takes one, `probe-2` two. Counts the
/// devices it built that are still alive.
pub struct ProbeParent {
    pub name: String,
    pub slots: u64,
    pub gate: Arc<Gate>,
    /// Sleep this long in `create` (to widen races).
    pub create_delay: Duration,
    /// Devices built and not dropped yet. (`create` panics when the `panic` parameter
    /// is given.)
    pub live: Arc<std::sync::atomic::AtomicUsize>,
    /// Failed ADD operations of its probes.
    pub dma_failures: Arc<std::sync::atomic::AtomicUsize>,
}

impl ProbeParent {
    pub fn new(name: &str, slots: u64) -> ProbeParent {
        ProbeParent {
            name: name.into(),
            slots,
            gate: Arc::new(Gate::default()),
            create_delay: Duration::ZERO,
            live: Default::default(),
            dma_failures: Default::default(),
        }
    }
}

/// Counts live probe devices of a parent.
struct Live(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The probe with its liveness token.
struct Counted(PciAdapter<Probe>, Live);

impl Device for Counted {
    fn info(&self) -> umdev::device::DeviceInfo {
        self.0.info()
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), umdev::device::DeviceError> {
        self.0.region_read(region, offset, data)
    }
    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), umdev::device::DeviceError> {
        self.0.region_write(region, offset, data)
    }
    fn attach(&mut self, dma: DmaHandle) {
        self.0.attach(dma)
    }
    fn set_irqs(&mut self, req: umdev::device::SetIrqs) -> Result<(), umdev::device::DeviceError> {
        self.0.set_irqs(req)
    }
    fn reset(&mut self) -> Result<(), umdev::device::DeviceError> {
        self.0.reset()
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.0.dma_unmap(iova, size)
    }
    fn disconnected(&mut self) {
        self.0.disconnected()
    }
    fn request_release(&mut self) -> bool {
        self.0.request_release()
    }
}

impl Parent for ProbeParent {
    fn name(&self) -> &str {
        &self.name
    }

    fn resources(&self) -> Vec<Resource> {
        vec![Resource {
            name: "slots".into(),
            unit: "slots".into(),
            total: self.slots,
        }]
    }

    fn types(&self) -> Vec<InstanceType> {
        let t = |name: &str, n: u64| InstanceType {
            name: name.into(),
            description: format!("a probe taking {n} slot(s)"),
            device_api: "vfio-pci".into(),
            needs: vec![("slots".into(), n)],
        };
        vec![t("probe", 1), t("probe-2", 2)]
    }

    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        for (k, v) in params {
            match k.as_str() {
                "tag" if v.parse::<u32>().is_ok() => {}
                "panic" => {}
                _ => {
                    return Err(InstanceError::BadParam {
                        name: k.clone(),
                        why: "probes take tag=<u32> only".into(),
                    })
                }
            }
        }
        Ok(())
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        std::thread::sleep(self.create_delay);
        if req.params.contains_key("panic") {
            panic!("probe parent: told to panic in create");
        }
        let tag = req.params.get("tag").map_or(0, |t| t.parse().unwrap_or(0));
        let probe = Probe {
            addr: 0,
            tag,
            dma: None,
            pinned: Vec::new(),
            gate: self.gate.clone(),
            dma_failures: self.dma_failures.clone(),
        };
        let adapter = PciAdapter::new(probe).map_err(InstanceError::Device)?;
        self.live.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Box::new(Counted(adapter, Live(self.live.clone()))))
    }
}

/// A registry in a fresh temp dir with short timeouts: release 300 ms, teardown 300 ms,
/// remote DMA 2 s.
pub fn registry() -> (tempfile::TempDir, Registry) {
    registry_with(|_| {})
}

/// [`registry`] with the configuration changed by `tune`.
pub fn registry_with(tune: impl FnOnce(&mut RegistryConfig)) -> (tempfile::TempDir, Registry) {
    umdev::testing::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let mut config = RegistryConfig::new(dir.path().join("sockets"));
    config.release_timeout = Duration::from_millis(300);
    config.teardown_timeout = Duration::from_millis(300);
    config.server.remote_dma_timeout = Duration::from_secs(2);
    tune(&mut config);
    let registry = Registry::new(config).unwrap();
    (dir, registry)
}

/// Parameters from `key=value` pairs.
pub fn params(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `available_instances` of `parent/type`.
pub fn available(registry: &Registry, parent: &str, ty: &str) -> u64 {
    registry
        .types()
        .into_iter()
        .find(|t| t.parent == parent && t.instance_type.name == ty)
        .unwrap_or_else(|| panic!("no type {parent}/{ty}"))
        .available_instances
}
