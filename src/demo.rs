//! `umdev demo`: start an example device and drive it with the embedded VMM (memfd guest
//! RAM, DMA_MAP, register writes, MSI), so a newcomer sees it work without QEMU; `umdev demo
//! migrate` moves running devices between two servers (`demo_migrate.rs`).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use umdev::device::Device;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::pci::PciAdapter;
use umdev::server::{RunningServer, Server, ServerConfig};
use umdev::testing::{wait_eventfd, DeviceAccess, Vmm};
use umdev_devices::ccw::driver::{self as ccw, regs as ccw_regs, CcwWord};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::commands::Command as GpuCmd;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::{GTT_ENTRIES, IRQ_FENCE};
use umdev_devices::gpu::{Gpu, GpuConfig, BAR_FB};
use umdev_devices::testing::{run_ccw_program, Bar0};

use crate::CliResult;

/// What `umdev demo` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoKind {
    /// The GPU: mode, GTT, ring, fence MSI; the framebuffer as a PNG.
    Gpu,
    /// The ccw device: channel programs writing and reading an image.
    Ccw,
    /// Live migration: a GPU scene drawn half before and half after moving the running
    /// GPU to a second server (with and without PRE_COPY), compared pixel by pixel with the
    /// scene drawn without migration; a ccw data set written across a migration read back;
    /// a table of rounds, bytes, STOP_COPY and downtime. Exit status 1 on any mismatch.
    Migrate,
}

/// Arguments of `umdev demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// What to demo.
    pub device: DemoKind,
    /// Where the GPU demo writes its framebuffer.
    #[arg(long, value_name = "FILE", default_value = "gpu-demo.png")]
    pub out: PathBuf,
    /// Where the migrate demo writes migrate-reference.png and migrate-destination.png.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub out_dir: PathBuf,
    /// Backing image for the ccw and migrate demos (default: a temporary file).
    #[arg(long, value_name = "FILE")]
    pub image: Option<PathBuf>,
}

/// Guest physical address of the demo's guest RAM.
const RAM_BASE: u64 = 1 << 30;
const RAM_SIZE: usize = 16 << 20;
const PAGE: u64 = 4096;

/// Entry point.
pub fn run(args: DemoArgs) -> CliResult {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("demo.sock");
    let dma = DmaSpace::new(DmaConfig::default());
    let result = match args.device {
        DemoKind::Migrate => {
            return crate::demo_migrate::run(&args.out_dir, args.image.as_deref());
        }
        DemoKind::Gpu => {
            let dev = PciAdapter::new(Gpu::new(GpuConfig::default())?)?;
            let server = serve(&socket, Box::new(dev), &dma)?;
            gpu_demo(&socket, &args.out).and(Ok(server))
        }
        DemoKind::Ccw => {
            let image = match &args.image {
                Some(p) => p.clone(),
                None => dir.path().join("ccw.img"),
            };
            let dev = PciAdapter::new(Ccw::new(CcwConfig::new(&image).with_capacity(32768))?)?;
            let server = serve(&socket, Box::new(dev), &dma)?;
            ccw_demo(&socket, &image).and(Ok(server))
        }
    };
    let server = result?;
    server.shutdown()?;
    let s = dma.stats();
    println!(
        "after disconnect: {} DMA maps, {} pinned pages, {} locked pages",
        s.maps, s.pinned_pages, s.locked_pages
    );
    if s.maps != 0 || s.pinned_pages != 0 {
        return Err("the device left DMA state behind".into());
    }
    Ok(())
}

pub(crate) fn serve(
    socket: &Path,
    dev: Box<dyn Device>,
    dma: &Arc<DmaSpace>,
) -> Result<RunningServer, Box<dyn std::error::Error>> {
    Ok(Server::new(ServerConfig::new(socket), dev, Arc::clone(dma)).spawn()?)
}

/// Guest address of surface page `i`: pages in reverse order, every other page, so the
/// GTT maps a scattered surface.
fn surface_page(i: u32, pages: u32) -> u64 {
    RAM_BASE + (8 << 20) + u64::from(pages - 1 - i) * 2 * PAGE
}

fn gpu_demo(socket: &Path, out: &Path) -> CliResult {
    let mut vmm = Vmm::connect(socket)?.with_ram(RAM_BASE, RAM_SIZE)?;
    vmm.enable_device()?;
    let msi = vmm.enable_msi()?;
    let (width, height, stride) = (640u32, 480u32, 640 * 4);
    // A 128×128 gradient surface in 16 scattered guest pages, mapped by GTT entries 0..16.
    let (sw, sh, sstride) = (128u32, 128u32, 512u32);
    let pages = sh * sstride / PAGE as u32;
    for y in 0..sh {
        let row: Vec<u8> = (0..sw)
            .flat_map(|x| (0xff00_0000 | (x * 2) << 16 | (y * 2) << 8 | 0xc0).to_le_bytes())
            .collect();
        let off = u64::from(y * sstride);
        vmm.ram()
            .write(surface_page((off / PAGE) as u32, pages) + off % PAGE, &row)?;
    }
    let mut ram = vmm.ram().clone();
    let mut drv = Driver::probe(Bar0(&mut vmm))?;
    drv.set_mode(width, height, stride)?;
    drv.setup_ring(RAM_BASE, 64 * 1024)?;
    drv.enable_irqs(IRQ_FENCE)?;
    for i in 0..pages.min(GTT_ENTRIES) {
        drv.set_gtt(i, surface_page(i, pages), false)?;
    }
    let mut cmds = vec![GpuCmd::FillRect {
        x: 0,
        y: 0,
        w: width,
        h: height,
        color: 0x0020_2848,
    }];
    for (i, color) in [0x00e0_4040u32, 0x0040_c060, 0x0040_60e0, 0x00e0_c040]
        .iter()
        .enumerate()
    {
        let i = i as u32;
        cmds.push(GpuCmd::FillRect {
            x: 40 + i * 150,
            y: 330,
            w: 110,
            h: 110,
            color: *color,
        });
    }
    cmds.push(GpuCmd::Blit {
        gtt_index: 0,
        stride: sstride,
        w: sw,
        h: sh,
        dst_x: 60,
        dst_y: 60,
    });
    cmds.push(GpuCmd::CopyRect {
        src_x: 60,
        src_y: 60,
        dst_x: 260,
        dst_y: 60,
        w: sw,
        h: sh,
    });
    cmds.push(GpuCmd::CopyRect {
        src_x: 60,
        src_y: 60,
        dst_x: 460,
        dst_y: 60,
        w: sw,
        h: sh,
    });
    cmds.push(GpuCmd::Fence { value: 1 });
    drv.submit(&mut ram, &cmds)?;
    let fired = wait_eventfd(&msi, Duration::from_secs(5)).is_some();
    drv.wait_fence(1)?;
    println!(
        "gpu: mode {width}x{height}, GTT maps a 128x128 surface over {pages} scattered guest pages"
    );
    println!(
        "gpu: submitted {} commands (5 fills, 1 blit, 2 copies, 1 fence); fence MSI fired: {fired}",
        cmds.len()
    );
    drv.clear_gtt(0, pages)?;
    write_framebuffer_png(&mut vmm, width, height, stride, out)?;
    println!(
        "gpu: framebuffer (read through the BAR2 sparse mmap) written to {}",
        out.display()
    );
    if !fired {
        return Err("the fence interrupt did not arrive".into());
    }
    Ok(())
}

/// mmap BAR2 the way a VMM does (the fd from GET_REGION_INFO) and encode it as PNG.
pub(crate) fn write_framebuffer_png(
    vmm: &mut Vmm,
    w: u32,
    h: u32,
    stride: u32,
    out: &Path,
) -> CliResult {
    let fb = vmm
        .map_region(BAR_FB as u32)
        .map_err(|e| format!("framebuffer region is not mmappable: {e}"))?;
    if u64::from(stride) * u64::from(h) > fb.len() as u64 {
        return Err("mode does not fit the framebuffer".into());
    }
    let mut rgb = Vec::with_capacity((w * h * 3) as usize);
    let mut row = vec![0u8; (w * 4) as usize];
    for y in 0..h {
        fb.read((y * stride) as usize, &mut row)?;
        rgb.extend(row.chunks_exact(4).flat_map(|px| [px[2], px[1], px[0]]));
    }
    let mut enc = png::Encoder::new(BufWriter::new(File::create(out)?), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&rgb)?;
    Ok(())
}

/// A tiny deterministic generator for demo data.
pub(crate) fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for b in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn ccw_demo(socket: &Path, image: &Path) -> CliResult {
    let mut vmm = Vmm::connect(socket)?.with_ram(RAM_BASE, RAM_SIZE)?;
    let ram = vmm.ram().clone();
    vmm.enable_device()?;
    let msi = vmm.enable_msi()?;
    let blocks = u64::from(vmm.read32(0, ccw_regs::CAPACITY_LO)?);
    println!(
        "ccw: image {} with {blocks} blocks of 512 bytes",
        image.display()
    );
    let data_page = |i: u64| RAM_BASE + (1 << 20) + i * PAGE;
    let cases: [(&str, Vec<u64>); 3] = [
        ("contiguous", (0..8).collect()),
        ("scattered", (0..8).map(|i| 63 - i * 5).collect()),
        ("mixed", vec![10, 11, 12, 40, 41, 7, 90, 91]),
    ];
    for (n, (name, pages)) in cases.iter().enumerate() {
        let len = pages.len() as u64 * PAGE;
        let mut data = vec![0u8; len as usize];
        fill_pattern(&mut data, n as u64 + 7);
        let src: Vec<u64> = pages.iter().map(|&p| data_page(p)).collect();
        for (i, &gpa) in src.iter().enumerate() {
            ram.write(gpa, &data[i * PAGE as usize..(i + 1) * PAGE as usize])?;
        }
        let idal = RAM_BASE + 0x1000;
        ram.write(idal, &ccw::encode_idaws(&src))?;
        let block = n as u64 * 64;
        let st = run_ccw_program(
            &mut vmm,
            &ram,
            &msi,
            &[CcwWord::write(len as u16, idal).ida(src.len() as u32)],
            block,
        )?;
        println!("ccw: WRITE {len} bytes from {} {name} pages to block {block}: dstat {:#04x} cstat {:#04x} residual {}", src.len(), st.device_status, st.channel_status, st.residual);
        // Read back into other pages, reversed, through a second IDAW list.
        let dst: Vec<u64> = (0..pages.len() as u64)
            .map(|i| data_page(200 + (pages.len() as u64 - 1 - i) * 3))
            .collect();
        ram.write(idal, &ccw::encode_idaws(&dst))?;
        let st = run_ccw_program(
            &mut vmm,
            &ram,
            &msi,
            &[CcwWord::read(len as u16, idal).ida(dst.len() as u32)],
            block,
        )?;
        let mut back = vec![0u8; len as usize];
        for (i, &gpa) in dst.iter().enumerate() {
            ram.read(gpa, &mut back[i * PAGE as usize..(i + 1) * PAGE as usize])?;
        }
        let ok = back == data && st.fault == 0;
        println!("ccw: READ  {len} bytes from block {block} into {} reversed pages: dstat {:#04x} cstat {:#04x}; data {}", dst.len(), st.device_status, st.channel_status, if ok { "verified" } else { "MISMATCH" });
        if !ok {
            return Err(format!("{name} read-back did not match").into());
        }
    }
    Ok(())
}
