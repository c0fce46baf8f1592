//! virtio-gpu wire format (virtio 1.2, 5.7.6): command and response types, little-endian
//! structures read from a request's bytes. Parsing only: every field is checked where it
//! is used (`commands.rs`).

/// Feature bit: the device answers GET_EDID.
pub const VIRTIO_GPU_F_EDID: u64 = 1 << 1;
/// Config event: the display configuration changed.
pub const VIRTIO_GPU_EVENT_DISPLAY: u32 = 1;
/// Header flag: the command carries a fence.
pub const VIRTIO_GPU_FLAG_FENCE: u32 = 1;
/// Most scanouts the protocol allows.
pub const MAX_SCANOUTS: usize = 16;

/// Command types.
pub mod cmd {
    /// Display modes of every scanout.
    pub const GET_DISPLAY_INFO: u32 = 0x0100;
    /// Create a 2D resource.
    pub const RESOURCE_CREATE_2D: u32 = 0x0101;
    /// Destroy a resource.
    pub const RESOURCE_UNREF: u32 = 0x0102;
    /// Show a resource on a scanout.
    pub const SET_SCANOUT: u32 = 0x0103;
    /// A rectangle of a resource changed on screen.
    pub const RESOURCE_FLUSH: u32 = 0x0104;
    /// Copy guest backing into the resource.
    pub const TRANSFER_TO_HOST_2D: u32 = 0x0105;
    /// Give a resource guest pages as backing.
    pub const RESOURCE_ATTACH_BACKING: u32 = 0x0106;
    /// Take the backing back.
    pub const RESOURCE_DETACH_BACKING: u32 = 0x0107;
    /// EDID of a scanout.
    pub const GET_EDID: u32 = 0x010a;
    /// Cursor image and position.
    pub const UPDATE_CURSOR: u32 = 0x0300;
    /// Cursor position.
    pub const MOVE_CURSOR: u32 = 0x0301;
}

/// Response types.
pub mod resp {
    /// Success, no data.
    pub const OK_NODATA: u32 = 0x1100;
    /// Success with display info.
    pub const OK_DISPLAY_INFO: u32 = 0x1101;
    /// Success with an EDID.
    pub const OK_EDID: u32 = 0x1104;
    /// Unspecified error.
    pub const ERR_UNSPEC: u32 = 0x1200;
    /// Out of (host) memory.
    pub const ERR_OUT_OF_MEMORY: u32 = 0x1201;
    /// No such scanout.
    pub const ERR_INVALID_SCANOUT_ID: u32 = 0x1202;
    /// No such resource (or one that exists where a new one was asked).
    pub const ERR_INVALID_RESOURCE_ID: u32 = 0x1203;
    /// A bad parameter (rectangle, format, size, entry).
    pub const ERR_INVALID_PARAMETER: u32 = 0x1205;
}

/// Bytes of the control header.
pub const HDR_SIZE: usize = 24;
/// Bytes of a backing entry.
pub const MEM_ENTRY_SIZE: usize = 16;

/// The control header of every request and response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlHdr {
    /// Command or response type.
    pub kind: u32,
    /// Flags (`VIRTIO_GPU_FLAG_FENCE`).
    pub flags: u32,
    /// Fence ID, echoed in the response when fenced.
    pub fence_id: u64,
    /// 3D context (0 in 2D).
    pub ctx_id: u32,
    /// Ring index (with context init; echoed).
    pub ring_idx: u8,
}

impl CtrlHdr {
    /// The response header for a request with this header: `kind`, and the fence echoed.
    pub fn response(&self, kind: u32) -> CtrlHdr {
        let fenced = self.flags & VIRTIO_GPU_FLAG_FENCE != 0;
        CtrlHdr {
            kind,
            flags: self.flags & VIRTIO_GPU_FLAG_FENCE,
            fence_id: if fenced { self.fence_id } else { 0 },
            ctx_id: self.ctx_id,
            ring_idx: if fenced { self.ring_idx } else { 0 },
        }
    }

    /// Encode.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.kind.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.fence_id.to_le_bytes());
        out.extend_from_slice(&self.ctx_id.to_le_bytes());
        out.extend_from_slice(&[self.ring_idx, 0, 0, 0]);
    }
}

/// A rectangle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rect {
    /// Left.
    pub x: u32,
    /// Top.
    pub y: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

impl Rect {
    /// Non-empty and inside a `w` × `h` surface (no overflow).
    pub fn inside(&self, w: u32, h: u32) -> bool {
        self.width > 0
            && self.height > 0
            && self.x.checked_add(self.width).is_some_and(|e| e <= w)
            && self.y.checked_add(self.height).is_some_and(|e| e <= h)
    }
}

/// Little-endian reads from a request's bytes; reading past the end is `None`.
pub struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    /// Fields of `bytes`, from the start.
    pub fn new(bytes: &'a [u8]) -> Fields<'a> {
        Fields { bytes, at: 0 }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let end = self.at.checked_add(N)?;
        let b: [u8; N] = self.bytes.get(self.at..end)?.try_into().ok()?;
        self.at = end;
        Some(b)
    }

    /// A u32.
    pub fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    /// A u64.
    pub fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    /// The header.
    pub fn hdr(&mut self) -> Option<CtrlHdr> {
        let kind = self.u32()?;
        let flags = self.u32()?;
        let fence_id = self.u64()?;
        let ctx_id = self.u32()?;
        let [ring_idx, ..] = self.take::<4>()?;
        Some(CtrlHdr {
            kind,
            flags,
            fence_id,
            ctx_id,
            ring_idx,
        })
    }

    /// A rectangle.
    pub fn rect(&mut self) -> Option<Rect> {
        Some(Rect {
            x: self.u32()?,
            y: self.u32()?,
            width: self.u32()?,
            height: self.u32()?,
        })
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.at
    }
}

/// Bytes per pixel of a supported format (all are 32-bit), or `None`.
pub fn format_bpp(format: u32) -> Option<u32> {
    match format {
        1 | 2 | 3 | 4 | 67 | 68 | 121 | 134 => Some(4),
        _ => None,
    }
}

/// The (R, G, B, A) byte positions in a pixel of `format` (virtio-gpu formats name the
/// bytes in memory order); alpha `None` for X formats (opaque).
pub fn format_channels(format: u32) -> ([usize; 3], Option<usize>) {
    match format {
        1 => ([2, 1, 0], Some(3)),   // B8G8R8A8
        2 => ([2, 1, 0], None),      // B8G8R8X8
        3 => ([1, 2, 3], Some(0)),   // A8R8G8B8
        4 => ([1, 2, 3], None),      // X8R8G8B8
        67 => ([0, 1, 2], Some(3)),  // R8G8B8A8
        68 => ([3, 2, 1], None),     // X8B8G8R8
        121 => ([3, 2, 1], Some(0)), // A8B8G8R8
        _ => ([0, 1, 2], None),      // R8G8B8X8 (134)
    }
}
