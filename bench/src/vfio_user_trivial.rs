//! The trivial device both servers of `umdev bench wire` serve: umdev's
//! [`TrivialDevice`] (BAR0 of 4 KiB plain registers and a 256-byte config space, nothing
//! else), on umdev's server as it is and on the `vfio_user` crate's `Server` through
//! [`VfioUserTrivial`]. Its cost is a bounds check and a memcpy, so a round trip measures the
//! server and the socket, not the device.
//!
//! DMA_MAP/UNMAP on the `vfio_user::Server` side mmap/munmap the region, as umdev's DMA layer
//! does, so both sides do the same work per mapping.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use umdev::device::{region_index, Device, DeviceError};
use umdev::testing::TrivialDevice;
use vfio_bindings::bindings::vfio::{
    vfio_region_info, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, ServerBackend, ServerRegion};

use super::local_mapping::LocalMapping;

/// The trivial device as a `vfio_user::ServerBackend`.
#[derive(Default)]
pub struct VfioUserTrivial {
    dev: TrivialDevice,
    maps: HashMap<u64, LocalMapping>,
}

fn io_err(e: DeviceError) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

/// The region list `vfio_user::Server::new` wants for the trivial device.
pub fn vfio_user_regions() -> Vec<ServerRegion> {
    (0..region_index::COUNT)
        .map(|index| {
            let size = TrivialDevice::region_size(index);
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
        self.dev.region_read(region, offset, data).map_err(io_err)
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.dev.region_write(region, offset, data).map_err(io_err)
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
        self.dev.reset().map_err(io_err)
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
    use umdev::testing::{DeviceAccess, FdlessMemory, TestServer, Vmm};

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
        let fd = crate::local_mapping::memfd("t", 0, 1 << 20).unwrap();
        use std::os::fd::AsRawFd;
        c.dma_map(0, 1 << 30, 1 << 20, fd.as_raw_fd()).unwrap();
        c.dma_unmap(1 << 30, 1 << 20).unwrap();
        c.shutdown().unwrap();
        drop(c);
        let mut raw = Vmm::connect(&path).unwrap();
        raw.posted_write(0, 32, &[1, 2, 3, 4]).unwrap();
        raw.read_bytes(0, 32, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        drop(raw);
        t.join().unwrap();
    }

    #[test]
    fn test_umdev_server_round_trip_and_fdless_dma() {
        let server = TestServer::start(TrivialDevice::default()).unwrap();
        let mut c = vfio_user::Client::new(server.path()).unwrap();
        c.region_write(0, 16, &[9, 8, 7, 6]).unwrap();
        let mut b = [0u8; 4];
        c.region_read(0, 16, &mut b).unwrap();
        assert_eq!(b, [9, 8, 7, 6]);
        c.shutdown().unwrap();
        drop(c);
        let mut raw = server.connect().unwrap();
        raw.posted_write(0, 32, &[1, 2, 3, 4]).unwrap();
        raw.read_bytes(0, 32, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        raw.set_fdless(FdlessMemory::new(1 << 32, 1 << 20));
        raw.dma_map_fdless(1 << 32, 1 << 20).unwrap();
        let dma = raw.serve_in_background().unwrap();
        let h = server.dma().handle();
        h.write((1 << 32) + 8, &[5, 6, 7]).unwrap();
        let mut got = [0u8; 3];
        h.read((1 << 32) + 8, &mut got).unwrap();
        assert_eq!(got, [5, 6, 7]);
        assert_eq!(dma.stop().unwrap(), 2);
    }
}
