//! Live migration of a virtio device on [`VirtioPci`]: the transport's own state, saved for
//! every device that opts in, around the device's section ([`VirtioMigrate`]).
//!
//! **What the transport saves** (format `umdev-virtio-pci`, version 1, [`TransportStateV1`]):
//! the features offered (compared, not copied: a destination offering other bits refuses
//! the stream) and negotiated, the feature select registers, the device status, the config
//! generation, the ISR bits, the config MSI-X vector, whether the device was active, and per
//! queue: size, enable, MSI-X vector, descriptor/driver/device area addresses, and the ring
//! positions (next avail index, next used index, the used index last considered for an
//! interrupt, which `VIRTIO_RING_F_EVENT_IDX` needs). Everything else of a split queue
//! (`avail_event`, `used.flags`, the rings themselves) is guest RAM and moves with it. The
//! PCI side (config space, the MSI-X table, pending bits) is [`crate::pci::PciAdapter`]'s.
//! The device's section follows the transport's in the same frame, unframed: it is the
//! rest of the bytes, whatever [`VirtioMigrate::save`] appended.
//!
//! **STOP** ([`crate::migration::Migrate::stop`]): if the device is active, the device's
//! [`VirtioMigrate::stop`] quiesces it: when it returns every chain it took from a queue is
//! completed (on the used ring) and nothing of it touches guest memory or raises an
//! interrupt any more. Then the transport bumps its reset epoch, so every [`Virtqueue`]
//! from before refuses to touch memory, and reads the ring positions the queues mirrored.
//! While stopped, a notify is dropped (a VMM does not run the guest then). A save refuses a
//! queue with chains still in flight (a device that keeps buffers across a stop, such as a
//! network receive queue, is not covered by version 1), unless the device already needs a
//! reset.
//!
//! **Load** decodes the transport's fields within this device's sizes (its queue count,
//! its MSI-X vector count) and checks them all — features offered equal, negotiated ones a
//! subset with `VERSION_1`, known status bits, queue sizes powers of two within the
//! maximum, enabled rings aligned and not wrapping, no chain in flight — before the
//! transport and the device are reset and the device loads its section. Only if that
//! succeeds is the transport state applied; a refused stream leaves transport and device
//! reset.
//!
//! **RUNNING** ([`crate::migration::Migrate::resume`]): a device that was active (at STOP on
//! the source, in the stream on the destination) is activated again
//! ([`super::VirtioDevice::activate`]) with queues that continue from the saved positions,
//! then notified once per enabled queue, so chains the driver published without a notify
//! (or whose notify came while stopped) are taken. A device not attached yet (a daemon loads
//! an instance before its server runs) is activated at attach. A device that needs a reset
//! is not activated again: its driver resets it.

use std::sync::atomic::Ordering::SeqCst;

use serde::{Deserialize, Serialize};

use super::signal::Position;
use super::transport::check_queue;
use super::{status, VirtioDevice, VirtioPci, VIRTIO_F_VERSION_1, VIRTIO_MSI_NO_VECTOR};
use crate::migration::{encode_state, Decoder, Migrate, MigrationCaps, MigrationError};

#[cfg(doc)]
use super::Virtqueue;

/// Format of the transport's section.
pub const TRANSPORT_FORMAT: &str = "umdev-virtio-pci";
/// Its version.
pub const TRANSPORT_VERSION: u32 = 1;

/// A virtio device's own migration (see the module doc of [`crate::virtio`], "Migration"):
/// returned by [`super::VirtioDevice::migration`]. Its methods run on the connection
/// thread, the device locked.
pub trait VirtioMigrate: Send {
    /// The largest section [`VirtioMigrate::save`] appends, in bytes, from the device's
    /// real sizes (the transport adds its own part).
    fn max_state_size(&self) -> u64;

    /// Stop using the queues (called only while the device is active): finish or complete
    /// every chain taken, stop workers, drop the [`super::Virtqueue`]s. When it returns,
    /// nothing of the device touches guest memory or raises an interrupt. The device keeps
    /// its state; the transport activates it again at RUNNING.
    fn stop(&mut self) -> Result<(), MigrationError>;

    /// Append the device's section (usually [`encode_state`] of its state) to `out`. The
    /// device is stopped. Pins are not state: the destination pins again.
    fn save(&mut self, out: &mut Vec<u8>) -> Result<(), MigrationError>;

    /// Replace the device's state with `state` (a section from [`VirtioMigrate::save`],
    /// client data of at most [`VirtioMigrate::max_state_size`] bytes: decode it with a
    /// [`Decoder`], check it whole before changing anything). The device was just reset
    /// and is not active; on error it must be as after a reset.
    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError>;
}

/// The transport's migration flags.
#[derive(Debug, Default)]
pub(crate) struct TransportMig {
    /// Between STOP and RUNNING.
    pub(crate) stopped: bool,
    /// The device was active at STOP (or in the loaded state): activate it at RUNNING.
    pub(crate) reactivate: bool,
    /// RUNNING came before attach: activate at attach.
    pub(crate) resume_at_attach: bool,
}

/// One queue's transport state.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueStateV1 {
    /// Queue size.
    pub size: u16,
    /// `queue_enable`.
    pub enabled: bool,
    /// MSI-X vector.
    pub vector: u16,
    /// Descriptor area.
    pub desc: u64,
    /// Driver (avail) area.
    pub driver: u64,
    /// Device (used) area.
    pub device: u64,
    /// The next avail index the device takes.
    pub next_avail: u16,
    /// The next used index the device writes.
    pub next_used: u16,
    /// The used index when the driver was last considered for an interrupt.
    pub signalled_used: Option<u16>,
}

/// The transport's state (format [`TRANSPORT_FORMAT`], version 1).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct TransportStateV1 {
    /// Features offered (must equal the destination's).
    pub offered: u64,
    /// Features the driver acknowledged.
    pub driver_features: u64,
    /// `device_status`.
    pub status: u8,
    /// `device_feature_select`.
    pub device_select: u32,
    /// `driver_feature_select`.
    pub driver_select: u32,
    /// `queue_select`.
    pub queue_select: u16,
    /// `config_generation`.
    pub generation: u8,
    /// ISR bits not read yet.
    pub isr: u8,
    /// `config_msix_vector`.
    pub config_vector: u16,
    /// The device was active (DRIVER_OK taken): it is activated at RUNNING.
    pub active: bool,
    /// Every queue of the device.
    pub queues: Vec<QueueStateV1>,
}

/// Bytes of the transport's section without its queues (header and fields, varints at
/// their longest), and per queue.
const TRANSPORT_FIXED: u64 = 128;
const TRANSPORT_PER_QUEUE: u64 = 64;
/// Smallest encoding of one queue (nine one-byte fields).
const QUEUE_MIN_WIRE: usize = 9;

const KNOWN_STATUS: u8 = status::ACKNOWLEDGE
    | status::DRIVER
    | status::DRIVER_OK
    | status::FEATURES_OK
    | status::DEVICE_NEEDS_RESET
    | status::FAILED;

fn malformed(why: String) -> MigrationError {
    MigrationError::Malformed {
        format: TRANSPORT_FORMAT.to_owned(),
        why,
    }
}

fn decode_queue(d: &mut Decoder<'_>) -> Result<QueueStateV1, MigrationError> {
    Ok(QueueStateV1 {
        size: d.value()?,
        enabled: d.value()?,
        vector: d.value()?,
        desc: d.value()?,
        driver: d.value()?,
        device: d.value()?,
        next_avail: d.value()?,
        next_used: d.value()?,
        signalled_used: d.value()?,
    })
}

impl<D: VirtioDevice> VirtioPci<D> {
    fn device_migration(&mut self) -> Result<&mut dyn VirtioMigrate, MigrationError> {
        self.device_mut()
            .migration()
            .ok_or_else(|| MigrationError::Device("the device no longer offers migration".into()))
    }

    fn transport_state(&self) -> TransportStateV1 {
        let sh = &self.shared;
        TransportStateV1 {
            offered: self.cfg.offered,
            driver_features: self.cfg.driver_features,
            status: sh.status.load(SeqCst),
            device_select: self.cfg.device_select,
            driver_select: self.cfg.driver_select,
            queue_select: self.cfg.queue_select,
            generation: sh.generation.load(SeqCst),
            isr: sh.isr.load(SeqCst),
            config_vector: sh.config_vector.load(SeqCst),
            active: self.mig.reactivate,
            queues: self
                .cfg
                .queues
                .iter()
                .enumerate()
                .map(|(i, q)| {
                    let p = sh.positions[i].load();
                    QueueStateV1 {
                        size: q.size,
                        enabled: q.enabled,
                        vector: sh.queue_vectors[i].load(SeqCst),
                        desc: q.desc,
                        driver: q.driver,
                        device: q.device,
                        next_avail: p.next_avail,
                        next_used: p.next_used,
                        signalled_used: p.signalled_used,
                    }
                })
                .collect(),
        }
    }

    /// Decode the transport's section within this device's sizes; returns it and the
    /// device's section (the rest).
    fn decode_transport<'a>(
        &self,
        bytes: &'a [u8],
    ) -> Result<(TransportStateV1, &'a [u8]), MigrationError> {
        let (_, mut d) = Decoder::new(TRANSPORT_FORMAT, 1, TRANSPORT_VERSION, bytes)?;
        let mut st = TransportStateV1 {
            offered: d.value()?,
            driver_features: d.value()?,
            status: d.value()?,
            device_select: d.value()?,
            driver_select: d.value()?,
            queue_select: d.value()?,
            generation: d.value()?,
            isr: d.value()?,
            config_vector: d.value()?,
            active: d.value()?,
            queues: Vec::new(),
        };
        let n = d.seq_len(self.cfg.queues.len(), QUEUE_MIN_WIRE)?;
        for _ in 0..n {
            st.queues.push(decode_queue(&mut d)?);
        }
        Ok((st, d.into_rest()))
    }

    /// Everything that would make `st` wrong for this transport, refused.
    fn check_transport(&self, st: &TransportStateV1) -> Result<(), MigrationError> {
        let cfg = &self.cfg;
        if st.offered != cfg.offered {
            return Err(MigrationError::Incompatible(format!(
                "virtio features offered differ: the stream's device offered {:#x}, this one \
                 offers {:#x}",
                st.offered, cfg.offered
            )));
        }
        if st.queues.len() != cfg.queues.len() {
            return Err(MigrationError::Incompatible(format!(
                "{} virtio queues in the stream, this device has {}",
                st.queues.len(),
                cfg.queues.len()
            )));
        }
        if st.driver_features & !st.offered != 0 {
            return Err(malformed(format!(
                "negotiated features {:#x} were not offered",
                st.driver_features
            )));
        }
        if st.status & !KNOWN_STATUS != 0 {
            return Err(malformed(format!("device status {:#x}", st.status)));
        }
        if st.status & status::FEATURES_OK != 0 && st.driver_features & VIRTIO_F_VERSION_1 == 0 {
            return Err(malformed("FEATURES_OK without VERSION_1".into()));
        }
        let live = status::DRIVER_OK | status::FEATURES_OK;
        if st.active && st.status & live != live {
            return Err(malformed(format!(
                "an active device with status {:#x}",
                st.status
            )));
        }
        if st.isr & !3 != 0 {
            return Err(malformed(format!("ISR {:#x}", st.isr)));
        }
        let vector_ok = |v: u16| v == VIRTIO_MSI_NO_VECTOR || v < cfg.msix_vectors;
        if !vector_ok(st.config_vector) {
            return Err(malformed(format!("config vector {}", st.config_vector)));
        }
        for (i, (q, regs)) in st.queues.iter().zip(&cfg.queues).enumerate() {
            let bad = |why: String| malformed(format!("queue {i}: {why}"));
            if !vector_ok(q.vector) {
                return Err(bad(format!("MSI-X vector {}", q.vector)));
            }
            if !q.size.is_power_of_two() || q.size > regs.max {
                return Err(bad(format!(
                    "size {} (a power of two ≤ {})",
                    q.size, regs.max
                )));
            }
            let probe = super::common_cfg::QueueRegs {
                max: regs.max,
                size: q.size,
                desc: q.desc,
                driver: q.driver,
                device: q.device,
                enabled: q.enabled,
            };
            if q.enabled {
                check_queue(&probe).map_err(|why| bad(why.to_owned()))?;
            }
            let at = Position {
                next_avail: q.next_avail,
                next_used: q.next_used,
                signalled_used: q.signalled_used,
            };
            let broken = st.status & status::DEVICE_NEEDS_RESET != 0;
            if !q.enabled && at != Position::default() {
                return Err(bad("ring positions of a queue that is not enabled".into()));
            }
            if q.next_avail != q.next_used && !broken {
                return Err(bad(format!(
                    "{} chains in flight",
                    q.next_avail.wrapping_sub(q.next_used)
                )));
            }
        }
        Ok(())
    }

    fn apply_transport(&mut self, st: &TransportStateV1) {
        self.cfg.driver_features = st.driver_features;
        self.cfg.device_select = st.device_select;
        self.cfg.driver_select = st.driver_select;
        self.cfg.queue_select = st.queue_select;
        let sh = &self.shared;
        sh.status.store(st.status, SeqCst);
        sh.generation.store(st.generation, SeqCst);
        sh.isr.store(st.isr, SeqCst);
        sh.config_vector.store(st.config_vector, SeqCst);
        for (i, q) in st.queues.iter().enumerate() {
            let regs = &mut self.cfg.queues[i];
            regs.size = q.size;
            regs.enabled = q.enabled;
            regs.desc = q.desc;
            regs.driver = q.driver;
            regs.device = q.device;
            sh.queue_vectors[i].store(q.vector, SeqCst);
            sh.positions[i].store(Position {
                next_avail: q.next_avail,
                next_used: q.next_used,
                signalled_used: q.signalled_used,
            });
        }
        self.mig.reactivate = st.active;
    }

    /// Reset transport and device and stay stopped (a refused load).
    fn reset_stopped(&mut self) {
        self.full_reset();
        self.mig.stopped = true;
    }

    /// Activate the device again from the saved ring positions and look at every queue.
    pub(crate) fn reactivate(&mut self) {
        let st = self.shared.status.load(SeqCst);
        if st & status::DEVICE_NEEDS_RESET != 0 || st & status::DRIVER_OK == 0 {
            tracing::info!("virtio: status {st:#x} after migration: the device stays inactive");
            return;
        }
        self.activate(true);
        if self.is_active() {
            let enabled: Vec<u16> = (0..self.cfg.queues.len() as u16)
                .filter(|&i| self.cfg.queues[usize::from(i)].enabled)
                .collect();
            for i in enabled {
                self.device_mut().queue_notify(i);
            }
        }
    }
}

impl<D: VirtioDevice> Migrate for VirtioPci<D> {
    fn caps(&self) -> MigrationCaps {
        MigrationCaps::default()
    }

    /// The transport's section for this device's queue count plus the device's.
    fn max_state_size(&self) -> u64 {
        (TRANSPORT_FIXED + TRANSPORT_PER_QUEUE * self.cfg.queues.len() as u64)
            .saturating_add(self.device_max_state)
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        if self.mig.stopped {
            return Ok(());
        }
        if self.is_active() {
            self.device_migration()?.stop()?;
            // Every queue from before refuses to touch memory from now on.
            self.shared.epoch.fetch_add(1, SeqCst);
            self.set_inactive();
            self.mig.reactivate = true;
        }
        self.mig.stopped = true;
        tracing::debug!("virtio: stopped for migration");
        Ok(())
    }

    fn resume(&mut self) -> Result<(), MigrationError> {
        if !self.mig.stopped {
            return Ok(());
        }
        self.mig.stopped = false;
        if std::mem::take(&mut self.mig.reactivate) {
            if self.has_dma() {
                self.reactivate();
            } else {
                self.mig.resume_at_attach = true;
            }
        }
        tracing::debug!("virtio: running after migration stop");
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        self.stop()?;
        let st = self.transport_state();
        if st.status & status::DEVICE_NEEDS_RESET == 0 {
            if let Some((i, q)) = st
                .queues
                .iter()
                .enumerate()
                .find(|(_, q)| q.next_avail != q.next_used)
            {
                return Err(MigrationError::Device(format!(
                    "virtio: queue {i} has {} chains in flight after the device stopped",
                    q.next_avail.wrapping_sub(q.next_used)
                )));
            }
        }
        let mut out = encode_state(TRANSPORT_FORMAT, TRANSPORT_VERSION, &st)?;
        self.device_migration()?.save(&mut out)?;
        let max = self.max_state_size();
        if out.len() as u64 > max {
            return Err(MigrationError::Device(format!(
                "virtio: a state of {} bytes, more than the {max} this device declares",
                out.len()
            )));
        }
        Ok(out)
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), MigrationError> {
        self.stop()?;
        let checked = if bytes.len() as u64 > self.max_state_size() {
            Err(malformed(format!(
                "{} bytes, at most {} for this device",
                bytes.len(),
                self.max_state_size()
            )))
        } else {
            self.decode_transport(bytes)
                .and_then(|(st, rest)| self.check_transport(&st).map(|()| (st, rest)))
        };
        let (st, device) = match checked {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "virtio: migration state refused; the device is reset");
                self.reset_stopped();
                return Err(e);
            }
        };
        self.reset_stopped();
        if let Err(e) = self.device_migration()?.load(device) {
            tracing::warn!(error = %e, "virtio: device state refused; the device is reset");
            self.reset_stopped();
            return Err(e);
        }
        self.apply_transport(&st);
        tracing::info!(
            active = st.active,
            features = format_args!("{:#x}", st.driver_features),
            "virtio: state loaded"
        );
        Ok(())
    }
}
