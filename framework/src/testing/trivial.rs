//! The trivial register device: BAR0 of 4 KiB plain registers and a 256-byte config space,
//! nothing else (no interrupts, no DMA). Its cost per access is a bounds check and a copy,
//! so a round trip through a server measures the server and the socket, not the device;
//! benchmarks serve it, and tests that need "some device" use it.
//!
//! BAR0 reads its offset's low byte until it is written (`0x10` reads `0x10 0x11 …`), so a
//! read proves the bytes came from the right place; reset restores that. Accesses outside a
//! region are refused with EINVAL.

use crate::device::{
    region_index, Device, DeviceError, DeviceInfo, RegionInfo, DEVICE_FLAGS_PCI,
    DEVICE_FLAGS_RESET, REGION_FLAG_READ, REGION_FLAG_WRITE,
};

/// BAR0 size.
pub const TRIVIAL_BAR0_SIZE: u64 = 4096;
/// Config space size.
pub const TRIVIAL_CONFIG_SIZE: u64 = 256;

/// The trivial register device.
#[derive(Debug, Clone)]
pub struct TrivialDevice {
    bar0: Vec<u8>,
    config: Vec<u8>,
}

impl Default for TrivialDevice {
    fn default() -> Self {
        TrivialDevice {
            bar0: (0..TRIVIAL_BAR0_SIZE).map(|i| i as u8).collect(),
            config: vec![0; TRIVIAL_CONFIG_SIZE as usize],
        }
    }
}

impl TrivialDevice {
    /// Size of region `index` (0: not implemented).
    pub fn region_size(index: u32) -> u64 {
        match index {
            region_index::BAR0 => TRIVIAL_BAR0_SIZE,
            region_index::CONFIG => TRIVIAL_CONFIG_SIZE,
            _ => 0,
        }
    }

    fn span(&mut self, region: u32, offset: u64, len: usize) -> Result<&mut [u8], DeviceError> {
        let mem = match region {
            region_index::BAR0 => &mut self.bar0,
            region_index::CONFIG => &mut self.config,
            _ => return Err(DeviceError::InvalidArgument(format!("region {region}"))),
        };
        usize::try_from(offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(len)?))
            .filter(|r| r.end <= mem.len())
            .map(|r| &mut mem[r])
            .ok_or_else(|| {
                DeviceError::InvalidArgument(format!("{len} bytes at {offset:#x} out of bounds"))
            })
    }
}

impl Device for TrivialDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
            regions: (0..region_index::COUNT)
                .map(|index| {
                    let size = Self::region_size(index);
                    RegionInfo {
                        index,
                        size,
                        flags: if size > 0 {
                            REGION_FLAG_READ | REGION_FLAG_WRITE
                        } else {
                            0
                        },
                        mmap: None,
                    }
                })
                .collect(),
            irqs: Vec::new(),
        }
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        data.copy_from_slice(self.span(region, offset, data.len())?);
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.span(region, offset, data.len())?.copy_from_slice(data);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        *self = TrivialDevice::default();
        Ok(())
    }
}
