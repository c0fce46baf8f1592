//! Mask and pending state of a set of message-signalled vectors (MSI or MSI-X).
//!
//! A vector is masked if any of three sources masks it: the group (MSI-X function mask), the
//! guest's per-vector mask (MSI mask register or MSI-X vector-control bit) or the client's
//! SET_IRQS MASK. A trigger on a masked vector sets its pending bit; the pending message is
//! sent when the last mask source is cleared.
//!
//! **Bus Master Enable** gates the sending, not the masking (an MSI is a memory write, and
//! a PCI function may not write memory while the guest has BME clear; QEMU's own devices
//! behave the same, their MSI writes go through the bus-master address space): a trigger on
//! an unmasked vector while BME is clear is dropped (no pending bit: the spec defines
//! pending for masked vectors only); a masked vector still records its pending bit, and
//! that bit is cleared only when the message is sent (the MSI-X rule), so a vector
//! unmasked while BME is clear keeps it and the message goes out when BME is set again.
//!
//! Everything is atomic so that device threads trigger without a lock while the connection
//! thread changes masks. The protocol that avoids lost interrupts: a trigger sets the pending
//! bit *then* re-checks the mask; an unmask clears the mask *then* takes the pending bit.
//! Whoever takes the bit (an atomic fetch-and) sends the message, so it is sent exactly once.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};

/// Which of the per-vector mask sources an operation changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MaskSource {
    /// The guest (MSI mask register / MSI-X vector control).
    Guest,
    /// The client (SET_IRQS MASK/UNMASK).
    Client,
}

/// Mask and pending bits of up to 2048 vectors.
#[derive(Debug)]
pub(crate) struct VectorSet {
    count: u32,
    enabled: AtomicU32,
    group_mask: AtomicBool,
    bus_master: AtomicBool,
    guest_mask: Box<[AtomicU64]>,
    client_mask: Box<[AtomicU64]>,
    pending: Box<[AtomicU64]>,
}

fn bitmap(count: u32) -> Box<[AtomicU64]> {
    (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
}

fn locate(vector: u32) -> (usize, u64) {
    ((vector / 64) as usize, 1u64 << (vector % 64))
}

impl VectorSet {
    /// `count` vectors, all unmasked, none pending, none enabled, Bus Master set (the PCI
    /// adapter pushes the command register's bit in before anything triggers).
    pub(crate) fn new(count: u32) -> VectorSet {
        VectorSet {
            count,
            enabled: AtomicU32::new(0),
            group_mask: AtomicBool::new(false),
            bus_master: AtomicBool::new(true),
            guest_mask: bitmap(count),
            client_mask: bitmap(count),
            pending: bitmap(count),
        }
    }

    /// Number of vectors.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Number of vectors the guest enabled (0 = disabled).
    pub(crate) fn enabled(&self) -> u32 {
        self.enabled.load(SeqCst)
    }

    /// Set the number of enabled vectors (clamped to the count). Vectors that become disabled
    /// lose their pending bits (a disabled function sends nothing).
    pub(crate) fn set_enabled(&self, n: u32) {
        let n = n.min(self.count);
        self.enabled.store(n, SeqCst);
        for v in n..self.count {
            let (w, b) = locate(v);
            self.pending[w].fetch_and(!b, SeqCst);
        }
    }

    /// True if the group mask or a per-vector mask masks `vector`.
    pub(crate) fn is_masked(&self, vector: u32) -> bool {
        let (w, b) = locate(vector);
        self.group_mask.load(SeqCst)
            || self
                .guest_mask
                .get(w)
                .is_some_and(|m| m.load(SeqCst) & b != 0)
            || self
                .client_mask
                .get(w)
                .is_some_and(|m| m.load(SeqCst) & b != 0)
    }

    /// The guest's per-vector mask bit.
    pub(crate) fn guest_masked(&self, vector: u32) -> bool {
        let (w, b) = locate(vector);
        self.guest_mask
            .get(w)
            .is_some_and(|m| m.load(SeqCst) & b != 0)
    }

    #[cfg(test)]
    /// True if `vector` has a pending message.
    pub(crate) fn is_pending(&self, vector: u32) -> bool {
        let (w, b) = locate(vector);
        self.pending.get(w).is_some_and(|p| p.load(SeqCst) & b != 0)
    }

    /// Pending bits `64 * word .. 64 * word + 63` (the PBA layout); 0 past the end.
    pub(crate) fn pending_word(&self, word: usize) -> u64 {
        self.pending.get(word).map_or(0, |p| p.load(SeqCst))
    }

    /// Raise `vector`: send it with `send` if unmasked, else mark it pending; dropped if
    /// unmasked while Bus Master is clear. Returns what `send` returned, or false if the
    /// vector is not enabled, masked, out of range or dropped.
    pub(crate) fn trigger(&self, vector: u32, send: impl Fn(u32) -> bool) -> bool {
        if vector >= self.enabled() {
            return false;
        }
        if !self.is_masked(vector) {
            if !self.bus_master.load(SeqCst) {
                tracing::debug!(vector, "interrupt dropped: Bus Master Enable is clear");
                return false;
            }
            return send(vector);
        }
        let (w, b) = locate(vector);
        self.pending[w].fetch_or(b, SeqCst);
        // An unmask may have raced with us between the check and the store.
        self.flush(vector, send)
    }

    /// Set or clear one mask source of `vector`; an unmask sends a pending message.
    pub(crate) fn set_mask(
        &self,
        source: MaskSource,
        vector: u32,
        masked: bool,
        send: impl Fn(u32) -> bool,
    ) {
        let map = match source {
            MaskSource::Guest => &self.guest_mask,
            MaskSource::Client => &self.client_mask,
        };
        let (w, b) = locate(vector);
        let Some(word) = map.get(w) else {
            return;
        };
        if masked {
            word.fetch_or(b, SeqCst);
        } else {
            word.fetch_and(!b, SeqCst);
            self.flush(vector, send);
        }
    }

    /// Set the group (function) mask; clearing it sends every pending unmasked vector.
    pub(crate) fn set_group_mask(&self, masked: bool, send: impl Fn(u32) -> bool) {
        let was = self.group_mask.swap(masked, SeqCst);
        if was && !masked {
            self.flush_all(send);
        }
    }

    /// The command register's Bus Master Enable. Returns true if it went from clear to set:
    /// the caller then sends what is pending and unmasked ([`VectorSet::flush_all`]), unless
    /// the device is stopped (a migration restore).
    pub(crate) fn set_bus_master(&self, enabled: bool) -> bool {
        let was = self.bus_master.swap(enabled, SeqCst);
        enabled && !was
    }

    /// Send every pending vector that is no longer masked.
    pub(crate) fn flush_all(&self, send: impl Fn(u32) -> bool) {
        for (w, word) in self.pending.iter().enumerate() {
            let mut bits = word.load(SeqCst);
            while bits != 0 {
                let bit = bits.trailing_zeros();
                bits &= bits - 1;
                self.flush(w as u32 * 64 + bit, &send);
            }
        }
    }

    /// Back to the power-on state: disabled, nothing masked or pending.
    pub(crate) fn reset(&self) {
        self.enabled.store(0, SeqCst);
        self.group_mask.store(false, SeqCst);
        for map in [&self.guest_mask, &self.client_mask, &self.pending] {
            for word in map.iter() {
                word.store(0, SeqCst);
            }
        }
    }

    /// The guest mask and pending bitmaps, one u64 per 64 vectors (for migration).
    pub(crate) fn snapshot(&self) -> (Vec<u64>, Vec<u64>) {
        let words = |m: &[AtomicU64]| m.iter().map(|w| w.load(SeqCst)).collect();
        (words(&self.guest_mask), words(&self.pending))
    }

    /// Replace the whole state with a migrated one, sending nothing (the device is stopped):
    /// a pending vector is delivered by the next unmask or trigger. Bits past the count are
    /// dropped; `guest` and `pending` hold at most one word per 64 vectors (missing words
    /// read as 0). Client masks are the destination client's own and stay.
    pub(crate) fn restore(&self, enabled: u32, group_mask: bool, guest: &[u64], pending: &[u64]) {
        self.enabled.store(enabled.min(self.count), SeqCst);
        self.group_mask.store(group_mask, SeqCst);
        for (w, (g, p)) in self.guest_mask.iter().zip(self.pending.iter()).enumerate() {
            let first = w as u32 * 64;
            let valid = match self.count - first {
                n if n >= 64 => u64::MAX,
                n => (1u64 << n) - 1,
            };
            g.store(guest.get(w).copied().unwrap_or(0) & valid, SeqCst);
            p.store(pending.get(w).copied().unwrap_or(0) & valid, SeqCst);
        }
    }

    /// If `vector` is unmasked, enabled and pending and Bus Master is set, take the pending
    /// bit and send it.
    fn flush(&self, vector: u32, send: impl Fn(u32) -> bool) -> bool {
        if vector >= self.enabled() || self.is_masked(vector) || !self.bus_master.load(SeqCst) {
            return false;
        }
        let (w, b) = locate(vector);
        let Some(word) = self.pending.get(w) else {
            return false;
        };
        if word.fetch_and(!b, SeqCst) & b != 0 {
            send(vector)
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records the vectors sent.
    type Log = Mutex<Vec<u32>>;

    fn record(log: &Log, v: u32) -> bool {
        log.lock().unwrap().push(v);
        true
    }

    fn recorder() -> (Log, fn(&Log, u32) -> bool) {
        (Mutex::new(Vec::new()), record)
    }

    #[test]
    fn test_vector_set_unmasked_trigger_sends_immediately() {
        let set = VectorSet::new(8);
        set.set_enabled(8);
        let (log, rec) = recorder();
        assert!(set.trigger(5, |v| rec(&log, v)));
        assert_eq!(*log.lock().unwrap(), vec![5]);
        assert!(!set.is_pending(5));
    }

    #[test]
    fn test_vector_set_masked_trigger_pends_and_unmask_sends_once() {
        let set = VectorSet::new(100);
        set.set_enabled(100);
        let (log, rec) = recorder();
        set.set_mask(MaskSource::Guest, 70, true, |v| rec(&log, v));
        assert!(!set.trigger(70, |v| rec(&log, v)));
        assert!(!set.trigger(70, |v| rec(&log, v)));
        assert!(set.is_pending(70));
        assert_eq!(set.pending_word(1), 1 << 6);
        set.set_mask(MaskSource::Guest, 70, false, |v| rec(&log, v));
        assert_eq!(*log.lock().unwrap(), vec![70]);
        assert!(!set.is_pending(70));
    }

    #[test]
    fn test_vector_set_two_mask_sources_both_must_clear() {
        let set = VectorSet::new(4);
        set.set_enabled(4);
        let (log, rec) = recorder();
        set.set_mask(MaskSource::Guest, 1, true, |v| rec(&log, v));
        set.set_mask(MaskSource::Client, 1, true, |v| rec(&log, v));
        set.trigger(1, |v| rec(&log, v));
        set.set_mask(MaskSource::Guest, 1, false, |v| rec(&log, v));
        assert!(log.lock().unwrap().is_empty());
        set.set_mask(MaskSource::Client, 1, false, |v| rec(&log, v));
        assert_eq!(*log.lock().unwrap(), vec![1]);
    }

    #[test]
    fn test_vector_set_group_unmask_flushes_all_pending() {
        let set = VectorSet::new(130);
        set.set_enabled(130);
        let (log, rec) = recorder();
        set.set_group_mask(true, |v| rec(&log, v));
        for v in [0, 64, 129] {
            set.trigger(v, |v| rec(&log, v));
        }
        set.set_group_mask(false, |v| rec(&log, v));
        assert_eq!(*log.lock().unwrap(), vec![0, 64, 129]);
    }

    #[test]
    fn test_vector_set_disabled_or_out_of_range_vector_is_dropped() {
        let set = VectorSet::new(4);
        let (log, rec) = recorder();
        assert!(!set.trigger(0, |v| rec(&log, v)));
        set.set_enabled(2);
        assert!(!set.trigger(2, |v| rec(&log, v)));
        assert!(!set.trigger(u32::MAX, |v| rec(&log, v)));
        assert!(log.lock().unwrap().is_empty());
    }

    #[test]
    fn test_vector_set_bus_master_clear_drops_unmasked_keeps_masked_pending() {
        let set = VectorSet::new(4);
        set.set_enabled(4);
        let (log, rec) = recorder();
        assert!(!set.set_bus_master(false), "set → clear asks for no flush");
        assert!(!set.trigger(0, |v| rec(&log, v)), "unmasked: dropped");
        assert!(!set.is_pending(0), "and not pending");
        set.set_mask(MaskSource::Guest, 1, true, |v| rec(&log, v));
        set.trigger(1, |v| rec(&log, v));
        set.set_mask(MaskSource::Guest, 1, false, |v| rec(&log, v));
        assert!(
            log.lock().unwrap().is_empty(),
            "nothing sent while BME is clear"
        );
        assert!(
            set.is_pending(1),
            "the pending bit waits for the message to go out"
        );
        assert!(set.set_bus_master(true), "clear → set: the caller flushes");
        assert!(!set.set_bus_master(true), "set → set: nothing to flush");
        set.flush_all(|v| rec(&log, v));
        assert_eq!(*log.lock().unwrap(), vec![1]);
        assert!(!set.is_pending(1));
    }

    #[test]
    fn test_vector_set_concurrent_trigger_and_unmask_loses_nothing() {
        use std::sync::atomic::AtomicU64;
        use std::sync::Arc;
        for _ in 0..200 {
            let set = Arc::new(VectorSet::new(1));
            set.set_enabled(1);
            set.set_mask(MaskSource::Guest, 0, true, |_| true);
            let sent = Arc::new(AtomicU64::new(0));
            let (s2, sent2) = (set.clone(), sent.clone());
            let t = std::thread::spawn(move || {
                s2.trigger(0, |_| {
                    sent2.fetch_add(1, SeqCst);
                    true
                })
            });
            set.set_mask(MaskSource::Guest, 0, false, |_| {
                sent.fetch_add(1, SeqCst);
                true
            });
            t.join().unwrap();
            assert_eq!(sent.load(SeqCst), 1);
        }
    }
}
