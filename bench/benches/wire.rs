//! REGION_READ (4 bytes) round trip through the socket with `vfio_user::Client`, against
//! umdev's server and against `vfio_user::Server` serving the same trivial register device
//! (`umdev::testing::TrivialDevice`), side by side in one run.
//!
//! Run briefly: `cargo bench -p umdev-bench --bench wire -- --measurement-time 3 --warm-up-time 1`.

use std::cell::RefCell;
use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use umdev::device::{region_index, Device, REGION_FLAG_READ, REGION_FLAG_WRITE};
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::server::{Server, ServerConfig};
use umdev::testing::TrivialDevice;
use vfio_bindings::bindings::vfio::vfio_region_info;

/// The trivial register device (umdev::testing's) as a `vfio_user::ServerBackend`; DMA
/// maps are accepted and ignored.
#[derive(Default)]
struct Baseline(TrivialDevice);

fn io_err(e: umdev::device::DeviceError) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.errno())
}

impl vfio_user::ServerBackend for Baseline {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        self.0.region_read(region, offset, data).map_err(io_err)
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.0.region_write(region, offset, data).map_err(io_err)
    }
    fn dma_map(
        &mut self,
        _flags: vfio_user::DmaMapFlags,
        _offset: u64,
        _address: u64,
        _size: u64,
        _fd: Option<File>,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn dma_unmap(
        &mut self,
        _flags: vfio_user::DmaUnmapFlags,
        _address: u64,
        _size: u64,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> std::io::Result<()> {
        self.0.reset().map_err(io_err)
    }
    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<File>,
    ) -> std::io::Result<()> {
        Ok(())
    }
}

fn baseline_server(path: &Path) -> std::thread::JoinHandle<()> {
    let regions = (0..region_index::COUNT)
        .map(|index| {
            let size = TrivialDevice::region_size(index);
            let flags = if size > 0 {
                REGION_FLAG_READ | REGION_FLAG_WRITE
            } else {
                0
            };
            vfio_user::ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags,
                    index,
                    cap_offset: 0,
                    size,
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect();
    let server =
        vfio_user::Server::new(path, false, Vec::new(), regions).expect("vfio_user server");
    std::thread::spawn(move || {
        let mut backend = Baseline::default();
        let _ = server.run(&mut backend);
    })
}

fn region_read_round_trip(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();

    let umdev_path = dir.path().join("umdev.sock");
    let dma = DmaSpace::new(DmaConfig::default());
    let running = Server::new(
        ServerConfig::new(&umdev_path),
        Box::new(TrivialDevice::default()),
        dma,
    )
    .spawn()
    .expect("umdev server");
    let umdev_client = vfio_user::Client::new(&umdev_path).expect("connect umdev");

    let base_path = dir.path().join("vfio_user.sock");
    let base_thread = baseline_server(&base_path);
    let base_client = vfio_user::Client::new(&base_path).expect("connect vfio_user");

    // The machine is shared and noisy: time each server in chunks of CHUNK calls and run
    // the same number of untimed calls against the other server in between, so both
    // measurements see the same background load.
    const CHUNK: u64 = 64;
    let clients = RefCell::new((umdev_client, base_client));
    let mut group = c.benchmark_group("region_read_4B");
    for (name, timed_is_umdev) in [("umdev", true), ("vfio_user_server", false)] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut guard = clients.borrow_mut();
                let (u, v) = &mut *guard;
                let (timed, other) = if timed_is_umdev { (u, v) } else { (v, u) };
                let mut buf = [0u8; 4];
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(CHUNK);
                    let start = Instant::now();
                    for _ in 0..n {
                        timed.region_read(0, 0x10, &mut buf).unwrap();
                    }
                    total += start.elapsed();
                    for _ in 0..n {
                        other.region_read(0, 0x10, &mut buf).unwrap();
                    }
                    left -= n;
                }
                total
            })
        });
    }
    group.finish();
    let (mut umdev_client, mut base_client) = clients.into_inner();

    let mut check = [0u8; 4];
    umdev_client.region_read(0, 0x10, &mut check).unwrap();
    assert_eq!(check, [0x10, 0x11, 0x12, 0x13]);
    base_client.region_read(0, 0x10, &mut check).unwrap();
    assert_eq!(check, [0x10, 0x11, 0x12, 0x13]);

    drop(umdev_client);
    running.shutdown().unwrap();
    let _ = base_client.shutdown();
    drop(base_client);
    let _ = base_thread.join();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = region_read_round_trip
}
criterion_main!(benches);
