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
//! A change to either layout is a new version (a new `…V2` type next to the old one, which
//! the destination keeps reading as long as it can); the range a build reads is
//! `STATE_VERSION_MIN..=STATE_VERSION` and likewise for PRE_COPY.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use umdev::migration::MigrationError;

use super::super::framebuffer::FB_PAGE;
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

/// Check `pages` against a framebuffer of `fb_size` bytes (`format` names the stream in
/// errors); returns true if they cover every page.
pub fn check_pages(format: &str, pages: &[Page], fb_size: u64) -> Result<bool, MigrationError> {
    let count = fb_size as usize / FB_PAGE;
    let mut seen = vec![false; count];
    for p in pages {
        let Some(slot) = seen.get_mut(p.index as usize) else {
            return Err(malformed(
                format,
                format!("page {} is past the framebuffer's {count} pages", p.index),
            ));
        };
        if let PageData::Bytes(b) = &p.data {
            if b.0.len() != FB_PAGE {
                return Err(malformed(
                    format,
                    format!("page {} has {} bytes, not {FB_PAGE}", p.index, b.0.len()),
                ));
            }
        }
        *slot = true;
    }
    Ok(seen.iter().all(|&s| s))
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
    /// (the invariants the register writes keep: an enabled mode or ring is valid, head
    /// and tail are dword offsets inside an enabled ring and 0 otherwise, only defined
    /// interrupt bits, one entry per GTT slot, pages inside the framebuffer). Returns true
    /// if the framebuffer part covers every page.
    pub fn check(&self, fb_size: u64) -> Result<bool, MigrationError> {
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
        check_pages(STATE_FORMAT, &self.fb.pages, fb_size)
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
}
