//! Shared rig of the guest-side, race and limit tests: a real umdev server on a temp-dir
//! socket serving an example device, the independent `vfio_user::Client` as the VMM, and the
//! test acting as the guest driver (registers through the socket, guest memory through a
//! memfd). The device is shared with the test through [`SharedDevice`] so the test can ask
//! it how many pins it holds while the server owns it.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use umdev::device::{region_index, Device, DeviceError, DeviceInfo, SetIrqs};
use umdev::dma::{DmaConfig, DmaHandle, DmaMapping, DmaSpace, Prot};
use umdev::pci::{PciAdapter, PciDevice};
use umdev::server::{RunningServer, Server, ServerConfig};

/// A device owned jointly by the server and the test.
pub struct SharedDevice<D>(pub Arc<Mutex<D>>);

fn lock<D>(m: &Mutex<D>) -> MutexGuard<'_, D> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<D: Device> Device for SharedDevice<D> {
    fn info(&self) -> DeviceInfo {
        lock(&self.0).info()
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        lock(&self.0).region_read(region, offset, data)
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        lock(&self.0).region_write(region, offset, data)
    }
    fn attach(&mut self, dma: DmaHandle) {
        lock(&self.0).attach(dma)
    }
    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        lock(&self.0).set_irqs(req)
    }
    fn reset(&mut self) -> Result<(), DeviceError> {
        lock(&self.0).reset()
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        lock(&self.0).dma_unmap(iova, size)
    }
    fn disconnected(&mut self) {
        lock(&self.0).disconnected()
    }
}

/// A running server with its (shared) PCI device.
pub struct Served<D: PciDevice> {
    pub dev: Arc<Mutex<PciAdapter<D>>>,
    pub dma: Arc<DmaSpace>,
    pub path: PathBuf,
    pub server: Option<RunningServer>,
    pub dir: tempfile::TempDir,
}

impl<D: PciDevice + Send + 'static> Served<D> {
    /// Serve `dev` on a fresh socket with a DMA space built from `dma_config`.
    pub fn start(
        dev: D,
        dma_config: DmaConfig,
        dir: tempfile::TempDir,
        tune: impl FnOnce(&mut ServerConfig),
    ) -> Served<D> {
        init_logs();
        let path = dir.path().join("dev.sock");
        let mut config = ServerConfig::new(&path);
        config.remote_dma_timeout = Duration::from_secs(2);
        tune(&mut config);
        let adapter = Arc::new(Mutex::new(PciAdapter::new(dev).unwrap()));
        let dma = DmaSpace::new(dma_config);
        let server = Server::new(config, Box::new(SharedDevice(adapter.clone())), dma.clone())
            .spawn()
            .unwrap();
        Served {
            dev: adapter,
            dma,
            path,
            server: Some(server),
            dir,
        }
    }

    /// The device (briefly: the server's connection thread needs it too).
    pub fn device(&self) -> MutexGuard<'_, PciAdapter<D>> {
        lock(&self.dev)
    }

    /// Connect the VMM.
    pub fn connect(&self) -> vfio_user::Client {
        vfio_user::Client::new(&self.path).expect("connect to the umdev socket")
    }

    /// DMA_MAP straight into the space (the vfio_user client maps read-write only).
    pub fn map_direct(&self, fd: OwnedFd, iova: u64, size: u64, offset: u64, prot: Prot) {
        self.dma
            .map(DmaMapping {
                iova,
                size,
                prot,
                fd: Some(fd),
                offset,
            })
            .unwrap();
    }

    /// Nothing pinned or locked in the space, and the accounting scan agrees.
    pub fn assert_space_unpinned(&self) {
        let s = self.dma.stats();
        assert_eq!(s.pinned_pages, 0, "pinned pages left: {s:?}");
        assert_eq!(s.locked_pages, 0, "locked pages left: {s:?}");
        assert_eq!(s.leaked_pins_released, 0, "device leaked pins: {s:?}");
        self.dma.check_invariants().unwrap();
    }
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

/// Poll `cond` every millisecond for up to `timeout`.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Route server logs to the test output (RUST_LOG controls the level; default: errors
/// only, since these tests provoke guest-error warnings on purpose).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_test_writer()
        .try_init();
}

/// A small deterministic PRNG (xorshift64*), so a failing seed can be replayed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A memfd of `size` bytes.
pub fn memfd(size: u64) -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: valid NUL-terminated name; the returned fd is checked below.
    let fd = unsafe { libc::memfd_create(c"umdev-hostile".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: fd is a fresh descriptor we own.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

/// Number of open fds of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}
