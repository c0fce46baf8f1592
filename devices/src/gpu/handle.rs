//! [`GpuHandle`]: an observer of a running GPU (framebuffer, mode, pins), for tests, the
//! demo and anything that needs to look at the device after it was handed to a server.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::engine::EngineStats;
use super::framebuffer::Framebuffer;
use super::gtt::lock;
use super::png_dump::{self, PngError};
use super::regs::Mode;
use super::state::Shared;

/// An observer of a [`super::Gpu`]: cheap to clone, `Send + Sync`; see [`super::Gpu::handle`].
#[derive(Clone)]
pub struct GpuHandle {
    pub(super) shared: Arc<Shared>,
}

impl GpuHandle {
    /// Number of GTT entries currently holding a pin.
    pub fn pins_held(&self) -> usize {
        self.shared.gtt.lock().pins_held()
    }

    /// The framebuffer (BAR2).
    pub fn framebuffer(&self) -> &Framebuffer {
        &self.shared.fb
    }

    /// The current mode registers.
    pub fn mode(&self) -> Mode {
        lock(&self.shared.regs).mode
    }

    /// Pixel (`x`, `y`) of the current mode, if inside it.
    pub fn pixel(&self, x: u32, y: u32) -> Option<u32> {
        let mode = self.mode();
        if x >= mode.width || y >= mode.height {
            return None;
        }
        let off = u64::from(y) * u64::from(mode.stride) + u64::from(x) * 4;
        let mut px = [0u8; 4];
        self.shared
            .fb
            .read(off as usize, &mut px)
            .then(|| u32::from_le_bytes(px))
    }

    /// What the render engine has executed for this GPU (commands, work, wake-up delay).
    pub fn engine_stats(&self) -> EngineStats {
        self.shared.engine.snapshot()
    }

    /// Wait until every published command has been executed; false on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        self.shared.wait_idle(timeout)
    }

    /// Write the visible part of the framebuffer (current mode) to a PNG file.
    pub fn write_png(&self, path: &Path) -> Result<(), PngError> {
        png_dump::write_png(&self.shared.fb, &self.mode(), path)
    }
}
