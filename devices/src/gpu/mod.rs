//! A gvt-style GPU: BAR0 registers, BAR2 framebuffer (shared memory the client can mmap),
//! a GTT of guest pages the device pins, and a command ring in guest memory executed by a
//! render engine (fill, copy, blit, readback, fence with interrupt).
//!
//! The register layout, GTT format, command encoding and error codes are documented for
//! guest-driver authors in `protocol-docs/devices/gpu.md`. [`driver`] is a small guest-side
//! driver (used by the tests and `umdev demo gpu`) that shares the encoding with the device.
//!
//! Threads: register accesses arrive on the connection thread ([`PciDevice::bar_write`],
//! decoded in `bar0.rs`); a `RING_TAIL` write only stores the tail and rings a crossbeam
//! doorbell; the GPU's fetcher thread (`worker.rs`) fetches the ring with multi-page DMA
//! reads and hands the commands to a [`RenderEngine`] (`engine.rs`), which decodes
//! ([`commands`]) and draws ([`render`]) one command per unit (`execute.rs`). GTT pages are
//! pinned on first use and cached until the entry changes, reset, disconnect or DMA unmap
//! ([`gtt`]).
//!
//! **One engine, many GPUs.** A standalone GPU ([`Gpu::new`], `umdev run gpu`) has an
//! engine of its own, an engine of one: the same code executes its commands as executes
//! those of a [`GpuParent`]'s instances, which share one engine through a weighted fair
//! scheduler (stride scheduling, `sched.rs`; a heavier type gets a larger share of the
//! engine, an idle instance's FENCE runs after at most one command per other instance).
//! The engine executes; it never waits for a client (only a GPU's own fetcher does), so a
//! client that stops answering stalls its own GPU, not the engine.
//!
//! Entry points that race with the fetcher and the engine, and what each guarantees when
//! it returns (all run on the connection thread, with the device lock held):
//!
//! - **reset** (DEVICE_RESET, FLR): the GPU's work is quiesced first (`Worker::quiesce`,
//!   see `worker.rs`: the fetcher and the engine stop at their next unit boundary of this
//!   GPU and leave it alone; the engine goes on serving other GPUs), the work the engine
//!   holds for it is dropped, then registers, INTx, GTT and pins are reset, then the work
//!   is let go (the fetcher finds the ring off). So after the reset reply nothing queued
//!   before it shows: no register change (`FENCE_VALUE`, `IRQ_STATUS`, errors,
//!   `RING_HEAD`), no interrupt, no framebuffer write, no pin, no DMA access (no DMA_READ
//!   on the wire for fd-less memory). The wait is for at most one unit of work; a fetch
//!   waiting for the client is cancelled by the server for the duration of the reset, so
//!   the wait is short (`worker.rs` says why it cannot deadlock).
//! - **DMA unmap notifier**: drops the pins in the range after waiting for pin calls in
//!   flight ([`gtt::GttCell::quiesce`]); a pixel copy from a pinned page holds the GTT lock,
//!   so it ends before. The fetcher's `dma.read`s of the ring are covered by the DMA layer
//!   (it waits for accesses in flight and refuses new ones in the range), so the work
//!   keeps going: later commands that need the range fail with a `GTT_FAULT` or
//!   `RING_FAULT`. No full quiesce, no wait for the client.
//! - **disconnect**: as the unmap notifier, for everything (the server has unmapped every
//!   region and closed the socket first, so a fetch of fd-less memory fails at once and new
//!   pins fail). Device state is kept, so the work is not stopped.
//! - **live migration STOP .. RUNNING** (`migration/`): the quiescing a reset does, kept
//!   until RUNNING; nothing is dropped, the commands not executed stay published in the
//!   ring and run after RUNNING (on the destination, after the state was loaded). PRE_COPY
//!   reads the framebuffer while the work goes on.
//! - **a second attach and `Drop`**: the fetcher is stopped and joined, the GPU's lane is
//!   taken off the engine once its unit in progress (if any) has ended, then its pins are
//!   released with the handle it used.
//!
//! ```
//! use umdev::pci::PciAdapter;
//! use umdev_devices::gpu::{Gpu, GpuConfig};
//! let gpu = Gpu::new(GpuConfig::default()).unwrap();
//! let adapter = PciAdapter::new(gpu).unwrap();
//! # drop(adapter);
//! ```

mod bar0;
pub mod commands;
pub mod demo_scene;
pub mod driver;
pub mod engine;
pub mod error;
mod execute;
pub mod framebuffer;
pub mod gtt;
mod handle;
pub mod migration;
pub mod parent;
pub mod png_dump;
pub mod regs;
pub mod render;
pub mod ring;
mod sched;
mod state;
mod worker;

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use umdev::dma::{DmaHandle, PAGE_SHIFT};
use umdev::irq::Interrupts;
use umdev::pci::{
    BarKind, BarSpec, MsixSpec, PciConfig, PciDevice, PciIds, RegisterRange, SharedMemory,
};

pub use commands::Command;
pub use engine::{EngineStats, RenderEngine};
pub use error::GpuError;
pub use framebuffer::Framebuffer;
pub use handle::GpuHandle;
pub use parent::{EngineNice, GpuParent, GpuParentConfig, GpuType, LOW_PRIORITY_ENGINE_NICE};
pub use png_dump::PngError;
pub use regs::Mode;

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

/// The GPU device. Serve it through [`umdev::pci::PciAdapter`].
pub struct Gpu {
    shared: Arc<Shared>,
    dma: Option<DmaHandle>,
    worker: Option<Worker>,
    fb_size: u64,
    engine: Arc<RenderEngine>,
    weight: u32,
    /// Live migration: stopped or not, what PRE_COPY sent or loaded (`migration/`).
    mig: migration::Migration,
    /// What the GPU borrowed from its parent (returned when the device is dropped, after
    /// its work has stopped).
    _lease: Option<parent::Lease>,
}

impl Gpu {
    /// Create the device and its framebuffer memory, with a render engine of its own.
    pub fn new(config: GpuConfig) -> std::io::Result<Gpu> {
        Gpu::on_engine(config, RenderEngine::new("gpu"), 1)
    }

    /// Create the device with its commands executed by `engine`, shared with other GPUs,
    /// with scheduling `weight` (clamped to `1..=65536`; see [`engine`]).
    pub fn on_engine(
        config: GpuConfig,
        engine: Arc<RenderEngine>,
        weight: u32,
    ) -> std::io::Result<Gpu> {
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
            engine: Default::default(),
        });
        Ok(Gpu {
            shared,
            dma: None,
            worker: None,
            fb_size,
            engine,
            weight,
            mig: Default::default(),
            _lease: None,
        })
    }

    /// Attach what the GPU borrowed from its parent; given back when the GPU is dropped.
    pub(crate) fn with_lease(mut self, lease: parent::Lease) -> Gpu {
        self._lease = Some(lease);
        self
    }

    /// What the render engine has executed for this GPU.
    pub fn engine_stats(&self) -> EngineStats {
        self.shared.engine.snapshot()
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
            // The register page and the GTT: the MSI-X table and PBA must stay clear of them.
            registers: vec![
                RegisterRange {
                    bar: BAR_REGS,
                    offset: 0,
                    size: 0x1000,
                },
                RegisterRange {
                    bar: BAR_REGS,
                    offset: GTT_BASE,
                    size: u64::from(GTT_ENTRIES) * 8,
                },
            ],
            vendor_capabilities: Vec::new(),
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        self.bar_read_impl(bar, offset, data);
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        self.bar_write_impl(bar, offset, data);
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        *lock(&self.shared.irq) = irq;
        // A second attach: stop the old work, release its pins with the old handle.
        self.worker = None;
        self.release_all_pins();
        match Worker::spawn(self.shared.clone(), dma.clone(), &self.engine, self.weight) {
            Ok(w) => self.worker = Some(w),
            Err(e) => tracing::warn!(error = %e, "gpu: cannot start the fetcher or engine"),
        }
        // A GPU stopped for migration stays stopped on its new worker.
        self.mig.reattached(self.worker.as_ref());
        self.dma = Some(dma);
    }

    fn reset(&mut self) {
        // First the work: the fetcher and the engine stop at their next unit boundary of
        // this GPU and leave it alone while the registers, the interrupt line and the GTT
        // go back to their reset values, and the fetched work not yet executed is dropped,
        // so no completion of work queued before the reset shows after it (module doc).
        let parked = self.worker.as_ref().map(Worker::quiesce);
        if let Some(p) = &parked {
            p.discard_work();
        }
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

    fn migration(&mut self) -> Option<&mut dyn umdev::migration::Migrate> {
        Some(self)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.worker = None;
        self.release_all_pins();
    }
}
