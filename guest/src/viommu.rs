//! The GPU behind a virtual IOMMU (QEMU `intel-iommu,caching-mode=on`, guest
//! `intel_iommu=on`), driven through the guest's VFIO type1 API ([`crate::vfio`]).
//!
//! Every VFIO_IOMMU_MAP_DMA/UNMAP_DMA here makes the guest kernel write the vIOMMU's page
//! tables and invalidate; caching mode makes QEMU see each invalidation and forward it to
//! the umdev server as vfio-user DMA_MAP/DMA_UNMAP. So what the device can reach is exactly
//! what this program mapped, at the IOVAs it chose.
//!
//! Phase 1 (a fresh QEMU): READBACK through the GTT into mapped buffers, a FENCE interrupt
//! on an eventfd (MSI-X, else MSI); VFIO_IOMMU_UNMAP_DMA of a READBACK target while the
//! device holds its GTT pins (the next READBACK must fault, the old buffer stay untouched,
//! a new buffer at the same IOVA must get the data); map/unmap churn with GPU work in
//! between; then it maps and pins more and reboots the guest **without unmapping**.
//!
//! Phase 2 (the same QEMU after the reboot; the scenario runs again from /init): maps new
//! buffers at the IOVAs that were live at the reboot; the data of a READBACK must land in
//! the new buffers, and an IOVA this boot never mapped must fault. A server that kept the
//! old boot's mappings (an unmap semantics QEMU's sweeps do not fit) refuses the new
//! DMA_MAPs with EEXIST, which QEMU only logs, and the device keeps writing the old
//! boot's pages while the guest sees success: this phase fails then.
//!
//! The phases are told apart by a byte of CMOS NVRAM ([`MARKER_INDEX`]) read and written
//! through `/dev/port`: it survives a guest reset (QEMU's RTC reset keeps the NVRAM) but
//! starts as 0 in a fresh QEMU. Phase 2 clears it first, so it never reboots again.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::error::ERR_GTT_FAULT;
use umdev_devices::gpu::regs::{
    IRQ_ERROR, IRQ_FENCE, REG_ERROR_CODE, REG_ERROR_COUNT, REG_FENCE_VALUE, REG_IRQ_STATUS,
    REG_RING_CTRL,
};
use umdev_devices::gpu::Command;
use vfio_bindings::bindings::vfio::{
    VFIO_DEVICE_FLAGS_PCI, VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX,
};

use crate::mem::{DmaBuf, Ram, PAGE};
use crate::pci::{command, PciDev};
use crate::report::Report;
use crate::vfio::{Bar, Container, Device, EventFd, Group};

const VENDOR: u16 = 0x1234;
const DEVICE: u16 = 0x5547;

// IOVAs, chosen above the guest's RAM (512 MiB) and the 32-bit PCI hole: while translation
// is off during the reboot, QEMU maps guest RAM at IOVA = GPA, which must not collide with
// these, so that phase 2 tests the stale vIOMMU mappings and nothing else.
/// The ring of phase 1.
const IOVA_RING1: u64 = 0x1_0000_0000;
/// The ring of phase 2 (a fresh IOVA: the ring must work for phase 2 to see where the
/// READBACK data goes).
const IOVA_RING2: u64 = 0x1_0800_0000;
/// Surface A (unmapped while pinned, then remapped with a new buffer).
const IOVA_A: u64 = 0x1_1000_0000;
/// Surface B.
const IOVA_B: u64 = 0x1_1010_0000;
/// The churn surface.
const IOVA_CHURN: u64 = 0x1_2000_0000;
/// The surfaces mapped and pinned only for the reboot (each [`SURF_PAGES`]).
const IOVA_R: u64 = 0x1_3000_0000;
/// Number of reboot surfaces, 64 KiB apart from [`IOVA_R`].
const R_SURFACES: u32 = 4;
/// A page only phase 1 maps (as the ring): phase 2 READBACKs into it and expects a fault.
const IOVA_STALE: u64 = IOVA_RING1;

const RING_PAGES: usize = 16;
/// Surfaces: 256 × 16 XRGB8888 pixels, rows 1 KiB apart: 4 pages, 4 GTT entries.
const SURF_W: u32 = 256;
const SURF_H: u32 = 16;
const STRIDE: u32 = 1024;
const SURF_PAGES: usize = (STRIDE * SURF_H) as usize / PAGE;

const GTT_A: u32 = 0;
const GTT_B: u32 = 4;
const GTT_CHURN: u32 = 8;
const GTT_R: u32 = 12;
const GTT_STALE: u32 = GTT_R + R_SURFACES * SURF_PAGES as u32;

const CHURN_CYCLES: u32 = 200;
const CHURN_BUDGET: Duration = Duration::from_secs(45);
const FENCE_TIMEOUT: Duration = Duration::from_secs(5);

/// CMOS NVRAM byte used as the phase marker: QEMU's PC code and SeaBIOS use 0x0f–0x3d and
/// 0x5b–0x5f; 0x40–0x5a are free.
const MARKER_INDEX: u8 = 0x48;
/// Marker value: phase 1 rebooted on purpose.
const MARKER_REBOOTED: u8 = 0xa5;

/// CMOS NVRAM through `/dev/port` (index port 0x70, data port 0x71; bit 7 of the index is
/// NMI disable and stays clear).
struct Cmos {
    port: File,
}

impl Cmos {
    fn open() -> io::Result<Cmos> {
        let port = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/port")
            .map_err(|e| io::Error::new(e.kind(), format!("/dev/port: {e}")))?;
        Ok(Cmos { port })
    }

    fn read(&self, index: u8) -> io::Result<u8> {
        self.port.write_all_at(&[index & 0x7f], 0x70)?;
        let mut b = [0u8];
        self.port.read_exact_at(&mut b, 0x71)?;
        Ok(b[0])
    }

    /// Write and read back.
    fn write(&self, index: u8, value: u8) -> io::Result<()> {
        self.port.write_all_at(&[index & 0x7f], 0x70)?;
        self.port.write_all_at(&[value], 0x71)?;
        let got = self.read(index)?;
        if got != value {
            return Err(io::Error::other(format!(
                "CMOS byte {index:#x} reads {got:#x} after writing {value:#x}"
            )));
        }
        Ok(())
    }
}

/// A READBACK destination: a buffer mapped at `iova`, reached through GTT entries from `gtt`.
struct Surface {
    name: String,
    buf: DmaBuf,
    iova: u64,
    gtt: u32,
}

impl Surface {
    fn new(name: &str, iova: u64, gtt: u32) -> io::Result<Surface> {
        Ok(Surface {
            name: name.to_string(),
            buf: DmaBuf::at_iova(SURF_PAGES, iova)?,
            iova,
            gtt,
        })
    }
}

/// The color of pixel (x, y) of pattern `seed`: 4 × 4 blocks of distinct colors.
fn pattern(seed: u32, x: u32, y: u32) -> u32 {
    let block = (y / (SURF_H / 4)) * 4 + x / (SURF_W / 4);
    (seed.wrapping_mul(0x9e37_79b1) ^ block.wrapping_mul(0x0001_0203)) & 0x00ff_ffff
}

/// FILL_RECTs that draw pattern `seed` into the framebuffer rectangle (0, 0, SURF_W, SURF_H).
fn draw(seed: u32) -> Vec<Command> {
    let (bw, bh) = (SURF_W / 4, SURF_H / 4);
    (0..16)
        .map(|b| Command::FillRect {
            x: (b % 4) * bw,
            y: (b / 4) * bh,
            w: bw,
            h: bh,
            color: pattern(seed, (b % 4) * bw, (b / 4) * bh),
        })
        .collect()
}

/// READBACK of the pattern rectangle into the surface at GTT entry `gtt`.
fn readback(gtt: u32) -> Command {
    Command::Readback {
        src_x: 0,
        src_y: 0,
        w: SURF_W,
        h: SURF_H,
        gtt_index: gtt,
        stride: STRIDE,
    }
}

/// Does `buf` hold pattern `seed` (or zeros for None)? Err: the first differing pixel.
fn expect(buf: &DmaBuf, seed: Option<u32>) -> Result<(), String> {
    let mut bytes = vec![0u8; buf.len()];
    buf.read_at(0, &mut bytes).map_err(|e| e.to_string())?;
    for y in 0..SURF_H {
        for x in 0..SURF_W {
            let off = (y * STRIDE + 4 * x) as usize;
            let got =
                u32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]]);
            let want = seed.map_or(0, |s| pattern(s, x, y));
            if got != want {
                return Err(format!("pixel ({x},{y}) = {got:#08x}, want {want:#08x}"));
            }
        }
    }
    Ok(())
}

/// One check over several buffers: passes if all hold what they should; the detail names
/// each that does not.
fn buffers_check(r: &mut Report, name: &str, errors: u32, results: &[(&str, Result<(), String>)]) {
    let bad: Vec<String> = results
        .iter()
        .filter_map(|(b, res)| res.as_ref().err().map(|e| format!("{b}: {e}")))
        .collect();
    let names: Vec<&str> = results.iter().map(|(b, _)| *b).collect();
    r.check(
        name,
        errors == 0 && bad.is_empty(),
        format_args!(
            "{errors} device errors; {}",
            if bad.is_empty() {
                format!("{} as expected", names.join(", "))
            } else {
                bad.join("; ")
            }
        ),
    );
}

/// What one submission ended with.
struct Done {
    /// Interrupts that arrived on the eventfd while waiting.
    irqs: u64,
    /// IRQ_STATUS before the ack.
    status: u32,
    /// ERROR_COUNT increase.
    errors: u32,
    /// ERROR_CODE.
    code: u32,
}

/// The GPU bound to vfio-pci, with its container, BAR0 driver and interrupt eventfd.
struct Gpu {
    container: Container,
    _group: Group,
    dev: Device,
    drv: Driver<Bar>,
    irq: EventFd,
    irq_index: u32,
    fence: u32,
}

impl Gpu {
    /// Bind the GPU to vfio-pci and set everything up to the point of mapping memory.
    fn open(r: &mut Report, p: &str) -> Option<Gpu> {
        let pci = r.ok(&format!("{p}find"), PciDev::find(VENDOR, DEVICE))?;
        let group = r.ok(&format!("{p}iommu_group"), pci.iommu_group())?;
        r.ok(&format!("{p}bind_vfio_pci"), pci.bind("vfio-pci"))?;
        let container = r.ok(&format!("{p}container"), Container::open())?;
        let grp = r.ok(&format!("{p}group"), Group::open(group))?;
        r.ok(&format!("{p}set_container"), grp.set_container(&container))?;
        r.ok(&format!("{p}type1v2"), container.set_type1v2())?;
        if let Ok((flags, pgsizes)) = container.iommu_info() {
            r.note(format_args!(
                "{} in IOMMU group {group}; type1 flags {flags:#x} iova_pgsizes {pgsizes:#x}",
                pci.bdf
            ));
        }
        let dev = r.ok(&format!("{p}device_fd"), grp.device(&pci.bdf))?;
        let info = r.ok(&format!("{p}device_info"), dev.info())?;
        r.check(
            &format!("{p}device_is_pci"),
            info.flags & VFIO_DEVICE_FLAGS_PCI != 0 && info.num_regions > 7,
            format_args!("flags {:#x}, {} regions", info.flags, info.num_regions),
        );
        let cmd = r.ok(
            &format!("{p}enable_mem_bme"),
            dev.update_command(command::MEMORY | command::BUS_MASTER, 0),
        )?;
        let want = command::MEMORY | command::BUS_MASTER;
        if !r.check(
            &format!("{p}command"),
            cmd & want == want,
            format_args!("command register {cmd:#06x}"),
        ) {
            return None;
        }
        let bar0 = r.ok(
            &format!("{p}bar0_info"),
            dev.region(VFIO_PCI_BAR0_REGION_INDEX),
        )?;
        let bar = r.ok(&format!("{p}bar0"), dev.bar(bar0))?;
        r.note(format_args!(
            "BAR0: {:#x} bytes at fd offset {:#x}, flags {:#x}, registers through {}",
            bar0.size,
            bar0.offset,
            bar0.flags,
            bar.how()
        ));
        let mut drv = r.ok(&format!("{p}probe"), Driver::probe(bar))?;
        let irq = r.ok(&format!("{p}eventfd"), EventFd::new())?;
        let mut irq_index = None;
        for index in [VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX] {
            if dev.irq_info(index).is_ok_and(|(_, n)| n >= 1)
                && dev.set_irq_eventfd(index, &irq).is_ok()
            {
                irq_index = Some(index);
                break;
            }
        }
        let irq_index = irq_index.unwrap_or(u32::MAX);
        if !r.check(
            &format!("{p}irq_eventfd"),
            irq_index != u32::MAX,
            match irq_index {
                VFIO_PCI_MSIX_IRQ_INDEX => "MSI-X vector 0 -> eventfd",
                VFIO_PCI_MSI_IRQ_INDEX => "MSI -> eventfd (no MSI-X)",
                _ => "neither MSI-X nor MSI could be routed to an eventfd",
            },
        ) {
            return None;
        }
        r.ok(&format!("{p}mode"), drv.set_mode(SURF_W, SURF_H, STRIDE))?;
        r.ok(
            &format!("{p}irq_enable"),
            drv.enable_irqs(IRQ_FENCE | IRQ_ERROR),
        )?;
        Some(Gpu {
            container,
            _group: grp,
            dev,
            drv,
            irq,
            irq_index,
            fence: 0,
        })
    }

    fn map(&self, buf: &DmaBuf, iova: u64) -> io::Result<()> {
        self.container.map_dma(buf.vaddr(), iova, buf.len() as u64)
    }

    /// Unmap `[iova, iova + len)`; an error unless the kernel unmapped exactly `len` bytes.
    fn unmap(&self, iova: u64, len: usize) -> io::Result<()> {
        let n = self.container.unmap_dma(iova, len as u64)?;
        if n != len as u64 {
            return Err(io::Error::other(format!(
                "VFIO_IOMMU_UNMAP_DMA iova={iova:#x} unmapped {n:#x} bytes, want {len:#x}"
            )));
        }
        Ok(())
    }

    /// Point the [`SURF_PAGES`] GTT entries from `gtt` at the pages from `iova` (writable).
    fn set_gtt(&mut self, gtt: u32, iova: u64) -> io::Result<()> {
        for k in 0..SURF_PAGES {
            self.drv
                .set_gtt(gtt + k as u32, iova + (k * PAGE) as u64, true)?;
        }
        Ok(())
    }

    /// Submit `cmds` and a FENCE, wait for the fence on the eventfd, ack what is pending.
    fn run(&mut self, ram: &mut Ram<'_>, mut cmds: Vec<Command>) -> io::Result<Done> {
        let errors0 = self.drv.read(REG_ERROR_COUNT)?;
        self.fence = self.fence.wrapping_add(1);
        let value = self.fence;
        cmds.push(Command::Fence { value });
        self.drv.submit(ram, &cmds)?;
        let deadline = Instant::now() + FENCE_TIMEOUT;
        let mut irqs = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            irqs += self.irq.wait(left)?;
            if self.drv.read(REG_FENCE_VALUE)? == value {
                break;
            }
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("fence {value} not reached in {FENCE_TIMEOUT:?} ({irqs} interrupts)"),
                ));
            }
        }
        let status = self.drv.read(REG_IRQ_STATUS)?;
        let errors = self.drv.read(REG_ERROR_COUNT)?.wrapping_sub(errors0);
        let code = self.drv.read(REG_ERROR_CODE)?;
        self.drv.ack(status)?;
        Ok(Done {
            irqs,
            status,
            errors,
            code,
        })
    }
}

/// The surfaces mapped and pinned for the reboot (phase 1) and mapped again after it
/// (phase 2), at the same IOVAs: R0, R1, ... 64 KiB apart from [`IOVA_R`].
fn reboot_surfaces() -> io::Result<Vec<Surface>> {
    (0..R_SURFACES)
        .map(|k| {
            Surface::new(
                &format!("R{k}"),
                IOVA_R + u64::from(k) * 0x1_0000,
                GTT_R + k * SURF_PAGES as u32,
            )
        })
        .collect()
}

/// Map `s` at its IOVA and point its GTT entries at it.
fn attach(gpu: &mut Gpu, s: &Surface) -> io::Result<()> {
    gpu.map(&s.buf, s.iova)?;
    gpu.set_gtt(s.gtt, s.iova)
}

/// Map, pin, unmap while pinned, remap, churn, reboot with live mappings (phase 1); after
/// the reboot: the same IOVAs with new buffers (phase 2).
pub fn run(r: &mut Report) -> Option<()> {
    let cmos = r.ok("gpu_viommu.cmos_open", Cmos::open())?;
    let marker = r.ok("gpu_viommu.cmos_read", cmos.read(MARKER_INDEX))?;
    if marker == MARKER_REBOOTED {
        r.note("phase 2: the guest rebooted with live VFIO mappings");
        r.ok("gpu_viommu.p2.marker_clear", cmos.write(MARKER_INDEX, 0))?;
        phase2(r)
    } else {
        r.check(
            "gpu_viommu.marker_fresh",
            marker == 0,
            format_args!("CMOS byte {MARKER_INDEX:#x} = {marker:#x} in a fresh QEMU"),
        );
        phase1(r, &cmos)
    }
}

fn phase1(r: &mut Report, cmos: &Cmos) -> Option<()> {
    let mut gpu = Gpu::open(r, "gpu_viommu.")?;
    let ring = r.ok(
        "gpu_viommu.ring_alloc",
        DmaBuf::at_iova(RING_PAGES, IOVA_RING1),
    )?;
    r.ok("gpu_viommu.ring_map", gpu.map(&ring, IOVA_RING1))?;
    r.ok(
        "gpu_viommu.ring_setup",
        gpu.drv.setup_ring(IOVA_RING1, ring.len() as u32),
    )?;
    let a = r.ok("gpu_viommu.alloc", Surface::new("A", IOVA_A, GTT_A))?;
    let b = r.ok("gpu_viommu.alloc", Surface::new("B", IOVA_B, GTT_B))?;
    let t = Instant::now();
    r.ok("gpu_viommu.map_a", attach(&mut gpu, &a))?;
    let map_us = t.elapsed().as_secs_f64() * 1e6;
    r.ok("gpu_viommu.map_b", attach(&mut gpu, &b))?;
    r.measure("map_4_pages_us", map_us, "us");

    // READBACK through the GTT into two buffers; a FENCE interrupt on the eventfd.
    {
        let mut ram = Ram(vec![&ring]);
        let mut cmds = draw(1);
        cmds.push(readback(GTT_A));
        cmds.extend(draw(2));
        cmds.push(readback(GTT_B));
        let done = r.ok("gpu_viommu.readback_run", gpu.run(&mut ram, cmds))?;
        r.check(
            "gpu_viommu.fence_irq",
            done.irqs >= 1 && done.status & IRQ_FENCE != 0,
            format_args!(
                "{} interrupt(s) on the eventfd, IRQ_STATUS {:#x}",
                done.irqs, done.status
            ),
        );
        buffers_check(
            r,
            "gpu_viommu.readback_data",
            done.errors,
            &[
                ("A", expect(&a.buf, Some(1))),
                ("B", expect(&b.buf, Some(2))),
            ],
        );
    }

    // Unmap A while the device holds its GTT pins: the next READBACK into A faults, the
    // old buffer stays untouched, B still works.
    let t = Instant::now();
    r.ok("gpu_viommu.unmap_pinned", gpu.unmap(IOVA_A, a.buf.len()))?;
    r.measure(
        "unmap_pinned_4_pages_us",
        t.elapsed().as_secs_f64() * 1e6,
        "us",
    );
    {
        let mut ram = Ram(vec![&ring]);
        let mut cmds = draw(3);
        cmds.push(readback(GTT_A));
        cmds.extend(draw(4));
        cmds.push(readback(GTT_B));
        let done = r.ok("gpu_viommu.after_unmap_run", gpu.run(&mut ram, cmds))?;
        r.check(
            "gpu_viommu.after_unmap_gtt_fault",
            done.errors == 1 && done.code == ERR_GTT_FAULT && done.status & IRQ_ERROR != 0,
            format_args!(
                "{} errors, ERROR_CODE {} (GTT_FAULT = {ERR_GTT_FAULT}), IRQ_STATUS {:#x}",
                done.errors, done.code, done.status
            ),
        );
        buffers_check(
            r,
            "gpu_viommu.after_unmap_old_untouched",
            0,
            &[("unmapped A (old contents)", expect(&a.buf, Some(1)))],
        );
        buffers_check(
            r,
            "gpu_viommu.after_unmap_other_works",
            0,
            &[("B (new contents)", expect(&b.buf, Some(4)))],
        );
    }

    // New memory at the same IOVA: the READBACK writes the new buffer, not the old one.
    let a2 = r.ok("gpu_viommu.alloc", Surface::new("A'", IOVA_A, GTT_A))?;
    r.ok("gpu_viommu.remap", gpu.map(&a2.buf, IOVA_A))?;
    {
        let mut ram = Ram(vec![&ring]);
        let mut cmds = draw(5);
        cmds.push(readback(GTT_A));
        let done = r.ok("gpu_viommu.remap_run", gpu.run(&mut ram, cmds))?;
        buffers_check(
            r,
            "gpu_viommu.remap_new_buffer",
            done.errors,
            &[("new A' (new contents)", expect(&a2.buf, Some(5)))],
        );
        buffers_check(
            r,
            "gpu_viommu.remap_old_untouched",
            0,
            &[("old A (old contents)", expect(&a.buf, Some(1)))],
        );
    }
    drop(a);

    churn(r, &mut gpu, &ring)?;

    // Map and pin more, then reboot without unmapping anything.
    let rs = r.ok("gpu_viommu.alloc", reboot_surfaces())?;
    for s in &rs {
        r.ok("gpu_viommu.reboot_map", attach(&mut gpu, s))?;
    }
    {
        let mut ram = Ram(vec![&ring]);
        let mut cmds = Vec::new();
        for (k, s) in rs.iter().enumerate() {
            cmds.extend(draw(100 + k as u32));
            cmds.push(readback(s.gtt));
        }
        let done = r.ok("gpu_viommu.reboot_pin_run", gpu.run(&mut ram, cmds))?;
        let results: Vec<(&str, Result<(), String>)> = rs
            .iter()
            .enumerate()
            .map(|(k, s)| (s.name.as_str(), expect(&s.buf, Some(100 + k as u32))))
            .collect();
        buffers_check(r, "gpu_viommu.reboot_pinned", done.errors, &results);
    }
    let live_pages = RING_PAGES + SURF_PAGES * (2 + R_SURFACES as usize);
    r.ok(
        "gpu_viommu.marker_set",
        cmos.write(MARKER_INDEX, MARKER_REBOOTED),
    )?;
    r.note(format_args!(
        "rebooting with {} live VFIO mappings ({live_pages} pages: ring, A', B, R0..R{}), \
         GTT pins held",
        3 + R_SURFACES,
        R_SURFACES - 1
    ));
    // The mappings, the pins and the container (everything above, still in scope) stay
    // alive until the reset.
    // SAFETY: sync and reboot; nothing is left to clean up in this guest.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    let e = io::Error::last_os_error();
    r.check(
        "gpu_viommu.reboot",
        false,
        format_args!("reboot(RB_AUTOBOOT): {e}"),
    );
    let _ = cmos.write(MARKER_INDEX, 0);
    drop((ring, a2, b, rs, gpu));
    None
}

/// Many map/unmap cycles with a READBACK in each: two buffers take turns at one IOVA.
fn churn(r: &mut Report, gpu: &mut Gpu, ring: &DmaBuf) -> Option<()> {
    let bufs = [
        r.ok("gpu_viommu.alloc", DmaBuf::at_iova(SURF_PAGES, IOVA_CHURN))?,
        r.ok("gpu_viommu.alloc", DmaBuf::at_iova(SURF_PAGES, IOVA_CHURN))?,
    ];
    r.ok("gpu_viommu.churn_gtt", gpu.set_gtt(GTT_CHURN, IOVA_CHURN))?;
    let mut last: [Option<u32>; 2] = [None, None];
    let (mut t_map, mut t_unmap, mut t_gpu) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut irqs = 0;
    let mut failure = None;
    let start = Instant::now();
    let mut cycles = 0;
    while cycles < CHURN_CYCLES && start.elapsed() < CHURN_BUDGET {
        let k = (cycles % 2) as usize;
        let seed = 1000 + cycles;
        let t = Instant::now();
        if let Err(e) = gpu.map(&bufs[k], IOVA_CHURN) {
            failure = Some(format!("cycle {cycles}: {e}"));
            break;
        }
        let t1 = Instant::now();
        let mut ram = Ram(vec![ring]);
        let mut cmds = draw(seed);
        cmds.push(readback(GTT_CHURN));
        let done = gpu.run(&mut ram, cmds);
        let t2 = Instant::now();
        let unmapped = gpu.unmap(IOVA_CHURN, bufs[k].len());
        let t3 = Instant::now();
        t_map += t1 - t;
        t_gpu += t2 - t1;
        t_unmap += t3 - t2;
        let verdict = done
            .map_err(|e| e.to_string())
            .and_then(|d| {
                irqs += d.irqs;
                if d.errors == 0 {
                    Ok(())
                } else {
                    Err(format!("{} errors, ERROR_CODE {}", d.errors, d.code))
                }
            })
            .and_then(|()| expect(&bufs[k], Some(seed)).map_err(|e| format!("mapped buffer: {e}")))
            .and_then(|()| {
                expect(&bufs[1 - k], last[1 - k]).map_err(|e| format!("other buffer: {e}"))
            })
            .and_then(|()| unmapped.map_err(|e| e.to_string()));
        if let Err(e) = verdict {
            failure = Some(format!("cycle {cycles}: {e}"));
            break;
        }
        last[k] = Some(seed);
        cycles += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    r.check(
        "gpu_viommu.churn",
        failure.is_none() && cycles >= 20,
        match &failure {
            Some(f) => f.clone(),
            None => format!("{cycles} map/READBACK/unmap cycles in {secs:.1} s, {irqs} interrupts"),
        },
    );
    r.check(
        "gpu_viommu.churn_irqs",
        irqs >= u64::from(cycles),
        format_args!("{irqs} interrupts for {cycles} fences"),
    );
    if cycles > 0 {
        let n = f64::from(cycles);
        r.measure("churn_cycles_per_s", n / secs, "cycle/s");
        r.measure("churn_map_us", t_map.as_secs_f64() * 1e6 / n, "us");
        r.measure("churn_gpu_us", t_gpu.as_secs_f64() * 1e6 / n, "us");
        r.measure("churn_unmap_us", t_unmap.as_secs_f64() * 1e6 / n, "us");
    }
    failure.is_none().then_some(())
}

/// After the reboot: new buffers at the IOVAs that were live at the reboot.
fn phase2(r: &mut Report) -> Option<()> {
    let mut gpu = Gpu::open(r, "gpu_viommu.p2.")?;
    let ring = r.ok(
        "gpu_viommu.p2.ring_alloc",
        DmaBuf::at_iova(RING_PAGES, IOVA_RING2),
    )?;
    r.ok("gpu_viommu.p2.ring_map", gpu.map(&ring, IOVA_RING2))?;
    r.ok(
        "gpu_viommu.p2.ring_setup",
        gpu.drv.setup_ring(IOVA_RING2, ring.len() as u32),
    )?;
    let mut surfaces = vec![
        r.ok("gpu_viommu.p2.alloc", Surface::new("A", IOVA_A, GTT_A))?,
        r.ok("gpu_viommu.p2.alloc", Surface::new("B", IOVA_B, GTT_B))?,
    ];
    surfaces.extend(r.ok("gpu_viommu.p2.alloc", reboot_surfaces())?);
    let mut map_err = None;
    for s in &surfaces {
        if let Err(e) = attach(&mut gpu, s) {
            map_err = Some(format!("{} at {:#x}: {e}", s.name, s.iova));
            break;
        }
    }
    if !r.check(
        "gpu_viommu.p2.map_same_iovas",
        map_err.is_none(),
        map_err
            .as_deref()
            .unwrap_or("the IOVAs live at the reboot mapped again"),
    ) {
        return None;
    }
    {
        let mut ram = Ram(vec![&ring]);
        let mut cmds = Vec::new();
        for (k, s) in surfaces.iter().enumerate() {
            cmds.extend(draw(200 + k as u32));
            cmds.push(readback(s.gtt));
        }
        let done = r.ok("gpu_viommu.p2.readback_run", gpu.run(&mut ram, cmds))?;
        r.check(
            "gpu_viommu.p2.fence_irq",
            done.irqs >= 1 && done.status & IRQ_FENCE != 0,
            format_args!("{} interrupt(s), IRQ_STATUS {:#x}", done.irqs, done.status),
        );
        let results: Vec<(&str, Result<(), String>)> = surfaces
            .iter()
            .enumerate()
            .map(|(k, s)| (s.name.as_str(), expect(&s.buf, Some(200 + k as u32))))
            .collect();
        buffers_check(
            r,
            "gpu_viommu.p2.readback_lands_in_new_buffers",
            done.errors,
            &results,
        );
    }
    // An IOVA only the previous boot mapped: this boot's IOMMU has nothing there, so the
    // device must fault (a stale server mapping would let it write the old boot's page).
    {
        r.ok(
            "gpu_viommu.p2.stale_gtt",
            gpu.drv.set_gtt(GTT_STALE, IOVA_STALE, true),
        )?;
        let mut ram = Ram(vec![&ring]);
        let mut cmds = draw(300);
        cmds.push(Command::Readback {
            src_x: 0,
            src_y: 0,
            w: SURF_W,
            h: (PAGE as u32) / STRIDE,
            gtt_index: GTT_STALE,
            stride: STRIDE,
        });
        let done = r.ok("gpu_viommu.p2.stale_run", gpu.run(&mut ram, cmds))?;
        r.check(
            "gpu_viommu.p2.stale_iova_faults",
            done.errors == 1 && done.code == ERR_GTT_FAULT,
            format_args!(
                "READBACK to {:#x} (mapped only before the reboot): {} errors, ERROR_CODE {}",
                IOVA_STALE, done.errors, done.code
            ),
        );
    }
    // Clean up: GTT, mappings, interrupts.
    r.ok(
        "gpu_viommu.p2.clear_gtt",
        gpu.drv.clear_gtt(0, GTT_STALE + 1),
    )?;
    let mut unmap_err = None;
    for s in &surfaces {
        if let Err(e) = gpu.unmap(s.iova, s.buf.len()) {
            unmap_err.get_or_insert(e.to_string());
        }
    }
    if let Err(e) = gpu.drv.write(REG_RING_CTRL, 0) {
        unmap_err.get_or_insert(e.to_string());
    }
    if let Err(e) = gpu.unmap(IOVA_RING2, ring.len()) {
        unmap_err.get_or_insert(e.to_string());
    }
    r.check(
        "gpu_viommu.p2.unmap_all",
        unmap_err.is_none(),
        unmap_err.as_deref().unwrap_or("every mapping removed"),
    );
    r.ok("gpu_viommu.p2.irq_off", gpu.dev.disable_irqs(gpu.irq_index))?;
    Some(())
}
