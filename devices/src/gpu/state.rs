//! State shared by the connection thread (register accesses, reset, unmap notifier), the
//! fetcher thread (ring fetches) and the render engine (command execution).

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use umdev::irq::Interrupts;

use super::engine::EngineCounters;
use super::framebuffer::Framebuffer;
use super::gtt::{lock, GttCell};
use super::regs::Regs;

/// Everything the threads touch. No thread holds two of these locks at once, and neither
/// the fetcher nor the engine holds one while it calls into the DMA layer (a DMA access may
/// wait for the client, e.g. a server→client DMA_READ, and the unmap notifier takes `gtt`).
/// The connection thread holds none of them while it waits in `Worker::quiesce`: the
/// fetcher or the engine may need any of them to finish its unit of work.
pub struct Shared {
    /// The register file.
    pub regs: Mutex<Regs>,
    /// Signalled whenever the ring head moves or the ring is reset.
    pub idle: Condvar,
    /// GTT entries and pins.
    pub gtt: GttCell,
    /// BAR2.
    pub fb: Framebuffer,
    /// The interrupt handle (replaced at attach).
    pub irq: Mutex<Interrupts>,
    /// What the render engine executed for this GPU.
    pub engine: EngineCounters,
}

impl Shared {
    /// Raise the device's interrupt (vector 0).
    pub fn raise(&self) {
        let irq = lock(&self.irq).clone();
        let delivered = irq.trigger(0);
        tracing::trace!(delivered, "gpu: interrupt");
    }

    /// Record an error from a register write and raise `IRQ_ERROR` if enabled.
    pub fn register_error(&self, code: u32, reg: u64) {
        tracing::warn!(code, reg = format_args!("{reg:#x}"), "gpu: register error");
        let raise = lock(&self.regs).record_error(code, reg as u32);
        if raise {
            self.raise();
        }
    }

    /// Wait until every published command has executed; false on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut regs = lock(&self.regs);
        while !regs.idle() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            regs = match self.idle.wait_timeout(regs, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        true
    }
}
