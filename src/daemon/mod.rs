//! `umdev daemon` and the client commands that talk to it (`umdev types`, `list`, `create`,
//! `define`, `undefine`, `start`, `stop`, `remove`, and `migrate` between two daemons:
//! [`migrate`]): many instances in one process, kept across restarts, in the style of
//! mdevctl.
//!
//! The daemon owns one [`Registry`] with the GPU parent (a framebuffer pool and one render
//! engine shared by its instances) and the ccw parent (an image directory under the state
//! directory), each instance served on `<socket-dir>/<uuid>.sock`. Its files:
//!
//! | path | what |
//! |---|---|
//! | `<state-dir>/definitions/<uuid>.json` | one definition per instance ([`definitions`]) |
//! | `<state-dir>/ccw-images/` | the ccw instances' images |
//! | `<state-dir>/daemon.lock` | held (`flock`) while a daemon uses the state directory |
//! | `<socket-dir>/control.sock` | the control socket, mode 0600 ([`control`], [`protocol`]) |
//! | `<socket-dir>/<uuid>.sock` | an instance's vfio-user socket, mode 0600 |
//!
//! Both directories are created with mode 0700 if missing and must belong to the daemon's
//! user and not be writable by others ([`paths`]).
//!
//! # Lifecycle of the process
//! 1. Block SIGINT/SIGTERM/SIGHUP and take a socket-activated control socket, if one was
//!    passed ([`systemd`]), before any thread starts; check the directories; take the
//!    state directory's lock (a second daemon on it is refused); bind the control socket
//!    unless one was passed (a live daemon's socket is never replaced).
//! 2. Register the parents; load the definitions (a malformed file is logged, skipped, and
//!    reported by `umdev list --defined`); start the autostart ones (a failure is logged and
//!    reported the same way).
//! 3. Tell the service manager `READY=1` ([`systemd`]); answer control requests
//!    ([`service`] has what each does) until SIGINT or SIGTERM; on SIGHUP re-read the
//!    definitions (`service::reload`: new autostart ones started, nothing running stopped).
//! 4. Stop taking requests (the control socket is removed), wait a bounded time for the ones
//!    in hand, then stop every instance at once: attached clients are disconnected without
//!    the device-request IRQ (the daemon is going away, not the devices: a QEMU asked to
//!    unplug would drop the device from the guest for good, and a stock QEMU 10.2.2 aborts
//!    doing so), their teardown releases every map and pin, and the log says what each
//!    instance released. Definitions stay for the next start.
//!
//! [`Registry`]: umdev::instance::Registry

pub mod client;
mod control;
mod definitions;
mod migrate;
pub(crate) mod paths;
mod protocol;
mod render;
mod service;
mod systemd;
mod table;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tracing::{info, warn};
use umdev::instance::{InstanceError, Parent, Registry, RegistryConfig};
use umdev::server::listener::SocketListener;
use umdev::server::ServerError;
use umdev::server::TerminationSignals;
use umdev_devices::ccw::parent::CcwParentError;
use umdev_devices::ccw::{CcwParent, CcwParentConfig, CcwType};
use umdev_devices::gpu::parent::GpuParentError;
use umdev_devices::gpu::{EngineNice, GpuParent, GpuParentConfig, GpuType};

use crate::CliResult;

/// Arguments of `umdev daemon`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Files: <state-dir>/definitions/<uuid>.json (one per defined instance), <state-dir>/ccw-images/,
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
    /// Directory of the definitions and the ccw images [default: see below].
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
    /// The ccw parent's storage budget for the images of running instances, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    pub ccw_budget_mib: u64,
    /// A ccw type: image capacity, MiB. Repeat for several [default: ccw-16m:16 and
    /// ccw-64m:64].
    #[arg(long = "ccw-type", value_name = "NAME:MIB", value_parser = parse_ccw_type)]
    pub ccw_types: Vec<CcwType>,
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

/// Why the daemon could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
enum DaemonError {
    #[error(transparent)]
    Dir(#[from] paths::DirError),
    #[error("state directory {}: cannot take its lock {}", dir.display(), lock.display())]
    Lock {
        dir: PathBuf,
        lock: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "state directory {} is in use by another umdev daemon (it holds {})",
        dir.display(),
        lock.display()
    )]
    StateInUse { dir: PathBuf, lock: PathBuf },
    #[error("another umdev daemon is running on {}", .0.display())]
    ControlInUse(PathBuf),
    #[error("control socket {}", path.display())]
    Control {
        path: PathBuf,
        #[source]
        source: ServerError,
    },
    #[error("the GPU parent's configuration")]
    Gpu(#[source] GpuParentError),
    #[error("the ccw parent's configuration")]
    Ccw(#[source] CcwParentError),
    #[error("setting up the registry")]
    Registry(#[source] InstanceError),
    #[error(transparent)]
    Store(#[from] definitions::StoreError),
    #[error("starting the control server")]
    Spawn(#[source] std::io::Error),
    #[error(transparent)]
    Activation(#[from] systemd::ActivationError),
    #[error("{0} instance(s) could not be stopped (a device stuck in a call; see the log)")]
    NotStopped(usize),
}

/// Take the state directory's lock: held (by the open file) until the daemon exits.
fn lock_state_dir(dir: &Path) -> Result<File, DaemonError> {
    let lock = dir.join("daemon.lock");
    let err = |source| DaemonError::Lock {
        dir: dir.to_path_buf(),
        lock: lock.clone(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&lock)
        .map_err(err)?;
    // SAFETY: flock on a file descriptor we own; it changes no memory.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(DaemonError::StateInUse {
                dir: dir.to_path_buf(),
                lock,
            });
        }
        return Err(err(e));
    }
    Ok(file)
}

/// Entry point of `umdev daemon`.
pub fn run(args: DaemonArgs) -> CliResult {
    // Before any thread starts, so that sigwait below gets them.
    let signals = TerminationSignals::block_with_hangup();
    // SAFETY: no thread has been spawned yet (the signals are blocked first, the logger
    // starts none), so clearing LISTEN_FDS/LISTEN_PID races nothing.
    let inherited = unsafe { systemd::inherited_control() }?;
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(paths::default_state_dir);
    let socket_dir = args
        .socket_dir
        .clone()
        .unwrap_or_else(paths::default_socket_dir);
    let control_path = args
        .control
        .clone()
        .unwrap_or_else(|| socket_dir.join(paths::CONTROL_SOCKET));
    // Absolute from here on: the paths printed (QEMU lines, logs) work from any directory.
    let state_dir = paths::ensure_private_dir(&state_dir).map_err(DaemonError::from)?;
    let socket_dir = paths::ensure_private_dir(&socket_dir).map_err(DaemonError::from)?;
    let control_dir = control_path.parent().filter(|d| !d.as_os_str().is_empty());
    let control_path = match (control_dir, control_path.file_name()) {
        (Some(dir), Some(name)) => paths::ensure_private_dir(dir)
            .map_err(DaemonError::from)?
            .join(name),
        _ => std::env::current_dir()
            .map(|cwd| cwd.join(&control_path))
            .unwrap_or(control_path),
    };
    let _lock = lock_state_dir(&state_dir)?;
    let listener = match inherited {
        Some(l) => {
            info!(control = %l.path().display(), "control socket passed by the service manager (socket activation)");
            l
        }
        None => SocketListener::bind(&control_path, 0o600).map_err(|e| match e {
            ServerError::SocketInUse(p) => DaemonError::ControlInUse(p),
            source => DaemonError::Control {
                path: control_path.clone(),
                source,
            },
        })?,
    };
    let control_path = listener.path().to_path_buf();

    let gpu_types = if args.gpu_types.is_empty() {
        GpuParentConfig::default().types
    } else {
        args.gpu_types.clone()
    };
    let gpu = GpuParent::new(GpuParentConfig {
        pool_mib: args.gpu_pool_mib,
        types: gpu_types,
        engine_nice: args.gpu_engine_nice.nice(),
    })
    .map_err(DaemonError::Gpu)?;
    // Guest data: private like the rest of the state.
    let images = state_dir.join("ccw-images");
    paths::ensure_private_dir(&images).map_err(DaemonError::from)?;
    let mut ccw_config = CcwParentConfig::new(images);
    ccw_config.budget_mib = args.ccw_budget_mib;
    if !args.ccw_types.is_empty() {
        ccw_config.types = args.ccw_types.clone();
    }
    let ccw = CcwParent::new(ccw_config).map_err(DaemonError::Ccw)?;
    let mut config = RegistryConfig::new(&socket_dir);
    config.release_timeout = args.release_timeout;
    config.max_instances = args.max_instances;
    config.server.poll = args.poll;
    config.server.write_multiple = args.write_multiple;
    let teardown = config.teardown_timeout;
    let registry = Arc::new(Registry::new(config).map_err(DaemonError::Registry)?);
    let parents: Vec<Arc<dyn Parent>> = vec![Arc::new(gpu), Arc::new(ccw)];
    for p in &parents {
        registry
            .add_parent(p.clone())
            .map_err(DaemonError::Registry)?;
    }

    let store = definitions::Store::open(state_dir.join("definitions"))?;
    let loaded = store.load()?;
    let autostart = loaded.definitions.values().filter(|d| d.autostart).count();
    info!(
        dir = %store.dir().display(),
        definitions = loaded.definitions.len(),
        autostart,
        broken = loaded.broken.len(),
        "definitions loaded"
    );
    for b in &loaded.broken {
        warn!(file = %b.path.display(), error = %b.error, "malformed definition file skipped (`umdev list --defined` reports it)");
    }
    let service = Arc::new(service::Service::new(
        registry.clone(),
        parents,
        store,
        loaded,
    ));
    let (started, failed) = service.autostart();
    if autostart > 0 {
        info!(started, failed, "autostart done");
    }
    let control_config = control::ControlConfig {
        request_timeout: args.control_timeout,
    };
    let control = control::Control::spawn(listener, service.clone(), control_config)
        .map_err(DaemonError::Spawn)?;
    info!(
        state = %state_dir.display(),
        sockets = %socket_dir.display(),
        control = %control_path.display(),
        "umdev daemon ready (SIGINT or SIGTERM stops it, SIGHUP reloads the definitions)"
    );
    let status = |what: &str| {
        format!(
            "{what}; instances running: {}; control socket {}",
            service.running_count(),
            control_path.display()
        )
    };
    systemd::notify(&[NotifyState::Ready, NotifyState::Status(&status("serving"))]);

    let sig = loop {
        match signals.wait() {
            libc::SIGHUP => {
                systemd::notify_reloading();
                let what = match service.reload() {
                    Some(r) => format!(
                        "definitions reloaded ({} added, {} changed, {} removed, {} started, \
                         {} failed to start, {} busy)",
                        r.added.len(),
                        r.changed.len(),
                        r.removed.len(),
                        r.started,
                        r.failed,
                        r.busy.len()
                    ),
                    None => "definitions not reloaded: the directory cannot be read".into(),
                };
                systemd::notify(&[NotifyState::Ready, NotifyState::Status(&status(&what))]);
            }
            sig => break sig,
        }
    };
    systemd::notify(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping: every instance is stopped"),
    ]);
    info!(signal = sig, "stopping: no more control requests");
    // A request in hand may be a removal waiting for its client.
    let drain = args.release_timeout + teardown + Duration::from_secs(1);
    let in_hand = control.stop(drain);
    if in_hand > 0 {
        warn!(
            in_hand,
            "control requests still in hand; stopping the instances anyway"
        );
    }
    let not_stopped = service.stop_all();
    info!("umdev daemon stopped");
    if not_stopped > 0 {
        return Err(DaemonError::NotStopped(not_stopped).into());
    }
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
        assert_eq!(parse_seconds("0.5").unwrap(), Duration::from_millis(500));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("NaN").is_err());
    }
}
