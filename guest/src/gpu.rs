//! GPU scenarios (devices/src/gpu, protocol-docs/devices/gpu.md), driven like a guest
//! driver: the device crate's own guest driver over BAR0 (through the sysfs mmap), the
//! framebuffer read and written by the guest CPU through BAR2, the ring in a contiguous
//! huge page, surfaces in physically scattered guest pages behind the GTT, INTx through
//! `uio_pci_generic`. Every drawing step is checked against a model of the screen (all of
//! it here; see [`gpu_kit`] for the windows the other scenarios use).

use std::time::{Duration, Instant};

use umdev_devices::gpu::commands::{header, Command, OP_FILL_RECT};
use umdev_devices::gpu::error::*;
use umdev_devices::gpu::regs::*;

use crate::gpu_kit::{self, pattern, Gpu, Rect, Surface, FULL, H, W};
use crate::pci::command;
use crate::report::Report;
use crate::uio::Uio;

/// Mode, FILL, READBACK through the GTT, BLIT, errors, INTx, throughput (memfd RAM).
pub fn run(r: &mut Report) -> Option<()> {
    let mut g = gpu_kit::open(r, "gpu", FULL)?;
    fill(r, &mut g)?;
    readback(r, &mut g)?;
    blit_and_errors(r, &mut g)?;
    beyond_ram(r, &mut g)?;
    fill_batch(r, &mut g, "gpu", 20_000)?;
    readback_batch(r, &mut g)?;
    // Last: QEMU traps BAR2 for good after the first INTx (see gpu_kit), which the two
    // measurements around it show.
    let before = r.ok("gpu.fb_cost_before", g.fb_read_ns(1 << 16))?;
    r.measure("fb_read_ns_before_intx", before, "ns");
    intx(r, &mut g)?;
    let after = r.ok("gpu.fb_cost_after", g.fb_read_ns(1 << 10))?;
    r.measure("fb_read_ns_after_intx", after, "ns");
    g.close(r, "gpu");
    Some(())
}

fn fill_cmd((x, y, w, h): Rect, color: u32) -> Command {
    Command::FillRect { x, y, w, h, color }
}

/// Publish `rects` as FILLs and a FENCE, apply them to the model, compare the screen.
fn fills(r: &mut Report, g: &mut Gpu, name: &str, rects: &[(Rect, u32)]) -> Option<()> {
    let cmds: Vec<Command> = rects.iter().map(|&(rect, c)| fill_cmd(rect, c)).collect();
    r.ok(&format!("{name}_run"), g.run(&cmds))?;
    for &(rect, c) in rects {
        g.model_fill(rect, c);
    }
    g.check_fb(r, &format!("{name}_pixels"));
    Some(())
}

/// FILL over the whole mode, a rectangle and the last pixel; the stride padding must stay.
fn fill(r: &mut Report, g: &mut Gpu) -> Option<()> {
    fills(
        r,
        g,
        "gpu.fill",
        &[
            ((0, 0, W, H), 0x0020_3040),
            ((100, 50, 200, 120), 0x00ff_8000),
            ((W - 1, H - 1, 1, 1), 0x0012_3456),
        ],
    )
}

/// The guest CPU draws a unique pattern into the framebuffer; READBACK copies it into
/// scattered guest pages through the GTT (rows that cross page boundaries, padding between
/// rows that must stay untouched).
fn readback(r: &mut Report, g: &mut Gpu) -> Option<()> {
    const SEED: u32 = 0x13_579b;
    let (x0, y0, w, h, stride) = (37, 21, 300, 200, 300 * 4 + 96);
    let draw = (|| -> std::io::Result<()> {
        for y in 0..h {
            for x in 0..w {
                g.cpu_put(x0 + x, y0 + y, pattern(SEED, x0 + x, y0 + y))?;
            }
        }
        Ok(())
    })();
    r.ok("gpu.readback_cpu_draw", draw)?;
    let dst = r.ok("gpu.readback_alloc", Surface::new(w, h, stride, 0xee))?;
    let breaks = dst.discontiguities();
    r.check(
        "gpu.readback_gtt_scattered",
        breaks > 0,
        format_args!(
            "{breaks} of {} neighbouring GTT entries point at non-consecutive guest pages \
             (first pages {:#x} {:#x} {:#x})",
            dst.pages() - 1,
            dst.addr(0),
            dst.addr(1),
            dst.addr(2)
        ),
    );
    r.ok("gpu.readback_gtt", g.map(0, &dst, true))?;
    let cmd = Command::Readback {
        src_x: x0,
        src_y: y0,
        w,
        h,
        gtt_index: 0,
        stride,
    };
    r.ok("gpu.readback_run", g.run(&[cmd]))?;
    let diff = dst.diff(|x, y| pattern(SEED, x0 + x, y0 + y));
    let (bad, first) = r.ok("gpu.readback_read", diff)?;
    r.check(
        "gpu.readback_pixels",
        bad == 0,
        format_args!("{bad} wrong bytes in {} pages{first}", dst.pages()),
    );
    g.check_fb(r, "gpu.readback_fb_unchanged");
    r.ok(
        "gpu.readback_gtt_clear",
        g.drv.clear_gtt(0, dst.pages() as u32),
    )?;
    Some(())
}

/// ERROR_COUNT now.
fn error_count(r: &mut Report, g: &mut Gpu, name: &str) -> Option<u32> {
    r.ok(name, g.drv.read(REG_ERROR_COUNT))
}

/// BLIT from read-only GTT pages; then errors and recovery: READBACK into those pages, a
/// bad opcode, a truncated command, a surface past the GTT; the commands after a bad one
/// run, ERROR_CODE keeps the most recent error until ERROR is acknowledged.
fn blit_and_errors(r: &mut Report, g: &mut Gpu) -> Option<()> {
    const SEED: u32 = 0x24_68ac;
    const GTT: u32 = 256;
    let (w, h, stride, dx, dy) = (256, 160, 256 * 4 + 64, 400, 300);
    let src = r.ok("gpu.blit_alloc", Surface::new(w, h, stride, 0x77))?;
    let write = (|| -> std::io::Result<()> {
        for y in 0..h {
            for x in 0..w {
                src.put(x, y, pattern(SEED, x, y))?;
            }
        }
        Ok(())
    })();
    r.ok("gpu.blit_src_write", write)?;
    r.ok("gpu.blit_gtt", g.map(GTT, &src, false))?;
    let blit = Command::Blit {
        gtt_index: GTT,
        stride,
        w,
        h,
        dst_x: dx,
        dst_y: dy,
    };
    r.ok("gpu.blit_run", g.run(&[blit]))?;
    for y in 0..h {
        for x in 0..w {
            g.model[((dy + y) * W + dx + x) as usize] = pattern(SEED, x, y);
        }
    }
    g.check_fb(r, "gpu.blit_pixels");
    let src_intact = |r: &mut Report, name: &str| match src.diff(|x, y| pattern(SEED, x, y)) {
        Ok((bad, first)) => r.check(name, bad == 0, format_args!("{bad} bytes changed{first}")),
        Err(e) => r.check(name, false, e),
    };
    src_intact(r, "gpu.blit_src_unchanged");

    // READBACK into the read-only entries: GTT_READONLY, the FENCE after it still runs.
    let n0 = error_count(r, g, "gpu.err_count")?;
    let rb = Command::Readback {
        src_x: 0,
        src_y: 0,
        w: 64,
        h: 8,
        gtt_index: GTT,
        stride,
    };
    let at = r.ok("gpu.err_readonly_run", g.run(&[rb]))?;
    g.check_error(r, "gpu.err_readonly", ERR_GTT_READONLY, at, n0 + 1);
    src_intact(r, "gpu.err_readonly_no_write");

    // An unknown opcode is skipped by its length: the FILL and FENCE after it run, and
    // ERROR_CODE now holds this, the most recent, error (no ack in between).
    g.fence = g.fence.wrapping_add(1);
    let good = ((500, 10, 50, 20), 0x0000_ff00);
    let mut raw = vec![header(0x7f, 3), 0xdead, 0xbeef];
    fill_cmd(good.0, good.1).encode(&mut raw);
    Command::Fence { value: g.fence }.encode(&mut raw);
    r.ok("gpu.err_opcode_run", g.submit_raw(&raw))?;
    g.model_fill(good.0, good.1);
    let fv = g.drv.read(REG_FENCE_VALUE);
    r.check(
        "gpu.err_opcode_skipped",
        fv.as_ref().is_ok_and(|&v| v == g.fence),
        format_args!("FENCE_VALUE {fv:?}, want {}", g.fence),
    );
    g.check_error(r, "gpu.err_opcode", ERR_BAD_OPCODE, 0, n0 + 2);
    g.check_fb(r, "gpu.err_opcode_fill_ran");

    // A FILL whose length runs past the tail: TRUNCATED, nothing drawn.
    r.ok(
        "gpu.err_truncated_run",
        g.submit_raw(&[header(OP_FILL_RECT, 6), 0, 0]),
    )?;
    g.check_error(r, "gpu.err_truncated", ERR_TRUNCATED, 0, n0 + 3);

    // A surface that runs past entry 1023: GTT_RANGE.
    let past = Command::Blit {
        gtt_index: GTT_ENTRIES - 1,
        stride: 4096,
        w: 16,
        h: 2,
        dst_x: 0,
        dst_y: 0,
    };
    let at = r.ok("gpu.err_range_run", g.run(&[past]))?;
    g.check_error(r, "gpu.err_range", ERR_GTT_RANGE, at, n0 + 4);

    // A good command does not clear the error; acknowledging ERROR does.
    let ok = ((500, 40, 10, 10), 0x0000_00ff);
    fills(r, g, "gpu.err_good", &[ok])?;
    g.check_error(r, "gpu.err_sticky", ERR_GTT_RANGE, at, n0 + 4);
    g.ack_error(r, "gpu.err_ack", n0 + 4);
    g.check_fb(r, "gpu.err_fb");
    r.ok(
        "gpu.blit_gtt_clear",
        g.drv.clear_gtt(GTT, src.pages() as u32),
    )?;
    Some(())
}

/// A GTT entry pointing far beyond guest RAM (64 GiB): BLIT and READBACK fail with
/// GTT_FAULT, nothing is drawn, and the device keeps working.
fn beyond_ram(r: &mut Report, g: &mut Gpu) -> Option<()> {
    const FAR: u64 = 64 << 30;
    const GTT: u32 = 1000;
    r.ok("gpu.far_gtt", g.drv.set_gtt(GTT, FAR, true))?;
    let n0 = error_count(r, g, "gpu.far_count")?;
    let blit = Command::Blit {
        gtt_index: GTT,
        stride: 64,
        w: 16,
        h: 1,
        dst_x: 0,
        dst_y: 0,
    };
    let at = r.ok("gpu.far_blit_run", g.run(&[blit]))?;
    g.check_error(r, "gpu.far_blit", ERR_GTT_FAULT, at, n0 + 1);
    g.ack_error(r, "gpu.far_blit_ack", n0 + 1);
    let rb = Command::Readback {
        src_x: 0,
        src_y: 0,
        w: 16,
        h: 1,
        gtt_index: GTT,
        stride: 64,
    };
    let at = r.ok("gpu.far_readback_run", g.run(&[rb]))?;
    g.check_error(r, "gpu.far_readback", ERR_GTT_FAULT, at, n0 + 2);
    g.ack_error(r, "gpu.far_readback_ack", n0 + 2);
    fills(r, g, "gpu.far_recovered", &[((0, 0, 16, 1), 0x00ab_cdef)])?;
    r.ok("gpu.far_gtt_clear", g.drv.clear_gtt(GTT, 1))?;
    Some(())
}

/// IRQ_ENABLE = FENCE, three FENCEs: one uio interrupt each (the kernel's handler masks
/// INTx with Interrupt Disable; the driver acknowledges in IRQ_ACK, then clears it).
fn intx(r: &mut Report, g: &mut Gpu) -> Option<()> {
    let setup = (|| -> std::io::Result<u32> {
        g.drv.ack(IRQ_ALL)?;
        let stale = g.uio.wait(Duration::ZERO)?;
        g.drv.enable_irqs(IRQ_FENCE)?;
        Ok(stale + g.uio.wait(Duration::from_millis(300))?)
    })();
    let stray = r.ok("gpu.intx_setup", setup)?;
    let mut got = Vec::new();
    for _ in 0..3 {
        g.fence = g.fence.wrapping_add(1);
        let fence = g.fence;
        let one = (|| -> std::io::Result<(u32, u32, u32, u16, u32)> {
            g.submit(&[Command::Fence { value: fence }])?;
            let n = g.uio.wait(Duration::from_secs(10))?;
            let status = g.drv.read(REG_IRQ_STATUS)?;
            let fv = g.drv.read(REG_FENCE_VALUE)?;
            let cmd = g.dev.command()?;
            g.drv.ack(IRQ_FENCE)?;
            let after = g.drv.read(REG_IRQ_STATUS)?;
            Uio::reenable(&g.dev)?;
            Ok((n, status, fv, cmd, after))
        })();
        got.push((fence, r.ok("gpu.intx_round", one)?));
    }
    let extra = r.ok("gpu.intx_tail", g.uio.wait(Duration::from_millis(500)))?;
    let detail: Vec<String> = got
        .iter()
        .map(|(f, (n, st, fv, cmd, after))| {
            format!("fence {f}: {n} irq, IRQ_STATUS {st:#x} -> {after:#x}, FENCE_VALUE {fv}, command {cmd:#06x}")
        })
        .collect();
    r.check(
        "gpu.intx_3",
        got.iter().all(|(_, (n, ..))| *n == 1) && stray == 0 && extra == 0,
        format_args!("{}; {stray} before, {extra} after", detail.join("; ")),
    );
    r.check(
        "gpu.intx_fence_status",
        got.iter().all(|(f, (_, st, fv, cmd, after))| {
            st & IRQ_FENCE != 0
                && fv == f
                && cmd & command::INTX_DISABLE != 0
                && after & IRQ_FENCE == 0
        }),
        "IRQ_STATUS.FENCE set with FENCE_VALUE reached and Interrupt Disable set by the \
         handler at each interrupt, clear after IRQ_ACK",
    );
    r.ok("gpu.intx_disable", g.drv.enable_irqs(0))?;
    Some(())
}

/// Throughput: one doorbell publishes a batch of `n` small 8×8 FILLs and a FENCE;
/// commands/s from the doorbell to the fence, and from the guest's first ring write to the
/// fence. Checks the screen.
pub(crate) fn fill_batch(r: &mut Report, g: &mut Gpu, p: &str, n: u32) -> Option<()> {
    let rects: Vec<(Rect, u32)> = (0..n)
        .map(|i| {
            let (x, y) = ((i * 37) % (W - 8), (i * 11) % (H - 8));
            ((x, y, 8, 8), pattern(0x00_0f0f, i, i >> 12))
        })
        .collect();
    let mut cmds: Vec<Command> = rects.iter().map(|&(rect, c)| fill_cmd(rect, c)).collect();
    g.fence = g.fence.wrapping_add(1);
    cmds.push(Command::Fence { value: g.fence });
    let fence = g.fence;
    let t0 = Instant::now();
    r.ok(&format!("{p}.fill_batch_submit"), g.submit(&cmds))?;
    let t1 = Instant::now();
    r.ok(&format!("{p}.fill_batch_fence"), g.drv.wait_fence(fence))?;
    let (all, device) = (t0.elapsed().as_secs_f64(), t1.elapsed().as_secs_f64());
    let cmds = f64::from(n + 1);
    r.measure("fill_cmds_per_s", cmds / device, "cmd/s");
    r.measure("fill_cmds_per_s_incl_ring_write", cmds / all, "cmd/s");
    for &(rect, c) in &rects {
        g.model_fill(rect, c);
    }
    g.check_fb(r, &format!("{p}.fill_batch_pixels"));
    Some(())
}

/// Throughput: READBACK of the whole mode into scattered pages (first use pins them, the
/// batch after reuses the pins); checks the last copy pixel by pixel.
fn readback_batch(r: &mut Report, g: &mut Gpu) -> Option<()> {
    const REPEAT: u32 = 8;
    let stride = W * 4;
    let dst = r.ok("gpu.readback_batch_alloc", Surface::new(W, H, stride, 0))?;
    r.ok("gpu.readback_batch_gtt", g.map(0, &dst, true))?;
    let cmd = Command::Readback {
        src_x: 0,
        src_y: 0,
        w: W,
        h: H,
        gtt_index: 0,
        stride,
    };
    let bytes = f64::from(W * H * 4);
    let t0 = Instant::now();
    r.ok("gpu.readback_first_run", g.run(&[cmd]))?;
    let first = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    r.ok("gpu.readback_batch_run", g.run(&vec![cmd; REPEAT as usize]))?;
    let batch = t1.elapsed().as_secs_f64();
    r.measure("readback_first_mb_s", bytes / first / 1e6, "MB/s");
    r.measure(
        "readback_mb_s",
        bytes * f64::from(REPEAT) / batch / 1e6,
        "MB/s",
    );
    let model = &g.model;
    let diff = dst.diff(|x, y| model[(y * W + x) as usize]);
    let (bad, first_bad) = r.ok("gpu.readback_batch_read", diff)?;
    r.check(
        "gpu.readback_batch_pixels",
        bad == 0,
        format_args!(
            "{bad} wrong bytes in {} pages ({} discontiguities){first_bad}",
            dst.pages(),
            dst.discontiguities()
        ),
    );
    r.ok(
        "gpu.readback_batch_gtt_clear",
        g.drv.clear_gtt(0, dst.pages() as u32),
    )?;
    Some(())
}

/// Bus Master cleared: no DMA reaches memory, the error is reported; set again: works.
pub fn run_bme(r: &mut Report) -> Option<()> {
    crate::gpu_dma::run_bme(r)
}

/// Plain RAM: the ring through DMA_READ works, GTT pins are refused with the documented error.
pub fn run_plain(r: &mut Report) -> Option<()> {
    crate::gpu_dma::run_plain(r)
}
