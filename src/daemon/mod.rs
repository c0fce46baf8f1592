//! `umdev daemon` and the client commands that talk to it (`umdev types`, `list`, `create`,
//! `define`, `undefine`, `start`, `stop`, `remove`, and `migrate` between two daemons:
//! [`migrate`]): the command line around the daemon library [`umdev::daemon`].
//!
//! `umdev daemon` is that library with parents of `umdev-devices`: the GPU parent (a
//! framebuffer pool and one render engine shared by its instances), the ccw parent (an
//! image directory, `<state-dir>/ccw-images/`, which it keeps private like the rest of the
//! state) and the nvme parent (NVMe controllers on `<state-dir>/nvme-images/`) and the virtio-gpu parent (a pool of resource memory). Everything else (directories, definitions, the control socket, lifecycle,
//! autostart, migration, systemd) is the library's; here are its flags ([`DaemonArgs`]),
//! the ccw parent's migration check, and the client commands' rendering ([`client`],
//! [`render`], [`table`]). The client commands read what the daemon reports (its parents
//! and types), so they talk to any daemon built on the library, not only this one.

pub mod client;
pub mod migrate;
mod render;
mod table;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use umdev::daemon::paths;
use umdev::daemon::protocol::{ControlError, ErrorKind};
use umdev::daemon::{BoxError, Daemon, DaemonConfig, DaemonDirs};
use umdev::instance::{InstanceInfo, Parent};
use umdev_devices::ccw::parent::{CcwParentError, PARAM_IMAGE};
use umdev_devices::ccw::{CcwParent, CcwParentConfig, CcwType};
use umdev_devices::gpu::parent::GpuParentError;
use umdev_devices::gpu::{EngineNice, GpuParent, GpuParentConfig, GpuType};
use umdev_devices::nvme::parent::NvmeParentError;
use umdev_devices::nvme::{NvmeParent, NvmeParentConfig, NvmeType};
use umdev_devices::virtio_gpu::parent::VirtioGpuParentError;
use umdev_devices::virtio_gpu::{VirtioGpuParent, VirtioGpuParentConfig, VirtioGpuType};

use crate::CliResult;

/// Arguments of `umdev daemon`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Files: <state-dir>/definitions/<uuid>.json (one per defined instance), <state-dir>/ccw-images/,
<state-dir>/nvme-images/,
<socket-dir>/control.sock (mode 0600) and <socket-dir>/<uuid>.sock (one per running instance).
Defaults: state /var/lib/umdev and sockets /run/umdev for root; otherwise
$XDG_STATE_HOME/umdev (~/.local/state/umdev) and $XDG_RUNTIME_DIR/umdev (/tmp/umdev-<uid>).

Then, from another shell:
  umdev types                                   what can be created, and what is left
  umdev create --type gpu-4m                    start a transient instance; prints its socket
  umdev define --type ccw-16m --auto            an instance started whenever the daemon starts
  umdev list [--defined]
  umdev stop|start|undefine|remove UUID

SIGINT/SIGTERM stop the daemon; SIGHUP re-reads the definitions (new autostart ones start).
Under systemd: systemd/umdev.service and umdev.socket (socket activation, sd_notify).

Each instance is one QEMU 10.1+ device:
  -device '{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"<socket-dir>/<uuid>.sock\"}}'")]
pub struct DaemonArgs {
    /// Directory of the definitions and the ccw and nvme images [default: see below].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Directory of the instance sockets and the control socket [default: see below].
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// The control socket [default: <socket-dir>/control.sock].
    #[arg(long, value_name = "PATH", env = paths::CONTROL_ENV)]
    pub control: Option<PathBuf>,
    /// The GPU parent's framebuffer pool, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub gpu_pool_mib: u64,
    /// A GPU type: framebuffer (a power of two, MiB) and weight on the shared render engine.
    /// Repeat for several [default: gpu-4m:4:1 and gpu-16m:16:4].
    #[arg(long = "gpu-type", value_name = "NAME:MIB:WEIGHT", value_parser = parse_gpu_type)]
    pub gpu_types: Vec<GpuType>,
    /// Nice value of the GPU parent's shared render engine thread, or `inherit` for the
    /// daemon's. 19 keeps the engine out of the way of the instances' own threads
    /// (doorbells, ring fetches, interrupts: latency paths) but starves it on a host whose
    /// CPUs are busy at normal priority (vCPUs), hence not the default.
    #[arg(long, value_name = "NICE|inherit", allow_negative_numbers = true, default_value_t = EngineNice::Inherit)]
    pub gpu_engine_nice: EngineNice,
    /// The virtio-gpu parent's pool of resource memory (what its instances' guests may
    /// allocate for resources, together), MiB.
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    pub virtio_gpu_pool_mib: u64,
    /// A virtio-gpu type: resource memory (MiB, its share of the pool) and display mode.
    /// Repeat for several [default: vgpu-720p:64:1280x720 and vgpu-1080p:128:1920x1080].
    #[arg(long = "virtio-gpu-type", value_name = "NAME:MIB:WxH")]
    pub virtio_gpu_types: Vec<VirtioGpuType>,
    /// The ccw parent's storage budget for the images of running instances, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    pub ccw_budget_mib: u64,
    /// A ccw type: image capacity, MiB. Repeat for several [default: ccw-16m:16 and
    /// ccw-64m:64].
    #[arg(long = "ccw-type", value_name = "NAME:MIB", value_parser = parse_ccw_type)]
    pub ccw_types: Vec<CcwType>,
    /// The nvme parent's storage budget for the images of running instances, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    pub nvme_budget_mib: u64,
    /// An nvme type: namespace capacity, MiB, and I/O queue pairs. Repeat for several
    /// [default: nvme-256m:256:2 and nvme-1g:1024:4].
    #[arg(long = "nvme-type", value_name = "NAME:MIB:QUEUES", value_parser = parse_nvme_type)]
    pub nvme_types: Vec<NvmeType>,
    /// Most instances at once, over all parents.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_instances: usize,
    /// How long `stop`/`remove` waits for an attached client to release an instance after
    /// the device-request IRQ, seconds (then: busy, or disconnected with --force).
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_seconds)]
    pub release_timeout: Duration,
    /// How long a control client has to send its whole request, and to take the reply,
    /// seconds (a state it sends or takes gets 1 s more per 32 MiB); then it is cut off.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_timeout)]
    pub control_timeout: Duration,
    /// Let every instance's client DMA_MAP any mmappable file, not only memfd, tmpfs
    /// (/dev/shm) and hugetlbfs files: for trusted clients only, e.g. QEMU with
    /// memory-backend-file on a disk filesystem. A file whose page faults its owner can stall
    /// (FUSE) would stop device threads every instance shares (the GPU render engine).
    #[arg(long)]
    pub allow_any_file_maps: bool,
    /// How every instance's connection thread waits for the next message (as `umdev run
    /// --poll`): `auto` spins for an adaptive time (at most 50 µs, none for an idle client)
    /// before blocking, `off` blocks at once, `<N>us` spins N µs after every message.
    #[arg(long, value_name = "off|auto|<N>us", default_value_t = umdev::server::PollMode::Auto)]
    pub poll: umdev::server::PollMode,
    /// Answer clients' `write_multiple` (as `umdev run --write-multiple`; off by default,
    /// see protocol-docs/qemu.md).
    #[arg(long)]
    pub write_multiple: bool,
}

fn parse_mib(s: &str) -> Result<u64, String> {
    s.parse::<u64>()
        .map_err(|e| format!("{s:?} is not a number of MiB: {e}"))
}

fn parse_gpu_type(s: &str) -> Result<GpuType, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [name, mib, weight] = parts.as_slice() else {
        return Err(format!(
            "{s:?}: a GPU type is NAME:MIB:WEIGHT (e.g. gpu-8m:8:2)"
        ));
    };
    let weight = weight
        .parse::<u32>()
        .map_err(|e| format!("{s:?}: weight {weight:?}: {e}"))?;
    Ok(GpuType::new(name, parse_mib(mib)?, weight))
}

fn parse_ccw_type(s: &str) -> Result<CcwType, String> {
    let Some((name, mib)) = s.split_once(':') else {
        return Err(format!("{s:?}: a ccw type is NAME:MIB (e.g. ccw-32m:32)"));
    };
    Ok(CcwType::new(name, parse_mib(mib)?))
}

fn parse_nvme_type(s: &str) -> Result<NvmeType, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [name, mib, queues] = parts.as_slice() else {
        return Err(format!(
            "{s:?}: an nvme type is NAME:MIB:QUEUES (e.g. nvme-1g:1024:4)"
        ));
    };
    let queues = queues
        .parse::<u16>()
        .map_err(|e| format!("{s:?}: I/O queue pairs {queues:?}: {e}"))?;
    Ok(NvmeType::new(name, parse_mib(mib)?, queues))
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    if !(0.0..=3600.0).contains(&v) {
        return Err(format!("{s}: between 0 and 3600 seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    parse_seconds(s).and_then(|d| match d.is_zero() {
        true => Err(format!("{s}: more than 0 seconds")),
        false => Ok(d),
    })
}

/// Why a parent of `umdev daemon` could not be built (the message `umdev daemon` printed
/// before the daemon was a library).
#[derive(Debug, thiserror::Error)]
enum ParentError {
    #[error("the GPU parent's configuration")]
    Gpu(#[source] GpuParentError),
    #[error("the ccw parent's configuration")]
    Ccw(#[source] CcwParentError),
    #[error("the nvme parent's configuration")]
    Nvme(#[source] NvmeParentError),
    #[error("the virtio-gpu parent's configuration")]
    VirtioGpu(#[source] VirtioGpuParentError),
}

/// The virtio-gpu parent of `args`.
fn virtio_gpu_parent(args: &DaemonArgs) -> Result<Arc<dyn Parent>, BoxError> {
    let mut config = VirtioGpuParentConfig {
        pool_mib: args.virtio_gpu_pool_mib,
        ..VirtioGpuParentConfig::default()
    };
    if !args.virtio_gpu_types.is_empty() {
        config.types = args.virtio_gpu_types.clone();
    }
    let parent = VirtioGpuParent::new(config).map_err(ParentError::VirtioGpu)?;
    Ok(Arc::new(parent))
}

/// The GPU parent of `args`.
fn gpu_parent(args: &DaemonArgs) -> Result<Arc<dyn Parent>, BoxError> {
    let types = if args.gpu_types.is_empty() {
        GpuParentConfig::default().types
    } else {
        args.gpu_types.clone()
    };
    let gpu = GpuParent::new(GpuParentConfig {
        pool_mib: args.gpu_pool_mib,
        types,
        engine_nice: args.gpu_engine_nice.nice(),
    })
    .map_err(ParentError::Gpu)?;
    Ok(Arc::new(gpu))
}

/// The ccw parent of `args`, its images in `<state-dir>/ccw-images/`.
fn ccw_parent(args: &DaemonArgs, dirs: &DaemonDirs) -> Result<Arc<dyn Parent>, BoxError> {
    // Guest data: private like the rest of the state.
    let images = paths::ensure_private_dir(&dirs.state_dir.join("ccw-images"))?;
    let mut config = CcwParentConfig::new(images);
    config.budget_mib = args.ccw_budget_mib;
    if !args.ccw_types.is_empty() {
        config.types = args.ccw_types.clone();
    }
    Ok(Arc::new(CcwParent::new(config).map_err(ParentError::Ccw)?))
}

/// The nvme parent of `args`, its images in `<state-dir>/nvme-images/`.
fn nvme_parent(args: &DaemonArgs, dirs: &DaemonDirs) -> Result<Arc<dyn Parent>, BoxError> {
    let images = paths::ensure_private_dir(&dirs.state_dir.join("nvme-images"))?;
    let mut config = NvmeParentConfig::new(images);
    config.budget_mib = args.nvme_budget_mib;
    if !args.nvme_types.is_empty() {
        config.types = args.nvme_types.clone();
    }
    if args.poll == umdev::server::PollMode::Off {
        // No spinning anywhere: the queue workers arm the EventIdx at once too.
        config.shadow_poll = std::time::Duration::ZERO;
    }
    Ok(Arc::new(
        NvmeParent::new(config).map_err(ParentError::Nvme)?,
    ))
}

/// A ccw or nvme instance migrates only if it names its image: its default image is
/// `<uuid>.img` in this daemon's image directory, which the state does not carry (the
/// destination would start on an empty image).
fn image_migration_check(info: &InstanceInfo) -> Result<(), ControlError> {
    if !matches!(info.parent.as_str(), "ccw" | "nvme") || info.params.contains_key(PARAM_IMAGE) {
        return Ok(());
    }
    let (uuid, parent) = (&info.uuid, &info.parent);
    Err(ControlError::new(
        ErrorKind::NotMigratable,
        format!(
            "{uuid} keeps its data in the image {uuid}.img of this daemon's {parent} image \
             directory, which a migration does not carry"
        ),
    )
    .hint(format!(
        "a {parent} instance migrates when it names its image (`umdev create --type T \
         image=NAME`) and the destination's image directory has that image (shared \
         or copied while the instance is detached)"
    )))
}

/// Entry point of `umdev daemon`.
pub fn run(args: DaemonArgs) -> CliResult {
    // Before any thread starts, so that the daemon's sigwait gets the signals.
    let mut config = DaemonConfig::new(
        args.state_dir
            .clone()
            .unwrap_or_else(paths::default_state_dir),
        args.socket_dir
            .clone()
            .unwrap_or_else(paths::default_socket_dir),
    );
    config.control = args.control.clone();
    config.release_timeout = args.release_timeout;
    config.max_instances = args.max_instances;
    config.control_timeout = args.control_timeout;
    config.server.allow_any_file_maps = args.allow_any_file_maps;
    config.server.poll = args.poll;
    config.server.write_multiple = args.write_multiple;
    let builder = Daemon::builder(config);
    // SAFETY: no thread has been spawned yet (the logger starts none; the parents are
    // built later, by `run`), so clearing LISTEN_FDS/LISTEN_PID races nothing.
    let builder = unsafe { builder.socket_activation() }?;
    let args = Arc::new(args);
    let (gpu_args, ccw_args, nvme_args, vgpu_args) =
        (args.clone(), args.clone(), args.clone(), args);
    builder
        .parent_with(move |_| gpu_parent(&gpu_args))
        .parent_with(move |dirs| ccw_parent(&ccw_args, dirs))
        .parent_with(move |dirs| nvme_parent(&nvme_args, dirs))
        .parent_with(move |_| virtio_gpu_parent(&vgpu_args))
        .migration_check(image_migration_check)
        .run()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_type_flags_parse_and_refuse_malformed() {
        let t = parse_gpu_type("gpu-8m:8:2").unwrap();
        assert_eq!((t.name.as_str(), t.fb_mib, t.weight), ("gpu-8m", 8, 2));
        assert!(parse_gpu_type("gpu-8m:8").is_err());
        assert!(parse_gpu_type("gpu-8m:x:2").is_err());
        let c = parse_ccw_type("ccw-32m:32").unwrap();
        assert_eq!((c.name.as_str(), c.capacity_mib), ("ccw-32m", 32));
        assert!(parse_ccw_type("ccw").is_err());
        let n = parse_nvme_type("nvme-1g:1024:4").unwrap();
        assert_eq!(
            (n.name.as_str(), n.capacity_mib, n.io_queues),
            ("nvme-1g", 1024, 4)
        );
        assert!(parse_nvme_type("nvme-1g:1024").is_err());
        assert!(parse_nvme_type("nvme-1g:1024:x").is_err());
        assert!(parse_nvme_type("nvme-1g:1024:70000").is_err());
        assert_eq!(parse_seconds("0.5").unwrap(), Duration::from_millis(500));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("NaN").is_err());
    }
}
