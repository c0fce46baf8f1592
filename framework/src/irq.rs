//! Interrupt delivery: eventfd triggering and masking, shared by the PCI adapter (which
//! configures it from SET_IRQS and the MSI/MSI-X capability state) and device threads (which
//! trigger vectors).
//!
//! SKELETON — the public API below is the contract devices code against.

/// The interrupt mode the guest has enabled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqMode {
    /// No interrupt delivery enabled.
    None,
    /// Legacy INTx.
    Intx,
    /// MSI.
    Msi,
    /// MSI-X.
    Msix,
}

/// A device's interrupt handle: cheap to clone, `Send + Sync`.
#[derive(Clone, Debug, Default)]
pub struct Interrupts {
    _private: (),
}

impl Interrupts {
    /// Raise `vector` in the current mode (INTx ignores the vector number). Honors masking:
    /// a masked MSI-X/MSI vector sets its pending bit and fires on unmask. Returns true if an
    /// eventfd was signalled.
    pub fn trigger(&self, _vector: u16) -> bool {
        todo!("irq: trigger")
    }

    /// Current mode.
    pub fn mode(&self) -> IrqMode {
        todo!("irq: mode")
    }
}
