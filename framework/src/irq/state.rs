//! The interrupt state shared by the PCI adapter (connection thread) and the device's
//! [`Interrupts`](super::Interrupts) handles (any thread).

use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use crate::device::{irq_index, DeviceError};

use super::eventfds::EventfdTable;
use super::intx::IntxState;
use super::intx_resample::ResampleWatcher;
use super::vector_set::{MaskSource, VectorSet};
use super::IrqMode;

/// Eventfds, INTx line, MSI and MSI-X vector state of one device.
#[derive(Debug)]
pub(crate) struct IrqState {
    pub(crate) eventfds: EventfdTable,
    pub(crate) intx: IntxState,
    pub(crate) msi: VectorSet,
    pub(crate) msix: VectorSet,
    resample: Mutex<Option<ResampleWatcher>>,
}

impl IrqState {
    /// State for a device with the given interrupt capabilities.
    pub(crate) fn new(intx: bool, msi_vectors: u32, msix_vectors: u32) -> IrqState {
        let counts = [u32::from(intx), msi_vectors, msix_vectors, 1, 1];
        IrqState {
            eventfds: EventfdTable::new(counts),
            intx: IntxState::new(intx),
            msi: VectorSet::new(msi_vectors),
            msix: VectorSet::new(msix_vectors),
            resample: Mutex::new(None),
        }
    }

    /// Vector count of each IRQ index (INTx, MSI, MSI-X, ERR, REQ).
    pub(crate) fn counts(&self) -> [u32; irq_index::COUNT as usize] {
        [
            u32::from(self.intx.offered()),
            self.msi.count(),
            self.msix.count(),
            1,
            1,
        ]
    }

    /// What the guest enabled: MSI-X over MSI over INTx. With MSI and MSI-X off the mode is
    /// INTx whether or not the guest has set Interrupt Disable (command bit 10): as on PCI,
    /// the device still asserts its line; INTX_DISABLE only keeps it from being signalled,
    /// so a trigger then pends in [`IntxState`] (Interrupt Status reads 1) and is delivered
    /// when the guest clears the bit, unless the device lowered the line meanwhile.
    pub(crate) fn mode(&self) -> IrqMode {
        if self.msix.enabled() > 0 {
            IrqMode::Msix
        } else if self.msi.enabled() > 0 {
            IrqMode::Msi
        } else if self.intx.offered() {
            IrqMode::Intx
        } else {
            IrqMode::None
        }
    }

    /// Raise `vector` in the current mode.
    pub(crate) fn trigger(&self, vector: u16) -> bool {
        let vector = u32::from(vector);
        match self.mode() {
            IrqMode::Msix => self.msix.trigger(vector, |v| self.send_msix(v)),
            IrqMode::Msi => self.msi.trigger(vector, |v| self.send_msi(v)),
            IrqMode::Intx => self.intx.trigger(|| self.send_intx()),
            IrqMode::None => false,
        }
    }

    /// Fire the INTx eventfd.
    pub(crate) fn send_intx(&self) -> bool {
        self.eventfds.fire(irq_index::INTX, 0)
    }

    /// Fire an MSI vector's eventfd.
    pub(crate) fn send_msi(&self, vector: u32) -> bool {
        self.eventfds.fire(irq_index::MSI, vector)
    }

    /// Fire an MSI-X vector's eventfd.
    pub(crate) fn send_msix(&self, vector: u32) -> bool {
        self.eventfds.fire(irq_index::MSIX, vector)
    }

    /// Command register BUS_MASTER: while it is clear no MSI/MSI-X message is sent (a
    /// trigger on an unmasked vector is dropped, a masked one still pends; see
    /// `vector_set.rs`); setting it sends what pended meanwhile and is now unmasked. INTx is
    /// not bus mastering and is unaffected; the SET_IRQS TRIGGER loopback (the client
    /// firing its own eventfds) is not either.
    pub(crate) fn set_bus_master(&self, enabled: bool) {
        if self.msi.set_bus_master(enabled) {
            self.msi.flush_all(|v| self.send_msi(v));
        }
        if self.msix.set_bus_master(enabled) {
            self.msix.flush_all(|v| self.send_msix(v));
        }
    }

    /// Bus Master from a migrated config space: set, sending nothing (the device is
    /// stopped; resuming sends what is deliverable).
    pub(crate) fn restore_bus_master(&self, enabled: bool) {
        self.msi.set_bus_master(enabled);
        self.msix.set_bus_master(enabled);
    }

    /// Command register INTX_DISABLE.
    pub(crate) fn set_intx_disabled(&self, disabled: bool) {
        if self.intx.disabled() != disabled {
            self.intx.set_disabled(disabled, || self.send_intx());
        }
    }

    /// MSI capability: number of enabled vectors (0 = disabled).
    pub(crate) fn set_msi_enabled(&self, vectors: u32) {
        if self.msi.enabled() != vectors {
            self.msi.set_enabled(vectors);
            self.msi.flush_all(|v| self.send_msi(v));
        }
    }

    /// MSI capability mask register (bit n masks vector n).
    pub(crate) fn set_msi_mask_bits(&self, bits: u32) {
        for v in 0..self.msi.count().min(32) {
            let masked = bits & (1 << v) != 0;
            if self.msi.guest_masked(v) != masked {
                self.msi
                    .set_mask(MaskSource::Guest, v, masked, |v| self.send_msi(v));
            }
        }
    }

    /// MSI pending bits as the capability's pending register shows them.
    pub(crate) fn msi_pending_bits(&self) -> u32 {
        // Vectors are at most 32, so the first word holds them all.
        self.msi.pending_word(0) as u32
    }

    /// MSI-X capability: enable and function mask.
    pub(crate) fn set_msix_control(&self, enabled: bool, function_mask: bool) {
        let want = if enabled { self.msix.count() } else { 0 };
        if self.msix.enabled() != want {
            self.msix.set_enabled(want);
        }
        self.msix
            .set_group_mask(function_mask, |v| self.send_msix(v));
        self.msix.flush_all(|v| self.send_msix(v));
    }

    /// MSI-X table vector-control mask bit.
    pub(crate) fn set_msix_vector_masked(&self, vector: u32, masked: bool) {
        self.msix
            .set_mask(MaskSource::Guest, vector, masked, |v| self.send_msix(v));
    }

    /// Back to power-on state; attached eventfds are kept (as VFIO keeps trigger fds across
    /// DEVICE_RESET; QEMU disables and re-enables them around it anyway).
    pub(crate) fn reset(&self) {
        self.intx.reset();
        self.msi.reset();
        self.msix.reset();
    }

    /// Attach (`Some`) or detach (`None`) the INTx unmask eventfd.
    pub(crate) fn set_intx_resample(
        self: &Arc<Self>,
        fd: Option<EventFd>,
    ) -> Result<(), DeviceError> {
        let watcher = match fd {
            Some(fd) => {
                Some(ResampleWatcher::start(fd, Arc::downgrade(self)).map_err(DeviceError::Io)?)
            }
            None => None,
        };
        // Replacing drops (stops) the old watcher.
        let old = std::mem::replace(&mut *self.lock_resample(), watcher);
        drop(old);
        Ok(())
    }

    /// True if an INTx unmask eventfd is attached.
    #[cfg(test)]
    pub(crate) fn has_intx_resample(&self) -> bool {
        self.lock_resample().is_some()
    }

    fn lock_resample(&self) -> std::sync::MutexGuard<'_, Option<ResampleWatcher>> {
        // The guarded value stays consistent even if a holder panicked.
        self.resample.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Detach the INTx unmask eventfd (stops its thread).
    pub(crate) fn clear_intx_resample(&self) {
        let old = self.lock_resample().take();
        drop(old);
    }

    /// Client disconnect: detach every eventfd and clear client masks and pending state the
    /// next client knows nothing about; the guest-visible enables stay.
    pub(crate) fn disconnect(&self) {
        self.eventfds.clear_all();
        self.clear_intx_resample();
        for v in 0..self.msi.count() {
            self.msi.set_mask(MaskSource::Client, v, false, |_| false);
        }
        for v in 0..self.msix.count() {
            self.msix.set_mask(MaskSource::Client, v, false, |_| false);
        }
        self.intx.lower();
        self.intx.unmask(|| false);
    }
}
