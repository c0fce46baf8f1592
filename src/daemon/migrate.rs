//! `umdev migrate UUID --to DST`: move a running instance, with its device state, from the
//! daemon of `--control` (the source) to the daemon whose control socket is `DST`.
//!
//! # Steps (the CLI carries the state between the two control sockets)
//! 1. `types` on the destination: it is reachable (nothing has been touched yet).
//! 2. `migrate_save` on the source: refused while a client is attached (only the VMM can
//!    migrate an attached device: it owns the guest RAM and interrupts) or for a device
//!    without migration; otherwise the device is stopped and saved as a migration stream
//!    (`protocol-docs/migration.md`, the stream a VMM reads in STOP_COPY), and the instance
//!    is **handed over**: its definition (if any) marked as migrating to `DST`, the instance
//!    removed (its socket gone), its state kept by the source daemon.
//! 3. `migrate_load` on the destination: the same UUID, type and parameters, created with
//!    that state (the destination refuses an unknown type, a UUID in use, a resource left
//!    short, or a state its device refuses; then it has nothing new, and the CLI sends
//!    `migrate_abort` to the source, which serves the instance again with the kept state).
//!    It is defined there, with the source's autostart flag, when the source had a
//!    definition.
//! 4. `migrate_finish` on the source: it forgets the kept state and deletes the marked
//!    definition.
//!
//! # Interrupted
//! The source stops serving (step 2) before the destination starts (step 3): **at most one
//! daemon serves the UUID** at every moment, and a marked definition is never started, at
//! a restart neither. A migration cut short (the CLI killed, a daemon restarted, a socket
//! error) leaves at most a leftover on the source, settled by `umdev migrate UUID --to DST
//! --recover`: if the destination runs or defines the UUID, `migrate_finish` on the source;
//! otherwise `migrate_abort` there (with the kept state, or from the definition if the
//! source daemon restarted meanwhile and lost it). `umdev remove UUID` on the source drops
//! the leftover too. The CLI settles by itself when it sees a step fail.
//!
//! With `--keep-source` the source is stopped, saved and resumed (not handed over) and the
//! destination gets a transient copy: the one case where two daemons serve the UUID, on
//! request. With `--prepare`, only the destination instance is created (same UUID, type
//! and parameters, no state): the socket a VMM connects to and drives RESUMING on.

use std::io::Write;
use std::path::{Path, PathBuf};

use umdev::daemon::client::{self, ClientError};
use umdev::daemon::paths;
use umdev::daemon::protocol::{ControlError, ErrorKind, Reply, Request, StartedReply};

use super::client::Common;
use super::render;
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
    /// Settle a migration that was cut short: the source's leftover is removed if the
    /// destination runs or defines the instance, served again otherwise.
    #[arg(long, conflicts_with_all = ["keep_source", "prepare"])]
    pub recover: bool,
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

/// `e` with `more` appended to what it says.
fn with_note(e: ClientError, more: &str) -> ClientError {
    match e {
        ClientError::Daemon(mut err) => {
            err.message = format!("{}; {more}", err.message);
            ClientError::Daemon(err)
        }
        other => ClientError::Daemon(ControlError::new(ErrorKind::Io, format!("{other}; {more}"))),
    }
}

/// Who serves a settled migration.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
enum ServedBy {
    /// The destination has it; the source's leftover was removed.
    Destination,
    /// The destination does not have it; the source serves it again.
    Source,
}

/// Settle `uuid` between `from` and `to` (see "Interrupted" in the module doc).
fn settle(uuid: &str, from: &Path, to: &Path) -> Result<(ServedBy, Option<Reply>), ClientError> {
    let wanted = uuid.to_ascii_lowercase();
    let Reply::Instances(running) = client::call(to, &Request::List { defined: false })? else {
        return Err(unexpected("list"));
    };
    let Reply::Definitions(defined) = client::call(to, &Request::List { defined: true })? else {
        return Err(unexpected("list"));
    };
    let there = running.instances.iter().any(|i| i.uuid == wanted)
        || defined.definitions.iter().any(|d| d.uuid == wanted);
    let uuid = uuid.to_owned();
    if there {
        client::call(from, &Request::MigrateFinish { uuid })?;
        Ok((ServedBy::Destination, None))
    } else {
        let reply = client::call(from, &Request::MigrateAbort { uuid })?;
        Ok((ServedBy::Source, Some(reply)))
    }
}

/// Settle after a step failed; `e` says what failed, and what settling did.
fn settle_after(e: ClientError, uuid: &str, from: &Path, to: &Path) -> ClientError {
    let note = match settle(uuid, from, to) {
        Ok((ServedBy::Destination, _)) => format!(
            "the destination ({}) serves the instance; the source's copy was removed",
            to.display()
        ),
        Ok((ServedBy::Source, _)) => "the source serves the instance again".to_owned(),
        Err(settling) => format!(
            "settling failed too ({settling}): `umdev migrate {uuid} --to {} --recover` \
             settles it (one daemon at most serves it meanwhile)",
            to.display()
        ),
    };
    with_note(e, &note)
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
    if args.recover {
        return recover(args, &from, &to);
    }
    let save = Request::MigrateSave {
        uuid: args.uuid.clone(),
        keep_source: args.keep_source,
        to: Some(to.clone()),
    };
    let (reply, state) = match client::call_with_payload(&from, &save, &[]) {
        Ok(r) => r,
        // The source refused: nothing changed.
        Err(e @ ClientError::Daemon(_)) => return Err(e),
        // The source may have handed it over without the state reaching us.
        Err(e) if !args.keep_source => return Err(settle_after(e, &args.uuid, &from, &to)),
        Err(e) => return Err(e),
    };
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
    let started = match client::call_with_payload(&to, &load, &state) {
        Ok((Reply::Started(started), _)) => started,
        Ok(_) => {
            let e = unexpected("migrate_load");
            return Err(match saved.handed_over {
                true => settle_after(e, &inst.uuid, &from, &to),
                false => e,
            });
        }
        // The destination refused: it has nothing new; the source serves the instance again.
        Err(e @ ClientError::Daemon(_)) if saved.handed_over => {
            let e = at_destination(&to, e);
            let abort = Request::MigrateAbort {
                uuid: inst.uuid.clone(),
            };
            return Err(match client::call(&from, &abort) {
                Ok(_) => with_note(e, "the source serves the instance again"),
                Err(undo) => with_note(
                    e,
                    &format!(
                        "serving it again on the source failed ({undo}): `umdev migrate {} \
                         --to {} --recover` settles it",
                        inst.uuid,
                        to.display()
                    ),
                ),
            });
        }
        // Unknown whether the destination created it: look.
        Err(e) if saved.handed_over => {
            return Err(settle_after(at_destination(&to, e), &inst.uuid, &from, &to))
        }
        Err(e) => return Err(at_destination(&to, e)),
    };
    if saved.handed_over {
        let finish = Request::MigrateFinish {
            uuid: inst.uuid.clone(),
        };
        if let Err(e) = client::call(&from, &finish) {
            // The destination serves it: the source keeps only a leftover, never served.
            return Err(with_note(
                e,
                &format!(
                    "the destination serves the instance; the source keeps a leftover that \
                     it does not serve: `umdev migrate {} --to {} --recover` removes it",
                    inst.uuid,
                    to.display()
                ),
            ));
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
        source_removed: saved.handed_over,
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

/// `--recover`: settle a migration that was cut short.
fn recover(args: &MigrateArgs, from: &Path, to: &Path) -> Result<String, ClientError> {
    let (served_by, reply) = settle(&args.uuid, from, to)?;
    let socket = match &reply {
        Some(Reply::Started(s)) => Some(s.instance.socket.clone()),
        _ => None,
    };
    let uuid = args.uuid.to_ascii_lowercase();
    Ok(if args.common.json {
        format!(
            "{:#}\n",
            serde_json::json!({ "recovered": {
                "uuid": uuid, "served_by": served_by, "socket": socket,
            }})
        )
    } else {
        match served_by {
            ServedBy::Destination => format!(
                "settled {uuid}: the destination ({}) has it; the source's leftover was removed\n",
                to.display()
            ),
            ServedBy::Source => format!(
                "settled {uuid}: the destination does not have it; the source serves it again{}\n",
                socket
                    .map(|s| format!(" on {}", s.display()))
                    .unwrap_or_default()
            ),
        }
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
