//! What a scanout shows, as an image: the part of its resource SET_SCANOUT named, with the
//! cursor drawn on top (alpha-blended), as RGB for a PNG.

use std::io::Write;
use std::path::Path;

use super::protocol::{format_channels, Rect};
use super::state::{GpuState, Resource};

/// An RGB image (3 bytes per pixel, rows of `width × 3`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Pixels.
    pub rgb: Vec<u8>,
}

impl Image {
    /// The (R, G, B) of pixel (x, y), if inside.
    pub fn pixel(&self, x: u32, y: u32) -> Option<[u8; 3]> {
        if x >= self.width || y >= self.height {
            return None;
        }
        let at = (y as usize * self.width as usize + x as usize) * 3;
        Some([self.rgb[at], self.rgb[at + 1], self.rgb[at + 2]])
    }

    /// Encode as PNG into `out`.
    pub fn encode_png<W: Write>(&self, out: W) -> Result<(), png::EncodingError> {
        let mut enc = png::Encoder::new(out, self.width, self.height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.write_header()?.write_image_data(&self.rgb)
    }

    /// Write as a PNG file.
    pub fn write_png(&self, path: &Path) -> std::io::Result<()> {
        let file = std::io::BufWriter::new(std::fs::File::create(path)?);
        self.encode_png(file).map_err(std::io::Error::other)
    }
}

/// Why a scanout gives no picture ([`super::VirtioGpuHandle::screenshot_png`]).
#[derive(Debug, thiserror::Error)]
pub enum ShotError {
    /// The device has fewer scanouts.
    #[error("does not exist (the device has {0} scanouts)")]
    NoSuchScanout(usize),
    /// The guest has not set the scanout to a resource (or disabled it, or reset the
    /// device).
    #[error("shows nothing yet: the guest has not set it to a resource (SET_SCANOUT)")]
    Blank,
    /// Encoding failed (a bug).
    #[error("could not be encoded as PNG: {0}")]
    Encode(String),
}

/// A PNG file of `image`.
pub fn png_of(image: &Image) -> Result<Vec<u8>, ShotError> {
    // Filtered PNG rows compress a desktop to a small fraction of its RGB size.
    let mut out = Vec::with_capacity(image.rgb.len() / 4 + 1024);
    image
        .encode_png(&mut out)
        .map_err(|e| ShotError::Encode(e.to_string()))?;
    Ok(out)
}

/// `rect` (inside `r`) of resource `r` as RGBA.
pub(crate) fn to_rgba(r: &Resource, rect: Rect) -> Vec<u8> {
    let (rgb, alpha) = format_channels(r.format);
    let mut out = Vec::with_capacity(rect.width as usize * rect.height as usize * 4);
    let stride = r.stride() as usize;
    for y in rect.y..rect.y + rect.height {
        let row = y as usize * stride;
        for x in rect.x..rect.x + rect.width {
            let p = &r.data[row + x as usize * 4..row + x as usize * 4 + 4];
            out.extend_from_slice(&[p[rgb[0]], p[rgb[1]], p[rgb[2]], alpha.map_or(255, |a| p[a])]);
        }
    }
    out
}

/// What scanout `index` shows now, with the cursor; `None` if it shows nothing.
pub fn capture(state: &GpuState, index: usize) -> Option<Image> {
    let s = state.scanouts.get(index)?;
    let r = state.resources.get(&s.resource)?;
    if !s.rect.inside(r.width, r.height) {
        return None;
    }
    let rgba = to_rgba(r, s.rect);
    let (w, h) = (s.rect.width, s.rect.height);
    let mut rgb: Vec<u8> = rgba
        .chunks_exact(4)
        .flat_map(|p| [p[0], p[1], p[2]])
        .collect();
    let c = &state.cursor;
    if let (Some((size, img)), true) = (&c.image, c.scanout as usize == index) {
        let (ox, oy) = (
            i64::from(c.x) - i64::from(c.hot_x),
            i64::from(c.y) - i64::from(c.hot_y),
        );
        for cy in 0..*size {
            for cx in 0..*size {
                let (px, py) = (ox + i64::from(cx), oy + i64::from(cy));
                if px < 0 || py < 0 || px >= i64::from(w) || py >= i64::from(h) {
                    continue;
                }
                let src = &img[(cy * size + cx) as usize * 4..][..4];
                let a = u32::from(src[3]);
                let dst = &mut rgb[(py as usize * w as usize + px as usize) * 3..][..3];
                for k in 0..3 {
                    let v = (u32::from(src[k]) * a + u32::from(dst[k]) * (255 - a)) / 255;
                    dst[k] = v as u8;
                }
            }
        }
    }
    Some(Image {
        width: w,
        height: h,
        rgb,
    })
}
