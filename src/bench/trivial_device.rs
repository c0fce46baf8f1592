//! The trivial device both servers of `umdev bench wire` serve: BAR0 of 4 KiB plain
//! registers and a 256-byte config space, nothing else. Its cost is a bounds check and a
//! memcpy, so a round trip measures the server and the socket, not the device.
//!
//! DMA_MAP/UNMAP on the `vfio_user::Server` side mmap/munmap the region, as umdev's DMA layer
//! does, so both sides do the same work per mapping.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use umdev::device::{
    Device, DeviceError, DeviceInfo, RegionInfo, DEVICE_FLAGS_PCI, DEVICE_FLAGS_RESET,
    REGION_FLAG_READ, REGION_FLAG_WRITE,
};
use vfio_bindings::bindings::vfio::{
    vfio_region_info, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, ServerBackend, ServerRegion};

use super::local_mapping::LocalMapping;

/// BAR0 size.
pub const BAR0_SIZE: u64 = 4096;
/// Config space size.
pub const CONFIG_SIZE: u64 = 256;
/// VFIO PCI region index of the config space.
pub const CONFIG_REGION: u32 = 7;
/// Number of VFIO PCI region indexes.
pub const REGION_COUNT: u32 = 9;

/// Registers of the trivial device.
pub struct TrivialRegs {
    bar0: Vec<u8>,
    config: Vec<u8>,
}

impl Default for TrivialRegs {
    fn default() -> Self {
        TrivialRegs {
            bar0: vec![0; BAR0_SIZE as usize],
            config: vec![0; CONFIG_SIZE as usize],
        }
    }
}

/// Size of region `index` (0 = not implemented).
pub fn region_size(index: u32) -> u64 {
    match index {
        0 => BAR0_SIZE,
        CONFIG_REGION => CONFIG_SIZE,
        _ => 0,
    }
}

impl TrivialRegs {
    fn span(&mut self, region: u32, offset: u64, len: usize) -> io::Result<&mut [u8]> {
        let mem = match region {
            0 => &mut self.bar0,
            CONFIG_REGION => &mut self.config,
            _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let start =
            usize::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= mem.len())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok(&mut mem[start..end])
    }

    /// Read registers.
    pub fn read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        data.copy_from_slice(self.span(region, offset, data.len())?);
        Ok(())
    }

    /// Write registers.
    pub fn write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.span(region, offset, data.len())?.copy_from_slice(data);
        Ok(())
    }
}

/// The trivial device as a umdev [`Device`] (DMA map/unmap is done by umdev's DMA layer).
#[derive(Default)]
pub struct UmdevTrivial {
    regs: TrivialRegs,
}

impl Device for UmdevTrivial {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
            regions: (0..REGION_COUNT)
                .map(|index| {
                    let size = region_size(index);
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
        self.regs
            .read(region, offset, data)
            .map_err(|_| DeviceError::InvalidArgument("out of bounds".into()))
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.regs
            .write(region, offset, data)
            .map_err(|_| DeviceError::InvalidArgument("out of bounds".into()))
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        self.regs = TrivialRegs::default();
        Ok(())
    }
}

/// The trivial device as a `vfio_user::ServerBackend`.
#[derive(Default)]
pub struct VfioUserTrivial {
    regs: TrivialRegs,
    maps: HashMap<u64, LocalMapping>,
}

/// The region list `vfio_user::Server::new` wants for the trivial device.
pub fn vfio_user_regions() -> Vec<ServerRegion> {
    (0..REGION_COUNT)
        .map(|index| {
            let size = region_size(index);
            ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags: if size > 0 {
                        VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE
                    } else {
                        0
                    },
                    index,
                    cap_offset: 0,
                    size,
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect()
}

impl ServerBackend for VfioUserTrivial {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.regs.read(region, offset, data)
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.regs.write(region, offset, data)
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        _offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let Some(file) = fd else {
            return Ok(());
        };
        let len = usize::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let fd: OwnedFd = file.into();
        let mapping = LocalMapping::new(&fd, len)?;
        if self.maps.contains_key(&address) {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        self.maps.insert(address, mapping);
        Ok(())
    }

    fn dma_unmap(&mut self, _flags: DmaUnmapFlags, address: u64, _size: u64) -> io::Result<()> {
        self.maps
            .remove(&address)
            .map(drop)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    fn reset(&mut self) -> io::Result<()> {
        self.regs = TrivialRegs::default();
        Ok(())
    }

    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<File>,
    ) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::ENOTSUP))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_trivial_regs_out_of_bounds_is_error() {
        let mut r = TrivialRegs::default();
        let mut b = [0u8; 4];
        assert!(r.read(0, BAR0_SIZE - 2, &mut b).is_err());
        assert!(r.read(3, 0, &mut b).is_err());
        assert!(r.read(0, u64::MAX, &mut b).is_err());
        r.write(0, 8, &[1, 2, 3, 4]).unwrap();
        r.read(0, 8, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
    }

    #[test]
    fn test_vfio_user_server_round_trip_with_raw_and_crate_clients() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let server = vfio_user::Server::new(&path, true, Vec::new(), vfio_user_regions()).unwrap();
        let t = std::thread::spawn(move || {
            let mut dev = VfioUserTrivial::default();
            server.run(&mut dev).unwrap();
            server.run(&mut dev).unwrap();
        });
        let mut c = vfio_user::Client::new(&path).unwrap();
        c.region_write(0, 16, &[9, 8, 7, 6]).unwrap();
        let mut b = [0u8; 4];
        c.region_read(0, 16, &mut b).unwrap();
        assert_eq!(b, [9, 8, 7, 6]);
        let fd = super::super::local_mapping::memfd("t", 0, 1 << 20).unwrap();
        use std::os::fd::AsRawFd;
        c.dma_map(0, 1 << 30, 1 << 20, fd.as_raw_fd()).unwrap();
        c.dma_unmap(1 << 30, 1 << 20).unwrap();
        c.shutdown().unwrap();
        drop(c);
        let mut raw = super::super::raw_client::RawClient::connect(&path).unwrap();
        raw.posted_write(0, 32, &[1, 2, 3, 4]).unwrap();
        raw.region_read(0, 32, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        drop(raw);
        t.join().unwrap();
    }

    #[test]
    fn test_umdev_server_round_trip_and_fdless_dma() {
        use umdev::dma::{DmaConfig, DmaSpace};
        use umdev::server::{Server, ServerConfig};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.sock");
        let space = DmaSpace::new(DmaConfig::default());
        let running = Server::new(
            ServerConfig::new(&path),
            Box::new(UmdevTrivial::default()),
            space.clone(),
        )
        .spawn()
        .unwrap();
        let mut c = vfio_user::Client::new(&path).unwrap();
        c.region_write(0, 16, &[9, 8, 7, 6]).unwrap();
        let mut b = [0u8; 4];
        c.region_read(0, 16, &mut b).unwrap();
        assert_eq!(b, [9, 8, 7, 6]);
        c.shutdown().unwrap();
        drop(c);
        let mut raw = super::super::raw_client::RawClient::connect(&path).unwrap();
        raw.posted_write(0, 32, &[1, 2, 3, 4]).unwrap();
        raw.region_read(0, 32, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        raw.dma_map_fdless(1 << 32, 1 << 20).unwrap();
        let server = raw.serve_dma(1 << 32, 1 << 20).unwrap();
        let h = space.handle();
        h.write((1 << 32) + 8, &[5, 6, 7]).unwrap();
        let mut got = [0u8; 3];
        h.read((1 << 32) + 8, &mut got).unwrap();
        assert_eq!(got, [5, 6, 7]);
        assert_eq!(server.stop().unwrap(), 2);
        running.shutdown().unwrap();
    }
}
