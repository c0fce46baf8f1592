//! Pin benchmarks: coalesced `pin_pages` vs the per-page reference path (`naive()`), in the
//! same run, for arrays of 1..4096 pages in every pattern of `umdev bench pin` and each
//! residency policy; and `dma_rw` of 1 MiB vs a plain memcpy of the same mapping.
//!
//! Each iteration pins the array and unpins it again (so `Lock` accounting stays flat).
//! Memory: one memfd-backed mapping of 4 KiB pages. Arrays, region and measurement are
//! umdev-bench's, the ones `umdev bench pin` uses.
//!
//! After the criterion runs, a paired summary prints `umdev bench pin`'s interleaved
//! measurement of the same cells ([`umdev_bench::pin::measure`]) as a markdown table: on a
//! loaded machine that is far more robust than comparing two criterion results measured
//! seconds apart.
//!
//! Run: `cargo bench -p umdev-bench --bench pin` (full) or with `UMDEV_BENCH_QUICK=1` for
//! short measurement times; a filter narrows the criterion part, e.g.
//! `-- 'pin/lock/contiguous'`; `UMDEV_BENCH_CRITERION=0` runs only the paired table,
//! `UMDEV_BENCH_PAIRED=0` skips it, `UMDEV_BENCH_ONLY=lock/contiguous` restricts its pin rows.

use std::hint::black_box;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, BenchmarkId, Criterion};
use umdev::dma::{DmaError, DmaHandle, DmaSpace, Prot, PAGE_SIZE};
use umdev_bench::local_mapping::{memfd, LocalMapping};
use umdev_bench::patterns::Pattern;
use umdev_bench::pin::{map_region, measure, PolicyArg, Work, REGION_IOVA};
use umdev_bench::report::{paired_ratio, PairRow, SideResult};
use umdev_bench::sampler::{interleaved, SamplePlan};

/// Bytes in the benchmark mapping (64 MiB: the largest array, 4096 pages, in any pattern).
const REGION_BYTES: u64 = 16384 * PAGE_SIZE;
const SIZES: [usize; 5] = [1, 8, 64, 512, 4096];
/// Seed of the seeded patterns (`umdev bench pin`'s default).
const SEED: u64 = 0x5eed;
/// Bytes per dma_rw call.
const RW_LEN: usize = 1 << 20;

fn setup(policy: PolicyArg) -> (Arc<DmaSpace>, DmaHandle, OwnedFd) {
    let fd = memfd("umdev-bench", 0, REGION_BYTES).expect("memfd");
    let space = map_region(fd.try_clone().expect("dup"), policy.policy(), REGION_BYTES)
        .expect("map the bench region");
    let h = space.handle();
    (space, h, fd)
}

fn quick() -> bool {
    std::env::var_os("UMDEV_BENCH_QUICK").is_some()
}

fn configure(c: Criterion) -> Criterion {
    if quick() {
        c.warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10)
    } else {
        c.warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(20)
    }
}

fn bench_pin(c: &mut Criterion) {
    for policy in PolicyArg::ALL {
        let (_space, h, _fd) = setup(policy);
        for pattern in Pattern::ALL {
            let mut g = c.benchmark_group(format!("pin/{}/{}", policy.name(), pattern.name()));
            for n in SIZES {
                let w = Work::synthetic(pattern, n, SEED);
                let pfns = &w.arrays[0].0;
                let mut addrs = vec![0u64; n];
                // Interleave the two paths per size so drift hits both alike.
                g.bench_with_input(BenchmarkId::new("coalesced", n), pfns, |b, pfns| {
                    b.iter(|| {
                        h.pin_pages(black_box(pfns), Prot::RW, &mut addrs).unwrap();
                        h.unpin_pages(black_box(pfns)).unwrap();
                    })
                });
                g.bench_with_input(BenchmarkId::new("naive", n), pfns, |b, pfns| {
                    let naive = h.naive();
                    b.iter(|| {
                        naive
                            .pin_pages(black_box(pfns), Prot::RW, &mut addrs)
                            .unwrap();
                        naive.unpin_pages(black_box(pfns)).unwrap();
                    })
                });
            }
            g.finish();
        }
    }
}

/// The bench region under Translate, faulted in, and a second local mapping of the same
/// memfd for the memcpy baseline.
fn rw_setup() -> (Arc<DmaSpace>, DmaHandle, LocalMapping) {
    let (space, h, fd) = setup(PolicyArg::Translate);
    let local = LocalMapping::new(&fd, RW_LEN).expect("local mapping");
    h.write(REGION_IOVA, &vec![1u8; RW_LEN]).unwrap(); // fault everything in
    (space, h, local)
}

fn bench_rw(c: &mut Criterion) {
    let (_space, h, local) = rw_setup();
    let mut buf = vec![1u8; RW_LEN];
    let mut g = c.benchmark_group("dma_rw_1MiB");
    g.throughput(criterion::Throughput::Bytes(RW_LEN as u64));
    g.bench_function("dma_read", |b| {
        b.iter(|| h.read(REGION_IOVA, black_box(&mut buf)).unwrap())
    });
    g.bench_function("memcpy_read", |b| {
        b.iter(|| {
            local.copy_to(&mut buf);
            black_box(&mut buf);
        })
    });
    g.bench_function("dma_write", |b| {
        b.iter(|| h.write(REGION_IOVA, black_box(&buf)).unwrap())
    });
    g.bench_function("memcpy_write", |b| {
        b.iter(|| local.copy_from(black_box(&buf)))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = configure(Criterion::default());
    targets = bench_pin, bench_rw
}

/// The paired summary's sampling: many short interleaved samples of about 200 µs.
fn paired_plan() -> SamplePlan {
    SamplePlan {
        warmup: Duration::from_millis(10),
        samples: if quick() { 15 } else { 41 },
        sample_target: Duration::from_micros(200),
        max_iters: 100_000,
        cell_budget: None,
        min_samples: 1,
    }
}

/// The paired summary table (printed after the criterion runs).
fn paired_summary() {
    let plan = paired_plan();
    println!(
        "\n## umdev pin: coalesced vs per-page, paired (median of {} interleaved samples)\n",
        plan.samples
    );
    println!("| policy | pattern | pages | coalesced ns | per-page ns | speedup (per-page / coalesced) |");
    println!("|---|---|---:|---:|---:|---:|");
    let only = std::env::var("UMDEV_BENCH_ONLY").unwrap_or_default();
    for policy in PolicyArg::ALL {
        let (_space, h, _fd) = setup(policy);
        for pattern in Pattern::ALL {
            let (pname, pat) = (policy.name(), pattern.name());
            if !format!("{pname}/{pat}").contains(&only) {
                continue;
            }
            for n in SIZES {
                let (coalesced, per_page) =
                    measure(&h, &Work::synthetic(pattern, n, SEED), &plan, false)
                        .unwrap_or_else(|e| panic!("{pname} {pat} {n}: {e}"));
                println!(
                    "| {pname} | {pat} | {n} | {:.0} | {:.0} | {:.2}x |",
                    coalesced.ns_per_array,
                    per_page.ns_per_array,
                    paired_ratio(&coalesced, &per_page).median
                );
            }
        }
    }
    let (_space, h, local) = rw_setup();
    let mut buf = vec![1u8; RW_LEN];
    let mut buf2 = vec![1u8; RW_LEN];
    let (read, copy) = interleaved(
        &plan,
        &mut || h.read(REGION_IOVA, black_box(&mut buf)),
        &mut || -> Result<(), DmaError> {
            local.copy_to(&mut buf2);
            black_box(&mut buf2);
            Ok(())
        },
        &mut || 0,
    )
    .expect("dma read");
    let read = PairRow::new(
        "read",
        RW_LEN as u64,
        SideResult::new("dma_read", &read),
        SideResult::new("memcpy", &copy),
    );
    let (write, copy) = interleaved(
        &plan,
        &mut || h.write(REGION_IOVA, black_box(&buf)),
        &mut || -> Result<(), DmaError> {
            local.copy_from(black_box(&buf2));
            Ok(())
        },
        &mut || 0,
    )
    .expect("dma write");
    let write = PairRow::new(
        "write",
        RW_LEN as u64,
        SideResult::new("dma_write", &write),
        SideResult::new("memcpy", &copy),
    );
    println!("\n| dma_rw 1 MiB | dma_rw ns | memcpy ns | dma_rw throughput vs memcpy |");
    println!("|---|---:|---:|---:|");
    for r in [read, write] {
        println!(
            "| {} | {:.0} | {:.0} | {:.0}% |",
            r.group,
            r.a.ns.median,
            r.b.ns.median,
            100.0 / r.ratio_paired.median
        );
    }
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    if std::env::var_os("UMDEV_BENCH_CRITERION").is_none_or(|v| v != "0") {
        benches();
        Criterion::default().configure_from_args().final_summary();
    }
    if bench_mode && std::env::var_os("UMDEV_BENCH_PAIRED").is_none_or(|v| v != "0") {
        paired_summary();
    }
}
