//! A descriptor chain's buffers, pinned: each direction is one page array (one `pin_pages`
//! call, coalesced), addressed as one byte stream (the buffers' bytes one after the other).

use crate::dma::{DmaError, DmaHandle, PinnedPages, PAGE_SIZE};

use super::chain::{pages_of, side_prot, DescChain, Segment};

/// One direction of a chain: its pinned pages and where each buffer starts in them.
#[derive(Debug)]
struct Side {
    pages: Option<PinnedPages>,
    /// Per buffer: (byte offset of the buffer in the pinned pages, length).
    spans: Vec<(u64, u64)>,
    len: u64,
}

impl Side {
    fn pin(dma: &DmaHandle, segments: &[Segment], writable: bool) -> Result<Side, DmaError> {
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
        Ok(Side { pages, spans, len })
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
    readable: Side,
    writable: Side,
}

impl PinnedChain {
    pub(crate) fn pin(dma: &DmaHandle, chain: &DescChain) -> Result<PinnedChain, DmaError> {
        let readable = Side::pin(dma, chain.readable(), false)?;
        // On error `readable` is dropped here: its pages are unpinned.
        let writable = Side::pin(dma, chain.writable(), true)?;
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
