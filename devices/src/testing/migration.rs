//! The example devices moved by live migration, for `umdev demo migrate` and the end-to-end
//! migration tests (`tests/migration_e2e.rs`): a server and a VMM ready to migrate
//! ([`serve_migrating`], [`serve_gpu`]) and a GPU scene drawn across a migration
//! ([`GpuGuest`], [`migrate_mid_scene`]).
//!
//! **The scene.** A guest program draws `frames` frames (at least [`MIN_FRAMES`]) into a
//! [`WIDTH`]×[`HEIGHT`] mode ([`frame_commands`]): frame 0 paints the background, every frame
//! redraws a small region (a moving box and a 32×32 sprite blitted from guest RAM through
//! GTT entry 0, ≈ 56 framebuffer pages at a 4 KiB stride), frame `frames / 2 - 3` reads a
//! 64×64 region back into guest RAM (device DMA: the RAM's dirty log must carry it, GTT
//! entries [`READBACK_GTT`]..+4, writable) and frame `frames - 3` blits it back. Drawn half
//! on a source GPU and half on a destination GPU ([`migrate_mid_scene`]), the destination's
//! framebuffer must be pixel-identical to the same frames drawn on one GPU.
//!
//! **Guest RAM layout** (from [`RAM_BASE`]; the scene needs [`SCENE_RAM`] bytes of it): the
//! 64 KiB command ring at +0, the sprite at +4 MiB, the read-back surface at +5 MiB.
//!
//! **Invariants.** The guest's RAM, driver state (ring position) and interrupt eventfd are
//! the guest's: after a migration the guest keeps them and only its VMM connection changes
//! (the destination VMM's, with the copied RAM; the eventfd attached there with SET_IRQS
//! before the destination runs). The source's half ends at frame `frames / 2` whatever the
//! number of rounds: `rounds + 1` of those frames are drawn while the migration runs.

use std::io;
use std::path::Path;
use std::time::Duration;

use umdev::device::irq_index;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::pci::{PciAdapter, PciDevice};
use umdev::server::{RunningServer, Server, ServerConfig};
use umdev::testing::{
    wait_eventfd, DeviceAccess, GuestMemory, MigrateError, MigrateOptions, Migration,
    MigrationReport, Vmm, MIGRATION_CAPS,
};
use vmm_sys_util::eventfd::EventFd;

use super::Bar0;
use crate::gpu::commands::Command;
use crate::gpu::driver::Driver;
use crate::gpu::regs::IRQ_FENCE;
use crate::gpu::{Gpu, GpuConfig, BAR_FB};

/// Guest address of the guest RAM ([`serve_migrating`] maps it there).
pub const RAM_BASE: u64 = 1 << 30;
/// Guest RAM the scene uses: up to the end of the read-back surface.
pub const SCENE_RAM: usize = (5 << 20) + 4 * PAGE as usize;
/// The scene's mode.
pub const WIDTH: u32 = 1024;
/// The scene's mode.
pub const HEIGHT: u32 = 768;
/// The scene's mode: 4 bytes a pixel, so a framebuffer row is a 4 KiB page.
pub const STRIDE: u32 = WIDTH * 4;
/// The first GTT entry of the read-back surface (4 entries, writable).
pub const READBACK_GTT: u32 = 8;
/// The fewest frames a scene has (the read-back happens at `frames / 2 - 3`).
pub const MIN_FRAMES: u32 = 6;

const PAGE: u64 = 4096;
const RING: u64 = RAM_BASE;
const RING_SIZE: u32 = 64 * 1024;
/// The 32×32 sprite (one page, GTT entry 0).
const SPRITE: u64 = RAM_BASE + (4 << 20);
/// The read-back surface: 64×64 pixels in 4 pages.
const READBACK: u64 = RAM_BASE + (5 << 20);
/// How long a frame waits for its fence interrupt.
const IRQ_WAIT: Duration = Duration::from_secs(5);

/// Serve `dev` (through a [`PciAdapter`], with a fresh [`DmaSpace`]) on `socket` and connect
/// a VMM to it that negotiates [`MIGRATION_CAPS`] and has `ram_size` bytes of guest RAM at
/// [`RAM_BASE`].
pub fn serve_migrating(
    socket: &Path,
    dev: impl PciDevice + 'static,
    ram_size: usize,
) -> io::Result<(RunningServer, Vmm)> {
    let dev = PciAdapter::new(dev).map_err(io::Error::other)?;
    let server = Server::new(
        ServerConfig::new(socket),
        Box::new(dev),
        DmaSpace::new(DmaConfig::default()),
    )
    .spawn()
    .map_err(io::Error::other)?;
    let vmm = Vmm::connect_with_caps(socket, MIGRATION_CAPS)?.with_ram(RAM_BASE, ram_size)?;
    Ok((server, vmm))
}

/// [`serve_migrating`] for a GPU of `config`.
pub fn serve_gpu(
    socket: &Path,
    config: GpuConfig,
    ram_size: usize,
) -> io::Result<(RunningServer, Vmm)> {
    serve_migrating(socket, Gpu::new(config)?, ram_size)
}

/// The commands of frame `f` of a scene of `frames` frames (its last command is the fence
/// `f + 1`).
pub fn frame_commands(f: u32, frames: u32) -> Vec<Command> {
    let mut c = Vec::new();
    if f == 0 {
        c.push(Command::FillRect {
            x: 0,
            y: 0,
            w: WIDTH,
            h: HEIGHT,
            color: 0x0018_2838,
        });
        c.push(Command::FillRect {
            x: 20,
            y: 560,
            w: 984,
            h: 180,
            color: 0x0030_4860,
        });
    }
    // The moving box and the sprite: the small region redrawn every frame.
    c.push(Command::FillRect {
        x: 30 + f * 58,
        y: 80 + (f % 4) * 90,
        w: 40,
        h: 24,
        color: 0x00e0_4020 + f * 0x0000_0c08,
    });
    c.push(Command::Blit {
        gtt_index: 0,
        stride: 128,
        w: 32,
        h: 32,
        dst_x: 40 + f * 60,
        dst_y: 600,
    });
    if f == frames / 2 - 3 {
        // Read the first boxes back into guest RAM (device DMA) ...
        c.push(Command::Readback {
            src_x: 30,
            src_y: 80,
            w: 64,
            h: 64,
            gtt_index: READBACK_GTT,
            stride: 256,
        });
    }
    if f == frames - 3 {
        // ... and show them again, after the migration.
        c.push(Command::Blit {
            gtt_index: READBACK_GTT,
            stride: 256,
            w: 64,
            h: 64,
            dst_x: 900,
            dst_y: 460,
        });
    }
    c.push(Command::Fence { value: f + 1 });
    c
}

/// The guest drawing the scene: its GPU driver (ring position), its RAM, its interrupt
/// eventfd, the next frame and the fence interrupts it saw.
pub struct GpuGuest {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    irq: EventFd,
    frames: u32,
    frame: u32,
    interrupts: u64,
    require_interrupts: bool,
}

impl GpuGuest {
    /// Boot on `vmm` (its RAM must hold [`SCENE_RAM`] bytes): enable the device and MSI,
    /// set the mode, the ring, the fence interrupt and the GTT, put the sprite in RAM. The
    /// scene has `frames` frames (at least [`MIN_FRAMES`]).
    pub fn boot(mut vmm: Vmm, frames: u32) -> io::Result<GpuGuest> {
        if frames < MIN_FRAMES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a scene of {frames} frames (at least {MIN_FRAMES})"),
            ));
        }
        vmm.enable_device()?;
        let irq = vmm.enable_msi()?;
        let ram = vmm.ram().clone();
        let sprite: Vec<u8> = (0..32u32 * 32)
            .flat_map(|i| {
                let (x, y) = (i % 32, i / 32);
                let inside = (x as i32 - 16).pow(2) + (y as i32 - 16).pow(2) < 200;
                let px = if inside {
                    0x00f0_d040 | (x * 4) << 8
                } else {
                    0x0010_1010 + y
                };
                px.to_le_bytes()
            })
            .collect();
        ram.write(SPRITE, &sprite)?;
        let mut drv = Driver::probe(Bar0(vmm))?;
        drv.set_mode(WIDTH, HEIGHT, STRIDE)?;
        drv.setup_ring(RING, RING_SIZE)?;
        drv.enable_irqs(IRQ_FENCE)?;
        drv.set_gtt(0, SPRITE, false)?;
        for i in 0..4 {
            drv.set_gtt(READBACK_GTT + i, READBACK + u64::from(i) * PAGE, true)?;
        }
        Ok(GpuGuest {
            drv,
            ram,
            irq,
            frames,
            frame: 0,
            interrupts: 0,
            require_interrupts: false,
        })
    }

    /// Make a frame whose fence interrupt does not come (within 5 s) an error
    /// (`TimedOut`); by default it is only not counted.
    pub fn require_interrupts(mut self) -> GpuGuest {
        self.require_interrupts = true;
        self
    }

    /// Draw the next frame, wait for its fence and (up to 5 s) its interrupt, acknowledge
    /// the interrupt.
    pub fn frame(&mut self) -> io::Result<()> {
        let f = self.frame;
        let mut ram = self.ram.clone();
        self.drv.submit(&mut ram, &frame_commands(f, self.frames))?;
        self.drv.wait_fence(f + 1)?;
        match wait_eventfd(&self.irq, IRQ_WAIT) {
            Some(n) => self.interrupts += n,
            None if self.require_interrupts => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no fence interrupt for frame {f}"),
                ))
            }
            None => {}
        }
        self.drv.ack(IRQ_FENCE)?;
        self.frame += 1;
        Ok(())
    }

    /// Draw frames until the next one is `frame` (none if it is already there).
    pub fn draw_until(&mut self, frame: u32) -> io::Result<()> {
        while self.frame < frame {
            self.frame()?;
        }
        Ok(())
    }

    /// Draw the rest of the scene.
    pub fn finish(&mut self) -> io::Result<()> {
        self.draw_until(self.frames)
    }

    /// The next frame to draw (the number drawn so far).
    pub fn next_frame(&self) -> u32 {
        self.frame
    }

    /// Fence interrupts seen so far.
    pub fn interrupts(&self) -> u64 {
        self.interrupts
    }

    /// The guest's interrupt eventfd (MSI vector 0).
    pub fn irq(&self) -> &EventFd {
        &self.irq
    }

    /// The VMM the guest runs on.
    pub fn vmm(&mut self) -> &mut Vmm {
        &mut self.drv.regs().0
    }

    /// The whole framebuffer, read through BAR2's mapping.
    pub fn framebuffer(&mut self) -> io::Result<Vec<u8>> {
        let fb = self.vmm().map_region(BAR_FB as u32)?;
        let mut out = vec![0u8; fb.len()];
        fb.read(0, &mut out)?;
        Ok(out)
    }

    /// Continue on `vmm` (the destination's, with the copied RAM); `vmm` gets the old one.
    fn move_to(&mut self, vmm: &mut Vmm) {
        std::mem::swap(self.vmm(), vmm);
        self.ram = self.vmm().ram().clone();
    }
}

/// Draw the source's half of the scene and move the guest to `dst` during it: the frames
/// before the migration; [`Migration::start`]; `rounds` times a frame and a round; the last
/// frame of the half (STOP_COPY carries it); [`Migration::stop_copy`]; the guest's eventfd
/// attached to the destination's MSI vector 0; [`Migration::resume_destination`]. On
/// return the guest runs on `dst`'s connection (at frame `frames / 2`) and `dst` holds the
/// stopped source's. A failing frame or attach aborts the migration
/// ([`MigrateError::Guest`], as [`umdev::testing::migrate`] does), and so does a frame
/// before the migration (nothing to abort then).
pub fn migrate_mid_scene(
    guest: &mut GpuGuest,
    dst: &mut Vmm,
    pre_copy: bool,
    rounds: usize,
) -> Result<MigrationReport, MigrateError> {
    let half = guest.frames / 2;
    let before = u32::try_from(rounds)
        .ok()
        .and_then(|r| half.checked_sub(r.checked_add(1)?))
        .ok_or_else(|| {
            MigrateError::Guest(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{rounds} rounds in a half of {half} frames"),
            ))
        })?;
    guest.draw_until(before).map_err(MigrateError::Guest)?;
    let opts = MigrateOptions {
        pre_copy,
        max_rounds: rounds,
        small_round_bytes: 0,
    };
    let mut m = Migration::start(guest.vmm(), dst, &opts)?;
    for _ in 0..rounds {
        if let Err(e) = guest.frame() {
            return Err(abort(m, guest.vmm(), dst, e));
        }
        m.round(guest.vmm(), dst)?;
    }
    if let Err(e) = guest.frame() {
        return Err(abort(m, guest.vmm(), dst, e));
    }
    m.stop_copy(guest.vmm(), dst)?;
    // The guest's interrupt goes on to the destination: the same eventfd.
    if let Err(e) = dst.set_irq_eventfd(irq_index::MSI, 0, &guest.irq) {
        return Err(abort(m, guest.vmm(), dst, e));
    }
    let report = m.resume_destination(guest.vmm(), dst)?;
    guest.move_to(dst);
    Ok(report)
}

/// Abort `m` after the guest's `cause`.
fn abort(m: Migration, src: &mut Vmm, dst: &mut Vmm, cause: io::Error) -> MigrateError {
    let cause = MigrateError::Guest(cause);
    match m.abort(src, dst) {
        Ok(()) => cause,
        Err(rollback) => MigrateError::RollbackFailed {
            cause: Box::new(cause),
            rollback,
        },
    }
}
