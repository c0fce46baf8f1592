//! Interrupt delivery: eventfd triggering and masking, shared by the PCI adapter (which
//! configures it from SET_IRQS and the MSI/MSI-X capability state) and device threads (which
//! trigger vectors).
//!
//! A device gets an [`Interrupts`] handle in [`crate::pci::PciDevice::attach`], clones it
//! into its worker threads and calls [`Interrupts::trigger`]. The handle delivers in the
//! mode the guest enabled (MSI-X, else MSI, else INTx), honours every mask (MSI-X function
//! and vector masks, the MSI mask register, the client's SET_IRQS masks, INTx automask and
//! INTX_DISABLE) and remembers triggers on masked vectors as pending. Triggering takes no
//! lock: state is atomics, eventfds are swapped in with `arc-swap`.
//!
//! Files: `eventfds.rs` (per-vector eventfd slots), `eventfd_check.rs` (client fds must be
//! eventfds; made non-blocking), `vector_set.rs` (MSI/MSI-X mask and
//! pending bits), `intx.rs` (the INTx line), `intx_resample.rs` (the INTx unmask eventfd thread), `state.rs` (the whole state and mode
//! selection), `set_irqs.rs` (the SET_IRQS request).

mod eventfd_check;
mod eventfds;
mod intx;
mod intx_resample;
mod set_irqs;
pub(crate) mod state;
mod vector_set;

use std::sync::Arc;

use crate::device::irq_index;

use state::IrqState;

/// The interrupt mode the guest has enabled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqMode {
    /// No interrupt delivery possible: MSI and MSI-X are off and the device offers no INTx
    /// (or the handle is detached).
    None,
    /// Legacy INTx: MSI and MSI-X are off. While the guest sets Interrupt Disable (command
    /// bit 10) a trigger pends (the status register's Interrupt Status reads 1) and fires
    /// when the bit is cleared, unless [`Interrupts::lower_intx`] withdrew it first.
    Intx,
    /// MSI.
    Msi,
    /// MSI-X.
    Msix,
}

/// A device's interrupt handle: cheap to clone, `Send + Sync`.
///
/// The `Default` handle is detached: it triggers nothing and reports [`IrqMode::None`].
#[derive(Clone, Debug, Default)]
pub struct Interrupts {
    state: Option<Arc<IrqState>>,
}

impl Interrupts {
    /// A handle on shared interrupt state.
    pub(crate) fn new(state: Arc<IrqState>) -> Interrupts {
        Interrupts { state: Some(state) }
    }

    /// Raise `vector` in the current mode (INTx ignores the vector number). Honors masking:
    /// a masked MSI-X/MSI vector sets its pending bit and fires on unmask. Returns true if an
    /// eventfd was signalled.
    pub fn trigger(&self, vector: u16) -> bool {
        self.state.as_ref().is_some_and(|s| s.trigger(vector))
    }

    /// Current mode.
    pub fn mode(&self) -> IrqMode {
        self.state.as_ref().map_or(IrqMode::None, |s| s.mode())
    }

    /// Number of vectors usable in the current mode: the MSI-X table size, the number of
    /// MSI vectors the guest enabled, 1 for INTx, 0 when nothing is enabled. A device with
    /// fewer vectors than it would like folds its sources onto `vector % enabled_vectors()`.
    pub fn enabled_vectors(&self) -> u32 {
        match &self.state {
            None => 0,
            Some(s) => match s.mode() {
                IrqMode::Msix => s.msix.enabled(),
                IrqMode::Msi => s.msi.enabled(),
                IrqMode::Intx => 1,
                IrqMode::None => 0,
            },
        }
    }

    /// Lower the INTx line: a trigger that is still pending (masked or INTx disabled) is
    /// forgotten. Does nothing in MSI/MSI-X mode.
    pub fn lower_intx(&self) {
        if let Some(s) = &self.state {
            s.intx.lower();
        }
    }

    /// Signal the error IRQ (index 3, QEMU reports an unrecoverable device error).
    pub fn trigger_error(&self) -> bool {
        self.state
            .as_ref()
            .is_some_and(|s| s.eventfds.fire(irq_index::ERR, 0))
    }

    /// Signal the request IRQ (index 4: ask the client to release the device).
    pub fn trigger_request(&self) -> bool {
        self.state
            .as_ref()
            .is_some_and(|s| s.eventfds.fire(irq_index::REQ, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_interrupts_default_handle_is_inert() {
        let irq = Interrupts::default();
        assert!(!irq.trigger(0));
        assert!(!irq.trigger_error());
        assert_eq!(irq.mode(), IrqMode::None);
        assert_eq!(irq.enabled_vectors(), 0);
    }

    #[test]
    fn test_interrupts_mode_prefers_msix_over_msi_over_intx() {
        let state = Arc::new(IrqState::new(true, 4, 8));
        let irq = Interrupts::new(state.clone());
        assert_eq!(irq.mode(), IrqMode::Intx);
        state.set_msi_enabled(2);
        assert_eq!(irq.mode(), IrqMode::Msi);
        assert_eq!(irq.enabled_vectors(), 2);
        state.set_msix_control(true, false);
        assert_eq!(irq.mode(), IrqMode::Msix);
        assert_eq!(irq.enabled_vectors(), 8);
        state.set_msix_control(false, false);
        state.set_msi_enabled(0);
        state.set_intx_disabled(true);
        assert_eq!(
            irq.mode(),
            IrqMode::Intx,
            "Interrupt Disable holds INTx, it does not switch interrupts off"
        );
        assert_eq!(irq.enabled_vectors(), 1);
        let no_intx = Interrupts::new(Arc::new(IrqState::new(false, 0, 0)));
        assert_eq!(no_intx.mode(), IrqMode::None);
        assert_eq!(no_intx.enabled_vectors(), 0);
    }

    #[test]
    fn test_interrupts_handle_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Interrupts>();
    }
}
