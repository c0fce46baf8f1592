//! Glue for the tests whose VMM is the independent `vfio_user::Client` (rust-vmm): umdev is
//! checked there against a client nobody here wrote, so these tests keep it. Serving the
//! device and everything else comes from `umdev::testing`.
#![allow(dead_code)]

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use umdev::device::region_index;
use umdev::dma::DmaSpace;
use umdev_devices::gpu::driver::RegisterAccess;

/// Connect the independent client to the socket at `path`.
pub fn connect(path: &Path) -> vfio_user::Client {
    vfio_user::Client::new(path).expect("connect to the umdev socket")
}

/// Enable memory decoding and bus mastering in the command register, as a guest does.
pub fn enable_device(client: &mut vfio_user::Client) {
    client
        .region_write(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
}

/// DMA_MAP `size` bytes of `fd` at `offset` to `iova` through the client and check that the
/// server took it (the vfio_user client does not look at the reply's error).
pub fn client_map(
    client: &mut vfio_user::Client,
    dma: &DmaSpace,
    fd: &impl AsRawFd,
    offset: u64,
    iova: u64,
    size: u64,
) {
    let before = dma.stats().maps;
    client.dma_map(offset, iova, size, fd.as_raw_fd()).unwrap();
    assert_eq!(dma.stats().maps, before + 1, "DMA_MAP {iova:#x} refused");
}

/// Read the 32-bit BAR0 register at `off` through the client.
pub fn bar0_read32(client: &mut vfio_user::Client, off: u64) -> u32 {
    let mut b = [0u8; 4];
    client.region_read(region_index::BAR0, off, &mut b).unwrap();
    u32::from_le_bytes(b)
}

/// Write the 32-bit BAR0 register at `off` through the client.
pub fn bar0_write32(client: &mut vfio_user::Client, off: u64, v: u32) {
    client
        .region_write(region_index::BAR0, off, &v.to_le_bytes())
        .unwrap();
}

/// Walk the capability list through the client; the config offset of capability `id`.
pub fn find_capability(client: &mut vfio_user::Client, id: u8) -> Option<u64> {
    let mut b = [0u8; 1];
    client
        .region_read(region_index::CONFIG, 0x34, &mut b)
        .unwrap();
    let mut ptr = u64::from(b[0] & !3);
    for _ in 0..48 {
        if ptr == 0 {
            return None;
        }
        let mut hdr = [0u8; 2];
        client
            .region_read(region_index::CONFIG, ptr, &mut hdr)
            .unwrap();
        if hdr[0] == id {
            return Some(ptr);
        }
        ptr = u64::from(hdr[1] & !3);
    }
    None
}

fn io_err(e: vfio_user::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// BAR0 through the independent client, as the GPU guest driver's register access. 64-bit
/// registers are written as two 32-bit halves (high first) unless `whole_64` is set.
pub struct SocketRegs {
    /// The client.
    pub client: vfio_user::Client,
    /// Write 64-bit registers with one 8-byte access.
    pub whole_64: bool,
}

impl SocketRegs {
    /// 64-bit registers as two 32-bit writes, as a 32-bit guest driver writes them.
    pub fn new(client: vfio_user::Client) -> SocketRegs {
        SocketRegs {
            client,
            whole_64: false,
        }
    }
}

impl RegisterAccess for SocketRegs {
    fn read32(&mut self, off: u64) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.client
            .region_read(region_index::BAR0, off, &mut b)
            .map_err(io_err)?;
        Ok(u32::from_le_bytes(b))
    }

    fn write32(&mut self, off: u64, val: u32) -> io::Result<()> {
        self.client
            .region_write(region_index::BAR0, off, &val.to_le_bytes())
            .map_err(io_err)
    }

    fn write64(&mut self, off: u64, val: u64) -> io::Result<()> {
        if !self.whole_64 {
            self.write32(off + 4, (val >> 32) as u32)?;
            return self.write32(off, val as u32);
        }
        self.client
            .region_write(region_index::BAR0, off, &val.to_le_bytes())
            .map_err(io_err)
    }
}
