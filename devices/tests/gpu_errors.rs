//! GPU device-level tests: every bad command and bad register write ends in the documented
//! error status and error interrupt, and the device keeps serving afterwards.

mod gpu_common;

use std::time::Duration;

use gpu_common::*;
use umdev::dma::PinPolicy;
use umdev_devices::gpu::commands::{header, OP_FILL_RECT, OP_NOP};
use umdev_devices::gpu::error::*;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::Command;

const GOOD_FILL: Command = Command::FillRect {
    x: 1,
    y: 1,
    w: 2,
    h: 2,
    color: 0x0012_3456,
};

/// Run `bad` (at ring offset 0 of a fresh rig) followed by a good fill and a fence; the
/// error must be `code` at ring offset `info`, the interrupt must fire, and the good fill
/// must still be executed.
fn expect_command_error(rig: &mut Rig, bad: &[Command], code: u32, info: u32) {
    let efd = rig.enable_msix();
    rig.drv.enable_irqs(IRQ_ERROR).unwrap();
    let mut cmds = bad.to_vec();
    cmds.push(GOOD_FILL);
    rig.run_fenced(&cmds, 0x77);
    assert!(wait_eventfd(&efd, Duration::from_secs(5)), "error IRQ");
    assert_eq!(rig.drv.read(REG_IRQ_STATUS).unwrap() & IRQ_ERROR, IRQ_ERROR);
    assert_eq!(rig.take_error(), (code, info));
    assert_eq!(rig.drv.read(REG_IRQ_STATUS).unwrap() & IRQ_ERROR, 0);
    assert_eq!(
        rig.gpu().pixel(2, 2),
        Some(0x0012_3456),
        "device kept serving"
    );
    rig.assert_no_pins_after_gtt_clear();
}

/// Write raw dwords into the ring at the current tail and publish them.
fn submit_raw(rig: &mut Rig, tail: u32, dwords: &[u32]) -> u32 {
    let bytes: Vec<u8> = dwords.iter().flat_map(|d| d.to_le_bytes()).collect();
    rig.ram.write(RING_GPA + u64::from(tail), &bytes).unwrap();
    let new_tail = tail + bytes.len() as u32;
    rig.drv.write(REG_RING_TAIL, new_tail).unwrap();
    new_tail
}

fn wait_head(rig: &mut Rig, want: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while rig.drv.read(REG_RING_HEAD).unwrap() != want {
        assert!(std::time::Instant::now() < deadline, "ring head stuck");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn test_fill_out_of_bounds_with_overflowing_sum_reports_out_of_bounds() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let bad = Command::FillRect {
        x: u32::MAX,
        y: 0,
        w: 2,
        h: 1,
        color: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_OUT_OF_BOUNDS, 0);
}

#[test]
fn test_copy_destination_out_of_bounds_reports_out_of_bounds() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let nop = Command::Nop;
    let bad = Command::CopyRect {
        src_x: 0,
        src_y: 0,
        dst_x: W - 1,
        dst_y: 0,
        w: 2,
        h: 1,
    };
    // After one NOP: the bad command's header is at ring offset 4.
    expect_command_error(&mut rig, &[nop, bad], ERR_OUT_OF_BOUNDS, 4);
}

#[test]
fn test_blit_invalid_gtt_entry_reports_gtt_invalid() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.map_gtt(0, &[SURFACE_GPA], false);
    // Two pages needed, entry 1 invalid.
    let bad = Command::Blit {
        gtt_index: 0,
        stride: 4096,
        w: 4,
        h: 2,
        dst_x: 0,
        dst_y: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_INVALID, 0);
}

#[test]
fn test_blit_unmapped_page_reports_gtt_fault_and_pins_nothing() {
    let mut rig = Rig::new(PinPolicy::Lock);
    rig.map_gtt(0, &[SURFACE_GPA, UNMAPPED_GPA, SURFACE_GPA + 4096], false);
    let bad = Command::Blit {
        gtt_index: 0,
        stride: 4096,
        w: 4,
        h: 3,
        dst_x: 0,
        dst_y: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_FAULT, 0);
}

#[test]
fn test_blit_past_gtt_end_reports_gtt_range() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let bad = Command::Blit {
        gtt_index: GTT_ENTRIES - 1,
        stride: 4096,
        w: 4,
        h: 2,
        dst_x: 0,
        dst_y: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_RANGE, 0);
}

#[test]
fn test_blit_huge_gtt_index_reports_gtt_range() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let bad = Command::Blit {
        gtt_index: u32::MAX,
        stride: 4,
        w: 1,
        h: 1,
        dst_x: 0,
        dst_y: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_RANGE, 0);
}

#[test]
fn test_blit_short_stride_reports_bad_stride() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let bad = Command::Blit {
        gtt_index: 0,
        stride: 8,
        w: 4,
        h: 2,
        dst_x: 0,
        dst_y: 0,
    };
    expect_command_error(&mut rig, &[bad], ERR_BAD_STRIDE, 0);
}

#[test]
fn test_blit_destination_out_of_bounds_reports_out_of_bounds() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.map_gtt(0, &[SURFACE_GPA], false);
    let bad = Command::Blit {
        gtt_index: 0,
        stride: 64,
        w: 16,
        h: 16,
        dst_x: 0,
        dst_y: H - 8,
    };
    expect_command_error(&mut rig, &[bad], ERR_OUT_OF_BOUNDS, 0);
}

#[test]
fn test_readback_without_writable_bit_reports_gtt_readonly() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.map_gtt(0, &[SURFACE_GPA], false);
    let bad = Command::Readback {
        src_x: 0,
        src_y: 0,
        w: 4,
        h: 4,
        gtt_index: 0,
        stride: 16,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_READONLY, 0);
}

#[test]
fn test_readback_into_read_only_mapping_reports_gtt_fault() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.map_gtt(0, &[RO_GPA], true);
    let bad = Command::Readback {
        src_x: 0,
        src_y: 0,
        w: 4,
        h: 4,
        gtt_index: 0,
        stride: 16,
    };
    expect_command_error(&mut rig, &[bad], ERR_GTT_FAULT, 0);
}

#[test]
fn test_blit_from_read_only_mapping_succeeds() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.ram.fill(RO_GPA, 4096, 0x5a).unwrap();
    rig.map_gtt(0, &[RO_GPA], false);
    rig.run_fenced(
        &[Command::Blit {
            gtt_index: 0,
            stride: 16,
            w: 4,
            h: 4,
            dst_x: 0,
            dst_y: 0,
        }],
        1,
    );
    assert_eq!(rig.gpu().pixel(3, 3), Some(0x5a5a_5a5a));
    assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    rig.assert_no_pins_after_gtt_clear();
}

#[test]
fn test_drawing_without_mode_reports_mode_disabled() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.drv.write(REG_MODE_CTRL, 0).unwrap();
    rig.run_fenced(&[GOOD_FILL], 1);
    assert_eq!(rig.take_error(), (ERR_MODE_DISABLED, 0));
}

#[test]
fn test_unknown_opcode_is_skipped_by_length() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let tail = submit_raw(&mut rig, 0, &[header(0x77, 3), 0xdead, 0xbeef]);
    let mut good = Vec::new();
    GOOD_FILL.encode(&mut good);
    Command::Fence { value: 5 }.encode(&mut good);
    submit_raw(&mut rig, tail, &good);
    rig.drv.wait_fence(5).unwrap();
    assert_eq!(rig.take_error(), (ERR_BAD_OPCODE, 0));
    assert_eq!(rig.gpu().pixel(2, 2), Some(0x0012_3456));
}

#[test]
fn test_wrong_length_is_skipped_by_length() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let mut dw = vec![header(OP_FILL_RECT, 3), 0, 0];
    GOOD_FILL.encode(&mut dw);
    Command::Fence { value: 6 }.encode(&mut dw);
    submit_raw(&mut rig, 0, &dw);
    rig.drv.wait_fence(6).unwrap();
    assert_eq!(rig.take_error(), (ERR_BAD_LENGTH, 0));
    assert_eq!(rig.gpu().pixel(2, 2), Some(0x0012_3456));
}

#[test]
fn test_length_past_tail_drops_rest_and_reports_truncated() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let tail = submit_raw(
        &mut rig,
        0,
        &[header(OP_NOP, 1), header(OP_NOP, 0x100), 1, 2],
    );
    wait_head(&mut rig, tail);
    assert_eq!(rig.take_error(), (ERR_TRUNCATED, 4));
    // Still serving.
    let mut dw = Vec::new();
    Command::Fence { value: 8 }.encode(&mut dw);
    submit_raw(&mut rig, tail, &dw);
    rig.drv.wait_fence(8).unwrap();
}

#[test]
fn test_zero_length_reports_truncated() {
    let mut rig = Rig::new(PinPolicy::Translate);
    let tail = submit_raw(&mut rig, 0, &[0, 0]);
    wait_head(&mut rig, tail);
    assert_eq!(rig.take_error(), (ERR_TRUNCATED, 0));
}

#[test]
fn test_unmapped_ring_reports_ring_fault_and_recovers() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.drv.setup_ring(UNMAPPED_GPA, 4096).unwrap();
    rig.drv.write(REG_RING_TAIL, 16).unwrap();
    wait_head(&mut rig, 16);
    assert_eq!(rig.take_error(), (ERR_RING_FAULT, 0));
    rig.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    rig.run_fenced(&[GOOD_FILL], 3);
    assert_eq!(rig.gpu().pixel(1, 1), Some(0x0012_3456));
}

#[test]
fn test_bad_ring_config_is_rejected() {
    let mut rig = Rig::new(PinPolicy::Translate);
    rig.drv.write(REG_RING_CTRL, 0).unwrap();
    for (base, size) in [
        (RING_GPA, 12288u32), // not a power of two
        (RING_GPA, 2048),     // too small
        (RING_GPA, 2 << 20),  // too big
        (RING_GPA + 8, 4096), // unaligned base
        (!0xfff_u64, 8192),   // base + size wraps
    ] {
        assert!(rig.drv.setup_ring(base, size).is_err(), "{base:#x} {size}");
        assert_eq!(rig.take_error(), (ERR_RING_CONFIG, REG_RING_CTRL as u32));
    }
    // Writing the base while enabled is rejected too.
    rig.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    rig.drv.write(REG_RING_BASE_LO, 0).unwrap();
    assert_eq!(rig.take_error(), (ERR_RING_CONFIG, REG_RING_BASE_LO as u32));
    assert_eq!(rig.drv.read(REG_RING_BASE_LO).unwrap(), RING_GPA as u32);
}

#[test]
fn test_bad_tail_is_rejected() {
    let mut rig = Rig::new(PinPolicy::Translate);
    for tail in [2u32, RING_SIZE, !3u32] {
        rig.drv.write(REG_RING_TAIL, tail).unwrap();
        assert_eq!(rig.take_error(), (ERR_BAD_TAIL, REG_RING_TAIL as u32));
        assert_eq!(rig.drv.read(REG_RING_TAIL).unwrap(), 0);
    }
    rig.drv.write(REG_RING_CTRL, 0).unwrap();
    rig.drv.write(REG_RING_TAIL, 16).unwrap();
    assert_eq!(rig.take_error(), (ERR_BAD_TAIL, REG_RING_TAIL as u32));
}

#[test]
fn test_bad_mode_is_rejected() {
    let mut rig = Rig::new(PinPolicy::Translate);
    for (w, h, stride) in [
        (0, 10, 0),
        (1024, 768, 1000),
        (2048, 2048, 8192),
        (10, 10, 42),
    ] {
        assert!(rig.drv.set_mode(w, h, stride).is_err());
        assert_eq!(rig.take_error(), (ERR_MODE_INVALID, REG_MODE_CTRL as u32));
    }
    rig.drv.set_mode(W, H, W * 4).unwrap();
    rig.drv.write(REG_MODE_WIDTH, 16).unwrap();
    assert_eq!(rig.take_error(), (ERR_MODE_INVALID, REG_MODE_WIDTH as u32));
    assert_eq!(rig.drv.read(REG_MODE_WIDTH).unwrap(), W);
    let count = rig.drv.read(REG_ERROR_COUNT).unwrap();
    assert_eq!(count, 5);
}
