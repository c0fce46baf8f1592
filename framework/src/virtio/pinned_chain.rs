//! A descriptor chain's buffers, pinned: each direction is one page array (one `pin_pages`
//! call, coalesced), addressed as one byte stream (the buffers' bytes one after the other).

use crate::dma::{DmaError, DmaHandle, PinnedPages, PAGE_SIZE};

use super::chain::{pages_of, side_prot, DescChain, Segment};

/// A scatter list of guest buffers pinned as one page array (one `pin_pages` call:
/// coalesced, all or nothing) and addressed as one byte stream: the buffers' bytes one
/// after the other. One direction of a [`PinnedChain`]; a device also keeps these for
/// buffers that outlive a chain (a virtio-gpu resource's backing). Unpinned on drop: drop
/// it before your unmap notifier returns for its range.
#[derive(Debug)]
pub struct PinnedBuffers {
    pages: Option<PinnedPages>,
    /// Per buffer: (byte offset of the buffer in the pinned pages, length).
    spans: Vec<(u64, u64)>,
    len: u64,
}

impl PinnedBuffers {
    /// Pin `segments` (each non-empty and not wrapping, as [`DescChain`] guarantees; an
    /// empty or wrapping one is an `InvalidArgument` error), readable, or writable if
    /// `writable`.
    pub fn pin(
        dma: &DmaHandle,
        segments: &[Segment],
        writable: bool,
    ) -> Result<PinnedBuffers, DmaError> {
        if segments
            .iter()
            .any(|s| s.len == 0 || s.addr.checked_add(u64::from(s.len) - 1).is_none())
        {
            return Err(DmaError::InvalidArgument("empty or wrapping buffer"));
        }
        let mut spans = Vec::with_capacity(segments.len());
        let mut page = 0u64;
        let mut len = 0u64;
        for s in segments {
            let first = s.addr / PAGE_SIZE;
            let last = (s.addr + (u64::from(s.len) - 1)) / PAGE_SIZE;
            spans.push((page * PAGE_SIZE + s.addr % PAGE_SIZE, u64::from(s.len)));
            page += last - first + 1;
            len += u64::from(s.len);
        }
        let pages = if segments.is_empty() {
            None
        } else {
            Some(PinnedPages::pin(
                dma,
                &pages_of(segments),
                side_prot(writable),
            )?)
        };
        Ok(PinnedBuffers { pages, spans, len })
    }

    /// Bytes in the stream.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True if there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if any buffer touches `[iova, iova + size)` (for an unmap notifier).
    pub fn overlaps(&self, iova: u64, size: u64) -> bool {
        let end = iova.saturating_add(size);
        self.pages.as_ref().is_some_and(|p| {
            p.pfns().iter().any(|&pfn| {
                let a = pfn << crate::dma::PAGE_SHIFT;
                a < end && iova < a.saturating_add(PAGE_SIZE)
            })
        })
    }

    /// Copy `buf.len()` bytes at `pos` of the stream into `buf` (pinned readable).
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.each(pos, buf.len() as u64, |pages, at, i, n| {
            pages.read(at, &mut buf[i..i + n])
        })
    }

    /// Copy `data` to `pos` of the stream (pinned writable).
    pub fn write(&self, pos: u64, data: &[u8]) -> Result<(), DmaError> {
        self.each(pos, data.len() as u64, |pages, at, i, n| {
            pages.write(at, &data[i..i + n])
        })
    }

    /// Call `f(offset in the pinned pages, position in the stream range, bytes)` for each
    /// buffer piece of `[pos, pos + n)` of the stream.
    fn each(
        &self,
        pos: u64,
        n: u64,
        mut f: impl FnMut(&PinnedPages, u64, usize, usize) -> Result<(), DmaError>,
    ) -> Result<(), DmaError> {
        let end =
            pos.checked_add(n)
                .filter(|&e| e <= self.len)
                .ok_or(DmaError::InvalidArgument(
                    "range beyond the chain's buffers",
                ))?;
        let Some(pages) = &self.pages else {
            return Ok(()); // n == 0 here
        };
        let mut start = 0u64; // stream position of the current buffer
        for &(at, len) in &self.spans {
            let (lo, hi) = (pos.max(start), end.min(start + len));
            if lo < hi {
                // Positions are below the caller's buffer length: they fit usize.
                f(
                    pages,
                    at + (lo - start),
                    (lo - pos) as usize,
                    (hi - lo) as usize,
                )?;
            }
            start += len;
            if start >= end {
                break;
            }
        }
        Ok(())
    }
}

/// A chain whose buffers are pinned (see the module docs); unpinned on drop. Drop it
/// before your unmap notifier returns for its range.
#[derive(Debug)]
pub struct PinnedChain {
    head: u16,
    readable: PinnedBuffers,
    writable: PinnedBuffers,
}

impl PinnedChain {
    pub(crate) fn pin(dma: &DmaHandle, chain: &DescChain) -> Result<PinnedChain, DmaError> {
        let readable = PinnedBuffers::pin(dma, chain.readable(), false)?;
        // On error `readable` is dropped here: its pages are unpinned.
        let writable = PinnedBuffers::pin(dma, chain.writable(), true)?;
        Ok(PinnedChain {
            head: chain.head(),
            readable,
            writable,
        })
    }

    /// The head descriptor index.
    pub fn head(&self) -> u16 {
        self.head
    }

    /// Device-readable bytes.
    pub fn readable_len(&self) -> u64 {
        self.readable.len
    }

    /// Device-writable bytes.
    pub fn writable_len(&self) -> u64 {
        self.writable.len
    }

    /// Copy `buf.len()` bytes at `pos` of the readable stream into `buf`.
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.readable
            .each(pos, buf.len() as u64, |pages, at, i, n| {
                pages.read(at, &mut buf[i..i + n])
            })
    }

    /// The whole readable stream as a vector (for small requests).
    pub fn read_all(&self) -> Result<Vec<u8>, DmaError> {
        let len = usize::try_from(self.readable.len)
            .map_err(|_| DmaError::InvalidArgument("chain too large"))?;
        let mut v = vec![0u8; len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Copy `data` to `pos` of the writable stream.
    pub fn write(&self, pos: u64, data: &[u8]) -> Result<(), DmaError> {
        self.writable
            .each(pos, data.len() as u64, |pages, at, i, n| {
                pages.write(at, &data[i..i + n])
            })
    }
}
