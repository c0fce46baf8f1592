//! Moving a command's data between the image or a host buffer and the guest pages of its
//! [`Transfer`].
//!
//! The pages are pinned with one `pin_pages` call on the whole array (so the DMA layer
//! coalesces a guest's contiguous buffer into one run); Read and Write data moves between
//! the image and the pins with `preadv`/`pwritev` ([`DataPath::image`], no bounce buffer),
//! admin data is copied through the pins with [`PinnedPages`], both under the submission queue's `pinning` lock (shared), which the unmap
//! notifier takes exclusively to wait for them; the pins are gone when the call returns. Memory mapped without
//! an fd cannot be pinned (`FdLess`): the data then goes through the DMA layer's copies
//! (DMA_READ/DMA_WRITE messages to the client), one per run of consecutive pages, without
//! the lock (the notifier must not wait for the client).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use umdev::dma::{DmaError, DmaHandle, PinnedIoError, PinnedPages, Prot, PAGE_SHIFT, PAGE_SIZE};

use super::namespace::Namespace;
use super::prp::Transfer;

/// What a data copy needs from its queue.
pub struct DataPath<'a> {
    /// The controller's DMA handle.
    pub dma: &'a DmaHandle,
    /// The submission queue's `pinning` lock (shared: several of its commands may hold
    /// pins at once; the unmap notifier takes it exclusively).
    pub pinning: &'a RwLock<()>,
    /// Pages this controller holds pinned for data (for the tests' leak checks).
    pub pins_held: &'a AtomicU64,
}

impl DataPath<'_> {
    /// Copy `data` (exactly `t.len` bytes) into the guest pages of `t`.
    pub fn to_guest(&self, t: &Transfer, data: &[u8]) -> Result<(), DmaError> {
        debug_assert_eq!(data.len() as u64, t.len);
        if t.len == 0 {
            return Ok(());
        }
        {
            let _pinning = self.pinning.read().unwrap_or_else(|e| e.into_inner());
            match self.pin(t, Prot::WRITE) {
                Ok(p) => return self.unpin_after(p, |p| p.write(t.offset, data)),
                Err(DmaError::FdLess { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        self.copy_to_guest(t, data)
    }

    /// [`DataPath::to_guest`] for memory that cannot be pinned: one DMA write per run.
    fn copy_to_guest(&self, t: &Transfer, data: &[u8]) -> Result<(), DmaError> {
        for (iova, at, n) in runs(t) {
            self.dma.write(iova, &data[at..at + n])?;
        }
        Ok(())
    }

    /// Copy the guest pages of `t` into `buf` (exactly `t.len` bytes).
    pub fn from_guest(&self, t: &Transfer, buf: &mut [u8]) -> Result<(), DmaError> {
        debug_assert_eq!(buf.len() as u64, t.len);
        if t.len == 0 {
            return Ok(());
        }
        {
            let _pinning = self.pinning.read().unwrap_or_else(|e| e.into_inner());
            match self.pin(t, Prot::READ) {
                Ok(p) => return self.unpin_after(p, |p| p.read(t.offset, buf)),
                Err(DmaError::FdLess { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        self.copy_from_guest(t, buf)
    }

    /// [`DataPath::from_guest`] for memory that cannot be pinned: one DMA read per run.
    fn copy_from_guest(&self, t: &Transfer, buf: &mut [u8]) -> Result<(), DmaError> {
        for (iova, at, n) in runs(t) {
            self.dma.read(iova, &mut buf[at..at + n])?;
        }
        Ok(())
    }

    /// Move the command's data between the image and the guest pages of `t` with no
    /// bounce buffer: the pages pinned (one coalesced `pin_pages`), then `preadv` into them
    /// (`to_guest`: a Read) or `pwritev` from them (a Write). Memory that cannot be pinned
    /// (fd-less) goes through a buffer and the DMA layer's copies instead.
    pub fn image(
        &self,
        t: &Transfer,
        ns: &Namespace,
        file_offset: u64,
        to_guest: bool,
    ) -> Result<(), ImageIoError> {
        if t.len == 0 {
            return Ok(());
        }
        let file = ns.file_for(file_offset, t.len, t.offset);
        let prot = if to_guest { Prot::WRITE } else { Prot::READ };
        {
            let _pinning = self.pinning.read().unwrap_or_else(|e| e.into_inner());
            match self.pin(t, prot) {
                Ok(p) => {
                    return self.unpin_after(p, |p| {
                        let moved = if to_guest {
                            p.read_from_file(file, file_offset, t.offset, t.len)
                        } else {
                            p.write_to_file(file, file_offset, t.offset, t.len)
                        };
                        moved.map_err(|e| match e {
                            PinnedIoError::Io(e) => ImageIoError::Host(e),
                            PinnedIoError::Dma(e) => ImageIoError::Dma(e),
                        })
                    })
                }
                Err(DmaError::FdLess { .. }) => {}
                Err(e) => return Err(ImageIoError::Dma(e)),
            }
        }
        // Through a buffer (and the page cache: the buffer is not aligned for O_DIRECT), and
        // the DMA layer's copies: the pin above already found the memory fd-less.
        let mut buf = vec![0u8; t.len as usize];
        if to_guest {
            ns.read(file_offset, &mut buf).map_err(ImageIoError::Host)?;
            self.copy_to_guest(t, &buf).map_err(ImageIoError::Dma)
        } else {
            self.copy_from_guest(t, &mut buf)
                .map_err(ImageIoError::Dma)?;
            ns.write(file_offset, &buf).map_err(ImageIoError::Host)
        }
    }

    fn pin(&self, t: &Transfer, prot: Prot) -> Result<PinnedPages, DmaError> {
        let p = PinnedPages::pin(self.dma, &t.pfns, prot)?;
        self.pins_held
            .fetch_add(t.pfns.len() as u64, Ordering::SeqCst);
        Ok(p)
    }

    /// `f` on the pins, then unpin them; `f`'s error first, else the unpin's.
    fn unpin_after<E: From<DmaError>>(
        &self,
        p: PinnedPages,
        f: impl FnOnce(&PinnedPages) -> Result<(), E>,
    ) -> Result<(), E> {
        let r = f(&p);
        let n = p.pfns().len() as u64;
        let unpinned = p.unpin();
        self.pins_held.fetch_sub(n, Ordering::SeqCst);
        r.and(unpinned.map_err(E::from))
    }
}

/// Why a transfer between the image and guest memory failed.
#[derive(Debug)]
pub enum ImageIoError {
    /// Guest memory (not mapped, Bus Master off, unmapped meanwhile): Data Transfer Error.
    Dma(DmaError),
    /// The image file: a media error status.
    Host(std::io::Error),
}

impl From<DmaError> for ImageIoError {
    fn from(e: DmaError) -> ImageIoError {
        ImageIoError::Dma(e)
    }
}

/// The runs of consecutive pages of `t`: `(iova, position in the buffer, bytes)`.
pub fn runs(t: &Transfer) -> Vec<(u64, usize, usize)> {
    let mut out: Vec<(u64, usize, usize)> = Vec::new();
    let mut at = 0u64;
    let mut prev: Option<u64> = None;
    for (i, &pfn) in t.pfns.iter().enumerate() {
        let start = if i == 0 { t.offset } else { 0 };
        let n = (PAGE_SIZE - start).min(t.len - at);
        match (out.last_mut(), prev) {
            (Some(last), Some(p)) if p.checked_add(1) == Some(pfn) => last.2 += n as usize,
            _ => out.push(((pfn << PAGE_SHIFT) + start, at as usize, n as usize)),
        }
        prev = Some(pfn);
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_runs_merge_consecutive_pages_only() {
        let t = Transfer {
            pfns: vec![5, 6, 9, 10],
            offset: 0x800,
            len: 0x3000,
        };
        assert_eq!(
            runs(&t),
            vec![(0x5800, 0, 0x1800), (0x9000, 0x1800, 0x1800)]
        );
    }
}
