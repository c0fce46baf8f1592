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
//!
//! The scene, its guest driver, the servers and the GPU's migration run are
//! `umdev_devices::testing::migration`'s, shared with `tests/migration_e2e.rs` (which draws
//! a shorter scene).

use std::path::Path;
use std::time::Duration;

use umdev::device::irq_index;
use umdev::server::RunningServer;
use umdev::testing::{
    ms, wait_eventfd, DeviceAccess, MigrateOptions, Migration, MigrationReport, Vmm,
};
use umdev_devices::ccw::driver::{self as ccw, regs as ccw_regs, OperationBlock, StatusBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::{GpuConfig, DEFAULT_FB_SIZE};
use umdev_devices::testing::migration::{
    migrate_mid_scene, serve_gpu, serve_migrating, GpuGuest, HEIGHT, RAM_BASE, STRIDE, WIDTH,
};
use umdev_devices::testing::{ccw_chain, run_ccw_program, CCW_CHUNK};

use crate::demo::{fill_pattern, write_framebuffer_png};
use crate::CliResult;

const RAM_SIZE: usize = 16 << 20;
/// Frames of the scene; half are drawn on each side.
const FRAMES: u32 = 16;
/// PRE_COPY rounds (the guest draws a frame before each).
const ROUNDS: usize = 5;

/// A GPU server on `socket` and a VMM connected to it with the demo's RAM.
fn gpu_server(socket: &Path) -> Result<(RunningServer, Vmm), Box<dyn std::error::Error>> {
    Ok(serve_gpu(socket, GpuConfig::default(), RAM_SIZE)?)
}

/// The scene on one GPU, no migration.
fn reference(dir: &Path, out_dir: &Path) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let (server, vmm) = gpu_server(&dir.join("reference.sock"))?;
    let mut guest = GpuGuest::boot(vmm, FRAMES)?;
    guest.finish()?;
    let fb = guest.framebuffer()?;
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
    let (src_server, vmm) = gpu_server(&dir.join(format!("src-{tag}.sock")))?;
    let mut guest = GpuGuest::boot(vmm, FRAMES)?;
    let (dst_server, mut dst) = gpu_server(&dir.join(format!("dst-{tag}.sock")))?;
    // Frames 0..FRAMES / 2 on the source (one per round, one after the last round: STOP_COPY
    // carries it), then the guest continues on the destination with its RAM.
    let report = migrate_mid_scene(&mut guest, &mut dst, pre_copy, ROUNDS)?;
    let interrupts_before = guest.interrupts();
    guest.finish()?;
    let fb = guest.framebuffer()?;
    if let Some(p) = png {
        write_framebuffer_png(guest.vmm(), WIDTH, HEIGHT, STRIDE, p)?;
    }
    let differing_pixels = fb
        .chunks_exact(4)
        .zip(reference.chunks_exact(4))
        .filter(|(a, b)| a != b)
        .count();
    let interrupts_after = guest.interrupts() - interrupts_before;
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

/// The data set: (first block, CCWs) of parts A (before), B (in flight at STOP), C (after).
const PARTS: [(u64, u64); 3] = [(0, 2), (256, 40), (8192, 3)];
/// Where part `i`'s data is in guest RAM, and where it is read back to.
fn part_buffer(i: usize) -> u64 {
    RAM_BASE + (1 << 20) + i as u64 * (2 << 20)
}
const READ_BACK: u64 = RAM_BASE + (8 << 20);

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
) -> Result<(RunningServer, Vmm), Box<dyn std::error::Error>> {
    let dev = Ccw::new(CcwConfig::new(image).with_capacity(32768))?;
    Ok(serve_migrating(socket, dev, RAM_SIZE)?)
}

fn status_ok(st: &StatusBlock) -> bool {
    st.fault == 0 && st.residual == 0 && st.channel_status == 0
}

fn ccw_migration(dir: &Path, image: &Path) -> Result<CcwRun, Box<dyn std::error::Error>> {
    let (src_server, mut src) = ccw_server(&dir.join("ccw-src.sock"), image)?;
    src.enable_device()?;
    let irq = src.enable_msi()?;
    let ram = src.ram().clone();
    let data: Vec<Vec<u8>> = PARTS
        .iter()
        .enumerate()
        .map(|(i, &(_, ccws))| {
            let mut d = vec![0u8; (ccws * CCW_CHUNK) as usize];
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
        &ccw_chain(true, part_buffer(0), ccws),
        block,
    )?;
    let mut statuses_ok = status_ok(&st);

    let (dst_server, mut dst) = ccw_server(&dir.join("ccw-dst.sock"), image)?;
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
        &ccw::encode_program(&ccw_chain(true, part_buffer(1), ccws)),
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
        &ccw_chain(true, part_buffer(2), ccws),
        block,
    )?;
    statuses_ok &= status_ok(&st);
    let mut intact = statuses_ok && b_status_ok;
    for (i, &(block, ccws)) in PARTS.iter().enumerate() {
        ram.fill(READ_BACK, (ccws * CCW_CHUNK) as usize, 0)?;
        let st = run_ccw_program(
            &mut dst,
            &ram,
            &irq,
            &ccw_chain(false, READ_BACK, ccws),
            block,
        )?;
        let back = ram.read_vec(READ_BACK, (ccws * CCW_CHUNK) as usize)?;
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
        PARTS.iter().map(|p| p.1 * CCW_CHUNK).sum::<u64>() >> 10,
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
