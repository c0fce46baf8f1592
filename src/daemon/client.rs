//! The client commands: `umdev types`, `list`, `create`, `define`, `undefine`, `start`,
//! `stop`, `remove`. Each sends one request to the daemon's control socket and prints the
//! reply as a table (or `--json`); an error goes to stderr with a hint, and the exit status
//! is 1 (with `--json`, the error is also printed on stdout as `{"error": {...}}`).

use std::io::Write;
use std::path::PathBuf;

use clap::Subcommand;
use umdev::daemon::client::{call, ClientError};
use umdev::daemon::paths;
use umdev::daemon::protocol::Request;
use umdev::instance::Params;

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

/// The parameters; one given twice is a usage error (clap does not see it).
fn params_of(list: Vec<(String, String)>) -> Result<Params, String> {
    let mut params = Params::new();
    for (k, v) in list {
        if params.insert(k.clone(), v).is_some() {
            return Err(format!("parameter {k:?} given twice"));
        }
    }
    Ok(params)
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
