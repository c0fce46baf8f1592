//! Rough GPU throughput numbers (device level, no socket): fill rate, blit rate from a
//! contiguous vs a scattered GTT surface (pins cached), the cost of re-pinning a surface on
//! every blit (GTT rewritten each time) under Translate and Lock, and small-command rate.
//!
//! `cargo run --release -p umdev-devices --example gpu_throughput`

use std::time::{Duration, Instant};

use umdev::device::Device;
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy, Prot};
use umdev::pci::PciAdapter;
use umdev::testing::GuestMemory;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};
use umdev_devices::testing::Bar0;

const RAM: u64 = 0x1000_0000;
const RAM_SIZE: usize = 16 << 20;
const SURF: u64 = RAM + (1 << 20);
const W: u32 = 1024;
const H: u32 = 768;

struct Bench {
    drv: Driver<Bar0<PciAdapter<Gpu>>>,
    ram: GuestMemory,
    space: std::sync::Arc<DmaSpace>,
    fence: u32,
}

impl Bench {
    fn new(policy: PinPolicy) -> Bench {
        let space = DmaSpace::new(DmaConfig {
            policy,
            lock_limit_bytes: Some(4 << 20),
            ..DmaConfig::default()
        });
        let ram = GuestMemory::new(RAM, RAM_SIZE).unwrap();
        space
            .map(ram.dma_mapping(RAM, RAM_SIZE as u64, Prot::RW).unwrap())
            .unwrap();
        let mut adapter = PciAdapter::new(Gpu::new(GpuConfig::default()).unwrap()).unwrap();
        Device::attach(&mut adapter, space.handle());
        let mut drv = Driver::probe(Bar0(adapter)).unwrap();
        drv.set_mode(W, H, W * 4).unwrap();
        drv.setup_ring(RAM, 256 * 1024).unwrap();
        Bench {
            drv,
            ram,
            space,
            fence: 0,
        }
    }

    fn run(&mut self, cmds: &[Command]) {
        self.fence += 1;
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: self.fence });
        self.drv.submit(&mut self.ram, &all).unwrap();
        self.drv.wait_fence(self.fence).unwrap();
    }

    fn map_surface(&mut self, pages: &[u64]) {
        for (i, &p) in pages.iter().enumerate() {
            self.drv.set_gtt(i as u32, p, false).unwrap();
        }
    }
}

/// Run `f` repeatedly for about `budget`; returns (iterations, elapsed).
fn measure(budget: Duration, mut f: impl FnMut()) -> (u64, Duration) {
    f(); // warm up
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < budget {
        f();
        n += 1;
    }
    (n, start.elapsed())
}

fn per_op(n: u64, t: Duration) -> f64 {
    t.as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let budget = Duration::from_millis(400);
    let blit = Command::Blit {
        gtt_index: 0,
        stride: 1024,
        w: 256,
        h: 256,
        dst_x: 10,
        dst_y: 10,
    };
    // 256×256×4 = 256 KiB = 64 pages.
    let contiguous: Vec<u64> = (0..64).map(|k| SURF + k * 4096).collect();
    let scattered: Vec<u64> = (0..64).map(|k| SURF + ((k * 37) % 64) * 2 * 4096).collect();

    let mut b = Bench::new(PinPolicy::Translate);
    let fill = Command::FillRect {
        x: 0,
        y: 0,
        w: W,
        h: H,
        color: 0x123456,
    };
    let (n, t) = measure(budget, || b.run(&[fill; 8]));
    let bytes = n as f64 * 8.0 * f64::from(W * H * 4);
    println!(
        "fill 1024x768 (8 per submit):      {:8.1} us/fill  {:7.0} MB/s",
        per_op(n * 8, t),
        bytes / t.as_secs_f64() / 1e6
    );

    for (name, pages) in [("contiguous", &contiguous), ("scattered", &scattered)] {
        b.map_surface(pages);
        let (n, t) = measure(budget, || b.run(&[blit; 8]));
        println!(
            "blit 256x256 cached pins, {name:10}: {:8.1} us/blit  {:7.0} MB/s",
            per_op(n * 8, t),
            n as f64 * 8.0 * 262144.0 / t.as_secs_f64() / 1e6
        );
    }

    for policy in [PinPolicy::Translate, PinPolicy::Lock] {
        let mut b = Bench::new(policy);
        for (name, pages) in [("contiguous", &contiguous), ("scattered", &scattered)] {
            let sys0 = b.space.stats().residency_syscalls;
            let (n, t) = measure(budget, || {
                // Rewriting the GTT drops the pins; the blit re-pins 64 pages in one call.
                b.drv.clear_gtt(0, 64).unwrap();
                b.map_surface(pages);
                b.run(&[blit]);
            });
            let sys = b.space.stats().residency_syscalls - sys0;
            println!(
                "GTT rewrite + blit (re-pin), {policy:?} {name:10}: {:8.1} us/iter  {:5.1} residency syscalls/iter",
                per_op(n, t),
                sys as f64 / (n + 1) as f64
            );
        }
    }

    let dot = Command::FillRect {
        x: 1,
        y: 1,
        w: 1,
        h: 1,
        color: 1,
    };
    let cmds = vec![dot; 2000];
    let (n, t) = measure(budget, || b.run(&cmds));
    println!(
        "1x1 fills (2000 per submit):       {:8.3} us/command",
        per_op(n * 2000, t)
    );
}
