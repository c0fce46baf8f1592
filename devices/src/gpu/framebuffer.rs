//! The framebuffer: BAR2's shared memory, accessed with volatile copies only.
//!
//! The client may map BAR2 and write it at any time, so the memory is never turned into a
//! Rust slice: every access goes through [`SharedMemory::read_at`]/[`SharedMemory::write_at`]
//! (bounds-checked volatile copies).
//!
//! **Pages the device wrote.** Every [`Framebuffer::write`] (the render paths: fill, copy,
//! blit; and `clear`) sets the bit of each [`FB_PAGE`]-byte page it touched in a bitmap
//! that live migration's PRE_COPY reads and clears (`migration/fb_sync.rs`). The bit is
//! set after the bytes are written, so a reader that clears a bit and then reads the page
//! either sees the write or finds the bit set again. Writes the device does not make — the
//! guest CPU's, through the client's mapping of BAR2 — set no bit: the migration code
//! catches those by comparing pages with what it sent (see there).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use umdev::pci::SharedMemory;

/// The page size of the framebuffer's written-page bitmap (and of migration's page copies).
pub const FB_PAGE: usize = 4096;

/// BAR2's memory as the device sees it.
#[derive(Debug, Clone)]
pub struct Framebuffer {
    mem: Arc<SharedMemory>,
    written: Arc<PageBits>,
}

/// One bit per framebuffer page, set by the device's writes.
#[derive(Debug)]
struct PageBits {
    words: Vec<AtomicU64>,
}

impl Framebuffer {
    /// Wrap BAR2's shared memory.
    pub fn new(mem: Arc<SharedMemory>) -> Framebuffer {
        let pages = (mem.len() as usize).div_ceil(FB_PAGE);
        let words = (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Framebuffer {
            mem,
            written: Arc::new(PageBits { words }),
        }
    }

    /// The shared memory (for the BAR declaration).
    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.mem
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.mem.len() as usize
    }

    /// True if the framebuffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of [`FB_PAGE`]-byte pages.
    pub fn pages(&self) -> usize {
        self.len().div_ceil(FB_PAGE)
    }

    /// Copy `buf.len()` bytes at `off` out of the framebuffer. False if out of range.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> bool {
        self.mem.read_at(off as u64, buf).is_ok()
    }

    /// Copy `data` into the framebuffer at `off` and mark the pages it touched as written
    /// by the device. False if out of range (nothing is written or marked).
    pub fn write(&self, off: usize, data: &[u8]) -> bool {
        if self.mem.write_at(off as u64, data).is_err() {
            return false;
        }
        if !data.is_empty() {
            let last = (off + data.len() - 1) / FB_PAGE;
            for page in off / FB_PAGE..=last {
                self.written.words[page / 64].fetch_or(1 << (page % 64), Ordering::AcqRel);
            }
        }
        true
    }

    /// True if the device wrote page `page` since the bit was last taken; clears the bit.
    pub fn take_written(&self, page: usize) -> bool {
        let Some(word) = self.written.words.get(page / 64) else {
            return false;
        };
        let bit = 1u64 << (page % 64);
        word.fetch_and(!bit, Ordering::AcqRel) & bit != 0
    }

    /// True if the device wrote page `page` since the bit was last taken (the bit stays).
    pub fn was_written(&self, page: usize) -> bool {
        self.written
            .words
            .get(page / 64)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1u64 << (page % 64)) != 0)
    }

    /// Zero the whole framebuffer.
    pub fn clear(&self) {
        let zeros = vec![0u8; 64 * 1024];
        let mut off = 0;
        while off < self.len() {
            let n = zeros.len().min(self.len() - off);
            self.write(off, &zeros[..n]);
            off += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_write_marks_every_touched_page_and_take_clears() {
        let fb = Framebuffer::new(Arc::new(SharedMemory::new("t", 64 * 1024).unwrap()));
        assert_eq!(fb.pages(), 16);
        // Bytes 4095..4097: the last byte of page 0 and the first of page 1.
        assert!(fb.write(FB_PAGE - 1, &[1, 2]));
        assert!(fb.write(15 * FB_PAGE, &[3]));
        assert!(!fb.write(16 * FB_PAGE, &[4]), "out of range");
        let written: Vec<usize> = (0..16).filter(|&p| fb.was_written(p)).collect();
        assert_eq!(written, vec![0, 1, 15]);
        assert!(fb.take_written(1));
        assert!(!fb.take_written(1));
        assert!(!fb.take_written(99), "past the end");
        assert!(fb.was_written(0) && !fb.was_written(1));
    }
}
