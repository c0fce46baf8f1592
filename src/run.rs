//! `umdev run`: serve an example device on a vfio-user socket until Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;

use clap::ValueEnum;
use umdev::device::Device;
use umdev::dma::{DmaConfig, DmaSpace, PinPolicy};
use umdev::pci::PciAdapter;
use umdev::server::{PollMode, Server, ServerConfig, TerminationSignals};
use umdev::virtio::VirtioPci;
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::{Gpu, GpuConfig};
use umdev_devices::nvme::{Nvme, NvmeConfig, MAX_IO_QUEUES};
use umdev_devices::virtio_gpu::{VirtioGpu, VirtioGpuConfig, VirtioGpuHandle};

use crate::display::http;
use crate::display::run_control::RunControl;
use crate::{CliResult, DeviceKind};

/// Residency policy for pinned pages (see protocol-docs/dma.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Refcount and translate only.
    Translate,
    /// mlock each pinned run, counted against the lock limit.
    Lock,
    /// Prefault each pinned run with MADV_POPULATE_READ/WRITE.
    Populate,
}

impl From<PolicyArg> for PinPolicy {
    fn from(p: PolicyArg) -> PinPolicy {
        match p {
            PolicyArg::Translate => PinPolicy::Translate,
            PolicyArg::Lock => PinPolicy::Lock,
            PolicyArg::Populate => PinPolicy::Populate,
        }
    }
}

/// Arguments of `umdev run`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "QEMU 10.1+ attaches with (guest RAM must be a shared memfd for pinning):\n  \
qemu-system-x86_64 -machine q35 \\\n    \
-object memory-backend-memfd,id=mem,size=1G,share=on -machine memory-backend=mem \\\n    \
-device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"/run/umdev/gpu.sock\"}}'\n\n\
NVMe: `umdev run nvme --image disk.img --size 1G --socket /run/umdev/nvme.sock` serves one \
namespace on disk.img (512-byte blocks); the guest's stock nvme driver binds it. Without a \
shared memfd memory backend the controller still works, through DMA_READ/DMA_WRITE \
messages (slower). Shadow doorbells are offered unless --no-shadow-doorbells.\n\n\
virtio-gpu: the guest's stock virtio_gpu driver binds it (no VGA beside it: add -vga none); \
--width/--height set each scanout's mode (--scanouts of them), --gpu-memory-mib the host memory \
its resources may take (ERR_OUT_OF_MEMORY beyond), --screenshot-on-exit writes scanout 0 (with \
the cursor) as PNG when umdev stops.\n\n\
The display while it runs: --control PATH serves a control socket for `umdev screenshot \
--control PATH -o screen.png` and `umdev view --control PATH`; --view 127.0.0.1:8080 serves \
a live view (open http://127.0.0.1:8080/ in a browser; port 0 picks a free one, the URL is \
logged). Example:\n  \
umdev run virtio-gpu --socket /tmp/vgpu.sock --control /tmp/vgpu.ctl --view 127.0.0.1:8080"
)]
pub struct RunArgs {
    /// Device to serve.
    pub device: DeviceKind,
    /// Path of the vfio-user UNIX socket to create.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Backing image file of the ccw device (created if missing) or of the NVMe
    /// namespace (created if missing when --size is given).
    #[arg(long, value_name = "FILE", default_value = "umdev-ccw.img")]
    pub image: PathBuf,
    /// NVMe: namespace size in bytes (suffixes K, M, G, T: powers of 1024); a missing
    /// image is created, a shorter one grown sparsely. Default: the image's size.
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    pub size: Option<u64>,
    /// NVMe: most I/O queue pairs the guest may create (one worker thread and one MSI-X
    /// vector each).
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=i64::from(MAX_IO_QUEUES)))]
    pub io_queues: u16,
    /// NVMe: threads of the I/O pool that runs the queues' reads and writes, so that a
    /// queue's commands overlap (0: each queue's worker runs its own I/O, in order).
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(0..=64))]
    pub io_threads: u16,
    /// NVMe: do not offer shadow doorbells (Doorbell Buffer Config): every doorbell then
    /// traps to this process.
    #[arg(long)]
    pub no_shadow_doorbells: bool,
    /// NVMe: the controller's serial number (ASCII, at most 20 characters) [default: one
    /// derived from the image file, so two controllers of one guest never share one].
    #[arg(long, value_name = "SERIAL", value_parser = parse_serial)]
    pub serial: Option<String>,
    /// NVMe: read and write the image with O_DIRECT where a transfer is 4 KiB aligned
    /// (bypassing the host's page cache; others go through it). The image's file system
    /// must support O_DIRECT (tmpfs only from Linux 6.6).
    #[arg(long)]
    pub direct: bool,
    /// Capacity of a newly created ccw image, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub image_size_mib: u64,
    /// How pinned guest pages are made resident.
    #[arg(long, value_enum, default_value_t = PolicyArg::Translate)]
    pub pin_policy: PolicyArg,
    /// Locked-memory limit in bytes for `--pin-policy lock` (default: RLIMIT_MEMLOCK).
    #[arg(long, value_name = "BYTES")]
    pub lock_limit: Option<u64>,
    /// Permission bits of the socket file, octal (default 600: only the owner connects).
    #[arg(long, value_name = "OCTAL", default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
    /// Record every pin array the device issues to FILE (replay with `umdev bench pin --trace`).
    #[arg(long, value_name = "FILE")]
    pub record_pins: Option<PathBuf>,
    /// Accept DMA_MAP of any mmappable file, not only memfd/tmpfs/hugetlbfs ones (for a
    /// trusted client whose guest RAM is a file on disk, e.g. libvfio-user's sample client
    /// on a host whose /tmp is not tmpfs). Faults on such files are served by their
    /// filesystem; a hostile one (FUSE) could stall this device.
    #[arg(long)]
    pub allow_any_file_maps: bool,
    /// How the connection thread waits for the next message: `auto` spins with
    /// non-blocking reads for a time that adapts to the gaps between messages (at most
    /// 50 µs, none for an idle client), then blocks; `off` blocks at once; `<N>us` spins N
    /// µs after every message. For nvme, `off` also stops the queue workers' 50 µs watch of
    /// the shadow doorbells after a burst.
    #[arg(long, value_name = "off|auto|<N>us", default_value_t = PollMode::Auto)]
    pub poll: PollMode,
    /// Answer the client's `write_multiple` (REGION_WRITE_MULTI). Off by default: QEMU
    /// 10.1/10.2's flag for it includes FORCE_QUEUED, which makes QEMU send every message
    /// from its I/O thread (protocol-docs/qemu.md); turn it on for a client without that bug.
    #[arg(long)]
    pub write_multiple: bool,
    /// virtio-gpu: width of each scanout's display mode, in pixels.
    #[arg(long, value_name = "PIXELS", default_value_t = 1280)]
    pub width: u32,
    /// virtio-gpu: height of each scanout's display mode, in pixels.
    #[arg(long, value_name = "PIXELS", default_value_t = 800)]
    pub height: u32,
    /// virtio-gpu: number of scanouts (displays), 1..=16.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub scanouts: usize,
    /// virtio-gpu: host memory the guest's resources may take together, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    pub gpu_memory_mib: u64,
    /// virtio-gpu: when umdev stops (Ctrl-C, SIGTERM), write what scanout 0 shows, with
    /// the cursor, to FILE as PNG (if the guest reset the device, as at power-off, what
    /// it showed before).
    #[arg(long, value_name = "FILE")]
    pub screenshot_on_exit: Option<PathBuf>,
    /// virtio-gpu: serve a control socket at PATH (mode 600) for `umdev screenshot
    /// --control PATH` and `umdev view --control PATH`.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// virtio-gpu: serve a live view of scanout 0 over HTTP on ADDR:PORT (no password:
    /// keep it on 127.0.0.1 and tunnel it, `ssh -L`).
    #[arg(long, value_name = "ADDR:PORT")]
    pub view: Option<std::net::SocketAddr>,
}

/// A byte count with an optional K/M/G/T suffix (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("unknown size suffix in {s:?} (use K, M, G or T)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num.parse().map_err(|e| format!("size {s:?}: {e}"))?;
    let bytes = n
        .checked_shl(shift)
        .filter(|b| b >> shift == n)
        .ok_or(format!("size {s:?} is too large"))?;
    if bytes < 512 {
        return Err(format!("size {s:?} is less than one 512-byte block"));
    }
    Ok(bytes)
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let v = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|e| format!("socket mode must be octal (e.g. 600): {e}"))?;
    if v > 0o777 {
        return Err("socket mode must be at most 777".into());
    }
    Ok(v)
}

/// A device built for the server, and the virtio-gpu's display handle if it is one.
type Built = (Box<dyn Device>, Option<VirtioGpuHandle>);

/// Build the example device `kind` wrapped for the server.
pub fn build_device(kind: DeviceKind, args: &RunArgs) -> Result<Built, Box<dyn std::error::Error>> {
    Ok(match kind {
        DeviceKind::Gpu => (
            Box::new(PciAdapter::new(Gpu::new(GpuConfig::default())?)?),
            None,
        ),
        DeviceKind::VirtioGpu => {
            let config = VirtioGpuConfig {
                scanouts: vec![(args.width, args.height); args.scanouts],
                memory_budget: args
                    .gpu_memory_mib
                    .checked_mul(1 << 20)
                    .ok_or("--gpu-memory-mib too large")?,
                ..VirtioGpuConfig::default()
            };
            let gpu = VirtioGpu::new(config)?;
            let handle = gpu.handle();
            (
                Box::new(PciAdapter::new(VirtioPci::new(gpu)?)?),
                Some(handle),
            )
        }
        DeviceKind::Ccw => {
            let blocks = args
                .image_size_mib
                .checked_mul(2048)
                .ok_or("image size too large")?;
            let cfg = if args.image.exists() {
                CcwConfig::new(&args.image)
            } else {
                CcwConfig::new(&args.image).with_capacity(blocks)
            };
            (Box::new(PciAdapter::new(Ccw::new(cfg)?)?), None)
        }
        DeviceKind::Nvme => {
            if args.size.is_none() && !args.image.exists() {
                return Err(format!(
                    "nvme: image {} does not exist; give --size to create it",
                    args.image.display()
                )
                .into());
            }
            let mut cfg = NvmeConfig::new(&args.image);
            cfg.size = args.size;
            cfg.max_io_queues = args.io_queues;
            cfg.shadow_doorbells = !args.no_shadow_doorbells;
            if args.poll == PollMode::Off {
                // No spinning anywhere: the queue workers arm the EventIdx at once too.
                cfg.shadow_poll = std::time::Duration::ZERO;
            }
            cfg.io_threads = usize::from(args.io_threads);
            cfg.direct = args.direct;
            if let Some(serial) = &args.serial {
                cfg.serial = serial.clone();
            }
            (Box::new(PciAdapter::new(Nvme::new(cfg)?)?), None)
        }
    })
}

/// An NVMe serial number: printable ASCII, 1 to 20 characters (Identify Controller's SN).
fn parse_serial(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "'{s}': a serial number is 1 to 20 printable ASCII characters without spaces"
        ));
    }
    Ok(s.to_string())
}

/// Entry point.
pub fn run(args: RunArgs) -> CliResult {
    let sigs = TerminationSignals::block();
    let dma = DmaSpace::new(DmaConfig {
        policy: args.pin_policy.into(),
        lock_limit_bytes: args.lock_limit,
        ..DmaConfig::default()
    });
    if let Some(path) = &args.record_pins {
        let rec = umdev_bench::trace::trace_recorder(path)
            .map_err(|e| format!("cannot record pins to {}: {e}", path.display()))?;
        dma.set_pin_recorder(Some(rec));
        tracing::info!("recording pin arrays to {}", path.display());
    }
    if args.screenshot_on_exit.is_some() && args.device != DeviceKind::VirtioGpu {
        return Err("--screenshot-on-exit is for virtio-gpu".into());
    }
    if (args.control.is_some() || args.view.is_some()) && args.device != DeviceKind::VirtioGpu {
        return Err(
            "--control and --view are for virtio-gpu (the one device with a display)".into(),
        );
    }
    let (device, display) = build_device(args.device, &args)?;
    let control = match (&args.control, &display) {
        (Some(path), Some(display)) => {
            let control = RunControl::spawn(path, display.clone())?;
            tracing::info!(
                "control socket {}: `umdev screenshot --control {} -o FILE`",
                path.display(),
                path.display()
            );
            Some(control)
        }
        _ => None,
    };
    if let (Some(listen), Some(display)) = (args.view, &display) {
        let display = display.clone();
        let source: http::FrameSource = Box::new(move || {
            display
                .screenshot_png(0)
                .map(|shot| Arc::new(shot.png))
                .map_err(|e| format!("scanout 0 {e}"))
        });
        let interval = std::time::Duration::from_millis(200);
        let view = http::View::spawn(
            http::ViewConfig {
                listen,
                title: format!(
                    "umdev run virtio-gpu ({}), scanout 0",
                    args.socket.display()
                ),
                interval,
            },
            Arc::new(http::FrameCache::new(source, interval)),
        )
        .map_err(|e| format!("cannot serve the view on {listen}: {e}"))?;
        tracing::info!("live view on {}", view.url());
    }
    let mut config = ServerConfig::new(&args.socket);
    config.socket_mode = args.socket_mode;
    config.allow_any_file_maps = args.allow_any_file_maps;
    config.poll = args.poll;
    config.write_multiple = args.write_multiple;
    let server = Server::new(config, device, Arc::clone(&dma)).spawn()?;
    tracing::info!(
        "serving {:?} on {} (pin policy {:?}); Ctrl-C to stop",
        args.device,
        args.socket.display(),
        args.pin_policy
    );
    sigs.serve_until_signal(server, &dma)?;
    dma.set_pin_recorder(None);
    if let Some(control) = control {
        control.stop(std::time::Duration::from_secs(1));
    }
    if let (Some(path), Some(display)) = (&args.screenshot_on_exit, display) {
        match display.last_frame(0) {
            Some(image) => {
                image
                    .write_png(path)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                tracing::info!(
                    "scanout 0 ({}x{}) written to {}",
                    image.width,
                    image.height,
                    path.display()
                );
            }
            None => tracing::warn!("scanout 0 never showed anything: no screenshot written"),
        }
    }
    Ok(())
}
