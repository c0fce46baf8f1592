//! A virtio-gpu (2D) device that Linux's stock `virtio_gpu` driver binds, on umdev's
//! virtio transport ([`umdev::virtio`]).
//!
//! - Commands: GET_DISPLAY_INFO, GET_EDID (with `VIRTIO_GPU_F_EDID`), RESOURCE_CREATE_2D,
//!   RESOURCE_UNREF, RESOURCE_ATTACH_BACKING, RESOURCE_DETACH_BACKING, SET_SCANOUT,
//!   TRANSFER_TO_HOST_2D, RESOURCE_FLUSH on the control queue; UPDATE_CURSOR and
//!   MOVE_CURSOR on the cursor queue. Fenced commands complete in order with the fence
//!   echoed (every command is complete when its response is written). No 3D (virgl), no
//!   blob resources.
//! - A resource's backing (the guest's page list) is pinned as one page array at
//!   ATTACH_BACKING and held until DETACH_BACKING, UNREF, an unmap of one of its pages
//!   (the unmap notifier drops it: a later transfer is an error) or a reset; transfers copy
//!   from those pins into the resource's host memory (`commands.rs` checks every
//!   rectangle, offset and stride first).
//! - Host memory for resources is budgeted per instance ([`VirtioGpuConfig::memory_budget`]):
//!   a RESOURCE_CREATE_2D beyond it is answered `ERR_OUT_OF_MEMORY`.
//! - Scanouts and their resolutions are configurable; [`VirtioGpuHandle::resize`] changes a
//!   mode from the host and raises the display config event.
//! - [`VirtioGpuHandle::screenshot`]: a scanout with the cursor, as an RGB image (PNG).
//! - Live migration ([`migration`]): resources with their pixels, backing re-pinned on the
//!   destination, scanouts, cursor.
//!
//! Wire format and behaviour: `protocol-docs/devices/virtio-gpu.md`. Files: `protocol.rs`
//! (wire types), `commands.rs` (execution), `state.rs` (resources, scanouts, budget),
//! `worker.rs` (the queue thread), `migration.rs`, `edid.rs`, `screenshot.rs`.

mod commands;
#[cfg(test)]
mod commands_proptest;
mod edid;
pub mod migration;
pub mod parent;
pub mod protocol;
mod screenshot;
mod state;
mod worker;

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use umdev::instance::Screenshot;
use umdev::virtio::{Activation, ConfigNotifier, VirtioDevice, VirtioError, VirtioMigrate};

pub use commands::{CURSOR_SIZE, MAX_BACKING_ENTRIES};
pub use edid::{edid, EDID_MAX_DIM};
pub use parent::{VirtioGpuParent, VirtioGpuParentConfig, VirtioGpuType};
pub use screenshot::{Image, ShotError};

use protocol::{MAX_SCANOUTS, VIRTIO_GPU_EVENT_DISPLAY, VIRTIO_GPU_F_EDID};
use state::GpuState;
use worker::{lock, Worker};

/// virtio device ID of a GPU.
pub const VIRTIO_ID_GPU: u16 = 16;
/// PCI class: display controller, other.
pub const CLASS_DISPLAY_OTHER: u32 = 0x03_80_00;

/// The XRGB8888 pattern the real-VMM suite's guest writes to `/dev/fb0` and the host finds
/// pixel for pixel in the screenshot: the colour of pixel (`x`, `y`) as `0x00RRGGBB`.
pub fn test_pattern(x: u32, y: u32) -> u32 {
    ((x.wrapping_mul(3) & 0xff) << 16) | ((y.wrapping_mul(5) & 0xff) << 8) | ((x ^ y) & 0xff)
}

/// The second test pattern (the real-VMM suite's KMS page flip shows it): `test_pattern`
/// with red and blue inverted.
pub fn test_pattern_flipped(x: u32, y: u32) -> u32 {
    test_pattern(x, y) ^ 0x00ff_00ff
}

/// How a virtio-gpu instance is set up.
#[derive(Clone, Debug)]
pub struct VirtioGpuConfig {
    /// One (width, height) per scanout: 1..=16 scanouts, each side 1..=[`EDID_MAX_DIM`].
    pub scanouts: Vec<(u32, u32)>,
    /// Host bytes all resources together may hold.
    pub memory_budget: u64,
    /// Offer `VIRTIO_GPU_F_EDID`.
    pub edid: bool,
}

impl Default for VirtioGpuConfig {
    /// One 1280×800 scanout, 256 MiB of resources, EDID.
    fn default() -> Self {
        VirtioGpuConfig {
            scanouts: vec![(1280, 800)],
            memory_budget: 256 << 20,
            edid: true,
        }
    }
}

/// Errors building the device.
#[derive(Debug, thiserror::Error)]
pub enum VirtioGpuError {
    /// A configuration value is out of range.
    #[error("invalid virtio-gpu configuration: {0}")]
    Config(String),
}

/// Looks at (and resizes) the display while the server owns the device; cheap to clone.
#[derive(Clone)]
pub struct VirtioGpuHandle {
    state: Arc<Mutex<GpuState>>,
    events: Arc<AtomicU32>,
    notifier: Arc<Mutex<Option<ConfigNotifier>>>,
}

impl VirtioGpuHandle {
    /// What scanout `index` shows now (with the cursor), or `None` if nothing.
    pub fn screenshot(&self, index: usize) -> Option<Image> {
        screenshot::capture(&lock(&self.state), index)
    }

    /// What scanout `index` shows now (with the cursor), as a PNG file: the picture is
    /// copied under the state lock (the queue threads wait only for that copy), encoded
    /// after it.
    pub fn screenshot_png(&self, index: u32) -> Result<Screenshot, ShotError> {
        let image = {
            let state = lock(&self.state);
            let n = state.scanouts.len();
            if index as usize >= n {
                return Err(ShotError::NoSuchScanout(n));
            }
            screenshot::capture(&state, index as usize).ok_or(ShotError::Blank)?
        };
        Ok(Screenshot {
            width: image.width,
            height: image.height,
            png: screenshot::png_of(&image)?,
        })
    }

    /// What scanout `index` shows now or, if it shows nothing, what it showed before the
    /// last reset (a guest that powers off resets the device first).
    pub fn last_frame(&self, index: usize) -> Option<Image> {
        let s = lock(&self.state);
        screenshot::capture(&s, index).or_else(|| s.before_reset.get(index).cloned().flatten())
    }

    /// The display mode of scanout `index`.
    pub fn mode(&self, index: usize) -> Option<(u32, u32)> {
        lock(&self.state)
            .scanouts
            .get(index)
            .map(|s| (s.width, s.height))
    }

    /// RESOURCE_FLUSHes that touched scanout `index`.
    pub fn flushes(&self, index: usize) -> u64 {
        lock(&self.state)
            .scanouts
            .get(index)
            .map_or(0, |s| s.flushes)
    }

    /// Host bytes held by resources, and the budget.
    pub fn memory(&self) -> (u64, u64) {
        let s = lock(&self.state);
        (s.used, s.budget)
    }

    /// Number of resources, and how many have backing attached.
    pub fn resources(&self) -> (usize, usize) {
        let s = lock(&self.state);
        let backed = s.resources.values().filter(|r| r.backing.is_some()).count();
        (s.resources.len(), backed)
    }

    /// How many resources have their backing pinned now (a migrated backing is pinned at
    /// its first transfer on the destination).
    pub fn pinned_backings(&self) -> usize {
        lock(&self.state)
            .resources
            .values()
            .filter(|r| r.backing.as_ref().is_some_and(|b| b.pins.is_some()))
            .count()
    }

    /// Change scanout `index`'s mode from the host: the driver sees the display event and
    /// reads the new mode with GET_DISPLAY_INFO (and the EDID, which describes it). The
    /// guest then allocates a resource of the new size within the instance's budget.
    pub fn resize(&self, index: usize, width: u32, height: u32) -> Result<(), ResizeError> {
        for side in [width, height] {
            if !(1..=EDID_MAX_DIM).contains(&side) {
                return Err(ResizeError::OutOfRange(width, height));
            }
        }
        {
            let mut s = lock(&self.state);
            let n = s.scanouts.len();
            let scanout = s
                .scanouts
                .get_mut(index)
                .ok_or(ResizeError::NoSuchScanout(n))?;
            scanout.width = width;
            scanout.height = height;
        }
        self.events.fetch_or(VIRTIO_GPU_EVENT_DISPLAY, SeqCst);
        if let Some(n) = &*self.notifier.lock().unwrap_or_else(|e| e.into_inner()) {
            n.notify();
        }
        Ok(())
    }
}

/// Why a host resize was refused ([`VirtioGpuHandle::resize`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResizeError {
    /// The device has fewer scanouts.
    #[error("no such scanout (the device has {0})")]
    NoSuchScanout(usize),
    /// A side is 0 or larger than an EDID describes.
    #[error("{0}x{1} is not a mode it can show (each side 1 to 4095 pixels)")]
    OutOfRange(u32, u32),
}

/// The virtio-gpu device; serve it as `PciAdapter::new(VirtioPci::new(gpu)?)`.
pub struct VirtioGpu {
    config: VirtioGpuConfig,
    handle: VirtioGpuHandle,
    worker: Option<Worker>,
    /// Its share of a [`VirtioGpuParent`]'s pool, given back when the device is dropped
    /// (after the worker stopped: see `Drop`).
    lease: Option<parent::Lease>,
}

impl VirtioGpu {
    /// A device with `config` (checked).
    pub fn new(config: VirtioGpuConfig) -> Result<VirtioGpu, VirtioGpuError> {
        let n = config.scanouts.len();
        if !(1..=MAX_SCANOUTS).contains(&n) {
            return Err(VirtioGpuError::Config(format!(
                "{n} scanouts (1..={MAX_SCANOUTS})"
            )));
        }
        if let Some((w, h)) = config
            .scanouts
            .iter()
            .find(|(w, h)| !(1..=EDID_MAX_DIM).contains(w) || !(1..=EDID_MAX_DIM).contains(h))
        {
            return Err(VirtioGpuError::Config(format!(
                "scanout {w}x{h} (each side 1..={EDID_MAX_DIM})"
            )));
        }
        let state = GpuState::new(&config.scanouts, config.memory_budget, config.edid);
        Ok(VirtioGpu {
            handle: VirtioGpuHandle {
                state: Arc::new(Mutex::new(state)),
                events: Arc::new(AtomicU32::new(0)),
                notifier: Arc::new(Mutex::new(None)),
            },
            config,
            worker: None,
            lease: None,
        })
    }

    /// The device holding `lease` until it is dropped.
    pub(crate) fn with_lease(mut self, lease: parent::Lease) -> VirtioGpu {
        self.lease = Some(lease);
        self
    }

    /// A handle on the display.
    pub fn handle(&self) -> VirtioGpuHandle {
        self.handle.clone()
    }

    fn stop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop();
        }
    }
}

impl Drop for VirtioGpu {
    fn drop(&mut self) {
        self.stop();
        drop(self.lease.take()); // only once nothing uses the resources any more
    }
}

/// Config space: events_read, events_clear, num_scanouts, num_capsets (le32 each).
const CONFIG_SIZE: u64 = 16;

impl VirtioDevice for VirtioGpu {
    fn device_id(&self) -> u16 {
        VIRTIO_ID_GPU
    }

    fn class_code(&self) -> u32 {
        CLASS_DISPLAY_OTHER
    }

    fn features(&self) -> u64 {
        if self.config.edid {
            VIRTIO_GPU_F_EDID
        } else {
            0
        }
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![256, 16] // control, cursor
    }

    fn config_size(&self) -> u64 {
        CONFIG_SIZE
    }

    fn config_read(&mut self, offset: u64, data: &mut [u8]) {
        let words = [
            self.handle.events.load(SeqCst),
            0,
            self.config.scanouts.len() as u32,
            0,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let at = offset as usize; // inside CONFIG_SIZE: the transport checked
        data.copy_from_slice(&bytes[at..at + data.len()]);
    }

    fn config_write(&mut self, offset: u64, data: &[u8]) {
        // events_clear (offset 4): clear those bits of events_read.
        if offset == 4 && data.len() == 4 {
            let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            self.handle.events.fetch_and(!v, SeqCst);
        }
    }

    fn activate(&mut self, a: Activation) -> Result<(), VirtioError> {
        if a.queues.first().is_none_or(|q| q.is_none()) {
            return Err(VirtioError::Device(
                "the control queue is not enabled".into(),
            ));
        }
        self.stop();
        // A display event that came while there was no driver to tell (a host resize
        // before DRIVER_OK or while stopped for migration) is told now.
        if self.handle.events.load(SeqCst) != 0 {
            a.config.notify();
        }
        *self
            .handle
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(a.config);
        self.worker = Some(Worker::start(a.queues, a.dma, self.handle.state.clone()));
        Ok(())
    }

    fn queue_notify(&mut self, index: u16) {
        if let Some(w) = &self.worker {
            w.kick(index);
        }
    }

    fn reset(&mut self) {
        self.stop();
        lock(&self.handle.state).reset();
        self.handle.events.store(0, SeqCst);
        *self
            .handle
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        // The worker holds the lock for a whole command, chain pins included.
        lock(&self.handle.state).unmap(iova, size);
    }

    fn migration(&mut self) -> Option<&mut dyn VirtioMigrate> {
        Some(self)
    }
}
