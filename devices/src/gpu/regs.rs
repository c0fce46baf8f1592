//! BAR0 register layout of the GPU (offsets, bits, reset values) and the register file the
//! connection thread and the worker share.
//!
//! The layout is documented for guest-driver authors in `protocol-docs/devices/gpu.md`; the
//! constants here are the single source both the device and [`super::driver`] use.

/// Size of BAR0 (registers, GTT window, MSI-X table and PBA).
pub const BAR0_SIZE: u64 = 64 * 1024;

/// `ID`: read-only magic, the bytes "UGPU" in little-endian order.
pub const REG_ID: u64 = 0x000;
/// `VERSION`: read-only, `major << 16 | minor`.
pub const REG_VERSION: u64 = 0x004;
/// `FB_SIZE`: read-only size of the BAR2 framebuffer in bytes.
pub const REG_FB_SIZE: u64 = 0x008;
/// `GTT_ENTRIES`: read-only number of GTT entries.
pub const REG_GTT_ENTRIES: u64 = 0x00c;
/// `MAX_WIDTH`: read-only largest accepted mode width.
pub const REG_MAX_WIDTH: u64 = 0x010;
/// `MAX_HEIGHT`: read-only largest accepted mode height.
pub const REG_MAX_HEIGHT: u64 = 0x014;
/// `STATUS`: read-only device state (`STATUS_*` bits).
pub const REG_STATUS: u64 = 0x018;

/// `MODE_WIDTH`: visible width in pixels.
pub const REG_MODE_WIDTH: u64 = 0x100;
/// `MODE_HEIGHT`: visible height in pixels.
pub const REG_MODE_HEIGHT: u64 = 0x104;
/// `MODE_STRIDE`: bytes from one framebuffer row to the next.
pub const REG_MODE_STRIDE: u64 = 0x108;
/// `MODE_FORMAT`: pixel format (`FORMAT_*`).
pub const REG_MODE_FORMAT: u64 = 0x10c;
/// `MODE_CTRL`: bit 0 enables the mode (validated when set).
pub const REG_MODE_CTRL: u64 = 0x110;

/// `RING_BASE_LO`: low 32 bits of the ring's guest IOVA.
pub const REG_RING_BASE_LO: u64 = 0x200;
/// `RING_BASE_HI`: high 32 bits of the ring's guest IOVA.
pub const REG_RING_BASE_HI: u64 = 0x204;
/// `RING_SIZE`: ring size in bytes (power of two, `RING_SIZE_MIN..=RING_SIZE_MAX`).
pub const REG_RING_SIZE: u64 = 0x208;
/// `RING_CTRL`: bit 0 enables the ring (validated when set; resets head and tail to 0).
pub const REG_RING_CTRL: u64 = 0x20c;
/// `RING_HEAD`: read-only byte offset of the next command the device will execute.
pub const REG_RING_HEAD: u64 = 0x210;
/// `RING_TAIL`: byte offset one past the last published command; writing it rings the
/// doorbell.
pub const REG_RING_TAIL: u64 = 0x214;

/// `IRQ_STATUS`: read-only pending interrupt causes (`IRQ_*` bits).
pub const REG_IRQ_STATUS: u64 = 0x300;
/// `IRQ_ENABLE`: which causes raise the interrupt.
pub const REG_IRQ_ENABLE: u64 = 0x304;
/// `IRQ_ACK`: write 1 to clear a cause in `IRQ_STATUS`; reads 0.
pub const REG_IRQ_ACK: u64 = 0x308;
/// `ERROR_CODE`: read-only code of the most recent error (`ERR_*`), cleared by acking
/// `IRQ_ERROR`.
pub const REG_ERROR_CODE: u64 = 0x310;
/// `ERROR_INFO`: read-only detail of the most recent error (ring offset, GTT index or
/// register offset, see the docs).
pub const REG_ERROR_INFO: u64 = 0x314;
/// `ERROR_COUNT`: read-only number of errors since reset (wraps).
pub const REG_ERROR_COUNT: u64 = 0x318;
/// `FENCE_VALUE`: read-only value of the last executed FENCE command.
pub const REG_FENCE_VALUE: u64 = 0x320;

/// `GTT_INVAL_START`: first entry of a batch invalidation.
pub const REG_GTT_INVAL_START: u64 = 0x400;
/// `GTT_INVAL_COUNT`: writing N invalidates entries `GTT_INVAL_START..+N` (clamped to the
/// GTT) and releases their pins in one array call; reads the last count written.
pub const REG_GTT_INVAL_COUNT: u64 = 0x404;

/// Start of the GTT window: `GTT_ENTRIES` little-endian 64-bit entries.
pub const GTT_BASE: u64 = 0x8000;
/// Number of GTT entries.
pub const GTT_ENTRIES: u32 = 1024;
/// GTT entry bit: the entry maps a guest page.
pub const GTT_VALID: u64 = 1 << 0;
/// GTT entry bit: the device may write the page (needed by READBACK).
pub const GTT_WRITABLE: u64 = 1 << 1;
/// GTT entry bits holding the guest IOVA of the page (bits 63..12).
pub const GTT_ADDR_MASK: u64 = !0xfff;

/// Offset of the MSI-X table in BAR0 (emulated by the framework).
pub const MSIX_TABLE_OFFSET: u64 = 0xc000;
/// Offset of the MSI-X PBA in BAR0 (emulated by the framework).
pub const MSIX_PBA_OFFSET: u64 = 0xd000;

/// `ID` value: "UGPU".
pub const ID_MAGIC: u32 = u32::from_le_bytes(*b"UGPU");
/// `VERSION` value: 1.0.
pub const VERSION: u32 = 0x0001_0000;

/// `STATUS` bit: the mode is enabled.
pub const STATUS_MODE_ENABLED: u32 = 1 << 0;
/// `STATUS` bit: the ring is enabled.
pub const STATUS_RING_ENABLED: u32 = 1 << 1;
/// `STATUS` bit: published commands are not executed yet (head != tail).
pub const STATUS_BUSY: u32 = 1 << 2;

/// `MODE_FORMAT`: 32-bit XRGB8888 (little-endian: bytes B, G, R, X).
pub const FORMAT_XRGB8888: u32 = 1;
/// Largest accepted mode width.
pub const MAX_WIDTH: u32 = 4096;
/// Largest accepted mode height.
pub const MAX_HEIGHT: u32 = 4096;

/// Smallest ring size in bytes.
pub const RING_SIZE_MIN: u32 = 4096;
/// Largest ring size in bytes.
pub const RING_SIZE_MAX: u32 = 1 << 20;

/// `IRQ_STATUS` bit: a FENCE command executed.
pub const IRQ_FENCE: u32 = 1 << 0;
/// `IRQ_STATUS` bit: an error was recorded in `ERROR_CODE`.
pub const IRQ_ERROR: u32 = 1 << 1;
/// All defined `IRQ_*` bits.
pub const IRQ_ALL: u32 = IRQ_FENCE | IRQ_ERROR;

/// Default mode width after reset.
pub const DEFAULT_WIDTH: u32 = 1024;
/// Default mode height after reset.
pub const DEFAULT_HEIGHT: u32 = 768;

/// The mode registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Bytes per row.
    pub stride: u32,
    /// `FORMAT_*`.
    pub format: u32,
    /// Enabled (only ever true for a mode that passed [`Mode::validate`]).
    pub enabled: bool,
}

impl Mode {
    /// The reset mode: 1024×768 XRGB8888, disabled.
    pub fn reset_value() -> Mode {
        Mode {
            width: DEFAULT_WIDTH,
            height: DEFAULT_HEIGHT,
            stride: DEFAULT_WIDTH * 4,
            format: FORMAT_XRGB8888,
            enabled: false,
        }
    }

    /// True if the mode fits a framebuffer of `fb_size` bytes.
    pub fn validate(&self, fb_size: u64) -> bool {
        let min_stride = u64::from(self.width) * 4;
        self.format == FORMAT_XRGB8888
            && (1..=MAX_WIDTH).contains(&self.width)
            && (1..=MAX_HEIGHT).contains(&self.height)
            && u64::from(self.stride) >= min_stride
            && self.stride.is_multiple_of(4)
            && u64::from(self.stride) * u64::from(self.height) <= fb_size
    }
}

/// The ring registers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingRegs {
    /// Guest IOVA of the ring.
    pub base: u64,
    /// Size in bytes.
    pub size: u32,
    /// Enabled (only ever true for a ring that passed [`RingRegs::validate`]).
    pub enabled: bool,
    /// Device-owned read offset.
    pub head: u32,
    /// Guest-owned write offset.
    pub tail: u32,
}

impl RingRegs {
    /// True if base and size describe a usable ring: size a power of two in
    /// `RING_SIZE_MIN..=RING_SIZE_MAX`, base page aligned, `base + size` not wrapping.
    pub fn validate(&self) -> bool {
        self.size.is_power_of_two()
            && (RING_SIZE_MIN..=RING_SIZE_MAX).contains(&self.size)
            && self.base.is_multiple_of(4096)
            && self.base.checked_add(u64::from(self.size)).is_some()
    }
}

/// The register file shared by the connection thread and the worker (behind a mutex).
#[derive(Debug)]
pub struct Regs {
    /// Mode registers.
    pub mode: Mode,
    /// Ring registers.
    pub ring: RingRegs,
    /// Bumped whenever the ring is (re)configured or the device is reset: the worker abandons
    /// work fetched under an older generation.
    pub ring_gen: u64,
    /// `IRQ_STATUS`.
    pub irq_status: u32,
    /// `IRQ_ENABLE`.
    pub irq_enable: u32,
    /// `ERROR_CODE`.
    pub error_code: u32,
    /// `ERROR_INFO`.
    pub error_info: u32,
    /// `ERROR_COUNT`.
    pub error_count: u32,
    /// `FENCE_VALUE`.
    pub fence: u32,
    /// `GTT_INVAL_START`.
    pub gtt_inval_start: u32,
    /// `GTT_INVAL_COUNT`.
    pub gtt_inval_count: u32,
}

impl Default for Regs {
    fn default() -> Self {
        Regs {
            mode: Mode::reset_value(),
            ring: RingRegs::default(),
            ring_gen: 0,
            irq_status: 0,
            irq_enable: 0,
            error_code: 0,
            error_info: 0,
            error_count: 0,
            fence: 0,
            gtt_inval_start: 0,
            gtt_inval_count: 0,
        }
    }
}

impl Regs {
    /// Reset every register to its reset value; the ring generation moves on.
    pub fn reset(&mut self) {
        let gen = self.ring_gen.wrapping_add(1);
        *self = Regs::default();
        self.ring_gen = gen;
    }

    /// True when every published command has been executed (or the ring is off).
    pub fn idle(&self) -> bool {
        !self.ring.enabled || self.ring.head == self.ring.tail
    }

    /// `STATUS` register value.
    pub fn status(&self) -> u32 {
        let mut s = 0;
        if self.mode.enabled {
            s |= STATUS_MODE_ENABLED;
        }
        if self.ring.enabled {
            s |= STATUS_RING_ENABLED;
        }
        if !self.idle() {
            s |= STATUS_BUSY;
        }
        s
    }

    /// Record an error and set `IRQ_ERROR`. Returns true if the interrupt should be raised.
    pub fn record_error(&mut self, code: u32, info: u32) -> bool {
        self.error_code = code;
        self.error_info = info;
        self.error_count = self.error_count.wrapping_add(1);
        self.set_irq(IRQ_ERROR)
    }

    /// Set `bits` in `IRQ_STATUS`. Returns true if any of them is enabled (raise the IRQ).
    pub fn set_irq(&mut self, bits: u32) -> bool {
        self.irq_status |= bits;
        self.irq_enable & bits != 0
    }

    /// `IRQ_ACK` write: clear the given causes; acking `IRQ_ERROR` clears the error registers.
    pub fn ack(&mut self, bits: u32) {
        self.irq_status &= !bits;
        if bits & IRQ_ERROR != 0 {
            self.error_code = 0;
            self.error_info = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_mode_default_is_valid_for_4mib() {
        assert!(Mode::reset_value().validate(4 << 20));
    }

    #[test]
    fn test_mode_too_big_for_fb_is_invalid() {
        let m = Mode {
            width: 2048,
            height: 2048,
            stride: 8192,
            ..Mode::reset_value()
        };
        assert!(!m.validate(4 << 20));
    }

    #[test]
    fn test_mode_short_stride_is_invalid() {
        let m = Mode {
            stride: 1000,
            ..Mode::reset_value()
        };
        assert!(!m.validate(4 << 20));
    }

    #[test]
    fn test_ring_wrapping_base_is_invalid() {
        let r = RingRegs {
            base: !0xfff,
            size: 8192,
            ..RingRegs::default()
        };
        assert!(!r.validate());
    }

    #[test]
    fn test_ring_non_power_of_two_is_invalid() {
        let r = RingRegs {
            base: 0x10000,
            size: 12288,
            ..RingRegs::default()
        };
        assert!(!r.validate());
        let ok = RingRegs { size: 8192, ..r };
        assert!(ok.validate());
    }

    #[test]
    fn test_ack_error_clears_error_registers() {
        let mut r = Regs {
            irq_enable: IRQ_ALL,
            ..Regs::default()
        };
        assert!(r.record_error(3, 7));
        r.ack(IRQ_ERROR);
        assert_eq!((r.irq_status, r.error_code, r.error_info), (0, 0, 0));
        assert_eq!(r.error_count, 1);
    }
}
