//! Live migration end to end: the VMM-side driver (`umdev::testing::Migration`) moves a
//! running GPU and a ccw device between two servers through real sockets while the guest
//! keeps working; the guest goes on on the destination. A scene drawn across the migration
//! is pixel-identical to the scene drawn without; a ccw data set written across it reads back
//! intact; a destination that refuses the stream leaves the source running and drawing.

use std::path::Path;
use std::time::Duration;

use umdev::device::irq_index;
use umdev::migration::MigState;
use umdev::server::RunningServer;
use umdev::testing::{
    wait_eventfd, DeviceAccess, MigrateError, MigrateOptions, Migration, Side, Vmm,
};
use umdev_devices::ccw::driver::{self as ccw, regs as ccw_regs, OperationBlock, StatusBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::regs::REG_FENCE_VALUE;
use umdev_devices::gpu::{GpuConfig, DEFAULT_FB_SIZE};
use umdev_devices::testing::migration::{
    migrate_mid_scene, serve_gpu, serve_migrating, GpuGuest, RAM_BASE, WIDTH,
};
use umdev_devices::testing::{ccw_chain, run_ccw_program, CCW_CHUNK};

const RAM_SIZE: usize = 8 << 20;
const FRAMES: u32 = 8;
const ROUNDS: usize = 2;

fn gpu(socket: &Path, fb_size: u64) -> (RunningServer, Vmm) {
    serve_gpu(socket, GpuConfig { fb_size }, RAM_SIZE).unwrap()
}

/// A guest of the scene (`umdev_devices::testing::migration`'s, shorter than the demo's)
/// for which a frame without its fence interrupt is an error.
fn boot(vmm: Vmm) -> GpuGuest {
    GpuGuest::boot(vmm, FRAMES).unwrap().require_interrupts()
}

fn reference_scene(dir: &Path) -> Vec<u8> {
    let (server, vmm) = gpu(&dir.join("ref.sock"), DEFAULT_FB_SIZE);
    let mut guest = boot(vmm);
    guest.finish().unwrap();
    let fb = guest.framebuffer().unwrap();
    drop(guest);
    server.shutdown().unwrap();
    fb
}

/// A guest booted on a source GPU and a destination GPU (`dst_fb_size` of framebuffer),
/// served from `dir` (sockets named after `pre_copy`).
struct Pair {
    src_server: RunningServer,
    guest: GpuGuest,
    dst_server: RunningServer,
    dst: Vmm,
}

impl Pair {
    fn new(dir: &Path, pre_copy: bool, dst_fb_size: u64) -> Pair {
        let (src_server, vmm) = gpu(&dir.join(format!("src{pre_copy}.sock")), DEFAULT_FB_SIZE);
        let (dst_server, dst) = gpu(&dir.join(format!("dst{pre_copy}.sock")), dst_fb_size);
        Pair {
            src_server,
            guest: boot(vmm),
            dst_server,
            dst,
        }
    }

    fn shutdown(self) {
        drop(self.guest);
        drop(self.dst);
        self.dst_server.shutdown().unwrap();
        self.src_server.shutdown().unwrap();
    }
}

#[test]
fn test_migration_e2e_gpu_scene_half_before_half_after_pixel_identical() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_scene(dir.path());
    for pre_copy in [true, false] {
        let mut p = Pair::new(dir.path(), pre_copy, DEFAULT_FB_SIZE);
        let Pair { guest, dst, .. } = &mut p;
        let report = migrate_mid_scene(guest, dst, pre_copy, ROUNDS).unwrap();
        assert_eq!(guest.next_frame(), FRAMES / 2);
        println!("{report}");
        guest.finish().unwrap();
        let fb = guest.framebuffer().unwrap();
        let bad = fb
            .chunks_exact(4)
            .zip(reference.chunks_exact(4))
            .position(|(a, b)| a != b);
        assert_eq!(
            bad.map(|px| (px % WIDTH as usize, px / WIDTH as usize)),
            None,
            "pre_copy={pre_copy}: first differing pixel (x, y)"
        );
        if pre_copy {
            assert!(report.rounds[0].device_bytes > 0);
            assert!(
                report.stop_copy_bytes <= DEFAULT_FB_SIZE / 10,
                "STOP_COPY carries {} bytes with PRE_COPY",
                report.stop_copy_bytes
            );
        } else {
            assert!(report.rounds.iter().all(|r| r.device_bytes == 0));
        }
        // The source stayed stopped where the migration left it (`dst` holds its VMM now).
        let src = dst;
        assert_eq!(src.mig_state().unwrap(), MigState::Stop);
        assert_eq!(src.read32(0, REG_FENCE_VALUE).unwrap(), FRAMES / 2);
        p.shutdown();
    }
}

#[test]
fn test_migration_e2e_gpu_destination_refuses_stream_source_running_and_still_drawing() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_scene(dir.path());
    for pre_copy in [true, false] {
        // A GPU with another framebuffer size cannot take this GPU's state.
        let mut p = Pair::new(dir.path(), pre_copy, 8 << 20);
        let Pair { guest, dst, .. } = &mut p;
        guest.frame().unwrap();
        let opts = MigrateOptions {
            pre_copy,
            max_rounds: 1,
            small_round_bytes: 0,
        };
        let err = (|| {
            let mut m = Migration::start(guest.vmm(), dst, &opts)?;
            guest.frame().unwrap();
            m.round(guest.vmm(), dst)?;
            m.stop_copy(guest.vmm(), dst)?;
            m.resume_destination(guest.vmm(), dst)
        })()
        .unwrap_err();
        assert!(matches!(err, MigrateError::Step { .. }), "{err:?}");
        assert_eq!(err.side(), Some(Side::Destination), "{err:?}");
        assert_eq!(err.errno(), Some(libc::EINVAL), "{err}");
        assert!(err.source_running());
        assert_eq!(guest.vmm().mig_state().unwrap(), MigState::Running);
        assert_eq!(
            dst.mig_state().unwrap(),
            MigState::Running,
            "the destination was reset"
        );
        // The guest draws on, on the source, and the scene is the scene.
        guest.finish().unwrap();
        assert!(
            guest.framebuffer().unwrap() == reference,
            "pre_copy={pre_copy}: the source's scene differs"
        );
        p.shutdown();
    }
}

fn ccw(socket: &Path, image: &Path) -> (RunningServer, Vmm) {
    let dev = Ccw::new(CcwConfig::new(image).with_capacity(16384)).unwrap();
    serve_migrating(socket, dev, RAM_SIZE).unwrap()
}

fn ok(st: &StatusBlock) -> bool {
    st.fault == 0 && st.residual == 0 && st.channel_status == 0
}

#[test]
fn test_migration_e2e_ccw_data_written_across_migration_reads_back_intact() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("shared.img");
    // (block, CCWs, guest buffer) of parts A (before), B (started right before STOP), C
    // (after). Several rounds: STOP catches B at different points.
    let parts: [(u64, u64, u64); 3] = [
        (0, 2, RAM_BASE + (1 << 20)),
        (128, 24, RAM_BASE + (2 << 20)),
        (4096, 2, RAM_BASE + (4 << 20)),
    ];
    let read_back = RAM_BASE + (5 << 20);
    let mut on_destination = 0;
    for round in 0..6u64 {
        let (src_server, mut src) = ccw(&dir.path().join(format!("src{round}.sock")), &image);
        src.enable_device().unwrap();
        let irq = src.enable_msi().unwrap();
        let ram = src.ram().clone();
        let data: Vec<Vec<u8>> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                umdev::testing::Rng::new(round * 10 + i as u64).bytes((p.1 * CCW_CHUNK) as usize)
            })
            .collect();
        for (d, p) in data.iter().zip(&parts) {
            ram.write(p.2, d).unwrap();
        }
        let st = run_ccw_program(
            &mut src,
            &ram,
            &irq,
            &ccw_chain(true, parts[0].2, parts[0].1),
            parts[0].0,
        )
        .unwrap();
        assert!(ok(&st), "{st:?}");

        let (dst_server, mut dst) = ccw(&dir.path().join(format!("dst{round}.sock")), &image);
        let mut m = Migration::start(&mut src, &mut dst, &MigrateOptions::default()).unwrap();
        let (opb, status, prog) = (RAM_BASE, RAM_BASE + 0x80, RAM_BASE + 0x100);
        ram.write(
            prog,
            &ccw::encode_program(&ccw_chain(true, parts[1].2, parts[1].1)),
        )
        .unwrap();
        let ob = OperationBlock {
            program: prog,
            block: parts[1].0,
            status,
            flags: 0,
            reserved: 0,
        };
        ram.write(opb, &ob.to_bytes()).unwrap();
        ram.write(status, &[0xee; ccw::STATUS_BLOCK_SIZE]).unwrap();
        src.write32(0, ccw_regs::OPB_ADDR_LO, opb as u32).unwrap();
        src.write32(0, ccw_regs::OPB_ADDR_HI, (opb >> 32) as u32)
            .unwrap();
        src.write32(0, ccw_regs::START, 1).unwrap();
        if round % 2 == 1 {
            m.round(&mut src, &mut dst).unwrap();
        }
        m.stop_copy(&mut src, &mut dst).unwrap();
        let before = irq.read().unwrap_or(0);
        dst.set_irq_eventfd(irq_index::MSI, 0, &irq).unwrap();
        m.resume_destination(&mut src, &mut dst).unwrap();
        let after = if before == 0 {
            wait_eventfd(&irq, Duration::from_secs(5)).unwrap_or(0)
        } else {
            0
        };
        on_destination += after;
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            (before + after, irq.read().unwrap_or(0)),
            (1, 0),
            "round {round}: exactly one completion of B"
        );
        dst.write32(0, ccw_regs::IRQ_STATUS, ccw_regs::IRQ_ALL)
            .unwrap();
        let ram = dst.ram().clone();
        let sb = ram.read_vec(status, ccw::STATUS_BLOCK_SIZE).unwrap();
        let st = StatusBlock::from_bytes(&sb.try_into().unwrap());
        assert!(
            ok(&st) && st.transferred == parts[1].1 * CCW_CHUNK,
            "round {round}: B's status {st:?}"
        );
        let st = run_ccw_program(
            &mut dst,
            &ram,
            &irq,
            &ccw_chain(true, parts[2].2, parts[2].1),
            parts[2].0,
        )
        .unwrap();
        assert!(ok(&st));
        for (i, p) in parts.iter().enumerate() {
            ram.fill(read_back, (p.1 * CCW_CHUNK) as usize, 0).unwrap();
            let st = run_ccw_program(&mut dst, &ram, &irq, &ccw_chain(false, read_back, p.1), p.0)
                .unwrap();
            assert!(ok(&st));
            assert!(
                ram.read_vec(read_back, (p.1 * CCW_CHUNK) as usize).unwrap() == data[i],
                "round {round}: part {i} differs"
            );
        }
        drop(src);
        drop(dst);
        dst_server.shutdown().unwrap();
        src_server.shutdown().unwrap();
    }
    println!("B's completion delivered on the destination in {on_destination} of 6 rounds");
}
