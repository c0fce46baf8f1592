//! The client commands: `umdev types`, `list`, `create`, `define`, `undefine`, `start`,
//! `stop`, `remove`. Each sends one request to the daemon's control socket and prints the
//! reply as a table (or `--json`); an error goes to stderr with a hint, and the exit status
//! is 1 (with `--json`, the error is also printed on stdout as `{"error": {...}}`).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use clap::Subcommand;
use umdev::instance::Params;

use super::paths;
use super::protocol::{self, ControlError, Reply, Request, RequestEnvelope, Response};
use super::render;
use crate::CliResult;

/// Options of every client command.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// The daemon's control socket [default: <socket-dir>/control.sock, the daemon's
    /// default; see `umdev daemon --help`].
    #[arg(long, value_name = "PATH", env = paths::CONTROL_ENV)]
    pub control: Option<PathBuf>,
    /// Print the reply as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The commands that talk to `umdev daemon`.
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// List the instance types and the parents' resources.
    ///
    /// Each type with how many more instances of it fit now; each resource with what the
    /// running instances use of it.
    Types {
        #[command(flatten)]
        common: Common,
    },
    /// List the running instances, or the definitions.
    ///
    /// With --defined: every definition (running, stopped, or start failed) and every
    /// malformed definition file with what is wrong with it.
    List {
        /// List the definitions instead.
        #[arg(long)]
        defined: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Start an instance of a type now.
    ///
    /// Transient (gone when stopped or when the daemon stops) unless --auto, which also
    /// defines it with autostart.
    Create {
        /// The type: <parent>/<type>, or a type name one parent alone offers (`umdev types`).
        #[arg(long = "type", short = 't', value_name = "TYPE")]
        type_spec: String,
        /// The instance's UUID [default: a new random one].
        #[arg(long, short = 'u', value_name = "UUID")]
        uuid: Option<String>,
        /// Also define it, marked autostart: it is started again whenever the daemon starts.
        #[arg(long)]
        auto: bool,
        /// The parent's parameters (ccw: image=<file in the image directory>).
        #[arg(value_name = "KEY=VALUE", value_parser = parse_param)]
        params: Vec<(String, String)>,
        #[command(flatten)]
        common: Common,
    },
    /// Define an instance: persistent, not started.
    ///
    /// Of a type (--type), or a running instance as it runs (--uuid alone).
    Define {
        /// The type: <parent>/<type>, or a type name one parent alone offers.
        #[arg(long = "type", short = 't', value_name = "TYPE")]
        type_spec: Option<String>,
        /// The instance's UUID [default with --type: a new random one].
        #[arg(long, short = 'u', value_name = "UUID")]
        uuid: Option<String>,
        /// Mark it autostart: started whenever the daemon starts.
        #[arg(long)]
        auto: bool,
        /// The parent's parameters (with --type).
        #[arg(value_name = "KEY=VALUE", value_parser = parse_param)]
        params: Vec<(String, String)>,
        #[command(flatten)]
        common: Common,
    },
    /// Delete a definition.
    ///
    /// A running instance keeps running, transient from then on.
    Undefine {
        /// The instance's UUID.
        uuid: String,
        #[command(flatten)]
        common: Common,
    },
    /// Start a defined instance.
    Start {
        /// The instance's UUID.
        uuid: String,
        #[command(flatten)]
        common: Common,
    },
    /// Stop a running instance; its definition stays.
    ///
    /// An attached client is asked to release it (the device-request IRQ) and waited for
    /// (the daemon's --release-timeout); then the stop fails unless --force.
    Stop {
        /// The instance's UUID.
        uuid: String,
        /// Disconnect a client that does not release the instance in time.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Stop an instance and delete its definition.
    ///
    /// Gone for good (a ccw instance's image stays in the image directory). An attached
    /// client is treated as by `stop`.
    Remove {
        /// The instance's UUID.
        uuid: String,
        /// Disconnect a client that does not release the instance in time.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Move a running instance to another daemon, with its device state.
    ///
    /// Without a client attached, its state (registers, framebuffer and GTT of a GPU;
    /// registers and sense of a ccw device) is saved on this daemon and the instance handed
    /// over (no longer served here, its state kept), the destination creates the same UUID,
    /// type and parameters with that state, and then this daemon forgets it, its definition
    /// (autostart kept) moved with it. If the destination refuses, the instance is served
    /// here again as it was. At most one daemon serves the UUID at any moment; a migration
    /// cut short is settled by --recover. An instance with a client attached can only be
    /// migrated by its VMM, which owns the guest RAM and interrupts: --prepare creates the
    /// destination instance for the VMM to migrate into.
    #[command(after_help = "\
Example, between a daemon on the default control socket and one started with
`umdev daemon --socket-dir /run/umdev-b --state-dir /var/lib/umdev-b`:
  umdev migrate 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11 --to /run/umdev-b/control.sock

The source daemon is the one of --control (or UMDEV_CONTROL, or the default), as for the
other commands. A migration cut short (the command killed, a daemon restarted) is settled by
  umdev migrate 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11 --to /run/umdev-b/control.sock --recover")]
    Migrate(super::migrate::MigrateArgs),
}

fn parse_param(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?}: a parameter is KEY=VALUE")),
    }
}

fn params_of(list: Vec<(String, String)>) -> Result<Params, ClientError> {
    let mut params = Params::new();
    for (k, v) in list {
        if params.insert(k.clone(), v).is_some() {
            return Err(ClientError::Usage(format!("parameter {k:?} given twice")));
        }
    }
    Ok(params)
}

/// Why a client command failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No daemon listens on the control socket.
    #[error(
        "no umdev daemon is listening on {} ({why})\nhint: start one with `umdev daemon` \
         (it serves until Ctrl-C or SIGTERM), or point --control or {env} at the control socket \
         of a daemon started with --socket-dir or --control",
        path.display(),
        env = paths::CONTROL_ENV
    )]
    NoDaemon {
        /// The control socket.
        path: PathBuf,
        /// Why connecting failed (in the message: the hint comes last).
        why: std::io::Error,
    },
    /// Talking to the daemon failed.
    #[error("talking to the daemon on {}: {what}", path.display())]
    Io {
        /// The control socket.
        path: PathBuf,
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The daemon's answer could not be understood.
    #[error("the daemon on {} answered something this umdev cannot read: {why}", path.display())]
    Protocol {
        /// The control socket.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The daemon refused the request.
    #[error("{}{}", .0.message, .0.hint.as_ref().map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Daemon(ControlError),
    /// The command line is wrong in a way clap does not see.
    #[error("{0}")]
    Usage(String),
}

/// Send `request` to the daemon on `path` and wait for its answer.
pub fn call(path: &std::path::Path, request: &Request) -> Result<Reply, ClientError> {
    call_with_payload(path, request, &[]).map(|(reply, _)| reply)
}

/// Send `request` and the `payload` it announces ([`Request::payload_len`]) to the daemon
/// on `path`; returns its answer and the payload the reply announces.
pub fn call_with_payload(
    path: &std::path::Path,
    request: &Request,
    payload: &[u8],
) -> Result<(Reply, Vec<u8>), ClientError> {
    let io = |what: &str| {
        let what = what.to_owned();
        move |source| ClientError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let mut stream = UnixStream::connect(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::PermissionDenied => ClientError::Io {
            path: path.to_path_buf(),
            what: "connecting (the control socket serves only the daemon's user)".into(),
            source,
        },
        _ => ClientError::NoDaemon {
            path: path.to_path_buf(),
            why: source,
        },
    })?;
    let envelope = RequestEnvelope {
        version: protocol::PROTOCOL_VERSION,
        request,
    };
    stream
        .write_all(&protocol::encode(&envelope))
        .and_then(|()| stream.write_all(payload))
        .map_err(io("sending the request"))?;
    let mut reader = std::io::BufReader::new(&stream);
    let message = protocol::read_message(&mut reader).map_err(|e| match e {
        protocol::FrameError::Io(source) => io("reading the answer")(source),
        other => ClientError::Protocol {
            path: path.to_path_buf(),
            why: other.to_string(),
        },
    })?;
    let protocol_err = |why: String| ClientError::Protocol {
        path: path.to_path_buf(),
        why,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&message).map_err(|e| protocol_err(e.to_string()))?;
    match value.get("version").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(protocol::PROTOCOL_VERSION) => {}
        Some(v) => {
            return Err(ClientError::Daemon(
                ControlError::new(
                    protocol::ErrorKind::VersionMismatch,
                    format!(
                        "the daemon speaks control protocol version {v}, this umdev version {}",
                        protocol::PROTOCOL_VERSION
                    ),
                )
                .hint("use the umdev binary the daemon runs, or restart the daemon with this one"),
            ))
        }
        None => return Err(protocol_err("no protocol version in the answer".into())),
    }
    let response: Response =
        serde_json::from_value(value).map_err(|e| protocol_err(e.to_string()))?;
    match (response.ok, response.error) {
        (Some(reply), None) => {
            let payload =
                protocol::read_payload(&mut reader, reply.payload_len()).map_err(|e| match e {
                    protocol::FrameError::Io(source) | protocol::FrameError::PayloadIo(source) => {
                        io("reading the answer's payload")(source)
                    }
                    other => protocol_err(other.to_string()),
                })?;
            Ok((reply, payload))
        }
        (None, Some(error)) => Err(ClientError::Daemon(error)),
        _ => Err(protocol_err("neither a reply nor an error".into())),
    }
}

/// Run a client command.
pub fn run(command: ClientCommand) -> CliResult {
    let (common, request) = match command {
        ClientCommand::Migrate(args) => return super::migrate::run(args),
        ClientCommand::Types { common } => (common, Request::Types),
        ClientCommand::List { defined, common } => (common, Request::List { defined }),
        ClientCommand::Create {
            type_spec,
            uuid,
            auto,
            params,
            common,
        } => (
            common,
            Request::Create {
                type_spec,
                uuid,
                params: params_of(params)?,
                auto,
            },
        ),
        ClientCommand::Define {
            type_spec,
            uuid,
            auto,
            params,
            common,
        } => (
            common,
            Request::Define {
                type_spec,
                uuid,
                params: params_of(params)?,
                auto,
            },
        ),
        ClientCommand::Undefine { uuid, common } => (common, Request::Undefine { uuid }),
        ClientCommand::Start { uuid, common } => (common, Request::Start { uuid }),
        ClientCommand::Stop {
            uuid,
            force,
            common,
        } => (common, Request::Stop { uuid, force }),
        ClientCommand::Remove {
            uuid,
            force,
            common,
        } => (common, Request::Remove { uuid, force }),
    };
    let path = common
        .control
        .clone()
        .unwrap_or_else(paths::default_control);
    let result = call(&path, &request);
    let mut out = std::io::stdout().lock();
    match result {
        Ok(reply) => {
            let text = if common.json {
                render::json(&reply)
            } else {
                render::human(&request, &reply, super::table::stdout_bold())
            };
            out.write_all(text.as_bytes())?;
            Ok(())
        }
        Err(e) => {
            if common.json {
                if let ClientError::Daemon(error) = &e {
                    let text = serde_json::json!({ "error": error });
                    writeln!(out, "{text:#}")?;
                }
            }
            Err(e.into())
        }
    }
}
