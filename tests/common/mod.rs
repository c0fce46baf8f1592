//! The wire tests' own device ([`test_device`]), served through umdev's test harness; the
//! raw client and the rest come from [`umdev::testing`]. The device file is shared with the
//! fuzz targets (`fuzz/src/lib.rs`), which is why it asks its parent module for `memfd`.
#![allow(dead_code, unused_imports)]

pub mod test_device;

use std::fs::File;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use umdev::server::ServerConfig;

pub use test_device::{DeviceState, TestDevice};

/// A running server with its test device, on a socket in a temp dir (everything of
/// [`umdev::testing::TestServer`], plus the device's observable state).
pub struct TestServer {
    server: umdev::testing::TestServer<TestDevice>,
    state: Arc<Mutex<DeviceState>>,
}

impl Deref for TestServer {
    type Target = umdev::testing::TestServer<TestDevice>;

    fn deref(&self) -> &Self::Target {
        &self.server
    }
}

impl TestServer {
    pub fn start() -> TestServer {
        Self::start_with(|_| {})
    }

    pub fn start_with(tune: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let (device, state) = TestDevice::new();
        let server = umdev::testing::TestServer::builder(device)
            .configure(tune)
            .start()
            .unwrap();
        TestServer { server, state }
    }

    pub fn state(&self) -> MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap()
    }

    /// The running server, taken out (to shut it down elsewhere).
    pub fn take_running(&mut self) -> Option<umdev::server::RunningServer> {
        self.server.take_running()
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

/// A memfd of `size` bytes (for the test device's BAR2).
pub fn memfd(size: u64) -> File {
    umdev::testing::memfd(size).unwrap()
}
