//! GPU device-level tests: invalidations (DMA unmap, GTT rewrites, reset) racing with the
//! worker's pinning never leave a pin behind.

mod gpu_common;

use std::time::Duration;

use gpu_common::*;
use umdev::device::Device;
use umdev::dma::{DmaMapping, PinPolicy, Prot};
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::Command;

fn blits() -> Vec<Command> {
    (0..40u32)
        .map(|i| Command::Blit {
            gtt_index: (i % 4) * 8,
            stride: 1024,
            w: 256,
            h: 30,
            dst_x: 0,
            dst_y: i % 200,
        })
        .collect()
}

fn map_surfaces(rig: &mut Rig) {
    rig.space
        .map(DmaMapping {
            iova: SURFACE_GPA,
            size: SURFACE_SIZE,
            prot: Prot::RW,
            fd: Some(rig.ram.try_clone_fd().unwrap()),
            offset: SURFACE_GPA - RAM_BASE,
        })
        .unwrap();
}

#[test]
fn test_unmap_racing_with_blits_leaves_no_pins() {
    let mut rig = Rig::new(PinPolicy::Lock);
    let pages: Vec<u64> = (0..32)
        .map(|k| SURFACE_GPA + ((k * 7) % 32) * 4096)
        .collect();
    rig.map_gtt(0, &pages, false);
    for round in 0..30 {
        rig.drv.submit(&mut rig.ram, &blits()).unwrap();
        // Unmap while the worker is (probably) pinning and blitting.
        std::thread::sleep(Duration::from_micros(200 * (round % 5)));
        let report = rig.unmap_surfaces();
        assert_eq!(report.leftover_pins, 0, "round {round}");
        assert_eq!(rig.gpu().pins_held(), 0);
        rig.drv.wait_idle().unwrap();
        // Blits that ran after the unmap failed cleanly.
        rig.drv.ack(IRQ_ALL).unwrap();
        assert_eq!(rig.gpu().pins_held(), 0, "no pin taken after the unmap");
        map_surfaces(&mut rig);
    }
    let stats = rig.space.stats();
    assert_eq!(stats.leaked_pins_released, 0);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_gtt_rewrites_racing_with_blits_leave_no_stale_pins() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let pages_a: Vec<u64> = (0..32).map(|k| SURFACE_GPA + k * 4096).collect();
    let pages_b: Vec<u64> = (0..32).map(|k| SURFACE_GPA + (32 + k) * 4096).collect();
    for round in 0..30 {
        let pages = if round % 2 == 0 { &pages_a } else { &pages_b };
        rig.map_gtt(0, pages, false);
        rig.drv.submit(&mut rig.ram, &blits()).unwrap();
        std::thread::sleep(Duration::from_micros(100 * (round % 7)));
    }
    rig.drv.wait_idle().unwrap();
    // Every pin held corresponds to the current GTT contents: rewriting everything drops all.
    assert!(rig.gpu().pins_held() <= 32);
    assert_eq!(
        rig.space.stats().pinned_pages as usize,
        rig.gpu().pins_held()
    );
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_reset_racing_with_blits_leaves_no_pins() {
    let mut rig = Rig::new(PinPolicy::Lock);
    let pages: Vec<u64> = (0..32).map(|k| SURFACE_GPA + k * 4096).collect();
    for round in 0..20 {
        rig.enable_device(); // Reset cleared Bus Master: a driver sets it again.
        rig.drv.set_mode(W, H, W * 4).unwrap();
        rig.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
        rig.map_gtt(0, &pages, false);
        rig.drv.submit(&mut rig.ram, &blits()).unwrap();
        std::thread::sleep(Duration::from_micros(150 * (round % 4)));
        rig.adapter().reset().unwrap();
        // A command in flight may finish, but it cannot keep a pin: entries are invalid now.
        assert!(rig.gpu().wait_idle(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(rig.gpu().pins_held(), 0, "round {round}");
        let stats = rig.space.stats();
        assert_eq!((stats.pinned_pages, stats.locked_pages), (0, 0));
    }
}
