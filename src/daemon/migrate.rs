//! `umdev migrate UUID --to DST`: move a running instance, with its device state, from the
//! daemon of `--control` (the source) to the daemon whose control socket is `DST`.
//!
//! # Steps (the CLI carries the state between the two control sockets)
//! 1. `types` on the destination: it is reachable (nothing has been touched yet).
//! 2. `migrate_save` on the source: refused while a client is attached (only the VMM can
//!    migrate an attached device: it owns the guest RAM and interrupts) or for a device
//!    without migration; otherwise the device is stopped, saved as a migration stream
//!    (`protocol-docs/migration.md`, the stream a VMM reads in STOP_COPY) and resumed: the
//!    source serves on, unchanged.
//! 3. `migrate_load` on the destination: the same UUID, type and parameters, created with
//!    that state (the destination refuses an unknown type, a UUID in use, a resource left
//!    short, or a state its device refuses; then it has nothing new). It is defined there,
//!    with the source's autostart flag, when the source had a definition.
//! 4. `migrate_finish` on the source (skipped with `--keep-source`): the source saves the
//!    state again and removes the instance and its definition only if no client is attached
//!    and the state is the one shipped. If it refuses, the destination's instance (and
//!    definition) is removed again and the source keeps serving.
//!
//! With `--prepare`, only the destination instance is created (same UUID, type and
//! parameters, no state): the socket a VMM connects to and drives RESUMING on.

use std::io::Write;
use std::path::PathBuf;

use super::client::{self, ClientError, Common};
use super::protocol::{ControlError, ErrorKind, Reply, Request, StartedReply};
use super::{paths, render};
use crate::CliResult;

/// Arguments of `umdev migrate`.
#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// The instance's UUID (on the source daemon).
    pub uuid: String,
    /// The destination daemon's control socket.
    #[arg(long, value_name = "DST_CONTROL_SOCKET")]
    pub to: PathBuf,
    /// Keep the source instance and its definition: the destination gets a transient copy.
    #[arg(long, conflicts_with = "prepare")]
    pub keep_source: bool,
    /// Only create the destination instance (same UUID, type and parameters) for a VMM
    /// that migrates an attached device, and print its socket.
    #[arg(long)]
    pub prepare: bool,
    #[command(flatten)]
    pub common: Common,
}

/// What `umdev migrate` did (its `--json` output).
#[derive(Debug, serde::Serialize)]
struct Migrated {
    uuid: String,
    parent: String,
    #[serde(rename = "type")]
    type_name: String,
    /// The source's control socket.
    from: PathBuf,
    /// The destination's control socket.
    to: PathBuf,
    /// Bytes of state moved.
    state_bytes: u64,
    /// The instance's socket on the destination.
    socket: PathBuf,
    /// The definition written on the destination.
    #[serde(skip_serializing_if = "Option::is_none")]
    definition: Option<PathBuf>,
    /// The definition's autostart flag.
    autostart: bool,
    /// The source instance (and definition) was removed.
    source_removed: bool,
}

/// A destination's refusal, said as such (its kind and hint kept).
fn at_destination(to: &std::path::Path, e: ClientError) -> ClientError {
    match e {
        ClientError::Daemon(mut err) => {
            err.message = format!(
                "the destination daemon ({}) refused the instance: {}",
                to.display(),
                err.message
            );
            ClientError::Daemon(err)
        }
        other => other,
    }
}

fn unexpected(what: &str) -> ClientError {
    ClientError::Daemon(ControlError::new(
        ErrorKind::Internal,
        format!("the daemon answered {what} with an unexpected reply"),
    ))
}

/// Entry point of `umdev migrate`.
pub fn run(args: MigrateArgs) -> CliResult {
    let json = args.common.json;
    let result = migrate(&args);
    let mut out = std::io::stdout().lock();
    match result {
        Ok(text) => {
            out.write_all(text.as_bytes())?;
            Ok(())
        }
        Err(e) => {
            if json {
                if let ClientError::Daemon(error) = &e {
                    writeln!(out, "{:#}", serde_json::json!({ "error": error }))?;
                }
            }
            Err(e.into())
        }
    }
}

fn migrate(args: &MigrateArgs) -> Result<String, ClientError> {
    let from = args
        .common
        .control
        .clone()
        .unwrap_or_else(paths::default_control);
    let to = args.to.clone();
    // Reachable before anything is touched.
    client::call(&to, &Request::Types)?;
    if args.prepare {
        return prepare(args, &from, &to);
    }
    let (reply, state) = client::call_with_payload(
        &from,
        &Request::MigrateSave {
            uuid: args.uuid.clone(),
        },
        &[],
    )?;
    let Reply::Saved(saved) = reply else {
        return Err(unexpected("migrate_save"));
    };
    let inst = &saved.instance;
    let define = inst.defined && !args.keep_source;
    let load = Request::MigrateLoad {
        uuid: inst.uuid.clone(),
        type_spec: format!("{}/{}", inst.parent, inst.type_name),
        params: inst.params.clone(),
        define,
        autostart: inst.autostart,
        state_len: state.len() as u64,
    };
    let (reply, _) =
        client::call_with_payload(&to, &load, &state).map_err(|e| at_destination(&to, e))?;
    let Reply::Started(started) = reply else {
        return Err(unexpected("migrate_load"));
    };
    if !args.keep_source {
        let finish = Request::MigrateFinish {
            uuid: inst.uuid.clone(),
            digest: saved.digest,
        };
        if let Err(e) = client::call(&from, &finish) {
            // The source keeps the instance: take the copy back.
            let undo = client::call(
                &to,
                &Request::Remove {
                    uuid: inst.uuid.clone(),
                    force: true,
                },
            );
            return Err(match (e, undo) {
                (ClientError::Daemon(mut err), Ok(_)) => {
                    err.message = format!(
                        "{}; the destination's copy was removed again, the source serves on",
                        err.message
                    );
                    ClientError::Daemon(err)
                }
                (ClientError::Daemon(mut err), Err(undo)) => {
                    err.message = format!(
                        "{}; removing the destination's copy failed too ({undo}): `umdev \
                         remove {} --control {}` removes it",
                        err.message,
                        inst.uuid,
                        to.display()
                    );
                    ClientError::Daemon(err)
                }
                (other, _) => other,
            });
        }
    }
    let report = Migrated {
        uuid: inst.uuid.clone(),
        parent: inst.parent.clone(),
        type_name: inst.type_name.clone(),
        from,
        to,
        state_bytes: saved.state_len,
        socket: started.instance.socket.clone(),
        definition: started.definition.clone(),
        autostart: define && inst.autostart,
        source_removed: !args.keep_source,
    };
    Ok(if args.common.json {
        format!(
            "{:#}\n",
            serde_json::json!({ "migrated": serde_json::to_value(&report).unwrap_or_default() })
        )
    } else {
        human(&report)
    })
}

fn human(r: &Migrated) -> String {
    let mut s = format!(
        "migrated {} ({}/{}, {} bytes of state) to {}\nserved there on {}\n",
        r.uuid,
        r.parent,
        r.type_name,
        r.state_bytes,
        r.to.display(),
        r.socket.display()
    );
    if let Some(p) = &r.definition {
        s.push_str(&format!(
            "definition moved to {} (autostart: {})\n",
            p.display(),
            if r.autostart { "yes" } else { "no" }
        ));
    }
    if !r.source_removed {
        s.push_str(&format!(
            "the source instance was kept (--keep-source) on {}\n",
            r.from.display()
        ));
    }
    s
}

/// `--prepare`: the destination instance alone, for the VMM to migrate into.
fn prepare(
    args: &MigrateArgs,
    from: &std::path::Path,
    to: &std::path::Path,
) -> Result<String, ClientError> {
    let Reply::Instances(list) = client::call(from, &Request::List { defined: false })? else {
        return Err(unexpected("list"));
    };
    let wanted = args.uuid.to_ascii_lowercase();
    let Some(inst) = list.instances.iter().find(|i| i.uuid == wanted) else {
        return Err(ClientError::Daemon(
            ControlError::new(
                ErrorKind::NoSuchInstance,
                format!("no running instance {} on {}", args.uuid, from.display()),
            )
            .hint("`umdev list` lists the running instances"),
        ));
    };
    let create = Request::Create {
        type_spec: format!("{}/{}", inst.parent, inst.type_name),
        uuid: Some(inst.uuid.clone()),
        params: inst.params.clone(),
        auto: false,
    };
    let reply = client::call(to, &create).map_err(|e| at_destination(to, e))?;
    let Reply::Started(started) = &reply else {
        return Err(unexpected("create"));
    };
    Ok(if args.common.json {
        render::json(&reply)
    } else {
        render::prepared(started as &StartedReply)
    })
}
