//! The instance registry: parents, their types and the live instances by UUID.
//!
//! # Model
//! A [`Registry`] holds the registered [`Parent`]s and a map UUID → instance. An instance
//! is a device built by [`Parent::create`] and served exactly as a single device is served
//! alone: its own socket (`<socket_dir>/<uuid>.sock`), its own [`DmaSpace`] (configured by
//! [`RegistryConfig::dma`]), its own [`Server`] with its threads, one client at a time,
//! reconnects. The registry is a layer *above* `server`: nothing below it knows about
//! instances, and instances share no lock, thread or socket with each other. What they do
//! share, being one process, is budgeted per instance: the fd-backed DMA maps (VMAs and
//! SIGBUS slots) come from one pool in which each instance has a guarantee of the pool's
//! capacity / `max_instances` (at most [`crate::dma::DEFAULT_MAP_GUARANTEE`]) that no
//! other instance's client can take (`dma::budget`); the fds and bytes a connection holds
//! are bounded by its server ([`ServerConfig`]'s backlog limits and send timeout).
//!
//! # Invariants
//! - **Availability is derived, never counted.** What a parent's instances use of each
//!   resource is summed from the map's entries on every query (each entry keeps the needs
//!   of the type it was created as); a type's `available_instances` is what is left divided
//!   by what one instance needs. Removing an entry gives its share back by construction.
//! - **An entry exists from admission to the end of its removal.** [`Registry::create`]
//!   inserts the entry (state *creating*, no server yet) once the UUID is free and the
//!   resources are there, *then* builds the device and starts its server; a failure or a
//!   panic in either removes the entry again. So a slow `Parent::create` holds its share
//!   while it runs, and two creates can never both take the last share.
//! - **Removal gives the resources back only after the device is gone**: the server is
//!   stopped and joined (which drops the device, and with it whatever the device borrowed
//!   from its parent) before the entry leaves the map.
//! - The UUID is the canonical lowercase hyphenated form; the same UUID in another
//!   spelling is the same instance.
//!
//! # Locking
//! - The map is a `DashMap` (sharded locks): lookups and listings of different instances do
//!   not contend, and no map guard is ever held across a call into a device, a parent or a
//!   server, nor across a wait. Instances are `Arc`s cloned out of the map.
//! - `admission` (a mutex) serializes only the check-and-insert of a create: UUID free,
//!   instance limit, resources left, insert. It is held for that computation alone, never
//!   while a device is built or a server starts or stops.
//! - Each instance's served part (server and DMA space) is behind its own `RwLock`: listings
//!   read it; a removal reads it while it waits for the client, and writes it only to take
//!   the server out once the client is gone. A `removing` flag keeps a second removal of
//!   the same instance out (it gets `Busy`).
//! - Parents are in an `RwLock<Vec<_>>`, written only by [`Registry::add_parent`]; calls into
//!   a parent are made on a cloned `Arc`, not under that lock.
//!
//! No `slab`: a slab's dense, reused slot numbers would name nothing here (instances are
//! addressed, and their sockets named, by UUID; availability is a sum over the map), and a
//! slab needs one lock around it, which is what the sharded map avoids.
//!
//! # Removal with a client attached
//! As VFIO does when a device is unbound while a user holds it: signal the device-request
//! IRQ ([`Device::request_release`]; QEMU answers
//! by hot-unplugging the device), wait up to [`RegistryConfig::release_timeout`] for the
//! client to leave, then refuse with [`InstanceError::Busy`] (the instance stays, served)
//! unless forced. A forced removal disconnects the client; the server's teardown then runs
//! the device's unmap notifier and force-releases the pins it left, as on any disconnect,
//! and the removal is logged with what it released. A device that does not finish its
//! teardown within [`RegistryConfig::teardown_timeout`] (stuck in a call) makes the removal
//! fail with [`InstanceError::Stuck`]; the instance then stays registered, its resources
//! taken, until a later removal succeeds.
//!
//! A client that connects while a removal without a client is shutting the server down is
//! disconnected with the server.
//!
//! # Migrating an instance to another registry
//! [`Registry::save_state`] saves an instance that no client holds as a migration stream
//! (the one a VMM reads in STOP_COPY): under the device's lock (as a client's message
//! holds it) the device is stopped, saved and resumed, so it serves on unchanged. While a
//! client is attached it is refused: the client's VMM owns the guest RAM and interrupts
//! and migrates the device itself. [`Registry::create_with_state`] creates an instance as
//! [`Registry::create`] does (same checks, same reservation) and loads the stream into its
//! device before the server starts, so no client sees the device without its state; a
//! stream the device refuses fails the create and takes nothing.
//!
//! # Dropping the registry
//! Stops every instance's server at once and waits up to
//! [`RegistryConfig::teardown_timeout`] for them; the server of a device stuck in a call is
//! left behind (logged) rather than waited for without a bound.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tracing::{error, info, warn};

use super::availability;
use super::info::{InstanceInfo, RemovalReport, ResourceUsage, TypeInfo};
use super::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource, Screenshot};
use crate::device::{Device, DeviceError};
use crate::dma::{DmaConfig, DmaSpace, MapPool};
use crate::migration::stream::{self, StreamReader};
use crate::migration::{Migrate, MigrationError};
use crate::server::{RunningServer, Server, ServerConfig};

/// Name of the registry's own limit when it is what runs out ([`InstanceError::Exhausted`]).
pub const INSTANCES_RESOURCE: &str = "instances";

/// How a [`Registry`] serves its instances.
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    /// Directory of the instance sockets (`<uuid>.sock`); created with mode 0700 if
    /// missing.
    pub socket_dir: PathBuf,
    /// Server configuration of every instance (its `socket_path` is replaced by the
    /// instance's socket).
    pub server: ServerConfig,
    /// Configuration of every instance's DMA space.
    pub dma: DmaConfig,
    /// How long a removal waits for an attached client to let go after the device-request
    /// IRQ (default 10 s: a guest's PCIe hotplug driver waits 5 s after the attention
    /// button before it ejects).
    pub release_timeout: Duration,
    /// How long a removal waits for the server's teardown once the client is gone or
    /// disconnected (default 5 s).
    pub teardown_timeout: Duration,
    /// Most instances at once, over all parents (default 1024).
    pub max_instances: usize,
}

impl RegistryConfig {
    /// Defaults, with sockets in `socket_dir`.
    pub fn new(socket_dir: impl Into<PathBuf>) -> RegistryConfig {
        RegistryConfig {
            socket_dir: socket_dir.into(),
            server: ServerConfig::new(""),
            dma: DmaConfig::default(),
            release_timeout: Duration::from_secs(10),
            teardown_timeout: Duration::from_secs(5),
            max_instances: 1024,
        }
    }
}

/// The server and DMA space of an instance, present once it is served.
struct Served {
    server: RunningServer,
    dma: Arc<DmaSpace>,
}

/// One entry of the map.
struct Instance {
    uuid: String,
    parent: String,
    type_name: String,
    /// The needs of the type as it was when the instance was created (what it holds).
    needs: Vec<(String, u64)>,
    params: Params,
    socket: PathBuf,
    /// `None` while being created, and during the end of a removal.
    served: RwLock<Option<Served>>,
    /// A removal is under way.
    removing: AtomicBool,
}

impl Instance {
    fn served(&self) -> RwLockReadGuard<'_, Option<Served>> {
        self.served.read().unwrap_or_else(|p| p.into_inner())
    }

    fn served_mut(&self) -> RwLockWriteGuard<'_, Option<Served>> {
        self.served.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Its listing, or `None` while it is being created.
    fn info(&self) -> Option<InstanceInfo> {
        let served = self.served();
        let s = served.as_ref()?;
        Some(InstanceInfo {
            uuid: self.uuid.clone(),
            parent: self.parent.clone(),
            type_name: self.type_name.clone(),
            params: self.params.clone(),
            socket: self.socket.clone(),
            client_attached: s.server.client_attached(),
            dma: s.dma.stats(),
            map_share: s.dma.map_share(),
            backlog: s.server.backlog(),
        })
    }
}

/// The parents and the instances of one daemon. `Sync`: share it (`Arc`) between the
/// threads that serve control requests.
pub struct Registry {
    config: RegistryConfig,
    parents: RwLock<Vec<Arc<dyn Parent>>>,
    instances: DashMap<String, Arc<Instance>>,
    admission: Mutex<()>,
}

/// Removes a creating entry unless disarmed (a failed or panicking create).
struct Reservation<'a> {
    registry: &'a Registry,
    uuid: &'a str,
    armed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.registry.instances.remove(self.uuid);
        }
    }
}

/// Clears an instance's `removing` flag unless disarmed (a removal that gave up).
struct Removing<'a> {
    instance: &'a Instance,
    armed: bool,
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.instance.removing.store(false, Ordering::Release);
        }
    }
}

/// The canonical form of a UUID the admin gave.
fn canonical_uuid(s: &str) -> Result<String, InstanceError> {
    uuid::Uuid::parse_str(s)
        .map(|u| u.hyphenated().to_string())
        .map_err(|e| InstanceError::BadParam {
            name: "uuid".into(),
            why: format!("{s:?} is not a UUID: {e}"),
        })
}

/// A name the CLI can address: not empty, no `/`, no whitespace or control characters.
fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty()
        || name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "{what} name {name:?} must be non-empty, without '/' or whitespace"
        ));
    }
    Ok(())
}

/// Check a parent's declarations: names, uniqueness, needs of declared resources.
fn check_parent(parent: &dyn Parent) -> Result<(), String> {
    check_name("parent", parent.name())?;
    let resources = parent.resources();
    for (i, r) in resources.iter().enumerate() {
        check_name("resource", &r.name)?;
        if resources[..i].iter().any(|o| o.name == r.name) {
            return Err(format!("resource {:?} is declared twice", r.name));
        }
    }
    let types = parent.types();
    for (i, t) in types.iter().enumerate() {
        check_name("type", &t.name)?;
        if types[..i].iter().any(|o| o.name == t.name) {
            return Err(format!("type {:?} is declared twice", t.name));
        }
        for (need, _) in &t.needs {
            if !resources.iter().any(|r| &r.name == need) {
                return Err(format!(
                    "type {:?} needs {need:?}, which the parent does not declare",
                    t.name
                ));
            }
        }
    }
    Ok(())
}

/// The instance's device as a [`Migrate`], or `NotMigratable`.
fn migrate_of<'d>(
    device: &'d mut dyn Device,
    instance: &Instance,
) -> Result<&'d mut dyn Migrate, InstanceError> {
    device
        .migration()
        .ok_or_else(|| InstanceError::NotMigratable {
            uuid: instance.uuid.clone(),
            type_name: format!("{}/{}", instance.parent, instance.type_name),
        })
}

/// Maps a migration error of instance `uuid` while doing `what`.
fn mig<'u>(uuid: &'u str, what: &'static str) -> impl FnOnce(MigrationError) -> InstanceError + 'u {
    move |source| InstanceError::Migration {
        uuid: uuid.to_owned(),
        what,
        source,
    }
}

/// Load a migration stream into a new instance's device (see
/// [`Registry::create_with_state`]).
fn load_stream(
    device: &mut dyn Device,
    instance: &Instance,
    bytes: &[u8],
) -> Result<(), InstanceError> {
    let uuid = instance.uuid.as_str();
    let mig = |what| mig(uuid, what);
    let m = migrate_of(device, instance)?;
    m.stop().map_err(mig("stopping the new device"))?;
    let mut reader = StreamReader::new();
    reader
        .feed(bytes, m)
        .map_err(mig("the migration stream was refused"))?;
    let state = reader
        .finish()
        .map_err(mig("the migration stream was refused"))?;
    m.load(&state)
        .map_err(mig("the migrated state was refused"))?;
    m.resume().map_err(mig("resuming the loaded device"))?;
    info!(uuid, bytes = bytes.len(), "instance state loaded");
    Ok(())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

impl Registry {
    /// An empty registry; creates the socket directory (mode 0700) if it is missing.
    pub fn new(config: RegistryConfig) -> Result<Registry, InstanceError> {
        if !config.socket_dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&config.socket_dir)
                .map_err(|source| InstanceError::Io {
                    what: format!(
                        "creating the socket directory {}",
                        config.socket_dir.display()
                    ),
                    source,
                })?;
        }
        Ok(Registry {
            config,
            parents: RwLock::new(Vec::new()),
            instances: DashMap::new(),
            admission: Mutex::new(()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    fn parents(&self) -> Vec<Arc<dyn Parent>> {
        self.parents
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Register a parent. Its name must be new; its names must be addressable (no `/`, no
    /// whitespace) and unique, and every need of a type must name a declared resource.
    pub fn add_parent(&self, parent: Arc<dyn Parent>) -> Result<(), InstanceError> {
        let invalid = |why: String| InstanceError::InvalidParent {
            parent: parent.name().to_owned(),
            why,
        };
        check_parent(parent.as_ref()).map_err(invalid)?;
        let mut parents = self.parents.write().unwrap_or_else(|p| p.into_inner());
        if parents.iter().any(|p| p.name() == parent.name()) {
            return Err(invalid("a parent of that name is registered".into()));
        }
        info!(parent = parent.name(), "parent registered");
        parents.push(parent);
        Ok(())
    }

    /// Names of the registered parents, in registration order.
    pub fn parent_names(&self) -> Vec<String> {
        self.parents().iter().map(|p| p.name().to_owned()).collect()
    }

    /// What the entries of `parent` (live and being created) use of each of `resources`.
    fn usage(&self, parent: &str, resources: &[Resource]) -> Vec<u64> {
        let takers: Vec<Vec<(String, u64)>> = self
            .instances
            .iter()
            .filter(|e| e.value().parent == parent)
            .map(|e| e.value().needs.clone())
            .collect();
        availability::used(resources, takers.iter().map(Vec::as_slice))
    }

    /// Room left under the registry's instance limit.
    fn room(&self) -> u64 {
        self.config
            .max_instances
            .saturating_sub(self.instances.len()) as u64
    }

    /// Every type of every parent with its availability, computed now.
    pub fn types(&self) -> Vec<TypeInfo> {
        let mut out = Vec::new();
        for parent in self.parents() {
            let resources = parent.resources();
            let used = self.usage(parent.name(), &resources);
            let room = self.room();
            for t in parent.types() {
                out.push(TypeInfo {
                    parent: parent.name().to_owned(),
                    available_instances: availability::available(&t, &resources, &used).min(room),
                    instance_type: t,
                });
            }
        }
        out
    }

    /// Every resource of every parent with what its instances use of it, computed now.
    pub fn resources(&self) -> Vec<ResourceUsage> {
        let mut out = Vec::new();
        for parent in self.parents() {
            let resources = parent.resources();
            let used = self.usage(parent.name(), &resources);
            for (resource, used) in resources.into_iter().zip(used) {
                out.push(ResourceUsage {
                    parent: parent.name().to_owned(),
                    resource,
                    used,
                });
            }
        }
        out
    }

    /// Resolve `<parent>/<type>`, or a bare type name that one parent alone offers.
    fn resolve(&self, spec: &str) -> Result<(Arc<dyn Parent>, InstanceType), InstanceError> {
        let parents = self.parents();
        let unknown = || InstanceError::UnknownType(spec.to_owned());
        if let Some((pname, tname)) = spec.split_once('/') {
            let parent = parents
                .into_iter()
                .find(|p| p.name() == pname)
                .ok_or_else(unknown)?;
            let t = parent
                .types()
                .into_iter()
                .find(|t| t.name == tname)
                .ok_or_else(unknown)?;
            return Ok((parent, t));
        }
        let mut found: Vec<(Arc<dyn Parent>, InstanceType)> = parents
            .into_iter()
            .filter_map(|p| {
                let t = p.types().into_iter().find(|t| t.name == spec)?;
                Some((p, t))
            })
            .collect();
        match found.len() {
            0 => Err(unknown()),
            1 => Ok(found.remove(0)),
            _ => Err(InstanceError::AmbiguousType {
                name: spec.to_owned(),
                parents: found.iter().map(|(p, _)| p.name().to_owned()).collect(),
            }),
        }
    }

    /// Check-and-insert under the admission lock: the UUID is free, the instance limit and
    /// the parent's resources leave room for one more instance of `ty`.
    fn admit(
        &self,
        ty: &InstanceType,
        resources: &[Resource],
        instance: Arc<Instance>,
    ) -> Result<(), InstanceError> {
        let _admission = self.admission.lock().unwrap_or_else(|p| p.into_inner());
        if self.instances.contains_key(&instance.uuid) {
            return Err(InstanceError::UuidInUse(instance.uuid.clone()));
        }
        if self.room() == 0 {
            let slots = Resource {
                name: INSTANCES_RESOURCE.to_owned(),
                unit: INSTANCES_RESOURCE.to_owned(),
                total: 0,
            };
            return Err(slots.exhausted(&ty.name, 1, 0));
        }
        let used = self.usage(&instance.parent, resources);
        if let Some((r, needed, left)) = availability::shortfall(ty, resources, &used) {
            return Err(r.exhausted(&ty.name, needed, left));
        }
        self.instances.insert(instance.uuid.clone(), instance);
        Ok(())
    }

    /// Create an instance of `type_spec` (`<parent>/<type>`, or the bare type name when one
    /// parent alone offers it) with `uuid` (a new random v4 UUID if `None`) and `params`,
    /// and serve it. Checked in this order: the type, the UUID's syntax, the parameters
    /// ([`Parent::check_params`]), the UUID not in use, the resources left (the error names
    /// the one that ran out); then the device is built ([`Parent::create`]) and served on
    /// `<socket_dir>/<uuid>.sock`. A failure, or a panic in `Parent::create` or in the
    /// device while it is attached and served, is an error and takes nothing.
    pub fn create(
        &self,
        type_spec: &str,
        uuid: Option<&str>,
        params: &Params,
    ) -> Result<InstanceInfo, InstanceError> {
        self.create_inner(type_spec, uuid, params, None)
    }

    /// Create an instance as [`Registry::create`] does, with the state `stream` of a
    /// migrated instance (a migration stream as [`Registry::save_state`] writes it, or as a
    /// VMM reads it with MIG_DATA_READ) loaded into its device before its socket exists: no
    /// client ever sees the device without the state. The device goes through the arcs a
    /// VMM would drive: RUNNING → STOP ([`Migrate::stop`]),
    /// RESUMING (the stream's `Precopy` frames applied, the stream checked whole), STOP
    /// ([`Migrate::load`]), RUNNING. A device without
    /// migration is [`InstanceError::NotMigratable`]; a stream the device refuses (cut
    /// short, corrupted, another format or version, state of another device) is
    /// [`InstanceError::Migration`] saying why. Either way the instance is not created and
    /// takes nothing.
    pub fn create_with_state(
        &self,
        type_spec: &str,
        uuid: &str,
        params: &Params,
        stream: &[u8],
    ) -> Result<InstanceInfo, InstanceError> {
        self.create_inner(type_spec, Some(uuid), params, Some(stream))
    }

    fn create_inner(
        &self,
        type_spec: &str,
        uuid: Option<&str>,
        params: &Params,
        state: Option<&[u8]>,
    ) -> Result<InstanceInfo, InstanceError> {
        let (parent, ty) = self.resolve(type_spec)?;
        let uuid = match uuid {
            Some(u) => canonical_uuid(u)?,
            None => uuid::Uuid::new_v4().hyphenated().to_string(),
        };
        parent.check_params(&ty.name, params)?;
        let resources = parent.resources();
        let instance = Arc::new(Instance {
            uuid: uuid.clone(),
            parent: parent.name().to_owned(),
            type_name: ty.name.clone(),
            needs: ty.needs.clone(),
            params: params.clone(),
            socket: self.config.socket_dir.join(format!("{uuid}.sock")),
            served: RwLock::new(None),
            removing: AtomicBool::new(false),
        });
        self.admit(&ty, &resources, instance.clone())?;
        let mut reservation = Reservation {
            registry: self,
            uuid: &uuid,
            armed: true,
        };
        let served = catch_unwind(AssertUnwindSafe(|| {
            self.serve(parent.as_ref(), &instance, state)
        }))
        .unwrap_or_else(|p| {
            let why = format!(
                "parent {} panicked creating a {} instance: {}",
                parent.name(),
                ty.name,
                panic_message(p.as_ref())
            );
            error!("{why}");
            Err(InstanceError::Device(DeviceError::Io(io::Error::other(
                why,
            ))))
        })?;
        let info = InstanceInfo {
            uuid: uuid.clone(),
            parent: instance.parent.clone(),
            type_name: instance.type_name.clone(),
            params: instance.params.clone(),
            socket: instance.socket.clone(),
            client_attached: served.server.client_attached(),
            dma: served.dma.stats(),
            map_share: served.dma.map_share(),
            backlog: served.server.backlog(),
        };
        *instance.served_mut() = Some(served);
        reservation.armed = false;
        info!(
            uuid,
            parent = parent.name(),
            r#type = ty.name,
            socket = %instance.socket.display(),
            "instance created"
        );
        Ok(info)
    }

    /// The DMA configuration of a new instance: the registry's, drawing from one pool of
    /// fd-backed maps (the process's unless configured), with the guarantee lowered to
    /// the pool's capacity / `max_instances` so that every instance the registry admits
    /// gets its whole guarantee (see `dma::budget`).
    fn instance_dma_config(&self) -> DmaConfig {
        let mut dma = self.config.dma.clone();
        let pool = dma.map_pool.get_or_insert_with(MapPool::process).clone();
        let fair = pool.capacity() / self.config.max_instances.max(1) as u64;
        dma.map_guarantee = dma.map_guarantee.min(fair);
        dma
    }

    /// Build the device and start its server.
    fn serve(
        &self,
        parent: &dyn Parent,
        instance: &Instance,
        state: Option<&[u8]>,
    ) -> Result<Served, InstanceError> {
        let mut device = parent.create(CreateRequest {
            uuid: &instance.uuid,
            type_name: &instance.type_name,
            params: &instance.params,
        })?;
        if let Some(stream) = state {
            load_stream(device.as_mut(), instance, stream)?;
        }
        let dma_config = self.instance_dma_config();
        let wanted = dma_config.map_guarantee;
        let dma = DmaSpace::new(dma_config);
        let (given, cap) = dma.map_share();
        if given < wanted {
            warn!(
                uuid = %instance.uuid,
                guarantee = wanted,
                given,
                cap,
                "instance gets less than its guaranteed share of the process's DMA map budget"
            );
        }
        let mut config = self.config.server.clone();
        config.socket_path = instance.socket.clone();
        let server = Server::new(config, device, dma.clone())
            .spawn()
            .map_err(|e| InstanceError::Io {
                what: format!(
                    "serving instance {} on {}",
                    instance.uuid,
                    instance.socket.display()
                ),
                source: io::Error::other(e),
            })?;
        Ok(Served { server, dma })
    }

    /// The whole state of an instance that no client holds, as the migration stream a VMM
    /// would read in STOP_COPY (`Start`, `State`, `End` frames; for a PCI device the
    /// framework's PCI section and the device's own): the device is locked (as for a
    /// client's message), stopped ([`Migrate::stop`]),
    /// saved and resumed, so it serves on unchanged. [`Registry::create_with_state`] loads
    /// the stream into a new instance, here or in another registry.
    ///
    /// Refused with [`InstanceError::Attached`] while a client is attached (its VMM owns
    /// the guest RAM and interrupts and must drive the migration itself),
    /// [`InstanceError::NotMigratable`] for a device without migration, `Busy` while the
    /// instance is being created or removed or its device stays locked, and
    /// [`InstanceError::Migration`] when the device cannot stop or save (it is resumed if it
    /// stopped).
    pub fn save_state(&self, uuid: &str) -> Result<Vec<u8>, InstanceError> {
        let instance = self.get(uuid)?;
        let uuid = instance.uuid.as_str();
        let busy = || InstanceError::Busy(uuid.to_owned());
        if instance.removing.load(Ordering::Acquire) {
            return Err(busy());
        }
        let served = instance.served();
        let s = served.as_ref().ok_or_else(busy)?;
        let mig = |what| mig(uuid, what);
        s.server
            .with_device(self.config.teardown_timeout, |device| {
                // Under the device lock: a client that attaches from here on waits for it,
                // and the state saved is the one it finds.
                if s.server.client_attached() {
                    return Err(InstanceError::Attached(uuid.to_owned()));
                }
                let m = migrate_of(device, &instance)?;
                m.stop().map_err(mig("stopping the device"))?;
                let saved = m.save();
                let resumed = m.resume();
                let state = saved.map_err(mig("saving the device's state"))?;
                resumed.map_err(mig("resuming the device after saving its state"))?;
                let mut out = Vec::with_capacity(state.len() + 64);
                stream::write_start(&mut out).map_err(mig("framing the state"))?;
                stream::write_state_and_end(&state, &mut out).map_err(mig("framing the state"))?;
                info!(uuid, bytes = out.len(), "instance state saved");
                Ok(out)
            })
            .unwrap_or_else(|| Err(busy()))
    }

    /// Every served instance, by UUID.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        let all: Vec<Arc<Instance>> = self.instances.iter().map(|e| e.value().clone()).collect();
        let mut out: Vec<InstanceInfo> = all.iter().filter_map(|i| i.info()).collect();
        out.sort_by(|a, b| a.uuid.cmp(&b.uuid));
        out
    }

    fn get(&self, uuid: &str) -> Result<Arc<Instance>, InstanceError> {
        let no_such = || InstanceError::NoSuchInstance(uuid.to_owned());
        let key = canonical_uuid(uuid).map_err(|_| no_such())?;
        self.instances
            .get(&key)
            .map(|e| e.value().clone())
            .ok_or_else(no_such)
    }

    /// One served instance.
    pub fn instance(&self, uuid: &str) -> Result<InstanceInfo, InstanceError> {
        self.get(uuid)?
            .info()
            .ok_or_else(|| InstanceError::NoSuchInstance(uuid.to_owned()))
    }

    /// What scanout `scanout` of served instance `uuid` shows, as PNG
    /// ([`Parent::screenshot`]): [`InstanceError::NoDisplay`] for a parent whose devices
    /// have none. No lock of the registry is held while the parent captures and encodes.
    pub fn screenshot(&self, uuid: &str, scanout: u32) -> Result<Screenshot, InstanceError> {
        self.with_display(uuid, |parent, uuid| parent.screenshot(uuid, scanout))
    }

    /// Change the mode of scanout `scanout` of served instance `uuid` ([`Parent::resize`]):
    /// [`InstanceError::NoDisplay`] for a parent whose devices have none.
    pub fn resize(
        &self,
        uuid: &str,
        scanout: u32,
        width: u32,
        height: u32,
    ) -> Result<(), InstanceError> {
        self.with_display(uuid, |parent, uuid| {
            parent.resize(uuid, scanout, width, height)
        })
    }

    /// `op` on the parent of served instance `uuid`, outside the registry's locks; its
    /// `None` (the parent's devices have no display) becomes [`InstanceError::NoDisplay`].
    fn with_display<T>(
        &self,
        uuid: &str,
        op: impl FnOnce(&dyn Parent, &str) -> Option<Result<T, InstanceError>>,
    ) -> Result<T, InstanceError> {
        let instance = self.get(uuid)?;
        if instance.info().is_none() || instance.removing.load(Ordering::Acquire) {
            return Err(InstanceError::NoSuchInstance(uuid.to_owned()));
        }
        let parent = self
            .parents()
            .into_iter()
            .find(|p| p.name() == instance.parent)
            .ok_or_else(|| InstanceError::NoSuchInstance(uuid.to_owned()))?;
        op(parent.as_ref(), &instance.uuid).unwrap_or_else(|| {
            Err(InstanceError::NoDisplay {
                uuid: instance.uuid.clone(),
                type_name: format!("{}/{}", instance.parent, instance.type_name),
            })
        })
    }

    /// Remove an instance (see the module docs for the protocol with an attached client).
    /// Without `force`, a client that does not let go within the release timeout makes
    /// this fail with [`InstanceError::Busy`] and the instance stays served; with `force`
    /// the client is disconnected.
    pub fn remove(&self, uuid: &str, force: bool) -> Result<RemovalReport, InstanceError> {
        let instance = self.get(uuid)?;
        let uuid = instance.uuid.as_str();
        let busy = || InstanceError::Busy(uuid.to_owned());
        if instance.removing.swap(true, Ordering::AcqRel) {
            return Err(busy()); // another removal is under way
        }
        let mut removing = Removing {
            instance: &instance,
            armed: true,
        };
        let start = Instant::now();
        let mut report = RemovalReport {
            uuid: uuid.to_owned(),
            client_was_attached: false,
            release_requested: false,
            waited: Duration::ZERO,
            forced: false,
            dma: Default::default(),
        };
        {
            let served = instance.served();
            let Some(s) = served.as_ref() else {
                return Err(busy()); // still being created
            };
            report.client_was_attached = s.server.client_attached();
            if report.client_was_attached {
                let timeout = self.config.release_timeout;
                report.release_requested = s.server.request_release(timeout);
                if report.release_requested {
                    info!(
                        uuid,
                        "removal: device request IRQ signalled, waiting for the client"
                    );
                } else {
                    warn!(
                        uuid,
                        "removal: the client has no request IRQ registered; waiting for it to leave"
                    );
                }
                let gone = s
                    .server
                    .wait_client_gone(timeout.saturating_sub(start.elapsed()));
                report.waited = start.elapsed();
                if !gone {
                    if !force {
                        warn!(uuid, waited = ?report.waited, "removal refused: the client did not release the device");
                        return Err(busy());
                    }
                    report.forced = true;
                    s.server.disconnect_client();
                    if !s.server.wait_client_gone(self.config.teardown_timeout) {
                        error!(
                            uuid,
                            "forced removal: the device did not finish the client's teardown"
                        );
                        return Err(InstanceError::Stuck {
                            uuid: uuid.to_owned(),
                            waited: self.config.teardown_timeout,
                        });
                    }
                }
            }
        }
        let Some(served) = instance.served_mut().take() else {
            return Err(busy());
        };
        served.server.shutdown_handle().shutdown();
        let deadline = Instant::now() + self.config.teardown_timeout;
        while !served.server.is_finished() {
            if Instant::now() >= deadline {
                error!(
                    uuid,
                    "removal: the server did not stop; the instance stays registered"
                );
                *instance.served_mut() = Some(served);
                return Err(InstanceError::Stuck {
                    uuid: uuid.to_owned(),
                    waited: self.config.teardown_timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Err(e) = served.server.join() {
            warn!(uuid, error = %e, "the instance's server ended with an error");
        }
        report.dma = served.dma.stats();
        removing.armed = false;
        self.instances.remove(uuid);
        if report.forced {
            warn!(
                uuid,
                waited = ?report.waited,
                leaked_pins_released = report.dma.leaked_pins_released,
                pinned_pages = report.dma.pinned_pages,
                "forced removal: the client was disconnected"
            );
        }
        info!(uuid, "instance removed");
        Ok(report)
    }

    /// Stop every served instance at once, as a server's shutdown does (a daemon that is
    /// going away, not a device being removed): an attached client is disconnected without
    /// the device-request IRQ, its connection's teardown runs (unmap notifier, pins the
    /// device left force-released), and each server is waited for up to
    /// [`RegistryConfig::teardown_timeout`], all in the same window. One result per
    /// instance: its report (`forced` when a client was disconnected; the DMA
    /// counters after the teardown), `Busy` for one whose removal or creation is under way
    /// (left to it), or `Stuck` for a device stuck in a call (it stays registered, and
    /// dropping the registry leaves its server behind).
    pub fn stop_all(&self) -> Vec<Result<RemovalReport, InstanceError>> {
        let mut all: Vec<Arc<Instance>> =
            self.instances.iter().map(|e| e.value().clone()).collect();
        all.sort_by(|a, b| a.uuid.cmp(&b.uuid));
        let mut results = Vec::new();
        let mut stopping = Vec::new();
        for instance in all {
            if instance.removing.swap(true, Ordering::AcqRel) {
                results.push(Err(InstanceError::Busy(instance.uuid.clone())));
                continue;
            }
            let taken = instance.served_mut().take();
            match taken {
                Some(served) => {
                    let attached = served.server.client_attached();
                    served.server.shutdown_handle().shutdown();
                    stopping.push((instance, served, attached));
                }
                None => {
                    instance.removing.store(false, Ordering::Release);
                    results.push(Err(InstanceError::Busy(instance.uuid.clone())));
                }
            }
        }
        let deadline = Instant::now() + self.config.teardown_timeout;
        for (instance, served, attached) in stopping {
            let uuid = instance.uuid.as_str();
            while !served.server.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if !served.server.is_finished() {
                error!(
                    uuid,
                    "stop: the server did not stop; the instance stays registered"
                );
                *instance.served_mut() = Some(served);
                instance.removing.store(false, Ordering::Release);
                results.push(Err(InstanceError::Stuck {
                    uuid: uuid.to_owned(),
                    waited: self.config.teardown_timeout,
                }));
                continue;
            }
            if let Err(e) = served.server.join() {
                warn!(uuid, error = %e, "the instance's server ended with an error");
            }
            let dma = served.dma.stats();
            self.instances.remove(uuid);
            info!(
                uuid,
                client_disconnected = attached,
                pinned_pages = dma.pinned_pages,
                leaked_pins_released = dma.leaked_pins_released,
                "instance stopped"
            );
            results.push(Ok(RemovalReport {
                uuid: uuid.to_owned(),
                client_was_attached: attached,
                release_requested: false,
                waited: Duration::ZERO,
                forced: attached,
                dma,
            }));
        }
        results
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let all: Vec<Arc<Instance>> = self.instances.iter().map(|e| e.value().clone()).collect();
        let served: Vec<(&str, Served)> = all
            .iter()
            .filter_map(|i| Some((i.uuid.as_str(), i.served_mut().take()?)))
            .collect();
        for (_, s) in &served {
            s.server.shutdown_handle().shutdown();
        }
        let deadline = Instant::now() + self.config.teardown_timeout;
        for (uuid, s) in served {
            while !s.server.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if s.server.is_finished() {
                let _ = s.server.join();
            } else {
                error!(uuid, "the device is stuck: its server is left behind");
                // Not joined: dropping it would wait for the stuck thread.
                std::mem::forget(s.server);
            }
        }
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("socket_dir", &self.config.socket_dir)
            .field("parents", &self.parent_names())
            .field("instances", &self.instances.len())
            .finish()
    }
}
