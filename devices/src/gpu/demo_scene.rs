//! A recognisable scene drawn through the guest driver, for `umdev demo gpu` and examples:
//! a banded background (fills), a gradient surface blitted from scattered GTT pages, tiled
//! with overlapping copies, and a fence.

use std::io;

use super::commands::Command;
use super::driver::{Driver, GuestRam, RegisterAccess};

/// Width of the demo surface in pixels.
pub const SURFACE_W: u32 = 128;
/// Height of the demo surface in pixels.
pub const SURFACE_H: u32 = 128;
/// Guest pages the demo surface needs (128 × 128 × 4 bytes).
pub const SURFACE_PAGES: usize = (SURFACE_W * SURFACE_H * 4 / 4096) as usize;
/// First GTT entry the demo uses.
pub const GTT_START: u32 = 16;

/// Pixel (`x`, `y`) of the demo surface: a colour gradient with a diagonal stripe.
pub fn surface_pixel(x: u32, y: u32) -> u32 {
    let r = x * 255 / (SURFACE_W - 1);
    let g = y * 255 / (SURFACE_H - 1);
    let b = if (x + y) % 32 < 6 { 255 } else { 96 };
    (r << 16) | (g << 8) | b
}

/// What [`draw`] did, for printing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SceneSummary {
    /// Commands submitted.
    pub commands: usize,
    /// Fence value that completed the scene.
    pub fence: u32,
}

/// Draw the scene in a `width`×`height` mode (at least 160×160; the mode and ring must be
/// set up). The surface is written into `surface_pages` (guest pages, GTT order, at least
/// [`SURFACE_PAGES`]; scatter them to show the GTT at work) and mapped at [`GTT_START`].
pub fn draw<R: RegisterAccess>(
    drv: &mut Driver<R>,
    ram: &mut dyn GuestRam,
    surface_pages: &[u64],
    (width, height): (u32, u32),
) -> io::Result<SceneSummary> {
    if surface_pages.len() < SURFACE_PAGES || width < 160 || height < 160 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "demo scene: not enough surface pages or mode too small",
        ));
    }
    // Surface rows are 512 bytes: 8 rows per page.
    let row_bytes = (SURFACE_W * 4) as usize;
    let mut row = vec![0u8; row_bytes];
    for y in 0..SURFACE_H {
        for x in 0..SURFACE_W {
            row[x as usize * 4..x as usize * 4 + 4]
                .copy_from_slice(&surface_pixel(x, y).to_le_bytes());
        }
        let off = y as usize * row_bytes;
        ram.write(surface_pages[off / 4096] + (off % 4096) as u64, &row)?;
    }
    for (i, &page) in surface_pages[..SURFACE_PAGES].iter().enumerate() {
        drv.set_gtt(GTT_START + i as u32, page, false)?;
    }

    let mut cmds = Vec::new();
    let bands = 16;
    for i in 0..bands {
        let y0 = height * i / bands;
        let y1 = height * (i + 1) / bands;
        let shade = 0x10 + i * 6;
        cmds.push(Command::FillRect {
            x: 0,
            y: y0,
            w: width,
            h: y1 - y0,
            color: (shade << 16) | (shade << 8) | (shade + 0x20),
        });
    }
    let (x0, y0) = (width / 8, height / 8);
    cmds.push(Command::Blit {
        gtt_index: GTT_START,
        stride: SURFACE_W * 4,
        w: SURFACE_W,
        h: SURFACE_H,
        dst_x: x0,
        dst_y: y0,
    });
    // Tile it diagonally with overlapping copies (memmove semantics).
    let mut x = x0;
    let mut y = y0;
    while x + SURFACE_W + SURFACE_W / 2 <= width && y + SURFACE_H + SURFACE_H / 3 <= height {
        cmds.push(Command::CopyRect {
            src_x: x,
            src_y: y,
            dst_x: x + SURFACE_W / 2,
            dst_y: y + SURFACE_H / 3,
            w: SURFACE_W,
            h: SURFACE_H,
        });
        x += SURFACE_W / 2;
        y += SURFACE_H / 3;
    }
    // A frame.
    for (fx, fy, fw, fh) in [
        (0, 0, width, 4),
        (0, height - 4, width, 4),
        (0, 0, 4, height),
        (width - 4, 0, 4, height),
    ] {
        cmds.push(Command::FillRect {
            x: fx,
            y: fy,
            w: fw,
            h: fh,
            color: 0xff_c000,
        });
    }
    let fence = 0x5ce0e;
    cmds.push(Command::Fence { value: fence });
    drv.submit(ram, &cmds)?;
    drv.wait_fence(fence)?;
    Ok(SceneSummary {
        commands: cmds.len(),
        fence,
    })
}
