//! The command ring in guest memory: fetching the published bytes `[head, tail)`.
//!
//! The ring is `size` bytes (a power of two) at guest IOVA `base`; `head` and `tail` are
//! byte offsets below `size`, multiples of 4. The published bytes are read with at most two
//! multi-page `DmaHandle::read` calls (two when they wrap past the ring's end).

use umdev::dma::{DmaError, DmaHandle};

use super::regs::RingRegs;

/// Number of published bytes between `head` and `tail` (the ring is full at `size - 4`).
pub fn published_bytes(ring: &RingRegs) -> usize {
    let mask = ring.size.wrapping_sub(1);
    (ring.tail.wrapping_sub(ring.head) & mask) as usize
}

/// Read the published commands `[head, tail)` as little-endian dwords into `out`.
/// `ring` must have passed [`RingRegs::validate`] and have head/tail below its size.
pub fn fetch(dma: &DmaHandle, ring: &RingRegs, out: &mut Vec<u32>) -> Result<(), DmaError> {
    out.clear();
    let avail = published_bytes(ring);
    if avail == 0 {
        return Ok(());
    }
    let mut bytes = vec![0u8; avail];
    let head = ring.head as usize;
    let first = avail.min(ring.size as usize - head);
    let (a, b) = bytes.split_at_mut(first);
    // base + size does not wrap (validated), so base + head cannot either.
    dma.read(ring.base + head as u64, a)?;
    if !b.is_empty() {
        dma.read(ring.base, b)?;
    }
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_published_bytes_wraps() {
        let r = RingRegs {
            base: 0,
            size: 4096,
            enabled: true,
            head: 4000,
            tail: 8,
        };
        assert_eq!(published_bytes(&r), 96 + 8);
        let empty = RingRegs { tail: 4000, ..r };
        assert_eq!(published_bytes(&empty), 0);
    }
}
