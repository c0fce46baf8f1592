//! The control protocol between a daemon (`umdev daemon`, or any built on [`crate::daemon`])
//! and its clients (`umdev`'s client commands, [`super::client`]): one request and one
//! response per connection on the control socket, each one JSON text followed by a newline.
//!
//! ```text
//! client → daemon   {"version":2,"request":{"op":"create","type":"gpu-4m","auto":true}}\n
//! daemon → client   {"version":2,"ok":{"reply":"started","instance":{...}}}\n
//!               or  {"version":2,"error":{"kind":"exhausted","message":"...","hint":"..."}}\n
//! ```
//!
//! # Payloads
//! Two messages carry a migrated instance's state, raw, right after their newline: the
//! `migrate_load` request and the `saved` reply to `migrate_save` (`state_len` bytes each).
//! The `screenshot` reply to `screenshot` carries a PNG file the same way (`png_len` bytes).
//! Binary after the JSON line rather than base64 inside it: no encoding crate, no third
//! more bytes, and the JSON line keeps its [`MAX_MESSAGE`] bound; a payload is bounded by
//! [`MAX_PAYLOAD`] and must arrive whole.
//!
//! # Versioning
//! Both sides send [`PROTOCOL_VERSION`]. The daemon reads the envelope (`version`, and
//! `request` as any JSON value) before it reads the request, so a daemon answers a client of
//! another version with a `version_mismatch` error naming both versions, whatever that
//! client's requests look like; the client checks the response's `version` the same way.
//! The version rises with every change a peer of the previous version would misread; a
//! field added with a default (read as absent by an older peer) does not raise it.
//!
//! # Bounds
//! A message is at most [`MAX_MESSAGE`] bytes (the newline included); a longer one, or one
//! that is not valid JSON, gets a `bad_request` error. Only `migrate_load` carries a
//! payload, at most [`MAX_PAYLOAD`] bytes; the buffer for it grows as its bytes arrive
//! (never the announced size up front, never more than it). The daemon gives a request a
//! deadline, not a timeout per read: the message within [`REQUEST_TIMEOUT`] of the
//! connection, its payload within [`transfer_time`] more; the reply, written once the
//! request is handled, gets the same. Nothing here is trusted more for coming from the
//! socket's owner: every field is checked as an admin's input is.
//!
//! [`decode_request`] is the whole decoder (message, envelope, version, request,
//! payload), with no I/O but the reader's: the daemon uses its two halves, a fuzz target
//! (`fuzz/fuzz_targets/control_decode.rs`) the whole.
//!
//! `protocol-docs/lifecycle.md` documents every request and reply.

use std::io::{self, BufRead, Read};
use std::path::PathBuf;
use std::time::Duration;

use crate::instance::Params;
use serde::{Deserialize, Serialize};

/// The control protocol's version (see the module doc).
pub const PROTOCOL_VERSION: u32 = 2;
/// The largest message, newline included.
pub const MAX_MESSAGE: usize = 1 << 20;
/// The largest payload after a message (`migrate_load`'s state, `saved`'s): a migration
/// stream's largest frame and its heads, the largest state `migrate_save` can produce.
pub const MAX_PAYLOAD: u64 = crate::migration::stream::MAX_FRAME as u64 + 4096;
/// How long the daemon waits for a connected client's whole request message (and for a
/// client to take the reply), by default.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The slowest a payload may flow, bytes per second: [`transfer_time`].
pub const MIN_PAYLOAD_RATE: u64 = 32 << 20;

/// The time a payload of `len` bytes is given beyond the message's deadline: `len` at
/// [`MIN_PAYLOAD_RATE`] (32 s for 1 GiB).
pub fn transfer_time(len: u64) -> Duration {
    Duration::from_millis(len.saturating_mul(1000) / MIN_PAYLOAD_RATE)
}

/// What a client asks for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Every type with its availability, and every resource with its use.
    Types,
    /// The running instances, or (`defined`) the definitions.
    List {
        /// List definitions instead of running instances.
        #[serde(default)]
        defined: bool,
    },
    /// Start an instance of a type now: transient, or also defined with autostart (`auto`).
    Create {
        /// `<parent>/<type>`, or a type name one parent alone offers.
        #[serde(rename = "type")]
        type_spec: String,
        /// The UUID (a new random one if absent).
        #[serde(default)]
        uuid: Option<String>,
        /// The parent's parameters.
        #[serde(default)]
        params: Params,
        /// Also write a definition marked autostart.
        #[serde(default)]
        auto: bool,
    },
    /// Write a definition: of a new instance of a type (`type_spec`), or of a running
    /// instance (`uuid` alone). Nothing is started.
    Define {
        /// The type; absent to define the running instance `uuid` as it runs.
        #[serde(rename = "type", default)]
        type_spec: Option<String>,
        /// The UUID (a new random one if absent and `type_spec` is given).
        #[serde(default)]
        uuid: Option<String>,
        /// The parent's parameters (only with `type_spec`).
        #[serde(default)]
        params: Params,
        /// Mark it autostart.
        #[serde(default)]
        auto: bool,
    },
    /// Delete a definition (a running instance keeps running, transient from then on).
    Undefine {
        /// The UUID.
        uuid: String,
    },
    /// Start a defined instance.
    Start {
        /// The UUID.
        uuid: String,
    },
    /// Stop a running instance; its definition, if any, stays.
    Stop {
        /// The UUID.
        uuid: String,
        /// Disconnect a client that does not let go.
        #[serde(default)]
        force: bool,
    },
    /// Stop a running instance and delete its definition: gone for good.
    Remove {
        /// The UUID.
        uuid: String,
        /// Disconnect a client that does not let go.
        #[serde(default)]
        force: bool,
    },
    /// `umdev migrate`, on the source: save the whole state of a running instance that no
    /// client holds. Unless `keep_source`, the instance is then **handed over**: removed
    /// (its socket gone: no client can attach to it here any more), its state kept in
    /// memory and its definition (if any) marked as migrating to `to`, until
    /// [`Request::MigrateFinish`] forgets them or [`Request::MigrateAbort`] serves the
    /// instance again with that state. With `keep_source` it is stopped, saved and resumed,
    /// and serves on unchanged. The reply ([`Reply::Saved`]) is followed by its `state_len`
    /// bytes of state (see "Payloads" in the module doc).
    MigrateSave {
        /// The UUID.
        uuid: String,
        /// Keep serving the instance (the destination gets a copy).
        #[serde(default)]
        keep_source: bool,
        /// The destination's control socket, recorded in the definition's mark.
        #[serde(default)]
        to: Option<PathBuf>,
    },
    /// `umdev migrate`, on the destination: create an instance with the state that follows
    /// the request (`state_len` bytes), and define it if `define`.
    MigrateLoad {
        /// The UUID (the source's).
        uuid: String,
        /// `<parent>/<type>` (the source's).
        #[serde(rename = "type")]
        type_spec: String,
        /// The parent's parameters (the source's).
        #[serde(default)]
        params: Params,
        /// Also write a definition (the source had one).
        #[serde(default)]
        define: bool,
        /// The definition's autostart flag (with `define`).
        #[serde(default)]
        autostart: bool,
        /// Length of the state that follows the request.
        state_len: u64,
    },
    /// `umdev migrate`, on the source once the destination serves the instance: forget a
    /// handed-over instance (its kept state, its marked definition).
    MigrateFinish {
        /// The UUID.
        uuid: String,
    },
    /// `umdev migrate`, on the source when the destination does not serve the instance:
    /// serve a handed-over instance again, with its kept state (or, after a restart of this
    /// daemon, from its marked definition), the mark removed.
    MigrateAbort {
        /// The UUID.
        uuid: String,
    },
    /// `umdev screenshot`, `umdev view`: what a scanout of a running instance shows now
    /// (the cursor drawn in), as PNG. The reply ([`Reply::Screenshot`]) is followed by its
    /// `png_len` bytes. A daemon needs `uuid`; the control socket of `umdev run` (one
    /// device) takes it absent.
    Screenshot {
        /// The instance (absent: the only device, on `umdev run`'s control socket).
        #[serde(default)]
        uuid: Option<String>,
        /// The scanout (display), from 0.
        #[serde(default)]
        scanout: u32,
    },
    /// `umdev resize`: give a scanout of a running instance a new mode, as plugging in
    /// another monitor would; the device raises its display event and the guest's driver
    /// reads the new mode. Like `screenshot`, `uuid` is absent on `umdev run`'s socket.
    Resize {
        /// The instance (absent: the only device, on `umdev run`'s control socket).
        #[serde(default)]
        uuid: Option<String>,
        /// The scanout (display), from 0.
        #[serde(default)]
        scanout: u32,
        /// The new width, pixels.
        width: u32,
        /// The new height, pixels.
        height: u32,
    },
}

impl Request {
    /// Length of the payload that follows this request on the socket.
    pub fn payload_len(&self) -> u64 {
        match self {
            Request::MigrateLoad { state_len, .. } => *state_len,
            _ => 0,
        }
    }
}

/// What a client sends: its version and its request.
#[derive(Debug, Serialize, Deserialize)]
pub struct RequestEnvelope<R> {
    /// The client's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The request ([`Request`]; any JSON value when the daemon reads the envelope).
    pub request: R,
}

/// What the daemon answers: its version, and a reply or an error.
#[derive(Debug, Serialize, Deserialize)]
pub struct Response {
    /// The daemon's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The reply, on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok: Option<Reply>,
    /// The error, on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ControlError>,
}

impl Response {
    /// The response of a request's result.
    pub fn of(result: Result<Reply, ControlError>) -> Response {
        let (ok, error) = match result {
            Ok(r) => (Some(r), None),
            Err(e) => (None, Some(e)),
        };
        Response {
            version: PROTOCOL_VERSION,
            ok,
            error,
        }
    }
}

/// A successful reply, one kind per request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// `types`.
    Types(TypesReply),
    /// `list`.
    Instances(InstancesReply),
    /// `list` with `defined`.
    Definitions(DefinitionsReply),
    /// `create`, `start`.
    Started(StartedReply),
    /// `define`.
    Defined(DefinedReply),
    /// `undefine`.
    Undefined(UndefinedReply),
    /// `stop`, `remove`, `migrate_finish`.
    Removed(RemovedReply),
    /// `migrate_save`; the state follows the reply.
    Saved(SavedReply),
    /// `screenshot`; the PNG follows the reply.
    Screenshot(ScreenshotReply),
    /// `resize`.
    Resized(ResizedReply),
}

impl Reply {
    /// Length of the payload that follows this reply on the socket.
    pub fn payload_len(&self) -> u64 {
        match self {
            Reply::Saved(r) => r.state_len,
            Reply::Screenshot(r) => r.png_len,
            _ => 0,
        }
    }
}

/// Reply to `migrate_save`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedReply {
    /// The instance as it runs (its definition flags included).
    pub instance: InstanceRow,
    /// Length of the state that follows the reply: a migration stream
    /// (`protocol-docs/migration.md`).
    pub state_len: u64,
    /// The instance was handed over (removed here, its state kept until `migrate_finish`
    /// or `migrate_abort`); false with `keep_source`.
    pub handed_over: bool,
}

/// Reply to `screenshot`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScreenshotReply {
    /// The instance (absent from `umdev run`, which serves one device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The scanout.
    pub scanout: u32,
    /// Width of the image, pixels.
    pub width: u32,
    /// Height of the image, pixels.
    pub height: u32,
    /// Length of the PNG file that follows the reply (at most [`MAX_PAYLOAD`]).
    pub png_len: u64,
}

/// Reply to `resize`: the display event is raised (the guest's driver reads the new mode
/// when it handles it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizedReply {
    /// The instance (absent from `umdev run`, which serves one device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The scanout.
    pub scanout: u32,
    /// The new width, pixels.
    pub width: u32,
    /// The new height, pixels.
    pub height: u32,
}

/// What one instance of a type takes of a resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Need {
    /// The resource.
    pub resource: String,
    /// The amount.
    pub amount: u64,
}

/// A type and how many more instances of it can be created now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeRow {
    /// The parent that offers it.
    pub parent: String,
    /// The type's name within the parent.
    #[serde(rename = "type")]
    pub type_name: String,
    /// One line for humans.
    pub description: String,
    /// The VFIO device API (`vfio-pci`).
    pub device_api: String,
    /// How many more instances fit now.
    pub available_instances: u64,
    /// What one instance takes.
    pub needs: Vec<Need>,
}

/// A resource of a parent and how much of it is used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceRow {
    /// The parent.
    pub parent: String,
    /// The resource.
    pub resource: String,
    /// Its unit.
    pub unit: String,
    /// What the running instances take.
    pub used: u64,
    /// The parent's total.
    pub total: u64,
}

/// Reply to `types`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypesReply {
    /// Every type.
    pub types: Vec<TypeRow>,
    /// Every resource.
    pub resources: Vec<ResourceRow>,
}

/// An instance's DMA counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmaRow {
    /// DMA mappings.
    pub maps: u64,
    /// Pages pinned.
    pub pinned_pages: u64,
    /// Pages locked.
    pub locked_pages: u64,
    /// Pins the device left behind, force-released so far.
    pub leaked_pins_released: u64,
}

impl From<crate::dma::DmaStats> for DmaRow {
    fn from(s: crate::dma::DmaStats) -> DmaRow {
        DmaRow {
            maps: s.maps,
            pinned_pages: s.pinned_pages,
            locked_pages: s.locked_pages,
            leaked_pins_released: s.leaked_pins_released,
        }
    }
}

/// A running instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceRow {
    /// UUID.
    pub uuid: String,
    /// Parent.
    pub parent: String,
    /// Type within the parent.
    #[serde(rename = "type")]
    pub type_name: String,
    /// Parameters.
    pub params: Params,
    /// The vfio-user socket a VMM connects to.
    pub socket: PathBuf,
    /// A client is connected.
    pub client_attached: bool,
    /// It has a definition.
    pub defined: bool,
    /// Its definition is marked autostart.
    pub autostart: bool,
    /// Its DMA counters.
    pub dma: DmaRow,
    /// What it holds of what the daemon's process shares (absent from older daemons).
    #[serde(default)]
    pub budget: BudgetRow,
}

/// An instance's use of the process's shared budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetRow {
    /// Fd-backed DMA maps held (each one VMA, two counted, and one SIGBUS slot).
    pub fd_maps: u64,
    /// VMAs those maps are counted as.
    pub vmas: u64,
    /// Fd-backed maps guaranteed to it in the process's budget.
    pub fd_maps_guarantee: u64,
    /// Most fd-backed maps it may hold.
    pub fd_maps_cap: u64,
    /// Commands its client's connection holds in the backlog.
    pub backlog_messages: u64,
    /// Bytes of those commands.
    pub backlog_bytes: u64,
    /// Fds those commands hold.
    pub backlog_fds: u64,
}

impl From<&crate::instance::InstanceInfo> for BudgetRow {
    fn from(i: &crate::instance::InstanceInfo) -> BudgetRow {
        BudgetRow {
            fd_maps: i.dma.fd_maps,
            vmas: i.dma.fd_maps * crate::dma::VMAS_PER_MAP,
            fd_maps_guarantee: i.map_share.0,
            fd_maps_cap: i.map_share.1,
            backlog_messages: i.backlog.messages as u64,
            backlog_bytes: i.backlog.bytes as u64,
            backlog_fds: i.backlog.fds as u64,
        }
    }
}

/// Reply to `list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstancesReply {
    /// The running instances, by UUID.
    pub instances: Vec<InstanceRow>,
}

/// A definition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinitionRow {
    /// UUID.
    pub uuid: String,
    /// Parent.
    pub parent: String,
    /// Type within the parent.
    #[serde(rename = "type")]
    pub type_name: String,
    /// Parameters.
    pub params: Params,
    /// Started when the daemon starts.
    pub autostart: bool,
    /// Running now.
    pub running: bool,
    /// Its file.
    pub path: PathBuf,
    /// Why its last autostart failed (until it is started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_error: Option<String>,
    /// Handed over to the daemon of this control socket by `umdev migrate`, not confirmed
    /// yet: not started here (`umdev migrate UUID --to DST --recover` settles it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrating_to: Option<PathBuf>,
}

/// A definition file the daemon could not read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokenRow {
    /// The file.
    pub path: PathBuf,
    /// The UUID its name gives, when it is `<uuid>.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// What is wrong with it.
    pub error: String,
}

/// Reply to `list --defined`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinitionsReply {
    /// The definitions, by UUID.
    pub definitions: Vec<DefinitionRow>,
    /// The files that are not definitions the daemon can read.
    pub broken: Vec<BrokenRow>,
}

/// Reply to `create` and `start`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedReply {
    /// The instance, now served.
    pub instance: InstanceRow,
    /// The definition written (`create --auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<PathBuf>,
}

/// Reply to `define`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinedReply {
    /// The definition written.
    pub definition: DefinitionRow,
}

/// Reply to `undefine`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndefinedReply {
    /// UUID.
    pub uuid: String,
    /// The file deleted.
    pub path: PathBuf,
    /// The instance is running (transient from now on).
    pub running: bool,
}

/// What stopping an instance did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovalRow {
    /// UUID.
    pub uuid: String,
    /// A client was attached.
    pub client_was_attached: bool,
    /// The device-request IRQ was signalled.
    pub release_requested: bool,
    /// How long the client was waited for, ms.
    pub waited_ms: u64,
    /// The client was disconnected (`--force`).
    pub forced: bool,
    /// DMA counters after the teardown.
    pub dma: DmaRow,
}

impl From<crate::instance::RemovalReport> for RemovalRow {
    fn from(r: crate::instance::RemovalReport) -> RemovalRow {
        RemovalRow {
            uuid: r.uuid,
            client_was_attached: r.client_was_attached,
            release_requested: r.release_requested,
            waited_ms: u64::try_from(r.waited.as_millis()).unwrap_or(u64::MAX),
            forced: r.forced,
            dma: r.dma.into(),
        }
    }
}

/// Reply to `stop` and `remove`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedReply {
    /// UUID.
    pub uuid: String,
    /// The stop of the running instance (absent when it was not running: `remove` of a
    /// definition alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<RemovalRow>,
    /// The definition file deleted (`remove`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undefined: Option<PathBuf>,
}

/// What kind of failure: a client may act on it without parsing the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// No parent offers the type.
    UnknownType,
    /// Several parents offer the bare type name.
    AmbiguousType,
    /// A resource (named in the message) ran out.
    Exhausted,
    /// The UUID names a running instance or a definition.
    UuidInUse,
    /// No running instance or definition has the UUID.
    NoSuchInstance,
    /// The UUID has no definition.
    NotDefined,
    /// The instance is not running.
    NotRunning,
    /// The instance is running already.
    AlreadyRunning,
    /// The UUID's definition file is malformed.
    BrokenDefinition,
    /// A parameter (or the UUID's syntax) is wrong.
    BadParam,
    /// A client is attached and did not let go, or another operation on the UUID is
    /// under way.
    Busy,
    /// The device did not finish its teardown in time.
    Stuck,
    /// The device could not be built.
    Device,
    /// A file or socket operation failed.
    Io,
    /// The request could not be read.
    BadRequest,
    /// The peers speak different protocol versions.
    VersionMismatch,
    /// The daemon is stopping, or has too many connections.
    Unavailable,
    /// A bug or an inconsistent configuration.
    Internal,
    /// A client is attached: only its VMM can migrate the instance.
    Attached,
    /// The instance's device does not support migration.
    NotMigratable,
    /// A migration state was refused, or the UUID is not (or no longer) handed over.
    Migration,
    /// The UUID was handed over to another daemon by `umdev migrate`, not yet settled.
    MigratingOut,
    /// The instance's device has no display (`screenshot` of an nvme or ccw instance).
    NoDisplay,
    /// The display shows nothing now (the guest has not set a scanout), or has no such
    /// scanout.
    NothingShown,
    /// The request is not served here (`umdev run`'s control socket answers `screenshot`,
    /// `resize` only).
    Unsupported,
}

/// A failure, as the client shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ControlError {
    /// What kind.
    pub kind: ErrorKind,
    /// What happened, for humans.
    pub message: String,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl ControlError {
    /// An error without a hint.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ControlError {
        ControlError {
            kind,
            message: message.into(),
            hint: None,
        }
    }

    /// The same error with a hint.
    pub fn hint(mut self, hint: impl Into<String>) -> ControlError {
        self.hint = Some(hint.into());
        self
    }
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection before sending anything.
    #[error("the connection closed before a message arrived")]
    Empty,
    /// More than [`MAX_MESSAGE`] bytes without a newline.
    #[error("message longer than {MAX_MESSAGE} bytes")]
    TooLong,
    /// The socket failed (a timeout included).
    #[error("reading the message")]
    Io(#[source] io::Error),
    /// The socket failed (a timeout included) while the payload was read.
    #[error("reading the payload")]
    PayloadIo(#[source] io::Error),
    /// A payload longer than [`MAX_PAYLOAD`] was announced.
    #[error("a payload of {0} bytes was announced (at most {MAX_PAYLOAD})")]
    PayloadTooLong(u64),
    /// The connection closed before the whole payload arrived.
    #[error("the payload was cut short: {got} of {expected} bytes")]
    PayloadCut {
        /// Announced length.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
}

/// Why a request could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The message or its payload could not be read.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The message is not a request envelope, or not a request this daemon knows.
    #[error("malformed request")]
    Malformed(#[source] serde_json::Error),
    /// The client speaks another version (whatever its request is).
    #[error(
        "this daemon speaks control protocol version {PROTOCOL_VERSION}, the client version {0}"
    )]
    Version(u32),
}

/// Read and decode one request message from `reader`: the envelope first (so that a client
/// of another version is told so whatever its request), then the request. The payload it
/// announces ([`Request::payload_len`], checked against [`MAX_PAYLOAD`]) is left in
/// `reader` for [`read_payload`].
pub fn decode_header(reader: &mut impl BufRead) -> Result<Request, DecodeError> {
    let message = read_message(reader)?;
    let envelope: RequestEnvelope<serde_json::Value> =
        serde_json::from_slice(&message).map_err(DecodeError::Malformed)?;
    if envelope.version != PROTOCOL_VERSION {
        return Err(DecodeError::Version(envelope.version));
    }
    let request: Request =
        serde_json::from_value(envelope.request).map_err(DecodeError::Malformed)?;
    let len = request.payload_len();
    if len > MAX_PAYLOAD {
        return Err(FrameError::PayloadTooLong(len).into());
    }
    Ok(request)
}

/// The whole decoder: [`decode_header`], then the payload the request announces.
#[allow(dead_code)] // the daemon reads the two halves with the payload budget between
pub fn decode_request(reader: &mut impl BufRead) -> Result<(Request, Vec<u8>), DecodeError> {
    let request = decode_header(reader)?;
    let payload = read_payload(reader, request.payload_len())?;
    Ok((request, payload))
}

/// Read one message: the bytes up to the first newline (or the end of the stream), at most
/// [`MAX_MESSAGE`] bytes. `reader` is kept for the payload that may follow (its buffer may
/// hold the payload's first bytes already).
pub fn read_message(reader: &mut impl BufRead) -> Result<Vec<u8>, FrameError> {
    let mut buf = Vec::new();
    reader
        .take(MAX_MESSAGE as u64 + 1)
        .read_until(b'\n', &mut buf)
        .map_err(FrameError::Io)?;
    if buf.len() > MAX_MESSAGE {
        return Err(FrameError::TooLong);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Err(FrameError::Empty);
    }
    Ok(buf)
}

/// Read the `len` bytes of payload that follow a message (at most [`MAX_PAYLOAD`]). The
/// buffer grows with the bytes that arrived, never beyond `len`: a peer that announces a
/// large payload and sends little costs little.
pub fn read_payload(reader: &mut impl Read, len: u64) -> Result<Vec<u8>, FrameError> {
    const CHUNK: usize = 64 * 1024;
    if len > MAX_PAYLOAD {
        return Err(FrameError::PayloadTooLong(len));
    }
    let want = usize::try_from(len).map_err(|_| FrameError::PayloadTooLong(len))?;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; CHUNK.min(want)];
    while buf.len() < want {
        let room = (want - buf.len()).min(chunk.len());
        let n = match reader.read(&mut chunk[..room]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(FrameError::PayloadIo(e)),
        };
        if buf.capacity() - buf.len() < n {
            // Double what arrived so far, capped at what is still announced.
            let grow = buf.len().max(CHUNK).min(want - buf.len()).max(n);
            buf.reserve_exact(grow);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    if buf.len() != want {
        return Err(FrameError::PayloadCut {
            expected: len,
            got: buf.len() as u64,
        });
    }
    Ok(buf)
}

/// One message: `value` as JSON and a newline.
pub fn encode(value: &impl Serialize) -> Vec<u8> {
    // Serializing these plain structs (string keys, no non-finite floats) cannot fail.
    let mut v = serde_json::to_vec(value).unwrap_or_else(|e| {
        serde_json::json!({
            "version": PROTOCOL_VERSION,
            "error": { "kind": "internal", "message": e.to_string() },
        })
        .to_string()
        .into_bytes()
    });
    v.push(b'\n');
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_request_json_shape_round_trips() {
        let req = Request::Create {
            type_spec: "gpu/gpu-4m".into(),
            uuid: None,
            params: Params::from([("k".to_string(), "v".to_string())]),
            auto: true,
        };
        let text = String::from_utf8(encode(&RequestEnvelope {
            version: PROTOCOL_VERSION,
            request: &req,
        }))
        .unwrap();
        assert_eq!(
            text,
            "{\"version\":2,\"request\":{\"op\":\"create\",\"type\":\"gpu/gpu-4m\",\"uuid\":null,\"params\":{\"k\":\"v\"},\"auto\":true}}\n"
        );
        let back: RequestEnvelope<Request> = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(back.request, req);
        // Optional fields may be left out.
        let short: Request = serde_json::from_str(r#"{"op":"stop","uuid":"u"}"#).unwrap();
        assert_eq!(
            short,
            Request::Stop {
                uuid: "u".into(),
                force: false
            }
        );
    }

    #[test]
    fn test_screenshot_request_defaults_and_reply_announces_png() {
        let r: Request = serde_json::from_str(r#"{"op":"screenshot"}"#).unwrap();
        assert_eq!(
            r,
            Request::Screenshot {
                uuid: None,
                scanout: 0
            }
        );
        assert_eq!(r.payload_len(), 0);
        let reply = Reply::Screenshot(ScreenshotReply {
            uuid: Some("u".into()),
            scanout: 1,
            width: 64,
            height: 32,
            png_len: 1234,
        });
        assert_eq!(reply.payload_len(), 1234);
        let text = serde_json::to_string(&reply).unwrap();
        assert!(
            text.starts_with(r#"{"reply":"screenshot","uuid":"u""#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Reply>(&text).unwrap(), reply);
    }

    #[test]
    fn test_read_message_stops_at_newline_and_bounds_length() {
        assert_eq!(read_message(&mut &b"{}\nrest"[..]).unwrap(), b"{}");
        assert_eq!(read_message(&mut &b"{}"[..]).unwrap(), b"{}");
        assert!(matches!(
            read_message(&mut &b""[..]),
            Err(FrameError::Empty)
        ));
        assert!(matches!(
            read_message(&mut &b"\n"[..]),
            Err(FrameError::Empty)
        ));
        let long = vec![b'x'; MAX_MESSAGE + 10];
        assert!(matches!(
            read_message(&mut &long[..]),
            Err(FrameError::TooLong)
        ));
        let mut fits = vec![b'x'; MAX_MESSAGE - 1];
        fits.push(b'\n');
        assert_eq!(read_message(&mut &fits[..]).unwrap().len(), MAX_MESSAGE - 1);
        fits.insert(0, b'x');
        assert!(matches!(
            read_message(&mut &fits[..]),
            Err(FrameError::TooLong)
        ));
    }

    #[test]
    fn test_payload_after_message_read_whole_or_refused() {
        // The reader's buffer holds the payload's first bytes after the message.
        let mut r = io::BufReader::new(&b"{}\npayload"[..]);
        assert_eq!(read_message(&mut r).unwrap(), b"{}");
        assert_eq!(read_payload(&mut r, 7).unwrap(), b"payload");
        let mut r = io::BufReader::new(&b"{}\npay"[..]);
        read_message(&mut r).unwrap();
        assert!(matches!(
            read_payload(&mut r, 7),
            Err(FrameError::PayloadCut {
                expected: 7,
                got: 3
            })
        ));
        assert!(matches!(
            read_payload(&mut &b""[..], MAX_PAYLOAD + 1),
            Err(FrameError::PayloadTooLong(_))
        ));
    }

    #[test]
    fn test_read_payload_buffer_never_larger_than_announced() {
        let len = 3 * (1 << 20) + 17;
        let data = vec![7u8; len];
        let got = read_payload(&mut &data[..], len as u64).unwrap();
        assert_eq!(got.len(), len);
        assert!(
            got.capacity() <= len,
            "capacity {} for {len}",
            got.capacity()
        );
        // A large announcement and a few bytes: cut, after a small buffer.
        let e = read_payload(&mut &b"tiny"[..], MAX_PAYLOAD).unwrap_err();
        assert!(matches!(e, FrameError::PayloadCut { got: 4, .. }), "{e:?}");
    }

    #[test]
    fn test_decode_request_version_first_payload_bounded() {
        let decode = |text: &str| decode_request(&mut io::BufReader::new(text.as_bytes()));
        let e = decode("{\"version\":9,\"request\":{\"op\":\"nonsense\"}}\n").unwrap_err();
        assert!(matches!(e, DecodeError::Version(9)), "{e:?}");
        let e = decode("{\"version\":2,\"request\":{\"op\":\"nonsense\"}}\n").unwrap_err();
        assert!(matches!(e, DecodeError::Malformed(_)), "{e:?}");
        let load = |len: u64| {
            format!(
                "{{\"version\":2,\"request\":{{\"op\":\"migrate_load\",\"uuid\":\"u\",\
                 \"type\":\"gpu/gpu-4m\",\"state_len\":{len}}}}}\n"
            )
        };
        let e = decode(&load(MAX_PAYLOAD + 1)).unwrap_err();
        assert!(
            matches!(e, DecodeError::Frame(FrameError::PayloadTooLong(_))),
            "{e:?}"
        );
        let (req, payload) = decode(&(load(3) + "abc")).unwrap();
        assert_eq!(req.payload_len(), 3);
        assert_eq!(payload, b"abc");
        // Bytes after a request without a payload are not read.
        let (req, payload) = decode("{\"version\":2,\"request\":{\"op\":\"types\"}}\nxyz").unwrap();
        assert_eq!((req, payload.len()), (Request::Types, 0));
        assert_eq!(transfer_time(MIN_PAYLOAD_RATE * 2), Duration::from_secs(2));
    }
}
