//! Legacy INTx emulation: one level-style line, automasked when it fires (as VFIO does).
//!
//! The line fires its eventfd and masks itself; the client unmasks it (SET_IRQS UNMASK,
//! sent by QEMU at the guest's EOI). A trigger while masked, or while the guest has set
//! INTX_DISABLE in the command register, is remembered as pending and fires on unmask or
//! enable — exactly once, and not at all if the device lowered the line first
//! ([`IntxState::lower`]). The status register's Interrupt Status bit
//! ([`IntxState::status`]) reads 1 while a trigger is pending, or fired and not yet
//! unmasked, so a guest polling with INTX_DISABLE set sees it. INTX_DISABLE never changes
//! the interrupt mode (see [`IrqState::mode`](super::state::IrqState::mode)).
//!
//! Lock-free: the mask flag doubles as the right to fire (taken with a compare-exchange), so
//! concurrent triggers and unmasks fire once per pending edge.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

/// State of the INTx line.
#[derive(Debug)]
pub(crate) struct IntxState {
    offered: bool,
    disabled: AtomicBool,
    masked: AtomicBool,
    pending: AtomicBool,
    asserted: AtomicBool,
}

impl IntxState {
    /// A line that exists if `offered`.
    pub(crate) fn new(offered: bool) -> IntxState {
        IntxState {
            offered,
            disabled: AtomicBool::new(false),
            masked: AtomicBool::new(false),
            pending: AtomicBool::new(false),
            asserted: AtomicBool::new(false),
        }
    }

    /// True if the device offers INTx.
    pub(crate) fn offered(&self) -> bool {
        self.offered
    }

    /// True if the guest set INTX_DISABLE.
    pub(crate) fn disabled(&self) -> bool {
        self.disabled.load(SeqCst)
    }

    #[cfg(test)]
    /// True if masked (automask after firing, or SET_IRQS MASK).
    pub(crate) fn masked(&self) -> bool {
        self.masked.load(SeqCst)
    }

    /// The interrupt-status bit of the status register: fired and not yet unmasked, or
    /// waiting to fire.
    pub(crate) fn status(&self) -> bool {
        self.asserted.load(SeqCst) || self.pending.load(SeqCst)
    }

    /// Raise the line; fires through `send` unless masked or disabled (then pending).
    pub(crate) fn trigger(&self, send: impl Fn() -> bool) -> bool {
        if !self.offered {
            return false;
        }
        self.pending.store(true, SeqCst);
        self.flush(send)
    }

    /// The device lowered the line: forget a trigger that has not been delivered yet.
    pub(crate) fn lower(&self) {
        self.pending.store(false, SeqCst);
    }

    /// Command register INTX_DISABLE changed; enabling delivers a pending trigger.
    pub(crate) fn set_disabled(&self, disabled: bool, send: impl Fn() -> bool) {
        self.disabled.store(disabled, SeqCst);
        if !disabled {
            self.flush(send);
        }
    }

    /// SET_IRQS MASK.
    pub(crate) fn mask(&self) {
        self.masked.store(true, SeqCst);
    }

    /// SET_IRQS UNMASK (the guest's EOI): clears the mask and delivers a pending trigger.
    pub(crate) fn unmask(&self, send: impl Fn() -> bool) {
        self.asserted.store(false, SeqCst);
        self.masked.store(false, SeqCst);
        self.flush(send);
    }

    /// Retry delivering a pending trigger (an eventfd was just attached).
    pub(crate) fn retry(&self, send: impl Fn() -> bool) -> bool {
        self.flush(send)
    }

    /// The client disabled the INTx index: drop the mask state, keep a pending trigger.
    pub(crate) fn clear_mask(&self) {
        self.asserted.store(false, SeqCst);
        self.masked.store(false, SeqCst);
    }

    /// The line level for migration: a trigger pending, or fired and not yet unmasked.
    pub(crate) fn level(&self) -> bool {
        self.status()
    }

    /// Replace the state with a migrated one, firing nothing: an asserted line comes back
    /// pending and unmasked, so the destination delivers it once (on the next unmask,
    /// eventfd attach, enable or [`IntxState::retry`]), as a level line that is still
    /// asserted would be.
    pub(crate) fn restore(&self, disabled: bool, level: bool) {
        self.disabled.store(disabled, SeqCst);
        self.asserted.store(false, SeqCst);
        self.masked.store(false, SeqCst);
        self.pending.store(level, SeqCst);
    }

    /// Back to the power-on state (enabled, unmasked, nothing pending).
    pub(crate) fn reset(&self) {
        self.disabled.store(false, SeqCst);
        self.masked.store(false, SeqCst);
        self.pending.store(false, SeqCst);
        self.asserted.store(false, SeqCst);
    }

    fn flush(&self, send: impl Fn() -> bool) -> bool {
        loop {
            if self.disabled() || !self.pending.load(SeqCst) {
                return false;
            }
            // Taking the mask is the right to fire; whoever holds it re-checks `pending`.
            if self
                .masked
                .compare_exchange(false, true, SeqCst, SeqCst)
                .is_err()
            {
                return false;
            }
            if self.pending.swap(false, SeqCst) {
                self.asserted.store(true, SeqCst);
                if send() {
                    return true;
                }
                // Nobody heard it (no eventfd attached): like a level line that stays
                // asserted, keep it pending and unmasked so that attaching an eventfd or
                // the next trigger delivers it, instead of staying automasked forever.
                self.asserted.store(false, SeqCst);
                self.pending.store(true, SeqCst);
                self.masked.store(false, SeqCst);
                return false;
            }
            self.masked.store(false, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn test_intx_trigger_fires_then_automasks() {
        let intx = IntxState::new(true);
        let fired = AtomicU32::new(0);
        let send = || fired.fetch_add(1, SeqCst) < u32::MAX;
        assert!(intx.trigger(send));
        assert!(intx.masked());
        assert!(!intx.trigger(send));
        assert_eq!(fired.load(SeqCst), 1);
        intx.unmask(send);
        assert_eq!(fired.load(SeqCst), 2, "pending trigger fires on unmask");
        assert!(intx.masked(), "and masks again");
    }

    #[test]
    fn test_intx_disabled_pends_until_enabled() {
        let intx = IntxState::new(true);
        let fired = AtomicU32::new(0);
        let send = || fired.fetch_add(1, SeqCst) < u32::MAX;
        intx.set_disabled(true, send);
        assert!(!intx.trigger(send));
        assert!(intx.status());
        intx.set_disabled(false, send);
        assert_eq!(fired.load(SeqCst), 1);
    }

    #[test]
    fn test_intx_lowered_before_unmask_does_not_fire() {
        let intx = IntxState::new(true);
        let fired = AtomicU32::new(0);
        let send = || fired.fetch_add(1, SeqCst) < u32::MAX;
        intx.trigger(send);
        intx.trigger(send);
        intx.lower();
        intx.unmask(send);
        assert_eq!(fired.load(SeqCst), 1);
        assert!(!intx.masked());
    }

    #[test]
    fn test_intx_undelivered_trigger_stays_pending_not_masked() {
        let intx = IntxState::new(true);
        assert!(!intx.trigger(|| false));
        assert!(!intx.masked());
        assert!(intx.status());
        assert!(intx.retry(|| true));
        assert!(intx.masked());
    }

    #[test]
    fn test_intx_not_offered_never_fires() {
        let intx = IntxState::new(false);
        assert!(!intx.trigger(|| true));
    }
}
