//! The connection thread asks for `ServerConfig::thread_slice` (a short time slice, so that
//! a woken connection thread preempts CPU-bound threads on a busy host).

use std::time::Duration;

use umdev::device::{region_index, Device, DeviceError, DeviceInfo};
use umdev::server::slice::thread_slice;
use umdev::testing::{DeviceAccess, TestServer, TrivialDevice};

/// TrivialDevice, except that BAR0's first word reads as the serving thread's requested
/// time slice in µs.
#[derive(Default)]
struct SliceProbe(TrivialDevice);

impl Device for SliceProbe {
    fn info(&self) -> DeviceInfo {
        self.0.info()
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        if region == region_index::BAR0 && offset == 0 && data.len() == 4 {
            let us = thread_slice().map_or(u32::MAX, |d| d.as_micros() as u32);
            data.copy_from_slice(&us.to_le_bytes());
            return Ok(());
        }
        self.0.region_read(region, offset, data)
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.0.region_write(region, offset, data)
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        self.0.reset()
    }
}

/// Linux (major, minor): before 6.12 a fair task's `sched_runtime` is not kept.
fn kernel() -> (u32, u32) {
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut it = rel.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn served_slice(slice: Option<Duration>) -> u32 {
    let server = TestServer::builder(SliceProbe::default())
        .configure(|c| c.thread_slice = slice)
        .start()
        .unwrap();
    let mut vmm = server.connect().unwrap();
    vmm.read32(region_index::BAR0, 0).unwrap()
}

#[test]
fn test_connection_thread_asks_for_the_configured_time_slice() {
    if kernel() < (6, 12) {
        eprintln!("skipped: Linux < 6.12 does not keep a fair task's slice");
        return;
    }
    assert_eq!(served_slice(Some(umdev::server::DEFAULT_THREAD_SLICE)), 100);
    assert_eq!(served_slice(Some(Duration::from_micros(500))), 500);
    // The default is the short slice; None: the kernel's default slice (reported as
    // sched_runtime, e.g. 1.4 ms here).
    assert_eq!(
        umdev::server::ServerConfig::new("s").thread_slice,
        Some(umdev::server::DEFAULT_THREAD_SLICE)
    );
    let default = served_slice(None);
    assert!(
        default > 500,
        "None: the kernel's default, got {default} µs"
    );
}
