//! A 128-byte EDID 1.4 base block whose preferred (and only) detailed timing is a scanout's
//! resolution at 60 Hz, for GET_EDID. Timings use fixed blanking (160 × 35), enough for a
//! virtual display: the guest only reads the active size from it.

/// Largest width or height an EDID detailed timing holds (12 bits).
pub const EDID_MAX_DIM: u32 = 4095;

/// The EDID of a `width` × `height` display (each 1..=[`EDID_MAX_DIM`], clamped).
pub fn edid(width: u32, height: u32) -> [u8; 128] {
    let w = width.clamp(1, EDID_MAX_DIM);
    let h = height.clamp(1, EDID_MAX_DIM);
    let mut e = [0u8; 128];
    e[..8].copy_from_slice(&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]);
    // Manufacturer "UMD" (5-bit letters, big endian), product 1, no serial, 2025.
    e[8..10].copy_from_slice(&[0x55, 0xa4]);
    e[10] = 1;
    e[17] = 35;
    e[18] = 1;
    e[19] = 4;
    e[20] = 0x80; // digital input
                  // Physical size at 96 dpi, in cm and mm.
    let mm = |px: u32| px * 254 / 960;
    let (wmm, hmm) = (mm(w), mm(h));
    e[21] = (wmm / 10).min(255) as u8;
    e[22] = (hmm / 10).min(255) as u8;
    e[23] = 120; // gamma 2.2
    e[24] = 0x06; // sRGB, preferred timing is native
    e[25..35].copy_from_slice(&[0xee, 0x91, 0xa3, 0x54, 0x4c, 0x99, 0x26, 0x0f, 0x50, 0x54]);
    for k in 0..8 {
        e[38 + 2 * k] = 1;
        e[39 + 2 * k] = 1; // unused standard timing
    }
    let (hb, vb) = (160u32, 35u32);
    // Pixel clock in 10 kHz units at 60 Hz; 60 Hz for 4095 × 4095 fits 16 bits.
    let clock = ((u64::from(w + hb) * u64::from(h + vb) * 60) / 10_000).min(0xffff) as u16;
    let d = &mut e[54..72];
    d[0..2].copy_from_slice(&clock.to_le_bytes());
    d[2] = w as u8;
    d[3] = hb as u8;
    d[4] = (((w >> 8) & 0xf) << 4 | ((hb >> 8) & 0xf)) as u8;
    d[5] = h as u8;
    d[6] = vb as u8;
    d[7] = (((h >> 8) & 0xf) << 4 | ((vb >> 8) & 0xf)) as u8;
    d[8] = 48; // h sync offset
    d[9] = 32; // h sync width
    d[10] = (3 << 4) | 5; // v sync offset, width
    d[12] = wmm as u8;
    d[13] = hmm as u8;
    d[14] = (((wmm >> 8) & 0xf) << 4 | ((hmm >> 8) & 0xf)) as u8;
    d[17] = 0x18; // digital separate sync
                  // Monitor name, then two dummy descriptors.
    e[72..77].copy_from_slice(&[0, 0, 0, 0xfc, 0]);
    let name = b"umdev virtio\n";
    e[77..90].copy_from_slice(name);
    for base in [90, 108] {
        e[base + 3] = 0x10;
    }
    let sum = e[..127].iter().fold(0u8, |a, b| a.wrapping_add(*b));
    e[127] = 0u8.wrapping_sub(sum);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_edid_checksum_and_preferred_timing_hold_the_size() {
        for (w, h) in [(1280, 800), (1920, 1080), (4095, 4095), (1, 1)] {
            let e = edid(w, h);
            assert_eq!(e.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0, "checksum");
            let d = &e[54..72];
            let hw = u32::from(d[2]) | (u32::from(d[4] >> 4) << 8);
            let vh = u32::from(d[5]) | (u32::from(d[7] >> 4) << 8);
            assert_eq!((hw, vh), (w, h));
            assert_ne!(u16::from_le_bytes([d[0], d[1]]), 0, "a DTD needs a clock");
        }
    }
}
