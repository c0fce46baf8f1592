//! GPU live migration, device level: the GPU's `Migrate` implementation driven directly
//! (stop / save on one instance, load / resume on a fresh one), with the guest's RAM copied
//! from source to destination at STOP as a VMM's last pass does, and the guest driver (its
//! ring tail) moving along. The PCI state (config space, MSI-X) is the framework's to
//! migrate, so the tests set it up on the destination themselves.

mod gpu_common;

use std::time::Duration;

use gpu_common::*;
use umdev::device::{region_index, Device};
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy, Prot};
use umdev::instance::{CreateRequest, Params};
use umdev::migration::{decode_header, encode_state, Migrate, MigrationError};
use umdev::pci::{PciAdapter, PciDevice};
use umdev::testing::GuestMemory;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::migration::wire::{STATE_FORMAT, STATE_VERSION};
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{
    Command, Gpu, GpuConfig, GpuParent, GpuParentConfig, GpuType, DEFAULT_FB_SIZE,
};
use umdev_devices::testing::Bar0;
use vmm_sys_util::eventfd::EventFd;

/// The GPU's migration interface, as the framework reaches it.
fn mig(rig: &mut Rig) -> &mut dyn Migrate {
    rig.adapter()
        .device_mut()
        .migration()
        .expect("the GPU migrates")
}

/// A rig around `gpu` on guest memory `ram` (mapped as `Rig::new` maps it), memory
/// decoding and Bus Master on; no mode, no ring (a destination gets them from the state).
fn rig_on(gpu: Gpu, ram: GuestMemory) -> Rig {
    let space = DmaSpace::new(DmaConfig {
        policy: PinPolicy::Translate,
        lock_limit_bytes: Some(2 << 20),
        ..DmaConfig::default()
    });
    for (iova, size, prot) in [
        (RAM_BASE, SURFACE_GPA - RAM_BASE, Prot::RW),
        (SURFACE_GPA, SURFACE_SIZE, Prot::RW),
        (RO_GPA, RAM_BASE + RAM_SIZE as u64 - RO_GPA, Prot::READ),
    ] {
        space
            .map(ram.dma_mapping(iova, size, prot).unwrap())
            .unwrap();
    }
    let mut adapter = PciAdapter::new(gpu).unwrap();
    Device::attach(&mut adapter, space.handle());
    adapter
        .region_write(region_index::CONFIG, 4, &0x0006u16.to_le_bytes())
        .unwrap();
    let drv = Driver::probe(Bar0(adapter)).unwrap();
    Rig { drv, space, ram }
}

/// A copy of `ram` (the VMM's last RAM pass, made while the source is stopped).
fn copy_ram(ram: &GuestMemory) -> GuestMemory {
    let copy = GuestMemory::new(ram.base(), ram.size()).unwrap();
    copy.write(ram.base(), &ram.read_vec(ram.base(), ram.size()).unwrap())
        .unwrap();
    copy
}

/// The guest moves from `guest`'s device to `dst`'s: its driver (ring position) stays,
/// the device, DMA space and RAM under it are swapped. `dst` then holds the old ones.
fn swap_guest(guest: &mut Rig, dst: &mut Rig) {
    std::mem::swap(&mut guest.drv.regs().0, &mut dst.drv.regs().0);
    std::mem::swap(&mut guest.space, &mut dst.space);
    std::mem::swap(&mut guest.ram, &mut dst.ram);
}

/// Migrate the guest of `guest` to `dst_gpu`: stop the source, copy the guest RAM, save;
/// on a fresh rig stop, load, check that no pin came along; move the guest over; let
/// `before_resume` set up the destination's PCI state; resume. Returns the old source's
/// rig and the size of the saved state.
fn migrate(guest: &mut Rig, dst_gpu: Gpu, before_resume: impl FnOnce(&mut Rig)) -> (Rig, usize) {
    mig(guest).stop().unwrap();
    let ram = copy_ram(&guest.ram);
    let state = mig(guest).save().unwrap();
    let mut dst = rig_on(dst_gpu, ram);
    mig(&mut dst).stop().unwrap();
    mig(&mut dst).load(&state).unwrap();
    assert_eq!(dst.gpu().pins_held(), 0, "pins are not state");
    swap_guest(guest, &mut dst);
    before_resume(guest);
    mig(guest).resume().unwrap();
    (dst, state.len())
}

fn new_gpu() -> Gpu {
    Gpu::new(GpuConfig::default()).unwrap()
}

/// The whole framebuffer.
fn fb_bytes(rig: &mut Rig) -> Vec<u8> {
    let fb = rig.gpu().framebuffer();
    let mut out = vec![0u8; fb.len()];
    assert!(fb.read(0, &mut out));
    out
}

/// Scattered guest pages of the 7-page surface, and contiguous ones of the 4-page one.
fn surfaces(rig: &mut Rig) {
    let scattered: Vec<u64> = [5u64, 0, 12, 3, 9, 1, 7]
        .iter()
        .map(|k| SURFACE_GPA + k * 4096)
        .collect();
    write_surface(&rig.ram, &scattered, 512, 100, 50);
    rig.map_gtt(10, &scattered, false);
    let contiguous: Vec<u64> = (0..4).map(|k| SURFACE_GPA + 0x40000 + k * 4096).collect();
    write_surface(&rig.ram, &contiguous, 256, 64, 64);
    rig.map_gtt(100, &contiguous, false);
}

fn fill(x: u32, y: u32, w: u32, h: u32, color: u32) -> Command {
    Command::FillRect { x, y, w, h, color }
}

fn copy(src: (u32, u32), dst: (u32, u32), w: u32, h: u32) -> Command {
    Command::CopyRect {
        src_x: src.0,
        src_y: src.1,
        dst_x: dst.0,
        dst_y: dst.1,
        w,
        h,
    }
}

fn blit(gtt_index: u32, stride: u32, w: u32, h: u32, dst: (u32, u32)) -> Command {
    Command::Blit {
        gtt_index,
        stride,
        w,
        h,
        dst_x: dst.0,
        dst_y: dst.1,
    }
}

/// The scene in three parts: drawn before the migration, published around STOP, drawn
/// after. Later parts copy what earlier ones drew, and blit from the GTT.
fn scene() -> [Vec<Command>; 3] {
    let first = vec![
        fill(0, 0, W, H, 0x20_2020),
        fill(10, 10, 50, 40, 0xff_0000),
        blit(10, 512, 100, 50, (150, 20)),
        copy((10, 10), (30, 20), 50, 40),
    ];
    // Enough full-screen work that STOP often lands in the middle of it.
    let mut around: Vec<Command> = (0..24)
        .map(|i| fill(0, 0, W, H, 0x01_0101 * (i + 1)))
        .collect();
    around.extend([
        fill(0, 0, W, H, 0x30_3030),
        copy((0, 0), (0, 0), 1, 1),
        fill(200, 100, 60, 60, 0x00_ff00),
        blit(100, 256, 64, 64, (240, 160)),
        blit(10, 512, 100, 50, (20, 120)),
    ]);
    let after = vec![
        copy((200, 100), (180, 90), 60, 60),
        blit(10, 512, 100, 50, (100, 60)),
        fill(5, 5, 7, 230, 0x00_00ff),
        copy((240, 160), (250, 170), 64, 64),
    ];
    [first, around, after]
}

/// The scene drawn on one GPU, no migration: the whole framebuffer.
fn reference_scene() -> Vec<u8> {
    let mut rig = Rig::new(PinPolicy::Translate);
    surfaces(&mut rig);
    let [first, around, after] = scene();
    rig.run(&first);
    rig.run(&around);
    rig.run_fenced(&after, 99);
    fb_bytes(&mut rig)
}

#[test]
fn test_gpu_migration_scene_half_before_half_after_is_pixel_identical() {
    let reference = reference_scene();
    let mut pending_at_stop = 0;
    for round in 0..8 {
        let mut guest = Rig::new(PinPolicy::Translate);
        surfaces(&mut guest);
        let [first, around, after] = scene();
        guest.run(&first);
        if round % 2 == 0 {
            // Published while running: STOP lands anywhere in it.
            guest.drv.submit(&mut guest.ram, &around).unwrap();
            mig(&mut guest).stop().unwrap();
        } else {
            // Published right before STOP took effect: none of it ran on the source.
            mig(&mut guest).stop().unwrap();
            guest.drv.submit(&mut guest.ram, &around).unwrap();
        }
        let (head, tail) = (
            guest.drv.read(REG_RING_HEAD).unwrap(),
            guest.drv.read(REG_RING_TAIL).unwrap(),
        );
        if head != tail {
            pending_at_stop += 1;
        }
        let (mut old, _) = migrate(&mut guest, new_gpu(), |_| {});
        guest.run_fenced(&after, 99);
        assert_eq!(guest.drv.read(REG_ERROR_COUNT).unwrap(), 0);
        let got = fb_bytes(&mut guest);
        if let Some(i) = got.iter().zip(&reference).position(|(a, b)| a != b) {
            let px = i / 4;
            panic!(
                "round {round}: framebuffer differs at byte {i} (pixel {},{}), head {head} \
                 tail {tail} at stop",
                px % W as usize,
                px / W as usize
            );
        }
        // The destination pinned the GTT pages it blitted from, lazily.
        assert!(guest.gpu().pins_held() > 0);
        // The stopped source did nothing more.
        assert_eq!(old.drv.read(REG_RING_HEAD).unwrap(), head);
    }
    assert!(
        pending_at_stop >= 4,
        "{pending_at_stop} rounds had work pending"
    );
}

/// Instantaneous count of `efd` (0 if it was not signalled).
fn fired(efd: &EventFd) -> u64 {
    efd.read().unwrap_or(0)
}

/// Wait up to 5 s for FENCE_VALUE == `value`.
fn wait_fence(rig: &mut Rig, value: u32) {
    rig.drv.wait_fence(value).unwrap();
}

#[test]
fn test_gpu_migration_fence_pending_at_stop_interrupts_once_on_destination() {
    // Deterministic: the FENCE is published while the source is stopped.
    let mut guest = Rig::new(PinPolicy::Translate);
    let src_irq = guest.enable_msix();
    guest.drv.enable_irqs(IRQ_FENCE).unwrap();
    mig(&mut guest).stop().unwrap();
    guest
        .drv
        .submit(&mut guest.ram, &[Command::Fence { value: 7 }])
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        guest.drv.read(REG_FENCE_VALUE).unwrap(),
        0,
        "ran while stopped"
    );
    assert_eq!(fired(&src_irq), 0, "interrupt while stopped");
    let mut dst_irq = None;
    let (_old, _) = migrate(&mut guest, new_gpu(), |dst| {
        dst_irq = Some(dst.enable_msix());
    });
    let dst_irq = dst_irq.unwrap();
    wait_fence(&mut guest, 7);
    assert!(wait_eventfd(&dst_irq, Duration::from_secs(5)));
    assert_eq!(guest.drv.read(REG_IRQ_STATUS).unwrap(), IRQ_FENCE);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(fired(&dst_irq), 0, "a second interrupt on the destination");
    assert_eq!(fired(&src_irq), 0, "an interrupt on the stopped source");
}

#[test]
fn test_gpu_migration_fence_racing_stop_interrupts_exactly_once_overall() {
    for round in 0..16u32 {
        let mut guest = Rig::new(PinPolicy::Translate);
        let src_irq = guest.enable_msix();
        guest.drv.enable_irqs(IRQ_FENCE).unwrap();
        let fence = 100 + round;
        let mut cmds: Vec<Command> = (0..(round % 4) * 4).map(|i| fill(0, 0, W, H, i)).collect();
        cmds.push(Command::Fence { value: fence });
        guest.drv.submit(&mut guest.ram, &cmds).unwrap();
        mig(&mut guest).stop().unwrap();
        let before = fired(&src_irq);
        let done_on_source = guest.drv.read(REG_FENCE_VALUE).unwrap() == fence;
        assert_eq!(before, u64::from(done_on_source), "round {round}");
        let mut dst_irq = None;
        let (_old, _) = migrate(&mut guest, new_gpu(), |dst| {
            dst_irq = Some(dst.enable_msix());
        });
        let dst_irq = dst_irq.unwrap();
        wait_fence(&mut guest, fence);
        let after = if done_on_source {
            0
        } else {
            umdev::testing::wait_eventfd(&dst_irq, Duration::from_secs(5)).unwrap_or(0)
        };
        std::thread::sleep(Duration::from_millis(20));
        let late = fired(&dst_irq) + fired(&src_irq);
        assert_eq!(
            (before + after, late),
            (1, 0),
            "round {round}: {before} interrupt(s) on the source, {after} on the destination"
        );
        assert_ne!(guest.drv.read(REG_IRQ_STATUS).unwrap() & IRQ_FENCE, 0);
    }
}

#[test]
fn test_gpu_stop_quiesces_nothing_runs_or_is_fetched_until_resume() {
    // The ring behind RING_HEAD is poisoned while the source is stopped: a GPU that kept
    // fetching would pick the poison up and draw it after resume.
    let cmds: Vec<Command> = (0..64).map(|i| fill(0, 0, W, H, 0x10_0000 + i)).collect();
    let poison: Vec<Command> = (0..64).map(|_| fill(0, 0, W, H, 0xdead)).collect();
    let bytes = Command::encode_bytes(&cmds);
    let bad = Command::encode_bytes(&poison);
    assert_eq!(bytes.len(), bad.len());
    let mut caught = 0;
    for _ in 0..10 {
        let mut rig = Rig::new(PinPolicy::Translate);
        let irq = rig.enable_msix();
        rig.drv.enable_irqs(IRQ_ALL).unwrap();
        rig.drv.submit(&mut rig.ram, &cmds).unwrap();
        mig(&mut rig).stop().unwrap();
        let head = rig.drv.read(REG_RING_HEAD).unwrap();
        let fb = fb_bytes(&mut rig);
        let stats = rig.gpu().engine_stats();
        rig.ram.write(RING_GPA, &bad).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(rig.drv.read(REG_RING_HEAD).unwrap(), head);
        assert_eq!(rig.gpu().engine_stats().commands, stats.commands);
        assert!(
            fb_bytes(&mut rig) == fb,
            "the framebuffer changed while stopped"
        );
        assert_eq!(fired(&irq), 0);
        if head != bytes.len() as u32 {
            caught += 1;
        }
        // An aborted migration: the source runs on from RING_HEAD.
        rig.ram.write(RING_GPA, &bytes).unwrap();
        mig(&mut rig).resume().unwrap();
        rig.run_fenced(&[], 1);
        assert_eq!(rig.gpu().pixel(W - 1, H - 1), Some(0x10_0000 + 63));
        assert_eq!(rig.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    }
    assert!(
        caught >= 3,
        "STOP caught work in progress only {caught} times"
    );
}

/// A pixel pattern written by the guest CPU straight into BAR2's memory (what a guest
/// does through the client's mapping; the device does not see it).
fn cpu_write(rig: &mut Rig, off: usize, len: usize, seed: u32) {
    let data: Vec<u8> = (0..len / 4)
        .flat_map(|i| (seed ^ (i as u32).wrapping_mul(2654435761)).to_le_bytes())
        .collect();
    rig.gpu()
        .framebuffer()
        .memory()
        .write_at(off as u64, &data)
        .unwrap();
}

#[test]
fn test_gpu_precopy_guest_keeps_drawing_stop_copy_carries_little() {
    let fb_size = DEFAULT_FB_SIZE as usize;
    let mut guest = Rig::new(PinPolicy::Translate);
    guest.drv.set_mode(1024, 768, 4096).unwrap();
    // Software-rendered desktop: every page differs from its neighbours.
    cpu_write(&mut guest, 0, fb_size, 1);
    // Without PRE_COPY, STOP_COPY carries the whole framebuffer.
    mig(&mut guest).stop().unwrap();
    let without = mig(&mut guest).save().unwrap().len();
    mig(&mut guest).resume().unwrap();
    assert!(without >= fb_size, "{without} bytes without PRE_COPY");

    let mut dst = rig_on(new_gpu(), copy_ram(&guest.ram));
    mig(&mut dst).stop().unwrap();
    let mut rounds = Vec::new();
    let first = mig(&mut guest)
        .precopy()
        .unwrap()
        .expect("the first round sends");
    mig(&mut dst).load_precopy(&first).unwrap();
    rounds.push(first.len());
    for frame in 0..6u32 {
        // A small region redrawn per frame by the device, and a cursor by the CPU.
        guest.run(&[fill(100 + frame * 8, 200, 48, 32, 0xff_0000 + frame)]);
        cpu_write(&mut guest, 700 * 4096 + frame as usize * 64, 64, frame);
        if let Some(chunk) = mig(&mut guest).precopy().unwrap() {
            mig(&mut dst).load_precopy(&chunk).unwrap();
            rounds.push(chunk.len());
        }
    }
    // The last frame, after the last round: a fill and a CPU write elsewhere.
    guest.run(&[fill(600, 500, 40, 40, 0x00_ff00)]);
    cpu_write(&mut guest, 900 * 4096 + 12, 8, 77);
    mig(&mut guest).stop().unwrap();
    let state = mig(&mut guest).save().unwrap();
    let stop_copy = state.len();
    println!(
        "STOP_COPY {stop_copy} bytes with PRE_COPY ({} rounds: {rounds:?}), {without} without",
        rounds.len()
    );
    assert!(rounds.len() >= 7, "a round per frame: {rounds:?}");
    assert!(
        rounds[1..].iter().all(|&r| r < fb_size / 10),
        "later rounds send only what changed: {rounds:?}"
    );
    assert!(
        stop_copy <= fb_size / 10,
        "STOP_COPY carries {stop_copy} bytes of a {fb_size}-byte framebuffer"
    );
    mig(&mut dst).load(&state).unwrap();
    mig(&mut dst).resume().unwrap();
    let (src_fb, dst_fb) = (fb_bytes(&mut guest), fb_bytes(&mut dst));
    let first_bad = src_fb.iter().zip(&dst_fb).position(|(a, b)| a != b);
    assert_eq!(first_bad, None, "the destination's framebuffer differs");
    assert_eq!(dst.gpu().mode().width, 1024);
}

#[test]
fn test_gpu_precopy_cpu_write_after_last_round_reaches_destination() {
    let mut guest = Rig::new(PinPolicy::Translate);
    guest.run(&[fill(0, 0, W, H, 0x11_1111)]);
    let mut dst = rig_on(new_gpu(), copy_ram(&guest.ram));
    mig(&mut dst).stop().unwrap();
    let chunk = mig(&mut guest).precopy().unwrap().unwrap();
    mig(&mut dst).load_precopy(&chunk).unwrap();
    assert_eq!(mig(&mut guest).precopy().unwrap(), None, "nothing changed");
    // Pixel (3, 3) written by the CPU only: no device write marks its page.
    let off = 3 * W as usize * 4 + 3 * 4;
    guest
        .gpu()
        .framebuffer()
        .memory()
        .write_at(off as u64, &0x00ab_cdefu32.to_le_bytes())
        .unwrap();
    mig(&mut guest).stop().unwrap();
    let state = mig(&mut guest).save().unwrap();
    mig(&mut dst).load(&state).unwrap();
    assert_eq!(dst.gpu().pixel(3, 3), Some(0x00ab_cdef));
    assert_eq!(dst.gpu().pixel(4, 3), Some(0x11_1111));
}

#[test]
fn test_gpu_migration_newer_version_cut_short_or_other_format_refused_destination_works() {
    let mut guest = Rig::new(PinPolicy::Translate);
    surfaces(&mut guest);
    let [first, ..] = scene();
    guest.run_fenced(&first, 5);
    mig(&mut guest).stop().unwrap();
    let state = mig(&mut guest).save().unwrap();
    let ram = copy_ram(&guest.ram);

    let (_, body) = decode_header(STATE_FORMAT, STATE_VERSION, STATE_VERSION, &state).unwrap();
    let mut newer = encode_state(STATE_FORMAT, STATE_VERSION + 1, &()).unwrap();
    newer.extend_from_slice(body);
    let mut other = encode_state("umdev-ccw", STATE_VERSION, &()).unwrap();
    other.extend_from_slice(body);
    let mut dst = rig_on(new_gpu(), ram);
    mig(&mut dst).stop().unwrap();
    let refusals = [
        mig(&mut dst).load(&newer).unwrap_err(),
        mig(&mut dst).load(&other).unwrap_err(),
    ];
    assert!(
        matches!(refusals[0], MigrationError::UnsupportedVersion { found, .. } if found == STATE_VERSION + 1),
        "{:?}",
        refusals[0]
    );
    assert!(matches!(refusals[1], MigrationError::WrongFormat { .. }));
    // Cut short anywhere: refused (every cut in the header and registers, then a sweep).
    let cuts = (0..200.min(state.len())).chain((200..state.len()).step_by(997));
    for cut in cuts {
        assert!(
            mig(&mut dst).load(&state[..cut]).is_err(),
            "a state cut at {cut} of {} bytes was accepted",
            state.len()
        );
        // Refused means reset, not half loaded.
        assert_eq!(dst.drv.read(REG_STATUS).unwrap(), 0, "cut at {cut}");
        assert_eq!(dst.drv.read(REG_FENCE_VALUE).unwrap(), 0);
    }
    let mut long = state.clone();
    long.push(0);
    assert!(matches!(
        mig(&mut dst).load(&long),
        Err(MigrationError::Malformed { .. })
    ));
    // A GPU with another framebuffer size cannot take it.
    let mut big = rig_on(
        Gpu::new(GpuConfig { fb_size: 8 << 20 }).unwrap(),
        copy_ram(&guest.ram),
    );
    mig(&mut big).stop().unwrap();
    assert!(matches!(
        mig(&mut big).load(&state),
        Err(MigrationError::Incompatible(_))
    ));

    // The destination still works: the good state loads and the guest goes on there.
    mig(&mut dst).load(&state).unwrap();
    swap_guest(&mut guest, &mut dst);
    mig(&mut guest).resume().unwrap();
    assert_eq!(guest.drv.read(REG_FENCE_VALUE).unwrap(), 5);
    guest.run_fenced(&[fill(1, 1, 2, 2, 0x42)], 6);
    assert_eq!(guest.gpu().pixel(2, 2), Some(0x42));
    assert_eq!(guest.drv.read(REG_ERROR_COUNT).unwrap(), 0);
    // And a destination that only ever saw refusals works as a fresh GPU.
    mig(&mut big).resume().unwrap();
    big.drv.set_mode(W, H, W * 4).unwrap();
    big.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    big.run_fenced(&[fill(0, 0, 4, 4, 0x77)], 1);
    assert_eq!(big.gpu().pixel(3, 3), Some(0x77));
}

#[test]
fn test_gpu_precopy_delta_without_its_chunks_or_out_of_order_refused() {
    let mut guest = Rig::new(PinPolicy::Translate);
    guest.run(&[fill(0, 0, W, H, 0x33)]);
    let chunk0 = mig(&mut guest).precopy().unwrap().unwrap();
    guest.run(&[fill(0, 0, 8, 8, 0x44)]);
    let chunk1 = mig(&mut guest).precopy().unwrap().unwrap();
    guest.run(&[fill(0, 100, 8, 8, 0x55)]);
    mig(&mut guest).stop().unwrap();
    let state = mig(&mut guest).save().unwrap();

    let mut dst = rig_on(new_gpu(), copy_ram(&guest.ram));
    mig(&mut dst).stop().unwrap();
    // No chunk loaded: the delta cannot be applied.
    assert!(matches!(
        mig(&mut dst).load(&state),
        Err(MigrationError::Incompatible(_))
    ));
    // Chunk 1 before chunk 0.
    assert!(mig(&mut dst).load_precopy(&chunk1).is_err());
    // Only chunk 0 of the two the state builds on.
    mig(&mut dst).load_precopy(&chunk0).unwrap();
    assert!(mig(&mut dst).load(&state).is_err());
    // Both, in order: loads, and the result is the source's.
    mig(&mut dst).load_precopy(&chunk0).unwrap();
    mig(&mut dst).load_precopy(&chunk1).unwrap();
    mig(&mut dst).load(&state).unwrap();
    assert_eq!(fb_bytes(&mut dst), fb_bytes(&mut guest));
    // A state chunk is not a PRE_COPY chunk and vice versa.
    assert!(matches!(
        mig(&mut dst).load_precopy(&state),
        Err(MigrationError::WrongFormat { .. })
    ));
    assert!(matches!(
        mig(&mut dst).load(&chunk0),
        Err(MigrationError::WrongFormat { .. })
    ));
}

#[test]
fn test_gpu_parent_instance_migrates_destination_keeps_its_type_weight_engine_serves_others() {
    let src_parent = GpuParent::new(GpuParentConfig::default()).unwrap();
    let dst_parent = GpuParent::new(GpuParentConfig {
        pool_mib: 16,
        types: vec![GpuType::new("gpu-4m-heavy", 4, 3)],
        ..GpuParentConfig::default()
    })
    .unwrap();
    let params = Params::new();
    let create = |parent: &GpuParent, uuid: &str, ty: &str| {
        parent
            .create_gpu(CreateRequest {
                uuid,
                type_name: ty,
                params: &params,
            })
            .unwrap()
    };
    let rig_with_ring = |gpu: Gpu| {
        let mut rig = rig_on(gpu, GuestMemory::new(RAM_BASE, RAM_SIZE).unwrap());
        rig.drv.set_mode(W, H, W * 4).unwrap();
        rig.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
        rig
    };
    let mut guest = rig_with_ring(create(&src_parent, "a", "gpu-4m"));
    let mut neighbour = rig_with_ring(create(&src_parent, "b", "gpu-4m"));
    surfaces(&mut guest);
    let [first, around, after] = scene();
    guest.run(&first);
    mig(&mut guest).stop().unwrap();
    guest.drv.submit(&mut guest.ram, &around).unwrap();
    let head = guest.drv.read(REG_RING_HEAD).unwrap();
    assert_ne!(head, guest.drv.read(REG_RING_TAIL).unwrap());
    // The engine is shared: the stopped instance's lane has work, and is parked while
    // the neighbour's is served.
    neighbour.run_fenced(&[fill(0, 0, W, H, 0x99)], 3);
    assert_eq!(guest.drv.read(REG_RING_HEAD).unwrap(), head);

    let (old, _) = migrate(&mut guest, create(&dst_parent, "a", "gpu-4m-heavy"), |_| {});
    guest.run_fenced(&after, 99);
    assert_eq!(fb_bytes(&mut guest), reference_scene());
    let info = dst_parent.instances();
    assert_eq!((info.len(), info[0].weight), (1, 3));
    assert!(
        info[0].stats.commands > 0,
        "executed on the destination's engine"
    );
    assert_eq!(src_parent.instances()[0].weight, 1);
    drop(old);
    assert_eq!(
        src_parent.instances().len(),
        1,
        "the source instance went away"
    );
}
