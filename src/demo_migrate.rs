//! `umdev demo migrate`: live migration between two in-process servers with the embedded
//! VMM's migration driver (`umdev::testing::Migration`).
//!
//! **GPU.** A guest program draws a scene in frames into a 4 MiB-framebuffer GPU (mode
//! 1024×768): frame 0 paints the background, every frame redraws a small region (a moving
//! box and a sprite blitted from guest RAM through the GTT, ≈ 56 framebuffer pages), one
//! frame reads a region back into guest RAM (device DMA, so the RAM's dirty log carries
//! it), a later one blits that back. Half the frames are drawn on the source — one per
//! PRE_COPY round while the migration runs, one after the last round — and half on the
//! destination, by the same guest driver (its ring position) on the copied RAM. The
//! destination's framebuffer must be pixel-identical to the same frames drawn on one GPU
//! without migration. Done twice: with PRE_COPY and STOP_COPY only, for the downtime
//! table.
//!
//! **ccw.** Two ccw devices on the same image file (shared storage). Part A of a data set is
//! written before the migration, part B's program is started just before STOP (in flight
//! or not yet started when STOP comes: the guest sees exactly one completion, on whichever
//! side), part C on the destination; everything is read back on the destination.
//!
//! The guest's interrupt eventfd is the VMM's: the destination VMM attaches the same one
//! (SET_IRQS) before the destination runs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use umdev::device::irq_index;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::pci::PciAdapter;
use umdev::server::RunningServer;
use umdev::testing::{
    ms, wait_eventfd, DeviceAccess, GuestMemory, MigrateOptions, Migration, MigrationReport, Vmm,
    MIGRATION_CAPS,
};
use umdev_devices::ccw::driver::{
    self as ccw, regs as ccw_regs, CcwWord, OperationBlock, StatusBlock,
};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::commands::Command as GpuCmd;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::IRQ_FENCE;
use umdev_devices::gpu::{Gpu, GpuConfig, BAR_FB, DEFAULT_FB_SIZE};
use umdev_devices::testing::{run_ccw_program, Bar0};
use vmm_sys_util::eventfd::EventFd;

use crate::demo::{fill_pattern, serve, write_framebuffer_png};
use crate::CliResult;

const RAM_BASE: u64 = 1 << 30;
const RAM_SIZE: usize = 16 << 20;
const PAGE: u64 = 4096;
const WIDTH: u32 = 1024;
const HEIGHT: u32 = 768;
const STRIDE: u32 = WIDTH * 4;
/// Frames of the scene; half are drawn on each side.
const FRAMES: u32 = 16;
/// PRE_COPY rounds (the guest draws a frame before each).
const ROUNDS: usize = 5;
const RING: u64 = RAM_BASE;
const RING_SIZE: u32 = 64 * 1024;
/// The 32×32 sprite (one page, GTT entry 0).
const SPRITE: u64 = RAM_BASE + (4 << 20);
/// The read-back surface: 64×64 pixels in 4 pages, GTT entries 8..12, writable.
const READBACK: u64 = RAM_BASE + (5 << 20);
const READBACK_GTT: u32 = 8;

/// The commands of frame `f`.
fn frame_commands(f: u32) -> Vec<GpuCmd> {
    let mut c = Vec::new();
    if f == 0 {
        c.push(GpuCmd::FillRect {
            x: 0,
            y: 0,
            w: WIDTH,
            h: HEIGHT,
            color: 0x0018_2838,
        });
        c.push(GpuCmd::FillRect {
            x: 20,
            y: 560,
            w: 984,
            h: 180,
            color: 0x0030_4860,
        });
    }
    // The moving box and the sprite: the small region redrawn every frame.
    c.push(GpuCmd::FillRect {
        x: 30 + f * 58,
        y: 80 + (f % 4) * 90,
        w: 40,
        h: 24,
        color: 0x00e0_4020 + f * 0x0000_0c08,
    });
    c.push(GpuCmd::Blit {
        gtt_index: 0,
        stride: 128,
        w: 32,
        h: 32,
        dst_x: 40 + f * 60,
        dst_y: 600,
    });
    if f == 5 {
        // Read the boxes of frames 0..=4 back into guest RAM (device DMA) ...
        c.push(GpuCmd::Readback {
            src_x: 30,
            src_y: 80,
            w: 64,
            h: 64,
            gtt_index: READBACK_GTT,
            stride: 256,
        });
    }
    if f == FRAMES - 3 {
        // ... and show it again, after the migration.
        c.push(GpuCmd::Blit {
            gtt_index: READBACK_GTT,
            stride: 256,
            w: 64,
            h: 64,
            dst_x: 900,
            dst_y: 460,
        });
    }
    c.push(GpuCmd::Fence { value: f + 1 });
    c
}

/// The guest: its GPU driver (ring position), its RAM, its interrupt eventfd.
struct GpuGuest {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    irq: EventFd,
    frame: u32,
    interrupts: u64,
}

impl GpuGuest {
    /// Boot: enable the device and MSI, set the mode, the ring, the GTT; a sprite in RAM.
    fn boot(mut vmm: Vmm) -> Result<GpuGuest, Box<dyn std::error::Error>> {
        vmm.enable_device()?;
        let irq = vmm.enable_msi()?;
        let ram = vmm.ram().clone();
        let sprite: Vec<u8> = (0..32u32 * 32)
            .flat_map(|i| {
                let (x, y) = (i % 32, i / 32);
                let inside = (x as i32 - 16).pow(2) + (y as i32 - 16).pow(2) < 200;
                let px = if inside {
                    0x00f0_d040 | (x * 4) << 8
                } else {
                    0x0010_1010 + y
                };
                px.to_le_bytes()
            })
            .collect();
        ram.write(SPRITE, &sprite)?;
        let mut drv = Driver::probe(Bar0(vmm))?;
        drv.set_mode(WIDTH, HEIGHT, STRIDE)?;
        drv.setup_ring(RING, RING_SIZE)?;
        drv.enable_irqs(IRQ_FENCE)?;
        drv.set_gtt(0, SPRITE, false)?;
        for i in 0..4 {
            drv.set_gtt(READBACK_GTT + i, READBACK + u64::from(i) * PAGE, true)?;
        }
        Ok(GpuGuest {
            drv,
            ram,
            irq,
            frame: 0,
            interrupts: 0,
        })
    }

    /// Draw the next frame and wait for its fence (and acknowledge its interrupt).
    fn frame(&mut self) -> std::io::Result<()> {
        let f = self.frame;
        let mut ram = self.ram.clone();
        self.drv.submit(&mut ram, &frame_commands(f))?;
        self.drv.wait_fence(f + 1)?;
        if let Some(n) = wait_eventfd(&self.irq, Duration::from_secs(5)) {
            self.interrupts += n;
        }
        self.drv.ack(IRQ_FENCE)?;
        self.frame += 1;
        Ok(())
    }

    fn vmm(&mut self) -> &mut Vmm {
        &mut self.drv.regs().0
    }
}

/// A GPU server on `socket` and a VMM connected to it with the demo's RAM.
fn gpu_server(
    socket: &Path,
    dma: &Arc<DmaSpace>,
) -> Result<(RunningServer, Vmm), Box<dyn std::error::Error>> {
    let dev = PciAdapter::new(Gpu::new(GpuConfig::default())?)?;
    let server = serve(socket, Box::new(dev), dma)?;
    let vmm = Vmm::connect_with_caps(socket, MIGRATION_CAPS)?.with_ram(RAM_BASE, RAM_SIZE)?;
    Ok((server, vmm))
}

/// The whole framebuffer, read through BAR2's mapping.
fn framebuffer(vmm: &mut Vmm) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let fb = vmm.map_region(BAR_FB as u32)?;
    let mut out = vec![0u8; fb.len()];
    fb.read(0, &mut out)?;
    Ok(out)
}

/// The scene on one GPU, no migration.
fn reference(dir: &Path, out_dir: &Path) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let dma = DmaSpace::new(DmaConfig::default());
    let (server, vmm) = gpu_server(&dir.join("reference.sock"), &dma)?;
    let mut guest = GpuGuest::boot(vmm)?;
    for _ in 0..FRAMES {
        guest.frame()?;
    }
    let fb = framebuffer(guest.vmm())?;
    write_framebuffer_png(
        guest.vmm(),
        WIDTH,
        HEIGHT,
        STRIDE,
        &out_dir.join("migrate-reference.png"),
    )?;
    drop(guest);
    server.shutdown()?;
    Ok(fb)
}

/// What one GPU migration showed.
struct GpuRun {
    report: MigrationReport,
    differing_pixels: usize,
    interrupts_after: u64,
}

/// The scene drawn half on a source GPU, half on a destination GPU.
fn migrated(
    dir: &Path,
    pre_copy: bool,
    reference: &[u8],
    png: Option<&Path>,
) -> Result<GpuRun, Box<dyn std::error::Error>> {
    let tag = if pre_copy { "pre" } else { "stop" };
    let (dma_src, dma_dst) = (
        DmaSpace::new(DmaConfig::default()),
        DmaSpace::new(DmaConfig::default()),
    );
    let (src_server, vmm) = gpu_server(&dir.join(format!("src-{tag}.sock")), &dma_src)?;
    let mut guest = GpuGuest::boot(vmm)?;
    // Before the migration: all source frames but one per round and the one after them.
    while guest.frame < FRAMES / 2 - ROUNDS as u32 - 1 {
        guest.frame()?;
    }
    let (dst_server, mut dst) = gpu_server(&dir.join(format!("dst-{tag}.sock")), &dma_dst)?;
    let opts = MigrateOptions {
        pre_copy,
        max_rounds: ROUNDS,
        small_round_bytes: 0,
    };
    let mut m = Migration::start(guest.vmm(), &mut dst, &opts)?;
    for _ in 0..ROUNDS {
        guest.frame()?;
        m.round(guest.vmm(), &mut dst)?;
    }
    // The last frame on the source, after the last round: STOP_COPY carries it.
    guest.frame()?;
    m.stop_copy(guest.vmm(), &mut dst)?;
    // The guest's interrupt goes on to the destination: the same eventfd.
    dst.set_irq_eventfd(irq_index::MSI, 0, &guest.irq)?;
    let report = m.resume_destination(guest.vmm(), &mut dst)?;
    // The guest continues on the destination: its VMM connection and RAM are swapped.
    std::mem::swap(guest.vmm(), &mut dst);
    guest.ram = guest.vmm().ram().clone();
    let interrupts_before = guest.interrupts;
    while guest.frame < FRAMES {
        guest.frame()?;
    }
    let fb = framebuffer(guest.vmm())?;
    if let Some(p) = png {
        write_framebuffer_png(guest.vmm(), WIDTH, HEIGHT, STRIDE, p)?;
    }
    let differing_pixels = fb
        .chunks_exact(4)
        .zip(reference.chunks_exact(4))
        .filter(|(a, b)| a != b)
        .count();
    let interrupts_after = guest.interrupts - interrupts_before;
    drop(guest);
    drop(dst);
    dst_server.shutdown()?;
    src_server.shutdown()?;
    Ok(GpuRun {
        report,
        differing_pixels,
        interrupts_after,
    })
}

/// 32 KiB per CCW.
const CHUNK: u64 = 32 << 10;
/// The data set: (first block, CCWs) of parts A (before), B (in flight at STOP), C (after).
const PARTS: [(u64, u64); 3] = [(0, 2), (256, 40), (8192, 3)];
/// Where part `i`'s data is in guest RAM, and where it is read back to.
fn part_buffer(i: usize) -> u64 {
    RAM_BASE + (1 << 20) + i as u64 * (2 << 20)
}
const READ_BACK: u64 = RAM_BASE + (8 << 20);

/// A program moving `ccws` × 32 KiB between the image and guest RAM at `data`.
fn program(write: bool, data: u64, ccws: u64) -> Vec<CcwWord> {
    (0..ccws)
        .map(|i| {
            let addr = data + i * CHUNK;
            let w = if write {
                CcwWord::write(CHUNK as u16, addr)
            } else {
                CcwWord::read(CHUNK as u16, addr)
            };
            if i + 1 < ccws {
                w.chain()
            } else {
                w
            }
        })
        .collect()
}

/// What the ccw migration showed.
struct CcwRun {
    report: MigrationReport,
    intact: bool,
    b_completed_on: &'static str,
    b_interrupts: u64,
    b_status_ok: bool,
}

fn ccw_server(
    socket: &Path,
    image: &Path,
    dma: &Arc<DmaSpace>,
) -> Result<(RunningServer, Vmm), Box<dyn std::error::Error>> {
    let dev = PciAdapter::new(Ccw::new(CcwConfig::new(image).with_capacity(32768))?)?;
    let server = serve(socket, Box::new(dev), dma)?;
    let vmm = Vmm::connect_with_caps(socket, MIGRATION_CAPS)?.with_ram(RAM_BASE, RAM_SIZE)?;
    Ok((server, vmm))
}

fn status_ok(st: &StatusBlock) -> bool {
    st.fault == 0 && st.residual == 0 && st.channel_status == 0
}

fn ccw_migration(dir: &Path, image: &Path) -> Result<CcwRun, Box<dyn std::error::Error>> {
    let (dma_src, dma_dst) = (
        DmaSpace::new(DmaConfig::default()),
        DmaSpace::new(DmaConfig::default()),
    );
    let (src_server, mut src) = ccw_server(&dir.join("ccw-src.sock"), image, &dma_src)?;
    src.enable_device()?;
    let irq = src.enable_msi()?;
    let ram = src.ram().clone();
    let data: Vec<Vec<u8>> = PARTS
        .iter()
        .enumerate()
        .map(|(i, &(_, ccws))| {
            let mut d = vec![0u8; (ccws * CHUNK) as usize];
            fill_pattern(&mut d, 0x5eed + i as u64);
            d
        })
        .collect();
    for (i, d) in data.iter().enumerate() {
        ram.write(part_buffer(i), d)?;
    }
    // Part A, before.
    let (block, ccws) = PARTS[0];
    let st = run_ccw_program(
        &mut src,
        &ram,
        &irq,
        &program(true, part_buffer(0), ccws),
        block,
    )?;
    let mut statuses_ok = status_ok(&st);

    let (dst_server, mut dst) = ccw_server(&dir.join("ccw-dst.sock"), image, &dma_dst)?;
    let mut m = Migration::start(
        &mut src,
        &mut dst,
        &MigrateOptions {
            max_rounds: 1,
            ..MigrateOptions::default()
        },
    )?;
    // Part B: started, not waited for; STOP follows at once.
    let (opb, status, prog) = (RAM_BASE, RAM_BASE + 0x80, RAM_BASE + 0x100);
    let (block, ccws) = PARTS[1];
    ram.write(
        prog,
        &ccw::encode_program(&program(true, part_buffer(1), ccws)),
    )?;
    let ob = OperationBlock {
        program: prog,
        block,
        status,
        flags: 0,
        reserved: 0,
    };
    ram.write(opb, &ob.to_bytes())?;
    ram.write(status, &[0xee; ccw::STATUS_BLOCK_SIZE])?;
    src.write32(0, ccw_regs::OPB_ADDR_LO, opb as u32)?;
    src.write32(0, ccw_regs::OPB_ADDR_HI, (opb >> 32) as u32)?;
    src.write32(0, ccw_regs::START, 1)?;
    m.round(&mut src, &mut dst)?;
    m.stop_copy(&mut src, &mut dst)?;
    let on_source = irq.read().unwrap_or(0);
    dst.set_irq_eventfd(irq_index::MSI, 0, &irq)?;
    let report = m.resume_destination(&mut src, &mut dst)?;
    // The guest goes on with the destination: wait for B's completion (unless it came on
    // the source), acknowledge it there.
    let on_destination = if on_source == 0 {
        wait_eventfd(&irq, Duration::from_secs(5)).unwrap_or(0)
    } else {
        0
    };
    std::thread::sleep(Duration::from_millis(20));
    let late = irq.read().unwrap_or(0);
    dst.write32(0, ccw_regs::IRQ_STATUS, ccw_regs::IRQ_ALL)?;
    let ram = dst.ram().clone();
    let mut sb = [0u8; ccw::STATUS_BLOCK_SIZE];
    ram.read(status, &mut sb)?;
    let b_status_ok = status_ok(&StatusBlock::from_bytes(&sb));
    // Part C, after; then everything read back on the destination.
    let (block, ccws) = PARTS[2];
    let st = run_ccw_program(
        &mut dst,
        &ram,
        &irq,
        &program(true, part_buffer(2), ccws),
        block,
    )?;
    statuses_ok &= status_ok(&st);
    let mut intact = statuses_ok && b_status_ok;
    for (i, &(block, ccws)) in PARTS.iter().enumerate() {
        ram.fill(READ_BACK, (ccws * CHUNK) as usize, 0)?;
        let st = run_ccw_program(
            &mut dst,
            &ram,
            &irq,
            &program(false, READ_BACK, ccws),
            block,
        )?;
        let back = ram.read_vec(READ_BACK, (ccws * CHUNK) as usize)?;
        intact &= status_ok(&st) && back == data[i];
    }
    drop(src);
    drop(dst);
    dst_server.shutdown()?;
    src_server.shutdown()?;
    Ok(CcwRun {
        report,
        intact,
        b_completed_on: match (on_source, on_destination) {
            (0, 0) => "nowhere",
            (_, 0) => "the source",
            _ => "the destination",
        },
        b_interrupts: on_source + on_destination + late,
        b_status_ok,
    })
}

/// One row of the table.
fn row(name: &str, r: &MigrationReport) -> String {
    let per_round: Vec<String> = r
        .rounds
        .iter()
        .map(|x| format!("{}+{}p", x.device_bytes, x.ram_pages))
        .collect();
    format!(
        "{name:<16} {:>6} {:>10} {:<44} {:>15} {:>12.2} {:>11.2}",
        r.rounds.len(),
        r.initial_ram_pages,
        per_round.join(" "),
        r.stop_copy_bytes,
        ms(r.stop_copy_time),
        ms(r.downtime),
    )
}

/// Entry point: `umdev demo migrate`.
pub fn run(out_dir: &Path, image: Option<&Path>) -> CliResult {
    let dir = tempfile::tempdir()?;
    let fb_size = DEFAULT_FB_SIZE;
    println!("gpu: {FRAMES} frames of a 1024x768 scene on a {} MiB framebuffer; frames 0..{} on the source ({ROUNDS} during PRE_COPY rounds, 1 after the last), {}..{FRAMES} on the destination", fb_size >> 20, FRAMES / 2, FRAMES / 2);
    let reference = reference(dir.path(), out_dir)?;
    let with = migrated(
        dir.path(),
        true,
        &reference,
        Some(&out_dir.join("migrate-destination.png")),
    )?;
    let without = migrated(dir.path(), false, &reference, None)?;
    let mut failures = Vec::new();
    for (name, run) in [("PRE_COPY", &with), ("STOP_COPY only", &without)] {
        let same = run.differing_pixels == 0;
        println!(
            "gpu ({name}): destination framebuffer vs. the scene drawn without migration: {}",
            if same {
                "pixel-identical".to_string()
            } else {
                format!("MISMATCH ({} pixels differ)", run.differing_pixels)
            }
        );
        println!(
            "gpu ({name}): fence interrupts on the destination (same eventfd): {}",
            run.interrupts_after
        );
        if !same {
            failures.push(format!("gpu ({name}) framebuffer differs"));
        }
        if run.interrupts_after == 0 {
            failures.push(format!("gpu ({name}): no interrupt after the migration"));
        }
    }
    println!(
        "gpu: PNGs {} and {}",
        out_dir.join("migrate-reference.png").display(),
        out_dir.join("migrate-destination.png").display()
    );
    let pct = with.report.stop_copy_bytes as f64 * 100.0 / fb_size as f64;
    let target = pct <= 10.0;
    println!(
        "gpu: STOP_COPY with PRE_COPY carries {} bytes = {pct:.1}% of the framebuffer (target <= 10%): {}",
        with.report.stop_copy_bytes,
        if target { "met" } else { "MISSED" }
    );
    if !target {
        failures.push("STOP_COPY over 10% of the framebuffer with PRE_COPY".into());
    }

    let image = match image {
        Some(p) => p.to_path_buf(),
        None => dir.path().join("ccw.img"),
    };
    let c = ccw_migration(dir.path(), &image)?;
    println!(
        "ccw: data set of {} KiB (part A before, B started right before STOP, C after) read back on the destination: {}",
        PARTS.iter().map(|p| p.1 * CHUNK).sum::<u64>() >> 10,
        if c.intact { "intact" } else { "MISMATCH" }
    );
    println!(
        "ccw: part B's completion delivered by {}, {} completion interrupt(s) in all, status {}",
        c.b_completed_on,
        c.b_interrupts,
        if c.b_status_ok { "ok" } else { "BAD" }
    );
    if !c.intact {
        failures.push("ccw data set differs".into());
    }
    if c.b_interrupts != 1 {
        failures.push(format!(
            "ccw: {} completions of the program in flight",
            c.b_interrupts
        ));
    }

    println!();
    println!(
        "{:<16} {:>6} {:>10} {:<44} {:>15} {:>12} {:>11}",
        "migration",
        "rounds",
        "RAM pages",
        "per round: device bytes+RAM pages",
        "STOP_COPY bytes",
        "STOP_COPY ms",
        "downtime ms"
    );
    println!("{}", row("gpu PRE_COPY", &with.report));
    println!("{}", row("gpu STOP_COPY", &without.report));
    println!("{}", row("ccw", &c.report));
    println!();
    if failures.is_empty() {
        println!("verdict: migration ok");
        Ok(())
    } else {
        println!("verdict: FAILED: {}", failures.join("; "));
        Err(failures.join("; ").into())
    }
}
