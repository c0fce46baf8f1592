//! Descriptor chains of a split virtqueue: read each descriptor once, check the whole chain
//! (the rules are in the module docs of [`crate::virtio`]) and keep its buffers as two lists,
//! device-readable then device-writable.

use crate::dma::{DmaError, DmaHandle, Prot, PAGE_SHIFT};

use super::error::VirtioError;
use super::pinned_chain::PinnedChain;

/// Descriptor flag: the chain continues at `next`.
pub(crate) const VIRTQ_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the buffer is device-writable.
pub(crate) const VIRTQ_DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is a table of indirect descriptors.
pub(crate) const VIRTQ_DESC_F_INDIRECT: u16 = 4;
/// Bytes of one descriptor.
pub(crate) const DESC_SIZE: u64 = 16;

/// Most entries an indirect table may have (a 64 KiB table).
pub const MAX_INDIRECT_DESCRIPTORS: u32 = 4096;

/// One buffer of a chain: guest address (IOVA) and length (never 0, never wrapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
}

/// A checked descriptor chain taken from the avail ring (not pinned yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescChain {
    head: u16,
    readable: Vec<Segment>,
    writable: Vec<Segment>,
    readable_len: u64,
    writable_len: u64,
}

/// A descriptor as read from guest memory (little endian).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Desc {
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) flags: u16,
    pub(crate) next: u16,
}

impl Desc {
    pub(crate) fn parse(b: &[u8]) -> Desc {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[0..8]);
        Desc {
            addr: u64::from_le_bytes(a),
            len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            flags: u16::from_le_bytes([b[12], b[13]]),
            next: u16::from_le_bytes([b[14], b[15]]),
        }
    }
}

/// How the walk reads guest memory: `read(addr, buf)`.
pub(crate) type ReadMem<'a> = &'a mut dyn FnMut(u64, &mut [u8]) -> Result<(), DmaError>;

/// Where descriptors come from while walking: the ring's table in guest memory, or an
/// indirect table already copied out.
enum Table {
    Direct { base: u64, len: u32 },
    Indirect(Vec<u8>),
}

impl Table {
    fn len(&self) -> u32 {
        match self {
            Table::Direct { len, .. } => *len,
            // At most MAX_INDIRECT_DESCRIPTORS entries: fits.
            Table::Indirect(bytes) => (bytes.len() as u64 / DESC_SIZE) as u32,
        }
    }

    fn get(&self, index: u32, read: ReadMem<'_>) -> Result<Desc, VirtioError> {
        let len = self.len();
        if index >= len {
            return Err(VirtioError::IndexOutOfRange { index, len });
        }
        match self {
            Table::Direct { base, .. } => {
                let mut b = [0u8; DESC_SIZE as usize];
                // The table's range was checked when the queue was enabled.
                read(base + u64::from(index) * DESC_SIZE, &mut b)?;
                Ok(Desc::parse(&b))
            }
            Table::Indirect(bytes) => {
                let at = index as usize * DESC_SIZE as usize;
                Ok(Desc::parse(&bytes[at..at + DESC_SIZE as usize]))
            }
        }
    }
}

/// What the walk needs to know about the queue.
pub(crate) struct WalkParams {
    /// Guest address of the descriptor table.
    pub(crate) table: u64,
    /// Queue size (entries of the table).
    pub(crate) size: u16,
    /// `VIRTIO_RING_F_INDIRECT_DESC` was negotiated.
    pub(crate) indirect: bool,
    /// Limit on each direction's bytes.
    pub(crate) max_bytes: u64,
}

impl DescChain {
    /// Walk and check the chain starting at `head`, reading guest memory with `read`.
    pub(crate) fn walk(
        p: &WalkParams,
        head: u16,
        read: ReadMem<'_>,
    ) -> Result<DescChain, VirtioError> {
        let mut chain = DescChain {
            head,
            readable: Vec::new(),
            writable: Vec::new(),
            readable_len: 0,
            writable_len: 0,
        };
        let mut table = Table::Direct {
            base: p.table,
            len: u32::from(p.size),
        };
        let mut index = u32::from(head);
        let mut seen = 0u32;
        let mut in_indirect = false;
        loop {
            seen += 1;
            if seen > table.len() {
                return Err(VirtioError::ChainLoop { len: table.len() });
            }
            let d = table.get(index, read)?;
            if d.flags & VIRTQ_DESC_F_INDIRECT != 0 {
                if !p.indirect {
                    return Err(VirtioError::BadIndirect(
                        "VIRTIO_RING_F_INDIRECT_DESC not negotiated",
                    ));
                }
                if in_indirect {
                    return Err(VirtioError::BadIndirect("inside an indirect table"));
                }
                if d.flags & VIRTQ_DESC_F_NEXT != 0 {
                    return Err(VirtioError::BadIndirect("with NEXT"));
                }
                if d.len == 0 || u64::from(d.len) % DESC_SIZE != 0 {
                    return Err(VirtioError::BadIndirect(
                        "length not a non-zero multiple of 16",
                    ));
                }
                if u64::from(d.len) / DESC_SIZE > u64::from(MAX_INDIRECT_DESCRIPTORS) {
                    return Err(VirtioError::BadIndirect("table too large"));
                }
                check_wrap(d.addr, d.len)?;
                let mut bytes = vec![0u8; d.len as usize];
                read(d.addr, &mut bytes)?;
                table = Table::Indirect(bytes);
                in_indirect = true;
                index = 0;
                seen = 0;
                continue;
            }
            chain.push(&d, p.max_bytes)?;
            if d.flags & VIRTQ_DESC_F_NEXT == 0 {
                return Ok(chain);
            }
            index = u32::from(d.next);
        }
    }

    fn push(&mut self, d: &Desc, max: u64) -> Result<(), VirtioError> {
        let writable = d.flags & VIRTQ_DESC_F_WRITE != 0;
        if !writable && !self.writable.is_empty() {
            return Err(VirtioError::ReadableAfterWritable);
        }
        if d.len == 0 {
            return Ok(());
        }
        check_wrap(d.addr, d.len)?;
        let (list, total, what) = if writable {
            (&mut self.writable, &mut self.writable_len, "writable")
        } else {
            (&mut self.readable, &mut self.readable_len, "readable")
        };
        *total += u64::from(d.len);
        if *total > max {
            return Err(VirtioError::ChainTooLarge { what, max });
        }
        list.push(Segment {
            addr: d.addr,
            len: d.len,
        });
        Ok(())
    }

    /// The head descriptor index (what [`super::Virtqueue::add_used`] takes back).
    pub fn head(&self) -> u16 {
        self.head
    }

    /// The device-readable buffers, in chain order.
    pub fn readable(&self) -> &[Segment] {
        &self.readable
    }

    /// The device-writable buffers, in chain order.
    pub fn writable(&self) -> &[Segment] {
        &self.writable
    }

    /// Total device-readable bytes.
    pub fn readable_len(&self) -> u64 {
        self.readable_len
    }

    /// Total device-writable bytes.
    pub fn writable_len(&self) -> u64 {
        self.writable_len
    }

    /// Pin the readable buffers (one page array, readable) and the writable buffers
    /// (another, writable), one `pin_pages` call each; all or nothing.
    pub fn pin(&self, dma: &DmaHandle) -> Result<PinnedChain, DmaError> {
        PinnedChain::pin(dma, self)
    }
}

/// `[addr, addr + len)` must not wrap (len > 0).
fn check_wrap(addr: u64, len: u32) -> Result<(), VirtioError> {
    if len > 0 && addr.checked_add(u64::from(len) - 1).is_none() {
        return Err(VirtioError::BufferWraps { addr, len });
    }
    Ok(())
}

/// The IOVA page numbers under `segments`, in order (each segment's pages; a page shared by
/// two segments appears twice, which `pin_pages` counts twice).
pub(crate) fn pages_of(segments: &[Segment]) -> Vec<u64> {
    let mut pfns = Vec::new();
    for s in segments {
        // Checked not to wrap when the chain was walked; len > 0.
        let last = s.addr + (u64::from(s.len) - 1);
        pfns.extend((s.addr >> PAGE_SHIFT)..=(last >> PAGE_SHIFT));
    }
    pfns
}

/// Permission a side of a chain is pinned with.
pub(crate) fn side_prot(writable: bool) -> Prot {
    if writable {
        Prot::WRITE
    } else {
        Prot::READ
    }
}
