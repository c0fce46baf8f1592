//! The guest side of `bench instances`: an embedded [`Vmm`] per instance acting as the
//! GPU's or the ccw device's guest driver, with the device's own encodings
//! (`umdev_devices::{gpu,ccw}::driver`).
//!
//! - [`GpuClient`]: mode 64×64, a 4 KiB ring, a 16 KiB read-back surface behind 4 writable
//!   GTT entries, MSI with `IRQ_FENCE` enabled. [`GpuClient::draw_and_verify`] fills the
//!   screen with the instance's colour, reads it back into guest RAM, fences, waits for the
//!   fence interrupt, and checks every read-back pixel.
//! - [`CcwClient`]: [`CcwClient::write_and_verify`] writes a 4 KiB pattern of the
//!   instance's own to a block, reads it back into other guest pages, compares, and
//!   compares the instance's image file at that block too.
//! - [`FenceProber`]: an idle GPU instance's FENCE round trip (doorbell write to fence
//!   interrupt), for the fairness part.
//!
//! Interrupts are waited for with `poll(2)` on the eventfd (no sleep loop), so a latency
//! is not rounded up to a polling period.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use umdev::testing::{DeviceAccess, GuestMemory, Vmm};
use umdev_devices::ccw::driver::CcwWord;
use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::driver::{Driver, GuestRam};
use umdev_devices::gpu::regs::{IRQ_FENCE, REG_ERROR_CODE, REG_FENCE_VALUE, REG_RING_TAIL};
use umdev_devices::testing::{run_ccw_program, Bar0};
use vmm_sys_util::eventfd::EventFd;

/// What the clients fail with: the step and its cause in one message.
pub type ClientError = String;

/// Guest physical address of every client's RAM.
pub const RAM_BASE: u64 = 1 << 30;
/// Guest RAM of a serving client (ring, surfaces, channel program, data).
pub const RAM_SIZE: usize = 64 << 10;
/// The serving GPU client's mode (fits every GPU type) and ring.
const MODE_W: u32 = 64;
const MODE_H: u32 = 64;
const RING_BYTES: u32 = 4096;
/// The read-back surface: one screen, rows of `MODE_W` pixels, after the ring.
const SURFACE_GPA: u64 = RAM_BASE + 0x2000;
const SURFACE_BYTES: usize = (MODE_W * MODE_H * 4) as usize;
const SURFACE_PAGES: u32 = (SURFACE_BYTES / 4096) as u32;
/// The ccw client's data pages (`run_ccw_program` uses the first 0x1000 bytes).
const CCW_SRC: u64 = RAM_BASE + 0x2000;
const CCW_DST: u64 = RAM_BASE + 0x4000;
const CCW_BYTES: usize = 4096;
/// Longest wait for one interrupt; turns a hang into a reported failure.
pub const IRQ_TIMEOUT: Duration = Duration::from_secs(20);

fn step<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, ClientError> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Wait until `efd` is signalled (blocking `poll`, not a sleep loop) and consume it; false
/// after `timeout`.
pub fn wait_irq(efd: &EventFd, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if efd.read().is_ok() {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut pfd = libc::pollfd {
            fd: efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call; poll writes only revents.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }
}

/// The colour instance `index` draws: distinct for every index below 2^16, never 0 (the
/// framebuffer's initial value).
pub fn colour(index: usize) -> u32 {
    0x0040_0000 | (index as u32 & 0xffff)
}

/// The 4 KiB pattern ccw instance `index` writes (xorshift seeded by the index).
pub fn ccw_pattern(index: usize) -> Vec<u8> {
    let mut x = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..CCW_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Connect to `socket` and do what a guest driver does at probe: guest RAM mapped, the
/// device enabled with MSI, the mode set and the ring at the start of guest RAM.
fn probe_gpu(socket: &Path) -> Result<(Driver<Bar0<Vmm>>, GuestMemory, EventFd), ClientError> {
    let vmm = step("connect", Vmm::connect(socket))?;
    let mut vmm = step("DMA_MAP guest RAM", vmm.with_ram(RAM_BASE, RAM_SIZE))?;
    step("enable", vmm.enable_device())?;
    let msi = step("MSI", vmm.enable_msi())?;
    let ram = vmm.ram().clone();
    let mut drv = step("probe", Driver::probe(Bar0(vmm)))?;
    step("mode", drv.set_mode(MODE_W, MODE_H, MODE_W * 4))?;
    step("ring", drv.setup_ring(RAM_BASE, RING_BYTES))?;
    Ok((drv, ram, msi))
}

/// A connected GPU guest driver (see the module doc).
pub struct GpuClient {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    msi: EventFd,
    /// The next fence value.
    fence: u32,
}

impl GpuClient {
    /// Connect to `socket` and do what a guest driver does at probe.
    pub fn connect(socket: &Path) -> Result<GpuClient, ClientError> {
        let (mut drv, ram, msi) = probe_gpu(socket)?;
        for p in 0..SURFACE_PAGES {
            step(
                "GTT",
                drv.set_gtt(p, SURFACE_GPA + u64::from(p) * 4096, true),
            )?;
        }
        step("IRQ enable", drv.enable_irqs(IRQ_FENCE))?;
        Ok(GpuClient {
            drv,
            ram,
            msi,
            fence: 0,
        })
    }

    /// Submit `cmds` followed by a FENCE, wait for its interrupt and check the fence value.
    fn run(&mut self, cmds: &[Command]) -> Result<(), ClientError> {
        self.fence = self.fence.wrapping_add(1).max(1);
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: self.fence });
        step("submit", self.drv.submit(&mut self.ram, &all))?;
        if !wait_irq(&self.msi, IRQ_TIMEOUT) {
            return Err(format!("no fence interrupt within {IRQ_TIMEOUT:?}"));
        }
        step("IRQ ack", self.drv.ack(IRQ_FENCE))?;
        let got = step("FENCE_VALUE", self.drv.read(REG_FENCE_VALUE))?;
        if got != self.fence {
            return Err(format!("FENCE_VALUE {got:#x}, expected {:#x}", self.fence));
        }
        let err = step("ERROR_CODE", self.drv.read(REG_ERROR_CODE))?;
        if err != 0 {
            return Err(format!("device error code {err:#x}"));
        }
        Ok(())
    }

    /// Fill the screen with `colour`, read it back into guest RAM, and check every pixel.
    pub fn draw_and_verify(&mut self, colour: u32) -> Result<(), ClientError> {
        self.run(&[
            Command::FillRect {
                x: 0,
                y: 0,
                w: MODE_W,
                h: MODE_H,
                color: colour,
            },
            Command::Readback {
                src_x: 0,
                src_y: 0,
                w: MODE_W,
                h: MODE_H,
                gtt_index: 0,
                stride: MODE_W * 4,
            },
        ])?;
        let mut surface = vec![0u8; SURFACE_BYTES];
        step("read surface", self.ram.read(SURFACE_GPA, &mut surface))?;
        let wrong = surface
            .chunks_exact(4)
            .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]))
            .enumerate()
            .find(|&(_, px)| px != colour);
        match wrong {
            None => Ok(()),
            Some((i, px)) => Err(format!(
                "read-back pixel {i} is {px:#08x}, expected {colour:#08x}"
            )),
        }
    }
}

/// A connected ccw guest driver (see the module doc).
pub struct CcwClient {
    vmm: Vmm,
    msi: EventFd,
}

impl CcwClient {
    /// Connect to `socket`, map guest RAM, enable the device and MSI.
    pub fn connect(socket: &Path) -> Result<CcwClient, ClientError> {
        let vmm = step("connect", Vmm::connect(socket))?;
        let mut vmm = step("DMA_MAP guest RAM", vmm.with_ram(RAM_BASE, RAM_SIZE))?;
        step("enable", vmm.enable_device())?;
        let msi = step("MSI", vmm.enable_msi())?;
        Ok(CcwClient { vmm, msi })
    }

    fn run(&mut self, ccw: CcwWord, block: u64) -> Result<(), ClientError> {
        let ram = self.vmm.ram().clone();
        let st = step(
            "channel program",
            run_ccw_program(&mut self.vmm, &ram, &self.msi, &[ccw], block),
        )?;
        if st.fault != 0 {
            return Err(format!("channel program faulted: {st:?}"));
        }
        Ok(())
    }

    /// Write `pattern` (4 KiB) to `block`, read it back into other guest pages, compare;
    /// then compare the image file `image` at that block.
    pub fn write_and_verify(
        &mut self,
        pattern: &[u8],
        block: u64,
        image: &Path,
    ) -> Result<(), ClientError> {
        let ram = self.vmm.ram().clone();
        step("write source", ram.write(CCW_SRC, pattern))?;
        step("clear target", ram.fill(CCW_DST, pattern.len(), 0))?;
        let count = pattern.len() as u16;
        self.run(CcwWord::write(count, CCW_SRC), block)?;
        self.run(CcwWord::read(count, CCW_DST), block)?;
        let back = step("read target", ram.read_vec(CCW_DST, pattern.len()))?;
        if back != pattern {
            return Err(format!("block {block}: data read back differs"));
        }
        let file = step("open image", File::open(image))?;
        let mut on_disk = vec![0u8; pattern.len()];
        step(
            "read image",
            file.read_exact_at(&mut on_disk, block * umdev_devices::ccw::driver::BLOCK_SIZE),
        )?;
        if on_disk != pattern {
            return Err(format!(
                "block {block}: the image {} does not hold the data",
                image.display()
            ));
        }
        Ok(())
    }
}

/// An idle GPU instance's FENCE round trip: the client writes one FENCE into its ring,
/// rings the doorbell (`RING_TAIL`) and waits for the fence interrupt.
pub struct FenceProber {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    msi: EventFd,
    tail: u32,
    value: u32,
}

impl FenceProber {
    /// Connect to `socket`: mode, a 4 KiB ring, MSI, `IRQ_FENCE` enabled.
    pub fn connect(socket: &Path) -> Result<FenceProber, ClientError> {
        let (mut drv, ram, msi) = probe_gpu(socket)?;
        step("IRQ enable", drv.enable_irqs(IRQ_FENCE))?;
        Ok(FenceProber {
            drv,
            ram,
            msi,
            tail: 0,
            value: 0,
        })
    }

    /// One FENCE: `(doorbell, fence)`, the times from the start of the doorbell write to
    /// its reply (a REGION_WRITE round trip) and to the fence interrupt. The ring is empty
    /// before and after (each FENCE completes before the next), and 8-byte commands never
    /// straddle the 4 KiB ring's end.
    pub fn sample(&mut self) -> Result<(Duration, Duration), ClientError> {
        self.value = self.value.wrapping_add(1).max(1);
        let bytes = Command::encode_bytes(&[Command::Fence { value: self.value }]);
        step(
            "write ring",
            GuestRam::write(&mut self.ram, RAM_BASE + u64::from(self.tail), &bytes),
        )?;
        self.tail = (self.tail + bytes.len() as u32) % RING_BYTES;
        let start = Instant::now();
        step("doorbell", self.drv.write(REG_RING_TAIL, self.tail))?;
        let doorbell = start.elapsed();
        if !wait_irq(&self.msi, IRQ_TIMEOUT) {
            return Err(format!("no fence interrupt within {IRQ_TIMEOUT:?}"));
        }
        let latency = start.elapsed();
        step("IRQ ack", self.drv.ack(IRQ_FENCE))?;
        let got = step("FENCE_VALUE", self.drv.read(REG_FENCE_VALUE))?;
        if got != self.value {
            return Err(format!("FENCE_VALUE {got:#x}, expected {:#x}", self.value));
        }
        Ok((doorbell, latency))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_colours_and_patterns_differ_per_instance() {
        assert_ne!(colour(0), 0);
        let colours: std::collections::BTreeSet<u32> = (0..1024).map(colour).collect();
        assert_eq!(colours.len(), 1024);
        assert_eq!(ccw_pattern(3).len(), CCW_BYTES);
        assert_ne!(ccw_pattern(3), ccw_pattern(4));
        assert_eq!(ccw_pattern(5), ccw_pattern(5));
    }

    #[test]
    fn test_wait_irq_sees_a_signal_and_times_out_without_one() {
        let efd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        assert!(!wait_irq(&efd, Duration::from_millis(5)));
        efd.write(1).unwrap();
        assert!(wait_irq(&efd, Duration::from_millis(5)));
        assert!(!wait_irq(&efd, Duration::ZERO), "the signal was consumed");
    }
}
