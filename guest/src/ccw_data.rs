//! Data of the ccw scenarios: a transfer scattered over buffer pages (what an IDAW list
//! describes) and the checks of bytes against `driver::pattern`.

use std::io;

use umdev_devices::ccw::driver::{self, pattern};

use crate::mem::{DmaBuf, PAGE};
use crate::report::Report;

/// A transfer's bytes over buffer pages in IDAW order: the first piece starts `first_off`
/// bytes into `pages[0]`, every later piece is a whole page (the last one partial).
pub struct Scatter<'a> {
    /// The buffer.
    pub buf: &'a DmaBuf,
    /// Buffer page indices, in transfer order.
    pub pages: Vec<usize>,
    /// Offset of the first byte in the first page.
    pub first_off: usize,
    /// Transfer length in bytes.
    pub len: usize,
}

impl Scatter<'_> {
    /// (buffer offset, length) of each piece, in transfer order.
    pub fn pieces(&self) -> io::Result<Vec<(usize, usize)>> {
        let mut v = Vec::new();
        let mut left = self.len;
        for (i, &pg) in self.pages.iter().enumerate() {
            if left == 0 {
                break;
            }
            let start = if i == 0 { self.first_off % PAGE } else { 0 };
            let n = (PAGE - start).min(left);
            v.push((pg * PAGE + start, n));
            left -= n;
        }
        if left > 0 {
            return Err(io::Error::other("transfer longer than its pages"));
        }
        Ok(v)
    }

    /// The IDAW list (only the entries the transfer needs), from the driver's encoder.
    pub fn idaws(&self) -> io::Result<Vec<u64>> {
        let addrs: Vec<u64> = self.pages.iter().map(|&k| self.buf.addr(k)).collect();
        driver::idaws_over_pages(&addrs, self.first_off as u64, self.len as u32)
            .ok_or_else(|| io::Error::other("not enough pages for the IDAW list"))
    }

    /// Put the pattern of image bytes `pos..pos + len` into the pieces.
    pub fn fill_pattern(&self, seed: u64, pos: u64) -> io::Result<()> {
        let mut data = vec![0u8; self.len];
        pattern::fill(seed, pos, &mut data);
        self.write(&data)
    }

    /// Write `data` (the whole transfer) into the pieces.
    pub fn write(&self, data: &[u8]) -> io::Result<()> {
        let mut at = 0;
        for (off, n) in self.pieces()? {
            self.buf.write_at(off, &data[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    /// Fill the pieces with `byte`.
    pub fn fill(&self, byte: u8) -> io::Result<()> {
        self.write(&vec![byte; self.len])
    }

    /// The transfer's bytes, gathered from the pieces.
    pub fn read(&self) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        let mut at = 0;
        for (off, n) in self.pieces()? {
            self.buf.read_at(off, &mut out[at..at + n])?;
            at += n;
        }
        Ok(out)
    }
}

/// Check that `data` is the pattern of image bytes `pos..` for `seed`.
pub fn expect_pattern(r: &mut Report, name: &str, data: &[u8], seed: u64, pos: u64) -> bool {
    match pattern::first_mismatch(seed, pos, data) {
        None => r.check(
            name,
            true,
            format_args!("{} bytes match the pattern", data.len()),
        ),
        Some(i) => r.check(
            name,
            false,
            format_args!(
                "byte {i} of {} (image offset {}) is {:#04x}, want {:#04x}",
                data.len(),
                pos + i as u64,
                data[i],
                pattern::byte(seed, pos + i as u64)
            ),
        ),
    }
}

/// Check that every byte of `data` is `byte` (memory the device must not have touched).
pub fn expect_untouched(r: &mut Report, name: &str, data: &[u8], byte: u8) -> bool {
    match data.iter().position(|&b| b != byte) {
        None => r.check(
            name,
            true,
            format_args!("{} bytes still {byte:#04x}", data.len()),
        ),
        Some(i) => r.check(
            name,
            false,
            format_args!(
                "byte {i} of {} changed to {:#04x} (was {byte:#04x})",
                data.len(),
                data[i]
            ),
        ),
    }
}

/// How many of `buf`'s pages do not follow their predecessor physically (0: contiguous).
pub fn physical_breaks(buf: &DmaBuf) -> usize {
    (1..buf.pages())
        .filter(|&k| buf.addr(k) != buf.addr(k - 1) + PAGE as u64)
        .count()
}
