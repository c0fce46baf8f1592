//! Pin benchmarks: coalesced `pin_pages` vs the per-page reference path (`naive()`), in the
//! same run, for arrays of 1..4096 pages in four patterns and each residency policy; and
//! `dma_rw` of 1 MiB vs a plain memcpy of the same mapping.
//!
//! Each iteration pins the array and unpins it again (so `Lock` accounting stays flat).
//! Memory: one memfd-backed mapping of 4 KiB pages.
//!
//! After the criterion runs, a paired summary alternates short batches of the two paths and
//! prints median per-round ratios as a markdown table: on a loaded machine this is far more
//! robust than comparing two criterion results measured seconds apart.
//!
//! Run: `cargo bench -p umdev-bench --bench pin` (full) or with `UMDEV_BENCH_QUICK=1` for short
//! measurement times; a filter narrows the criterion part, e.g. `-- 'pin/Lock/contiguous'`;
//! `UMDEV_BENCH_CRITERION=0` runs only the paired table, `UMDEV_BENCH_PAIRED=0` skips it,
//! `UMDEV_BENCH_ONLY=Lock/contiguous` restricts its pin rows.

use std::hint::black_box;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion};
use umdev::dma::{DmaConfig, DmaHandle, DmaMapping, DmaSpace, PinPolicy, Prot, PAGE_SIZE};

/// Pages in the benchmark mapping (64 MiB).
const REGION_PAGES: u64 = 16384;
/// First IOVA page of the mapping.
const BASE_PFN: u64 = 0x10_0000;
const SIZES: [usize; 5] = [1, 8, 64, 512, 4096];

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a static NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"umdev-bench".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own fd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

fn setup(policy: PinPolicy) -> (Arc<DmaSpace>, DmaHandle, OwnedFd) {
    let space = DmaSpace::new(DmaConfig {
        policy,
        lock_limit_bytes: Some(1 << 40),
        max_dma_maps: 65535,
    });
    let fd = memfd(REGION_PAGES * PAGE_SIZE);
    space
        .map(DmaMapping {
            iova: BASE_PFN * PAGE_SIZE,
            size: REGION_PAGES * PAGE_SIZE,
            prot: Prot::RW,
            fd: Some(fd.try_clone().expect("dup")),
            offset: 0,
        })
        .expect("map");
    let h = space.handle();
    (space, h, fd)
}

/// A tiny deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The page arrays of each pattern, all inside the mapping.
fn pattern(name: &str, n: usize) -> Vec<u64> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
    let v: Vec<u64> = match name {
        "contiguous" => (0..n as u64).collect(),
        "scattered" => (0..n as u64).map(|i| 2 * i).collect(),
        "ccw" => {
            // Runs of 1..=16 pages separated by gaps of 1..=4 pages (IDAW-list like).
            let mut v = Vec::with_capacity(n);
            let mut p = 0u64;
            while v.len() < n {
                let run = 1 + rng.next() % 16;
                for _ in 0..run {
                    if v.len() < n {
                        v.push(p);
                        p += 1;
                    }
                }
                p += 1 + rng.next() % 4;
            }
            v
        }
        "random" => {
            let mut v: Vec<u64> = (0..n as u64).collect();
            for i in (1..v.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                v.swap(i, j);
            }
            v
        }
        _ => unreachable!(),
    };
    v.into_iter().map(|p| BASE_PFN + p).collect()
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
    for (policy, pname) in [
        (PinPolicy::Translate, "Translate"),
        (PinPolicy::Lock, "Lock"),
        (PinPolicy::Populate, "Populate"),
    ] {
        let (_space, h, _fd) = setup(policy);
        for pat in ["contiguous", "scattered", "ccw", "random"] {
            let mut g = c.benchmark_group(format!("pin/{pname}/{pat}"));
            for n in SIZES {
                let pfns = pattern(pat, n);
                let mut addrs = vec![0u64; n];
                // Interleave the two paths per size so drift hits both alike.
                g.bench_with_input(BenchmarkId::new("coalesced", n), &pfns, |b, pfns| {
                    b.iter(|| {
                        h.pin_pages(black_box(pfns), Prot::RW, &mut addrs).unwrap();
                        h.unpin_pages(black_box(pfns)).unwrap();
                    })
                });
                g.bench_with_input(BenchmarkId::new("naive", n), &pfns, |b, pfns| {
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

fn bench_rw(c: &mut Criterion) {
    const LEN: usize = 1 << 20;
    let (_space, h, fd) = setup(PinPolicy::Translate);
    // Our own mapping of the same memfd for the memcpy baseline.
    // SAFETY: a fresh shared mapping of our memfd; accessed only with raw copies below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let mut buf = vec![1u8; LEN];
    h.write(BASE_PFN * PAGE_SIZE, &buf).unwrap(); // fault everything in
    let mut g = c.benchmark_group("dma_rw_1MiB");
    g.throughput(criterion::Throughput::Bytes(LEN as u64));
    g.bench_function("dma_read", |b| {
        b.iter(|| h.read(BASE_PFN * PAGE_SIZE, black_box(&mut buf)).unwrap())
    });
    g.bench_function("memcpy_read", |b| {
        b.iter(|| {
            // SAFETY: `base` maps LEN bytes; `buf` holds LEN bytes; distinct memory.
            unsafe { std::ptr::copy_nonoverlapping(base as *const u8, buf.as_mut_ptr(), LEN) };
            black_box(&mut buf);
        })
    });
    g.bench_function("dma_write", |b| {
        b.iter(|| h.write(BASE_PFN * PAGE_SIZE, black_box(&buf)).unwrap())
    });
    g.bench_function("memcpy_write", |b| {
        b.iter(|| {
            // SAFETY: as above, in the other direction.
            unsafe {
                std::ptr::copy_nonoverlapping(black_box(&buf).as_ptr(), base as *mut u8, LEN)
            };
        })
    });
    g.finish();
    // SAFETY: unmapping our own mapping; no reference into it remains.
    unsafe { libc::munmap(base, LEN) };
}

criterion_group! {
    name = benches;
    config = configure(Criterion::default());
    targets = bench_pin, bench_rw
}

/// Time `k` runs of `f`, in nanoseconds per run.
fn time_batch(k: u32, f: &mut dyn FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..k {
        f();
    }
    t.elapsed().as_nanos() as f64 / f64::from(k)
}

/// Paired measurement robust to load drift on a shared machine: alternate batches of `a`
/// and `b` (order swapped every round) and return (median ns of a, median ns of b, median
/// of the per-round ratios b / a).
fn paired(rounds: usize, a: &mut dyn FnMut(), b: &mut dyn FnMut()) -> (f64, f64, f64) {
    // Calibrate a batch to about 200 µs of the slower side.
    let one = time_batch(1, a).max(time_batch(1, b)).max(1.0);
    let k = ((200_000.0 / one) as u32).clamp(1, 100_000);
    time_batch(k, a);
    time_batch(k, b);
    let (mut ta, mut tb, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let (x, y) = if i % 2 == 0 {
            let x = time_batch(k, a);
            (x, time_batch(k, b))
        } else {
            let y = time_batch(k, b);
            (time_batch(k, a), y)
        };
        ta.push(x);
        tb.push(y);
        r.push(y / x);
    }
    (median(ta), median(tb), median(r))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The paired summary table (printed after the criterion runs).
fn paired_summary() {
    let rounds = if quick() { 15 } else { 41 };
    println!(
        "\n## umdev pin: coalesced vs per-page, paired (median of {rounds} alternating rounds)\n"
    );
    println!("| policy | pattern | pages | coalesced ns | per-page ns | speedup (per-page / coalesced) |");
    println!("|---|---|---:|---:|---:|---:|");
    for (policy, pname) in [
        (PinPolicy::Translate, "Translate"),
        (PinPolicy::Lock, "Lock"),
        (PinPolicy::Populate, "Populate"),
    ] {
        let (_space, h, _fd) = setup(policy);
        for pat in ["contiguous", "scattered", "ccw", "random"] {
            let only = std::env::var("UMDEV_BENCH_ONLY").unwrap_or_default();
            if !format!("{pname}/{pat}").contains(&only) {
                continue;
            }
            for n in SIZES {
                let pfns = pattern(pat, n);
                let mut addrs = vec![0u64; n];
                let mut addrs2 = vec![0u64; n];
                let naive = h.naive();
                let (tc, tn, ratio) = paired(
                    rounds,
                    &mut || {
                        h.pin_pages(black_box(&pfns), Prot::RW, &mut addrs).unwrap();
                        h.unpin_pages(black_box(&pfns)).unwrap();
                    },
                    &mut || {
                        naive
                            .pin_pages(black_box(&pfns), Prot::RW, &mut addrs2)
                            .unwrap();
                        naive.unpin_pages(black_box(&pfns)).unwrap();
                    },
                );
                println!("| {pname} | {pat} | {n} | {tc:.0} | {tn:.0} | {ratio:.2}x |");
            }
        }
    }
    const LEN: usize = 1 << 20;
    let (_space, h, fd) = setup(PinPolicy::Translate);
    // SAFETY: a fresh shared mapping of our memfd; accessed only with raw copies below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let mut buf = vec![1u8; LEN];
    let mut buf2 = vec![1u8; LEN];
    h.write(BASE_PFN * PAGE_SIZE, &buf).unwrap();
    let (td, tm, ratio) = paired(
        rounds,
        &mut || h.read(BASE_PFN * PAGE_SIZE, black_box(&mut buf)).unwrap(),
        &mut || {
            // SAFETY: `base` maps LEN bytes; `buf2` holds LEN bytes; distinct memory.
            unsafe { std::ptr::copy_nonoverlapping(base as *const u8, buf2.as_mut_ptr(), LEN) };
            black_box(&mut buf2);
        },
    );
    println!("\n| dma_rw 1 MiB | dma_read ns | memcpy ns | dma_read throughput vs memcpy |");
    println!("|---|---:|---:|---:|");
    println!("| read | {td:.0} | {tm:.0} | {:.0}% |", ratio * 100.0);
    let (td, tm, ratio) = paired(
        rounds,
        &mut || h.write(BASE_PFN * PAGE_SIZE, black_box(&buf)).unwrap(),
        &mut || {
            // SAFETY: as above, in the other direction.
            unsafe {
                std::ptr::copy_nonoverlapping(black_box(&buf2).as_ptr(), base as *mut u8, LEN)
            };
        },
    );
    println!("| write | {td:.0} | {tm:.0} | {:.0}% |", ratio * 100.0);
    // SAFETY: unmapping our own mapping; no reference into it remains.
    unsafe { libc::munmap(base, LEN) };
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
