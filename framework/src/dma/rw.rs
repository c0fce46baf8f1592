//! `dma_rw`: copying between a device buffer and guest memory by IOVA.
//!
//! The range is walked region by region: each region contributes one chunk as large as it
//! allows (not page by page), after an overflow check of `iova + len` and a permission check
//! per region. fd-backed chunks are raw copies (`ptr::copy_nonoverlapping`) between the
//! caller's buffer and the shared mapping — no `&[u8]` ever aliases guest memory — with the
//! region's in-flight counter held so that unmap waits for the copy. fd-less chunks go to
//! the client as DMA_READ/DMA_WRITE in pieces of at most the negotiated max_data_xfer_size,
//! each piece counted in flight too: unmap waits for the piece on the wire and no piece is
//! sent for a region once unmap has removed it, so the client never gets a request for a
//! range after its DMA_UNMAP reply. (Waiting cannot deadlock: unmap cancels the pieces in
//! flight to the removed mappings through `RemoteDma::cancel`, see `mapping.rs`, so it
//! does not wait for a client that answers nothing until it has the unmap reply.) Writes
//! mark the written pages dirty after the copy.
//!
//! Both directions refuse before any lookup while Bus Master Enable is clear
//! ([`DmaError::BusMasterDisabled`]; for fd-less regions no message is sent).
//!
//! On error a prefix of the transfer may have been done (like the kernel's `vfio_dma_rw`).

use std::sync::Arc;

use super::region::Region;
use super::{DmaError, DmaSpace, Prot, RemoteDma};

impl DmaSpace {
    /// Walk `[iova, iova + len)` as (region, iova, offset into the buffer, length) chunks.
    fn for_each_chunk(
        &self,
        iova: u64,
        len: usize,
        need: Prot,
        mut f: impl FnMut(&Region, u64, usize, usize) -> Result<(), DmaError>,
    ) -> Result<(), DmaError> {
        if len == 0 {
            return Ok(());
        }
        iova.checked_add(len as u64).ok_or(DmaError::Overflow {
            what: "dma_rw iova + length",
        })?;
        let table = self.table.load();
        let mut done = 0usize;
        while done < len {
            let cur = iova + done as u64;
            let region = table.find(cur).ok_or(DmaError::NotMapped { iova: cur })?;
            if !region.prot.allows(need) {
                return Err(DmaError::Permission {
                    iova: cur,
                    need,
                    have: region.prot,
                });
            }
            let n = (len - done).min(usize::try_from(region.end - cur).unwrap_or(usize::MAX));
            f(region, cur, done, n)?;
            done += n;
        }
        Ok(())
    }

    /// The client path for fd-less mappings.
    fn remote(&self) -> Result<(Arc<dyn RemoteDma>, usize), DmaError> {
        let remote = self
            .remote
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(DmaError::Disconnected)?;
        let max = remote.max_xfer();
        if max == 0 {
            return Err(DmaError::InvalidArgument("max_data_xfer_size is 0"));
        }
        Ok((remote, max))
    }

    /// Copy guest memory at `iova` into `buf`.
    pub(crate) fn read_impl(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.check_bus_master(|| iova)?;
        let len = buf.len();
        self.for_each_chunk(iova, len, Prot::READ, |region, cur, off, n| {
            let dst = &mut buf[off..off + n];
            if region.is_fdless() {
                let (remote, max) = self.remote()?;
                for (k, piece) in dst.chunks_mut(max).enumerate() {
                    let at = cur + (k * max) as u64;
                    let _inflight = region.enter().ok_or(DmaError::NotMapped { iova: at })?;
                    remote.dma_read(at, piece)?;
                }
                return Ok(());
            }
            let _inflight = region.enter().ok_or(DmaError::NotMapped { iova: cur })?;
            let src = (region.host + (cur - region.iova)) as *const u8;
            // SAFETY: `src..src+n` lies inside the region's live mapping (cur + n <= end, and
            // the in-flight guard keeps unmap from releasing it); `dst` is the caller's buffer
            // of length n; the two cannot overlap (the buffer is Rust memory, the mapping a
            // client mmap). A raw copy: no reference to guest memory is created.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), n) };
            Ok(())
        })
    }

    /// Copy `data` into guest memory at `iova`.
    pub(crate) fn write_impl(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        self.check_bus_master(|| iova)?;
        self.for_each_chunk(iova, data.len(), Prot::WRITE, |region, cur, off, n| {
            let src = &data[off..off + n];
            if region.is_fdless() {
                let (remote, max) = self.remote()?;
                for (k, piece) in src.chunks(max).enumerate() {
                    let at = cur + (k * max) as u64;
                    let _inflight = region.enter().ok_or(DmaError::NotMapped { iova: at })?;
                    remote.dma_write(at, piece)?;
                }
            } else {
                let _inflight = region.enter().ok_or(DmaError::NotMapped { iova: cur })?;
                let dst = (region.host + (cur - region.iova)) as *mut u8;
                // SAFETY: `dst..dst+n` lies inside the region's live, writable mapping
                // (permission checked, cur + n <= end, in-flight guard held); `src` is the
                // caller's slice of length n; distinct memory. Raw copy into shared memory.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, n) };
            }
            self.mark_dirty(region, cur, n as u64);
            Ok(())
        })
    }
}
