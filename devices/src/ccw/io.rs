//! Execution of a validated, pinned program: the image I/O goes straight between the backing
//! file and the pinned guest pages (`pread`/`pwrite` into the pages' host addresses, merged
//! into one syscall wherever consecutive pages are host-contiguous). Guest memory is never
//! turned into a Rust slice: the kernel (or a raw copy for SENSE) touches it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use umdev::dma::PAGE_SIZE;

use super::format::SENSE_SIZE;
use super::idal::Extent;
use super::pins::PinnedPages;
use super::program::{Op, Program, Step};
use super::status::{sense, Fault};

/// The device's sense bytes (what SENSE transfers).
pub type SenseData = [u8; SENSE_SIZE];

/// Build the sense bytes describing a unit check: byte 0 flags, byte 1 the fault code,
/// bytes 8..16 the image offset involved.
pub fn unit_check_sense(fault: Fault, image_offset: u64) -> SenseData {
    let mut s = [0u8; SENSE_SIZE];
    s[0] = match fault {
        Fault::ImageIo => sense::EQUIPMENT_CHECK,
        _ => sense::COMMAND_REJECT,
    };
    // Fault codes are < 256.
    s[1] = fault.code() as u8;
    s[8..16].copy_from_slice(&image_offset.to_le_bytes());
    s
}

/// How a program's execution ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// `Fault::None` on success.
    pub fault: Fault,
    /// Address of the last CCW executed (the failing one on error).
    pub ccw_addr: u64,
    /// Residual count of that CCW.
    pub residual: u16,
    /// Bytes moved between the image/sense data and guest memory.
    pub transferred: u64,
    /// Image offset involved in a unit check.
    pub image_offset: u64,
}

/// One host-contiguous piece of a step's transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunk {
    host: u64,
    len: usize,
}

/// Split `extent` into host-contiguous chunks given its pages' host addresses.
fn chunks(extent: &Extent, hosts: &[u64], out: &mut Vec<Chunk>) {
    out.clear();
    let mut left = extent.len as usize;
    let mut in_page = (extent.iova % PAGE_SIZE) as usize;
    for &h in hosts {
        if left == 0 {
            break;
        }
        let len = left.min(PAGE_SIZE as usize - in_page);
        let host = h + in_page as u64;
        match out.last_mut() {
            Some(c) if c.host + c.len as u64 == host => c.len += len,
            _ => out.push(Chunk { host, len }),
        }
        left -= len;
        in_page = 0;
    }
}

/// Execute `program` against `image`. `sense` is transferred by SENSE (and cleared after);
/// `aborted` is polled between chunks.
pub fn execute(
    program: &Program,
    pinned: &PinnedPages,
    image: &File,
    sense: &mut SenseData,
    aborted: &dyn Fn() -> bool,
) -> Completion {
    let mut done = Completion {
        fault: Fault::None,
        ccw_addr: 0,
        residual: 0,
        transferred: 0,
        image_offset: 0,
    };
    let mut scratch = Vec::new();
    for (si, step) in program.steps.iter().enumerate() {
        done.ccw_addr = step.ccw_addr;
        done.residual = step.residual;
        let mut moved: u64 = 0;
        let res = run_step(
            si,
            step,
            pinned,
            image,
            sense,
            aborted,
            &mut scratch,
            &mut moved,
        );
        done.transferred += moved;
        if let Err((fault, image_offset)) = res {
            done.fault = fault;
            // `moved` ≤ count for READ/WRITE, so the difference fits the 16-bit count.
            done.residual = u64::from(step.count).saturating_sub(moved) as u16;
            done.image_offset = image_offset;
            return done;
        }
    }
    if program.incorrect_length {
        done.fault = Fault::IncorrectLength;
    }
    done
}

#[allow(clippy::too_many_arguments)]
fn run_step(
    si: usize,
    step: &Step,
    pinned: &PinnedPages,
    image: &File,
    sense_data: &mut SenseData,
    aborted: &dyn Fn() -> bool,
    scratch: &mut Vec<Chunk>,
    moved: &mut u64,
) -> Result<(), (Fault, u64)> {
    let mut file_off = step.image_offset;
    let mut sense_off = 0usize;
    for (ei, extent) in step.extents.iter().enumerate() {
        let (first, last) = extent.page_span();
        let npages = (last - first + 1) as usize;
        let hosts = pinned
            .hosts(si, ei, npages)
            .ok_or((Fault::Aborted, file_off))?;
        chunks(extent, hosts, scratch);
        for c in scratch.iter() {
            if aborted() {
                return Err((Fault::Aborted, file_off));
            }
            match step.op {
                Op::Read => {
                    // SAFETY: `c` lies inside pages pinned with WRITE permission by
                    // `pinned` (alive for this call); pin_pages guarantees each host address
                    // is valid for PAGE_SIZE bytes until unpinned, and `chunks` never
                    // crosses a page unless the next page is host-contiguous.
                    unsafe { pread_into(image, c.host, c.len, file_off) }
                        .map_err(|_| (Fault::ImageIo, file_off))?;
                    file_off += c.len as u64;
                }
                Op::Write => {
                    // SAFETY: as above, pages pinned with READ permission.
                    unsafe { pwrite_from(image, c.host, c.len, file_off) }
                        .map_err(|_| (Fault::ImageIo, file_off))?;
                    file_off += c.len as u64;
                }
                Op::Sense => {
                    let end = sense_off + c.len;
                    let src = sense_data
                        .get(sense_off..end)
                        .ok_or((Fault::Aborted, file_off))?;
                    // SAFETY: `c` lies inside pages `pinned` holds pinned writable for the
                    // whole call (see above), which is what `pinned_slice` requires.
                    let dst = unsafe { pinned.dma().pinned_slice(c.host, c.len) };
                    dst.copy_from(src);
                    sense_off = end;
                }
                Op::Nop => {}
            }
            *moved += c.len as u64;
        }
    }
    if step.op == Op::Sense {
        *sense_data = [0; SENSE_SIZE];
    }
    Ok(())
}

/// `pread` exactly `len` bytes at `off` into host memory at `host`; bytes past the end of
/// the file read as zero.
///
/// # Safety
/// `[host, host + len)` must be writable memory that stays mapped for the call.
unsafe fn pread_into(image: &File, host: u64, len: usize, off: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let pos = off
            .checked_add(done as u64)
            .and_then(|p| libc::off_t::try_from(p).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let ptr = (host as usize + done) as *mut libc::c_void;
        // SAFETY: the caller guarantees the destination range is writable; the kernel
        // writes at most `len - done` bytes into it.
        let n = unsafe { libc::pread(image.as_raw_fd(), ptr, len - done, pos) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            // End of file (the image shrank under us): the rest reads as zeros.
            // SAFETY: same destination range as above.
            unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len - done) };
            return Ok(());
        }
        done += n as usize;
    }
    Ok(())
}

/// `pwrite` exactly `len` bytes from host memory at `host` to `off`.
///
/// # Safety
/// `[host, host + len)` must be readable memory that stays mapped for the call.
unsafe fn pwrite_from(image: &File, host: u64, len: usize, off: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let pos = off
            .checked_add(done as u64)
            .and_then(|p| libc::off_t::try_from(p).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let ptr = (host as usize + done) as *const libc::c_void;
        // SAFETY: the caller guarantees the source range is readable; the kernel reads at
        // most `len - done` bytes from it.
        let n = unsafe { libc::pwrite(image.as_raw_fd(), ptr, len - done, pos) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_chunks_merge_host_contiguous_pages() {
        let e = Extent {
            iova: 0x1800,
            len: 0x800 + 4096 + 100,
        };
        let mut out = Vec::new();
        chunks(&e, &[0x10000, 0x11000, 0x50000], &mut out);
        assert_eq!(
            out,
            vec![
                Chunk {
                    host: 0x10800,
                    len: 0x800 + 4096
                },
                Chunk {
                    host: 0x50000,
                    len: 100
                }
            ]
        );
    }

    #[test]
    fn test_unit_check_sense_encodes_fault_and_offset() {
        let s = unit_check_sense(Fault::OutOfRange, 0x1234);
        assert_eq!(s[0], sense::COMMAND_REJECT);
        assert_eq!(s[1], Fault::OutOfRange.code() as u8);
        assert_eq!(&s[8..16], &0x1234u64.to_le_bytes());
        assert_eq!(
            unit_check_sense(Fault::ImageIo, 0)[0],
            sense::EQUIPMENT_CHECK
        );
    }

    #[test]
    fn test_pread_into_past_eof_zero_fills() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 10]).unwrap();
        let mut buf = vec![0xffu8; 32];
        // SAFETY: `buf` is a local, writable 32-byte buffer.
        unsafe { pread_into(&f, buf.as_mut_ptr() as u64, 32, 4) }.unwrap();
        assert_eq!(&buf[..6], &[7u8; 6]);
        assert!(buf[6..].iter().all(|&b| b == 0));
    }
}
