//! GPU device-level tests: a known scene drawn through the ring matches a reference model
//! pixel for pixel; fences raise interrupts; pins are held and released as documented.

mod gpu_common;

use std::time::Duration;

use gpu_common::*;
use umdev::device::{irq_index, Device};
use umdev::dma::PinPolicy;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::Command;

/// Scattered guest pages for a 7-page surface (GTT order → guest page).
fn scattered_pages() -> Vec<u64> {
    [5u64, 0, 12, 3, 9, 1, 7]
        .iter()
        .map(|k| SURFACE_GPA + k * 4096)
        .collect()
}

/// Contiguous guest pages for a 4-page surface.
fn contiguous_pages() -> Vec<u64> {
    (0..4).map(|k| SURFACE_GPA + 0x40000 + k * 4096).collect()
}

/// Draw the scene on `rig` and on a model; returns the model.
fn draw_scene(rig: &mut Rig) -> Model {
    let mut m = Model::new(W, H);
    // Scattered surface: 100×50, stride 512 → 25,600 bytes = 7 GTT pages.
    let scattered = scattered_pages();
    write_surface(&rig.ram, &scattered, 512, 100, 50);
    rig.map_gtt(10, &scattered, false);
    // Contiguous surface: 64×64, stride 256 → 4 GTT pages.
    let contiguous = contiguous_pages();
    write_surface(&rig.ram, &contiguous, 256, 64, 64);
    rig.map_gtt(100, &contiguous, false);

    let cmds = [
        Command::FillRect {
            x: 0,
            y: 0,
            w: W,
            h: H,
            color: 0x20_2020,
        },
        Command::FillRect {
            x: 10,
            y: 10,
            w: 50,
            h: 40,
            color: 0xff_0000,
        },
        Command::FillRect {
            x: 20,
            y: 15,
            w: 10,
            h: 10,
            color: 0x00_00ff,
        },
        Command::FillRect {
            x: 200,
            y: 100,
            w: 60,
            h: 60,
            color: 0x00_ff00,
        },
        // Overlapping copy down-right, then up-left (memmove both directions).
        Command::CopyRect {
            src_x: 10,
            src_y: 10,
            dst_x: 30,
            dst_y: 20,
            w: 50,
            h: 40,
        },
        Command::CopyRect {
            src_x: 30,
            src_y: 20,
            dst_x: 25,
            dst_y: 15,
            w: 50,
            h: 40,
        },
        Command::CopyRect {
            src_x: 200,
            src_y: 100,
            dst_x: 0,
            dst_y: 180,
            w: 60,
            h: 60,
        },
        Command::Blit {
            gtt_index: 10,
            stride: 512,
            w: 100,
            h: 50,
            dst_x: 150,
            dst_y: 20,
        },
        Command::Blit {
            gtt_index: 100,
            stride: 256,
            w: 64,
            h: 64,
            dst_x: 240,
            dst_y: 150,
        },
        Command::Nop,
    ];
    m.fill(0, 0, W, H, 0x20_2020);
    m.fill(10, 10, 50, 40, 0xff_0000);
    m.fill(20, 15, 10, 10, 0x00_00ff);
    m.fill(200, 100, 60, 60, 0x00_ff00);
    m.copy(10, 10, 30, 20, 50, 40);
    m.copy(30, 20, 25, 15, 50, 40);
    m.copy(200, 100, 0, 180, 60, 60);
    m.blit_pattern(100, 50, 150, 20);
    m.blit_pattern(64, 64, 240, 150);
    // A fence value not seen before, so the wait cannot return early.
    let fence = rig.drv.read(REG_FENCE_VALUE).unwrap() + 1;
    rig.run_fenced(&cmds, fence);
    m
}

fn assert_screen_eq(rig: &mut Rig, m: &Model) {
    let screen = rig.screen();
    assert_eq!(screen.len(), m.px.len());
    let bad = screen.iter().zip(&m.px).position(|(a, b)| a != b);
    if let Some(i) = bad {
        let (x, y) = (i as u32 % W, i as u32 / W);
        panic!(
            "pixel ({x},{y}) is {:#08x}, expected {:#08x}",
            screen[i], m.px[i]
        );
    }
}

#[test]
fn test_scene_translate_matches_model_exactly_and_releases_pins() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let m = draw_scene(&mut rig);
    assert_screen_eq(&mut rig, &m);
    assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    // 7 + 4 GTT pages pinned (cached until the GTT changes).
    assert_eq!(rig.gpu().pins_held(), 11);
    let observer = rig.gpu().handle();
    assert_eq!(observer.pins_held(), 11);
    assert_eq!(observer.pixel(160, 30), rig.gpu().pixel(160, 30));
    assert_eq!(rig.space.stats().pinned_pages, 11);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_scene_lock_policy_locks_then_releases_every_page() {
    let mut rig = Rig::new(PinPolicy::Lock);
    let m = draw_scene(&mut rig);
    assert_screen_eq(&mut rig, &m);
    assert_eq!(rig.space.stats().locked_pages, 11);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_scene_repeated_blit_reuses_cached_pins() {
    let mut rig = Rig::new(PinPolicy::Translate);
    draw_scene(&mut rig);
    let before = rig.space.stats();
    let m = draw_scene(&mut rig);
    assert_screen_eq(&mut rig, &m);
    let after = rig.space.stats();
    assert_eq!(after.pinned_pages, before.pinned_pages);
    assert_eq!(rig.gpu().pins_held(), 11);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_gtt_rewrite_drops_old_pin_and_blits_new_page() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let page_a = SURFACE_GPA;
    let page_b = SURFACE_GPA + 0x8000;
    rig.ram.fill(page_a, 4096, 0x11).unwrap();
    rig.ram.fill(page_b, 4096, 0x22).unwrap();
    let blit = Command::Blit {
        gtt_index: 0,
        stride: 64,
        w: 16,
        h: 16,
        dst_x: 0,
        dst_y: 0,
    };
    rig.map_gtt(0, &[page_a], false);
    rig.run_fenced(&[blit], 1);
    assert_eq!(rig.gpu().pixel(0, 0), Some(0x1111_1111));
    assert_eq!(rig.gpu().pins_held(), 1);
    rig.map_gtt(0, &[page_b], false);
    assert_eq!(rig.space.stats().pinned_pages, 0, "rewrite unpinned page A");
    rig.run_fenced(&[blit], 2);
    assert_eq!(rig.gpu().pixel(15, 15), Some(0x2222_2222));
    assert_eq!(rig.space.stats().pinned_pages, 1);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_readback_into_scattered_pages_copies_framebuffer() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let m = draw_scene(&mut rig);
    let pages: Vec<u64> = [3u64, 1, 2]
        .iter()
        .map(|k| RO_GPA - (k + 1) * 4096)
        .collect();
    rig.map_gtt(200, &pages, true);
    // 40×60 rectangle, stride 160: 9,600 bytes = 3 pages.
    rig.run_fenced(
        &[Command::Readback {
            src_x: 140,
            src_y: 10,
            w: 40,
            h: 60,
            gtt_index: 200,
            stride: 160,
        }],
        2,
    );
    for y in 0..60u32 {
        for x in 0..40u32 {
            let o = u64::from(y) * 160 + u64::from(x) * 4;
            let mut b = [0u8; 4];
            rig.ram
                .read(pages[(o / 4096) as usize] + o % 4096, &mut b)
                .unwrap();
            let want = m.px[((10 + y) * W + 140 + x) as usize];
            assert_eq!(u32::from_le_bytes(b), want, "({x},{y})");
        }
    }
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_readback_after_blit_upgrades_read_only_pins() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let page = SURFACE_GPA + 0x1000;
    rig.map_gtt(0, &[page], true);
    rig.run_fenced(
        &[
            Command::Blit {
                gtt_index: 0,
                stride: 64,
                w: 16,
                h: 16,
                dst_x: 0,
                dst_y: 0,
            },
            Command::FillRect {
                x: 0,
                y: 0,
                w: 16,
                h: 16,
                color: 0xabcdef,
            },
            Command::Readback {
                src_x: 0,
                src_y: 0,
                w: 16,
                h: 16,
                gtt_index: 0,
                stride: 64,
            },
        ],
        3,
    );
    let mut b = [0u8; 4];
    rig.ram.read(page + 64 * 15 + 60, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 0xabcdef);
    assert_eq!(rig.gpu().pins_held(), 1);
    assert_eq!(rig.space.stats().pinned_pages, 1);
    rig.assert_no_pins_after_gtt_clear();
}

fn fence_fires(rig: &mut Rig, index: u32) {
    let efd = rig.irq_eventfd(index);
    rig.drv.enable_irqs(IRQ_FENCE | IRQ_ERROR).unwrap();
    rig.run_fenced(
        &[Command::FillRect {
            x: 0,
            y: 0,
            w: 8,
            h: 8,
            color: 1,
        }],
        7,
    );
    assert!(
        wait_eventfd(&efd, Duration::from_secs(5)),
        "eventfd of irq index {index} did not fire"
    );
    assert_eq!(rig.drv.read(REG_IRQ_STATUS).unwrap() & IRQ_FENCE, IRQ_FENCE);
    assert_eq!(rig.drv.read(REG_FENCE_VALUE).unwrap(), 7);
    rig.drv.ack(IRQ_FENCE).unwrap();
    assert_eq!(rig.drv.read(REG_IRQ_STATUS).unwrap(), 0);
}

#[test]
fn test_fence_raises_msix_eventfd() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.enable_msix();
    fence_fires(&mut rig, irq_index::MSIX);
}

#[test]
fn test_fence_raises_msi_eventfd() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.enable_msi();
    fence_fires(&mut rig, irq_index::MSI);
}

#[test]
fn test_fence_raises_intx_eventfd_without_msi() {
    let mut rig = Rig::new(PinPolicy::Translate);
    fence_fires(&mut rig, irq_index::INTX);
}

#[test]
fn test_intx_fires_again_after_ack_and_unmask() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let efd = rig.irq_eventfd(irq_index::INTX);
    rig.drv.enable_irqs(IRQ_FENCE).unwrap();
    rig.run_fenced(&[], 1);
    assert!(wait_eventfd(&efd, Duration::from_secs(5)));
    // Automasked: a second fence before the unmask does not fire yet.
    rig.run_fenced(&[], 2);
    assert!(!wait_eventfd(&efd, Duration::from_millis(20)));
    // Handler acks everything, VMM unmasks: the line was lowered, nothing fires.
    rig.drv.ack(IRQ_FENCE).unwrap();
    rig.unmask(irq_index::INTX);
    assert!(!wait_eventfd(&efd, Duration::from_millis(20)));
    // The next fence fires.
    rig.run_fenced(&[], 3);
    assert!(wait_eventfd(&efd, Duration::from_secs(5)));
}

#[test]
fn test_fence_with_irq_disabled_sets_status_without_eventfd() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.enable_msix();
    let efd = rig.irq_eventfd(irq_index::MSIX);
    rig.run_fenced(&[], 3);
    assert_eq!(rig.drv.read(REG_IRQ_STATUS).unwrap(), IRQ_FENCE);
    assert!(!wait_eventfd(&efd, Duration::from_millis(50)));
    // Enabling a pending cause raises it.
    rig.drv.enable_irqs(IRQ_FENCE).unwrap();
    assert!(wait_eventfd(&efd, Duration::from_secs(5)));
}

#[test]
fn test_unmap_notifier_drops_pins_and_next_blit_faults() {
    let mut rig = Rig::new(PinPolicy::Lock);
    draw_scene(&mut rig);
    assert_eq!(rig.gpu().pins_held(), 11);
    let report = rig.unmap_surfaces();
    assert_eq!(report.leftover_pins, 0, "device dropped its pins itself");
    assert_eq!(rig.gpu().pins_held(), 0);
    let stats = rig.space.stats();
    assert_eq!((stats.pinned_pages, stats.locked_pages), (0, 0));
    rig.run_fenced(
        &[Command::Blit {
            gtt_index: 10,
            stride: 512,
            w: 100,
            h: 50,
            dst_x: 0,
            dst_y: 0,
        }],
        9,
    );
    assert_eq!(rig.take_error().0, umdev_devices::gpu::error::ERR_GTT_FAULT);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_reset_releases_pins_and_restores_registers() {
    let mut rig = Rig::new(PinPolicy::Lock);
    draw_scene(&mut rig);
    rig.drv.enable_irqs(IRQ_ALL).unwrap();
    assert!(rig.gpu().pins_held() > 0);
    rig.adapter().reset().unwrap();
    assert_eq!(rig.gpu().pins_held(), 0);
    let stats = rig.space.stats();
    assert_eq!((stats.pinned_pages, stats.locked_pages), (0, 0));
    for (reg, want) in [
        (REG_MODE_CTRL, 0),
        (REG_RING_CTRL, 0),
        (REG_RING_HEAD, 0),
        (REG_IRQ_ENABLE, 0),
        (REG_FENCE_VALUE, 0),
        (REG_MODE_WIDTH, DEFAULT_WIDTH),
        (GTT_BASE + 10 * 8, 0),
    ] {
        assert_eq!(rig.drv.read(reg).unwrap(), want, "register {reg:#x}");
    }
}

#[test]
fn test_disconnect_releases_pins_keeps_gtt() {
    let mut rig = Rig::new(PinPolicy::Translate);
    draw_scene(&mut rig);
    rig.adapter().disconnected();
    assert_eq!(rig.gpu().pins_held(), 0);
    assert_eq!(rig.space.stats().pinned_pages, 0);
    assert_ne!(rig.drv.read(GTT_BASE + 10 * 8).unwrap(), 0);
}

#[test]
fn test_ring_wraps_around_end() {
    let mut rig = Rig::new(PinPolicy::Translate);
    // 24-byte fills: 64 KiB / 24 is not whole, so commands straddle the ring's end.
    let mut m = Model::new(W, H);
    for round in 0..6u32 {
        let cmds: Vec<Command> = (0..500u32)
            .map(|i| {
                let c = round * 1000 + i;
                Command::FillRect {
                    x: i % W,
                    y: round,
                    w: 1,
                    h: 1,
                    color: c,
                }
            })
            .collect();
        for i in 0..500u32 {
            m.fill(i % W, round, 1, 1, round * 1000 + i);
        }
        rig.run_fenced(&cmds, round + 1);
    }
    let screen = rig.screen();
    assert_eq!(&screen[..(6 * W) as usize], &m.px[..(6 * W) as usize]);
    assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
}

#[test]
fn test_write_png_produces_decodable_image() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let m = draw_scene(&mut rig);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scene.png");
    rig.gpu().write_png(&path).unwrap();
    let decoder = png::Decoder::new(std::fs::File::open(&path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (W, H));
    let (x, y) = (160u32, 30u32);
    let i = ((y * W + x) * 3) as usize;
    let want = m.px[(y * W + x) as usize];
    assert_eq!(
        [buf[i], buf[i + 1], buf[i + 2]],
        [(want >> 16) as u8, (want >> 8) as u8, want as u8]
    );
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_demo_scene_draws_surface_and_frame() {
    use umdev_devices::gpu::demo_scene::{self, SURFACE_PAGES};
    let mut rig = Rig::new(PinPolicy::Translate);
    // Scatter the surface: every third page, backwards.
    let pages: Vec<u64> = (0..SURFACE_PAGES as u64)
        .rev()
        .map(|k| SURFACE_GPA + k * 3 * 4096)
        .collect();
    let summary = demo_scene::draw(&mut rig.drv, &mut rig.ram, &pages, (W, H)).unwrap();
    assert!(summary.commands > 20);
    assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    let (x0, y0) = (W / 8, H / 8);
    assert_eq!(
        rig.gpu().pixel(x0 + 5, y0 + 7),
        Some(demo_scene::surface_pixel(5, 7))
    );
    assert_eq!(rig.gpu().pixel(0, 0), Some(0xff_c000));
    assert_eq!(rig.gpu().pins_held(), SURFACE_PAGES);
    rig.assert_no_pins_after_gtt_clear();
}

/// Blit a 16-page surface (256×64, stride 1024) mapped at GTT entry 0 from `pages`;
/// returns the residency syscalls its pinning and its release (one batch GTT invalidation)
/// cost under `PinPolicy::Lock`.
fn lock_syscalls_for_surface(pages: &[u64]) -> (u64, u64) {
    let mut rig = Rig::new(PinPolicy::Lock);
    rig.map_gtt(0, pages, false);
    let before = rig.space.stats().residency_syscalls;
    rig.run_fenced(
        &[Command::Blit {
            gtt_index: 0,
            stride: 1024,
            w: 256,
            h: 64,
            dst_x: 0,
            dst_y: 0,
        }],
        1,
    );
    let pin_cost = rig.space.stats().residency_syscalls - before;
    assert_eq!(rig.space.stats().locked_pages, 16);
    let before = rig.space.stats().residency_syscalls;
    rig.assert_no_pins_after_gtt_clear();
    (pin_cost, rig.space.stats().residency_syscalls - before)
}

#[test]
fn test_contiguous_surface_pins_as_one_run_scattered_as_many() {
    // 256×64 pixels, stride 1024: 64 KiB = 16 GTT pages pinned in one array call.
    let contiguous: Vec<u64> = (0..16).map(|k| SURFACE_GPA + k * 4096).collect();
    let scattered: Vec<u64> = (0..16).map(|k| SURFACE_GPA + k * 2 * 4096).collect();
    let one_run = lock_syscalls_for_surface(&contiguous);
    let many_runs = lock_syscalls_for_surface(&scattered);
    assert_eq!(
        one_run,
        (1, 1),
        "contiguous surface: one mlock, one munlock"
    );
    assert_eq!(many_runs, (16, 16), "scattered surface: one per page");
}
