//! The common configuration structure (virtio 1.2, 4.1.4.3): its registers, and the
//! transport state they set. Pure register logic; `transport.rs` acts on what a write asks
//! for ([`Action`]).
//!
//! | offset | field | width |
//! |---|---|---|
//! | 0x00 | device_feature_select | 4 |
//! | 0x04 | device_feature (read-only) | 4 |
//! | 0x08 | driver_feature_select | 4 |
//! | 0x0c | driver_feature | 4 |
//! | 0x10 | config_msix_vector | 2 |
//! | 0x12 | num_queues (read-only) | 2 |
//! | 0x14 | device_status | 1 |
//! | 0x15 | config_generation (read-only) | 1 |
//! | 0x16 | queue_select | 2 |
//! | 0x18 | queue_size | 2 |
//! | 0x1a | queue_msix_vector | 2 |
//! | 0x1c | queue_enable | 2 |
//! | 0x1e | queue_notify_off (read-only) | 2 |
//! | 0x20, 0x28, 0x30 | queue_desc, queue_driver, queue_device | 8 (or two 4-byte halves) |
//! | 0x38, 0x3a | queue_notify_data, queue_reset (not offered: read 0) | 2 |
//!
//! Reads of any width and alignment inside the structure see its bytes; writes must hit a
//! writable field with its width (the 64-bit addresses also as 32-bit halves): anything
//! else is ignored with a log line.

use std::sync::atomic::Ordering::SeqCst;

use super::signal::Shared;
use super::VIRTIO_MSI_NO_VECTOR;

/// Bytes of the common configuration structure.
pub(crate) const COMMON_CFG_SIZE: u64 = 0x40;

/// One queue's registers.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QueueRegs {
    pub(crate) max: u16,
    pub(crate) size: u16,
    pub(crate) desc: u64,
    pub(crate) driver: u64,
    pub(crate) device: u64,
    pub(crate) enabled: bool,
}

/// What a write asks the transport to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    None,
    /// The driver wrote `device_status`.
    Status(u8),
    /// The driver wrote 1 to `queue_enable` of this queue.
    Enable(u16),
}

/// The common configuration registers.
#[derive(Debug)]
pub(crate) struct CommonCfg {
    pub(crate) offered: u64,
    pub(crate) driver_features: u64,
    pub(crate) device_select: u32,
    pub(crate) driver_select: u32,
    pub(crate) queue_select: u16,
    pub(crate) queues: Vec<QueueRegs>,
    /// MSI-X table size (vectors ≥ this read back as NO_VECTOR).
    pub(crate) msix_vectors: u16,
}

impl CommonCfg {
    pub(crate) fn new(offered: u64, max_sizes: &[u16], msix_vectors: u16) -> CommonCfg {
        CommonCfg {
            offered,
            driver_features: 0,
            device_select: 0,
            driver_select: 0,
            queue_select: 0,
            queues: max_sizes
                .iter()
                .map(|&max| QueueRegs {
                    max,
                    size: max,
                    ..Default::default()
                })
                .collect(),
            msix_vectors,
        }
    }

    /// Back to the reset values (the vectors live in `Shared` and are reset there).
    pub(crate) fn reset(&mut self) {
        *self = CommonCfg::new(
            self.offered,
            &self.queues.iter().map(|q| q.max).collect::<Vec<_>>(),
            self.msix_vectors,
        );
    }

    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(usize::from(self.queue_select))
    }

    /// The structure's bytes as they read now.
    fn image(&self, shared: &Shared) -> [u8; COMMON_CFG_SIZE as usize] {
        let mut b = [0u8; COMMON_CFG_SIZE as usize];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        let half = |sel: u32, v: u64| match sel {
            0 => v as u32,
            1 => (v >> 32) as u32,
            _ => 0,
        };
        put(0x00, &self.device_select.to_le_bytes());
        put(0x04, &half(self.device_select, self.offered).to_le_bytes());
        put(0x08, &self.driver_select.to_le_bytes());
        put(
            0x0c,
            &half(self.driver_select, self.driver_features).to_le_bytes(),
        );
        put(0x10, &shared.config_vector.load(SeqCst).to_le_bytes());
        // At most MAX_QUEUES queues: fits.
        put(0x12, &(self.queues.len() as u16).to_le_bytes());
        put(0x14, &[shared.status.load(SeqCst)]);
        put(0x15, &[shared.generation.load(SeqCst)]);
        put(0x16, &self.queue_select.to_le_bytes());
        if let Some(q) = self.selected() {
            let vector = shared.queue_vectors[usize::from(self.queue_select)].load(SeqCst);
            put(0x18, &q.size.to_le_bytes());
            put(0x1a, &vector.to_le_bytes());
            put(0x1c, &u16::from(q.enabled).to_le_bytes());
            put(0x1e, &self.queue_select.to_le_bytes());
            put(0x20, &q.desc.to_le_bytes());
            put(0x28, &q.driver.to_le_bytes());
            put(0x30, &q.device.to_le_bytes());
        }
        b
    }

    pub(crate) fn read(&self, shared: &Shared, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let image = self.image(shared);
        let start = offset.min(COMMON_CFG_SIZE) as usize;
        let end = (start + data.len()).min(image.len());
        data[..end - start].copy_from_slice(&image[start..end]);
    }

    /// A vector the driver may use: inside the table, else NO_VECTOR.
    fn vector(&self, v: u16) -> u16 {
        if v < self.msix_vectors {
            v
        } else {
            VIRTIO_MSI_NO_VECTOR
        }
    }

    pub(crate) fn write(&mut self, shared: &Shared, offset: u64, data: &[u8]) -> Action {
        let mut bytes = [0u8; 8];
        let n = data.len().min(8);
        bytes[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(bytes);
        let running = shared.status.load(SeqCst) & super::status::DRIVER_OK != 0;
        let sel = usize::from(self.queue_select);
        match (offset, data.len()) {
            (0x00, 4) => self.device_select = v as u32,
            (0x08, 4) => self.driver_select = v as u32,
            (0x0c, 4) => {
                if running || shared.status.load(SeqCst) & super::status::FEATURES_OK != 0 {
                    tracing::debug!("virtio: driver_feature written after FEATURES_OK: ignored");
                } else {
                    match self.driver_select {
                        0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                        1 => {
                            self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32)
                        }
                        s => tracing::debug!("virtio: driver_feature select {s}: ignored"),
                    }
                }
            }
            (0x10, 2) => shared.config_vector.store(self.vector(v as u16), SeqCst),
            (0x14, 1) => return Action::Status(v as u8),
            (0x16, 2) => self.queue_select = v as u16,
            (0x18 | 0x1a | 0x1c | 0x20..=0x37, _) if sel >= self.queues.len() => {
                tracing::debug!("virtio: write to queue {sel}, which does not exist: ignored");
            }
            (0x1a, 2) => shared.queue_vectors[sel].store(self.vector(v as u16), SeqCst),
            (0x1c, 2) => {
                if v == 1 {
                    return Action::Enable(self.queue_select);
                }
                tracing::debug!("virtio: queue_enable {v} (only 1 may be written): ignored");
            }
            (0x18 | 0x20..=0x37, _) if self.queues[sel].enabled || running => {
                tracing::debug!(
                    "virtio: queue {sel} register {offset:#x} written while enabled: ignored"
                );
            }
            (0x18, 2) => {
                let q = &mut self.queues[sel];
                let size = v as u16;
                if size.is_power_of_two() && size <= q.max {
                    q.size = size;
                } else {
                    tracing::warn!(
                        "virtio: queue {sel} size {size} refused (a power of two ≤ {})",
                        q.max
                    );
                }
            }
            (0x20 | 0x28 | 0x30, 8) => *self.address(sel, offset) = v,
            (0x20 | 0x28 | 0x30, 4) => {
                let a = self.address(sel, offset);
                *a = (*a & !0xffff_ffff) | v;
            }
            (0x24 | 0x2c | 0x34, 4) => {
                let a = self.address(sel, offset - 4);
                *a = (*a & 0xffff_ffff) | (v << 32);
            }
            _ => tracing::debug!(
                "virtio: common cfg write {offset:#x}+{} ignored",
                data.len()
            ),
        }
        Action::None
    }

    fn address(&mut self, sel: usize, offset: u64) -> &mut u64 {
        let q = &mut self.queues[sel];
        match offset {
            0x20 => &mut q.desc,
            0x28 => &mut q.driver,
            _ => &mut q.device,
        }
    }
}
