//! Command encoding: what the guest writes into the ring, one [`Command`] at a time.
//!
//! A command is a sequence of little-endian 32-bit dwords. The first dword is the header:
//! bits 31..24 opcode, bits 23..16 reserved (ignored), bits 15..0 length in dwords including
//! the header. The same code encodes (guest driver, tests, demo) and decodes (device).

use super::error::GpuError;

/// Opcode: do nothing.
pub const OP_NOP: u8 = 0x00;
/// Opcode: fill a rectangle of the framebuffer with one color.
pub const OP_FILL_RECT: u8 = 0x01;
/// Opcode: copy a rectangle inside the framebuffer (overlap handled like memmove).
pub const OP_COPY_RECT: u8 = 0x02;
/// Opcode: copy a surface from GTT-mapped guest pages into the framebuffer.
pub const OP_BLIT: u8 = 0x03;
/// Opcode: write the fence register and raise `IRQ_FENCE`.
pub const OP_FENCE: u8 = 0x04;
/// Opcode: copy a framebuffer rectangle out to a surface in GTT-mapped guest pages.
pub const OP_READBACK: u8 = 0x05;

/// One ring command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// No operation.
    Nop,
    /// Fill `w`×`h` pixels at (`x`, `y`) with `color` (XRGB8888).
    FillRect {
        /// Left.
        x: u32,
        /// Top.
        y: u32,
        /// Width.
        w: u32,
        /// Height.
        h: u32,
        /// Pixel value.
        color: u32,
    },
    /// Copy `w`×`h` pixels from (`src_x`, `src_y`) to (`dst_x`, `dst_y`).
    CopyRect {
        /// Source left.
        src_x: u32,
        /// Source top.
        src_y: u32,
        /// Destination left.
        dst_x: u32,
        /// Destination top.
        dst_y: u32,
        /// Width.
        w: u32,
        /// Height.
        h: u32,
    },
    /// Copy a `w`×`h` surface whose first byte is at the start of GTT entry `gtt_index`
    /// (rows `stride` bytes apart, in GTT-linear address space) to (`dst_x`, `dst_y`).
    Blit {
        /// First GTT entry of the surface.
        gtt_index: u32,
        /// Bytes between surface rows.
        stride: u32,
        /// Width in pixels.
        w: u32,
        /// Height in pixels.
        h: u32,
        /// Destination left.
        dst_x: u32,
        /// Destination top.
        dst_y: u32,
    },
    /// Set `FENCE_VALUE` to `value` and raise `IRQ_FENCE`.
    Fence {
        /// The value.
        value: u32,
    },
    /// Copy `w`×`h` framebuffer pixels at (`src_x`, `src_y`) to a surface starting at GTT
    /// entry `gtt_index` (rows `stride` bytes apart). The entries need `GTT_WRITABLE`.
    Readback {
        /// Source left.
        src_x: u32,
        /// Source top.
        src_y: u32,
        /// Width.
        w: u32,
        /// Height.
        h: u32,
        /// First GTT entry of the destination surface.
        gtt_index: u32,
        /// Bytes between surface rows.
        stride: u32,
    },
}

/// Build a header dword.
pub fn header(opcode: u8, len_dwords: u16) -> u32 {
    (u32::from(opcode) << 24) | u32::from(len_dwords)
}

/// Length in dwords (header included) of each known opcode.
pub fn opcode_len(opcode: u8) -> Option<u32> {
    match opcode {
        OP_NOP => Some(1),
        OP_FILL_RECT => Some(6),
        OP_COPY_RECT => Some(7),
        OP_BLIT => Some(7),
        OP_FENCE => Some(2),
        OP_READBACK => Some(7),
        _ => None,
    }
}

/// Why decoding failed, and whether the command can be skipped.
#[derive(Debug)]
pub struct DecodeError {
    /// The error reported to the guest.
    pub error: GpuError,
    /// Dwords to skip to reach the next command, if the length field is usable.
    pub skip: Option<usize>,
}

impl Command {
    /// The opcode.
    pub fn opcode(&self) -> u8 {
        match self {
            Command::Nop => OP_NOP,
            Command::FillRect { .. } => OP_FILL_RECT,
            Command::CopyRect { .. } => OP_COPY_RECT,
            Command::Blit { .. } => OP_BLIT,
            Command::Fence { .. } => OP_FENCE,
            Command::Readback { .. } => OP_READBACK,
        }
    }

    /// Length in dwords including the header.
    pub fn len_dwords(&self) -> usize {
        // Every opcode produced by `opcode()` has a length.
        opcode_len(self.opcode()).unwrap_or(1) as usize
    }

    /// Append the encoded dwords to `out`.
    pub fn encode(&self, out: &mut Vec<u32>) {
        out.push(header(self.opcode(), self.len_dwords() as u16));
        match *self {
            Command::Nop => {}
            Command::FillRect { x, y, w, h, color } => out.extend([x, y, w, h, color]),
            Command::CopyRect {
                src_x,
                src_y,
                dst_x,
                dst_y,
                w,
                h,
            } => out.extend([src_x, src_y, dst_x, dst_y, w, h]),
            Command::Blit {
                gtt_index,
                stride,
                w,
                h,
                dst_x,
                dst_y,
            } => out.extend([gtt_index, stride, w, h, dst_x, dst_y]),
            Command::Fence { value } => out.push(value),
            Command::Readback {
                src_x,
                src_y,
                w,
                h,
                gtt_index,
                stride,
            } => out.extend([src_x, src_y, w, h, gtt_index, stride]),
        }
    }

    /// Encode a list of commands into little-endian bytes.
    pub fn encode_bytes(cmds: &[Command]) -> Vec<u8> {
        let mut dw = Vec::new();
        for c in cmds {
            c.encode(&mut dw);
        }
        dw.iter().flat_map(|d| d.to_le_bytes()).collect()
    }

    /// Decode the command at the start of `dwords` (everything published up to the tail).
    /// Returns the command and its length in dwords.
    pub fn decode(dwords: &[u32]) -> Result<(Command, usize), DecodeError> {
        let Some(&hdr) = dwords.first() else {
            return Err(DecodeError {
                error: GpuError::Truncated { len: 0, avail: 0 },
                skip: None,
            });
        };
        let opcode = (hdr >> 24) as u8;
        let len = hdr & 0xffff;
        if len == 0 || len as usize > dwords.len() {
            return Err(DecodeError {
                error: GpuError::Truncated {
                    len,
                    avail: dwords.len(),
                },
                skip: None,
            });
        }
        let skip = Some(len as usize);
        let Some(expected) = opcode_len(opcode) else {
            return Err(DecodeError {
                error: GpuError::BadOpcode(opcode),
                skip,
            });
        };
        if expected != len {
            return Err(DecodeError {
                error: GpuError::BadLength { opcode, len },
                skip,
            });
        }
        let a = &dwords[1..len as usize];
        let cmd = match opcode {
            OP_NOP => Command::Nop,
            OP_FILL_RECT => Command::FillRect {
                x: a[0],
                y: a[1],
                w: a[2],
                h: a[3],
                color: a[4],
            },
            OP_COPY_RECT => Command::CopyRect {
                src_x: a[0],
                src_y: a[1],
                dst_x: a[2],
                dst_y: a[3],
                w: a[4],
                h: a[5],
            },
            OP_BLIT => Command::Blit {
                gtt_index: a[0],
                stride: a[1],
                w: a[2],
                h: a[3],
                dst_x: a[4],
                dst_y: a[5],
            },
            OP_FENCE => Command::Fence { value: a[0] },
            _ => Command::Readback {
                src_x: a[0],
                src_y: a[1],
                w: a[2],
                h: a[3],
                gtt_index: a[4],
                stride: a[5],
            },
        };
        Ok((cmd, len as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Command> {
        vec![
            Command::Nop,
            Command::FillRect {
                x: 1,
                y: 2,
                w: 3,
                h: 4,
                color: 0xff00ff,
            },
            Command::CopyRect {
                src_x: 1,
                src_y: 2,
                dst_x: 3,
                dst_y: 4,
                w: 5,
                h: 6,
            },
            Command::Blit {
                gtt_index: 7,
                stride: 64,
                w: 16,
                h: 8,
                dst_x: 9,
                dst_y: 10,
            },
            Command::Fence { value: 42 },
            Command::Readback {
                src_x: 1,
                src_y: 2,
                w: 3,
                h: 4,
                gtt_index: 5,
                stride: 6,
            },
        ]
    }

    #[test]
    fn test_command_encode_decode_roundtrip_is_identity() {
        for c in all() {
            let mut dw = Vec::new();
            c.encode(&mut dw);
            assert_eq!(dw.len(), c.len_dwords());
            let (d, len) = Command::decode(&dw).unwrap();
            assert_eq!((d, len), (c, dw.len()));
        }
    }

    #[test]
    fn test_decode_unknown_opcode_is_skippable() {
        let e = Command::decode(&[header(0x77, 3), 0, 0]).unwrap_err();
        assert!(matches!(e.error, GpuError::BadOpcode(0x77)));
        assert_eq!(e.skip, Some(3));
    }

    #[test]
    fn test_decode_wrong_length_is_skippable() {
        let e = Command::decode(&[header(OP_FENCE, 3), 1, 2]).unwrap_err();
        assert!(matches!(e.error, GpuError::BadLength { .. }));
        assert_eq!(e.skip, Some(3));
    }

    #[test]
    fn test_decode_zero_or_overlong_length_is_not_skippable() {
        let e = Command::decode(&[header(OP_NOP, 0)]).unwrap_err();
        assert!(matches!(e.error, GpuError::Truncated { .. }));
        assert_eq!(e.skip, None);
        let e = Command::decode(&[header(OP_FILL_RECT, 6), 1, 2]).unwrap_err();
        assert!(matches!(e.error, GpuError::Truncated { .. }));
        assert_eq!(e.skip, None);
        assert!(Command::decode(&[]).is_err());
    }
}
