//! Sending the framebuffer: what the source remembers between PRE_COPY rounds, and how a
//! round finds the pages that changed.
//!
//! **Two kinds of writers.** The device's render paths write through
//! [`Framebuffer::write`], which marks each page it touched (`framebuffer.rs`). The guest
//! CPU writes BAR2 through the client's mapping of the memfd, which the device never sees:
//! there is no trap to catch it, and no way to write-protect another process's mapping
//! (the kernel's soft-dirty bits and userfaultfd write-protection only cover our own page
//! tables). So a round catches those writes by **comparing each page with a shadow copy of
//! what was sent**, and keeps the written-page bits as a fast path: a page the device wrote
//! is sent without the comparison.
//!
//! Why a shadow copy and not per-page checksums: both cost a read of the whole
//! framebuffer per round (no trap, nothing on the guest's write path); checksums would
//! save the shadow's memory (one framebuffer's size, held from the first round until the
//! migration ends) but a collision would report a changed page as clean, and the
//! destination would show a stale page for good — the one mistake a dirty log must never
//! make. The comparison is exact.
//!
//! **Races.** A round runs while the guest and the engine keep writing. For each page it
//! first takes the page's written bit, then reads the page; a write that lands after the
//! read leaves the page different from the shadow (or sets the bit again), so the next
//! round or STOP_COPY sends it. A page torn by a concurrent write is sent torn and sent
//! again later for the same reason. STOP_COPY runs with the device stopped and, as VFIO
//! requires, the guest's vCPUs stopped by the VMM first, so nothing writes while it
//! compares: its answer is final.

use super::super::framebuffer::{Framebuffer, FB_PAGE};
use super::wire::Page;

/// The source side of PRE_COPY: what the destination has been sent.
pub struct Outgoing {
    /// The framebuffer as sent so far (the contents of the chunks sent).
    shadow: Vec<u8>,
    /// Chunks sent (the first held every page).
    chunks: u32,
}

impl Outgoing {
    /// The first round: every page (and the written bits cleared).
    pub fn start(fb: &Framebuffer) -> (Outgoing, Vec<Page>) {
        let mut shadow = vec![0u8; fb.pages() * FB_PAGE];
        let mut pages = Vec::with_capacity(fb.pages());
        for (index, sent) in shadow.chunks_exact_mut(FB_PAGE).enumerate() {
            fb.take_written(index);
            fb.read(index * FB_PAGE, sent);
            pages.push(Page::encode(index, sent));
        }
        (Outgoing { shadow, chunks: 1 }, pages)
    }

    /// A later round: the pages changed since the previous one (device-written or
    /// different from what was sent). An empty result is not a chunk.
    pub fn round(&mut self, fb: &Framebuffer) -> Vec<Page> {
        let mut page = vec![0u8; FB_PAGE];
        let mut pages = Vec::new();
        for (index, sent) in self.shadow.chunks_exact_mut(FB_PAGE).enumerate() {
            let written = fb.take_written(index);
            fb.read(index * FB_PAGE, &mut page);
            if written || page != *sent {
                sent.copy_from_slice(&page);
                pages.push(Page::encode(index, &page));
            }
        }
        if !pages.is_empty() {
            self.chunks = self.chunks.saturating_add(1);
        }
        pages
    }

    /// STOP_COPY: the pages changed since the last round, without forgetting them (saving
    /// twice gives the same answer).
    pub fn delta(&self, fb: &Framebuffer) -> Vec<Page> {
        let mut page = vec![0u8; FB_PAGE];
        let mut pages = Vec::new();
        for (index, sent) in self.shadow.chunks_exact(FB_PAGE).enumerate() {
            fb.read(index * FB_PAGE, &mut page);
            if fb.was_written(index) || page != *sent {
                pages.push(Page::encode(index, &page));
            }
        }
        pages
    }

    /// Chunks sent so far.
    pub fn chunks(&self) -> u32 {
        self.chunks
    }
}

/// Every page of the framebuffer (STOP_COPY without PRE_COPY).
pub fn all_pages(fb: &Framebuffer) -> Vec<Page> {
    let mut page = vec![0u8; FB_PAGE];
    (0..fb.pages())
        .map(|index| {
            fb.read(index * FB_PAGE, &mut page);
            Page::encode(index, &page)
        })
        .collect()
}

/// The destination side of PRE_COPY: the chunks loaded so far.
#[derive(Debug, Default)]
pub struct Incoming {
    /// The next chunk expected (chunks `0..next` are in the framebuffer).
    pub next: u32,
}
