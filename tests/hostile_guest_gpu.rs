//! Hostile guest against the GPU, through a real socket: umdev's server serves the GPU, the
//! independent `vfio_user::Client` is the VMM, the test is the guest driver. Random register
//! writes, rings and GTT entries at unmapped, read-only, aliased or wrapping addresses: the
//! device answers with its documented error code (protocol-docs/devices/gpu.md), the server
//! keeps serving (a following good operation works) and every pin is returned.

#[path = "common/independent_client.rs"]
mod independent;

use std::os::fd::AsRawFd;
use std::time::Duration;

use independent::{client_map, enable_device, SocketRegs};
use umdev::device::region_index;
use umdev::dma::{DmaConfig, DmaMapping, PinPolicy, Prot};
use umdev::pci::PciAdapter;
use umdev::testing::{
    memfd, wait_until, Answer, DeviceAccess, FdlessMemory, GuestMemory, RawClient, Rng, TestServer,
    Vmm,
};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::error::*;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};

const RAM_BASE: u64 = 0x1000_0000;
const RAM_SIZE: usize = 4 << 20;
/// Ring mapping (read-write, through the client).
const RING_GPA: u64 = RAM_BASE;
const RING_MAP_SIZE: u64 = 1 << 20;
const RING_SIZE: u32 = 64 * 1024;
/// Surface mapping (read-write, through the client).
const SURF_GPA: u64 = RAM_BASE + (1 << 20);
const SURF_SIZE: u64 = 2 << 20;
/// Read-only mapping (straight into the DMA space: the client maps read-write only).
const RO_GPA: u64 = RAM_BASE + (3 << 20);
const RO_SIZE: u64 = 1 << 20;
/// Nothing is mapped here.
const UNMAPPED_GPA: u64 = 0x2000_0000;
/// The last page of the 64-bit IOVA space.
const LAST_PAGE: u64 = 0xffff_ffff_ffff_f000;
const W: u32 = 64;
const H: u32 = 64;
/// GTT entry the health check uses.
const HEALTH_GTT: u32 = 1000;

struct GpuVm {
    served: TestServer<PciAdapter<Gpu>>,
    drv: Driver<SocketRegs>,
    ram: GuestMemory,
    fence: u32,
}

impl GpuVm {
    fn new(policy: PinPolicy) -> GpuVm {
        GpuVm::with_lock_limit(policy, 4 << 20)
    }

    fn with_lock_limit(policy: PinPolicy, lock_limit: u64) -> GpuVm {
        let dma = DmaConfig {
            policy,
            lock_limit_bytes: Some(lock_limit),
            ..DmaConfig::default()
        };
        let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
        let served = TestServer::builder_pci(gpu)
            .unwrap()
            .dma_config(dma)
            .start()
            .unwrap();
        let mut client = independent::connect(served.path());
        enable_device(&mut client);
        let ram = GuestMemory::new(RAM_BASE, RAM_SIZE).unwrap();
        let fd = ram.fd();
        client_map(&mut client, served.dma(), &fd, 0, RING_GPA, RING_MAP_SIZE);
        client_map(
            &mut client,
            served.dma(),
            &fd,
            SURF_GPA - RAM_BASE,
            SURF_GPA,
            SURF_SIZE,
        );
        served
            .dma()
            .map(DmaMapping {
                iova: RO_GPA,
                size: RO_SIZE,
                prot: Prot::READ,
                fd: Some(ram.try_clone_fd().unwrap()),
                offset: RO_GPA - RAM_BASE,
            })
            .unwrap();
        let mut drv = Driver::probe(SocketRegs::new(client)).unwrap();
        drv.set_mode(W, H, W * 4).unwrap();
        drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
        GpuVm {
            served,
            drv,
            ram,
            fence: 0,
        }
    }

    fn client(&mut self) -> &mut vfio_user::Client {
        &mut self.drv.regs().client
    }

    fn reg(&mut self, off: u64) -> u32 {
        self.drv.read(off).unwrap()
    }

    /// Submit `cmds` and a fence, wait for the fence.
    fn run(&mut self, cmds: &[Command]) {
        self.fence += 1;
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: self.fence });
        self.drv.submit(&mut self.ram, &all).unwrap();
        self.drv.wait_fence(self.fence).unwrap();
    }

    /// Run `cmds` (the first one must fail with `code`; the rest must succeed) and check
    /// the error: ERROR_INFO is the ring offset of the failing command.
    fn run_expect(&mut self, cmds: &[Command], code: u32) {
        let at = self.reg(REG_RING_TAIL);
        let count = self.reg(REG_ERROR_COUNT);
        self.run(cmds);
        assert_eq!(self.take_error(), (code, at), "{cmds:?}");
        assert_eq!(self.reg(REG_ERROR_COUNT), count.wrapping_add(1), "{cmds:?}");
    }

    /// `(ERROR_CODE, ERROR_INFO)`, then ack the error.
    fn take_error(&mut self) -> (u32, u32) {
        let e = self.drv.error().unwrap();
        self.drv.ack(IRQ_ALL).unwrap();
        e
    }

    fn pixel(&self, x: u32, y: u32) -> Option<u32> {
        self.served.device().device().pixel(x, y)
    }

    fn pins_held(&self) -> usize {
        self.served.device().device().pins_held()
    }

    /// A good operation still works: blit a known pixel from a fresh surface page.
    fn assert_serving(&mut self) {
        let page = SURF_GPA + SURF_SIZE - 4096;
        let color = 0x00c0_ffee ^ self.fence;
        self.ram.write(page, &color.to_le_bytes()).unwrap();
        self.drv.set_gtt(HEALTH_GTT, page, false).unwrap();
        self.run(&[Command::Blit {
            gtt_index: HEALTH_GTT,
            stride: 4096,
            w: 1,
            h: 1,
            dst_x: W - 1,
            dst_y: H - 1,
        }]);
        assert_eq!(
            self.pixel(W - 1, H - 1),
            Some(color),
            "device stopped serving"
        );
        assert_eq!(self.take_error(), (ERR_NONE, 0), "health blit failed");
    }

    /// Invalidate GTT entries `0..n` and the health entry: no pin may remain anywhere.
    fn assert_pins_return_to_zero(&mut self, n: u32) {
        self.drv.clear_gtt(0, n).unwrap();
        self.drv.clear_gtt(HEALTH_GTT, 1).unwrap();
        assert_eq!(self.pins_held(), 0, "GPU still holds pins");
        self.served.assert_space_unpinned();
    }
}

fn blit(gtt_index: u32, w: u32, h: u32) -> Command {
    Command::Blit {
        gtt_index,
        stride: 4096,
        w,
        h,
        dst_x: 0,
        dst_y: 0,
    }
}

fn readback(gtt_index: u32, w: u32, h: u32) -> Command {
    Command::Readback {
        src_x: 0,
        src_y: 0,
        w,
        h,
        gtt_index,
        stride: 4096,
    }
}

/// Registers a hostile guest aims at most.
const REGS: [u64; 20] = [
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
    REG_RING_TAIL,
    REG_RING_TAIL,
    REG_IRQ_STATUS,
    REG_IRQ_ENABLE,
    REG_IRQ_ACK,
    REG_ERROR_CODE,
    REG_FENCE_VALUE,
];

/// A guest address a hostile guest might pick: mapped RW, read-only, unmapped, wrapping.
fn hostile_address(rng: &mut Rng) -> u64 {
    let page = rng.below(64) * 4096;
    match rng.below(6) {
        0 => RING_GPA + page,
        1 => SURF_GPA + page,
        2 => RO_GPA + page,
        3 => UNMAPPED_GPA + page,
        4 => LAST_PAGE - page,
        _ => rng.next_u64() & !0xfff,
    }
}

fn hostile_command(rng: &mut Rng) -> Command {
    let small = |rng: &mut Rng| rng.below(80) as u32;
    match rng.below(6) {
        0 => Command::Blit {
            gtt_index: rng.below(16) as u32,
            stride: rng.pick(&[0, 64, 4096, 4096, 8192]),
            w: rng.below(9) as u32,
            h: rng.below(5) as u32,
            dst_x: rng.below(60) as u32,
            dst_y: rng.below(60) as u32,
        },
        1 => Command::Readback {
            src_x: rng.below(60) as u32,
            src_y: rng.below(60) as u32,
            w: rng.below(9) as u32,
            h: rng.below(5) as u32,
            gtt_index: rng.below(16) as u32,
            stride: rng.pick(&[0, 64, 4096, 4096]),
        },
        2 => Command::FillRect {
            x: small(rng),
            y: small(rng),
            w: small(rng),
            h: small(rng),
            color: rng.next_u64() as u32,
        },
        3 => Command::CopyRect {
            src_x: small(rng),
            src_y: small(rng),
            dst_x: small(rng),
            dst_y: small(rng),
            w: small(rng),
            h: small(rng),
        },
        4 => Command::Fence {
            value: rng.next_u64() as u32,
        },
        _ => Command::Nop,
    }
}

/// Fill the ring memory with back-to-back hostile commands, so that wherever a random
/// doorbell leaves the head, the device parses commands that reference random GTT entries.
fn plant_commands(vm: &mut GpuVm, rng: &mut Rng) {
    let mut cmds = Vec::new();
    let mut len = 0;
    while len < RING_SIZE as usize - 64 {
        let c = hostile_command(rng);
        len += c.len_dwords() * 4;
        cmds.push(c);
    }
    vm.ram
        .write(RING_GPA, &Command::encode_bytes(&cmds))
        .unwrap();
    // A guest driver recovering: valid mode and ring, GTT entries at hostile pages.
    vm.drv.set_mode(W, H, W * 4).unwrap();
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    for i in 0..20 {
        let addr = if rng.chance(70) {
            SURF_GPA + rng.below(16) * 4096
        } else {
            hostile_address(rng)
        };
        vm.drv.set_gtt(i, addr, rng.chance(50)).unwrap();
    }
}

/// One seeded run of random BAR0 writes (any offset, size 1/2/4/8, random or plausible
/// values), with random commands planted in the ring memory so random doorbells execute
/// them against random GTT entries.
fn random_register_storm(seed: u64, steps: usize) -> u64 {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    let mut rng = Rng::new(seed);
    for step in 0..steps {
        if step % 100 == 0 {
            plant_commands(&mut vm, &mut rng);
        }
        if rng.chance(8) {
            let tail = rng.below(u64::from(RING_SIZE) / 4) as u32 * 4;
            vm.drv.write(REG_RING_TAIL, tail).unwrap();
            continue;
        }
        let off = match rng.below(10) {
            0..=3 => rng.pick(&REGS),
            4..=6 => GTT_BASE + 8 * rng.below(20) + rng.pick(&[0, 0, 4]),
            7 => GTT_BASE + rng.below(u64::from(GTT_ENTRIES) * 8),
            _ => rng.below(BAR0_SIZE),
        };
        let size = rng
            .pick(&[1usize, 2, 4, 4, 4, 8])
            .min((BAR0_SIZE - off) as usize);
        let value = match rng.below(10) {
            0..=2 => hostile_address(&mut rng) | GTT_VALID | rng.below(2) << 1,
            3..=4 => rng.below(0x2_0000),
            _ => rng.next_u64(),
        };
        vm.client()
            .region_write(region_index::BAR0, off, &value.to_le_bytes()[..size])
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: write {off:#x}: {e}"));
        if step % 50 == 0 {
            assert_eq!(vm.reg(REG_ID), ID_MAGIC, "seed {seed} step {step}");
        }
    }
    // Calm down: stop the ring, let the worker finish, re-initialize like a rebooting guest.
    vm.drv.write(REG_RING_CTRL, 0).unwrap();
    assert!(
        vm.served
            .device()
            .device()
            .wait_idle(Duration::from_secs(5)),
        "seed {seed}: worker did not go idle"
    );
    let errors = vm.reg(REG_ERROR_COUNT);
    let syscalls = vm.served.dma().stats().residency_syscalls;
    eprintln!("seed {seed}: {errors} device errors, {syscalls} mlock/munlock calls");
    assert!(errors > 0, "seed {seed}: no error provoked");
    vm.drv.ack(IRQ_ALL).unwrap();
    vm.drv.write(REG_IRQ_ENABLE, 0).unwrap();
    vm.drv.set_mode(W, H, W * 4).unwrap();
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(GTT_ENTRIES);
    syscalls
}

#[test]
fn test_gpu_socket_random_register_writes_keep_serving_and_return_pins() {
    let pin_syscalls: u64 = (1..=3).map(|seed| random_register_storm(seed, 700)).sum();
    assert!(pin_syscalls > 0, "the storm never reached the pin path");
}

#[test]
fn test_gpu_socket_ring_at_unmapped_address_ring_fault_then_recovers() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    vm.drv.setup_ring(UNMAPPED_GPA, RING_SIZE).unwrap();
    vm.drv.write(REG_RING_TAIL, 16).unwrap();
    assert!(wait_until(Duration::from_secs(5), || vm.reg(REG_RING_HEAD) == 16));
    assert_eq!(vm.take_error(), (ERR_RING_FAULT, 0));
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_ring_straddling_mapping_end_ring_fault() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    // The last 4 KiB of the ring are unmapped: the whole-ring read of a wrapped batch fails.
    let base = UNMAPPED_GPA - 0x1000;
    vm.served
        .dma()
        .map(DmaMapping {
            iova: base,
            size: 0x1000,
            prot: Prot::RW,
            fd: Some(vm.ram.try_clone_fd().unwrap()),
            offset: 0,
        })
        .unwrap();
    vm.drv.setup_ring(base, 0x2000).unwrap();
    vm.drv.write(REG_RING_TAIL, 0x1800).unwrap();
    assert!(wait_until(Duration::from_secs(5), || vm.reg(REG_RING_HEAD) == 0x1800));
    assert_eq!(vm.take_error(), (ERR_RING_FAULT, 0));
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_ring_in_read_only_mapping_executes() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    // The device only reads the ring: a read-only mapping is enough.
    vm.drv.setup_ring(RO_GPA, RING_SIZE).unwrap();
    vm.run(&[Command::FillRect {
        x: 0,
        y: 0,
        w: 2,
        h: 2,
        color: 0x00ab_cdef,
    }]);
    assert_eq!(vm.pixel(1, 1), Some(0x00ab_cdef));
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_ring_base_wrapping_address_space_rejected() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    vm.drv.write(REG_RING_CTRL, 0).unwrap();
    vm.drv.write(REG_RING_BASE_LO, LAST_PAGE as u32).unwrap();
    vm.drv
        .write(REG_RING_BASE_HI, (LAST_PAGE >> 32) as u32)
        .unwrap();
    vm.drv.write(REG_RING_SIZE, 0x2000).unwrap();
    vm.drv.write(REG_RING_CTRL, 1).unwrap();
    assert_eq!(vm.reg(REG_RING_CTRL), 0, "wrapping ring enabled");
    assert_eq!(vm.take_error().0, ERR_RING_CONFIG);
    // A doorbell on the disabled ring is refused too.
    vm.drv.write(REG_RING_TAIL, 8).unwrap();
    assert_eq!(vm.take_error(), (ERR_BAD_TAIL, REG_RING_TAIL as u32));
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_surface_straddling_unmapped_page_gtt_fault_pins_nothing() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    for i in 0..3 {
        vm.drv
            .set_gtt(i, SURF_GPA + u64::from(i) * 4096, false)
            .unwrap();
    }
    vm.drv.set_gtt(3, UNMAPPED_GPA, false).unwrap();
    vm.run_expect(&[blit(0, 4, 4)], ERR_GTT_FAULT);
    assert_eq!(vm.pins_held(), 0, "failed blit kept pins");
    vm.served.assert_space_unpinned();
    // Fix the entry: the same blit now pins all four pages.
    vm.drv.set_gtt(3, SURF_GPA + 3 * 4096, false).unwrap();
    vm.run(&[blit(0, 4, 4)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pins_held(), 4);
    assert_eq!(vm.served.dma().stats().locked_pages, 4);
    vm.assert_serving();
    vm.assert_pins_return_to_zero(4);
}

#[test]
fn test_gpu_socket_gtt_entries_at_wrapping_and_unmapped_pages_gtt_fault() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    for addr in [LAST_PAGE, UNMAPPED_GPA, 0, RO_GPA + RO_SIZE] {
        vm.drv.set_gtt(0, addr, true).unwrap();
        vm.run_expect(&[blit(0, 1, 1)], ERR_GTT_FAULT);
        vm.run_expect(&[readback(0, 1, 1)], ERR_GTT_FAULT);
        assert_eq!(vm.pins_held(), 0, "GTT entry at {addr:#x} kept a pin");
        vm.served.assert_space_unpinned();
    }
    vm.assert_serving();
    vm.assert_pins_return_to_zero(1);
}

#[test]
fn test_gpu_socket_readback_into_read_only_mapping_faults_memory_untouched() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    vm.ram.fill(RO_GPA, 8192, 0x5a).unwrap();
    vm.run(&[Command::FillRect {
        x: 0,
        y: 0,
        w: 4,
        h: 4,
        color: 0x0011_2233,
    }]);
    // Entry 0 is fine (RW surface), entry 1 is read-only memory: nothing may be written.
    vm.drv.set_gtt(0, SURF_GPA, true).unwrap();
    vm.drv.set_gtt(1, RO_GPA + 4096, true).unwrap();
    vm.ram.fill(SURF_GPA, 4096, 0x5a).unwrap();
    vm.run_expect(
        &[Command::Readback {
            src_x: 0,
            src_y: 0,
            w: 4,
            h: 2,
            gtt_index: 0,
            stride: 4096,
        }],
        ERR_GTT_FAULT,
    );
    let mut back = vec![0u8; 8192];
    vm.ram.read(RO_GPA, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a), "read-only memory written");
    vm.ram.read(SURF_GPA, &mut back[..4096]).unwrap();
    assert!(
        back[..4096].iter().all(|&b| b == 0x5a),
        "a failed readback wrote its first page"
    );
    assert_eq!(vm.pins_held(), 0);
    // Blitting from the read-only page is fine.
    vm.drv.set_gtt(1, RO_GPA + 4096, false).unwrap();
    vm.run(&[blit(1, 1, 1)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pixel(0, 0), Some(0x5a5a_5a5a));
    vm.assert_serving();
    vm.assert_pins_return_to_zero(2);
}

#[test]
fn test_gpu_socket_aliased_gtt_entries_pin_one_page_many_times() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    // Eight entries, one guest page: a surface that overlaps itself.
    for i in 0..8 {
        vm.drv.set_gtt(i, SURF_GPA, true).unwrap();
    }
    vm.run(&[
        Command::FillRect {
            x: 0,
            y: 0,
            w: 8,
            h: 8,
            color: 0x0000_00ff,
        },
        readback(0, 8, 8),
        blit(0, 8, 8),
    ]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pins_held(), 8);
    let s = vm.served.dma().stats();
    assert_eq!((s.pinned_pages, s.locked_pages), (1, 1), "{s:?}");
    vm.served.dma().check_invariants().unwrap();
    // Dropping seven of the eight entries keeps the page pinned.
    vm.drv.clear_gtt(1, 7).unwrap();
    assert_eq!(vm.served.dma().stats().pinned_pages, 1);
    vm.assert_serving();
    vm.assert_pins_return_to_zero(8);
}

#[test]
fn test_gpu_socket_client_unmap_drops_pins_next_blit_faults() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    for i in 0..4 {
        vm.drv
            .set_gtt(i, SURF_GPA + u64::from(i) * 4096, false)
            .unwrap();
    }
    vm.run(&[blit(0, 4, 4)]);
    assert_eq!(vm.pins_held(), 4);
    vm.client().dma_unmap(SURF_GPA, SURF_SIZE).unwrap();
    assert_eq!(vm.pins_held(), 0, "unmap notifier kept pins");
    vm.served.assert_space_unpinned();
    vm.run_expect(&[blit(0, 4, 4)], ERR_GTT_FAULT);
    // The VMM maps the memory again: the same entries work again.
    let fd = vm.ram.try_clone_fd().unwrap();
    let raw = fd.as_raw_fd();
    vm.client()
        .dma_map(SURF_GPA - RAM_BASE, SURF_GPA, SURF_SIZE, raw)
        .unwrap();
    drop(fd);
    vm.run(&[blit(0, 4, 4)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    vm.assert_serving();
    vm.assert_pins_return_to_zero(4);
}

#[test]
fn test_gpu_socket_ring_ending_at_top_of_address_space_faults_cleanly() {
    let mut vm = GpuVm::new(PinPolicy::Translate);
    let base = 0xffff_ffff_ffff_0000u64;
    vm.drv.write(REG_RING_CTRL, 0).unwrap();
    vm.drv.write(REG_RING_BASE_LO, base as u32).unwrap();
    vm.drv.write(REG_RING_BASE_HI, (base >> 32) as u32).unwrap();
    vm.drv.write(REG_RING_SIZE, 0x1_0000).unwrap();
    vm.drv.write(REG_RING_CTRL, 1).unwrap();
    if vm.reg(REG_RING_CTRL) == 1 {
        // Accepted (base + size == 2^64 does not wrap): the ring is simply unmapped.
        vm.drv.write(REG_RING_TAIL, 0xfff0).unwrap();
        assert!(wait_until(Duration::from_secs(5), || vm.reg(REG_RING_HEAD) == 0xfff0));
        assert_eq!(vm.take_error(), (ERR_RING_FAULT, 0));
    } else {
        assert_eq!(vm.take_error(), (ERR_RING_CONFIG, REG_RING_CTRL as u32));
    }
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_own_framebuffer_mapped_as_guest_memory_readback_and_blit() {
    // A VMM may put the device's own BAR2 into the DMA address space (peer-to-peer style):
    // the device then pins its own framebuffer pages and copies framebuffer to framebuffer.
    let mut vm = GpuVm::new(PinPolicy::Lock);
    const FB_GPA: u64 = 0x4000_0000;
    let (fd, start, size) = {
        let bar2 = vm.client().region(2).expect("BAR2");
        let fo = bar2.file_offset.as_ref().expect("BAR2 has an fd");
        (fo.file().try_clone().unwrap(), fo.start(), bar2.size)
    };
    let dma = vm.served.dma().clone();
    client_map(vm.client(), &dma, &fd, start, FB_GPA, size);
    for i in 0..16 {
        vm.drv
            .set_gtt(i, FB_GPA + u64::from(i) * 4096, true)
            .unwrap();
    }
    // Row 0 := a gradient; READBACK it into GTT page 1 (framebuffer offset 4096 = row 16
    // with a 256-byte stride), then BLIT GTT page 1 back to row 40.
    let mut cmds = Vec::new();
    for x in 0..W {
        cmds.push(Command::FillRect {
            x,
            y: 0,
            w: 1,
            h: 1,
            color: 0x0001_0203 * (x + 1),
        });
    }
    cmds.push(readback(1, W, 1));
    cmds.push(Command::Blit {
        gtt_index: 1,
        stride: 4096,
        w: W,
        h: 1,
        dst_x: 0,
        dst_y: 40,
    });
    vm.run(&cmds);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    for x in 0..W {
        let want = Some(0x0001_0203 * (x + 1));
        assert_eq!(
            vm.pixel(x, 16),
            want,
            "readback into own framebuffer, x {x}"
        );
        assert_eq!(vm.pixel(x, 40), want, "blit from own framebuffer, x {x}");
    }
    assert_eq!(vm.pins_held(), 1, "one surface page pinned");
    vm.client().dma_unmap(FB_GPA, size).unwrap();
    assert_eq!(vm.pins_held(), 0);
    vm.served.assert_space_unpinned();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(16);
}

/// Publish `cmds` at ring offset `tail` of a ring in the raw VMM's fd-less memory; returns
/// the new tail after waiting until the device consumed them.
fn fdless_submit(vmm: &mut Vmm, tail: u32, cmds: &[Command]) -> u32 {
    let bytes = Command::encode_bytes(cmds);
    let t = tail as usize;
    vmm.mem_mut()[t..t + bytes.len()].copy_from_slice(&bytes);
    let new_tail = tail + bytes.len() as u32;
    vmm.write32(region_index::BAR0, REG_RING_TAIL, new_tail)
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while vmm.read32(region_index::BAR0, REG_RING_HEAD).unwrap() != new_tail {
        assert!(std::time::Instant::now() < deadline, "ring head stuck");
        std::thread::sleep(Duration::from_millis(1));
    }
    new_tail
}

fn fdless_setup(vmm: &mut Vmm) {
    let bar = region_index::BAR0;
    for (off, v) in [
        (REG_MODE_CTRL, 0),
        (REG_MODE_WIDTH, W),
        (REG_MODE_HEIGHT, H),
        (REG_MODE_STRIDE, W * 4),
        (REG_MODE_FORMAT, FORMAT_XRGB8888),
        (REG_MODE_CTRL, 1),
        (REG_RING_CTRL, 0),
        (REG_RING_BASE_LO, FDLESS_RING as u32),
        (REG_RING_BASE_HI, (FDLESS_RING >> 32) as u32),
        (REG_RING_SIZE, RING_SIZE),
        (REG_RING_CTRL, 1),
    ] {
        vmm.write32(bar, off, v).unwrap();
    }
    assert_eq!(vmm.read32(bar, REG_RING_CTRL).unwrap(), 1);
}

const FDLESS_RING: u64 = 0x5000_0000;

#[test]
fn test_gpu_socket_ring_in_fdless_memory_honest_lying_silent_vmm_and_reset_while_waiting() {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let timeout = Duration::from_millis(300);
    let served = TestServer::builder_pci(gpu)
        .unwrap()
        .configure(|c| c.remote_dma_timeout = timeout)
        .start()
        .unwrap();
    let c = RawClient::new_default(served.path());
    let mut vmm =
        Vmm::from_client(c).with_fdless(FdlessMemory::new(FDLESS_RING, RING_SIZE as usize));
    vmm.dma_map_fdless(FDLESS_RING, u64::from(RING_SIZE))
        .unwrap();
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    fdless_setup(&mut vmm);
    let bar = region_index::BAR0;
    let mut tail = 0;
    for (round, answer) in [
        Answer::Honest,
        Answer::Errors,
        Answer::Silent,
        Answer::Honest,
    ]
    .into_iter()
    .enumerate()
    {
        vmm.set_answer(answer);
        let color = 0x0030_0000 + round as u32;
        let before = vmm.requests();
        let fill = Command::FillRect {
            x: 0,
            y: 0,
            w: 1,
            h: 1,
            color,
        };
        tail = fdless_submit(&mut vmm, tail, &[fill, Command::Fence { value: color }]);
        assert!(vmm.requests() > before, "{answer:?}: no DMA_READ");
        let got = served.device().device().pixel(0, 0);
        if answer == Answer::Honest {
            assert_eq!(got, Some(color), "{answer:?}");
            assert_eq!(vmm.read32(bar, REG_FENCE_VALUE).unwrap(), color);
        } else {
            assert_ne!(
                got,
                Some(color),
                "{answer:?}: commands ran without ring data"
            );
            assert_eq!(
                vmm.read32(bar, REG_ERROR_CODE).unwrap(),
                ERR_RING_FAULT,
                "{answer:?}"
            );
            vmm.write32(bar, REG_IRQ_ACK, IRQ_ALL).unwrap();
        }
    }
    // Reset while the worker waits for a DMA_READ the VMM never answers: bounded by the
    // remote DMA timeout, then the device is back at reset values and works again.
    vmm.set_answer(Answer::Silent);
    let bytes = Command::encode_bytes(&[Command::Nop]);
    let t = tail as usize;
    vmm.mem_mut()[t..t + bytes.len()].copy_from_slice(&bytes);
    vmm.write32(bar, REG_RING_TAIL, tail + 4).unwrap();
    let started = std::time::Instant::now();
    let m = vmm
        .call(umdev::protocol::Command::DeviceReset, &[], &[])
        .unwrap();
    assert!(!m.header.is_error(), "reset errno {}", m.header.error);
    assert!(
        started.elapsed() < timeout + Duration::from_secs(3),
        "reset took {:?}",
        started.elapsed()
    );
    assert_eq!(vmm.read32(bar, REG_RING_CTRL).unwrap(), 0);
    vmm.set_answer(Answer::Honest);
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    fdless_setup(&mut vmm);
    let fill = Command::FillRect {
        x: 1,
        y: 1,
        w: 1,
        h: 1,
        color: 0x77,
    };
    fdless_submit(&mut vmm, 0, &[fill]);
    assert_eq!(served.device().device().pixel(1, 1), Some(0x77));
    assert_eq!(served.device().device().pins_held(), 0);
    served.assert_space_unpinned();
}

#[test]
fn test_gpu_socket_lock_limit_gtt_fault_nothing_pinned_by_failed_blit() {
    // 9 pages of locked memory: an 8-page surface (+ the health page) fits, 16 do not.
    let mut vm = GpuVm::with_lock_limit(PinPolicy::Lock, 9 * 4096);
    for i in 0..16 {
        vm.drv
            .set_gtt(i, SURF_GPA + u64::from(i) * 4096, false)
            .unwrap();
    }
    vm.run_expect(&[blit(0, 4, 16)], ERR_GTT_FAULT);
    assert_eq!(vm.pins_held(), 0);
    vm.served.assert_space_unpinned();
    vm.run(&[blit(0, 4, 8)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pins_held(), 8);
    let s = vm.served.dma().stats();
    assert_eq!((s.pinned_pages, s.locked_pages), (8, 8));
    // Entries 8..16 need 8 more pages: refused, the first 8 stay exactly as they were.
    vm.run_expect(&[blit(8, 4, 8)], ERR_GTT_FAULT);
    assert_eq!(vm.pins_held(), 8);
    let s = vm.served.dma().stats();
    assert_eq!((s.pinned_pages, s.locked_pages), (8, 8));
    vm.served.dma().check_invariants().unwrap();
    // Dropping the first surface frees the budget for the second.
    vm.drv.clear_gtt(0, 8).unwrap();
    vm.run(&[blit(8, 4, 8)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.served.dma().stats().locked_pages, 8);
    vm.drv.clear_gtt(8, 8).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(16);
}

#[test]
fn test_gpu_socket_random_config_space_writes_keep_serving() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    let mut rng = Rng::new(77);
    let mut refused = 0;
    for step in 0..1500 {
        let off = if rng.chance(50) {
            rng.pick(&[
                0x04u64, 0x06, 0x0c, 0x10, 0x14, 0x18, 0x1c, 0x20, 0x24, 0x30, 0x3c, 0x3d,
            ])
        } else {
            rng.below(256)
        };
        let size = rng.pick(&[1usize, 2, 4]).min((256 - off) as usize);
        let v = rng.next_u64().to_le_bytes();
        if vm
            .client()
            .region_write(region_index::CONFIG, off, &v[..size])
            .is_err()
        {
            refused += 1;
        }
        if step % 100 == 0 {
            // Whatever the guest did to its config space, the socket still answers.
            let mut b = [0u8; 4];
            vm.client()
                .region_read(region_index::CONFIG, 0, &mut b)
                .unwrap();
            assert_eq!(u32::from_le_bytes(b), 0x5547_1234, "vendor/device changed");
        }
    }
    eprintln!("config storm: {refused} writes refused");
    // The guest driver re-enables the device and carries on.
    enable_device(vm.client());
    assert_eq!(vm.reg(REG_ID), ID_MAGIC);
    vm.drv.ack(IRQ_ALL).unwrap();
    vm.drv.set_mode(W, H, W * 4).unwrap();
    vm.drv.setup_ring(RING_GPA, RING_SIZE).unwrap();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(0);
}

#[test]
fn test_gpu_socket_refused_pin_upgrade_keeps_read_only_pins_exactly() {
    let mut vm = GpuVm::new(PinPolicy::Lock);
    // Entry 0 in RW memory, entry 1 in read-only memory, both marked WRITABLE.
    vm.drv.set_gtt(0, SURF_GPA, true).unwrap();
    vm.drv.set_gtt(1, RO_GPA, true).unwrap();
    vm.run(&[blit(0, 4, 2)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pins_held(), 2);
    let before = vm.served.dma().stats();
    assert_eq!((before.pinned_pages, before.locked_pages), (2, 2));
    // READBACK needs both writable: the upgrade of entry 1 is refused as a whole.
    vm.run_expect(&[readback(0, 4, 2)], ERR_GTT_FAULT);
    assert_eq!(
        vm.pins_held(),
        2,
        "read-only pins lost by the failed upgrade"
    );
    let after = vm.served.dma().stats();
    assert_eq!(
        (after.pinned_pages, after.locked_pages),
        (2, 2),
        "{before:?} -> {after:?}"
    );
    vm.served.dma().check_invariants().unwrap();
    // The read-only pins still serve blits.
    vm.run(&[blit(0, 4, 2)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    vm.assert_serving();
    vm.assert_pins_return_to_zero(2);
}

#[test]
fn test_gpu_socket_vmm_shrinks_pinned_memfd_server_survives() {
    // A hostile VMM truncates guest memory the GPU has pinned: the next blit touches pages
    // that no longer exist. The server must not die (SIGBUS); the device reads zeros.
    let mut vm = GpuVm::new(PinPolicy::Translate);
    const GPA: u64 = 0x6000_0000;
    let mem = memfd(16 * 4096).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&mem, &[0x77; 16 * 4096], 0).unwrap();
    let dma = vm.served.dma().clone();
    client_map(vm.client(), &dma, &mem, 0, GPA, 16 * 4096);
    for i in 0..4 {
        vm.drv.set_gtt(i, GPA + u64::from(i) * 4096, true).unwrap();
    }
    vm.run(&[blit(0, 4, 4)]);
    assert_eq!(vm.take_error(), (ERR_NONE, 0));
    assert_eq!(vm.pixel(3, 3), Some(0x7777_7777));
    mem.set_len(0).unwrap();
    vm.run(&[blit(0, 4, 4), readback(0, 4, 4)]);
    assert_eq!(vm.pixel(3, 3), Some(0), "vanished pages read as zeros");
    vm.client().dma_unmap(GPA, 16 * 4096).unwrap();
    assert_eq!(vm.pins_held(), 0);
    vm.served.assert_space_unpinned();
    vm.assert_serving();
    vm.assert_pins_return_to_zero(4);
}
