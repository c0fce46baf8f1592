//! Data addresses → extents: direct addresses and indirect data address lists (IDAW lists).
//!
//! An IDAW list is an array of 8-byte guest addresses of 4 KiB pages. The first IDAW may
//! point anywhere inside a page (the transfer runs to the end of that page); every later
//! IDAW must be page aligned and contributes a whole page. The CCW count must fit inside
//! what the list covers.

use super::format::IDAW_PAGE_SIZE;
use super::status::Fault;

/// Most IDAWs one CCW may list. A 16-bit count needs at most 17 (a first IDAW at the last
/// byte of a page plus 16 full pages); 32 leaves room for generous drivers.
pub const MAX_IDAWS_PER_CCW: u32 = 32;

/// One guest-contiguous piece of a CCW's data area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Guest address of the first byte.
    pub iova: u64,
    /// Length in bytes (> 0).
    pub len: u32,
}

impl Extent {
    /// First and last guest page number (4 KiB pages) the extent touches.
    pub fn page_span(&self) -> (u64, u64) {
        let first = self.iova / IDAW_PAGE_SIZE;
        // `iova + len - 1` cannot overflow: extents are built with checked arithmetic.
        let last = (self.iova + u64::from(self.len) - 1) / IDAW_PAGE_SIZE;
        (first, last)
    }
}

/// The extent of a direct data address: `len` bytes at `addr`.
pub fn direct_extent(addr: u64, len: u32) -> Result<Extent, Fault> {
    if len == 0 {
        return Err(Fault::ZeroCount);
    }
    addr.checked_add(u64::from(len) - 1)
        .ok_or(Fault::DataAddressInvalid)?;
    Ok(Extent { iova: addr, len })
}

/// Validate an IDAW list against the CCW `count` and return the extents that transfer the
/// first `len` bytes (`len <= count`; SENSE transfers less than its count).
///
/// Checks, in order: every IDAW after the first is page aligned ([`Fault::IdawUnaligned`]);
/// the list covers `count` bytes ([`Fault::CountPastIdawList`]); no page wraps the address
/// space ([`Fault::DataAddressInvalid`]).
pub fn idaw_extents(idaws: &[u64], count: u32, len: u32) -> Result<Vec<Extent>, Fault> {
    let Some((&first, rest)) = idaws.split_first() else {
        return Err(Fault::IdawCountInvalid);
    };
    if count == 0 || len == 0 {
        return Err(Fault::ZeroCount);
    }
    if rest.iter().any(|&a| a & (IDAW_PAGE_SIZE - 1) != 0) {
        return Err(Fault::IdawUnaligned);
    }
    let first_room = IDAW_PAGE_SIZE - first % IDAW_PAGE_SIZE;
    let covered = first_room + (rest.len() as u64) * IDAW_PAGE_SIZE;
    if u64::from(count) > covered {
        return Err(Fault::CountPastIdawList);
    }
    let mut out = Vec::new();
    let mut left = u64::from(len.min(count));
    for (i, &addr) in idaws.iter().enumerate() {
        if left == 0 {
            break;
        }
        let room = if i == 0 { first_room } else { IDAW_PAGE_SIZE };
        let take = left.min(room);
        addr.checked_add(take - 1)
            .ok_or(Fault::DataAddressInvalid)?;
        // `take` ≤ 4096, so it fits in u32.
        out.push(Extent {
            iova: addr,
            len: take as u32,
        });
        left -= take;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_idaw_extents_mid_page_first_then_full_pages() {
        let ext = idaw_extents(&[0x1800, 0x5000, 0x9000], 8000, 8000).unwrap();
        assert_eq!(
            ext,
            vec![
                Extent {
                    iova: 0x1800,
                    len: 0x800
                },
                Extent {
                    iova: 0x5000,
                    len: 4096
                },
                Extent {
                    iova: 0x9000,
                    len: 8000 - 0x800 - 4096
                },
            ]
        );
    }

    #[test]
    fn test_idaw_extents_unaligned_later_idaw_rejected() {
        assert_eq!(
            idaw_extents(&[0x1000, 0x2008], 5000, 5000),
            Err(Fault::IdawUnaligned)
        );
    }

    #[test]
    fn test_idaw_extents_count_past_list_rejected() {
        assert_eq!(
            idaw_extents(&[0x1800, 0x3000], 0x800 + 4097, 10),
            Err(Fault::CountPastIdawList)
        );
        assert!(idaw_extents(&[0x1800, 0x3000], 0x800 + 4096, 10).is_ok());
    }

    #[test]
    fn test_idaw_extents_short_len_uses_prefix_only() {
        let ext = idaw_extents(&[0x1000, 0x3000], 8192, 32).unwrap();
        assert_eq!(
            ext,
            vec![Extent {
                iova: 0x1000,
                len: 32
            }]
        );
    }

    #[test]
    fn test_idaw_extents_wrapping_page_rejected() {
        assert_eq!(
            idaw_extents(&[u64::MAX - 0xfff], 4096, 4096).map(|e| e.len()),
            Ok(1)
        );
        assert_eq!(
            idaw_extents(&[0x1000, u64::MAX - 0xfff], 8192, 8192).map(|e| e.len()),
            Ok(2)
        );
        assert_eq!(direct_extent(u64::MAX, 2), Err(Fault::DataAddressInvalid));
    }

    #[test]
    fn test_idaw_extents_empty_list_rejected() {
        assert_eq!(idaw_extents(&[], 10, 10), Err(Fault::IdawCountInvalid));
    }

    #[test]
    fn test_extent_page_span_crossing_pages() {
        let e = Extent {
            iova: 0x1ff0,
            len: 0x20,
        };
        assert_eq!(e.page_span(), (1, 2));
    }
}
