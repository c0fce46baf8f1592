//! A gvt-style GPU: BAR0 registers, BAR2 framebuffer (shared memory the client can mmap),
//! a GTT of guest pages the device pins, and a command ring in guest memory executed by a
//! worker thread (fill, copy, blit, readback, fence with interrupt).
//!
//! The register layout, GTT format, command encoding and error codes are documented for
//! guest-driver authors in `protocol-docs/devices/gpu.md`. [`driver`] is a small guest-side
//! driver (used by the tests and `umdev demo gpu`) that shares the encoding with the device.
//!
//! Threads: register accesses arrive on the connection thread ([`PciDevice::bar_write`]);
//! a `RING_TAIL` write only stores the tail and rings a crossbeam doorbell; the worker
//! ([`worker`]) fetches the ring with multi-page DMA reads and draws.
//!
//! ```no_run
//! use umdev::pci::PciAdapter;
//! use umdev_devices::gpu::{Gpu, GpuConfig};
//! let gpu = Gpu::new(GpuConfig::default()).unwrap();
//! let adapter = PciAdapter::new(gpu).unwrap();
//! # drop(adapter);
//! ```

pub mod commands;
pub mod demo_scene;
pub mod driver;
pub mod error;
pub mod framebuffer;
pub mod gtt;
pub mod png_dump;
pub mod regs;
pub mod render;
pub mod ring;
mod state;
mod worker;

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use umdev::dma::{DmaHandle, PAGE_SHIFT};
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, MsixSpec, PciConfig, PciDevice, PciIds, SharedMemory};

pub use commands::Command;
pub use error::GpuError;
pub use framebuffer::Framebuffer;
pub use png_dump::PngError;
pub use regs::Mode;

use error::{ERR_BAD_TAIL, ERR_MODE_INVALID, ERR_RING_CONFIG, ERR_RING_FAULT};
use gtt::{lock, GttCell};
use regs::*;
use state::Shared;
use worker::Worker;

/// PCI vendor ID (0x1234: the unassigned ID QEMU's emulated displays use).
pub const VENDOR_ID: u16 = 0x1234;
/// PCI device ID ("UG").
pub const DEVICE_ID: u16 = 0x5547;
/// PCI class: display controller, other (0x0380). Not VGA-compatible, so firmware does not
/// expect legacy VGA resources.
pub const CLASS_CODE: u32 = 0x03_80_00;
/// BAR index of the registers.
pub const BAR_REGS: usize = 0;
/// BAR index of the framebuffer.
pub const BAR_FB: usize = 2;
/// Default framebuffer size: 1024×768×4 rounded up to a power of two.
pub const DEFAULT_FB_SIZE: u64 = 4 << 20;

/// Construction parameters.
#[derive(Clone, Debug)]
pub struct GpuConfig {
    /// BAR2 size in bytes: a power of two ≥ 64 KiB (default 4 MiB).
    pub fb_size: u64,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            fb_size: DEFAULT_FB_SIZE,
        }
    }
}

/// An observer of a [`Gpu`]: cheap to clone, `Send + Sync`; see [`Gpu::handle`].
#[derive(Clone)]
pub struct GpuHandle {
    shared: Arc<Shared>,
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

    /// Wait until every published command has been executed; false on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        self.shared.wait_idle(timeout)
    }

    /// Write the visible part of the framebuffer (current mode) to a PNG file.
    pub fn write_png(&self, path: &Path) -> Result<(), PngError> {
        png_dump::write_png(&self.shared.fb, &self.mode(), path)
    }
}

/// The GPU device. Serve it through [`umdev::pci::PciAdapter`].
pub struct Gpu {
    shared: Arc<Shared>,
    dma: Option<DmaHandle>,
    worker: Option<Worker>,
    fb_size: u64,
}

impl Gpu {
    /// Create the device and its framebuffer memory.
    pub fn new(config: GpuConfig) -> std::io::Result<Gpu> {
        let fb_size = config.fb_size;
        if !fb_size.is_power_of_two() || fb_size < 64 * 1024 || fb_size > u64::from(u32::MAX) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "framebuffer size must be a power of two between 64 KiB and 2 GiB",
            ));
        }
        let mem = Arc::new(SharedMemory::new("umdev-gpu-fb", fb_size)?);
        let shared = Arc::new(Shared {
            regs: Mutex::new(Regs::default()),
            idle: Condvar::new(),
            gtt: GttCell::new(GTT_ENTRIES),
            fb: Framebuffer::new(mem),
            irq: Mutex::new(Interrupts::default()),
        });
        Ok(Gpu {
            shared,
            dma: None,
            worker: None,
            fb_size,
        })
    }

    /// A cloneable observer of the device (framebuffer, mode, pins) that stays usable after
    /// the device itself has been handed to a server.
    pub fn handle(&self) -> GpuHandle {
        GpuHandle {
            shared: self.shared.clone(),
        }
    }

    /// Number of GTT entries currently holding a pin.
    pub fn pins_held(&self) -> usize {
        self.handle().pins_held()
    }

    /// The framebuffer (BAR2).
    pub fn framebuffer(&self) -> &Framebuffer {
        &self.shared.fb
    }

    /// The current mode registers.
    pub fn mode(&self) -> Mode {
        self.handle().mode()
    }

    /// Pixel (`x`, `y`) of the current mode, if inside it.
    pub fn pixel(&self, x: u32, y: u32) -> Option<u32> {
        self.handle().pixel(x, y)
    }

    /// Wait until every published command has been executed; false on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        self.shared.wait_idle(timeout)
    }

    /// Write the visible part of the framebuffer (current mode) to a PNG file.
    pub fn write_png(&self, path: &Path) -> Result<(), PngError> {
        self.handle().write_png(path)
    }

    fn release_all_pins(&self) {
        let pfns = self.shared.gtt.quiesce().take_all_pins();
        gtt::release(self.dma.as_ref(), &pfns);
    }

    fn read_reg(&self, off: u64) -> u32 {
        let r = lock(&self.shared.regs);
        match off {
            REG_ID => ID_MAGIC,
            REG_VERSION => VERSION,
            REG_FB_SIZE => self.fb_size as u32,
            REG_GTT_ENTRIES => GTT_ENTRIES,
            REG_MAX_WIDTH => MAX_WIDTH,
            REG_MAX_HEIGHT => MAX_HEIGHT,
            REG_STATUS => r.status(),
            REG_MODE_WIDTH => r.mode.width,
            REG_MODE_HEIGHT => r.mode.height,
            REG_MODE_STRIDE => r.mode.stride,
            REG_MODE_FORMAT => r.mode.format,
            REG_MODE_CTRL => u32::from(r.mode.enabled),
            REG_RING_BASE_LO => r.ring.base as u32,
            REG_RING_BASE_HI => (r.ring.base >> 32) as u32,
            REG_RING_SIZE => r.ring.size,
            REG_RING_CTRL => u32::from(r.ring.enabled),
            REG_RING_HEAD => r.ring.head,
            REG_RING_TAIL => r.ring.tail,
            REG_IRQ_STATUS => r.irq_status,
            REG_IRQ_ENABLE => r.irq_enable,
            REG_ERROR_CODE => r.error_code,
            REG_ERROR_INFO => r.error_info,
            REG_ERROR_COUNT => r.error_count,
            REG_FENCE_VALUE => r.fence,
            REG_GTT_INVAL_START => r.gtt_inval_start,
            REG_GTT_INVAL_COUNT => r.gtt_inval_count,
            _ => 0,
        }
    }

    fn write_reg(&mut self, off: u64, val: u32) {
        let outcome = apply_reg_write(&mut lock(&self.shared.regs), self.fb_size, off, val);
        match outcome {
            Ok(WriteEffect::None) => {}
            Ok(WriteEffect::RingStopped) => self.shared.idle.notify_all(),
            Ok(WriteEffect::Raise) => self.shared.raise(),
            Ok(WriteEffect::Lower) => lock(&self.shared.irq).lower_intx(),
            Ok(WriteEffect::InvalidateGtt { start, count }) => {
                let pfns = self.shared.gtt.lock().invalidate(start, count);
                gtt::release(self.dma.as_ref(), &pfns);
            }
            Ok(WriteEffect::Doorbell) => match &self.worker {
                Some(w) => w.doorbell(),
                None => {
                    let mut r = lock(&self.shared.regs);
                    r.ring.head = r.ring.tail;
                    drop(r);
                    self.shared.register_error(ERR_RING_FAULT, off);
                }
            },
            Err(code) => self.shared.register_error(code, off),
        }
    }

    fn write_gtt(&mut self, index: u32, value: u64) {
        let dropped = self.shared.gtt.lock().set_entry(index, value);
        if let Some(pfn) = dropped {
            gtt::release(self.dma.as_ref(), &[pfn]);
        }
    }

    /// Split a BAR0 access into the 4-byte registers / 8-byte GTT entries it touches:
    /// `f(unit_offset, unit_len, byte_in_unit, data_offset, n)`.
    fn for_each_unit(off: u64, len: usize, mut f: impl FnMut(u64, u64, usize, usize, usize)) {
        let gtt_end = GTT_BASE + u64::from(GTT_ENTRIES) * 8;
        let mut done = 0usize;
        while done < len {
            let Some(pos) = off.checked_add(done as u64) else {
                return;
            };
            let unit_len: u64 = if (GTT_BASE..gtt_end).contains(&pos) {
                8
            } else {
                4
            };
            let unit = pos & !(unit_len - 1);
            let in_unit = (pos - unit) as usize;
            let n = (unit_len as usize - in_unit).min(len - done);
            f(unit, unit_len, in_unit, done, n);
            done += n;
        }
    }

    fn read_unit(&self, unit: u64, unit_len: u64) -> u64 {
        if unit_len == 8 {
            let index = ((unit - GTT_BASE) / 8) as u32;
            self.shared.gtt.lock().entry(index)
        } else {
            u64::from(self.read_reg(unit))
        }
    }
}

impl PciDevice for Gpu {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: VENDOR_ID,
                device: DEVICE_ID,
                subsystem_vendor: VENDOR_ID,
                subsystem: DEVICE_ID,
                class_code: CLASS_CODE,
                revision: 1,
            },
            bars: vec![
                BarSpec {
                    index: BAR_REGS,
                    size: BAR0_SIZE,
                    kind: BarKind::Mmio32,
                    prefetchable: false,
                    shared: None,
                },
                BarSpec {
                    index: BAR_FB,
                    size: self.fb_size,
                    kind: BarKind::Mmio64,
                    prefetchable: true,
                    shared: Some(self.shared.fb.memory().clone()),
                },
            ],
            intx: true,
            msi_vectors: 1,
            msix: Some(MsixSpec {
                vectors: 1,
                table_bar: BAR_REGS,
                table_offset: MSIX_TABLE_OFFSET,
                pba_bar: BAR_REGS,
                pba_offset: MSIX_PBA_OFFSET,
            }),
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != BAR_REGS {
            return;
        }
        Self::for_each_unit(offset, data.len(), |unit, unit_len, in_unit, at, n| {
            let bytes = self.read_unit(unit, unit_len).to_le_bytes();
            data[at..at + n].copy_from_slice(&bytes[in_unit..in_unit + n]);
        });
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != BAR_REGS {
            return;
        }
        let mut units = Vec::with_capacity(2);
        Self::for_each_unit(offset, data.len(), |unit, unit_len, in_unit, at, n| {
            units.push((unit, unit_len, in_unit, at, n));
        });
        for (unit, unit_len, in_unit, at, n) in units {
            // Partial writes merge with the current value (registers read as documented).
            let mut bytes = self.read_unit(unit, unit_len).to_le_bytes();
            bytes[in_unit..in_unit + n].copy_from_slice(&data[at..at + n]);
            let value = u64::from_le_bytes(bytes);
            if unit_len == 8 {
                self.write_gtt(((unit - GTT_BASE) / 8) as u32, value);
            } else {
                self.write_reg(unit, value as u32);
            }
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        *lock(&self.shared.irq) = irq;
        // A second attach: stop the old worker, release its pins with the old handle.
        self.worker = None;
        self.release_all_pins();
        match Worker::spawn(self.shared.clone(), dma.clone()) {
            Ok(w) => self.worker = Some(w),
            Err(e) => tracing::warn!(error = %e, "gpu: cannot start the worker thread"),
        }
        self.dma = Some(dma);
    }

    fn reset(&mut self) {
        lock(&self.shared.regs).reset();
        self.shared.idle.notify_all();
        lock(&self.shared.irq).lower_intx();
        let pfns = {
            let mut g = self.shared.gtt.quiesce();
            let pfns = g.take_all_pins();
            g.clear_entries();
            pfns
        };
        gtt::release(self.dma.as_ref(), &pfns);
        tracing::debug!(released = pfns.len(), "gpu: reset");
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        if size == 0 {
            return;
        }
        let first = iova >> PAGE_SHIFT;
        let last = iova.saturating_add(size - 1) >> PAGE_SHIFT;
        let pfns = self.shared.gtt.quiesce().take_pins_in(first, last);
        tracing::debug!(iova, size, released = pfns.len(), "gpu: dma unmap");
        gtt::release(self.dma.as_ref(), &pfns);
    }

    fn disconnected(&mut self) {
        self.release_all_pins();
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.worker = None;
        self.release_all_pins();
    }
}

/// What a register write asks the caller to do once the register lock is released.
enum WriteEffect {
    None,
    Doorbell,
    Raise,
    /// No enabled cause is pending any more: lower the INTx line.
    Lower,
    /// Invalidate GTT entries and release their pins in one call.
    InvalidateGtt {
        start: u32,
        count: u32,
    },
    RingStopped,
}

/// Apply a 32-bit register write to the register file; `Err(code)` for a rejected write.
fn apply_reg_write(r: &mut Regs, fb_size: u64, off: u64, val: u32) -> Result<WriteEffect, u32> {
    match off {
        REG_MODE_WIDTH | REG_MODE_HEIGHT | REG_MODE_STRIDE | REG_MODE_FORMAT => {
            if r.mode.enabled {
                return Err(ERR_MODE_INVALID);
            }
            match off {
                REG_MODE_WIDTH => r.mode.width = val,
                REG_MODE_HEIGHT => r.mode.height = val,
                REG_MODE_STRIDE => r.mode.stride = val,
                _ => r.mode.format = val,
            }
        }
        REG_MODE_CTRL => {
            if val & 1 == 0 {
                r.mode.enabled = false;
            } else if !r.mode.enabled {
                if !r.mode.validate(fb_size) {
                    return Err(ERR_MODE_INVALID);
                }
                r.mode.enabled = true;
            }
        }
        REG_RING_BASE_LO | REG_RING_BASE_HI | REG_RING_SIZE => {
            if r.ring.enabled {
                return Err(ERR_RING_CONFIG);
            }
            match off {
                REG_RING_BASE_LO => r.ring.base = (r.ring.base & !0xffff_ffff) | u64::from(val),
                REG_RING_BASE_HI => {
                    r.ring.base = (r.ring.base & 0xffff_ffff) | (u64::from(val) << 32)
                }
                _ => r.ring.size = val,
            }
        }
        REG_RING_CTRL => {
            let enable = val & 1 != 0;
            if enable == r.ring.enabled {
                return Ok(WriteEffect::None);
            }
            if enable && !r.ring.validate() {
                return Err(ERR_RING_CONFIG);
            }
            r.ring.enabled = enable;
            r.ring.head = 0;
            r.ring.tail = 0;
            r.ring_gen = r.ring_gen.wrapping_add(1);
            return Ok(WriteEffect::RingStopped);
        }
        REG_RING_TAIL => {
            if !r.ring.enabled || !val.is_multiple_of(4) || val >= r.ring.size {
                return Err(ERR_BAD_TAIL);
            }
            r.ring.tail = val;
            return Ok(WriteEffect::Doorbell);
        }
        REG_IRQ_ENABLE => {
            let old = r.irq_enable;
            r.irq_enable = val & IRQ_ALL;
            if r.irq_status & r.irq_enable & !old != 0 {
                return Ok(WriteEffect::Raise);
            }
            if r.irq_status & r.irq_enable == 0 {
                return Ok(WriteEffect::Lower);
            }
        }
        REG_GTT_INVAL_START => r.gtt_inval_start = val,
        REG_GTT_INVAL_COUNT => {
            r.gtt_inval_count = val;
            return Ok(WriteEffect::InvalidateGtt {
                start: r.gtt_inval_start,
                count: val,
            });
        }
        REG_IRQ_ACK => {
            r.ack(val & IRQ_ALL);
            if r.irq_status & r.irq_enable == 0 {
                return Ok(WriteEffect::Lower);
            }
        }
        _ => tracing::debug!(off, val, "gpu: write to read-only or unknown register"),
    }
    Ok(WriteEffect::None)
}
