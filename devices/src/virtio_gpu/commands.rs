//! One request in, one response out: every virtio-gpu 2D command and the cursor commands,
//! each field checked before use (ids, rectangles against the resource, transfer offsets
//! and strides against the backing, entry counts and lengths, the memory budget).

use umdev::dma::DmaHandle;
use umdev::virtio::{PinnedBuffers, Segment};

use super::edid::edid;
use super::protocol::*;
use super::state::{Backing, GpuState, Resource, MAX_RESOURCES};

/// Most entries in one RESOURCE_ATTACH_BACKING.
pub const MAX_BACKING_ENTRIES: u32 = 16384;
/// Cursor images are this many pixels square.
pub const CURSOR_SIZE: u32 = 64;

/// A response: its type and payload after the header.
struct Reply(u32, Vec<u8>);

fn ok() -> Reply {
    Reply(resp::OK_NODATA, Vec::new())
}

fn err(kind: u32, why: &str) -> Reply {
    tracing::debug!("virtio-gpu: {why}");
    Reply(kind, Vec::new())
}

/// Execute the request `req` (its readable bytes); returns the response bytes.
pub fn execute(state: &mut GpuState, dma: &DmaHandle, req: &[u8]) -> Vec<u8> {
    let mut f = Fields::new(req);
    let Some(hdr) = f.hdr() else {
        let mut out = Vec::new();
        CtrlHdr::default()
            .response(resp::ERR_UNSPEC)
            .encode(&mut out);
        return out;
    };
    let Reply(kind, payload) = dispatch(state, dma, hdr.kind, &mut f)
        .unwrap_or_else(|| err(resp::ERR_UNSPEC, "request shorter than its command"));
    let mut out = Vec::with_capacity(HDR_SIZE + payload.len());
    hdr.response(kind).encode(&mut out);
    out.extend_from_slice(&payload);
    out
}

/// `None`: the request was too short.
fn dispatch(state: &mut GpuState, dma: &DmaHandle, kind: u32, f: &mut Fields) -> Option<Reply> {
    Some(match kind {
        cmd::GET_DISPLAY_INFO => display_info(state),
        cmd::GET_EDID => {
            let scanout = f.u32()?;
            get_edid(state, scanout)
        }
        cmd::RESOURCE_CREATE_2D => {
            let (id, format, width, height) = (f.u32()?, f.u32()?, f.u32()?, f.u32()?);
            create_2d(state, id, format, width, height)
        }
        cmd::RESOURCE_UNREF => {
            let id = f.u32()?;
            if state.unref(id) {
                ok()
            } else {
                err(
                    resp::ERR_INVALID_RESOURCE_ID,
                    "unref of an unknown resource",
                )
            }
        }
        cmd::SET_SCANOUT => {
            let (rect, scanout, id) = (f.rect()?, f.u32()?, f.u32()?);
            set_scanout(state, rect, scanout, id)
        }
        cmd::RESOURCE_FLUSH => {
            let (rect, id) = (f.rect()?, f.u32()?);
            flush(state, rect, id)
        }
        cmd::TRANSFER_TO_HOST_2D => {
            let (rect, offset, id) = (f.rect()?, f.u64()?, f.u32()?);
            transfer(state, dma, rect, offset, id)
        }
        cmd::RESOURCE_ATTACH_BACKING => {
            let (id, n) = (f.u32()?, f.u32()?);
            attach(state, dma, id, n, f)?
        }
        cmd::RESOURCE_DETACH_BACKING => {
            let id = f.u32()?;
            match state.resources.get_mut(&id).map(|r| r.backing.take()) {
                Some(Some(_)) => ok(),
                Some(None) => err(resp::ERR_UNSPEC, "detach of a resource without backing"),
                None => err(
                    resp::ERR_INVALID_RESOURCE_ID,
                    "detach of an unknown resource",
                ),
            }
        }
        cmd::UPDATE_CURSOR | cmd::MOVE_CURSOR => {
            let (scanout, x, y, _pad) = (f.u32()?, f.u32()?, f.u32()?, f.u32()?);
            let (id, hot_x, hot_y) = (f.u32()?, f.u32()?, f.u32()?);
            cursor(
                state,
                kind == cmd::UPDATE_CURSOR,
                scanout,
                x,
                y,
                id,
                hot_x,
                hot_y,
            )
        }
        other => err(
            resp::ERR_UNSPEC,
            &format!("command {other:#x} not supported"),
        ),
    })
}

fn display_info(state: &GpuState) -> Reply {
    let mut p = Vec::with_capacity(MAX_SCANOUTS * 24);
    for i in 0..MAX_SCANOUTS {
        let (w, h, on) = state
            .scanouts
            .get(i)
            .map_or((0, 0, 0u32), |s| (s.width, s.height, 1));
        for v in [0u32, 0, w, h, on, 0] {
            p.extend_from_slice(&v.to_le_bytes());
        }
    }
    Reply(resp::OK_DISPLAY_INFO, p)
}

fn get_edid(state: &GpuState, scanout: u32) -> Reply {
    if !state.edid {
        return err(resp::ERR_UNSPEC, "GET_EDID without VIRTIO_GPU_F_EDID");
    }
    let Some(s) = state.scanouts.get(scanout as usize) else {
        return err(
            resp::ERR_INVALID_SCANOUT_ID,
            "GET_EDID of an unknown scanout",
        );
    };
    let block = edid(s.width, s.height);
    let mut p = Vec::with_capacity(8 + 1024);
    p.extend_from_slice(&(block.len() as u32).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&block);
    p.resize(8 + 1024, 0);
    Reply(resp::OK_EDID, p)
}

fn create_2d(state: &mut GpuState, id: u32, format: u32, width: u32, height: u32) -> Reply {
    if id == 0 || state.resources.contains_key(&id) {
        return err(
            resp::ERR_INVALID_RESOURCE_ID,
            "create of resource 0 or an existing one",
        );
    }
    let Some(bpp) = format_bpp(format) else {
        return err(resp::ERR_INVALID_PARAMETER, "unsupported format");
    };
    if state.resources.len() >= MAX_RESOURCES {
        return err(resp::ERR_OUT_OF_MEMORY, "too many resources");
    }
    // u32 × u32 fits u64; × 4 may not.
    let Some(size) = (u64::from(width) * u64::from(height)).checked_mul(u64::from(bpp)) else {
        return Reply(resp::ERR_OUT_OF_MEMORY, Vec::new());
    };
    if size == 0 {
        return err(resp::ERR_INVALID_PARAMETER, "empty resource");
    }
    if state
        .used
        .checked_add(size)
        .is_none_or(|t| t > state.budget)
    {
        tracing::warn!(
            "virtio-gpu: resource {id} of {size} bytes refused: {} of {} bytes in use",
            state.used,
            state.budget
        );
        return Reply(resp::ERR_OUT_OF_MEMORY, Vec::new());
    }
    let mut data = Vec::new();
    // Within the budget, which is a host-side setting: fits usize.
    if data.try_reserve_exact(size as usize).is_err() {
        return Reply(resp::ERR_OUT_OF_MEMORY, Vec::new());
    }
    data.resize(size as usize, 0);
    state.used += size;
    state.resources.insert(
        id,
        Resource {
            width,
            height,
            format,
            data,
            backing: None,
        },
    );
    ok()
}

fn set_scanout(state: &mut GpuState, rect: Rect, scanout: u32, id: u32) -> Reply {
    let Some(s) = state.scanouts.get(scanout as usize) else {
        return err(
            resp::ERR_INVALID_SCANOUT_ID,
            "SET_SCANOUT of an unknown scanout",
        );
    };
    let _ = s;
    if id == 0 {
        let s = &mut state.scanouts[scanout as usize];
        s.resource = 0;
        return ok();
    }
    let Some(r) = state.resources.get(&id) else {
        return err(
            resp::ERR_INVALID_RESOURCE_ID,
            "SET_SCANOUT of an unknown resource",
        );
    };
    if !rect.inside(r.width, r.height) {
        return err(
            resp::ERR_INVALID_PARAMETER,
            "SET_SCANOUT rectangle outside the resource",
        );
    }
    let s = &mut state.scanouts[scanout as usize];
    s.resource = id;
    s.rect = rect;
    ok()
}

fn flush(state: &mut GpuState, rect: Rect, id: u32) -> Reply {
    let Some(r) = state.resources.get(&id) else {
        return err(
            resp::ERR_INVALID_RESOURCE_ID,
            "flush of an unknown resource",
        );
    };
    if !rect.inside(r.width, r.height) {
        return err(
            resp::ERR_INVALID_PARAMETER,
            "flush rectangle outside the resource",
        );
    }
    for s in state.scanouts.iter_mut().filter(|s| s.resource == id) {
        s.flushes += 1;
    }
    ok()
}

/// Copy `rect` of resource `id` from its backing: row `k` of the rectangle starts at byte
/// `offset + k × stride` of the backing (stride = the resource's row bytes), as Linux and
/// QEMU lay it out; every row is checked to lie in the backing before anything is copied.
fn transfer(state: &mut GpuState, dma: &DmaHandle, rect: Rect, offset: u64, id: u32) -> Reply {
    let Some(r) = state.resources.get_mut(&id) else {
        return err(
            resp::ERR_INVALID_RESOURCE_ID,
            "transfer to an unknown resource",
        );
    };
    if !rect.inside(r.width, r.height) {
        return err(
            resp::ERR_INVALID_PARAMETER,
            "transfer rectangle outside the resource",
        );
    }
    let (stride, width) = (r.stride(), r.width);
    let Some(backing) = r.backing.as_mut() else {
        return err(resp::ERR_UNSPEC, "transfer to a resource without backing");
    };
    let backing = match backing.pins(dma) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("virtio-gpu: backing of resource {id} cannot be pinned: {e}");
            return Reply(resp::ERR_UNSPEC, Vec::new());
        }
    };
    let row = u64::from(rect.width) * 4;
    let last = u64::from(rect.height - 1)
        .checked_mul(stride)
        .and_then(|v| v.checked_add(offset))
        .and_then(|v| v.checked_add(row));
    if last.is_none_or(|end| end > backing.len()) {
        return err(resp::ERR_INVALID_PARAMETER, "transfer beyond the backing");
    }
    let dst0 = u64::from(rect.y) * stride + u64::from(rect.x) * 4;
    let whole_rows = rect.x == 0 && rect.width == width;
    let rows = if whole_rows { 1 } else { rect.height };
    let len = if whole_rows {
        stride * u64::from(rect.height)
    } else {
        row
    };
    for k in 0..u64::from(rows) {
        // In range: the rectangle is inside the resource, the source inside the backing.
        let dst = (dst0 + k * stride) as usize;
        let src = offset + k * stride;
        if let Err(e) = backing.read(src, &mut r.data[dst..dst + len as usize]) {
            tracing::warn!("virtio-gpu: transfer to resource {id} failed: {e}");
            return Reply(resp::ERR_UNSPEC, Vec::new());
        }
    }
    ok()
}

/// `None`: the entries are missing from the request.
fn attach(state: &mut GpuState, dma: &DmaHandle, id: u32, n: u32, f: &mut Fields) -> Option<Reply> {
    let entries = state.backing_entries();
    let max_entries = state.max_backing_entries();
    let Some(r) = state.resources.get_mut(&id) else {
        return Some(err(
            resp::ERR_INVALID_RESOURCE_ID,
            "attach to an unknown resource",
        ));
    };
    if r.backing.is_some() {
        return Some(err(
            resp::ERR_UNSPEC,
            "attach to a resource that has backing",
        ));
    }
    if n == 0 || n > MAX_BACKING_ENTRIES {
        return Some(err(resp::ERR_INVALID_PARAMETER, "backing entry count"));
    }
    if entries + u64::from(n) > max_entries {
        return Some(err(
            resp::ERR_OUT_OF_MEMORY,
            "more backing entries than the instance holds",
        ));
    }
    let mut segments = Vec::with_capacity(n as usize);
    let mut total = 0u64;
    for _ in 0..n {
        let (addr, len, _pad) = (f.u64()?, f.u32()?, f.u32()?);
        if len == 0 || addr.checked_add(u64::from(len) - 1).is_none() {
            return Some(err(
                resp::ERR_INVALID_PARAMETER,
                "empty or wrapping backing entry",
            ));
        }
        total += u64::from(len);
        segments.push(Segment { addr, len });
    }
    // A backing larger than twice the resource (plus a page per entry) is not a framebuffer.
    let limit = 2 * r.data.len() as u64 + u64::from(n) * 4096;
    if total > limit {
        return Some(err(
            resp::ERR_INVALID_PARAMETER,
            "backing much larger than the resource",
        ));
    }
    Some(match PinnedBuffers::pin(dma, &segments, false) {
        Ok(b) => {
            r.backing = Some(Backing {
                segments,
                pins: Some(b),
            });
            ok()
        }
        Err(e) => {
            tracing::warn!("virtio-gpu: backing of resource {id} cannot be pinned: {e}");
            Reply(resp::ERR_UNSPEC, Vec::new())
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn cursor(
    state: &mut GpuState,
    update: bool,
    scanout: u32,
    x: u32,
    y: u32,
    id: u32,
    hot_x: u32,
    hot_y: u32,
) -> Reply {
    if scanout as usize >= state.scanouts.len() {
        return err(resp::ERR_INVALID_SCANOUT_ID, "cursor on an unknown scanout");
    }
    let c = &mut state.cursor;
    c.scanout = scanout;
    c.x = x;
    c.y = y;
    if !update {
        return ok();
    }
    if id == 0 {
        c.image = None;
        return ok();
    }
    let Some(r) = state.resources.get(&id) else {
        return err(
            resp::ERR_INVALID_RESOURCE_ID,
            "cursor from an unknown resource",
        );
    };
    if r.width != CURSOR_SIZE || r.height != CURSOR_SIZE {
        return err(resp::ERR_INVALID_PARAMETER, "cursor resource is not 64x64");
    }
    let rgba = super::screenshot::to_rgba(
        r,
        Rect {
            x: 0,
            y: 0,
            width: CURSOR_SIZE,
            height: CURSOR_SIZE,
        },
    );
    let c = &mut state.cursor;
    c.hot_x = hot_x.min(CURSOR_SIZE - 1);
    c.hot_y = hot_y.min(CURSOR_SIZE - 1);
    c.image = Some((CURSOR_SIZE, rgba));
    ok()
}
