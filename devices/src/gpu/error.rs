//! Errors of the GPU and the `ERROR_CODE` values the guest sees for them.

use umdev::dma::DmaError;

/// `ERROR_CODE`: no error.
pub const ERR_NONE: u32 = 0;
/// `ERROR_CODE`: unknown command opcode (the command is skipped using its length field).
pub const ERR_BAD_OPCODE: u32 = 1;
/// `ERROR_CODE`: the length field does not match the opcode (the command is skipped).
pub const ERR_BAD_LENGTH: u32 = 2;
/// `ERROR_CODE`: a rectangle lies (partly) outside the framebuffer mode.
pub const ERR_OUT_OF_BOUNDS: u32 = 3;
/// `ERROR_CODE`: a drawing command arrived while no mode is enabled.
pub const ERR_MODE_DISABLED: u32 = 4;
/// `ERROR_CODE`: the ring memory could not be read (not mapped / not readable, or the guest
/// has cleared Bus Master Enable, so the device may not read guest memory at all).
pub const ERR_RING_FAULT: u32 = 5;
/// `ERROR_CODE`: a surface uses a GTT entry without the VALID bit.
pub const ERR_GTT_INVALID: u32 = 6;
/// `ERROR_CODE`: a GTT-mapped page could not be pinned (not mapped, not writable, or Bus
/// Master Enable cleared after the command was fetched).
pub const ERR_GTT_FAULT: u32 = 7;
/// `ERROR_CODE`: READBACK into a GTT entry without the WRITABLE bit.
pub const ERR_GTT_READONLY: u32 = 8;
/// `ERROR_CODE`: a surface stride is smaller than its row.
pub const ERR_BAD_STRIDE: u32 = 9;
/// `ERROR_CODE`: RING_CTRL enable with an invalid base/size (see the docs).
pub const ERR_RING_CONFIG: u32 = 10;
/// `ERROR_CODE`: MODE_CTRL enable with a mode that does not fit the framebuffer.
pub const ERR_MODE_INVALID: u32 = 11;
/// `ERROR_CODE`: RING_TAIL write that is not 4-byte aligned, not below RING_SIZE, or made
/// while the ring is disabled.
pub const ERR_BAD_TAIL: u32 = 12;
/// `ERROR_CODE`: a command's length runs past the published tail, or is 0 (the rest of the
/// published commands is dropped).
pub const ERR_TRUNCATED: u32 = 13;
/// `ERROR_CODE`: a surface runs past the last GTT entry.
pub const ERR_GTT_RANGE: u32 = 14;

/// Why a command (or a register write) failed. Each maps to one `ERROR_CODE`.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// Unknown opcode.
    #[error("unknown opcode {0:#x}")]
    BadOpcode(u8),
    /// Length field wrong for the opcode.
    #[error("opcode {opcode:#x} with length {len} dwords")]
    BadLength {
        /// The opcode.
        opcode: u8,
        /// The length field.
        len: u32,
    },
    /// Command runs past the published tail (or has length 0).
    #[error("command truncated: length {len} dwords, {avail} published")]
    Truncated {
        /// The length field.
        len: u32,
        /// Dwords published from the command's start to the tail.
        avail: usize,
    },
    /// Rectangle outside the mode.
    #[error("rectangle out of bounds")]
    OutOfBounds,
    /// No mode enabled.
    #[error("no mode enabled")]
    ModeDisabled,
    /// Ring memory unreadable.
    #[error("ring memory unreadable")]
    RingFault(#[source] DmaError),
    /// GTT entry not valid.
    #[error("GTT entry {0} is not valid")]
    GttInvalid(u32),
    /// GTT entry without the WRITABLE bit used as a destination.
    #[error("GTT entry {0} is not writable")]
    GttReadOnly(u32),
    /// Pinning the GTT pages failed.
    #[error("pinning GTT entries {start}..{end} failed")]
    GttFault {
        /// First entry of the failed range.
        start: u32,
        /// One past the last entry.
        end: u32,
        /// The DMA layer's error.
        #[source]
        source: DmaError,
    },
    /// The surface runs past the GTT.
    #[error("surface runs past the GTT")]
    GttRange,
    /// Stride smaller than a row.
    #[error("stride {stride} smaller than a row of {width} pixels")]
    BadStride {
        /// The stride in bytes.
        stride: u32,
        /// The width in pixels.
        width: u32,
    },
}

impl GpuError {
    /// The message with its causes, for logs (e.g. the DMA layer's hint to use a shared
    /// memfd memory backend when a pinned page is fd-less).
    pub fn report(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }

    /// The `ERROR_CODE` the guest sees.
    pub fn code(&self) -> u32 {
        match self {
            GpuError::BadOpcode(_) => ERR_BAD_OPCODE,
            GpuError::BadLength { .. } => ERR_BAD_LENGTH,
            GpuError::Truncated { .. } => ERR_TRUNCATED,
            GpuError::OutOfBounds => ERR_OUT_OF_BOUNDS,
            GpuError::ModeDisabled => ERR_MODE_DISABLED,
            GpuError::RingFault(_) => ERR_RING_FAULT,
            GpuError::GttInvalid(_) => ERR_GTT_INVALID,
            GpuError::GttReadOnly(_) => ERR_GTT_READONLY,
            GpuError::GttFault { .. } => ERR_GTT_FAULT,
            GpuError::GttRange => ERR_GTT_RANGE,
            GpuError::BadStride { .. } => ERR_BAD_STRIDE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_report_includes_dma_cause() {
        let e = GpuError::GttFault {
            start: 1,
            end: 3,
            source: DmaError::NotMapped { iova: 0x5000 },
        };
        let r = e.report();
        assert!(r.starts_with("pinning GTT entries 1..3 failed: "), "{r}");
        assert!(r.contains("0x5000"), "{r}");
        assert_eq!(e.code(), ERR_GTT_FAULT);
    }
}
