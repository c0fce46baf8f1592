//! The daemon's operations: what each control request does to the registry (running
//! instances) and the store (definitions), with mdevctl's semantics.
//!
//! | request | running instance | definition |
//! |---|---|---|
//! | `create` | started now | none (transient), or written with autostart (`auto`) |
//! | `define` | untouched (a running instance given by UUID alone is defined as it runs) | written |
//! | `undefine` | keeps running, transient from then on | deleted |
//! | `start` | started from its definition | required |
//! | `stop` | stopped | kept |
//! | `remove` | stopped | deleted |
//!
//! # Invariants
//! - **One operation per UUID at a time.** Every request that changes an instance or a
//!   definition first claims the UUID; a second request on the same UUID meanwhile gets
//!   `busy` at once. Requests on different UUIDs run in parallel; nothing is held across a
//!   removal's wait but the claim of that one UUID.
//! - **A UUID names one thing.** `create` and `define` of a type refuse a UUID that a
//!   running instance, a definition or a broken definition file has.
//! - **The files are the truth after a restart.** The definitions in memory are what the
//!   store loaded at startup plus what this daemon wrote since, each written to its file
//!   before it is reported; a failed write leaves neither (a `create --auto` whose
//!   definition cannot be written stops the instance again).
//! - **A handed-over instance is served by no one here.** `migrate_save` (without
//!   `keep_source`) marks the definition first (`migrating_to`, written before anything
//!   else), then removes the instance, then keeps its state; a marked definition is never
//!   started (autostart, `start`), and the UUID is refused to `create`/`define` with
//!   `migrating_out`, until `migrate_finish` (state and definition forgotten),
//!   `migrate_abort` (served again with the kept state, or from the definition after a
//!   restart lost the state) or `remove` settles it. So a migration cut short never leaves
//!   two daemons serving the UUID.
//! - Definitions take no resources while they are not running (as mdevctl's do not): a
//!   `start` can fail with `exhausted`; an autostart that fails is logged and reported by
//!   `list --defined` until the instance starts.

mod reload;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::instance::{InstanceError, InstanceInfo, Params, Parent, Registry};
use tracing::{info, warn};

use super::definitions::{canonical_uuid, Definition, Loaded, Store, DEFINITION_VERSION};
use super::protocol::{
    BrokenRow, ControlError, DefinedReply, DefinitionRow, DefinitionsReply, ErrorKind, InstanceRow,
    InstancesReply, Need, RemovedReply, Reply, Request, ResizedReply, ResourceRow, SavedReply,
    ScreenshotReply, StartedReply, TypeRow, TypesReply, UndefinedReply,
};

/// The definitions in memory.
#[derive(Default)]
struct Defs {
    defined: BTreeMap<String, Definition>,
    broken: Vec<BrokenRow>,
    /// Why the last autostart of a definition failed, until it starts.
    start_errors: BTreeMap<String, String>,
}

impl Defs {
    fn broken_of(&self, uuid: &str) -> Option<&BrokenRow> {
        self.broken.iter().find(|b| b.uuid.as_deref() == Some(uuid))
    }
}

/// An instance `migrate_save` handed over: removed from the registry, its state kept until
/// `migrate_finish` forgets it or `migrate_abort` serves it again.
struct Outgoing {
    type_spec: String,
    params: Params,
    state: Payload,
    to: PathBuf,
}

/// A payload sent after a reply (a saved state), shared with what the daemon keeps of it.
pub type Payload = Arc<Vec<u8>>;

/// A parent-specific check of a running instance before `migrate_save` saves its state for
/// another daemon (`DaemonBuilder::migration_check`): an error refuses the migration with
/// nothing changed.
pub type MigrationCheck = Arc<dyn Fn(&InstanceInfo) -> Result<(), ControlError> + Send + Sync>;

/// The registry, the parents registered in it, and the definitions.
pub struct Service {
    registry: Arc<Registry>,
    parents: Vec<Arc<dyn Parent>>,
    store: Store,
    defs: Mutex<Defs>,
    claims: Mutex<HashSet<String>>,
    outgoing: Mutex<BTreeMap<String, Outgoing>>,
    migration_checks: Vec<MigrationCheck>,
}

/// A UUID claimed by an operation; released on drop.
struct Claim<'a> {
    service: &'a Service,
    uuid: String,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        lock(&self.service.claims).remove(&self.uuid);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `e` and its sources, joined with ": ".
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What the admin was doing, for the hints of errors.
#[derive(Clone, Copy)]
enum Op {
    Create,
    Define,
    Start,
    Stop,
    Remove,
    Migrate,
    Screenshot,
    Resize,
}

/// The control error of a registry error during `op` on `uuid`.
fn instance_error(e: InstanceError, op: Op, uuid: &str) -> ControlError {
    let message = chain(&e);
    let err = |kind| ControlError::new(kind, message.clone());
    match e {
        InstanceError::UnknownType(_) => {
            err(ErrorKind::UnknownType).hint("`umdev types` lists the types")
        }
        InstanceError::AmbiguousType { .. } => err(ErrorKind::AmbiguousType),
        InstanceError::Exhausted { .. } => err(ErrorKind::Exhausted).hint(
            "`umdev types` shows what is left of each resource; stopping an instance gives \
             its share back",
        ),
        InstanceError::UuidInUse(_) => err(ErrorKind::UuidInUse)
            .hint("`umdev list` and `umdev list --defined` show the UUIDs in use"),
        InstanceError::NoSuchInstance(_) => err(ErrorKind::NoSuchInstance),
        InstanceError::BadParam { .. } => err(ErrorKind::BadParam),
        InstanceError::Busy(_) => {
            let cmd = match op {
                Op::Stop => "stop",
                _ => "remove",
            };
            err(ErrorKind::Busy).hint(format!(
                "the client was asked to release the device and did not; `umdev {cmd} {uuid} \
                 --force` disconnects it (its DMA maps and pins are released)"
            ))
        }
        InstanceError::Stuck { .. } => err(ErrorKind::Stuck)
            .hint("the instance stays registered; try again later, or restart the daemon"),
        InstanceError::Device(_) => err(ErrorKind::Device),
        InstanceError::Io { .. } => err(ErrorKind::Io),
        InstanceError::InvalidParent { .. } => err(ErrorKind::Internal),
        InstanceError::Attached(_) => err(ErrorKind::Attached).hint(format!(
            "the VMM must migrate an attached device (it drives STOP_COPY here and RESUMING \
             there); `umdev migrate {uuid} --to DST --prepare` creates the destination \
             instance for it, or detach the client and run `umdev migrate` again"
        )),
        InstanceError::NotMigratable { .. } => err(ErrorKind::NotMigratable),
        InstanceError::Migration { .. } => err(ErrorKind::Migration),
        InstanceError::NoDisplay { .. } => err(ErrorKind::NoDisplay)
            .hint("only virtio-gpu instances have a display (`umdev list` shows the types)"),
        InstanceError::DisplayRefused { .. } => err(ErrorKind::BadParam),
        InstanceError::NothingShown { .. } => err(ErrorKind::NothingShown).hint(
            "the guest's driver sets a scanout when it starts (the console or a desktop); \
             try again once the guest has booted",
        ),
    }
}

/// The canonical UUID of a display request (`what`) to a daemon, which needs one.
fn display_uuid(uuid: Option<&str>, what: &str) -> Result<String, ControlError> {
    let uuid = uuid.ok_or_else(|| {
        ControlError::new(
            ErrorKind::BadParam,
            format!("a daemon serves many instances: the {what} request needs a UUID"),
        )
        .hint("`umdev list` lists the running instances")
    })?;
    canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))
}

/// The control error of a display request's registry error.
fn display_error(e: InstanceError, op: Op, uuid: &str) -> ControlError {
    match e {
        InstanceError::NoSuchInstance(_) => {
            instance_error(e, op, uuid).hint("`umdev list` lists the running instances")
        }
        e => instance_error(e, op, uuid),
    }
}

fn bad_uuid(uuid: &str) -> ControlError {
    ControlError::new(
        ErrorKind::BadParam,
        format!("{uuid:?} is not a UUID (e.g. 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11)"),
    )
}

fn instance_row(i: InstanceInfo, defs: &Defs) -> InstanceRow {
    let def = defs.defined.get(&i.uuid);
    InstanceRow {
        budget: (&i).into(),
        defined: def.is_some(),
        autostart: def.is_some_and(|d| d.autostart),
        uuid: i.uuid,
        parent: i.parent,
        type_name: i.type_name,
        params: i.params,
        socket: i.socket,
        client_attached: i.client_attached,
        dma: i.dma.into(),
    }
}

impl Service {
    /// A service over `registry` (whose parents are `parents`) and the definitions
    /// `loaded` from `store`; `migration_checks` run before a state is saved for another
    /// daemon.
    pub fn new(
        registry: Arc<Registry>,
        parents: Vec<Arc<dyn Parent>>,
        store: Store,
        loaded: Loaded,
        migration_checks: Vec<MigrationCheck>,
    ) -> Service {
        Service {
            registry,
            parents,
            store,
            defs: Mutex::new(Defs {
                defined: loaded.definitions,
                broken: loaded.broken,
                start_errors: BTreeMap::new(),
            }),
            claims: Mutex::new(HashSet::new()),
            outgoing: Mutex::new(BTreeMap::new()),
            migration_checks,
        }
    }

    fn claim(&self, uuid: &str) -> Result<Claim<'_>, ControlError> {
        if !lock(&self.claims).insert(uuid.to_owned()) {
            return Err(ControlError::new(
                ErrorKind::Busy,
                format!("another operation on {uuid} is under way"),
            ));
        }
        Ok(Claim {
            service: self,
            uuid: uuid.to_owned(),
        })
    }

    fn definition_row(&self, def: &Definition, defs: &Defs) -> DefinitionRow {
        DefinitionRow {
            uuid: def.uuid.clone(),
            parent: def.parent.clone(),
            type_name: def.type_name.clone(),
            params: def.params.clone(),
            autostart: def.autostart,
            running: self.registry.instance(&def.uuid).is_ok(),
            path: self.store.path_of(&def.uuid),
            start_error: defs.start_errors.get(&def.uuid).cloned(),
            migrating_to: def.migrating_to.clone(),
        }
    }

    /// Start every definition marked autostart; log each outcome. Returns (started,
    /// failed).
    pub fn autostart(&self) -> (usize, usize) {
        let autos: Vec<Definition> = lock(&self.defs)
            .defined
            .values()
            .filter(|d| d.autostart)
            .cloned()
            .collect();
        let (autos, handed_over): (Vec<_>, Vec<_>) =
            autos.into_iter().partition(|d| d.migrating_to.is_none());
        for def in handed_over {
            let to = def.migrating_to.unwrap_or_default();
            warn!(
                uuid = %def.uuid,
                to = %to.display(),
                "autostart: not started, `umdev migrate` handed it over and did not settle \
                 (`umdev migrate UUID --to DST --recover` does)"
            );
        }
        let (mut started, mut failed) = (0, 0);
        for def in autos {
            match self.start_definition(&def) {
                Ok(info) => {
                    started += 1;
                    info!(uuid = %def.uuid, socket = %info.socket.display(), "autostart: started");
                }
                Err(e) => {
                    failed += 1;
                    let why = chain(&e);
                    warn!(uuid = %def.uuid, error = %why, "autostart failed");
                    lock(&self.defs).start_errors.insert(def.uuid.clone(), why);
                }
            }
        }
        (started, failed)
    }

    fn start_definition(&self, def: &Definition) -> Result<InstanceInfo, InstanceError> {
        let info = self
            .registry
            .create(&def.type_spec(), Some(&def.uuid), &def.params)?;
        lock(&self.defs).start_errors.remove(&def.uuid);
        Ok(info)
    }

    /// Answer one request that carries no payload.
    #[cfg(test)]
    pub fn handle(&self, request: Request) -> Result<Reply, ControlError> {
        self.handle_with_payload(request, Vec::new())
            .map(|(r, _)| r)
    }

    /// Answer one request with the payload that followed it (`migrate_load`'s state);
    /// returns the reply and its payload (`migrate_save`'s state; empty for the others).
    pub fn handle_with_payload(
        &self,
        request: Request,
        payload: Vec<u8>,
    ) -> Result<(Reply, Payload), ControlError> {
        let reply = match request {
            Request::MigrateSave {
                uuid,
                keep_source,
                to,
            } => return self.migrate_save(&uuid, keep_source, to),
            Request::MigrateLoad {
                uuid,
                type_spec,
                params,
                define,
                autostart,
                state_len: _,
            } => self.migrate_load(&uuid, &type_spec, &params, define, autostart, &payload),
            Request::MigrateFinish { uuid } => self.migrate_finish(&uuid),
            Request::MigrateAbort { uuid } => self.migrate_abort(&uuid),
            Request::Screenshot { uuid, scanout } => {
                return self.screenshot(uuid.as_deref(), scanout)
            }
            Request::Resize {
                uuid,
                scanout,
                width,
                height,
            } => self.resize(uuid.as_deref(), scanout, width, height),
            other => self.handle_plain(other),
        }?;
        Ok((reply, Payload::default()))
    }

    fn handle_plain(&self, request: Request) -> Result<Reply, ControlError> {
        match request {
            Request::Types => Ok(Reply::Types(self.types())),
            Request::List { defined: false } => Ok(Reply::Instances(self.list())),
            Request::List { defined: true } => Ok(Reply::Definitions(self.list_defined())),
            Request::Create {
                type_spec,
                uuid,
                params,
                auto,
            } => self.create(&type_spec, uuid.as_deref(), &params, auto),
            Request::Define {
                type_spec,
                uuid,
                params,
                auto,
            } => self.define(type_spec.as_deref(), uuid.as_deref(), &params, auto),
            Request::Undefine { uuid } => self.undefine(&uuid),
            Request::Start { uuid } => self.start(&uuid),
            Request::Stop { uuid, force } => self.stop_or_remove(&uuid, force, Op::Stop),
            Request::Remove { uuid, force } => self.stop_or_remove(&uuid, force, Op::Remove),
            Request::MigrateSave { .. }
            | Request::MigrateLoad { .. }
            | Request::MigrateFinish { .. }
            | Request::MigrateAbort { .. }
            | Request::Screenshot { .. }
            | Request::Resize { .. } => Err(ControlError::new(
                ErrorKind::Internal,
                "a request with a payload without its payload handling (a bug)",
            )),
        }
    }

    /// `migrate_save`: the state of a running instance no client holds; handed over unless
    /// `keep_source` ([`Service::hand_over`]).
    fn migrate_save(
        &self,
        uuid: &str,
        keep_source: bool,
        to: Option<PathBuf>,
    ) -> Result<(Reply, Payload), ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        self.check_not_outgoing(&uuid)?;
        let info = self.running(&uuid)?;
        for check in &self.migration_checks {
            check(&info)?;
        }
        let state: Payload = Arc::new(
            self.registry
                .save_state(&uuid)
                .map_err(|e| instance_error(e, Op::Migrate, &uuid))?,
        );
        let row = instance_row(info.clone(), &lock(&self.defs));
        if !keep_source {
            let to = to.unwrap_or_else(|| PathBuf::from("(not given)"));
            self.hand_over(&uuid, &info, &state, to)?;
        }
        info!(
            uuid,
            bytes = state.len(),
            handed_over = !keep_source,
            "migration: state saved for another daemon"
        );
        let reply = SavedReply {
            instance: row,
            state_len: state.len() as u64,
            handed_over: !keep_source,
        };
        Ok((Reply::Saved(reply), state))
    }

    /// `screenshot`: what a scanout of running instance `uuid` shows, as PNG (the payload).
    fn screenshot(
        &self,
        uuid: Option<&str>,
        scanout: u32,
    ) -> Result<(Reply, Payload), ControlError> {
        let uuid = display_uuid(uuid, "screenshot")?;
        let shot = self
            .registry
            .screenshot(&uuid, scanout)
            .map_err(|e| display_error(e, Op::Screenshot, &uuid))?;
        let png_len = shot.png.len() as u64;
        if png_len > super::protocol::MAX_PAYLOAD {
            return Err(ControlError::new(
                ErrorKind::Internal,
                format!("instance {uuid}: a PNG of {png_len} bytes is larger than a reply carries"),
            ));
        }
        let reply = ScreenshotReply {
            uuid: Some(uuid),
            scanout,
            width: shot.width,
            height: shot.height,
            png_len,
        };
        Ok((Reply::Screenshot(reply), Arc::new(shot.png)))
    }

    /// `resize`: a new mode for a scanout of running instance `uuid`.
    fn resize(
        &self,
        uuid: Option<&str>,
        scanout: u32,
        width: u32,
        height: u32,
    ) -> Result<Reply, ControlError> {
        let uuid = display_uuid(uuid, "resize")?;
        self.registry
            .resize(&uuid, scanout, width, height)
            .map_err(|e| display_error(e, Op::Resize, &uuid))?;
        info!(
            uuid,
            scanout, width, height, "display resized from the host"
        );
        Ok(Reply::Resized(ResizedReply {
            uuid: Some(uuid),
            scanout,
            width,
            height,
        }))
    }

    /// Hand the instance over: mark its definition (a restart from here on does not start
    /// it again), remove it (its socket goes: no client attaches here any more), keep its
    /// state. Any failure leaves it served and its definition unmarked.
    fn hand_over(
        &self,
        uuid: &str,
        info: &InstanceInfo,
        state: &Payload,
        to: PathBuf,
    ) -> Result<(), ControlError> {
        let def = lock(&self.defs).defined.get(uuid).cloned();
        if let Some(def) = &def {
            let mut marked = def.clone();
            marked.migrating_to = Some(to.clone());
            self.write_definition(marked)?;
        }
        let unmark = || {
            if let Some(def) = def.clone() {
                if let Err(e) = self.write_definition(def) {
                    warn!(uuid, error = %e.message, "the definition's migration mark could not be removed");
                }
            }
        };
        let outgoing = Outgoing {
            type_spec: format!("{}/{}", info.parent, info.type_name),
            params: info.params.clone(),
            state: state.clone(),
            to,
        };
        match self.registry.remove(uuid, false) {
            Ok(report) if !report.client_was_attached => {}
            Ok(_) => {
                // A client attached between the save and the removal, and let go when asked:
                // the state may miss what it did. Serve the instance again as saved.
                warn!(
                    uuid,
                    "migration: a client attached while the instance was handed over; it \
                     serves on here"
                );
                let restored = self.registry.create_with_state(
                    &outgoing.type_spec,
                    uuid,
                    &outgoing.params,
                    state,
                );
                if let Err(e) = restored {
                    // Kept as handed over (marked, state kept): `--recover` serves it again.
                    let to = outgoing.to.display().to_string();
                    lock(&self.outgoing).insert(uuid.to_owned(), outgoing);
                    return Err(instance_error(e, Op::Migrate, uuid).hint(format!(
                        "its state is kept here: `umdev migrate {uuid} --to {to} --recover` \
                         serves it again once the cause is gone"
                    )));
                }
                unmark();
                return Err(instance_error(
                    InstanceError::Attached(uuid.to_owned()),
                    Op::Migrate,
                    uuid,
                ));
            }
            Err(e) => {
                unmark();
                return Err(instance_error(e, Op::Migrate, uuid));
            }
        }
        lock(&self.outgoing).insert(uuid.to_owned(), outgoing);
        Ok(())
    }

    /// `migrating_out` if `migrate_save` handed `uuid` over and nothing settled it yet.
    fn check_not_outgoing(&self, uuid: &str) -> Result<(), ControlError> {
        let to = lock(&self.outgoing)
            .get(uuid)
            .map(|o| o.to.clone())
            .or_else(|| {
                lock(&self.defs)
                    .defined
                    .get(uuid)
                    .and_then(|d| d.migrating_to.clone())
            });
        match to {
            None => Ok(()),
            Some(to) => Err(ControlError::new(
                ErrorKind::MigratingOut,
                format!(
                    "{uuid} was handed over to the daemon of {} by `umdev migrate`, which did \
                     not settle",
                    to.display()
                ),
            )
            .hint(format!(
                "`umdev migrate {uuid} --to {} --recover` settles it: the source's copy is \
                 removed if the destination serves the instance, served again otherwise",
                to.display()
            ))),
        }
    }

    /// The running instance `uuid`, or `no_such_instance` with a hint.
    fn running(&self, uuid: &str) -> Result<InstanceInfo, ControlError> {
        self.registry.instance(uuid).map_err(|e| {
            instance_error(e, Op::Migrate, uuid).hint(
                "`umdev list` lists the running instances (a stopped instance has no state to \
                 migrate: define it on the other daemon instead)",
            )
        })
    }

    /// `migrate_load`: a new instance with a migrated state, defined if `define`.
    fn migrate_load(
        &self,
        uuid: &str,
        type_spec: &str,
        params: &Params,
        define: bool,
        autostart: bool,
        state: &[u8],
    ) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        self.check_free(&uuid, Op::Migrate)?;
        let info = self
            .registry
            .create_with_state(type_spec, &uuid, params, state)
            .map_err(|e| instance_error(e, Op::Migrate, &uuid))?;
        let definition = if define {
            Some(self.define_started(&uuid, &info, autostart)?)
        } else {
            None
        };
        info!(
            uuid,
            bytes = state.len(),
            "migration: instance created with its state"
        );
        let defs = lock(&self.defs);
        Ok(Reply::Started(StartedReply {
            instance: instance_row(info, &defs),
            definition,
        }))
    }

    /// `migrate_finish`: forget a handed-over instance: its kept state and its marked
    /// definition.
    fn migrate_finish(&self, uuid: &str) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        let held = lock(&self.outgoing).contains_key(&uuid);
        let marked = lock(&self.defs)
            .defined
            .get(&uuid)
            .is_some_and(|d| d.migrating_to.is_some());
        if !held && !marked {
            return Err(self.not_handed_over(&uuid));
        }
        let mut undefined = None;
        if marked {
            let path = self.store.path_of(&uuid);
            self.store.delete(&path).map_err(|e| {
                ControlError::new(
                    ErrorKind::Io,
                    format!("deleting the definition: {}", chain(&e)),
                )
            })?;
            let mut defs = lock(&self.defs);
            defs.defined.remove(&uuid);
            defs.start_errors.remove(&uuid);
            undefined = Some(path);
        }
        lock(&self.outgoing).remove(&uuid);
        info!(
            uuid,
            "migration finished: the instance is the destination's"
        );
        Ok(Reply::Removed(RemovedReply {
            uuid,
            stopped: None,
            undefined,
        }))
    }

    /// `migrate_abort`: serve a handed-over instance again with its kept state, or (after a
    /// restart of this daemon, which lost the state) from its marked definition; the mark
    /// goes.
    fn migrate_abort(&self, uuid: &str) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        let marked = lock(&self.defs)
            .defined
            .get(&uuid)
            .filter(|d| d.migrating_to.is_some())
            .cloned();
        let held = lock(&self.outgoing).remove(&uuid);
        let info = match (held, &marked) {
            (None, None) => return Err(self.not_handed_over(&uuid)),
            (Some(held), _) => {
                match self.registry.create_with_state(
                    &held.type_spec,
                    &uuid,
                    &held.params,
                    &held.state,
                ) {
                    Ok(info) => info,
                    Err(e) => {
                        let err = instance_error(e, Op::Migrate, &uuid).hint(
                            "its state is kept here: settle the migration again once the cause \
                             is gone",
                        );
                        lock(&self.outgoing).insert(uuid, held);
                        return Err(err);
                    }
                }
            }
            (None, Some(def)) => {
                warn!(
                    uuid,
                    "migration aborted after a restart of this daemon: its state is lost, the \
                     instance starts from its definition"
                );
                let mut def = def.clone();
                def.migrating_to = None;
                self.start_definition(&def)
                    .map_err(|e| instance_error(e, Op::Start, &uuid))?
            }
        };
        if let Some(mut def) = marked {
            def.migrating_to = None;
            if let Err(e) = self.write_definition(def) {
                warn!(uuid, error = %e.message, "the definition's migration mark could not be removed");
            }
        }
        info!(uuid, "migration aborted: the instance serves here again");
        let defs = lock(&self.defs);
        Ok(Reply::Started(StartedReply {
            instance: instance_row(info, &defs),
            definition: None,
        }))
    }

    fn not_handed_over(&self, uuid: &str) -> ControlError {
        let why = if self.registry.instance(uuid).is_ok() {
            "it runs here"
        } else {
            "this daemon has no instance or definition of it"
        };
        ControlError::new(
            ErrorKind::Migration,
            format!("{uuid} is not handed over by this daemon: {why}"),
        )
    }

    fn types(&self) -> TypesReply {
        let resources = self.registry.resources();
        let unit_of = |parent: &str, name: &str| {
            resources
                .iter()
                .find(|r| r.parent == parent && r.resource.name == name)
                .map(|r| r.resource.unit.clone())
        };
        let types = self
            .registry
            .types()
            .into_iter()
            .map(|t| TypeRow {
                needs: t
                    .instance_type
                    .needs
                    .iter()
                    .map(|(resource, amount)| Need {
                        resource: resource.clone(),
                        amount: *amount,
                    })
                    .collect(),
                parent: t.parent,
                type_name: t.instance_type.name,
                description: t.instance_type.description,
                device_api: t.instance_type.device_api,
                available_instances: t.available_instances,
            })
            .collect();
        let resources = resources
            .iter()
            .map(|r| ResourceRow {
                parent: r.parent.clone(),
                resource: r.resource.name.clone(),
                unit: unit_of(&r.parent, &r.resource.name).unwrap_or_default(),
                used: r.used,
                total: r.resource.total,
            })
            .collect();
        TypesReply { types, resources }
    }

    fn list(&self) -> InstancesReply {
        let running = self.registry.instances();
        let defs = lock(&self.defs);
        InstancesReply {
            instances: running
                .into_iter()
                .map(|i| instance_row(i, &defs))
                .collect(),
        }
    }

    fn list_defined(&self) -> DefinitionsReply {
        let defs = lock(&self.defs);
        DefinitionsReply {
            definitions: defs
                .defined
                .values()
                .map(|d| self.definition_row(d, &defs))
                .collect(),
            broken: defs.broken.clone(),
        }
    }

    /// The UUID is free for a new definition or instance: not handed over, no definition
    /// (readable or broken) and no running instance.
    fn check_free(&self, uuid: &str, op: Op) -> Result<(), ControlError> {
        self.check_not_outgoing(uuid)?;
        let defs = lock(&self.defs);
        let in_use = |why: String| ControlError::new(ErrorKind::UuidInUse, why);
        if defs.defined.contains_key(uuid) {
            let e = in_use(format!("UUID {uuid} is in use: it has a definition"));
            return Err(match op {
                Op::Create => e.hint(format!("`umdev start {uuid}` starts it")),
                _ => e.hint(format!("`umdev undefine {uuid}` deletes it")),
            });
        }
        if let Some(b) = defs.broken_of(uuid) {
            return Err(in_use(format!(
                "UUID {uuid} is in use: its definition file {} is malformed ({})",
                b.path.display(),
                b.error
            ))
            .hint(format!(
                "fix the file and restart the daemon, or `umdev undefine {uuid}` deletes it"
            )));
        }
        drop(defs);
        if self.registry.instance(uuid).is_ok() {
            let e = in_use(format!("UUID {uuid} is in use: an instance is running"));
            return Err(match op {
                Op::Define => e.hint(format!(
                    "`umdev define --uuid {uuid}` (without --type) defines it as it runs"
                )),
                _ => e,
            });
        }
        Ok(())
    }

    fn canonical(&self, uuid: Option<&str>) -> Result<String, ControlError> {
        match uuid {
            Some(u) => canonical_uuid(u).ok_or_else(|| bad_uuid(u)),
            None => Ok(uuid::Uuid::new_v4().hyphenated().to_string()),
        }
    }

    /// Define the instance just started (`info`), as `create --auto` and a migration's
    /// destination do; if the definition cannot be written the instance is stopped again,
    /// so that no started instance is left behind an error.
    fn define_started(
        &self,
        uuid: &str,
        info: &InstanceInfo,
        autostart: bool,
    ) -> Result<PathBuf, ControlError> {
        let def = Definition {
            version: DEFINITION_VERSION,
            uuid: uuid.to_owned(),
            parent: info.parent.clone(),
            type_name: info.type_name.clone(),
            params: info.params.clone(),
            autostart,
            migrating_to: None,
        };
        self.write_definition(def).inspect_err(|_| {
            warn!(
                uuid,
                "the definition could not be written: stopping the instance again"
            );
            if let Err(stop) = self.registry.remove(uuid, true) {
                warn!(uuid, error = %chain(&stop), "stopping the instance failed");
            }
        })
    }

    fn write_definition(&self, def: Definition) -> Result<PathBuf, ControlError> {
        let path = self.store.write(&def).map_err(|e| {
            ControlError::new(
                ErrorKind::Io,
                format!("writing the definition: {}", chain(&e)),
            )
        })?;
        info!(uuid = %def.uuid, r#type = %def.type_spec(), autostart = def.autostart, path = %path.display(), "defined");
        lock(&self.defs).defined.insert(def.uuid.clone(), def);
        Ok(path)
    }

    fn create(
        &self,
        type_spec: &str,
        uuid: Option<&str>,
        params: &Params,
        auto: bool,
    ) -> Result<Reply, ControlError> {
        let uuid = self.canonical(uuid)?;
        let _claim = self.claim(&uuid)?;
        self.check_free(&uuid, Op::Create)?;
        let info = self
            .registry
            .create(type_spec, Some(&uuid), params)
            .map_err(|e| instance_error(e, Op::Create, &uuid))?;
        let definition = if auto {
            Some(self.define_started(&uuid, &info, true)?)
        } else {
            None
        };
        let defs = lock(&self.defs);
        Ok(Reply::Started(StartedReply {
            instance: instance_row(info, &defs),
            definition,
        }))
    }

    /// Resolve a type as the registry does: `<parent>/<type>` or a bare name one parent
    /// alone offers.
    fn resolve(&self, spec: &str) -> Result<(Arc<dyn Parent>, String), ControlError> {
        let unknown =
            || instance_error(InstanceError::UnknownType(spec.to_owned()), Op::Define, "");
        let offers = |p: &Arc<dyn Parent>, t: &str| p.types().iter().any(|ty| ty.name == t);
        if let Some((pname, tname)) = spec.split_once('/') {
            let parent = self
                .parents
                .iter()
                .find(|p| p.name() == pname && offers(p, tname))
                .ok_or_else(unknown)?;
            return Ok((parent.clone(), tname.to_owned()));
        }
        let found: Vec<&Arc<dyn Parent>> =
            self.parents.iter().filter(|p| offers(p, spec)).collect();
        match found.as_slice() {
            [] => Err(unknown()),
            [one] => Ok(((*one).clone(), spec.to_owned())),
            many => Err(instance_error(
                InstanceError::AmbiguousType {
                    name: spec.to_owned(),
                    parents: many.iter().map(|p| p.name().to_owned()).collect(),
                },
                Op::Define,
                "",
            )),
        }
    }

    fn define(
        &self,
        type_spec: Option<&str>,
        uuid: Option<&str>,
        params: &Params,
        auto: bool,
    ) -> Result<Reply, ControlError> {
        let def = match (type_spec, uuid) {
            (None, None) => {
                return Err(ControlError::new(
                    ErrorKind::BadRequest,
                    "define needs --type (a new definition), or --uuid of a running instance",
                ))
            }
            (None, Some(u)) => {
                if !params.is_empty() {
                    return Err(ControlError::new(
                        ErrorKind::BadRequest,
                        "parameters need --type: a running instance is defined with its own",
                    ));
                }
                let uuid = self.canonical(Some(u))?;
                let claim = self.claim(&uuid)?;
                let info = self.registry.instance(&uuid).map_err(|_| {
                    ControlError::new(ErrorKind::NotRunning, format!("{uuid} is not running"))
                        .hint("give --type to define a new instance")
                })?;
                let defs = lock(&self.defs);
                if defs.defined.contains_key(&uuid) || defs.broken_of(&uuid).is_some() {
                    return Err(ControlError::new(
                        ErrorKind::UuidInUse,
                        format!("UUID {uuid} is in use: it has a definition"),
                    )
                    .hint(format!("`umdev undefine {uuid}` deletes it")));
                }
                drop(defs);
                let def = Definition {
                    version: DEFINITION_VERSION,
                    uuid,
                    parent: info.parent,
                    type_name: info.type_name,
                    params: info.params,
                    autostart: auto,
                    migrating_to: None,
                };
                return self.finish_define(def, claim);
            }
            (Some(spec), u) => {
                let (parent, type_name) = self.resolve(spec)?;
                parent
                    .check_params(&type_name, params)
                    .map_err(|e| instance_error(e, Op::Define, ""))?;
                Definition {
                    version: DEFINITION_VERSION,
                    uuid: self.canonical(u)?,
                    parent: parent.name().to_owned(),
                    type_name,
                    params: params.clone(),
                    autostart: auto,
                    migrating_to: None,
                }
            }
        };
        let claim = self.claim(&def.uuid)?;
        self.check_free(&def.uuid, Op::Define)?;
        self.finish_define(def, claim)
    }

    fn finish_define(&self, def: Definition, _claim: Claim<'_>) -> Result<Reply, ControlError> {
        let uuid = def.uuid.clone();
        self.write_definition(def)?;
        let defs = lock(&self.defs);
        let def = &defs.defined[&uuid];
        Ok(Reply::Defined(DefinedReply {
            definition: self.definition_row(def, &defs),
        }))
    }

    fn not_defined(uuid: &str) -> ControlError {
        ControlError::new(ErrorKind::NotDefined, format!("{uuid} has no definition")).hint(
            "`umdev list --defined` lists the definitions; `umdev create --type T` starts a \
             transient instance",
        )
    }

    fn undefine(&self, uuid: &str) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        let mut defs = lock(&self.defs);
        let path = if defs.defined.contains_key(&uuid) {
            self.store.path_of(&uuid)
        } else if let Some(b) = defs.broken_of(&uuid) {
            b.path.clone()
        } else {
            return Err(Self::not_defined(&uuid));
        };
        self.store.delete(&path).map_err(|e| {
            ControlError::new(
                ErrorKind::Io,
                format!("deleting the definition: {}", chain(&e)),
            )
        })?;
        defs.defined.remove(&uuid);
        defs.broken.retain(|b| b.path != path);
        defs.start_errors.remove(&uuid);
        drop(defs);
        info!(uuid, path = %path.display(), "undefined");
        Ok(Reply::Undefined(UndefinedReply {
            running: self.registry.instance(&uuid).is_ok(),
            uuid,
            path,
        }))
    }

    fn start(&self, uuid: &str) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        let def = {
            let defs = lock(&self.defs);
            match defs.defined.get(&uuid) {
                Some(d) => d.clone(),
                None => {
                    return Err(match defs.broken_of(&uuid) {
                        Some(b) => ControlError::new(
                            ErrorKind::BrokenDefinition,
                            format!(
                                "the definition file {} of {uuid} is malformed: {}",
                                b.path.display(),
                                b.error
                            ),
                        )
                        .hint("fix the file and restart the daemon, or `umdev undefine` it"),
                        None => Self::not_defined(&uuid),
                    })
                }
            }
        };
        self.check_not_outgoing(&uuid)?;
        if self.registry.instance(&uuid).is_ok() {
            return Err(ControlError::new(
                ErrorKind::AlreadyRunning,
                format!("{uuid} is running already"),
            ));
        }
        let info = self
            .start_definition(&def)
            .map_err(|e| instance_error(e, Op::Start, &uuid))?;
        let defs = lock(&self.defs);
        Ok(Reply::Started(StartedReply {
            instance: instance_row(info, &defs),
            definition: None,
        }))
    }

    fn stop_or_remove(&self, uuid: &str, force: bool, op: Op) -> Result<Reply, ControlError> {
        let uuid = canonical_uuid(uuid).ok_or_else(|| bad_uuid(uuid))?;
        let _claim = self.claim(&uuid)?;
        self.stop_or_remove_claimed(&uuid, force, op)
    }

    /// [`Service::stop_or_remove`] of a canonical UUID the caller has claimed.
    fn stop_or_remove_claimed(
        &self,
        uuid: &str,
        force: bool,
        op: Op,
    ) -> Result<Reply, ControlError> {
        let uuid = uuid.to_owned();
        let running = self.registry.instance(&uuid).is_ok();
        let def_path = {
            let defs = lock(&self.defs);
            if defs.defined.contains_key(&uuid) {
                Some(self.store.path_of(&uuid))
            } else {
                defs.broken_of(&uuid).map(|b| b.path.clone())
            }
        };
        let outgoing = matches!(op, Op::Remove) && lock(&self.outgoing).contains_key(&uuid);
        if !running && (matches!(op, Op::Stop) || (def_path.is_none() && !outgoing)) {
            let mut e = ControlError::new(ErrorKind::NotRunning, format!("{uuid} is not running"));
            if matches!(op, Op::Remove) {
                e = ControlError::new(
                    ErrorKind::NoSuchInstance,
                    format!("no instance or definition {uuid}"),
                );
            }
            return Err(e.hint(
                "`umdev list` lists the running instances, `umdev list --defined` the definitions",
            ));
        }
        let stopped = if running {
            let report = self
                .registry
                .remove(&uuid, force)
                .map_err(|e| instance_error(e, op, &uuid))?;
            Some(report.into())
        } else {
            None
        };
        let mut undefined = None;
        if let (Op::Remove, Some(path)) = (op, def_path) {
            self.store.delete(&path).map_err(|e| {
                ControlError::new(
                    ErrorKind::Io,
                    format!(
                        "the instance is stopped, but deleting its definition failed: {}",
                        chain(&e)
                    ),
                )
            })?;
            let mut defs = lock(&self.defs);
            defs.defined.remove(&uuid);
            defs.broken.retain(|b| b.path != path);
            defs.start_errors.remove(&uuid);
            info!(uuid, path = %path.display(), "undefined");
            undefined = Some(path);
        }
        if outgoing && lock(&self.outgoing).remove(&uuid).is_some() {
            info!(uuid, "the state kept for a migration was dropped");
        }
        Ok(Reply::Removed(RemovedReply {
            uuid,
            stopped,
            undefined,
        }))
    }

    /// How many instances run.
    pub fn running_count(&self) -> usize {
        self.registry.instances().len()
    }

    /// Stop every running instance (the daemon is stopping); log what each released.
    /// Returns how many instances could not be stopped.
    pub fn stop_all(&self) -> usize {
        let results = self.registry.stop_all();
        let mut failed = 0;
        let (mut pinned, mut released) = (0, 0);
        let stopped = results.len();
        for r in results {
            match r {
                Ok(report) => {
                    pinned += report.dma.pinned_pages;
                    released += report.dma.leaked_pins_released;
                }
                Err(e) => {
                    failed += 1;
                    warn!(error = %chain(&e), "an instance could not be stopped");
                }
            }
        }
        info!(
            stopped = stopped - failed,
            failed,
            pinned_pages = pinned,
            leaked_pins_released = released,
            "every instance stopped"
        );
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::reload::ReloadReport;
    use super::*;
    use crate::device::Device;
    use crate::instance::{CreateRequest, InstanceType, RegistryConfig, Resource};
    use crate::testing::TrivialDevice;

    /// A parent like the GPU's: a 64 MiB framebuffer pool, one type taking 4 MiB of it.
    struct Pool;

    impl Parent for Pool {
        fn name(&self) -> &str {
            "gpu"
        }
        fn resources(&self) -> Vec<Resource> {
            vec![Resource {
                name: "framebuffer".into(),
                unit: "MiB".into(),
                total: 64,
            }]
        }
        fn types(&self) -> Vec<InstanceType> {
            vec![InstanceType {
                name: "gpu-4m".into(),
                description: "registers".into(),
                device_api: "vfio-pci".into(),
                needs: vec![("framebuffer".into(), 4)],
            }]
        }
        fn create(&self, _req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
            Ok(Box::new(TrivialDevice::default()))
        }
    }

    fn service(dir: &std::path::Path) -> Service {
        let registry = Arc::new(Registry::new(RegistryConfig::new(dir.join("sockets"))).unwrap());
        let gpu: Arc<dyn Parent> = Arc::new(Pool);
        registry.add_parent(gpu.clone()).unwrap();
        let store = Store::open(dir.join("definitions")).unwrap();
        Service::new(registry, vec![gpu], store, Loaded::default(), Vec::new())
    }

    #[test]
    fn test_service_screenshot_no_display_no_uuid_unknown_uuid_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = service(dir.path());
        let Reply::Started(started) = s
            .handle(Request::Create {
                type_spec: "gpu-4m".into(),
                uuid: None,
                params: Params::new(),
                auto: false,
            })
            .unwrap()
        else {
            panic!("not started");
        };
        let shot = |uuid: Option<&str>| {
            s.handle_with_payload(
                Request::Screenshot {
                    uuid: uuid.map(str::to_owned),
                    scanout: 0,
                },
                Vec::new(),
            )
            .unwrap_err()
        };
        let u = started.instance.uuid;
        let e = shot(Some(&u));
        assert_eq!(e.kind, ErrorKind::NoDisplay, "{e:?}");
        assert_eq!(
            e.message,
            format!("instance {u} of type gpu/gpu-4m has no display")
        );
        assert_eq!(shot(None).kind, ErrorKind::BadParam);
        let e = shot(Some("6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11"));
        assert_eq!(e.kind, ErrorKind::NoSuchInstance, "{e:?}");
        assert_eq!(s.stop_all(), 0);
    }

    #[test]
    fn test_service_second_request_on_claimed_uuid_busy_others_proceed() {
        let dir = tempfile::tempdir().unwrap();
        let s = service(dir.path());
        let u = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
        let held = s.claim(u).unwrap();
        let e = s
            .handle(Request::Define {
                type_spec: Some("gpu-4m".into()),
                uuid: Some(u.to_uppercase()),
                params: Params::new(),
                auto: false,
            })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Busy, "{e:?}");
        assert!(e.message.contains("another operation"), "{e:?}");
        // Another UUID is not held up.
        s.handle(Request::Create {
            type_spec: "gpu-4m".into(),
            uuid: None,
            params: Params::new(),
            auto: false,
        })
        .unwrap();
        drop(held);
        s.handle(Request::Define {
            type_spec: Some("gpu-4m".into()),
            uuid: Some(u.into()),
            params: Params::new(),
            auto: false,
        })
        .unwrap();
    }

    #[test]
    fn test_reload_claimed_uuid_left_busy_then_added_started_gone_file_keeps_instance() {
        let dir = tempfile::tempdir().unwrap();
        let s = service(dir.path());
        let u = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
        let def = Definition {
            version: DEFINITION_VERSION,
            uuid: u.into(),
            parent: "gpu".into(),
            type_name: "gpu-4m".into(),
            params: Params::new(),
            autostart: true,
            migrating_to: None,
        };
        s.store.write(&def).unwrap();
        // A request on the UUID under way: the reload leaves it alone.
        let held = s.claim(u).unwrap();
        let r = s.reload().unwrap();
        assert_eq!(r.busy, [u]);
        assert!(
            r.added.is_empty() && lock(&s.defs).defined.is_empty(),
            "{r:?}"
        );
        assert!(s.registry.instances().is_empty());
        drop(held);
        let r = s.reload().unwrap();
        assert_eq!(
            (r.added.as_slice(), r.started, r.failed),
            ([u.to_owned()].as_slice(), 1, 0)
        );
        assert_eq!(s.running_count(), 1);
        // Nothing new: nothing started again.
        let r = s.reload().unwrap();
        assert_eq!(r, ReloadReport::default());
        // The file goes: the definition too, the instance runs on.
        s.store.delete(&s.store.path_of(u)).unwrap();
        let r = s.reload().unwrap();
        assert_eq!(r.removed, [u]);
        assert!(lock(&s.defs).defined.is_empty());
        assert_eq!(s.running_count(), 1);
        assert_eq!(s.stop_all(), 0);
    }

    #[test]
    fn test_service_create_auto_definition_unwritable_instance_stopped_again() {
        let dir = tempfile::tempdir().unwrap();
        let s = service(dir.path());
        // The definitions directory vanishes under the daemon: the write fails.
        std::fs::remove_dir_all(dir.path().join("definitions")).unwrap();
        let e = s
            .handle(Request::Create {
                type_spec: "gpu-4m".into(),
                uuid: None,
                params: Params::new(),
                auto: true,
            })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Io, "{e:?}");
        assert!(e.message.contains("writing the definition"), "{e:?}");
        assert!(s.registry.instances().is_empty(), "the instance was kept");
        assert!(lock(&s.defs).defined.is_empty());
        let types = s.types();
        assert_eq!(types.resources[0].used, 0, "its share is back");
    }
}
