//! The device's state: resources (host copies, their pinned guest backing), scanouts,
//! the cursor, and the per-instance budget of host memory for resources.
//!
//! A resource's host memory is `width × height × 4` bytes, taken from the budget when it
//! is created (a request beyond it is `ERR_OUT_OF_MEMORY`, and the allocation itself is
//! fallible) and given back at unref or reset. Its backing is the guest's page list from
//! RESOURCE_ATTACH_BACKING, pinned as one page array and held until detach, unref, an
//! unmap of any of its pages, or reset. A backing that came with a migration is not pinned
//! yet: the first transfer pins it from this device's own DMA maps ([`Backing::pins`]).
//!
//! Besides the budget, an instance holds at most [`MAX_RESOURCES`] resources and
//! [`GpuState::max_backing_entries`] backing entries in all (both `ERR_OUT_OF_MEMORY`
//! beyond), so the resource table and a migration state have a size the budget bounds.

use std::collections::HashMap;

use umdev::dma::{DmaError, DmaHandle, PAGE_SIZE};
use umdev::virtio::{PinnedBuffers, Segment};

use super::protocol::Rect;

/// A 2D resource.
#[derive(Debug)]
pub struct Resource {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// virtio-gpu format.
    pub format: u32,
    /// Host copy, `width × height × 4` bytes, rows of `width × 4`.
    pub data: Vec<u8>,
    /// Guest backing.
    pub backing: Option<Backing>,
}

/// Most resources one instance holds.
pub const MAX_RESOURCES: usize = 4096;

/// A resource's guest backing: the entries RESOURCE_ATTACH_BACKING gave, and their pins.
#[derive(Debug)]
pub struct Backing {
    /// The guest's entries (checked: non-empty, not wrapping).
    pub segments: Vec<Segment>,
    /// The entries pinned as one page array; `None` after a migration until first used.
    pub pins: Option<PinnedBuffers>,
}

impl Backing {
    /// The pins, pinning the entries now if they are not (a migrated backing: re-pinned
    /// from this device's DMA maps on first use).
    pub fn pins(&mut self, dma: &DmaHandle) -> Result<&PinnedBuffers, DmaError> {
        if self.pins.is_none() {
            self.pins = Some(PinnedBuffers::pin(dma, &self.segments, false)?);
        }
        Ok(self.pins.as_ref().expect("pinned just above"))
    }

    /// Whether a page of the backing lies in `[iova, iova + size)`.
    pub fn overlaps(&self, iova: u64, size: u64) -> bool {
        if let Some(p) = &self.pins {
            return p.overlaps(iova, size);
        }
        let end = iova.saturating_add(size);
        self.segments.iter().any(|s| {
            // Checked at attach (or load): does not wrap.
            let first = s.addr / PAGE_SIZE * PAGE_SIZE;
            let last = (s.addr + (u64::from(s.len) - 1)) | (PAGE_SIZE - 1);
            first < end && last >= iova
        })
    }
}

impl Resource {
    /// Bytes per row.
    pub fn stride(&self) -> u64 {
        u64::from(self.width) * 4
    }
}

/// A display output.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scanout {
    /// Display mode (what GET_DISPLAY_INFO reports).
    pub width: u32,
    /// Display mode height.
    pub height: u32,
    /// Resource shown (0: none).
    pub resource: u32,
    /// Part of the resource shown.
    pub rect: Rect,
    /// RESOURCE_FLUSHes that touched this scanout.
    pub flushes: u64,
}

/// The cursor (from the cursor queue).
#[derive(Clone, Debug, Default)]
pub struct Cursor {
    /// Scanout it is on.
    pub scanout: u32,
    /// Position of the hot spot.
    pub x: u32,
    /// Position of the hot spot.
    pub y: u32,
    /// Hot spot inside the image.
    pub hot_x: u32,
    /// Hot spot inside the image.
    pub hot_y: u32,
    /// The image (RGBA, `size × size`), copied from its resource at UPDATE_CURSOR; `None`:
    /// hidden.
    pub image: Option<(u32, Vec<u8>)>,
}

/// Everything the guest set up.
#[derive(Debug)]
pub struct GpuState {
    /// Resources by ID (never 0).
    pub resources: HashMap<u32, Resource>,
    /// Scanouts.
    pub scanouts: Vec<Scanout>,
    /// The cursor.
    pub cursor: Cursor,
    /// Host bytes the resources hold.
    pub used: u64,
    /// Most host bytes the resources may hold.
    pub budget: u64,
    /// Whether EDID was offered.
    pub edid: bool,
    /// What each scanout showed when the device was last reset (a guest shutting down
    /// resets it: a screenshot taken after that shows the last frame).
    pub before_reset: Vec<Option<super::screenshot::Image>>,
}

impl GpuState {
    /// Empty state with `modes` scanouts and `budget` bytes for resources.
    pub fn new(modes: &[(u32, u32)], budget: u64, edid: bool) -> GpuState {
        GpuState {
            resources: HashMap::new(),
            scanouts: modes
                .iter()
                .map(|&(width, height)| Scanout {
                    width,
                    height,
                    ..Default::default()
                })
                .collect(),
            cursor: Cursor::default(),
            used: 0,
            budget,
            edid,
            before_reset: vec![None; modes.len()],
        }
    }

    /// Back to power-on: no resources (pins and host memory released), nothing shown.
    pub fn reset(&mut self) {
        for i in 0..self.scanouts.len() {
            if let Some(image) = super::screenshot::capture(self, i) {
                self.before_reset[i] = Some(image);
            }
        }
        self.resources.clear();
        self.used = 0;
        for s in &mut self.scanouts {
            s.resource = 0;
            s.rect = Rect::default();
        }
        self.cursor = Cursor::default();
    }

    /// Most backing entries all resources together may have: one per 2 KiB of the budget
    /// (resources filling the budget, every page of their backing its own entry, twice
    /// over) plus 16384.
    pub fn max_backing_entries(&self) -> u64 {
        self.budget / 2048 + 16384
    }

    /// Backing entries all resources have now.
    pub fn backing_entries(&self) -> u64 {
        self.resources
            .values()
            .filter_map(|r| r.backing.as_ref())
            .map(|b| b.segments.len() as u64)
            .sum()
    }

    /// Drop the backing of every resource with a page in `[iova, iova + size)`.
    pub fn unmap(&mut self, iova: u64, size: u64) {
        for (id, r) in &mut self.resources {
            if r.backing.as_ref().is_some_and(|b| b.overlaps(iova, size)) {
                tracing::info!(
                    "virtio-gpu: unmap of {iova:#x}+{size:#x} takes resource {id}'s backing"
                );
                r.backing = None;
            }
        }
    }

    /// Remove resource `id`, its memory back to the budget; scanouts showing it go blank.
    pub fn unref(&mut self, id: u32) -> bool {
        let Some(r) = self.resources.remove(&id) else {
            return false;
        };
        self.used -= r.data.len() as u64;
        for s in &mut self.scanouts {
            if s.resource == id {
                s.resource = 0;
            }
        }
        true
    }
}
