//! Copies between pinned page arrays, and [`PinnedPages`], the guard that makes them safe.
//!
//! A device that pins a scattered source and a scattered destination (a blit, a copy
//! engine, a block device's bounce) must work out, for every byte, which page of which
//! array it lies in: source and destination usually start at different page offsets, so
//! their page boundaries never line up. [`copy_pinned`] does that walk once, for everyone:
//!
//! - the source is the bytes `[src_offset, src_offset + len)` of the concatenation of the
//!   source pages, in array order (an offset may exceed a page: it just skips pages); the
//!   destination likewise;
//! - it copies in *segments*: each is as long as both sides stay contiguous in host memory,
//!   so pages that are consecutive in one mapping (what `pin_pages` coalesces into a run)
//!   are copied as one piece, not page by page;
//! - every segment is one volatile copy ([`VolatileSlice::copy_to_volatile_slice`]): the
//!   guest may write either side concurrently, so no `&[u8]` ever aliases it.
//!
//! Overlapping source and destination (the same guest page in both arrays) is memory-safe
//! but gives unspecified bytes there, as a concurrent guest write would.
//!
//! [`PinnedPages`] pins an array with one `pin_pages` call, remembers the permission it was
//! pinned with and unpins on drop, so that [`PinnedPages::copy_to`], [`PinnedPages::read`]
//! and [`PinnedPages::write`] are safe: the range is checked against the array, the
//! destination must be pinned writable (a write to a page mapped read-only would be a
//! SIGSEGV, the one device bug a test binary cannot survive), and the pages stay pinned for
//! as long as the guard lives.

use vm_memory::VolatileSlice;

use super::{DmaError, DmaHandle, Prot, PAGE_SIZE};

/// Bytes from `(page, in_page)` to the end of the host-contiguous run of `hosts` it lies in,
/// and the index of the page after that run.
fn run_bytes(hosts: &[u64], page: usize, in_page: u64) -> (u64, usize) {
    let mut end = page + 1;
    while end < hosts.len() && hosts[end - 1].checked_add(PAGE_SIZE) == Some(hosts[end]) {
        end += 1;
    }
    ((end - page) as u64 * PAGE_SIZE - in_page, end)
}

/// One side of a copy: a position in a page array and how far its run goes.
struct Cursor<'a> {
    hosts: &'a [u64],
    page: usize,
    in_page: u64,
    /// Contiguous bytes left from the position (0: look up the next run).
    left: u64,
}

impl<'a> Cursor<'a> {
    fn new(hosts: &'a [u64], offset: u64) -> Cursor<'a> {
        Cursor {
            hosts,
            page: (offset / PAGE_SIZE) as usize,
            in_page: offset % PAGE_SIZE,
            left: 0,
        }
    }

    /// Host address of the position and the contiguous bytes from there.
    fn here(&mut self) -> (u64, u64) {
        if self.left == 0 {
            self.left = run_bytes(self.hosts, self.page, self.in_page).0;
        }
        (self.hosts[self.page] + self.in_page, self.left)
    }

    fn advance(&mut self, n: u64) {
        self.left -= n;
        let pos = self.in_page + n;
        self.page += (pos / PAGE_SIZE) as usize;
        self.in_page = pos % PAGE_SIZE;
    }
}

/// The segments `(src host address, dst host address, bytes)` of a copy of `len` bytes from
/// `src_offset` in `src_hosts` to `dst_offset` in `dst_hosts` (see the module docs), or an
/// error if either range does not lie inside its array. Pure arithmetic: nothing is touched.
pub fn copy_segments(
    src_hosts: &[u64],
    src_offset: u64,
    dst_hosts: &[u64],
    dst_offset: u64,
    len: u64,
) -> Result<Vec<(u64, u64, u64)>, DmaError> {
    check_range(src_hosts.len(), src_offset, len)?;
    check_range(dst_hosts.len(), dst_offset, len)?;
    let mut out = Vec::new();
    if len == 0 {
        return Ok(out);
    }
    let (mut s, mut d) = (
        Cursor::new(src_hosts, src_offset),
        Cursor::new(dst_hosts, dst_offset),
    );
    let mut left = len;
    while left > 0 {
        let (sa, sn) = s.here();
        let (da, dn) = d.here();
        let n = left.min(sn).min(dn);
        out.push((sa, da, n));
        s.advance(n);
        d.advance(n);
        left -= n;
    }
    Ok(out)
}

/// `[offset, offset + len)` must lie inside `pages` pages.
fn check_range(pages: usize, offset: u64, len: u64) -> Result<(), DmaError> {
    let size = (pages as u64)
        .checked_mul(PAGE_SIZE)
        .ok_or(DmaError::Overflow {
            what: "pinned array size",
        })?;
    let end = offset.checked_add(len).ok_or(DmaError::Overflow {
        what: "pinned copy range",
    })?;
    if end > size {
        return Err(DmaError::InvalidArgument(
            "pinned copy range exceeds the pinned pages",
        ));
    }
    Ok(())
}

/// Copy `len` bytes from byte `src_offset` of the pages `src_hosts` to byte `dst_offset` of
/// the pages `dst_hosts`, one volatile copy per host-contiguous segment; returns the number
/// of segments. A range outside its array is an error and copies nothing.
///
/// [`PinnedPages::copy_to`] is the safe form; this one is for pins a device keeps in its own
/// tables (a GTT, a cache of pinned pages).
///
/// # Safety
/// Every address in `src_hosts` and `dst_hosts` must be a page `dma` returned from
/// `pin_pages`/`pin_range` (or a page of such a run), pinned until this call returns; the
/// pages of `dst_hosts` must have been pinned with write permission, those of `src_hosts`
/// with read permission.
pub unsafe fn copy_pinned(
    dma: &DmaHandle,
    src_hosts: &[u64],
    src_offset: u64,
    dst_hosts: &[u64],
    dst_offset: u64,
    len: u64,
) -> Result<usize, DmaError> {
    let segments = copy_segments(src_hosts, src_offset, dst_hosts, dst_offset, len)?;
    for &(src, dst, n) in &segments {
        // A segment lies inside one host-contiguous run of each array, so `n` fits usize.
        let n = n as usize;
        // SAFETY: the caller guarantees both arrays are pinned pages of `dma`'s space, and
        // `copy_segments` keeps each segment inside host-contiguous runs of pinned pages
        // (pages consecutive in one mapping are consecutive in host memory); the pins last
        // for the call. Only volatile copies touch them.
        let (from, to) = unsafe { (dma.pinned_slice(src, n), dma.pinned_slice(dst, n)) };
        from.copy_to_volatile_slice(to);
    }
    Ok(segments.len())
}

/// An array of guest pages pinned with one `pin_pages` call, unpinned on drop; what it
/// holds can be copied safely ([`PinnedPages::copy_to`], [`PinnedPages::read`],
/// [`PinnedPages::write`]).
///
/// Drop it (or call [`PinnedPages::unpin`]) before your unmap notifier returns for its
/// range: a pin left there is a device bug that umdev counts and takes back.
pub struct PinnedPages {
    dma: DmaHandle,
    pfns: Vec<u64>,
    hosts: Vec<u64>,
    prot: Prot,
}

impl std::fmt::Debug for PinnedPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPages")
            .field("pfns", &self.pfns)
            .field("prot", &self.prot)
            .finish()
    }
}

impl PinnedPages {
    /// Pin the IOVA pages `pfns` (any order, duplicates allowed; one `pin_pages` call, so
    /// coalesced and all-or-nothing) with `prot`.
    pub fn pin(dma: &DmaHandle, pfns: &[u64], prot: Prot) -> Result<PinnedPages, DmaError> {
        let mut hosts = vec![0u64; pfns.len()];
        dma.pin_pages(pfns, prot, &mut hosts)?;
        Ok(PinnedPages {
            dma: dma.clone(),
            pfns: pfns.to_vec(),
            hosts,
            prot,
        })
    }

    /// The IOVA page numbers, in the order given.
    pub fn pfns(&self) -> &[u64] {
        &self.pfns
    }

    /// The host address of each page (see `DmaHandle::pinned_slice` for what they allow).
    pub fn host_addrs(&self) -> &[u64] {
        &self.hosts
    }

    /// The permission the pages were pinned with.
    pub fn prot(&self) -> Prot {
        self.prot
    }

    /// Size in bytes: pages × [`PAGE_SIZE`].
    pub fn len(&self) -> u64 {
        self.hosts.len() as u64 * PAGE_SIZE
    }

    /// True if no page is pinned.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    fn need(&self, need: Prot) -> Result<(), DmaError> {
        if self.prot.allows(need) {
            return Ok(());
        }
        Err(DmaError::Permission {
            iova: self.pfns.first().map_or(0, |p| p << super::PAGE_SHIFT),
            need,
            have: self.prot,
        })
    }

    /// Copy `len` bytes from byte `offset` of these pages to byte `dst_offset` of `dst`
    /// (see [`copy_pinned`]); returns the number of segments copied. `self` must be pinned
    /// readable and `dst` writable (else `Permission`), both ranges must lie inside their
    /// arrays (else `InvalidArgument`); on error nothing is copied.
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &PinnedPages,
        dst_offset: u64,
        len: u64,
    ) -> Result<usize, DmaError> {
        self.need(Prot::READ)?;
        dst.need(Prot::WRITE)?;
        if !std::sync::Arc::ptr_eq(self.dma.space(), dst.dma.space()) {
            return Err(DmaError::InvalidArgument(
                "pinned copy between two DMA spaces",
            ));
        }
        // SAFETY: both arrays were pinned through `self.dma`'s space (checked above) and
        // stay pinned while the guards, borrowed for this call, live; the permissions were
        // checked above.
        unsafe { copy_pinned(&self.dma, &self.hosts, offset, &dst.hosts, dst_offset, len) }
    }

    /// Copy `buf.len()` bytes at byte `offset` of these pages into `buf` (pinned readable).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.need(Prot::READ)?;
        self.each_segment(offset, buf.len() as u64, |slice, at| {
            slice.copy_to(&mut buf[at..at + slice.len()]);
        })
    }

    /// Copy `data` to byte `offset` of these pages (pinned writable).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), DmaError> {
        self.need(Prot::WRITE)?;
        self.each_segment(offset, data.len() as u64, |slice, at| {
            slice.copy_from(&data[at..at + slice.len()]);
        })
    }

    /// Call `f(slice, position in the caller's buffer)` for each host-contiguous piece of
    /// `[offset, offset + len)`.
    fn each_segment(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(VolatileSlice<'_>, usize),
    ) -> Result<(), DmaError> {
        check_range(self.hosts.len(), offset, len)?;
        let mut cur = Cursor::new(&self.hosts, offset);
        let mut done = 0u64;
        while done < len {
            let (addr, run) = cur.here();
            let n = run.min(len - done);
            // SAFETY: `[addr, addr + n)` lies in a host-contiguous run of pages this guard
            // pinned through `self.dma` (range checked above), pinned while `self` lives.
            let slice = unsafe { self.dma.pinned_slice(addr, n as usize) };
            // `done` < len, which is the length of a caller's buffer: fits usize.
            f(slice, done as usize);
            cur.advance(n);
            done += n;
        }
        Ok(())
    }

    /// The host-contiguous pieces of `[offset, offset + len)` as `iovec`s (range checked).
    fn iovecs(&self, offset: u64, len: u64) -> Result<Vec<libc::iovec>, DmaError> {
        check_range(self.hosts.len(), offset, len)?;
        let mut cur = Cursor::new(&self.hosts, offset);
        let mut out = Vec::new();
        let mut done = 0u64;
        while done < len {
            let (addr, run) = cur.here();
            let n = run.min(len - done);
            out.push(libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: n as usize,
            });
            cur.advance(n);
            done += n;
        }
        Ok(out)
    }

    /// Read `len` bytes of `file` at `file_offset` straight into bytes `[offset, offset +
    /// len)` of these pages (pinned writable), with `preadv` on the host-contiguous pieces:
    /// no bounce buffer, one copy (the kernel's). A block device reads its image this way.
    /// End of file before `len` bytes is [`PinnedIoError::Io`] with `UnexpectedEof`.
    pub fn read_from_file(
        &self,
        file: &std::fs::File,
        file_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<(), PinnedIoError> {
        self.need(Prot::WRITE)?;
        let iov = self.iovecs(offset, len)?;
        // SAFETY: every iovec lies in pages these guards pinned writable through
        // `self.dma` (range checked by `iovecs`), pinned while `self`, borrowed for the
        // call, lives; the kernel writes them as a device would (no Rust reference to
        // them exists).
        unsafe { vectored_io(file, file_offset, iov, false) }
    }

    /// Write bytes `[offset, offset + len)` of these pages (pinned readable) to `file` at
    /// `file_offset` with `pwritev`, without a bounce buffer.
    pub fn write_to_file(
        &self,
        file: &std::fs::File,
        file_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<(), PinnedIoError> {
        self.need(Prot::READ)?;
        let iov = self.iovecs(offset, len)?;
        // SAFETY: as in `read_from_file`; the pages are pinned readable and only read.
        unsafe { vectored_io(file, file_offset, iov, true) }
    }

    /// Unpin now, reporting an error (a page already taken back by an unmap, for one).
    pub fn unpin(mut self) -> Result<(), DmaError> {
        let pfns = std::mem::take(&mut self.pfns);
        self.hosts.clear();
        self.dma.unpin_pages(&pfns)
    }
}

/// Why a [`PinnedPages`] file transfer failed: the request (range, permission) or the
/// file.
#[derive(Debug, thiserror::Error)]
pub enum PinnedIoError {
    /// The range or the permission: nothing was transferred.
    #[error(transparent)]
    Dma(#[from] DmaError),
    /// The file's read or write failed (some bytes may have moved).
    #[error("file I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// `preadv`/`pwritev` of all of `iov` at `offset`, resuming after short transfers
/// (at most `IOV_MAX` pieces per call).
///
/// # Safety
/// Every iovec must describe memory valid for the transfer's direction (written by a read,
/// read by a write) for the duration of the call.
unsafe fn vectored_io(
    file: &std::fs::File,
    mut offset: u64,
    mut iov: Vec<libc::iovec>,
    write: bool,
) -> Result<(), PinnedIoError> {
    use std::os::fd::AsRawFd;
    const IOV_MAX: usize = 1024;
    let mut first = 0usize;
    while first < iov.len() {
        let n = (iov.len() - first).min(IOV_MAX);
        let off = offset as libc::off_t;
        // SAFETY: the caller guarantees the iovecs; `iov[first..first + n]` is in bounds.
        let rc = unsafe {
            let p = iov.as_ptr().add(first);
            if write {
                libc::pwritev(file.as_raw_fd(), p, n as libc::c_int, off)
            } else {
                libc::preadv(file.as_raw_fd(), p, n as libc::c_int, off)
            }
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        if rc == 0 {
            return Err(std::io::Error::new(
                if write {
                    std::io::ErrorKind::WriteZero
                } else {
                    std::io::ErrorKind::UnexpectedEof
                },
                "file ended before the transfer did",
            )
            .into());
        }
        // Skip what moved: whole iovecs, then part of one.
        let mut moved = rc as usize;
        offset += moved as u64;
        while moved > 0 {
            let v = &mut iov[first];
            if moved >= v.iov_len {
                moved -= v.iov_len;
                first += 1;
            } else {
                v.iov_base = (v.iov_base as usize + moved) as *mut libc::c_void;
                v.iov_len -= moved;
                moved = 0;
            }
        }
    }
    Ok(())
}

impl Drop for PinnedPages {
    fn drop(&mut self) {
        if self.pfns.is_empty() {
            return;
        }
        if let Err(e) = self.dma.unpin_pages(&self.pfns) {
            tracing::warn!(
                "PinnedPages: unpin of {} pages failed: {e}",
                self.pfns.len()
            );
        }
    }
}

#[cfg(test)]
#[path = "pinned_copy_tests.rs"]
mod tests;
