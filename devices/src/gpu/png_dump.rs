//! Framebuffer → PNG.

use std::io::Write;
use std::path::Path;

use super::framebuffer::Framebuffer;
use super::regs::Mode;

/// Errors of the PNG dump.
#[derive(Debug, thiserror::Error)]
pub enum PngError {
    /// The mode does not describe a valid image inside the framebuffer.
    #[error("mode {width}x{height} stride {stride} does not fit the framebuffer")]
    BadMode {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// Stride.
        stride: u32,
    },
    /// Creating the file failed.
    #[error("cannot create the PNG file")]
    Io(#[source] std::io::Error),
    /// The encoder failed.
    #[error("PNG encoding failed")]
    Encode(#[source] png::EncodingError),
}

/// Copy the visible XRGB8888 pixels of `mode` out of `fb` as RGB bytes (3 per pixel).
pub fn framebuffer_rgb(fb: &Framebuffer, mode: &Mode) -> Result<Vec<u8>, PngError> {
    let bad = || PngError::BadMode {
        width: mode.width,
        height: mode.height,
        stride: mode.stride,
    };
    if !mode.validate(fb.len() as u64) {
        return Err(bad());
    }
    let w = mode.width as usize;
    let mut row = vec![0u8; w * 4];
    let mut rgb = Vec::with_capacity(w * mode.height as usize * 3);
    for y in 0..mode.height as usize {
        if !fb.read(y * mode.stride as usize, &mut row) {
            return Err(bad());
        }
        for px in row.chunks_exact(4) {
            // XRGB8888 little-endian: B, G, R, X.
            rgb.extend_from_slice(&[px[2], px[1], px[0]]);
        }
    }
    Ok(rgb)
}

/// Encode the visible part of the framebuffer as an 8-bit RGB PNG into `out`.
pub fn encode_png<W: Write>(fb: &Framebuffer, mode: &Mode, out: W) -> Result<(), PngError> {
    let rgb = framebuffer_rgb(fb, mode)?;
    let mut enc = png::Encoder::new(out, mode.width, mode.height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header().map_err(PngError::Encode)?;
    writer.write_image_data(&rgb).map_err(PngError::Encode)?;
    writer.finish().map_err(PngError::Encode)
}

/// Write the visible part of the framebuffer to the PNG file `path`.
pub fn write_png(fb: &Framebuffer, mode: &Mode, path: &Path) -> Result<(), PngError> {
    let file = std::fs::File::create(path).map_err(PngError::Io)?;
    let mut out = std::io::BufWriter::new(file);
    encode_png(fb, mode, &mut out)?;
    out.flush().map_err(PngError::Io)
}
