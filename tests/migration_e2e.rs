//! Live migration end to end: the VMM-side driver (`umdev::testing::Migration`) moves a
//! running GPU and a ccw device between two servers through real sockets while the guest
//! keeps working; the guest goes on on the destination. A scene drawn across the migration
//! is pixel-identical to the scene drawn without; a ccw data set written across it reads back
//! intact; a destination that refuses the stream leaves the source running and drawing.

use std::path::Path;
use std::time::Duration;

use umdev::device::{irq_index, Device};
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::migration::MigState;
use umdev::pci::PciAdapter;
use umdev::server::{RunningServer, Server, ServerConfig};
use umdev::testing::{
    wait_eventfd, DeviceAccess, GuestMemory, MigrateError, MigrateOptions, Migration, Side, Vmm,
    MIGRATION_CAPS,
};
use umdev_devices::ccw::driver::{
    self as ccw, regs as ccw_regs, CcwWord, OperationBlock, StatusBlock,
};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::commands::Command as GpuCmd;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::{IRQ_FENCE, REG_FENCE_VALUE};
use umdev_devices::gpu::{Gpu, GpuConfig, BAR_FB, DEFAULT_FB_SIZE};
use umdev_devices::testing::{run_ccw_program, Bar0};
use vmm_sys_util::eventfd::EventFd;

const RAM_BASE: u64 = 1 << 30;
const RAM_SIZE: usize = 8 << 20;
const W: u32 = 1024;
const H: u32 = 768;
const SPRITE: u64 = RAM_BASE + (2 << 20);
const READBACK: u64 = RAM_BASE + (3 << 20);
const FRAMES: u32 = 8;
const ROUNDS: usize = 2;

fn serve(socket: &Path, dev: Box<dyn Device>) -> RunningServer {
    Server::new(
        ServerConfig::new(socket),
        dev,
        DmaSpace::new(DmaConfig::default()),
    )
    .spawn()
    .unwrap()
}

fn connect(socket: &Path) -> Vmm {
    Vmm::connect_with_caps(socket, MIGRATION_CAPS)
        .unwrap()
        .with_ram(RAM_BASE, RAM_SIZE)
        .unwrap()
}

fn gpu(socket: &Path, fb_size: u64) -> (RunningServer, Vmm) {
    let dev = PciAdapter::new(Gpu::new(GpuConfig { fb_size }).unwrap()).unwrap();
    (serve(socket, Box::new(dev)), connect(socket))
}

/// Frame `f`: a small region redrawn (a box, a sprite from guest RAM), a read-back into
/// guest RAM at frame 2 shown again at frame 6, a fence.
fn frame_commands(f: u32) -> Vec<GpuCmd> {
    let mut c = Vec::new();
    if f == 0 {
        c.push(GpuCmd::FillRect {
            x: 0,
            y: 0,
            w: W,
            h: H,
            color: 0x0010_2030,
        });
    }
    c.push(GpuCmd::FillRect {
        x: 20 + f * 70,
        y: 50 + (f % 3) * 40,
        w: 48,
        h: 20,
        color: 0x00c0_4000 + f,
    });
    c.push(GpuCmd::Blit {
        gtt_index: 0,
        stride: 128,
        w: 32,
        h: 32,
        dst_x: 30 + f * 90,
        dst_y: 500,
    });
    if f == 2 {
        c.push(GpuCmd::Readback {
            src_x: 20,
            src_y: 50,
            w: 64,
            h: 64,
            gtt_index: 8,
            stride: 256,
        });
    }
    if f == 6 {
        c.push(GpuCmd::Blit {
            gtt_index: 8,
            stride: 256,
            w: 64,
            h: 64,
            dst_x: 900,
            dst_y: 300,
        });
    }
    c.push(GpuCmd::Fence { value: f + 1 });
    c
}

struct GpuGuest {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    irq: EventFd,
    frame: u32,
}

impl GpuGuest {
    fn boot(mut vmm: Vmm) -> GpuGuest {
        vmm.enable_device().unwrap();
        let irq = vmm.enable_msi().unwrap();
        let ram = vmm.ram().clone();
        let sprite: Vec<u8> = (0..32u32 * 32)
            .flat_map(|i| (0x0040_0000 | (i * 37)).to_le_bytes())
            .collect();
        ram.write(SPRITE, &sprite).unwrap();
        let mut drv = Driver::probe(Bar0(vmm)).unwrap();
        drv.set_mode(W, H, W * 4).unwrap();
        drv.setup_ring(RAM_BASE, 64 * 1024).unwrap();
        drv.enable_irqs(IRQ_FENCE).unwrap();
        drv.set_gtt(0, SPRITE, false).unwrap();
        for i in 0..4 {
            drv.set_gtt(8 + i, READBACK + u64::from(i) * 4096, true)
                .unwrap();
        }
        GpuGuest {
            drv,
            ram,
            irq,
            frame: 0,
        }
    }

    /// Draw the next frame, wait for its fence and its interrupt.
    fn frame(&mut self) {
        let f = self.frame;
        let mut ram = self.ram.clone();
        self.drv.submit(&mut ram, &frame_commands(f)).unwrap();
        self.drv.wait_fence(f + 1).unwrap();
        assert!(
            wait_eventfd(&self.irq, Duration::from_secs(5)).is_some(),
            "no fence interrupt for frame {f}"
        );
        self.drv.ack(IRQ_FENCE).unwrap();
        self.frame += 1;
    }

    fn vmm(&mut self) -> &mut Vmm {
        &mut self.drv.regs().0
    }

    fn framebuffer(&mut self) -> Vec<u8> {
        let fb = self.vmm().map_region(BAR_FB as u32).unwrap();
        let mut out = vec![0u8; fb.len()];
        fb.read(0, &mut out).unwrap();
        out
    }
}

fn reference_scene(dir: &Path) -> Vec<u8> {
    let (server, vmm) = gpu(&dir.join("ref.sock"), DEFAULT_FB_SIZE);
    let mut guest = GpuGuest::boot(vmm);
    for _ in 0..FRAMES {
        guest.frame();
    }
    let fb = guest.framebuffer();
    drop(guest);
    server.shutdown().unwrap();
    fb
}

#[test]
fn test_migration_e2e_gpu_scene_half_before_half_after_pixel_identical() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_scene(dir.path());
    for pre_copy in [true, false] {
        let (src_server, vmm) = gpu(
            &dir.path().join(format!("src{pre_copy}.sock")),
            DEFAULT_FB_SIZE,
        );
        let mut guest = GpuGuest::boot(vmm);
        while guest.frame < FRAMES / 2 - ROUNDS as u32 - 1 {
            guest.frame();
        }
        let (dst_server, mut dst) = gpu(
            &dir.path().join(format!("dst{pre_copy}.sock")),
            DEFAULT_FB_SIZE,
        );
        let opts = MigrateOptions {
            pre_copy,
            max_rounds: ROUNDS,
            small_round_bytes: 0,
        };
        let mut m = Migration::start(guest.vmm(), &mut dst, &opts).unwrap();
        for _ in 0..ROUNDS {
            guest.frame();
            m.round(guest.vmm(), &mut dst).unwrap();
        }
        guest.frame();
        assert_eq!(guest.frame, FRAMES / 2);
        m.stop_copy(guest.vmm(), &mut dst).unwrap();
        dst.set_irq_eventfd(irq_index::MSI, 0, &guest.irq).unwrap();
        let report = m.resume_destination(guest.vmm(), &mut dst).unwrap();
        println!("{report}");
        std::mem::swap(guest.vmm(), &mut dst);
        guest.ram = guest.vmm().ram().clone();
        while guest.frame < FRAMES {
            guest.frame();
        }
        let fb = guest.framebuffer();
        let bad = fb
            .chunks_exact(4)
            .zip(reference.chunks_exact(4))
            .position(|(a, b)| a != b);
        assert_eq!(
            bad.map(|px| (px % W as usize, px / W as usize)),
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
        // The source stayed stopped where the migration left it.
        let mut src = dst;
        assert_eq!(src.mig_state().unwrap(), MigState::Stop);
        assert_eq!(src.read32(0, REG_FENCE_VALUE).unwrap(), FRAMES / 2);
        drop(guest);
        drop(src);
        dst_server.shutdown().unwrap();
        src_server.shutdown().unwrap();
    }
}

#[test]
fn test_migration_e2e_gpu_destination_refuses_stream_source_running_and_still_drawing() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_scene(dir.path());
    for pre_copy in [true, false] {
        let (src_server, vmm) = gpu(
            &dir.path().join(format!("src{pre_copy}.sock")),
            DEFAULT_FB_SIZE,
        );
        let mut guest = GpuGuest::boot(vmm);
        guest.frame();
        // A GPU with another framebuffer size cannot take this GPU's state.
        let (dst_server, mut dst) = gpu(&dir.path().join(format!("dst{pre_copy}.sock")), 8 << 20);
        let opts = MigrateOptions {
            pre_copy,
            max_rounds: 1,
            small_round_bytes: 0,
        };
        let err = (|| {
            let mut m = Migration::start(guest.vmm(), &mut dst, &opts)?;
            guest.frame();
            m.round(guest.vmm(), &mut dst)?;
            m.stop_copy(guest.vmm(), &mut dst)?;
            m.resume_destination(guest.vmm(), &mut dst)
        })()
        .unwrap_err();
        assert!(
            matches!(
                err,
                MigrateError::Step {
                    side: Side::Destination,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.errno(), Some(libc::EINVAL), "{err}");
        assert!(err.source_running());
        assert_eq!(guest.vmm().mig_state().unwrap(), MigState::Running);
        assert_eq!(
            dst.mig_state().unwrap(),
            MigState::Running,
            "the destination was reset"
        );
        // The guest draws on, on the source, and the scene is the scene.
        while guest.frame < FRAMES {
            guest.frame();
        }
        assert!(
            guest.framebuffer() == reference,
            "pre_copy={pre_copy}: the source's scene differs"
        );
        drop(guest);
        drop(dst);
        dst_server.shutdown().unwrap();
        src_server.shutdown().unwrap();
    }
}

/// 32 KiB per CCW.
const CHUNK: u64 = 32 << 10;

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

fn ccw(socket: &Path, image: &Path) -> (RunningServer, Vmm) {
    let dev =
        PciAdapter::new(Ccw::new(CcwConfig::new(image).with_capacity(16384)).unwrap()).unwrap();
    (serve(socket, Box::new(dev)), connect(socket))
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
                umdev::testing::Rng::new(round * 10 + i as u64).bytes((p.1 * CHUNK) as usize)
            })
            .collect();
        for (d, p) in data.iter().zip(&parts) {
            ram.write(p.2, d).unwrap();
        }
        let st = run_ccw_program(
            &mut src,
            &ram,
            &irq,
            &program(true, parts[0].2, parts[0].1),
            parts[0].0,
        )
        .unwrap();
        assert!(ok(&st), "{st:?}");

        let (dst_server, mut dst) = ccw(&dir.path().join(format!("dst{round}.sock")), &image);
        let mut m = Migration::start(&mut src, &mut dst, &MigrateOptions::default()).unwrap();
        let (opb, status, prog) = (RAM_BASE, RAM_BASE + 0x80, RAM_BASE + 0x100);
        ram.write(
            prog,
            &ccw::encode_program(&program(true, parts[1].2, parts[1].1)),
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
            ok(&st) && st.transferred == parts[1].1 * CHUNK,
            "round {round}: B's status {st:?}"
        );
        let st = run_ccw_program(
            &mut dst,
            &ram,
            &irq,
            &program(true, parts[2].2, parts[2].1),
            parts[2].0,
        )
        .unwrap();
        assert!(ok(&st));
        for (i, p) in parts.iter().enumerate() {
            ram.fill(read_back, (p.1 * CHUNK) as usize, 0).unwrap();
            let st = run_ccw_program(&mut dst, &ram, &irq, &program(false, read_back, p.1), p.0)
                .unwrap();
            assert!(ok(&st));
            assert!(
                ram.read_vec(read_back, (p.1 * CHUNK) as usize).unwrap() == data[i],
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
