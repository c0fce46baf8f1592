//! BAR0 access decoding: splitting accesses into 4-byte registers and 8-byte GTT entries,
//! register reads, and register writes with their side effects (mode and ring validation,
//! doorbell, interrupt enable/ack, batch GTT invalidation).

use super::error::{ERR_BAD_TAIL, ERR_MODE_INVALID, ERR_RING_CONFIG, ERR_RING_FAULT};
use super::gtt::{self, lock};
use super::regs::*;
use super::{Gpu, BAR_REGS};

impl Gpu {
    /// Guest read of BAR0 at `offset` (registers and GTT window; other BARs read 0).
    pub(super) fn bar_read_impl(&self, bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != BAR_REGS {
            return;
        }
        Self::for_each_unit(offset, data.len(), |unit, unit_len, in_unit, at, n| {
            let bytes = self.read_unit(unit, unit_len).to_le_bytes();
            data[at..at + n].copy_from_slice(&bytes[in_unit..in_unit + n]);
        });
    }

    /// Guest write of BAR0 at `offset`.
    pub(super) fn bar_write_impl(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != BAR_REGS {
            return;
        }
        let mut units = Vec::with_capacity(2);
        Self::for_each_unit(offset, data.len(), |unit, unit_len, in_unit, at, n| {
            units.push((unit, unit_len, in_unit, at, n));
        });
        for (unit, unit_len, in_unit, at, n) in units {
            // Partial writes merge with the current value (registers read as documented).
            let mut bytes = self.read_unit(unit, unit_len).to_le_bytes();
            bytes[in_unit..in_unit + n].copy_from_slice(&data[at..at + n]);
            let value = u64::from_le_bytes(bytes);
            if unit_len == 8 {
                self.write_gtt(((unit - GTT_BASE) / 8) as u32, value);
            } else {
                self.write_reg(unit, value as u32);
            }
        }
    }

    fn read_reg(&self, off: u64) -> u32 {
        let r = lock(&self.shared.regs);
        match off {
            REG_ID => ID_MAGIC,
            REG_VERSION => VERSION,
            REG_FB_SIZE => self.fb_size as u32,
            REG_GTT_ENTRIES => GTT_ENTRIES,
            REG_MAX_WIDTH => MAX_WIDTH,
            REG_MAX_HEIGHT => MAX_HEIGHT,
            REG_STATUS => r.status(),
            REG_MODE_WIDTH => r.mode.width,
            REG_MODE_HEIGHT => r.mode.height,
            REG_MODE_STRIDE => r.mode.stride,
            REG_MODE_FORMAT => r.mode.format,
            REG_MODE_CTRL => u32::from(r.mode.enabled),
            REG_RING_BASE_LO => r.ring.base as u32,
            REG_RING_BASE_HI => (r.ring.base >> 32) as u32,
            REG_RING_SIZE => r.ring.size,
            REG_RING_CTRL => u32::from(r.ring.enabled),
            REG_RING_HEAD => r.ring.head,
            REG_RING_TAIL => r.ring.tail,
            REG_IRQ_STATUS => r.irq_status,
            REG_IRQ_ENABLE => r.irq_enable,
            REG_ERROR_CODE => r.error_code,
            REG_ERROR_INFO => r.error_info,
            REG_ERROR_COUNT => r.error_count,
            REG_FENCE_VALUE => r.fence,
            REG_GTT_INVAL_START => r.gtt_inval_start,
            REG_GTT_INVAL_COUNT => r.gtt_inval_count,
            _ => 0,
        }
    }

    fn write_reg(&mut self, off: u64, val: u32) {
        let outcome = apply_reg_write(&mut lock(&self.shared.regs), self.fb_size, off, val);
        match outcome {
            Ok(WriteEffect::None) => {}
            Ok(WriteEffect::RingStopped) => self.shared.idle.notify_all(),
            Ok(WriteEffect::Raise) => self.shared.raise(),
            Ok(WriteEffect::Lower) => lock(&self.shared.irq).lower_intx(),
            Ok(WriteEffect::InvalidateGtt { start, count }) => {
                let pfns = self.shared.gtt.lock().invalidate(start, count);
                gtt::release(self.dma.as_ref(), &pfns);
            }
            Ok(WriteEffect::Doorbell) => match &self.worker {
                Some(w) => w.doorbell(),
                None => {
                    let mut r = lock(&self.shared.regs);
                    r.ring.head = r.ring.tail;
                    drop(r);
                    self.shared.register_error(ERR_RING_FAULT, off);
                }
            },
            Err(code) => self.shared.register_error(code, off),
        }
    }

    fn write_gtt(&mut self, index: u32, value: u64) {
        let dropped = self.shared.gtt.lock().set_entry(index, value);
        if let Some(pfn) = dropped {
            gtt::release(self.dma.as_ref(), &[pfn]);
        }
    }

    /// Split a BAR0 access into the 4-byte registers / 8-byte GTT entries it touches:
    /// `f(unit_offset, unit_len, byte_in_unit, data_offset, n)`.
    fn for_each_unit(off: u64, len: usize, mut f: impl FnMut(u64, u64, usize, usize, usize)) {
        let gtt_end = GTT_BASE + u64::from(GTT_ENTRIES) * 8;
        let mut done = 0usize;
        while done < len {
            let Some(pos) = off.checked_add(done as u64) else {
                return;
            };
            let unit_len: u64 = if (GTT_BASE..gtt_end).contains(&pos) {
                8
            } else {
                4
            };
            let unit = pos & !(unit_len - 1);
            let in_unit = (pos - unit) as usize;
            let n = (unit_len as usize - in_unit).min(len - done);
            f(unit, unit_len, in_unit, done, n);
            done += n;
        }
    }

    fn read_unit(&self, unit: u64, unit_len: u64) -> u64 {
        if unit_len == 8 {
            let index = ((unit - GTT_BASE) / 8) as u32;
            self.shared.gtt.lock().entry(index)
        } else {
            u64::from(self.read_reg(unit))
        }
    }
}

/// What a register write asks the caller to do once the register lock is released.
enum WriteEffect {
    None,
    Doorbell,
    Raise,
    /// No enabled cause is pending any more: lower the INTx line.
    Lower,
    /// Invalidate GTT entries and release their pins in one call.
    InvalidateGtt {
        start: u32,
        count: u32,
    },
    RingStopped,
}

/// Apply a 32-bit register write to the register file; `Err(code)` for a rejected write.
fn apply_reg_write(r: &mut Regs, fb_size: u64, off: u64, val: u32) -> Result<WriteEffect, u32> {
    match off {
        REG_MODE_WIDTH | REG_MODE_HEIGHT | REG_MODE_STRIDE | REG_MODE_FORMAT => {
            if r.mode.enabled {
                return Err(ERR_MODE_INVALID);
            }
            match off {
                REG_MODE_WIDTH => r.mode.width = val,
                REG_MODE_HEIGHT => r.mode.height = val,
                REG_MODE_STRIDE => r.mode.stride = val,
                _ => r.mode.format = val,
            }
        }
        REG_MODE_CTRL => {
            if val & 1 == 0 {
                r.mode.enabled = false;
            } else if !r.mode.enabled {
                if !r.mode.validate(fb_size) {
                    return Err(ERR_MODE_INVALID);
                }
                r.mode.enabled = true;
            }
        }
        REG_RING_BASE_LO | REG_RING_BASE_HI | REG_RING_SIZE => {
            if r.ring.enabled {
                return Err(ERR_RING_CONFIG);
            }
            match off {
                REG_RING_BASE_LO => r.ring.base = (r.ring.base & !0xffff_ffff) | u64::from(val),
                REG_RING_BASE_HI => {
                    r.ring.base = (r.ring.base & 0xffff_ffff) | (u64::from(val) << 32)
                }
                _ => r.ring.size = val,
            }
        }
        REG_RING_CTRL => {
            let enable = val & 1 != 0;
            if enable == r.ring.enabled {
                return Ok(WriteEffect::None);
            }
            if enable && !r.ring.validate() {
                return Err(ERR_RING_CONFIG);
            }
            r.ring.enabled = enable;
            r.ring.head = 0;
            r.ring.tail = 0;
            r.ring_gen = r.ring_gen.wrapping_add(1);
            return Ok(WriteEffect::RingStopped);
        }
        REG_RING_TAIL => {
            if !r.ring.enabled || !val.is_multiple_of(4) || val >= r.ring.size {
                return Err(ERR_BAD_TAIL);
            }
            r.ring.tail = val;
            return Ok(WriteEffect::Doorbell);
        }
        REG_IRQ_ENABLE => {
            let old = r.irq_enable;
            r.irq_enable = val & IRQ_ALL;
            if r.irq_status & r.irq_enable & !old != 0 {
                return Ok(WriteEffect::Raise);
            }
            if r.irq_status & r.irq_enable == 0 {
                return Ok(WriteEffect::Lower);
            }
        }
        REG_GTT_INVAL_START => r.gtt_inval_start = val,
        REG_GTT_INVAL_COUNT => {
            r.gtt_inval_count = val;
            return Ok(WriteEffect::InvalidateGtt {
                start: r.gtt_inval_start,
                count: val,
            });
        }
        REG_IRQ_ACK => {
            r.ack(val & IRQ_ALL);
            if r.irq_status & r.irq_enable == 0 {
                return Ok(WriteEffect::Lower);
            }
        }
        _ => tracing::debug!(off, val, "gpu: write to read-only or unknown register"),
    }
    Ok(WriteEffect::None)
}
