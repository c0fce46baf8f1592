//! A victim of `bench isolation`: a GPU instance's guest driver that measures, over and
//! over, the three things a VM needs from its device whatever its neighbours do:
//!
//! - **region**: a REGION_READ of BAR0 `REG_ID` (the connection thread's round trip);
//! - **map**: a DMA_MAP of one page of the victim's own memfd and its DMA_UNMAP (the fd
//!   passed over the socket, the server's mmap and munmap: what a process-wide VMA or fd
//!   shortage breaks first);
//! - **fence**: one FENCE through the shared render engine, doorbell write to fence MSI.
//!
//! A sample is the three in a row; the thread takes samples while its block is on and
//! files each under the block it started and ended in ([`Phase`]), with a random pause
//! of 1–3 ms between samples so that seven victims do not saturate the machine they
//! measure. A failed operation is counted as an error of its kind (and its first message
//! kept), never as a latency.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev::testing::{DeviceAccess, GuestMemory, Vmm};
use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::driver::{Driver, GuestRam};
use umdev_devices::gpu::regs::{IRQ_FENCE, REG_FENCE_VALUE, REG_ID, REG_RING_TAIL};
use umdev_devices::testing::Bar0;
use vmm_sys_util::eventfd::EventFd;

use crate::instances::clients::{wait_irq, ClientError, RAM_BASE, RAM_SIZE};
use crate::rng::SeededRng;

/// The victim's ring (at the start of its guest RAM).
const RING_BYTES: u32 = 4096;
/// Where the victim's extra page is mapped and unmapped (above its guest RAM).
const MAP_IOVA: u64 = RAM_BASE + (RAM_SIZE as u64) + (1 << 20);
/// Longest wait for a late fence once it has been counted as an error (to get back in
/// step with the device before the next sample).
const RESYNC_TIMEOUT: Duration = Duration::from_secs(20);

/// Which block a victim's samples go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Not sampling.
    Idle = 0,
    /// The block without attack.
    Baseline = 1,
    /// The block under attack.
    Attack = 2,
    /// The thread ends.
    Exit = 3,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::Baseline,
            2 => Phase::Attack,
            3 => Phase::Exit,
            _ => Phase::Idle,
        }
    }
}

/// A phase shared by the victims and the run that sets it.
#[derive(Clone, Default)]
pub struct PhaseCell(Arc<AtomicU8>);

impl PhaseCell {
    /// Set the phase.
    pub fn set(&self, p: Phase) {
        self.0.store(p as u8, Ordering::Release);
    }

    /// The phase now.
    pub fn get(&self) -> Phase {
        Phase::from_u8(self.0.load(Ordering::Acquire))
    }
}

/// The operations a victim measures.
pub const OPS: [&str; 3] = ["region", "map", "fence"];

/// Samples and errors of one block, per operation (in [`OPS`] order), µs.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Block {
    /// Latencies per operation, µs.
    pub us: [Vec<f64>; 3],
    /// Failed operations per operation.
    pub errors: [u64; 3],
    /// The first error message of the block.
    pub first_error: Option<String>,
}

/// Everything one victim measured.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct VictimSamples {
    /// Without attack.
    pub baseline: Block,
    /// Under attack.
    pub attack: Block,
    /// Set when the victim stopped sampling early (its device stopped answering).
    pub gave_up: Option<String>,
}

/// A connected victim (see the module doc).
pub struct Victim {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    msi: EventFd,
    page: File,
    tail: u32,
    value: u32,
    fence_timeout: Duration,
}

fn step<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, ClientError> {
    r.map_err(|e| format!("{what}: {e}"))
}

impl Victim {
    /// Connect to `socket` and do what a guest driver does at probe (guest RAM, MSI, mode,
    /// ring, `IRQ_FENCE`); the page it maps and unmaps is a memfd made now, before any
    /// attack.
    pub fn connect(socket: &Path, fence_timeout: Duration) -> Result<Victim, ClientError> {
        let vmm = step("connect", Vmm::connect(socket))?;
        let mut vmm = step("DMA_MAP guest RAM", vmm.with_ram(RAM_BASE, RAM_SIZE))?;
        step("enable", vmm.enable_device())?;
        let msi = step("MSI", vmm.enable_msi())?;
        let ram = vmm.ram().clone();
        let mut drv = step("probe", Driver::probe(Bar0(vmm)))?;
        step("mode", drv.set_mode(64, 64, 256))?;
        step("ring", drv.setup_ring(RAM_BASE, RING_BYTES))?;
        step("IRQ enable", drv.enable_irqs(IRQ_FENCE))?;
        let page = step("memfd", umdev::testing::memfd(4096))?;
        Ok(Victim {
            drv,
            ram,
            msi,
            page,
            tail: 0,
            value: 0,
            fence_timeout,
        })
    }

    fn region(&mut self) -> Result<Duration, ClientError> {
        let t = Instant::now();
        step("REGION_READ REG_ID", self.drv.read(REG_ID))?;
        Ok(t.elapsed())
    }

    fn map(&mut self) -> Result<Duration, ClientError> {
        let t = Instant::now();
        let vmm = &mut self.drv.regs().0;
        step(
            "DMA_MAP",
            vmm.dma_map_fd(MAP_IOVA, 4096, self.page.as_fd(), 0),
        )?;
        step("DMA_UNMAP", vmm.dma_unmap(MAP_IOVA, 4096))?;
        Ok(t.elapsed())
    }

    /// One FENCE; a fence later than the timeout is an error, and the victim then waits
    /// (up to [`RESYNC_TIMEOUT`]) for it before going on: `Err((message, in_step))`.
    fn fence(&mut self) -> Result<Duration, (ClientError, bool)> {
        self.value = self.value.wrapping_add(1).max(1);
        let bytes = Command::encode_bytes(&[Command::Fence { value: self.value }]);
        GuestRam::write(&mut self.ram, RAM_BASE + u64::from(self.tail), &bytes)
            .map_err(|e| (format!("write ring: {e}"), true))?;
        self.tail = (self.tail + bytes.len() as u32) % RING_BYTES;
        let t = Instant::now();
        self.drv
            .write(REG_RING_TAIL, self.tail)
            .map_err(|e| (format!("doorbell: {e}"), false))?;
        let in_time = wait_irq(&self.msi, self.fence_timeout);
        let latency = t.elapsed();
        if !in_time && !wait_irq(&self.msi, RESYNC_TIMEOUT) {
            return Err((
                format!(
                    "no fence interrupt within {:?}",
                    self.fence_timeout + RESYNC_TIMEOUT
                ),
                false,
            ));
        }
        self.drv
            .ack(IRQ_FENCE)
            .map_err(|e| (format!("IRQ ack: {e}"), false))?;
        let got = self
            .drv
            .read(REG_FENCE_VALUE)
            .map_err(|e| (format!("FENCE_VALUE: {e}"), false))?;
        if got != self.value {
            return Err((
                format!("FENCE_VALUE {got:#x}, expected {:#x}", self.value),
                false,
            ));
        }
        if !in_time {
            return Err((
                format!("fence {latency:?} late (limit {:?})", self.fence_timeout),
                true,
            ));
        }
        Ok(latency)
    }

    /// Take samples while `phase` is Baseline or Attack, until it is Exit.
    pub fn run(mut self, phase: PhaseCell, seed: u64) -> VictimSamples {
        let mut out = VictimSamples::default();
        let mut rng = SeededRng::new(seed);
        loop {
            let p = phase.get();
            match p {
                Phase::Exit => return out,
                Phase::Idle => {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Phase::Baseline | Phase::Attack => {}
            }
            let mut got: [Option<f64>; 3] = [None; 3];
            let mut errs: Vec<(usize, String)> = Vec::new();
            let mut in_step = true;
            match self.region() {
                Ok(d) => got[0] = Some(us(d)),
                Err(e) => errs.push((0, e)),
            }
            match self.map() {
                Ok(d) => got[1] = Some(us(d)),
                Err(e) => errs.push((1, e)),
            }
            match self.fence() {
                Ok(d) => got[2] = Some(us(d)),
                Err((e, ok)) => {
                    in_step = ok;
                    errs.push((2, e));
                }
            }
            // A sample that straddles a phase change belongs to neither block (errors
            // count for the block it ends in: an attack's effect may outlive its block).
            let end = phase.get();
            let block = match end {
                Phase::Baseline => &mut out.baseline,
                Phase::Attack => &mut out.attack,
                _ => continue,
            };
            if end == p {
                for (i, v) in got.iter().enumerate() {
                    if let Some(v) = v {
                        block.us[i].push(*v);
                    }
                }
            }
            for (i, e) in errs {
                block.errors[i] += 1;
                block.first_error.get_or_insert(format!("{}: {e}", OPS[i]));
            }
            if !in_step {
                out.gave_up = block.first_error.clone();
                return out;
            }
            std::thread::sleep(Duration::from_micros(rng.range_inclusive(1000, 3000)));
        }
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
