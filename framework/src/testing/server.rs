//! Serving a device for a test: a real [`Server`] on a socket in a fresh temp dir, with its
//! own [`DmaSpace`], shut down when the [`TestServer`] is dropped.
//!
//! The server owns the device, but a test wants to look at it (how many pins it holds, what
//! it drew): the device is shared between the two through [`SharedDevice`], a
//! `Arc<Mutex<D>>` that implements [`Device`]. [`TestServer::device`] locks it briefly; the
//! connection thread takes the same lock for every message, so a test must not hold the
//! guard while it waits for a reply.
//!
//! **A device that panics.** The server's connection thread catches a panic in a device
//! call (the client gets EIO and is disconnected, the server serves on). The test server
//! also records it, with the name of the test that started the server (the test thread's
//! name), and prints it to the test's output at once: `the device of test `m::test_x`
//! panicked in region_write: ...`; [`TestServer::device_panics`] lists them. A panic in a
//! worker thread the device spawned in `attach` is printed by Rust's own panic hook into
//! the same test's output (`attach` runs on the test thread, so its threads inherit the
//! capture). A SIGSEGV (a write through a stale or read-only host address) cannot be caught
//! by anything in the process: it ends the whole test binary, and only the libtest line of
//! the test that was running tells which one. Copy pinned memory with
//! [`PinnedPages`](crate::dma::PinnedPages), which checks the range and the permission, and
//! that cause is gone.
//!
//! The remote DMA timeout is 2 s instead of the server's default, so that a test whose client
//! never answers a DMA_READ fails in seconds; [`TestServerBuilder::configure`] changes it and
//! anything else in [`ServerConfig`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::device::{Device, DeviceError, DeviceInfo, SetIrqs};
use crate::dma::{DmaConfig, DmaHandle, DmaSpace};
use crate::migration::{Migrate, MigrationCaps, MigrationError};
use crate::pci::{PciAdapter, PciDevice};
use crate::server::{RunningServer, Server, ServerConfig, ServerError};

use super::vmm::Vmm;

/// Remote DMA timeout of a test server (the server's default is QEMU's 5 s).
pub const TEST_REMOTE_DMA_TIMEOUT: Duration = Duration::from_secs(2);

/// A device owned jointly by the server and the test. Every [`Device`] call locks it; a
/// panic inside the device (the server catches it) leaves the lock usable.
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
    fn request_release(&mut self) -> bool {
        lock(&self.0).request_release()
    }
    fn migration(&mut self) -> Option<&mut dyn Migrate> {
        if lock(&self.0).migration().is_some() {
            Some(self)
        } else {
            None
        }
    }
}

/// The shared device's migration: each call locks the device and forwards to its own.
impl<D: Device> Migrate for SharedDevice<D> {
    fn caps(&self) -> MigrationCaps {
        // `Device::migration` needs `&mut`; the lock gives it.
        lock(&self.0)
            .migration()
            .map_or_else(MigrationCaps::default, |m| m.caps())
    }
    fn max_state_size(&self) -> u64 {
        lock(&self.0)
            .migration()
            .map_or(crate::migration::DEFAULT_MAX_STATE, |m| m.max_state_size())
    }
    fn stop(&mut self) -> Result<(), MigrationError> {
        with_migration(&self.0, |m| m.stop())
    }
    fn resume(&mut self) -> Result<(), MigrationError> {
        with_migration(&self.0, |m| m.resume())
    }
    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        with_migration(&self.0, |m| m.save())
    }
    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        with_migration(&self.0, |m| m.load(state))
    }
    fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        with_migration(&self.0, |m| m.precopy())
    }
    fn load_precopy(&mut self, chunk: &[u8]) -> Result<(), MigrationError> {
        with_migration(&self.0, |m| m.load_precopy(chunk))
    }
}

fn with_migration<D: Device, T>(
    dev: &Mutex<D>,
    f: impl FnOnce(&mut dyn Migrate) -> Result<T, MigrationError>,
) -> Result<T, MigrationError> {
    match lock(dev).migration() {
        Some(m) => f(m),
        None => Err(MigrationError::Device(
            "the device no longer offers migration".into(),
        )),
    }
}

/// Panics of a served device, and the test they belong to.
#[derive(Debug)]
struct DevicePanics {
    test: String,
    seen: Mutex<Vec<String>>,
}

/// The harness's outermost device: every call goes through `catch_unwind`, a panic is
/// recorded in [`DevicePanics`] and printed with the test's name, then resumed, so the
/// server answers it as it answers any device panic.
struct Watched<T> {
    inner: T,
    panics: Arc<DevicePanics>,
}

impl<T> Watched<T> {
    fn watch<R>(&mut self, call: &str, f: impl FnOnce(&mut T) -> R) -> R {
        let inner = &mut self.inner;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(inner))) {
            Ok(r) => r,
            Err(payload) => {
                let why = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(a non-string panic payload)".into());
                let note = format!(
                    "the device of test `{}` panicked in {call}: {why}",
                    self.panics.test
                );
                eprintln!("umdev::testing: {note}");
                lock(&self.panics.seen).push(note);
                std::panic::resume_unwind(payload)
            }
        }
    }
}

impl<T: Device> Device for Watched<T> {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.watch("region_read", |d| d.region_read(region, offset, data))
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.watch("region_write", |d| d.region_write(region, offset, data))
    }
    fn attach(&mut self, dma: DmaHandle) {
        self.watch("attach", |d| d.attach(dma))
    }
    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        self.watch("set_irqs", |d| d.set_irqs(req))
    }
    fn reset(&mut self) -> Result<(), DeviceError> {
        self.watch("reset", |d| d.reset())
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.watch("dma_unmap", |d| d.dma_unmap(iova, size))
    }
    fn disconnected(&mut self) {
        self.watch("disconnected", |d| d.disconnected())
    }
    fn request_release(&mut self) -> bool {
        self.watch("request_release", |d| d.request_release())
    }
    fn migration(&mut self) -> Option<&mut dyn Migrate> {
        self.inner.migration()
    }
}

/// A running server with its device, on `dev.sock` in a temp dir that is removed on drop.
pub struct TestServer<D: Device + 'static> {
    device: Arc<Mutex<D>>,
    dma: Arc<DmaSpace>,
    path: PathBuf,
    // Dropped before `dir`: the server stops before its directory goes away.
    running: Option<RunningServer>,
    dir: tempfile::TempDir,
    panics: Arc<DevicePanics>,
}

/// How a [`TestServer`] is started: DMA configuration, server configuration, directory.
pub struct TestServerBuilder<D> {
    device: D,
    dma: DmaConfig,
    config: ServerConfig,
    dir: Option<tempfile::TempDir>,
}

impl<D: Device + 'static> TestServerBuilder<D> {
    /// The DMA space's configuration (pin policy, limits); default [`DmaConfig::default`].
    pub fn dma_config(mut self, config: DmaConfig) -> Self {
        self.dma = config;
        self
    }

    /// Change the server configuration (the socket path is the server's own).
    pub fn configure(mut self, tune: impl FnOnce(&mut ServerConfig)) -> Self {
        tune(&mut self.config);
        self
    }

    /// Serve from `dir` (e.g. one that holds the device's backing image) instead of a new
    /// temp dir; it is removed when the server is dropped.
    pub fn in_dir(mut self, dir: tempfile::TempDir) -> Self {
        self.dir = Some(dir);
        self
    }

    /// Bind the socket and start serving.
    pub fn start(self) -> io::Result<TestServer<D>> {
        super::init_logs();
        let dir = match self.dir {
            Some(d) => d,
            None => tempfile::tempdir()?,
        };
        let path = dir.path().join("dev.sock");
        let mut config = self.config;
        config.socket_path = path.clone();
        let device = Arc::new(Mutex::new(self.device));
        let dma = DmaSpace::new(self.dma);
        let panics = Arc::new(DevicePanics {
            test: std::thread::current()
                .name()
                .unwrap_or("(unnamed thread)")
                .to_string(),
            seen: Mutex::new(Vec::new()),
        });
        let watched = Watched {
            inner: SharedDevice(device.clone()),
            panics: panics.clone(),
        };
        let running = Server::new(config, Box::new(watched), dma.clone())
            .spawn()
            .map_err(server_error)?;
        Ok(TestServer {
            device,
            dma,
            path,
            running: Some(running),
            dir,
            panics,
        })
    }
}

fn server_error(e: ServerError) -> io::Error {
    io::Error::other(e)
}

impl<D: Device + 'static> TestServer<D> {
    /// A builder for serving `device`.
    pub fn builder(device: D) -> TestServerBuilder<D> {
        let mut config = ServerConfig::new("");
        config.remote_dma_timeout = TEST_REMOTE_DMA_TIMEOUT;
        TestServerBuilder {
            device,
            dma: DmaConfig::default(),
            config,
            dir: None,
        }
    }

    /// Serve `device` with the default configuration.
    pub fn start(device: D) -> io::Result<TestServer<D>> {
        Self::builder(device).start()
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temp dir the socket lives in (removed on drop).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The device's DMA space (maps, pins, statistics).
    pub fn dma(&self) -> &Arc<DmaSpace> {
        &self.dma
    }

    /// Every panic of the device in a call from the server so far, oldest first, each as
    /// "the device of test `NAME` panicked in CALL: MESSAGE" (see the module docs).
    pub fn device_panics(&self) -> Vec<String> {
        lock(&self.panics.seen).clone()
    }

    /// The device, locked. Keep the guard short: the server locks it for every message.
    pub fn device(&self) -> MutexGuard<'_, D> {
        lock(&self.device)
    }

    /// Connect the embedded VMM (negotiated with [`super::DEFAULT_CAPS`]).
    pub fn connect(&self) -> io::Result<Vmm> {
        Vmm::connect(&self.path)
    }

    /// True while a client is attached (see [`RunningServer::client_attached`]); false
    /// once the last client's teardown has finished (or the server was taken out).
    pub fn client_attached(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(RunningServer::client_attached)
    }

    /// Take the running server out (to shut it down from another thread, say); the
    /// `TestServer` then only keeps the device, the DMA space and the directory.
    pub fn take_running(&mut self) -> Option<RunningServer> {
        self.running.take()
    }

    /// Stop the server and wait for it.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        match self.running.take() {
            Some(r) => r.shutdown(),
            None => Ok(()),
        }
    }

    /// Assert that nothing is pinned or locked in the DMA space, that the device leaked no
    /// pin the server had to release, and that the space's accounting scan agrees.
    #[track_caller]
    pub fn assert_space_unpinned(&self) {
        let s = self.dma.stats();
        assert_eq!(s.pinned_pages, 0, "pinned pages left: {s:?}");
        assert_eq!(s.locked_pages, 0, "locked pages left: {s:?}");
        assert_eq!(s.leaked_pins_released, 0, "device leaked pins: {s:?}");
        if let Err(e) = self.dma.check_invariants() {
            panic!("DMA space accounting: {e}");
        }
    }
}

impl<P: PciDevice + 'static> TestServer<PciAdapter<P>> {
    /// A builder for serving the PCI device `dev` (config space, BARs and interrupts by
    /// [`PciAdapter`]).
    pub fn builder_pci(dev: P) -> io::Result<TestServerBuilder<PciAdapter<P>>> {
        let adapter = PciAdapter::new(dev).map_err(io::Error::other)?;
        Ok(Self::builder(adapter))
    }

    /// Serve the PCI device `dev` with the default configuration.
    pub fn start_pci(dev: P) -> io::Result<TestServer<PciAdapter<P>>> {
        Self::builder_pci(dev)?.start()
    }
}
