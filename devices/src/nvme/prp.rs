//! PRP entries → one page array.
//!
//! A command names its data with PRP1, PRP2 and, for more than two pages, PRP lists in
//! guest memory (NVMe 1.4 section 4.3; SGLs are not supported, SGLS = 0). Every entry is a
//! guest address the guest chose, so every rule is checked:
//!
//! - PRP1 may start anywhere in a page, but dword aligned (else PRP Offset Invalid);
//! - every later data page starts at offset 0 (PRP2 when it is the second page, and every
//!   list entry; else PRP Offset Invalid);
//! - PRP2 as a list pointer may have a dword-aligned offset; the last entry of a list page
//!   that is not the last needed entry points to the next list page (page aligned);
//! - a list page the controller cannot read (not mapped, Bus Master off) is a Data
//!   Transfer Error;
//! - a transfer longer than MDTS is Invalid Field in Command.
//!
//! The result is a [`Transfer`]: the IOVA page numbers in data order (the array the DMA
//! layer pins with one `pin_pages` call, coalescing consecutive pages into runs) and the
//! byte offset of the data in the first page. Nothing here pins or touches the data.

use umdev::dma::{DmaError, PAGE_SHIFT, PAGE_SIZE};

use super::spec::Status;

/// The data of one command as a page array.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transfer {
    /// IOVA page numbers, in data order.
    pub pfns: Vec<u64>,
    /// Offset of the first byte in the first page.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Why a PRP walk failed.
#[derive(Debug, thiserror::Error)]
pub enum PrpError {
    /// An entry has an offset the rules forbid.
    #[error("PRP entry {entry:#x} has an invalid offset")]
    Offset {
        /// The entry.
        entry: u64,
    },
    /// The transfer is longer than MDTS allows.
    #[error("transfer of {len} bytes exceeds MDTS ({max} bytes)")]
    TooLong {
        /// Bytes asked for.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A PRP list page could not be read.
    #[error("PRP list page at {addr:#x} is unreadable")]
    List {
        /// Address of the list read.
        addr: u64,
        /// The cause.
        #[source]
        source: DmaError,
    },
    /// An address computation overflowed.
    #[error("PRP address overflow")]
    Overflow,
}

impl PrpError {
    /// The completion status the spec gives this failure.
    pub fn status(&self) -> Status {
        match self {
            PrpError::Offset { .. } => Status::PRP_OFFSET_INVALID,
            PrpError::TooLong { .. } => Status::INVALID_FIELD,
            PrpError::List { .. } => Status::DATA_TRANSFER_ERROR,
            PrpError::Overflow => Status::INVALID_FIELD,
        }
    }
}

/// Walk PRP1/PRP2 for `len` bytes (at most `max_len`), reading PRP lists with
/// `read(iova, buf)`.
pub fn walk(
    prp1: u64,
    prp2: u64,
    len: u64,
    max_len: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), DmaError>,
) -> Result<Transfer, PrpError> {
    if len > max_len {
        return Err(PrpError::TooLong { len, max: max_len });
    }
    if len == 0 {
        return Ok(Transfer::default());
    }
    if prp1 & 3 != 0 {
        return Err(PrpError::Offset { entry: prp1 });
    }
    let offset = prp1 % PAGE_SIZE;
    let end = offset.checked_add(len).ok_or(PrpError::Overflow)?;
    let pages = end.div_ceil(PAGE_SIZE);
    let mut pfns = Vec::with_capacity(pages as usize);
    pfns.push(prp1 >> PAGE_SHIFT);
    if pages == 2 {
        if !prp2.is_multiple_of(PAGE_SIZE) {
            return Err(PrpError::Offset { entry: prp2 });
        }
        pfns.push(prp2 >> PAGE_SHIFT);
    } else if pages > 2 {
        if prp2 & 3 != 0 {
            return Err(PrpError::Offset { entry: prp2 });
        }
        read_list(prp2, pages - 1, &mut pfns, &mut read)?;
    }
    Ok(Transfer { pfns, offset, len })
}

/// Append `needed` data pages from the PRP list at `list` to `pfns`.
fn read_list(
    mut list: u64,
    mut needed: u64,
    pfns: &mut Vec<u64>,
    read: &mut impl FnMut(u64, &mut [u8]) -> Result<(), DmaError>,
) -> Result<(), PrpError> {
    let mut buf = Vec::new();
    while needed > 0 {
        let slots = (PAGE_SIZE - list % PAGE_SIZE) / 8;
        // All remaining entries fit in this page, or the last slot chains to the next.
        let (data_entries, chained) = if needed <= slots {
            (needed, false)
        } else {
            (slots - 1, true)
        };
        let entries = data_entries + u64::from(chained);
        buf.resize(entries as usize * 8, 0);
        read(list, &mut buf).map_err(|source| PrpError::List { addr: list, source })?;
        let mut words = buf
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
        for entry in words.by_ref().take(data_entries as usize) {
            if entry % PAGE_SIZE != 0 {
                return Err(PrpError::Offset { entry });
            }
            pfns.push(entry >> PAGE_SHIFT);
        }
        needed -= data_entries;
        if chained {
            let next = words.next().ok_or(PrpError::Overflow)?;
            if next % PAGE_SIZE != 0 {
                return Err(PrpError::Offset { entry: next });
            }
            list = next;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Guest memory as a map of 8-byte words; unmapped words fail like an unmapped IOVA.
    fn mem(words: &[(u64, u64)]) -> impl FnMut(u64, &mut [u8]) -> Result<(), DmaError> {
        let m: HashMap<u64, u64> = words.iter().copied().collect();
        move |iova, buf| {
            for (i, c) in buf.chunks_mut(8).enumerate() {
                let a = iova + i as u64 * 8;
                let v = m.get(&a).ok_or(DmaError::NotMapped { iova: a })?;
                c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
            }
            Ok(())
        }
    }

    const MAX: u64 = 1 << 20;

    #[test]
    fn test_walk_single_page_with_offset() {
        let t = walk(0x5010, 0, 0x100, MAX, mem(&[])).unwrap();
        assert_eq!((t.pfns, t.offset, t.len), (vec![5], 0x10, 0x100));
    }

    #[test]
    fn test_walk_two_pages_uses_prp2_directly() {
        let t = walk(0x5800, 0x9000, 0x1000, MAX, mem(&[])).unwrap();
        assert_eq!(t.pfns, vec![5, 9]);
        let e = walk(0x5800, 0x9008, 0x1000, MAX, mem(&[])).unwrap_err();
        assert_eq!(e.status(), Status::PRP_OFFSET_INVALID);
    }

    #[test]
    fn test_walk_list_with_chain_to_next_page() {
        // A list starting 16 bytes before its page's end: one data entry, then a chain.
        let list = 0x7ff0;
        let t = walk(
            0x1000,
            list,
            4 * 4096,
            MAX,
            mem(&[
                (0x7ff0, 0x2000),
                (0x7ff8, 0xa000),
                (0xa000, 0x3000),
                (0xa008, 0x4000),
            ]),
        )
        .unwrap();
        assert_eq!(t.pfns, vec![1, 2, 3, 4]);
    }

    #[test]
    fn test_walk_rejects_bad_entries_and_unreadable_lists() {
        let e = walk(0x1002, 0, 16, MAX, mem(&[])).unwrap_err();
        assert_eq!(e.status(), Status::PRP_OFFSET_INVALID);
        let e = walk(0x1000, 0x8000, 3 * 4096, MAX, mem(&[(0x8000, 0x2000)])).unwrap_err();
        assert_eq!(e.status(), Status::DATA_TRANSFER_ERROR);
        let e = walk(
            0x1000,
            0x8000,
            3 * 4096,
            MAX,
            mem(&[(0x8000, 0x2000), (0x8008, 0x3004)]),
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::PRP_OFFSET_INVALID);
        let e = walk(0x1000, 0x8000, MAX + 1, MAX, mem(&[])).unwrap_err();
        assert_eq!(e.status(), Status::INVALID_FIELD);
    }

    #[test]
    fn test_walk_zero_length_is_empty() {
        assert_eq!(walk(3, 3, 0, MAX, mem(&[])).unwrap(), Transfer::default());
    }
}
