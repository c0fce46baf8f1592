//! Shared helpers of the wire tests: a small test device, a raw protocol client, and a
//! server launcher on a temp-dir socket.
#![allow(dead_code, unused_imports)]

pub mod raw_client;
pub mod test_device;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umdev::dma::{DmaConfig, DmaSpace};
use umdev::server::{RunningServer, Server, ServerConfig};

pub use raw_client::RawClient;
pub use test_device::{DeviceState, TestDevice};

/// A running server with its test device, on a socket in a temp dir.
pub struct TestServer {
    pub server: Option<RunningServer>,
    pub state: Arc<Mutex<DeviceState>>,
    pub dma: Arc<DmaSpace>,
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn start() -> TestServer {
        Self::start_with(|_| {})
    }

    pub fn start_with(tune: impl FnOnce(&mut ServerConfig)) -> TestServer {
        init_logs();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.sock");
        let mut config = ServerConfig::new(&path);
        config.remote_dma_timeout = Duration::from_secs(2);
        tune(&mut config);
        let (device, state) = TestDevice::new();
        let dma = DmaSpace::new(DmaConfig::default());
        let server = Server::new(config, Box::new(device), dma.clone())
            .spawn()
            .unwrap();
        TestServer {
            server: Some(server),
            state,
            dma,
            path,
            _dir: dir,
        }
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap()
    }

    /// Wait (≤ 2 s) until `cond` holds on the device state.
    pub fn wait_for(&self, what: &str, cond: impl Fn(&DeviceState) -> bool) {
        for _ in 0..400 {
            if cond(&self.state()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("timed out waiting for {what}");
    }
}

/// Route server logs to the test output (RUST_LOG controls the level).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A memfd of `size` bytes.
pub fn memfd(size: u64) -> std::fs::File {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new("umdev-test").unwrap();
    // SAFETY: valid NUL-terminated name; the returned fd is checked below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: fd is a fresh descriptor we own.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}
