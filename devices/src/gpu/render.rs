//! The drawing operations: fill, copy, blit and readback, with overflow-proof bounds checks
//! against the current mode.

use super::error::GpuError;
use super::framebuffer::Framebuffer;
use super::regs::Mode;

/// Bytes per pixel of XRGB8888.
const BPP: u64 = 4;

/// A linear surface in GTT address space (the pages behind it are pinned by the caller).
pub trait Surface {
    /// Copy `buf.len()` bytes at surface offset `off` into `buf`; false if out of range.
    fn read(&self, off: u64, buf: &mut [u8]) -> bool;
    /// Copy `data` to surface offset `off`; false if out of range.
    fn write(&self, off: u64, data: &[u8]) -> bool;
}

/// Check that the `w`×`h` rectangle at (`x`, `y`) lies inside the mode (u64 arithmetic,
/// so no sum can wrap).
pub fn check_rect(mode: &Mode, x: u32, y: u32, w: u32, h: u32) -> Result<(), GpuError> {
    let fits = u64::from(x) + u64::from(w) <= u64::from(mode.width)
        && u64::from(y) + u64::from(h) <= u64::from(mode.height);
    if fits {
        Ok(())
    } else {
        Err(GpuError::OutOfBounds)
    }
}

/// Byte offset of pixel (`x`, `y`); only call for a pixel inside a validated mode.
fn pixel_offset(mode: &Mode, x: u32, y: u32) -> usize {
    (u64::from(y) * u64::from(mode.stride) + u64::from(x) * BPP) as usize
}

/// Number of GTT pages a `w`×`h` surface with `stride` spans (0 for an empty surface).
pub fn surface_pages(stride: u32, w: u32, h: u32) -> Result<u32, GpuError> {
    if w == 0 || h == 0 {
        return Ok(0);
    }
    let row = u64::from(w) * BPP;
    if u64::from(stride) < row {
        return Err(GpuError::BadStride { stride, width: w });
    }
    // (h - 1) * stride + row < 2^32 * 2^32 + 2^34: fits u64.
    let span = u64::from(h - 1) * u64::from(stride) + row;
    let pages = span.div_ceil(umdev::dma::PAGE_SIZE);
    u32::try_from(pages).map_err(|_| GpuError::GttRange)
}

/// FILL_RECT.
pub fn fill_rect(
    fb: &Framebuffer,
    mode: &Mode,
    (x, y, w, h): (u32, u32, u32, u32),
    color: u32,
) -> Result<(), GpuError> {
    check_rect(mode, x, y, w, h)?;
    let row_buf: Vec<u8> = std::iter::repeat_n(color.to_le_bytes(), w as usize)
        .flatten()
        .collect();
    for row in 0..h {
        if !fb.write(pixel_offset(mode, x, y + row), &row_buf) {
            return Err(GpuError::OutOfBounds);
        }
    }
    Ok(())
}

/// COPY_RECT, memmove semantics: rows are visited so that no source row is overwritten
/// before it is read, and each row is read whole before it is written.
pub fn copy_rect(
    fb: &Framebuffer,
    mode: &Mode,
    (src_x, src_y): (u32, u32),
    (dst_x, dst_y): (u32, u32),
    (w, h): (u32, u32),
) -> Result<(), GpuError> {
    check_rect(mode, src_x, src_y, w, h)?;
    check_rect(mode, dst_x, dst_y, w, h)?;
    let mut row_buf = vec![0u8; w as usize * BPP as usize];
    let mut copy_row = |row: u32| -> Result<(), GpuError> {
        let src = pixel_offset(mode, src_x, src_y + row);
        let dst = pixel_offset(mode, dst_x, dst_y + row);
        if fb.read(src, &mut row_buf) && fb.write(dst, &row_buf) {
            Ok(())
        } else {
            Err(GpuError::OutOfBounds)
        }
    };
    if dst_y > src_y {
        for row in (0..h).rev() {
            copy_row(row)?;
        }
    } else {
        for row in 0..h {
            copy_row(row)?;
        }
    }
    Ok(())
}

/// BLIT: surface rows `stride` bytes apart → framebuffer at (`dst_x`, `dst_y`).
pub fn blit(
    fb: &Framebuffer,
    mode: &Mode,
    src: &dyn Surface,
    stride: u32,
    (w, h): (u32, u32),
    (dst_x, dst_y): (u32, u32),
) -> Result<(), GpuError> {
    check_rect(mode, dst_x, dst_y, w, h)?;
    let mut row_buf = vec![0u8; w as usize * BPP as usize];
    for row in 0..h {
        let src_off = u64::from(row) * u64::from(stride);
        let dst = pixel_offset(mode, dst_x, dst_y + row);
        if !src.read(src_off, &mut row_buf) {
            return Err(GpuError::GttRange);
        }
        if !fb.write(dst, &row_buf) {
            return Err(GpuError::OutOfBounds);
        }
    }
    Ok(())
}

/// READBACK: framebuffer rectangle at (`src_x`, `src_y`) → surface rows `stride` apart.
pub fn readback(
    fb: &Framebuffer,
    mode: &Mode,
    (src_x, src_y): (u32, u32),
    (w, h): (u32, u32),
    dst: &dyn Surface,
    stride: u32,
) -> Result<(), GpuError> {
    check_rect(mode, src_x, src_y, w, h)?;
    let mut row_buf = vec![0u8; w as usize * BPP as usize];
    for row in 0..h {
        let src = pixel_offset(mode, src_x, src_y + row);
        if !fb.read(src, &mut row_buf) {
            return Err(GpuError::OutOfBounds);
        }
        if !dst.write(u64::from(row) * u64::from(stride), &row_buf) {
            return Err(GpuError::GttRange);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(w: u32, h: u32) -> Mode {
        Mode {
            width: w,
            height: h,
            stride: w * 4,
            enabled: true,
            ..Mode::reset_value()
        }
    }

    #[test]
    fn test_check_rect_overflowing_sum_is_out_of_bounds() {
        let m = mode(100, 100);
        assert!(check_rect(&m, u32::MAX, 0, 2, 1).is_err());
        assert!(check_rect(&m, 0, u32::MAX, 1, u32::MAX).is_err());
        assert!(check_rect(&m, 99, 99, 1, 1).is_ok());
        assert!(check_rect(&m, 99, 99, 2, 1).is_err());
        assert!(check_rect(&m, 100, 0, 0, 0).is_ok());
    }

    #[test]
    fn test_surface_pages_counts_partial_pages() {
        assert_eq!(surface_pages(4096, 1024, 2).unwrap(), 2);
        assert_eq!(surface_pages(4096, 1, 2).unwrap(), 2);
        assert_eq!(surface_pages(64, 16, 64).unwrap(), 1);
        assert_eq!(surface_pages(64, 16, 65).unwrap(), 2);
        assert_eq!(surface_pages(0, 0, 5).unwrap(), 0);
        assert!(matches!(
            surface_pages(60, 16, 1),
            Err(GpuError::BadStride { .. })
        ));
        assert!(surface_pages(u32::MAX, 1, u32::MAX).is_err());
    }
}
