//! Errors of the virtio transport and virtqueues.

use crate::dma::DmaError;

/// What went wrong with a virtqueue or the transport. Every variant but [`VirtioError::Dma`]
/// and [`VirtioError::Device`] is a driver breaking the virtio rules.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// Guest memory could not be reached (not mapped, no permission, Bus Master off, …).
    #[error("queue memory access failed")]
    Dma(#[source] DmaError),
    /// The avail index moved by more than the queue size.
    #[error("avail index {avail} is {ahead} entries ahead of the device (queue size {size})")]
    AvailIndexJump {
        /// The driver's index.
        avail: u16,
        /// How far ahead of what the device consumed.
        ahead: u16,
        /// Queue size.
        size: u16,
    },
    /// A descriptor index at or beyond its table.
    #[error("descriptor index {index} outside a table of {len}")]
    IndexOutOfRange {
        /// The index.
        index: u32,
        /// Entries in the table.
        len: u32,
    },
    /// More descriptors in a chain than the table holds: a loop.
    #[error("descriptor chain longer than its table of {len} (a loop)")]
    ChainLoop {
        /// Entries in the table.
        len: u32,
    },
    /// An indirect descriptor without `VIRTIO_RING_F_INDIRECT_DESC`, with `NEXT`, inside an
    /// indirect table, or with a bad length.
    #[error("bad indirect descriptor: {0}")]
    BadIndirect(&'static str),
    /// A device-readable descriptor after a device-writable one.
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    /// A buffer whose end wraps the 64-bit address space.
    #[error("buffer {addr:#x}+{len:#x} wraps the address space")]
    BufferWraps {
        /// Start.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// The chain's readable or writable bytes exceed the device's limit.
    #[error("chain has more than {max} {what} bytes")]
    ChainTooLarge {
        /// "readable" or "writable".
        what: &'static str,
        /// The limit.
        max: u64,
    },
    /// A used length beyond the chain's writable bytes, or a head not in flight.
    #[error("bad completion: {0}")]
    BadCompletion(&'static str),
    /// The queue was stopped by an earlier error, or belongs to a device generation
    /// before a reset.
    #[error("queue is stopped (an earlier error or a reset)")]
    Stopped,
    /// The device's own failure (for example, while activating).
    #[error("{0}")]
    Device(String),
}

impl From<DmaError> for VirtioError {
    fn from(e: DmaError) -> Self {
        VirtioError::Dma(e)
    }
}
