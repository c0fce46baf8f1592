//! virtio-gpu TRANSFER_TO_HOST_2D's copy against memcpy, in the same run: a full 1920×1080
//! XRGB frame (8,294,400 bytes) copied out of a resource's pinned backing into host memory
//! with `PinnedBuffers::read`, the call `commands.rs` makes for a full-width rectangle,
//! for a backing of one entry (contiguous guest pages) and of one entry per page in
//! shuffled order (a fragmented guest), against a plain memcpy of the same bytes from a
//! second mapping of the same memfd.
//!
//! Run: `cargo bench -p umdev-bench --bench virtio_gpu_transfer` (`UMDEV_BENCH_QUICK=1`
//! for short measurement times).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use umdev::dma::PAGE_SIZE;
use umdev::virtio::{PinnedBuffers, Segment};
use umdev_bench::local_mapping::{memfd, LocalMapping};
use umdev_bench::pin::{map_region, PolicyArg, REGION_IOVA};

const FRAME: usize = 1920 * 1080 * 4;
const REGION_BYTES: u64 = 4096 * PAGE_SIZE;

fn configure(c: Criterion) -> Criterion {
    if std::env::var_os("UMDEV_BENCH_QUICK").is_some() {
        c.warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(800))
            .sample_size(10)
    } else {
        c.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .sample_size(30)
    }
}

fn bench_transfer(c: &mut Criterion) {
    let fd = memfd("umdev-bench-vgpu", 0, REGION_BYTES).expect("memfd");
    let space = map_region(
        fd.try_clone().expect("dup"),
        PolicyArg::Translate.policy(),
        REGION_BYTES,
    )
    .expect("map the bench region");
    let dma = space.handle();
    let local = LocalMapping::new(&fd, FRAME).expect("local mapping");
    dma.write(REGION_IOVA, &vec![7u8; FRAME]).unwrap(); // fault everything in
    let pages = FRAME.div_ceil(PAGE_SIZE as usize) as u64;
    let contiguous = [Segment {
        addr: REGION_IOVA,
        len: FRAME as u32,
    }];
    // One entry per page, in a fixed shuffled order (a multiplicative permutation).
    let mut scattered: Vec<Segment> = (0..pages)
        .map(|i| {
            let page = (i * 1031) % pages;
            Segment {
                addr: REGION_IOVA + page * PAGE_SIZE,
                len: PAGE_SIZE as u32,
            }
        })
        .collect();
    let last = FRAME as u64 - (pages - 1) * PAGE_SIZE;
    scattered.last_mut().unwrap().len = last as u32;
    let one = PinnedBuffers::pin(&dma, &contiguous, false).expect("pin");
    let many = PinnedBuffers::pin(&dma, &scattered, false).expect("pin");
    let mut resource = vec![0u8; FRAME];

    let mut g = c.benchmark_group("virtio_gpu_transfer_1080p");
    g.throughput(Throughput::Bytes(FRAME as u64));
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            local.copy_to(&mut resource);
            black_box(&mut resource);
        })
    });
    g.bench_function("transfer_contiguous_backing", |b| {
        b.iter(|| one.read(0, black_box(&mut resource)).unwrap())
    });
    g.bench_function("transfer_per_page_backing", |b| {
        b.iter(|| many.read(0, black_box(&mut resource)).unwrap())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = configure(Criterion::default());
    targets = bench_transfer
}
criterion_main!(benches);
