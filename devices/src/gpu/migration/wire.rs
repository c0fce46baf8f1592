//! The GPU's migration formats: serde values that travel behind umdev's versioned header
//! ([`umdev::migration::encode_state`]), and the checks a destination makes before it
//! applies one (a stream is untrusted input: a value that decodes but describes a state
//! the device could never be in is refused, never applied).
//!
//! Two formats, each with its own name and version, so that one is never read as the
//! other:
//!
//! - [`STATE_FORMAT`] version 1 ([`StateV1`]): the whole device state, saved in STOP_COPY.
//! - [`PRECOPY_FORMAT`] version 1 ([`ChunkV1`]): one PRE_COPY chunk of framebuffer pages.
//!
//! **Reading** goes field by field with a [`Decoder`] ([`decode_state_v1`],
//! [`decode_chunk_v1`]): the registers and GTT are small (the GTT's length is checked
//! against [`GTT_ENTRIES`] before it is read), and the pages are never collected: [`Pages`]
//! checks the declared count against the framebuffer's page count, then walks the pages in
//! the frame twice, once to check them (inside the framebuffer, each at most once, whole),
//! once to write them, their bytes borrowed from the frame. So loading holds nothing the
//! size of the data but the frame itself.
//!
//! A change to either layout is a new version (a new `…V2` type next to the old one, which
//! the destination keeps reading as long as it can); the range a build reads is
//! `STATE_VERSION_MIN..=STATE_VERSION` and likewise for PRE_COPY.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use umdev::migration::{Decoder, MigrationError};

use super::super::framebuffer::{Framebuffer, FB_PAGE};
use super::super::regs::{Mode, Regs, RingRegs, GTT_ENTRIES, IRQ_ALL};

/// Name of the GPU's state format.
pub const STATE_FORMAT: &str = "umdev-gpu";
/// Version of the state format this build writes.
pub const STATE_VERSION: u32 = 1;
/// Oldest state version this build reads.
pub const STATE_VERSION_MIN: u32 = 1;
/// Name of the GPU's PRE_COPY chunk format.
pub const PRECOPY_FORMAT: &str = "umdev-gpu-fb";
/// Version of the PRE_COPY chunk format this build writes.
pub const PRECOPY_VERSION: u32 = 1;
/// Oldest PRE_COPY chunk version this build reads.
pub const PRECOPY_VERSION_MIN: u32 = 1;

/// The whole device state, version 1. Pins are not state (the destination pins GTT pages
/// again on first use); neither is the ring generation (the destination moves its own on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateV1 {
    /// BAR2 size of the source: the destination's must be the same.
    pub fb_size: u64,
    /// Mode registers.
    pub mode: ModeV1,
    /// Ring registers, `RING_HEAD` included: the commands `[head, tail)` are published but
    /// not executed, the destination executes them after RUNNING.
    pub ring: RingV1,
    /// `IRQ_STATUS`.
    pub irq_status: u32,
    /// `IRQ_ENABLE`.
    pub irq_enable: u32,
    /// `ERROR_CODE`.
    pub error_code: u32,
    /// `ERROR_INFO`.
    pub error_info: u32,
    /// `ERROR_COUNT`.
    pub error_count: u32,
    /// `FENCE_VALUE`.
    pub fence: u32,
    /// `GTT_INVAL_START`.
    pub gtt_inval_start: u32,
    /// `GTT_INVAL_COUNT`.
    pub gtt_inval_count: u32,
    /// Every GTT entry, in order.
    pub gtt: Vec<u64>,
    /// The framebuffer: whole, or the pages changed since the PRE_COPY chunks.
    pub fb: FbPartV1,
}

/// The mode registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModeV1 {
    /// `MODE_WIDTH`.
    pub width: u32,
    /// `MODE_HEIGHT`.
    pub height: u32,
    /// `MODE_STRIDE`.
    pub stride: u32,
    /// `MODE_FORMAT`.
    pub format: u32,
    /// `MODE_CTRL` bit 0.
    pub enabled: bool,
}

/// The ring registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingV1 {
    /// `RING_BASE_HI:LO`.
    pub base: u64,
    /// `RING_SIZE`.
    pub size: u32,
    /// `RING_HEAD`.
    pub head: u32,
    /// `RING_TAIL`.
    pub tail: u32,
    /// `RING_CTRL` bit 0.
    pub enabled: bool,
}

/// The framebuffer part of a saved state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FbPartV1 {
    /// 0: `pages` is the whole framebuffer. `n > 0`: `pages` are the pages that changed
    /// after PRE_COPY chunks `0..n`, which the destination must have loaded.
    pub precopy_chunks: u32,
    /// The pages.
    pub pages: Vec<Page>,
}

/// One PRE_COPY chunk, version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkV1 {
    /// BAR2 size of the source.
    pub fb_size: u64,
    /// Position in the PRE_COPY sequence: chunk 0 holds every page, chunk `n > 0` the
    /// pages that changed after chunk `n - 1`.
    pub seq: u32,
    /// The pages.
    pub pages: Vec<Page>,
}

/// One [`FB_PAGE`]-byte framebuffer page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Page {
    /// Page number (byte offset / `FB_PAGE`).
    pub index: u32,
    /// Its contents.
    pub data: PageData,
}

/// A page's contents: one pixel value repeated (an untouched page is `Solid(0)`, a page
/// inside a filled rectangle is `Solid(color)`), or its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PageData {
    /// Every 32-bit word of the page is this value.
    Solid(u32),
    /// The page's bytes (exactly [`FB_PAGE`]).
    Bytes(PageBytes),
}

impl Page {
    /// Encode page `index` with contents `bytes` (`FB_PAGE` long).
    pub fn encode(index: usize, bytes: &[u8]) -> Page {
        let first = &bytes[..4];
        let data = if bytes.chunks_exact(4).all(|w| w == first) {
            PageData::Solid(u32::from_le_bytes([first[0], first[1], first[2], first[3]]))
        } else {
            PageData::Bytes(PageBytes(bytes.to_vec()))
        };
        Page {
            index: index as u32,
            data,
        }
    }

    /// Write the page's contents into `out` (`FB_PAGE` long). The page was checked
    /// ([`check_pages`]).
    pub fn decode_into(&self, out: &mut [u8]) {
        match &self.data {
            PageData::Solid(v) => {
                for w in out.chunks_exact_mut(4) {
                    w.copy_from_slice(&v.to_le_bytes());
                }
            }
            PageData::Bytes(b) => out.copy_from_slice(&b.0),
        }
    }

    /// Bytes of page contents this page carries on the wire (for accounting).
    pub fn payload_len(&self) -> usize {
        match &self.data {
            PageData::Solid(_) => 4,
            PageData::Bytes(b) => b.0.len(),
        }
    }
}

/// A page's bytes, encoded as one byte string (postcard: a length and the bytes) rather
/// than a sequence of numbers.
#[derive(Clone, PartialEq, Eq)]
pub struct PageBytes(pub Vec<u8>);

impl fmt::Debug for PageBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageBytes({} bytes)", self.0.len())
    }
}

impl Serialize for PageBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for PageBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<PageBytes, D::Error> {
        struct BytesVisitor;
        impl Visitor<'_> for BytesVisitor {
            type Value = PageBytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a framebuffer page's bytes")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<PageBytes, E> {
                Ok(PageBytes(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<PageBytes, E> {
                Ok(PageBytes(v))
            }
        }
        d.deserialize_byte_buf(BytesVisitor)
    }
}

fn malformed(format: &str, why: String) -> MigrationError {
    MigrationError::Malformed {
        format: format.to_owned(),
        why,
    }
}

fn check_fb_size(found: u64, fb_size: u64) -> Result<(), MigrationError> {
    if found == fb_size {
        Ok(())
    } else {
        Err(MigrationError::Incompatible(format!(
            "the state is of a GPU with a {found}-byte framebuffer, this one has {fb_size} bytes"
        )))
    }
}

/// Upper bound of the encoded [`StateV1`] or [`ChunkV1`] of a GPU with `fb_size` bytes of
/// framebuffer: its [`Migrate::max_state_size`](umdev::migration::Migrate::max_state_size).
/// Every page at its largest (index varint, variant, length varint, [`FB_PAGE`] bytes),
/// the GTT at ten bytes an entry, 256 bytes for the header and registers.
pub fn max_encoded_size(fb_size: u64) -> u64 {
    const PAGE: u64 = 5 + 1 + 3 + FB_PAGE as u64;
    let pages = fb_size / FB_PAGE as u64;
    256 + 5 + u64::from(GTT_ENTRIES) * 10 + 5 + 10 + pages * PAGE
}

/// A page as read from a frame: its bytes borrowed (the wire form of [`Page`]).
#[derive(Debug, Deserialize)]
pub struct PageRef<'a> {
    /// Page number.
    pub index: u32,
    /// Its contents.
    #[serde(borrow)]
    pub data: PageDataRef<'a>,
}

/// The contents of a [`PageRef`] (the wire form of [`PageData`]).
#[derive(Debug, Deserialize)]
pub enum PageDataRef<'a> {
    /// Every 32-bit word of the page is this value.
    Solid(u32),
    /// The page's bytes.
    Bytes(&'a [u8]),
}

/// The pages of a frame, not decoded yet (see the module doc).
#[derive(Debug, Clone)]
pub struct Pages<'a> {
    format: &'static str,
    count: usize,
    /// Positioned at the first page; the pages are the last field of their value.
    at: Decoder<'a>,
}

impl<'a> Pages<'a> {
    /// The pages that follow in `d`, for a framebuffer of `fb_size` bytes: a declared count
    /// over its page count (each page at most once) or over what the bytes can hold is
    /// refused here.
    fn read(
        format: &'static str,
        d: &mut Decoder<'a>,
        fb_size: u64,
    ) -> Result<Pages<'a>, MigrationError> {
        let count = d.seq_len(fb_size as usize / FB_PAGE, 3)?;
        Ok(Pages {
            format,
            count,
            at: d.clone(),
        })
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True if there are none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn each(
        &self,
        mut f: impl FnMut(PageRef<'a>) -> Result<(), MigrationError>,
    ) -> Result<(), MigrationError> {
        let mut d = self.at.clone();
        for _ in 0..self.count {
            f(d.value()?)?;
        }
        d.finish()
    }

    /// Check every page against a framebuffer of `fb_size` bytes (inside it, at most once,
    /// byte pages whole; nothing after the last page); returns true if they cover every
    /// page. Nothing is allocated but one bit per framebuffer page.
    pub fn check(&self, fb_size: u64) -> Result<bool, MigrationError> {
        let count = fb_size as usize / FB_PAGE;
        let mut seen = vec![false; count];
        let format = self.format;
        self.each(|p| check_page(format, &mut seen, p.index, &p.data))?;
        Ok(seen.iter().all(|&s| s))
    }

    /// Write the pages (checked with [`Pages::check`]) into `fb`.
    pub fn apply(&self, fb: &Framebuffer) {
        let mut solid = vec![0u8; FB_PAGE];
        let r = self.each(|p| {
            let at = p.index as usize * FB_PAGE;
            match p.data {
                PageDataRef::Solid(v) => {
                    for w in solid.chunks_exact_mut(4) {
                        w.copy_from_slice(&v.to_le_bytes());
                    }
                    fb.write(at, &solid);
                }
                PageDataRef::Bytes(b) => {
                    fb.write(at, b);
                }
            }
            Ok(())
        });
        debug_assert!(r.is_ok(), "pages applied unchecked: {r:?}");
    }
}

fn check_page(
    format: &str,
    seen: &mut [bool],
    index: u32,
    data: &PageDataRef<'_>,
) -> Result<(), MigrationError> {
    let count = seen.len();
    let Some(slot) = seen.get_mut(index as usize) else {
        return Err(malformed(
            format,
            format!("page {index} is past the framebuffer's {count} pages"),
        ));
    };
    if *slot {
        return Err(malformed(format, format!("page {index} appears twice")));
    }
    if let PageDataRef::Bytes(b) = data {
        if b.len() != FB_PAGE {
            return Err(malformed(
                format,
                format!("page {index} has {} bytes, not {FB_PAGE}", b.len()),
            ));
        }
    }
    *slot = true;
    Ok(())
}

/// Check `pages` against a framebuffer of `fb_size` bytes (`format` names the stream in
/// errors), as [`Pages::check`] does for pages read from a frame; returns true if they
/// cover every page.
pub fn check_pages(format: &str, pages: &[Page], fb_size: u64) -> Result<bool, MigrationError> {
    let mut seen = vec![false; fb_size as usize / FB_PAGE];
    for p in pages {
        let data = match &p.data {
            PageData::Solid(v) => PageDataRef::Solid(*v),
            PageData::Bytes(b) => PageDataRef::Bytes(&b.0),
        };
        check_page(format, &mut seen, p.index, &data)?;
    }
    Ok(seen.iter().all(|&s| s))
}

/// Read a [`StateV1`] of a GPU with `fb_size` bytes of framebuffer: everything but the
/// pages (the returned state's are empty), and the pages, unchecked (check the state with
/// [`StateV1::check_regs`], the pages with [`Pages::check`]). A state of another
/// framebuffer size is refused before its registers are read.
pub fn decode_state_v1(bytes: &[u8], fb_size: u64) -> Result<(StateV1, Pages<'_>), MigrationError> {
    let (_, mut d) = Decoder::new(STATE_FORMAT, STATE_VERSION_MIN, STATE_VERSION, bytes)?;
    let found: u64 = d.value()?;
    check_fb_size(found, fb_size)?;
    let mode = d.value()?;
    let ring = d.value()?;
    let mut regs = [0u32; 8];
    for r in &mut regs {
        *r = d.value()?;
    }
    let entries = d.seq_len(usize::MAX, 1)?;
    if entries != GTT_ENTRIES as usize {
        return Err(malformed(
            STATE_FORMAT,
            format!("{entries} GTT entries, the GPU has {GTT_ENTRIES}"),
        ));
    }
    let gtt = (0..entries)
        .map(|_| d.value())
        .collect::<Result<Vec<u64>, _>>()?;
    let precopy_chunks = d.value()?;
    let pages = Pages::read(STATE_FORMAT, &mut d, fb_size)?;
    let [irq_status, irq_enable, error_code, error_info, error_count, fence, gtt_inval_start, gtt_inval_count] =
        regs;
    let state = StateV1 {
        fb_size: found,
        mode,
        ring,
        irq_status,
        irq_enable,
        error_code,
        error_info,
        error_count,
        fence,
        gtt_inval_start,
        gtt_inval_count,
        gtt,
        fb: FbPartV1 {
            precopy_chunks,
            pages: Vec::new(),
        },
    };
    Ok((state, pages))
}

/// Read a [`ChunkV1`] of a GPU with `fb_size` bytes of framebuffer: its sequence number and
/// its pages, unchecked ([`Pages::check`]). A chunk of another framebuffer size is refused
/// before its pages are looked at.
pub fn decode_chunk_v1(bytes: &[u8], fb_size: u64) -> Result<(u32, Pages<'_>), MigrationError> {
    let (_, mut d) = Decoder::new(PRECOPY_FORMAT, PRECOPY_VERSION_MIN, PRECOPY_VERSION, bytes)?;
    let found: u64 = d.value()?;
    check_fb_size(found, fb_size)?;
    let seq = d.value()?;
    let pages = Pages::read(PRECOPY_FORMAT, &mut d, fb_size)?;
    Ok((seq, pages))
}

impl ChunkV1 {
    /// Check the chunk against this GPU; returns true if it covers every page.
    pub fn check(&self, fb_size: u64) -> Result<bool, MigrationError> {
        check_fb_size(self.fb_size, fb_size)?;
        check_pages(PRECOPY_FORMAT, &self.pages, fb_size)
    }
}

impl StateV1 {
    /// The state of `regs`, `gtt` entries and framebuffer part `fb` of a GPU with
    /// `fb_size` bytes of framebuffer.
    pub fn capture(regs: &Regs, gtt: &[u64], fb_size: u64, fb: FbPartV1) -> StateV1 {
        let m = regs.mode;
        let r = regs.ring;
        StateV1 {
            fb_size,
            mode: ModeV1 {
                width: m.width,
                height: m.height,
                stride: m.stride,
                format: m.format,
                enabled: m.enabled,
            },
            ring: RingV1 {
                base: r.base,
                size: r.size,
                head: r.head,
                tail: r.tail,
                enabled: r.enabled,
            },
            irq_status: regs.irq_status,
            irq_enable: regs.irq_enable,
            error_code: regs.error_code,
            error_info: regs.error_info,
            error_count: regs.error_count,
            fence: regs.fence,
            gtt_inval_start: regs.gtt_inval_start,
            gtt_inval_count: regs.gtt_inval_count,
            gtt: gtt.to_vec(),
            fb,
        }
    }

    fn mode(&self) -> Mode {
        let m = self.mode;
        Mode {
            width: m.width,
            height: m.height,
            stride: m.stride,
            format: m.format,
            enabled: m.enabled,
        }
    }

    fn ring(&self) -> RingRegs {
        let r = self.ring;
        RingRegs {
            base: r.base,
            size: r.size,
            enabled: r.enabled,
            head: r.head,
            tail: r.tail,
        }
    }

    /// Check that the state is one a GPU with `fb_size` bytes of framebuffer can be in
    /// ([`StateV1::check_regs`], and pages inside the framebuffer, each at most once).
    /// Returns true if the framebuffer part covers every page.
    pub fn check(&self, fb_size: u64) -> Result<bool, MigrationError> {
        self.check_regs(fb_size)?;
        check_pages(STATE_FORMAT, &self.fb.pages, fb_size)
    }

    /// Check everything but the pages: the invariants the register writes keep (an enabled
    /// mode or ring is valid, head and tail are dword offsets inside an enabled ring and 0
    /// otherwise, only defined interrupt bits) and one entry per GTT slot.
    pub fn check_regs(&self, fb_size: u64) -> Result<(), MigrationError> {
        let bad = |why: String| Err(malformed(STATE_FORMAT, why));
        check_fb_size(self.fb_size, fb_size)?;
        let mode = self.mode();
        if mode.enabled && !mode.validate(fb_size) {
            return bad(format!("the enabled mode {mode:?} is not valid"));
        }
        let ring = self.ring();
        let offsets_ok = |o: u32| o.is_multiple_of(4) && o < ring.size;
        let ring_ok = if ring.enabled {
            ring.validate() && offsets_ok(ring.head) && offsets_ok(ring.tail)
        } else {
            ring.head == 0 && ring.tail == 0
        };
        if !ring_ok {
            return bad(format!("the ring {ring:?} is not valid"));
        }
        if (self.irq_status | self.irq_enable) & !IRQ_ALL != 0 {
            return bad(format!(
                "undefined interrupt bits (status {:#x}, enable {:#x})",
                self.irq_status, self.irq_enable
            ));
        }
        if self.gtt.len() != GTT_ENTRIES as usize {
            return bad(format!(
                "{} GTT entries, the GPU has {GTT_ENTRIES}",
                self.gtt.len()
            ));
        }
        Ok(())
    }

    /// Write the registers of the state into `regs` (checked first with
    /// [`StateV1::check`]); the ring generation moves on, so work fetched before is
    /// dropped.
    pub fn apply_regs(&self, regs: &mut Regs) {
        regs.mode = self.mode();
        regs.ring = self.ring();
        regs.ring_gen = regs.ring_gen.wrapping_add(1);
        regs.irq_status = self.irq_status;
        regs.irq_enable = self.irq_enable;
        regs.error_code = self.error_code;
        regs.error_info = self.error_info;
        regs.error_count = self.error_count;
        regs.fence = self.fence;
        regs.gtt_inval_start = self.gtt_inval_start;
        regs.gtt_inval_count = self.gtt_inval_count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_page_encode_solid_and_bytes_round_trip() {
        let solid: Vec<u8> = std::iter::repeat_n(0x11223344u32.to_le_bytes(), FB_PAGE / 4)
            .flatten()
            .collect();
        let p = Page::encode(3, &solid);
        assert_eq!(p.data, PageData::Solid(0x11223344));
        let mut back = vec![0u8; FB_PAGE];
        p.decode_into(&mut back);
        assert_eq!(back, solid);
        let mut mixed = solid.clone();
        mixed[FB_PAGE - 1] = 0;
        let p = Page::encode(4, &mixed);
        assert!(matches!(p.data, PageData::Bytes(_)));
        p.decode_into(&mut back);
        assert_eq!(back, mixed);
    }

    #[test]
    fn test_check_pages_refuses_short_page_and_index_past_end() {
        let fb_size = 64 * 1024;
        let short = Page {
            index: 0,
            data: PageData::Bytes(PageBytes(vec![0; 100])),
        };
        assert!(check_pages("f", &[short], fb_size).is_err());
        let past = Page {
            index: 16,
            data: PageData::Solid(0),
        };
        assert!(check_pages("f", &[past], fb_size).is_err());
        let all: Vec<Page> = (0..16)
            .map(|i| Page {
                index: i,
                data: PageData::Solid(0),
            })
            .collect();
        assert_eq!(check_pages("f", &all, fb_size).ok(), Some(true));
        assert_eq!(check_pages("f", &all[1..], fb_size).ok(), Some(false));
    }

    #[test]
    fn test_state_check_refuses_impossible_registers() {
        let fb_size = 4 << 20;
        let regs = Regs::default();
        let gtt = vec![0u64; GTT_ENTRIES as usize];
        let ok = StateV1::capture(
            &regs,
            &gtt,
            fb_size,
            FbPartV1 {
                precopy_chunks: 0,
                pages: vec![],
            },
        );
        assert_eq!(ok.check(fb_size).ok(), Some(false), "valid, pages missing");
        let mut s = ok.clone();
        s.ring.tail = 8;
        assert!(s.check(fb_size).is_err(), "tail of a disabled ring");
        let mut s = ok.clone();
        s.ring = RingV1 {
            base: 0x1000,
            size: 4096,
            head: 4096,
            tail: 0,
            enabled: true,
        };
        assert!(s.check(fb_size).is_err(), "head past the ring");
        s.ring.head = 6;
        assert!(s.check(fb_size).is_err(), "head not a dword offset");
        s.ring.head = 8;
        assert!(s.check(fb_size).is_ok());
        let mut s = ok.clone();
        s.mode.enabled = true;
        s.mode.height = 4096;
        assert!(
            s.check(fb_size).is_err(),
            "mode larger than the framebuffer"
        );
        let mut s = ok.clone();
        s.irq_status = 1 << 7;
        assert!(s.check(fb_size).is_err());
        let mut s = ok.clone();
        s.gtt.pop();
        assert!(s.check(fb_size).is_err());
        assert!(matches!(
            ok.check(fb_size * 2),
            Err(MigrationError::Incompatible(_))
        ));
    }

    fn noisy_page(index: usize) -> Page {
        let bytes: Vec<u8> = (0..FB_PAGE)
            .map(|i| (i * 31 + index * 7 + 1) as u8)
            .collect();
        Page::encode(index, &bytes)
    }

    #[test]
    fn test_max_encoded_size_bounds_the_largest_state_and_fits_a_2_gib_type_in_a_frame() {
        let fb_size = 1 << 20;
        let pages: Vec<Page> = (0..fb_size as usize / FB_PAGE).map(noisy_page).collect();
        let regs = Regs::default();
        let gtt = vec![u64::MAX; GTT_ENTRIES as usize];
        let mut state = StateV1::capture(
            &regs,
            &gtt,
            fb_size,
            FbPartV1 {
                precopy_chunks: u32::MAX,
                pages: pages.clone(),
            },
        );
        state.mode.width = u32::MAX;
        state.ring.base = u64::MAX;
        let bytes = umdev::migration::encode_state(STATE_FORMAT, u32::MAX, &state).unwrap();
        assert!(bytes.len() as u64 <= max_encoded_size(fb_size));
        let chunk = ChunkV1 {
            fb_size,
            seq: u32::MAX,
            pages,
        };
        let bytes = umdev::migration::encode_state(PRECOPY_FORMAT, u32::MAX, &chunk).unwrap();
        assert!(bytes.len() as u64 <= max_encoded_size(fb_size));
        // The largest type (2 GiB) fits a frame (the head's length is a u32), so its
        // STOP_COPY is not refused for its size.
        assert!(max_encoded_size(2 << 30) <= umdev::migration::stream::MAX_FRAME as u64);
        assert!(
            max_encoded_size(2 << 30) < (2 << 30) + (2 << 30) / 100,
            "a tight bound"
        );
    }

    #[test]
    fn test_check_pages_duplicate_index_refused() {
        let fb_size = 64 * 1024;
        let twice = [noisy_page(3), noisy_page(3)];
        let e = check_pages("f", &twice, fb_size).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn test_decode_state_v1_reads_what_serde_wrote_and_checks_pages_in_the_frame() {
        let fb_size = 64 * 1024;
        let regs = Regs {
            fence: 77,
            ..Regs::default()
        };
        let gtt: Vec<u64> = (0..u64::from(GTT_ENTRIES)).collect();
        let pages = vec![noisy_page(2), noisy_page(0)];
        let state = StateV1::capture(
            &regs,
            &gtt,
            fb_size,
            FbPartV1 {
                precopy_chunks: 3,
                pages: pages.clone(),
            },
        );
        let bytes = umdev::migration::encode_state(STATE_FORMAT, STATE_VERSION, &state).unwrap();
        let (back, view) = decode_state_v1(&bytes, fb_size).unwrap();
        let mut expected = state.clone();
        expected.fb.pages.clear();
        assert_eq!(back, expected);
        assert_eq!(view.len(), 2);
        assert_eq!(view.check(fb_size).ok(), Some(false));
        // Another framebuffer size: refused before the pages.
        assert!(matches!(
            decode_state_v1(&bytes, fb_size * 2),
            Err(MigrationError::Incompatible(_))
        ));
        // The same page twice: refused by the check, before anything is applied.
        let mut dup = state.clone();
        dup.fb.pages = vec![noisy_page(1), noisy_page(1)];
        let bytes = umdev::migration::encode_state(STATE_FORMAT, STATE_VERSION, &dup).unwrap();
        let (_, view) = decode_state_v1(&bytes, fb_size).unwrap();
        assert!(view.check(fb_size).is_err());
        // More pages declared than the framebuffer has: refused before any is read.
        let mut many = state;
        many.fb.pages = (0..17).map(|i| noisy_page(i % 16)).collect();
        let bytes = umdev::migration::encode_state(STATE_FORMAT, STATE_VERSION, &many).unwrap();
        assert!(decode_state_v1(&bytes, fb_size).is_err());
    }
}
