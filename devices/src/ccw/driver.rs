//! Guest-driver helpers: build CCWs, IDAW lists and operation blocks, decode status.
//!
//! The CLI demo and the tests act as the guest driver with these, so there is one encoding
//! of every guest-visible structure (shared with the device's parser through
//! [`super::format`]).
//!
//! ```
//! use umdev_devices::ccw::driver::{self, CcwWord};
//! // Write 4 KiB from guest 0x10000, then read it back into 0x20000 through an IDAW list
//! // at 0x3000 that scatters it over two pages.
//! let program = driver::encode_program(&[
//!     CcwWord::write(4096, 0x10000).chain(),
//!     CcwWord::read(4096, 0x3000).ida(2),
//! ]);
//! let idaws = driver::encode_idaws(&[0x20800, 0x40000]);
//! assert_eq!(program.len(), 32);
//! assert_eq!(idaws.len(), 16);
//! ```

pub use super::format::{
    cmd, flags, opb_flags, CcwWord, OperationBlock, BLOCK_SIZE, CCW_SIZE, IDAW_PAGE_SIZE, OPB_SIZE,
    SENSE_SIZE,
};
pub use super::idal::MAX_IDAWS_PER_CCW;
pub use super::regs;
pub use super::status::{cstat, dstat, sense, Fault, StatusBlock, STATUS_BLOCK_SIZE};

impl CcwWord {
    /// READ `count` bytes into `addr`.
    pub fn read(count: u16, addr: u64) -> CcwWord {
        CcwWord::new(cmd::READ, count, addr)
    }

    /// WRITE `count` bytes from `addr`.
    pub fn write(count: u16, addr: u64) -> CcwWord {
        CcwWord::new(cmd::WRITE, count, addr)
    }

    /// SENSE into `addr` (`count` 32 avoids incorrect length).
    pub fn sense(count: u16, addr: u64) -> CcwWord {
        CcwWord::new(cmd::SENSE, count, addr)
    }

    /// NOP.
    pub fn nop() -> CcwWord {
        CcwWord::new(cmd::NOP, 0, 0)
    }

    /// TIC to the CCW at `target`.
    pub fn tic(target: u64) -> CcwWord {
        CcwWord::new(cmd::TIC, 0, target)
    }

    /// A CCW with the given command, count and address and no flags.
    pub fn new(cmd: u8, count: u16, addr: u64) -> CcwWord {
        CcwWord {
            cmd,
            flags: 0,
            count,
            idaw_count: 0,
            addr,
        }
    }

    /// Set chain-command.
    pub fn chain(mut self) -> CcwWord {
        self.flags |= flags::CC;
        self
    }

    /// Set chain-data.
    pub fn chain_data(mut self) -> CcwWord {
        self.flags |= flags::CD;
        self
    }

    /// Set arbitrary flag bits.
    pub fn with_flags(mut self, f: u8) -> CcwWord {
        self.flags |= f;
        self
    }

    /// Make the address an IDAW list of `entries` entries.
    pub fn ida(mut self, entries: u32) -> CcwWord {
        self.flags |= flags::IDA;
        self.idaw_count = entries;
        self
    }
}

/// Encode consecutive CCWs (place the result at an 8-byte aligned address).
pub fn encode_program(words: &[CcwWord]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_bytes()).collect()
}

/// Encode an IDAW list.
pub fn encode_idaws(addrs: &[u64]) -> Vec<u8> {
    addrs.iter().flat_map(|a| a.to_le_bytes()).collect()
}

/// Number of IDAWs needed to transfer `count` bytes starting at `first` (mid-page allowed).
pub fn idaws_needed(first: u64, count: u32) -> u32 {
    if count == 0 {
        return 0;
    }
    let span = first % IDAW_PAGE_SIZE + u64::from(count);
    span.div_ceil(IDAW_PAGE_SIZE) as u32
}

/// The IDAWs for `count` bytes starting at byte `offset` of `pages[0]` and continuing at the
/// start of each later page (`pages` are page-aligned guest addresses). Returns only the
/// entries the transfer needs; `None` if `pages` is too short.
pub fn idaws_over_pages(pages: &[u64], offset: u64, count: u32) -> Option<Vec<u64>> {
    let first = pages.first()?.checked_add(offset % IDAW_PAGE_SIZE)?;
    let n = idaws_needed(first, count) as usize;
    if n > pages.len() {
        return None;
    }
    let mut v = Vec::with_capacity(n);
    v.push(first);
    v.extend_from_slice(&pages[1..n]);
    Some(v)
}

/// Decode the LAST_STATUS register: (device status, channel status, fault).
pub fn decode_last_status(v: u32) -> (u8, u8, Option<Fault>) {
    (
        (v & 0xff) as u8,
        ((v >> 8) & 0xff) as u8,
        Fault::from_code((v >> 16) as u16),
    )
}

/// A reproducible test pattern for image contents, a function of the *image* byte position:
/// a guest driver fills its buffers with it before a WRITE, and whoever checks the result —
/// the guest after a READ, or the host reading the image file after the device stopped —
/// regenerates the same bytes from (seed, position) instead of copying them around.
/// Because every byte depends on its image position, data that lands at the wrong offset
/// (even by one byte) does not match.
pub mod pattern {
    /// One 64-bit word of the pattern: splitmix64 of the seed and the word's index.
    fn word(seed: u64, index: u64) -> u64 {
        let mut z = seed
            .wrapping_mul(0xd605_bbb5_8c8a_bb25)
            .wrapping_add(index)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The pattern byte at image byte offset `pos`.
    pub fn byte(seed: u64, pos: u64) -> u8 {
        word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize]
    }

    /// Fill `buf` with the pattern of image bytes `pos..pos + buf.len()`.
    pub fn fill(seed: u64, pos: u64, buf: &mut [u8]) {
        let mut at = pos;
        let mut rest = buf;
        while !rest.is_empty() {
            let bytes = word(seed, at / 8).to_le_bytes();
            let skip = (at % 8) as usize;
            let n = (8 - skip).min(rest.len());
            rest[..n].copy_from_slice(&bytes[skip..skip + n]);
            rest = &mut rest[n..];
            at = at.wrapping_add(n as u64);
        }
    }

    /// The index in `buf` of the first byte that differs from the pattern of image bytes
    /// `pos..`, or `None` if all match.
    pub fn first_mismatch(seed: u64, pos: u64, buf: &[u8]) -> Option<usize> {
        let mut want = [0u8; 4096];
        for (i, chunk) in buf.chunks(want.len()).enumerate() {
            let off = i * want.len();
            let want = &mut want[..chunk.len()];
            fill(seed, pos.wrapping_add(off as u64), want);
            if let Some(j) = chunk.iter().zip(want.iter()).position(|(a, b)| a != b) {
                return Some(off + j);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_builders_set_flags_and_fields() {
        let w = CcwWord::read(100, 0x5000).chain().ida(2);
        assert_eq!(w.cmd, cmd::READ);
        assert_eq!(w.flags, flags::CC | flags::IDA);
        assert_eq!(w.idaw_count, 2);
        assert_eq!(CcwWord::tic(0x40).addr, 0x40);
        assert_eq!(CcwWord::write(1, 0).chain_data().flags, flags::CD);
    }

    #[test]
    fn test_idaws_needed_counts_pages() {
        assert_eq!(idaws_needed(0x1000, 4096), 1);
        assert_eq!(idaws_needed(0x1fff, 2), 2);
        assert_eq!(idaws_needed(0x1800, 8192), 3);
        assert_eq!(idaws_needed(0, 0), 0);
    }

    #[test]
    fn test_idaws_over_pages_offsets_first_only() {
        let v = idaws_over_pages(&[0x10000, 0x30000, 0x20000], 0x100, 8192).unwrap();
        assert_eq!(v, vec![0x10100, 0x30000, 0x20000]);
        assert_eq!(idaws_over_pages(&[0x10000], 0x100, 8192), None);
    }

    #[test]
    fn test_decode_last_status_splits_fields() {
        let v = 0x0c | 0x20 << 8 | (Fault::TicToTic.code() as u32) << 16;
        assert_eq!(decode_last_status(v), (0x0c, 0x20, Some(Fault::TicToTic)));
    }

    #[test]
    fn test_encode_program_concatenates_words() {
        let p = encode_program(&[CcwWord::nop().chain(), CcwWord::tic(0x1000)]);
        assert_eq!(p.len(), 32);
        assert_eq!(p[16], cmd::TIC);
        assert_eq!(encode_idaws(&[1, 2])[8], 2);
    }

    #[test]
    fn test_pattern_fill_matches_byte_at_unaligned_positions() {
        let mut buf = [0u8; 37];
        pattern::fill(5, 1003, &mut buf);
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, pattern::byte(5, 1003 + i as u64));
        }
        assert_eq!(pattern::first_mismatch(5, 1003, &buf), None);
    }

    #[test]
    fn test_pattern_shifted_or_other_seed_mismatches() {
        let mut buf = vec![0u8; 10000];
        pattern::fill(1, 512, &mut buf);
        assert_eq!(pattern::first_mismatch(1, 513, &buf), Some(0));
        assert_eq!(pattern::first_mismatch(2, 512, &buf), Some(0));
        buf[9000] ^= 1;
        assert_eq!(pattern::first_mismatch(1, 512, &buf), Some(9000));
    }
}
