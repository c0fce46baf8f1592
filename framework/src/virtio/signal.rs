//! What the transport and its queues share: the device status (for `DEVICE_NEEDS_RESET`),
//! the ISR bits, the MSI-X vectors and the interrupt handle, and the reset epoch that makes
//! a queue from before a reset refuse to touch memory, and each queue's ring positions
//! (mirrored by its [`super::Virtqueue`], read by migration while the device is stopped).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8};
use std::sync::OnceLock;

use crate::irq::{Interrupts, IrqMode};

use super::{status, VIRTIO_MSI_NO_VECTOR};

/// ISR bit: a queue has used buffers.
pub(crate) const ISR_QUEUE: u8 = 1;
/// ISR bit: the device configuration changed (or the device needs a reset).
pub(crate) const ISR_CONFIG: u8 = 2;

/// A queue's ring positions as its [`super::Virtqueue`] last left them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Position {
    /// The next avail ring index the device takes.
    pub(crate) next_avail: u16,
    /// The next used ring index the device writes.
    pub(crate) next_used: u16,
    /// The used index when the driver was last considered for an interrupt.
    pub(crate) signalled_used: Option<u16>,
}

/// [`Position`] in atomics: written by the queue's owner, read by the transport.
#[derive(Debug)]
pub(crate) struct PositionCell {
    next_avail: AtomicU16,
    next_used: AtomicU16,
    /// `signalled_used`, or `NONE` for `None`.
    signalled: AtomicU32,
}

const NONE: u32 = 1 << 16;

impl Default for PositionCell {
    /// [`Position::default`].
    fn default() -> Self {
        PositionCell {
            next_avail: AtomicU16::new(0),
            next_used: AtomicU16::new(0),
            signalled: AtomicU32::new(NONE),
        }
    }
}

impl PositionCell {
    pub(crate) fn store(&self, p: Position) {
        self.next_avail.store(p.next_avail, SeqCst);
        self.next_used.store(p.next_used, SeqCst);
        self.signalled
            .store(p.signalled_used.map_or(NONE, u32::from), SeqCst);
    }

    pub(crate) fn load(&self) -> Position {
        let s = self.signalled.load(SeqCst);
        Position {
            next_avail: self.next_avail.load(SeqCst),
            next_used: self.next_used.load(SeqCst),
            // Below NONE: a u16.
            signalled_used: (s != NONE).then_some(s as u16),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) status: AtomicU8,
    pub(crate) isr: AtomicU8,
    pub(crate) generation: AtomicU8,
    pub(crate) epoch: AtomicU64,
    pub(crate) config_vector: AtomicU16,
    pub(crate) queue_vectors: Vec<AtomicU16>,
    pub(crate) positions: Vec<PositionCell>,
    pub(crate) irq: OnceLock<Interrupts>,
}

impl Shared {
    pub(crate) fn new(queues: usize) -> Shared {
        Shared {
            status: AtomicU8::new(0),
            isr: AtomicU8::new(0),
            generation: AtomicU8::new(0),
            epoch: AtomicU64::new(0),
            config_vector: AtomicU16::new(VIRTIO_MSI_NO_VECTOR),
            queue_vectors: (0..queues)
                .map(|_| AtomicU16::new(VIRTIO_MSI_NO_VECTOR))
                .collect(),
            positions: (0..queues).map(|_| PositionCell::default()).collect(),
            irq: OnceLock::new(),
        }
    }

    /// Raise an interrupt: the MSI-X `vector` if MSI-X is on (none for NO_VECTOR), else the
    /// ISR bit and INTx.
    pub(crate) fn raise(&self, isr_bit: u8, vector: u16) {
        let Some(irq) = self.irq.get() else { return };
        match irq.mode() {
            IrqMode::Msix => {
                if vector != VIRTIO_MSI_NO_VECTOR {
                    irq.trigger(vector);
                }
            }
            IrqMode::None => {
                self.isr.fetch_or(isr_bit, SeqCst);
            }
            IrqMode::Intx | IrqMode::Msi => {
                self.isr.fetch_or(isr_bit, SeqCst);
                irq.trigger(0);
            }
        }
    }

    /// Raise queue `index`'s interrupt.
    pub(crate) fn raise_queue(&self, index: u16) {
        let vector = self
            .queue_vectors
            .get(usize::from(index))
            .map_or(VIRTIO_MSI_NO_VECTOR, |v| v.load(SeqCst));
        self.raise(ISR_QUEUE, vector);
    }

    /// The device configuration changed: bump the generation, raise the config interrupt.
    pub(crate) fn config_changed(&self) {
        self.generation.fetch_add(1, SeqCst);
        self.raise(ISR_CONFIG, self.config_vector.load(SeqCst));
    }

    /// Set `DEVICE_NEEDS_RESET` (once the driver is running) and tell the driver.
    pub(crate) fn needs_reset(&self, why: &dyn std::fmt::Display) {
        tracing::warn!("virtio: device needs reset: {why}");
        let before = self.status.fetch_or(status::DEVICE_NEEDS_RESET, SeqCst);
        if before & status::DEVICE_NEEDS_RESET == 0 {
            self.raise(ISR_CONFIG, self.config_vector.load(SeqCst));
        }
    }
}
