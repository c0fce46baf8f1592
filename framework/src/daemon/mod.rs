//! The daemon as a library: many instances of any set of [`Parent`]s in one process, kept
//! across restarts, created and removed through a control socket, in the style of mdevctl.
//! `umdev daemon` is this module with the GPU and ccw parents of `umdev-devices`; an author
//! serves a parent of their own the same way, in a few lines:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use umdev::device::Device;
//! # use umdev::instance::{CreateRequest, InstanceError, InstanceType, Parent};
//! # struct MyParent;
//! # impl Parent for MyParent {
//! #     fn name(&self) -> &str { "mine" }
//! #     fn types(&self) -> Vec<InstanceType> { Vec::new() }
//! #     fn create(&self, _: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
//! #         unimplemented!()
//! #     }
//! # }
//! use umdev::daemon::{Daemon, DaemonConfig};
//!
//! // Until SIGINT or SIGTERM; SIGHUP re-reads the definitions.
//! Daemon::builder(DaemonConfig::new("/var/lib/mine", "/run/mine"))
//!     .parent(Arc::new(MyParent))
//!     .run()?;
//! # Ok::<(), umdev::daemon::DaemonError>(())
//! ```
//!
//! Any `umdev` binary's client commands then talk to it (`umdev --help`: `types`, `list`,
//! `create`, `define`, `start`, `stop`, `remove`, `migrate`, pointed at its control socket
//! with `--control` or `UMDEV_CONTROL`), and so does a program through [`client`].
//!
//! The daemon owns one [`Registry`] with the parents, each instance served on
//! `<socket-dir>/<uuid>.sock`. Its files:
//!
//! | path | what |
//! |---|---|
//! | `<state-dir>/definitions/<uuid>.json` | one definition per instance ([`definitions`]) |
//! | `<state-dir>/daemon.lock` | held (`flock`) while a daemon uses the state directory |
//! | `<socket-dir>/control.sock` | the control socket, mode 0600 ([`protocol`]) |
//! | `<socket-dir>/<uuid>.sock` | an instance's vfio-user socket, mode 0600 |
//!
//! A parent may keep files of its own under the state directory (`umdev daemon`'s ccw
//! parent: `<state-dir>/ccw-images/`): [`DaemonBuilder::parent_with`] builds it once the
//! directories are known. Both directories are created with mode 0700 if missing and must
//! belong to the daemon's user and not be writable by others ([`paths`]).
//!
//! # Lifecycle of the process
//! 1. Block SIGINT/SIGTERM/SIGHUP ([`Daemon::builder`]) and take a socket-activated control
//!    socket, if one was passed ([`DaemonBuilder::socket_activation`], [`systemd`]), before
//!    any thread starts; check the directories; take the state directory's lock (a second
//!    daemon on it is refused); bind the control socket unless one was passed (a live
//!    daemon's socket is never replaced).
//! 2. Register the parents; load the definitions (a malformed file is logged, skipped, and
//!    reported by `umdev list --defined`); start the autostart ones (a failure is logged and
//!    reported the same way).
//! 3. Tell the service manager `READY=1` ([`systemd`]); answer control requests (what each
//!    does: `protocol-docs/lifecycle.md`) until SIGINT or SIGTERM; on SIGHUP re-read the
//!    definitions (new autostart ones started, nothing running stopped).
//! 4. Stop taking requests (the control socket is removed), wait a bounded time for the ones
//!    in hand, then stop every instance at once: attached clients are disconnected without
//!    the device-request IRQ (the daemon is going away, not the devices: a QEMU asked to
//!    unplug would drop the device from the guest for good, and a stock QEMU 10.2.2 aborts
//!    doing so), their teardown releases every map and pin, and the log says what each
//!    instance released. Definitions stay for the next start.
//!
//! # Migration between daemons
//! `umdev migrate UUID --to DST` moves a running instance with its device state from one
//! daemon to another (the requests `migrate_save`, `migrate_load`, `migrate_finish`,
//! `migrate_abort`: [`protocol`]); at most one daemon serves the UUID at any moment. A
//! parent whose instances cannot always migrate (a ccw instance keeping its data in an image
//! of the source daemon's own directory) refuses with a [`DaemonBuilder::migration_check`].
//!
//! This module is the `daemon` feature (on by default): its one dependency beyond the core's
//! is `sd-notify` (libc only).
//!
//! [`Registry`]: crate::instance::Registry

pub mod client;
mod control;
pub mod definitions;
pub mod paths;
pub mod protocol;
mod service;
mod stop;
pub mod systemd;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tracing::{info, warn};

use crate::instance::{InstanceError, InstanceInfo, Parent, Registry, RegistryConfig};
use crate::server::listener::SocketListener;
use crate::server::{ServerConfig, ServerError, TerminationSignals};

pub use control::{Control, ControlConfig, ControlHandler, MAX_CONNECTIONS, PAYLOAD_BUDGET};
use protocol::ControlError;
use service::MigrationCheck;
pub use service::Payload;
pub use stop::StopHandle;

/// An error a parent factory ([`DaemonBuilder::parent_with`]) returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a daemon is given: its directories and its bounds. [`DaemonConfig::new`] has the
/// defaults of `umdev daemon`'s flags; [`DaemonConfig::default`] its default directories
/// too ([`paths`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DaemonConfig {
    /// The definitions and the lock (and whatever the parents keep there). Created (mode
    /// 0700) if missing; relative to the working directory if relative.
    pub state_dir: PathBuf,
    /// The instance sockets, and the control socket unless [`DaemonConfig::control`] says
    /// otherwise. Created (mode 0700) if missing.
    pub socket_dir: PathBuf,
    /// The control socket; `None`: `<socket-dir>/control.sock`.
    pub control: Option<PathBuf>,
    /// How long `stop`/`remove` waits for an attached client to release an instance after
    /// the device-request IRQ (then: busy, or disconnected with `force`).
    pub release_timeout: Duration,
    /// Most instances at once, over all parents.
    pub max_instances: usize,
    /// How long a control client has to send its whole request, and to take the reply (a
    /// payload gets [`protocol::transfer_time`] more); then it is cut off.
    pub control_timeout: Duration,
    /// How every instance is served (the socket path is each instance's own): polling,
    /// limits, timeouts. Default [`ServerConfig::new`]'s. Its
    /// [`allow_any_file_maps`](ServerConfig::allow_any_file_maps) lets every instance's
    /// client DMA_MAP any mmappable file; set it only when every client is trusted (e.g.
    /// QEMU with `memory-backend-file` on a disk filesystem): a file whose faults its owner
    /// serves (FUSE) would stop device threads that serve other instances too (the GPU
    /// parent's render engine). The daemon warns at startup when it is set.
    pub server: ServerConfig,
}

impl DaemonConfig {
    /// A daemon on these directories, with the default bounds (10 s to release, 1024
    /// instances, 10 s per control request).
    pub fn new(state_dir: impl Into<PathBuf>, socket_dir: impl Into<PathBuf>) -> DaemonConfig {
        let registry = RegistryConfig::new("");
        DaemonConfig {
            state_dir: state_dir.into(),
            socket_dir: socket_dir.into(),
            control: None,
            release_timeout: registry.release_timeout,
            max_instances: registry.max_instances,
            control_timeout: protocol::REQUEST_TIMEOUT,
            server: registry.server,
        }
    }
}

impl Default for DaemonConfig {
    /// `umdev daemon`'s default directories ([`paths::default_state_dir`],
    /// [`paths::default_socket_dir`]) and bounds.
    fn default() -> DaemonConfig {
        DaemonConfig::new(paths::default_state_dir(), paths::default_socket_dir())
    }
}

/// The daemon's directories as it uses them (absolute, checked private), for a parent
/// built once they are known ([`DaemonBuilder::parent_with`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DaemonDirs {
    /// The state directory.
    pub state_dir: PathBuf,
    /// The socket directory.
    pub socket_dir: PathBuf,
    /// The control socket.
    pub control: PathBuf,
}

/// Why the daemon could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    /// A directory cannot be created or is not private.
    #[error(transparent)]
    Dir(#[from] paths::DirError),
    /// The state directory's lock file cannot be opened or locked.
    #[error("state directory {}: cannot take its lock {}", dir.display(), lock.display())]
    Lock {
        /// The state directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Another daemon holds the state directory's lock.
    #[error(
        "state directory {} is in use by another umdev daemon (it holds {})",
        dir.display(),
        lock.display()
    )]
    StateInUse {
        /// The state directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
    },
    /// A live daemon answers on the control socket.
    #[error("another umdev daemon is running on {}", .0.display())]
    ControlInUse(PathBuf),
    /// The control socket cannot be bound.
    #[error("control socket {}", path.display())]
    Control {
        /// The control socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: ServerError,
    },
    /// A parent could not be built ([`DaemonBuilder::parent_with`]): its error as it is.
    #[error(transparent)]
    Parent(BoxError),
    /// The registry refused its configuration or a parent.
    #[error("setting up the registry")]
    Registry(#[source] InstanceError),
    /// The definitions directory cannot be opened or read.
    #[error(transparent)]
    Store(#[from] definitions::StoreError),
    /// The control server's thread could not start.
    #[error("starting the control server")]
    Spawn(#[source] std::io::Error),
    /// The socket passed by the service manager is not a control socket.
    #[error(transparent)]
    Activation(#[from] systemd::ActivationError),
    /// Instances still registered when the daemon stopped.
    #[error("{0} instance(s) could not be stopped (a device stuck in a call; see the log)")]
    NotStopped(usize),
}

/// The daemon: [`Daemon::builder`] sets one up, [`DaemonBuilder::run`] serves it.
#[derive(Debug)]
pub struct Daemon {
    _private: (),
}

/// How to build a parent once the directories are known ([`DaemonBuilder::parent_with`]).
type ParentFactory = Box<dyn FnOnce(&DaemonDirs) -> Result<Arc<dyn Parent>, BoxError> + Send>;

/// A parent, or how to build it.
enum ParentSource {
    Ready(Arc<dyn Parent>),
    Factory(ParentFactory),
}

/// A daemon being set up: its parents and options ([`Daemon::builder`]).
pub struct DaemonBuilder {
    config: DaemonConfig,
    signals: TerminationSignals,
    inherited: Option<SocketListener>,
    parents: Vec<ParentSource>,
    migration_checks: Vec<MigrationCheck>,
    stop: StopHandle,
}

impl std::fmt::Debug for DaemonBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonBuilder")
            .field("config", &self.config)
            .field("socket_activated", &self.inherited.is_some())
            .field("parents", &self.parents.len())
            .field("migration_checks", &self.migration_checks.len())
            .finish()
    }
}

impl Daemon {
    /// Start setting up a daemon with `config`.
    ///
    /// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread, so that the threads started
    /// after it (a parent's own, the daemon's) leave them to [`DaemonBuilder::run`], which
    /// waits for them. Call it before any thread is started (first thing in `main`), and
    /// build parents that start threads after it (or with [`DaemonBuilder::parent_with`]):
    /// a thread started earlier may take SIGTERM itself, which ends the process without the
    /// daemon's orderly stop.
    pub fn builder(config: DaemonConfig) -> DaemonBuilder {
        DaemonBuilder {
            config,
            signals: TerminationSignals::block_with_hangup(),
            inherited: None,
            parents: Vec::new(),
            migration_checks: Vec::new(),
            stop: StopHandle::default(),
        }
    }
}

impl DaemonBuilder {
    /// Serve `parent`'s types (a parent's name must be unique among the daemon's parents).
    pub fn parent(mut self, parent: Arc<dyn Parent>) -> DaemonBuilder {
        self.parents.push(ParentSource::Ready(parent));
        self
    }

    /// Serve the parent `build` returns, built by [`DaemonBuilder::run`] once the
    /// directories are checked, the state directory locked and the control socket bound:
    /// for a parent that keeps files under the state directory, or whose setup is costly
    /// or starts threads. An error stops the daemon from starting (as it is:
    /// [`DaemonError::Parent`]).
    pub fn parent_with<F>(mut self, build: F) -> DaemonBuilder
    where
        F: FnOnce(&DaemonDirs) -> Result<Arc<dyn Parent>, BoxError> + Send + 'static,
    {
        self.parents.push(ParentSource::Factory(Box::new(build)));
        self
    }

    /// Check a running instance before `migrate_save` saves its state for another daemon:
    /// an error refuses the migration with nothing changed, and is what the client gets
    /// (e.g. `not_migratable` with a hint). For what a parent knows and the migration stream
    /// does not carry (data outside the device's state). Every check added runs.
    pub fn migration_check<F>(mut self, check: F) -> DaemonBuilder
    where
        F: Fn(&InstanceInfo) -> Result<(), ControlError> + Send + Sync + 'static,
    {
        self.migration_checks.push(Arc::new(check));
        self
    }

    /// Take the control socket a service manager passed (socket activation,
    /// `sd_listen_fds(3)`; see [`systemd`]), if it passed one: the daemon serves on it
    /// instead of binding [`DaemonConfig::control`], and never removes it.
    ///
    /// # Safety
    /// Call it before any other thread is started: it clears `LISTEN_FDS` and `LISTEN_PID`
    /// (`std::env::remove_var`), which must not race another thread's reading of the
    /// environment.
    pub unsafe fn socket_activation(mut self) -> Result<DaemonBuilder, DaemonError> {
        // SAFETY: the caller guarantees no other thread runs (this function's contract).
        self.inherited = unsafe { systemd::inherited_control() }?;
        Ok(self)
    }

    /// A handle that stops the daemon from another thread as SIGTERM does: for a program
    /// that runs it on a thread of its own (a test).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Serve until SIGINT or SIGTERM (SIGHUP re-reads the definitions) or
    /// [`StopHandle::stop`]; then stop every instance and return. The steps: the module
    /// documentation's "Lifecycle".
    ///
    /// Run it on the thread that called [`Daemon::builder`] or on one started after it,
    /// which has the signals blocked.
    pub fn run(self) -> Result<(), DaemonError> {
        let DaemonBuilder {
            config,
            signals,
            inherited,
            parents,
            migration_checks,
            stop,
        } = self;
        let control_path = config
            .control
            .clone()
            .unwrap_or_else(|| config.socket_dir.join(paths::CONTROL_SOCKET));
        // Absolute from here on: the paths printed (QEMU lines, logs) work from any directory.
        let state_dir = paths::ensure_private_dir(&config.state_dir)?;
        let socket_dir = paths::ensure_private_dir(&config.socket_dir)?;
        let control_dir = control_path.parent().filter(|d| !d.as_os_str().is_empty());
        let control_path = match (control_dir, control_path.file_name()) {
            (Some(dir), Some(name)) => paths::ensure_private_dir(dir)?.join(name),
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
        let dirs = DaemonDirs {
            state_dir: state_dir.clone(),
            socket_dir: socket_dir.clone(),
            control: control_path.clone(),
        };
        let parents = parents
            .into_iter()
            .map(|p| match p {
                ParentSource::Ready(p) => Ok(p),
                ParentSource::Factory(build) => build(&dirs).map_err(DaemonError::Parent),
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut registry_config = RegistryConfig::new(&socket_dir);
        registry_config.release_timeout = config.release_timeout;
        registry_config.max_instances = config.max_instances;
        // Each instance's socket path replaces the template's.
        registry_config.server = config.server.clone();
        if config.server.allow_any_file_maps {
            tracing::warn!(
                "every instance accepts DMA_MAPs of any file (--allow-any-file-maps): a client \
                 whose file's page faults stall (FUSE) can stop threads other instances share"
            );
        }
        let teardown = registry_config.teardown_timeout;
        let registry = Arc::new(Registry::new(registry_config).map_err(DaemonError::Registry)?);
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
            migration_checks,
        ));
        let (started, failed) = service.autostart();
        if autostart > 0 {
            info!(started, failed, "autostart done");
        }
        let control_config = control::ControlConfig {
            request_timeout: config.control_timeout,
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

        let waiting = stop.begin_wait();
        let sig = loop {
            if !waiting {
                break libc::SIGTERM;
            }
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
        stop.end_wait();
        systemd::notify(&[
            NotifyState::Stopping,
            NotifyState::Status("stopping: every instance is stopped"),
        ]);
        info!(signal = sig, "stopping: no more control requests");
        // A request in hand may be a removal waiting for its client.
        let drain = config.release_timeout + teardown + Duration::from_secs(1);
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
            return Err(DaemonError::NotStopped(not_stopped));
        }
        Ok(())
    }
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
