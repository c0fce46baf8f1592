//! The eventfds attached by SET_IRQS, one slot per (IRQ index, vector).
//!
//! Slots are read lock-free by device threads ([`EventfdTable::fire`]) and replaced by the
//! connection thread; a replaced eventfd is closed when the last in-flight `fire` drops it.

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use vmm_sys_util::eventfd::EventFd;

use crate::device::irq_index;

/// Eventfd slots for every IRQ index.
pub(crate) struct EventfdTable {
    slots: [Box<[ArcSwapOption<EventFd>]>; irq_index::COUNT as usize],
}

impl EventfdTable {
    /// Slots for `counts[i]` vectors of IRQ index `i`.
    pub(crate) fn new(counts: [u32; irq_index::COUNT as usize]) -> EventfdTable {
        EventfdTable {
            slots: counts.map(|n| (0..n).map(|_| ArcSwapOption::empty()).collect()),
        }
    }

    /// Attach (`Some`) or detach (`None`) the eventfd of one vector. Out-of-range is ignored
    /// (callers validate first).
    pub(crate) fn set(&self, index: u32, vector: u32, fd: Option<EventFd>) {
        if let Some(slot) = self.slot(index, vector) {
            slot.store(fd.map(Arc::new));
        }
    }

    /// Detach every eventfd of one index.
    pub(crate) fn clear_index(&self, index: u32) {
        if let Some(slots) = self.slots.get(index as usize) {
            for slot in slots.iter() {
                slot.store(None);
            }
        }
    }

    /// Detach every eventfd.
    pub(crate) fn clear_all(&self) {
        for index in 0..irq_index::COUNT {
            self.clear_index(index);
        }
    }

    #[cfg(test)]
    /// True if an eventfd is attached to the vector.
    pub(crate) fn is_attached(&self, index: u32, vector: u32) -> bool {
        self.slot(index, vector).is_some_and(|s| s.load().is_some())
    }

    /// Signal the vector's eventfd. Returns true if one was attached and the write worked.
    pub(crate) fn fire(&self, index: u32, vector: u32) -> bool {
        let Some(slot) = self.slot(index, vector) else {
            return false;
        };
        match slot.load().as_ref() {
            Some(fd) => match fd.write(1) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(index, vector, error = %e, "eventfd write failed");
                    false
                }
            },
            None => {
                tracing::trace!(index, vector, "interrupt with no eventfd attached");
                false
            }
        }
    }

    fn slot(&self, index: u32, vector: u32) -> Option<&ArcSwapOption<EventFd>> {
        self.slots
            .get(index as usize)
            .and_then(|s| s.get(vector as usize))
    }
}

impl fmt::Debug for EventfdTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let attached: Vec<usize> = self
            .slots
            .iter()
            .map(|s| s.iter().filter(|e| e.load().is_some()).count())
            .collect();
        f.debug_struct("EventfdTable")
            .field("attached_per_index", &attached)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_eventfd_table_fire_attached_vector_signals() {
        let table = EventfdTable::new([1, 2, 4, 1, 1]);
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        table.set(irq_index::MSIX, 3, Some(fd.try_clone().unwrap()));
        assert!(table.fire(irq_index::MSIX, 3));
        assert_eq!(fd.read().unwrap(), 1);
        assert!(!table.fire(irq_index::MSIX, 2));
    }

    #[test]
    fn test_eventfd_table_out_of_range_is_ignored() {
        let table = EventfdTable::new([1, 0, 0, 1, 1]);
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        table.set(irq_index::MSI, 0, Some(fd));
        assert!(!table.is_attached(irq_index::MSI, 0));
        assert!(!table.fire(9, 0));
    }

    #[test]
    fn test_eventfd_table_clear_all_detaches() {
        let table = EventfdTable::new([1, 1, 1, 1, 1]);
        for i in 0..irq_index::COUNT {
            table.set(i, 0, Some(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        }
        table.clear_all();
        assert!((0..irq_index::COUNT).all(|i| !table.is_attached(i, 0)));
    }
}
