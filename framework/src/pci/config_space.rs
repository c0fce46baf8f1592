//! The 256-byte type-0 configuration space as byte arrays with per-byte masks.
//!
//! Every byte has a value, a write mask (bits the guest may change) and a write-1-to-clear
//! mask. A write of any size at any offset is applied byte by byte through the masks, so
//! unaligned and field-straddling accesses need no special cases, read-only fields ignore
//! writes, and BAR sizing falls out of the BAR's write mask (writing all-ones reads back the
//! size mask). Fields whose value is computed (interrupt status, MSI pending bits) are
//! stored by the adapter before a read with [`ConfigSpace::set_u16_raw`]/`set_u32_raw`.

use crate::device::DeviceError;

/// Size of the emulated configuration space (no PCIe extended space).
pub(crate) const CONFIG_SIZE: usize = 256;

/// Standard header register offsets.
pub(crate) mod reg {
    pub(crate) const VENDOR_ID: usize = 0x00;
    pub(crate) const DEVICE_ID: usize = 0x02;
    pub(crate) const COMMAND: usize = 0x04;
    pub(crate) const STATUS: usize = 0x06;
    pub(crate) const REVISION: usize = 0x08;
    pub(crate) const CLASS_PROG_IF: usize = 0x09;
    pub(crate) const CACHE_LINE_SIZE: usize = 0x0c;
    pub(crate) const HEADER_TYPE: usize = 0x0e;
    pub(crate) const BAR0: usize = 0x10;
    pub(crate) const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
    pub(crate) const SUBSYSTEM_ID: usize = 0x2e;
    pub(crate) const ROM_BAR: usize = 0x30;
    pub(crate) const CAPABILITIES: usize = 0x34;
    pub(crate) const INTERRUPT_LINE: usize = 0x3c;
    pub(crate) const INTERRUPT_PIN: usize = 0x3d;
    /// First byte after the standard header: capabilities start here.
    pub(crate) const HEADER_END: usize = 0x40;
}

/// Command register bits.
pub(crate) mod command {
    pub(crate) const IO: u16 = 1 << 0;
    pub(crate) const MEMORY: u16 = 1 << 1;
    pub(crate) const BUS_MASTER: u16 = 1 << 2;
    pub(crate) const INTX_DISABLE: u16 = 1 << 10;
    /// The bits a guest may change.
    pub(crate) const WRITABLE: u16 = IO | MEMORY | BUS_MASTER | INTX_DISABLE;
}

/// Status register bits.
pub(crate) mod status {
    pub(crate) const INTERRUPT: u16 = 1 << 3;
    pub(crate) const CAP_LIST: u16 = 1 << 4;
    /// Error bits that are write-1-to-clear (parity, aborts, SERR).
    pub(crate) const W1C: u16 = 0xf900;
}

/// Configuration space bytes plus write masks.
#[derive(Clone)]
pub(crate) struct ConfigSpace {
    bytes: [u8; CONFIG_SIZE],
    wmask: [u8; CONFIG_SIZE],
    w1c: [u8; CONFIG_SIZE],
    defaults: [u8; CONFIG_SIZE],
}

fn out_of_range(offset: u64, len: usize) -> DeviceError {
    DeviceError::InvalidArgument(format!(
        "config access {offset:#x}+{len} outside the {CONFIG_SIZE}-byte config space"
    ))
}

impl ConfigSpace {
    /// All zero and read-only.
    pub(crate) fn new() -> ConfigSpace {
        ConfigSpace {
            bytes: [0; CONFIG_SIZE],
            wmask: [0; CONFIG_SIZE],
            w1c: [0; CONFIG_SIZE],
            defaults: [0; CONFIG_SIZE],
        }
    }

    /// Initialise bytes at `offset` with `value` and write mask `wmask` (little endian).
    /// Panics only on a framework bug (offsets are constants or validated layout).
    fn init(&mut self, offset: usize, value: &[u8], wmask: &[u8]) {
        self.bytes[offset..offset + value.len()].copy_from_slice(value);
        self.wmask[offset..offset + wmask.len()].copy_from_slice(wmask);
    }

    /// Initialise a byte.
    pub(crate) fn init_u8(&mut self, offset: usize, value: u8, wmask: u8) {
        self.init(offset, &[value], &[wmask]);
    }

    /// Initialise a 16-bit field.
    pub(crate) fn init_u16(&mut self, offset: usize, value: u16, wmask: u16) {
        self.init(offset, &value.to_le_bytes(), &wmask.to_le_bytes());
    }

    /// Initialise a 32-bit field.
    pub(crate) fn init_u32(&mut self, offset: usize, value: u32, wmask: u32) {
        self.init(offset, &value.to_le_bytes(), &wmask.to_le_bytes());
    }

    /// Mark bits of a 16-bit field write-1-to-clear.
    pub(crate) fn init_w1c_u16(&mut self, offset: usize, mask: u16) {
        self.w1c[offset..offset + 2].copy_from_slice(&mask.to_le_bytes());
    }

    /// Remember the current contents as the reset state.
    pub(crate) fn seal_defaults(&mut self) {
        self.defaults = self.bytes;
    }

    /// Back to the state recorded by [`ConfigSpace::seal_defaults`].
    pub(crate) fn reset(&mut self) {
        self.bytes = self.defaults;
    }

    /// The whole space as it is now (for migration).
    pub(crate) fn bytes(&self) -> [u8; CONFIG_SIZE] {
        self.bytes
    }

    /// Take migrated `saved` bytes, after checking that they come from a function of the
    /// same layout and describe a state it can be in. Only what the guest can write (the
    /// write masks) is taken from `saved`; every other bit must equal this function's reset
    /// value or the stream is refused. That includes the write-1-to-clear error bits of
    /// STATUS: umdev's emulation never sets them (no parity or abort is ever signalled), so
    /// a saved 1 there is a state this function cannot be in. `computed` lists the bits
    /// (offset of a little-endian field, mask) whose values the adapter stores itself
    /// before every read (STATUS's interrupt bit, MSI pending bits): those are neither
    /// compared nor taken, they keep this function's value until it recomputes them. On
    /// error nothing changes.
    pub(crate) fn restore(
        &mut self,
        saved: &[u8],
        computed: &[(usize, u32)],
    ) -> Result<(), String> {
        let saved: [u8; CONFIG_SIZE] = saved.try_into().map_err(|_| {
            format!(
                "config space of {} bytes, this function has {CONFIG_SIZE}",
                saved.len()
            )
        })?;
        let computed_mask = |i: usize| -> u8 {
            computed
                .iter()
                .filter_map(|&(o, m)| {
                    let k = i.checked_sub(o).filter(|&k| k < 4)?;
                    Some((m >> (8 * k)) as u8)
                })
                .fold(0, |a, b| a | b)
        };
        let mut next = self.bytes;
        for (i, &b) in saved.iter().enumerate() {
            let c = computed_mask(i);
            let guest = self.wmask[i] & !c;
            let fixed = !(guest | c);
            if (b ^ self.defaults[i]) & fixed != 0 {
                return Err(format!(
                    "config byte {i:#04x} is {b:#04x}, this function's read-only bits say {:#04x} (another device or layout)",
                    self.defaults[i]
                ));
            }
            next[i] = (b & guest) | (self.defaults[i] & fixed) | (self.bytes[i] & c);
        }
        self.bytes = next;
        Ok(())
    }

    /// Guest read of `data.len()` bytes at `offset`.
    pub(crate) fn read(&self, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let range = Self::range(offset, data.len())?;
        data.copy_from_slice(&self.bytes[range]);
        Ok(())
    }

    /// Guest write of `data` at `offset`, through the write and W1C masks.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let range = Self::range(offset, data.len())?;
        for (i, &v) in range.zip(data) {
            let w = self.wmask[i];
            let b = (self.bytes[i] & !w) | (v & w);
            self.bytes[i] = b & !(v & self.w1c[i]);
        }
        Ok(())
    }

    /// Current value of a byte.
    pub(crate) fn u8(&self, offset: usize) -> u8 {
        self.bytes.get(offset).copied().unwrap_or(0)
    }

    /// Current value of a 16-bit field.
    pub(crate) fn u16(&self, offset: usize) -> u16 {
        u16::from_le_bytes([self.u8(offset), self.u8(offset + 1)])
    }

    /// Current value of a 32-bit field.
    pub(crate) fn u32(&self, offset: usize) -> u32 {
        u32::from_le_bytes([
            self.u8(offset),
            self.u8(offset + 1),
            self.u8(offset + 2),
            self.u8(offset + 3),
        ])
    }

    /// Store a computed 16-bit value, bypassing the write masks.
    pub(crate) fn set_u16_raw(&mut self, offset: usize, value: u16) {
        if let Some(b) = self.bytes.get_mut(offset..offset + 2) {
            b.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Store a computed 32-bit value, bypassing the write masks.
    pub(crate) fn set_u32_raw(&mut self, offset: usize, value: u32) {
        if let Some(b) = self.bytes.get_mut(offset..offset + 4) {
            b.copy_from_slice(&value.to_le_bytes());
        }
    }

    fn range(offset: u64, len: usize) -> Result<std::ops::Range<usize>, DeviceError> {
        usize::try_from(offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(len)?))
            .filter(|r| r.end <= CONFIG_SIZE)
            .ok_or_else(|| out_of_range(offset, len))
    }
}

impl std::fmt::Debug for ConfigSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSpace")
            .field("vendor", &format_args!("{:#06x}", self.u16(reg::VENDOR_ID)))
            .field("device", &format_args!("{:#06x}", self.u16(reg::DEVICE_ID)))
            .field("command", &format_args!("{:#06x}", self.u16(reg::COMMAND)))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_config_write_respects_write_mask() {
        let mut cs = ConfigSpace::new();
        cs.init_u16(reg::COMMAND, 0, command::WRITABLE);
        cs.write(reg::COMMAND as u64, &[0xff, 0xff]).unwrap();
        assert_eq!(cs.u16(reg::COMMAND), command::WRITABLE);
        cs.write(0, &[0xff; 4]).unwrap();
        assert_eq!(cs.u32(0), 0, "read-only ids ignore writes");
    }

    #[test]
    fn test_config_write_one_clears_w1c_bits() {
        let mut cs = ConfigSpace::new();
        cs.init_u16(reg::STATUS, 0x8010, 0);
        cs.init_w1c_u16(reg::STATUS, status::W1C);
        cs.write(reg::STATUS as u64, &[0x00, 0x80]).unwrap();
        assert_eq!(cs.u16(reg::STATUS), 0x0010);
    }

    #[test]
    fn test_config_access_past_end_is_rejected() {
        let mut cs = ConfigSpace::new();
        let mut buf = [0u8; 4];
        assert!(cs.read(254, &mut buf).is_err());
        assert!(cs.write(u64::MAX, &buf).is_err());
        assert!(cs.read(252, &mut buf).is_ok());
    }

    #[test]
    fn test_config_reset_restores_defaults() {
        let mut cs = ConfigSpace::new();
        cs.init_u8(reg::INTERRUPT_LINE, 0, 0xff);
        cs.seal_defaults();
        cs.write(reg::INTERRUPT_LINE as u64, &[9]).unwrap();
        assert_eq!(cs.u8(reg::INTERRUPT_LINE), 9);
        cs.reset();
        assert_eq!(cs.u8(reg::INTERRUPT_LINE), 0);
    }
}
