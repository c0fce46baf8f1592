//! GPU device-level property tests: random register writes and random ring contents never
//! panic, never leak a pin, and leave the device serving.

mod gpu_common;

use std::time::Duration;

use gpu_common::*;
use proptest::prelude::*;
use umdev::device::{region_index, Device};
use umdev::dma::PinPolicy;
use umdev_devices::gpu::commands::header;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::Command;

/// Offsets worth hitting: every register, the GTT window, and anywhere.
fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop::sample::select(vec![
            REG_ID,
            REG_STATUS,
            REG_MODE_WIDTH,
            REG_MODE_HEIGHT,
            REG_MODE_STRIDE,
            REG_MODE_FORMAT,
            REG_MODE_CTRL,
            REG_RING_BASE_LO,
            REG_RING_BASE_HI,
            REG_RING_SIZE,
            REG_RING_CTRL,
            REG_RING_HEAD,
            REG_RING_TAIL,
            REG_IRQ_STATUS,
            REG_IRQ_ENABLE,
            REG_IRQ_ACK,
            REG_ERROR_CODE,
            REG_FENCE_VALUE,
            REG_GTT_INVAL_START,
            REG_GTT_INVAL_COUNT,
        ]),
        (0u64..16).prop_map(|i| GTT_BASE + i * 8),
        (0u64..BAR0_SIZE - 8),
    ]
}

/// Values worth writing: small, page-ish addresses of the rig's memory, anything.
fn value() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..8,
        Just(u64::from(RING_SIZE)),
        (0u64..64).prop_map(|p| (SURFACE_GPA + p * 4096) | GTT_VALID),
        (0u64..64).prop_map(|p| (RAM_BASE + p * 4096) | 3),
        any::<u64>(),
    ]
}

fn finish_and_check(rig: &mut Rig) {
    assert!(rig.gpu().wait_idle(Duration::from_secs(5)), "worker stuck");
    assert_eq!(rig.drv.read(REG_ID).unwrap(), ID_MAGIC);
    // The device's pin table and the DMA layer agree: every held pin is a pinned page.
    // (A command abandoned by a ring disable may still be finishing: allow it a moment.)
    let agree = |rig: &mut Rig| {
        let held = rig.gpu().pins_held() as u64;
        let pinned = rig.space.stats().pinned_pages;
        pinned <= held && (held == 0) == (pinned == 0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !agree(rig) {
        assert!(
            std::time::Instant::now() < deadline,
            "pin table and DMA layer disagree"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.space.check_invariants().unwrap();
    rig.adapter().reset().unwrap();
    assert_eq!(rig.gpu().pins_held(), 0);
    let stats = rig.space.stats();
    assert_eq!((stats.pinned_pages, stats.locked_pages), (0, 0));
    // Still serving after reset, once the guest re-enables the device.
    rig.enable_device();
    rig.drv.set_mode(W, H, W * 4).unwrap();
    rig.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    rig.run_fenced(&[], 0xfeed);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn test_random_register_writes_never_panic_or_leak_pins(
        writes in prop::collection::vec((offset(), 1usize..=8, value()), 1..40),
    ) {
        let mut rig = Rig::new(PinPolicy::Lock);
        // Something worth pinning: a blit source in the GTT.
        rig.map_gtt(0, &[SURFACE_GPA, SURFACE_GPA + 0x3000], false);
        for (off, len, val) in writes {
            let bytes = val.to_le_bytes();
            rig.adapter().region_write(region_index::BAR0, off, &bytes[..len]).unwrap();
            let mut back = [0u8; 8];
            rig.adapter().region_read(region_index::BAR0, off, &mut back[..len]).unwrap();
            // Occasionally give the worker something that pins.
            if val % 5 == 0 {
                let blit = Command::encode_bytes(&[Command::Blit {
                    gtt_index: 0, stride: 64, w: 16, h: 64, dst_x: 0, dst_y: 0,
                }]);
                rig.ram.write(RING_GPA, &blit).unwrap();
                rig.drv.write(REG_RING_TAIL, blit.len() as u32).unwrap();
            }
        }
        finish_and_check(&mut rig);
    }

    #[test]
    fn test_random_ring_contents_never_panic_or_leak_pins(
        dwords in prop::collection::vec(prop_oneof![
            any::<u32>(),
            (0u8..8, 0u16..10).prop_map(|(op, len)| header(op, len)),
            0u32..400,
        ], 1..200),
    ) {
        let mut rig = Rig::new(PinPolicy::Translate);
        rig.map_gtt(0, &[SURFACE_GPA, SURFACE_GPA + 0x2000, SURFACE_GPA + 0x1000], true);
        rig.map_gtt(3, &[RO_GPA], true);
        rig.map_gtt(4, &[UNMAPPED_GPA], false);
        let bytes: Vec<u8> = dwords.iter().flat_map(|d| d.to_le_bytes()).collect();
        rig.ram.write(RING_GPA, &bytes).unwrap();
        rig.drv.write(REG_RING_TAIL, bytes.len() as u32).unwrap();
        assert!(rig.gpu().wait_idle(Duration::from_secs(5)), "worker stuck");
        prop_assert_eq!(rig.drv.read(REG_RING_HEAD).unwrap(), bytes.len() as u32);
        finish_and_check(&mut rig);
    }

    #[test]
    fn test_random_fill_copy_sequences_match_model(
        ops in prop::collection::vec(
            (any::<bool>(), 0u32..W, 0u32..H, 0u32..W, 0u32..H, 1u32..80, 1u32..60, any::<u32>()),
            1..30,
        ),
    ) {
        let mut rig = Rig::new(PinPolicy::Translate);
        let mut m = Model::new(W, H);
        let mut cmds = Vec::new();
        for (is_fill, x, y, x2, y2, w, h, color) in ops {
            // Clip into the mode so every command is valid.
            let w = w.min(W - x).min(W - x2);
            let h = h.min(H - y).min(H - y2);
            if is_fill {
                let color = color & 0x00ff_ffff;
                cmds.push(Command::FillRect { x, y, w, h, color });
                m.fill(x, y, w, h, color);
            } else {
                cmds.push(Command::CopyRect { src_x: x, src_y: y, dst_x: x2, dst_y: y2, w, h });
                m.copy(x, y, x2, y2, w, h);
            }
        }
        rig.run_fenced(&cmds, 1);
        prop_assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
        let screen = rig.screen();
        let bad = screen.iter().zip(&m.px).position(|(a, b)| a != b);
        prop_assert!(bad.is_none(), "first wrong pixel at index {:?}", bad);
    }
}
