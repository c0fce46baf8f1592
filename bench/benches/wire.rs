//! REGION_READ (4 bytes) round trip through the socket with `vfio_user::Client`, against
//! umdev's server and against `vfio_user::Server` serving the same trivial register device
//! (`umdev::testing::TrivialDevice`), side by side in one run. Both servers are the ones
//! `umdev bench wire` starts ([`umdev_bench::wire`]).
//!
//! Run briefly: `cargo bench -p umdev-bench --bench wire -- --measurement-time 3 --warm-up-time 1`.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use umdev_bench::wire::{client, spawn_umdev, spawn_vfio_user, stop_umdev};

fn region_read_round_trip(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();

    let umdev_path = dir.path().join("umdev.sock");
    let running = spawn_umdev(&umdev_path).expect("umdev server");
    let umdev_client = client(&umdev_path).expect("connect umdev");

    let base_path = dir.path().join("vfio_user.sock");
    let base_thread = spawn_vfio_user(&base_path, 1).expect("vfio_user server");
    let base_client = client(&base_path).expect("connect vfio_user");

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
    stop_umdev(running);
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
