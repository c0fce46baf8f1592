//! `umdev bench record gpu|ccw --out FILE`: run an example device under a representative
//! guest workload, driven through a real socket by the embedded VMM, and record every pin
//! array the *device itself* issues (the same recorder as `umdev run --record-pins`). The
//! file feeds `umdev bench pin --trace FILE`, so the bench shows the patterns real devices
//! produce, not only synthetic ones.
//!
//! Workloads (seeded, so a recording is reproducible):
//! - **gpu**: a compositor-like loop. Per frame: a 256×128 window surface in a contiguous
//!   guest buffer (double-buffered: the GTT is re-pointed at the other buffer every frame,
//!   so its 32 pages are pinned again), a 128×128 texture in 16 scattered guest pages
//!   (replaced every 4th frame), a 64×64 cursor in 4 scattered pages (stable), and a
//!   64×64 readback into 4 writable scattered pages (a screenshot), then a fence.
//! - **ccw**: a file-system-like mix of channel programs: 4 KiB metadata reads, 32 KiB
//!   readahead into contiguous pages, 32 KiB writeback from scattered pages, and chained
//!   three-CCW programs whose buffers mix runs and single pages.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use umdev::device::Device;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::pci::PciAdapter;
use umdev::server::{Server, ServerConfig};
use umdev::testing::{DeviceAccess, Vmm};
use umdev_devices::ccw::driver::{self as ccw, CcwWord};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::commands::Command as GpuCmd;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::{Gpu, GpuConfig};
use umdev_devices::testing::{run_ccw_program, Bar0};

use super::rng::SeededRng;
use super::trace::{read_trace, trace_recorder};
use crate::BenchError;

/// Which example device to record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// gvt-style GPU: registers, GTT, command ring, framebuffer.
    Gpu,
    /// ccw-style channel block device backed by an image file.
    Ccw,
}

/// Arguments of `umdev bench record`.
#[derive(clap::Args, Debug)]
pub struct RecordArgs {
    /// Device to record.
    pub device: DeviceKind,
    /// Trace file to write (JSON lines, see `umdev bench pin --trace`).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// GPU frames or ccw channel programs to run.
    #[arg(long, default_value_t = 32)]
    pub steps: u32,
    /// Seed of the workload.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
}

/// What the devices, their guest drivers and the embedded VMM fail with.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Guest physical address and size of the guest RAM.
const RAM_BASE: u64 = 1 << 30;
const RAM_SIZE: usize = 32 << 20;
const PAGE: u64 = 4096;
/// Guest pages from which surfaces and buffers are allocated (after ring/program space).
const POOL_FIRST: u64 = 256;
const POOL_PAGES: u64 = (RAM_SIZE as u64 / PAGE) - POOL_FIRST;

/// Entry point of `umdev bench record`.
pub fn run(args: RecordArgs) -> Result<(), BenchError> {
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-record-")
        .tempdir()?;
    let socket = dir.path().join("dev.sock");
    let dma = DmaSpace::new(DmaConfig::default());
    dma.set_pin_recorder(Some(trace_recorder(&args.out)?));
    let dev = example_device(args.device, dir.path()).map_err(BenchError::Workload)?;
    let server = Server::new(ServerConfig::new(&socket), dev, Arc::clone(&dma)).spawn()?;
    let mut rng = SeededRng::new(args.seed);
    let result = match args.device {
        DeviceKind::Gpu => gpu_workload(&socket, args.steps, &mut rng),
        DeviceKind::Ccw => ccw_workload(&socket, args.steps, &mut rng),
    };
    server.shutdown()?;
    dma.set_pin_recorder(None);
    drop(dir);
    result.map_err(BenchError::Workload)?;
    let entries = read_trace(&args.out)?;
    let pages: usize = entries.iter().map(|e| e.pfns.len()).sum();
    println!(
        "recorded {} pin arrays ({pages} pages) from the {:?} device to {}",
        entries.len(),
        args.device,
        args.out.display()
    );
    Ok(())
}

/// The example device `kind`, its backing files (the ccw image) in `dir`.
fn example_device(kind: DeviceKind, dir: &Path) -> Result<Box<dyn Device>, BoxError> {
    Ok(match kind {
        DeviceKind::Gpu => Box::new(PciAdapter::new(Gpu::new(GpuConfig::default())?)?),
        DeviceKind::Ccw => Box::new(PciAdapter::new(Ccw::new(
            CcwConfig::new(dir.join("ccw.img")).with_capacity(65536),
        )?)?),
    })
}

/// A page allocator over the guest RAM pool: contiguous or scattered pages.
struct PagePool<'a> {
    rng: &'a mut SeededRng,
}

impl PagePool<'_> {
    fn contiguous(&mut self, n: u64) -> Vec<u64> {
        let start = self.rng.range_inclusive(0, POOL_PAGES - n);
        (0..n).map(|i| page_gpa(start + i)).collect()
    }

    fn scattered(&mut self, n: u64) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::with_capacity(n as usize);
        while (out.len() as u64) < n {
            let p = page_gpa(self.rng.range_inclusive(0, POOL_PAGES - 1));
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }
}

fn page_gpa(pool_index: u64) -> u64 {
    RAM_BASE + (POOL_FIRST + pool_index) * PAGE
}

/// GTT layout of the GPU workload: (first entry, pages).
const GTT_WINDOW: (u32, u64) = (0, 32);
const GTT_TEXTURE: (u32, u64) = (64, 16);
const GTT_CURSOR: (u32, u64) = (96, 4);
const GTT_SHOT: (u32, u64) = (128, 4);

fn gpu_workload(socket: &Path, frames: u32, rng: &mut SeededRng) -> Result<(), BoxError> {
    let mut vmm = Vmm::connect(socket)?.with_ram(RAM_BASE, RAM_SIZE)?;
    vmm.enable_device()?;
    let _msi = vmm.enable_msi()?;
    let mut ram = vmm.ram().clone();
    let mut drv = Driver::probe(Bar0(&mut vmm))?;
    drv.set_mode(640, 480, 640 * 4)?;
    drv.setup_ring(RAM_BASE, 64 * 1024)?;
    let mut pool = PagePool { rng };
    let buffers = [pool.contiguous(GTT_WINDOW.1), pool.contiguous(GTT_WINDOW.1)];
    let set = |drv: &mut Driver<Bar0<&mut Vmm>>, (start, _): (u32, u64), pages: &[u64], w: bool| {
        pages
            .iter()
            .enumerate()
            .try_for_each(|(i, &gpa)| drv.set_gtt(start + i as u32, gpa, w))
    };
    set(&mut drv, GTT_CURSOR, &pool.scattered(GTT_CURSOR.1), false)?;
    set(&mut drv, GTT_SHOT, &pool.scattered(GTT_SHOT.1), true)?;
    for frame in 0..frames {
        set(&mut drv, GTT_WINDOW, &buffers[frame as usize % 2], false)?;
        if frame % 4 == 0 {
            set(&mut drv, GTT_TEXTURE, &pool.scattered(GTT_TEXTURE.1), false)?;
        }
        let fence = frame + 1;
        let cmds = [
            GpuCmd::FillRect {
                x: 0,
                y: 0,
                w: 640,
                h: 480,
                color: 0x0020_2848,
            },
            GpuCmd::Blit {
                gtt_index: GTT_WINDOW.0,
                stride: 1024,
                w: 256,
                h: 128,
                dst_x: 40 + frame % 64,
                dst_y: 40,
            },
            GpuCmd::Blit {
                gtt_index: GTT_TEXTURE.0,
                stride: 512,
                w: 128,
                h: 128,
                dst_x: 320,
                dst_y: 200,
            },
            GpuCmd::Blit {
                gtt_index: GTT_CURSOR.0,
                stride: 256,
                w: 64,
                h: 64,
                dst_x: (frame * 13) % 560,
                dst_y: (frame * 7) % 400,
            },
            GpuCmd::Readback {
                src_x: 0,
                src_y: 0,
                w: 64,
                h: 64,
                gtt_index: GTT_SHOT.0,
                stride: 256,
            },
            GpuCmd::Fence { value: fence },
        ];
        drv.submit(&mut ram, &cmds)?;
        drv.wait_fence(fence)?;
    }
    let total = GTT_SHOT.0 + GTT_SHOT.1 as u32;
    drv.clear_gtt(0, total)?;
    Ok(())
}

/// Run one channel program and check its status.
fn ccw_run(
    vmm: &mut Vmm,
    msi: &vmm_sys_util::eventfd::EventFd,
    program: &[CcwWord],
    block: u64,
) -> Result<(), BoxError> {
    let ram = vmm.ram().clone();
    let st = run_ccw_program(vmm, &ram, msi, program, block)?;
    if st.fault != 0 {
        return Err(format!("ccw: program faulted: {st:?}").into());
    }
    Ok(())
}

/// Where the IDAW list of the `i`-th CCW of a program goes.
fn idal_gpa(i: u64) -> u64 {
    RAM_BASE + 0x1000 + i * 0x1000
}

fn ccw_workload(socket: &Path, programs: u32, rng: &mut SeededRng) -> Result<(), BoxError> {
    let mut vmm = Vmm::connect(socket)?.with_ram(RAM_BASE, RAM_SIZE)?;
    vmm.enable_device()?;
    let msi = vmm.enable_msi()?;
    for n in 0..programs {
        let kind = rng.range_inclusive(0, 3);
        let block = rng.range_inclusive(0, 60_000);
        // (is_read, pages) per CCW.
        let ccws: Vec<(bool, Vec<u64>)> = {
            let mut pool = PagePool { rng: &mut *rng };
            match kind {
                0 => vec![(true, pool.scattered(1))],
                1 => vec![(true, pool.contiguous(8))],
                2 => vec![(false, pool.scattered(8))],
                _ => {
                    let a = pool.contiguous(2);
                    let mut b = pool.contiguous(3);
                    b.extend(pool.scattered(1));
                    vec![(true, a), (true, b), (true, pool.scattered(1))]
                }
            }
        };
        let mut program = Vec::with_capacity(ccws.len());
        for (i, (is_read, pages)) in ccws.iter().enumerate() {
            let idal = idal_gpa(i as u64);
            vmm.ram().write(idal, &ccw::encode_idaws(pages))?;
            let count = u16::try_from(pages.len() as u64 * PAGE)?;
            let word = if *is_read {
                CcwWord::read(count, idal)
            } else {
                CcwWord::write(count, idal)
            }
            .ida(pages.len() as u32);
            program.push(if i + 1 < ccws.len() {
                word.chain()
            } else {
                word
            });
        }
        ccw_run(&mut vmm, &msi, &program, block)
            .map_err(|e| format!("ccw program {n} (kind {kind}): {e}"))?;
    }
    Ok(())
}
