//! Live migration of the virtio-gpu ([`umdev::virtio::VirtioMigrate`]; the transport's
//! state around it is [`umdev::virtio::migration`]'s).
//!
//! **What migrates** (format `umdev-virtio-gpu`, version 1, [`StateV1`]): the configured
//! display (scanout modes as built, EDID offered: compared, a destination configured
//! otherwise refuses the stream), each scanout's current mode (a host resize moves with
//! it), the pending config events, each scanout's resource, rectangle and flush count, the
//! cursor (scanout, position, hot spot and its 64×64 image as copied at UPDATE_CURSOR),
//! and every resource: id, format, width, height, its backing entries (guest addresses and
//! lengths) and its host pixels. Not state: pins. The destination pins a backing again
//! from its own DMA maps at the resource's first TRANSFER_TO_HOST_2D after RUNNING, so
//! an unmap there before that simply drops the backing as it would a pinned one.
//!
//! **Resource memory travels in STOP_COPY**, in the one state frame (no PRE_COPY: pixels
//! change at every transfer, and a frame holds the whole of them anyway). Its size is
//! bounded by the budget: [`VirtioMigrate::max_state_size`] is the budget plus the most
//! metadata an instance may hold ([`MAX_RESOURCES`] resources, `max_backing_entries`
//! entries), so a destination refuses a longer frame at its head, and a stream whose
//! resources together need more than the destination's budget is refused before any of
//! their memory is allocated ([`MigrationError::Incompatible`]).
//!
//! **STOP** stops the queue worker: it finishes every command it was notified of (each
//! chain completed on the used ring, fences included, since every command completes when
//! its response is written) and exits; nothing touches guest memory after that, and a host
//! resize raises no interrupt until RUNNING (the activation then tells the driver). The
//! transport activates the device again at RUNNING with queues that continue where they
//! were.
//!
//! **Load** reads the section field by field ([`umdev::migration::Decoder`]: every declared
//! length checked against this instance's limits and the bytes left before anything is
//! allocated), checks it whole — configuration equal, ids non-zero and unique, formats
//! known, pixel data of exactly `width × height × 4` bytes, the budget, backing entries
//! non-empty and not wrapping and within the attach limits, scanouts showing existing
//! resources with rectangles inside them, the cursor on an existing scanout — and only
//! then replaces the device's state. A refused section leaves the device reset.

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;

use serde::{Deserialize, Serialize, Serializer};
use umdev::migration::{encode_state_into, Decoder, MigrationError};
use umdev::virtio::{Segment, VirtioMigrate};

use super::commands::{CURSOR_SIZE, MAX_BACKING_ENTRIES};
use super::edid::EDID_MAX_DIM;
use super::protocol::{format_bpp, Rect, MAX_SCANOUTS, VIRTIO_GPU_EVENT_DISPLAY};
use super::state::{Backing, Cursor, Resource, MAX_RESOURCES};
use super::worker::lock;
use super::VirtioGpu;

/// Format of the device's section.
pub const STATE_FORMAT: &str = "umdev-virtio-gpu";
/// Its version.
pub const STATE_VERSION: u32 = 1;

/// Bytes of a cursor image.
const CURSOR_BYTES: usize = (CURSOR_SIZE * CURSOR_SIZE * 4) as usize;
/// Upper bounds of the encoding: everything but resources (header, modes, scanouts, the
/// cursor image), per resource without its pixels and entries, per backing entry.
const FIXED_BYTES: u64 = 32 << 10;
const PER_RESOURCE: u64 = 64;
const PER_ENTRY: u64 = 16;

/// A byte string borrowed from the device (encoded as postcard bytes: a length, then the
/// bytes, exactly as a `Vec<u8>`).
#[derive(Debug, Clone, Copy)]
pub struct Blob<'a>(pub &'a [u8]);

impl Serialize for Blob<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// A scanout.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanoutV1 {
    /// Its current mode.
    pub mode: (u32, u32),
    /// Resource shown (0: none).
    pub resource: u32,
    /// `(x, y, width, height)` of the resource shown.
    pub rect: (u32, u32, u32, u32),
    /// RESOURCE_FLUSHes that touched it.
    pub flushes: u64,
}

/// The cursor; `B` is the image's bytes ([`Blob`] when saving, `Vec<u8>` to read one).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct CursorV1<B> {
    /// Scanout it is on.
    pub scanout: u32,
    /// Hot spot position.
    pub x: u32,
    /// Hot spot position.
    pub y: u32,
    /// Hot spot in the image.
    pub hot_x: u32,
    /// Hot spot in the image.
    pub hot_y: u32,
    /// RGBA, 64 × 64; `None`: hidden.
    pub image: Option<B>,
}

/// A resource; `B` is its pixels' bytes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ResourceV1<B> {
    /// Resource id (not 0).
    pub id: u32,
    /// virtio-gpu format.
    pub format: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Backing entries (guest address, length), if attached.
    pub backing: Option<Vec<(u64, u32)>>,
    /// Host pixels, `width × height × 4` bytes.
    pub data: B,
}

/// The device's section (format [`STATE_FORMAT`], version 1).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct StateV1<B> {
    /// The scanout modes the device was built with.
    pub configured: Vec<(u32, u32)>,
    /// Whether EDID was offered.
    pub edid: bool,
    /// `events_read`.
    pub events: u32,
    /// Every scanout.
    pub scanouts: Vec<ScanoutV1>,
    /// The cursor.
    pub cursor: CursorV1<B>,
    /// Every resource, by id.
    pub resources: Vec<ResourceV1<B>>,
}

fn rect_of((x, y, width, height): (u32, u32, u32, u32)) -> Rect {
    Rect {
        x,
        y,
        width,
        height,
    }
}

fn incompatible(why: String) -> MigrationError {
    MigrationError::Incompatible(format!("virtio-gpu: {why}"))
}

/// A resource read out of the frame, checked, its pixels still borrowed.
struct Loaded<'a> {
    id: u32,
    format: u32,
    width: u32,
    height: u32,
    backing: Option<Vec<Segment>>,
    data: &'a [u8],
}

/// The section read and checked, nothing allocated for pixels yet.
struct Checked<'a> {
    events: u32,
    scanouts: Vec<ScanoutV1>,
    cursor: CursorV1<&'a [u8]>,
    resources: Vec<Loaded<'a>>,
    used: u64,
}

impl VirtioGpu {
    /// Read and check a section against this device (see the module doc).
    fn check_section<'a>(&self, bytes: &'a [u8]) -> Result<Checked<'a>, MigrationError> {
        let (_, mut d) = Decoder::new(STATE_FORMAT, 1, STATE_VERSION, bytes)?;
        let n = d.seq_len(MAX_SCANOUTS, 2)?;
        let configured = (0..n)
            .map(|_| d.value::<(u32, u32)>())
            .collect::<Result<Vec<_>, _>>()?;
        if configured != self.config.scanouts {
            return Err(incompatible(format!(
                "the stream's display is {configured:?}, this device's {:?}",
                self.config.scanouts
            )));
        }
        let edid: bool = d.value()?;
        if edid != self.config.edid {
            return Err(incompatible(format!(
                "EDID offered {edid} in the stream, {} here",
                self.config.edid
            )));
        }
        let events: u32 = d.value()?;
        if events & !VIRTIO_GPU_EVENT_DISPLAY != 0 {
            return Err(d.malformed(format!("events {events:#x}")));
        }
        let n = d.seq_len(MAX_SCANOUTS, 8)?;
        if n != configured.len() {
            return Err(d.malformed(format!("{n} scanouts, {} configured", configured.len())));
        }
        let scanouts = (0..n)
            .map(|_| d.value::<ScanoutV1>())
            .collect::<Result<Vec<_>, _>>()?;
        let cursor = CursorV1 {
            scanout: d.value()?,
            x: d.value()?,
            y: d.value()?,
            hot_x: d.value()?,
            hot_y: d.value()?,
            image: d.value::<Option<&[u8]>>()?,
        };
        let n = d.seq_len(MAX_RESOURCES, 7)?;
        let budget = self.config.memory_budget;
        let max_entries = lock(&self.handle.state).max_backing_entries();
        let (mut used, mut entries) = (0u64, 0u64);
        let mut resources: Vec<Loaded<'a>> = Vec::with_capacity(n);
        let mut ids: HashMap<u32, usize> = HashMap::with_capacity(n);
        for _ in 0..n {
            let (id, format, width, height): (u32, u32, u32, u32) =
                (d.value()?, d.value()?, d.value()?, d.value()?);
            let backing = match d.value::<u8>()? {
                0 => None,
                1 => {
                    let k = d.seq_len(MAX_BACKING_ENTRIES as usize, 2)?;
                    entries += k as u64;
                    if k == 0 || entries > max_entries {
                        return Err(d.malformed(format!(
                            "resource {id}: {k} backing entries ({entries} in all, at most \
                             {max_entries})"
                        )));
                    }
                    let mut segs = Vec::with_capacity(k);
                    for _ in 0..k {
                        let (addr, len): (u64, u32) = d.value()?;
                        if len == 0 || addr.checked_add(u64::from(len) - 1).is_none() {
                            return Err(d.malformed(format!(
                                "resource {id}: backing entry {addr:#x}+{len:#x}"
                            )));
                        }
                        segs.push(Segment { addr, len });
                    }
                    Some(segs)
                }
                t => return Err(d.malformed(format!("resource {id}: option tag {t}"))),
            };
            let data = d.bytes()?;
            if id == 0 || ids.insert(id, resources.len()).is_some() {
                return Err(d.malformed(format!("resource id {id} is 0 or repeated")));
            }
            let Some(bpp) = format_bpp(format) else {
                return Err(d.malformed(format!("resource {id}: format {format}")));
            };
            let size = (u64::from(width) * u64::from(height)).checked_mul(u64::from(bpp));
            if size.is_none_or(|s| s == 0 || s != data.len() as u64) {
                return Err(d.malformed(format!(
                    "resource {id}: {} bytes of pixels for {width}x{height}",
                    data.len()
                )));
            }
            used += data.len() as u64;
            if used > budget {
                return Err(incompatible(format!(
                    "the stream's resources need more than this instance's budget of \
                     {budget} bytes"
                )));
            }
            if let Some(segs) = &backing {
                let total: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
                if total > 2 * data.len() as u64 + segs.len() as u64 * 4096 {
                    return Err(d.malformed(format!("resource {id}: a backing of {total} bytes")));
                }
            }
            resources.push(Loaded {
                id,
                format,
                width,
                height,
                backing,
                data,
            });
        }
        d.finish()?;
        for (i, s) in scanouts.iter().enumerate() {
            let (w, h) = s.mode;
            if !(1..=EDID_MAX_DIM).contains(&w) || !(1..=EDID_MAX_DIM).contains(&h) {
                return Err(incompatible(format!("scanout {i}: mode {w}x{h}")));
            }
            if s.resource != 0 {
                let r = ids.get(&s.resource).map(|&k| &resources[k]);
                if !r.is_some_and(|r| rect_of(s.rect).inside(r.width, r.height)) {
                    return Err(incompatible(format!(
                        "scanout {i} shows resource {} at {:?}, which it does not hold",
                        s.resource, s.rect
                    )));
                }
            }
        }
        if cursor.scanout as usize >= scanouts.len()
            || cursor.hot_x >= CURSOR_SIZE
            || cursor.hot_y >= CURSOR_SIZE
            || cursor.image.is_some_and(|i| i.len() != CURSOR_BYTES)
        {
            return Err(incompatible(format!(
                "cursor on scanout {} with hot spot {}x{} and a {}-byte image",
                cursor.scanout,
                cursor.hot_x,
                cursor.hot_y,
                cursor.image.map_or(0, <[u8]>::len)
            )));
        }
        Ok(Checked {
            events,
            scanouts,
            cursor,
            resources,
            used,
        })
    }

    /// Replace the (reset) state with a checked section. Only allocation can fail here.
    fn apply_section(&mut self, c: Checked<'_>) -> Result<(), MigrationError> {
        let mut resources = HashMap::with_capacity(c.resources.len());
        for r in c.resources {
            let mut data = Vec::new();
            data.try_reserve_exact(r.data.len()).map_err(|e| {
                MigrationError::Device(format!("virtio-gpu: resource {}: {e}", r.id))
            })?;
            data.extend_from_slice(r.data);
            resources.insert(
                r.id,
                Resource {
                    width: r.width,
                    height: r.height,
                    format: r.format,
                    data,
                    backing: r.backing.map(|segments| Backing {
                        segments,
                        pins: None,
                    }),
                },
            );
        }
        let mut s = lock(&self.handle.state);
        s.resources = resources;
        s.used = c.used;
        for (dst, src) in s.scanouts.iter_mut().zip(&c.scanouts) {
            (dst.width, dst.height) = src.mode;
            dst.resource = src.resource;
            dst.rect = rect_of(src.rect);
            dst.flushes = src.flushes;
        }
        s.cursor = Cursor {
            scanout: c.cursor.scanout,
            x: c.cursor.x,
            y: c.cursor.y,
            hot_x: c.cursor.hot_x,
            hot_y: c.cursor.hot_y,
            image: c.cursor.image.map(|i| (CURSOR_SIZE, i.to_vec())),
        };
        self.handle.events.store(c.events, SeqCst);
        Ok(())
    }
}

impl VirtioMigrate for VirtioGpu {
    /// The budget plus the most metadata this instance may hold (see the module doc).
    fn max_state_size(&self) -> u64 {
        let entries = lock(&self.handle.state).max_backing_entries();
        FIXED_BYTES
            .saturating_add(self.config.memory_budget)
            .saturating_add(MAX_RESOURCES as u64 * PER_RESOURCE)
            .saturating_add(entries.saturating_mul(PER_ENTRY))
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        // The worker finishes every command it was notified of, then exits; a host resize
        // from now on raises no interrupt (activation at RUNNING tells the driver).
        VirtioGpu::stop(self);
        *self
            .handle
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    fn save(&mut self, out: &mut Vec<u8>) -> Result<(), MigrationError> {
        VirtioGpu::stop(self);
        let s = lock(&self.handle.state);
        let mut ids: Vec<u32> = s.resources.keys().copied().collect();
        ids.sort_unstable();
        let c = &s.cursor;
        let state = StateV1 {
            configured: self.config.scanouts.clone(),
            edid: self.config.edid,
            events: self.handle.events.load(SeqCst),
            scanouts: s
                .scanouts
                .iter()
                .map(|o| ScanoutV1 {
                    mode: (o.width, o.height),
                    resource: o.resource,
                    rect: (o.rect.x, o.rect.y, o.rect.width, o.rect.height),
                    flushes: o.flushes,
                })
                .collect(),
            cursor: CursorV1 {
                scanout: c.scanout,
                x: c.x,
                y: c.y,
                hot_x: c.hot_x,
                hot_y: c.hot_y,
                image: c.image.as_ref().map(|(_, img)| Blob(img)),
            },
            resources: ids
                .iter()
                .map(|id| {
                    let r = &s.resources[id];
                    ResourceV1 {
                        id: *id,
                        format: r.format,
                        width: r.width,
                        height: r.height,
                        backing: r
                            .backing
                            .as_ref()
                            .map(|b| b.segments.iter().map(|g| (g.addr, g.len)).collect()),
                        data: Blob(&r.data),
                    }
                })
                .collect(),
        };
        encode_state_into(out, STATE_FORMAT, STATE_VERSION, &state)?;
        tracing::info!(
            resources = state.resources.len(),
            bytes = s.used,
            "virtio-gpu: state saved"
        );
        Ok(())
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), MigrationError> {
        let r = self
            .check_section(bytes)
            .and_then(|c| self.apply_section(c));
        match r {
            Ok(()) => {
                let (n, used) = {
                    let s = lock(&self.handle.state);
                    (s.resources.len(), s.used)
                };
                tracing::info!(resources = n, bytes = used, "virtio-gpu: state loaded");
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "virtio-gpu: state refused; the device is reset");
                umdev::virtio::VirtioDevice::reset(self);
                Err(e)
            }
        }
    }
}
