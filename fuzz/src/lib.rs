//! Shared pieces of the umdev fuzz targets: the wire tests' test device (the same source
//! file), the daemon's control protocol (`umdev::daemon::protocol`), and a one-connection
//! server harness over a socketpair.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umdev::device::{Device, DeviceError, DeviceInfo, SetIrqs};
use umdev::dma::DmaHandle;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::server::channel::Channel;
use umdev::server::connection::Connection;
use umdev::server::ServerConfig;

/// The daemon's control protocol: `umdev::daemon::protocol`.
pub use umdev::daemon::protocol as control_protocol;

#[path = "../../tests/common/test_device.rs"]
#[allow(dead_code)]
pub mod test_device;

/// The test device minus its deliberate-panic register (`REG_PANIC`, which exists to test
/// that the server survives a panicking device): libFuzzer's panic hook aborts on every
/// panic, caught or not, so writes there are refused instead.
struct Fuzzed(test_device::TestDevice);

impl Device for Fuzzed {
    fn info(&self) -> DeviceInfo {
        self.0.info()
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.0.region_read(region, offset, data)
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let end = offset.saturating_add(data.len() as u64);
        if region == 0 && offset < test_device::REG_PANIC + 8 && end > test_device::REG_PANIC {
            return Err(DeviceError::InvalidArgument("panic register".into()));
        }
        self.0.region_write(region, offset, data)
    }
    fn attach(&mut self, dma: DmaHandle) {
        self.0.attach(dma)
    }
    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        self.0.set_irqs(req)
    }
    fn reset(&mut self) -> Result<(), DeviceError> {
        self.0.reset()
    }
    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.0.dma_unmap(iova, size)
    }
    fn disconnected(&mut self) {
        self.0.disconnected()
    }
}

/// A memfd of `size` bytes (used by the test device for its BAR2).
pub fn memfd(size: u64) -> std::fs::File {
    use std::os::fd::FromRawFd;
    let name = c"umdev-fuzz";
    // SAFETY: valid NUL-terminated name; the result is checked below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: fd is a fresh descriptor we own.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size).expect("memfd size");
    f
}

/// Feed `bytes` to one server connection (test device, fresh DMA space) as if a client had
/// written them and then hung up; drain what the server answers. Returns when the
/// connection thread has finished (it must neither panic nor hang) and checks that the
/// disconnect released every map and pin.
pub fn run_stream(bytes: &[u8], twin: bool) {
    let (client, server) = UnixStream::pair().expect("socketpair");
    let mut config = ServerConfig::new("/nonexistent/fuzz.sock");
    config.remote_dma_timeout = Duration::from_millis(20);
    config.twin_socket = twin;
    let (device, _state) = test_device::TestDevice::new();
    let dma = DmaSpace::new(DmaConfig::default());
    let mut device: Box<dyn Device> = Box::new(Fuzzed(device));
    device.attach(dma.handle());
    let device = Arc::new(Mutex::new(device));
    let chan = Arc::new(
        Channel::new(
            server,
            config.max_message_size(),
            config.offer().max_data_xfer_size,
            config.remote_dma_timeout,
        )
        .expect("channel"),
    );
    let conn = Connection::new(chan, device, dma.clone(), config);
    let t = std::thread::spawn(move || conn.run());
    let reader = client.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut r = reader;
        let mut buf = [0u8; 8192];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    let mut w = &client;
    let _ = w.write_all(bytes);
    let _ = client.shutdown(std::net::Shutdown::Write);
    t.join().expect("connection thread panicked");
    drop(client);
    drain.join().expect("drain thread panicked");
    let s = dma.stats();
    assert_eq!(s.maps, 0, "maps left after disconnect");
    assert_eq!(s.pinned_pages, 0, "pins left after disconnect");
}

/// A valid VERSION command (max_data_xfer_size 4096 keeps transfers small, plus an unknown
/// key that must be ignored).
pub fn version_message() -> Vec<u8> {
    use umdev::protocol::{encode_message, Command, Header};
    let mut p = vec![0u8, 0, 0, 0];
    p.extend_from_slice(
        br#"{"capabilities":{"max_data_xfer_size":4096,"write_multiple":true,"x":[1]}}"#,
    );
    p.push(0);
    encode_message(&Header::command(1, Command::Version, p.len()), &p)
}
