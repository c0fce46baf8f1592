//! Moving a running instance, with its device state, from one daemon (the source) to another
//! (the destination), each named by its control socket: [`migrate`], [`recover`] (settle one
//! cut short) and [`prepare`] (the destination instance alone, for a VMM to migrate into).
//! `umdev migrate UUID --to DST` is these with a command line around them.
//!
//! # Steps (the caller carries the state between the two control sockets)
//! 1. `types` on the destination: it is reachable (nothing has been touched yet).
//! 2. `migrate_save` on the source: refused while a client is attached (only the VMM can
//!    migrate an attached device: it owns the guest RAM and interrupts) or for a device
//!    without migration; otherwise the device is stopped and saved as a migration stream
//!    (`protocol-docs/migration.md`, the stream a VMM reads in STOP_COPY), and the instance
//!    is **handed over**: its definition (if any) marked as migrating to `DST`, the instance
//!    removed (its socket gone), its state kept by the source daemon.
//! 3. `migrate_load` on the destination: the same UUID, type and parameters, created with
//!    that state (the destination refuses an unknown type, a UUID in use, a resource left
//!    short, or a state its device refuses; then it has nothing new, and the caller sends
//!    `migrate_abort` to the source, which serves the instance again with the kept state).
//!    It is defined there, with the source's autostart flag, when the source had a
//!    definition.
//! 4. `migrate_finish` on the source: it forgets the kept state and deletes the marked
//!    definition.
//!
//! # Interrupted
//! The source stops serving (step 2) before the destination starts (step 3): **at most one
//! daemon serves the UUID** at every moment, and a marked definition is never started, at
//! a restart neither. A migration cut short (the caller killed, a daemon restarted, a socket
//! error) leaves at most a leftover on the source, settled by [`recover`] (`umdev migrate
//! UUID --to DST --recover`): if the destination runs or defines the UUID, `migrate_finish`
//! on the source; otherwise `migrate_abort` there (with the kept state, or from the definition if the
//! source daemon restarted meanwhile and lost it). `umdev remove UUID` on the source drops
//! the leftover too. [`migrate`] settles by itself when it sees a step fail.
//!
//! With `keep_source` the source is stopped, saved and resumed (not handed over) and the
//! destination gets a transient copy: the one case where two daemons serve the UUID, on
//! request. With [`prepare`], only the destination instance is created (same UUID, type
//! and parameters, no state): the socket a VMM connects to and drives RESUMING on.

use std::path::{Path, PathBuf};

use super::{self as client, ClientError};
use crate::daemon::protocol::{ControlError, ErrorKind, Reply, Request, StartedReply};

/// What [`migrate`] did (`umdev migrate --json` prints it).
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct Migrated {
    /// The instance.
    pub uuid: String,
    /// Its parent.
    pub parent: String,
    /// Its type.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The source's control socket.
    pub from: PathBuf,
    /// The destination's control socket.
    pub to: PathBuf,
    /// Bytes of state moved.
    pub state_bytes: u64,
    /// The instance's socket on the destination.
    pub socket: PathBuf,
    /// The definition written on the destination.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub definition: Option<PathBuf>,
    /// The definition's autostart flag.
    pub autostart: bool,
    /// The source instance (and definition) was removed.
    pub source_removed: bool,
}

/// A destination's refusal, said as such (its kind and hint kept).
fn at_destination(to: &Path, e: ClientError) -> ClientError {
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

/// Migrate the running instance `uuid` from the daemon on `from` to the daemon on `to`
/// (the steps: the module documentation). With `keep_source`, the source instance stays
/// (stopped, saved and resumed) and the destination gets a transient copy.
///
/// An error says what failed and what was done about it (the instance served again on the
/// source, or the leftover to settle with [`recover`]).
pub fn migrate(
    from: &Path,
    to: &Path,
    uuid: &str,
    keep_source: bool,
) -> Result<Migrated, ClientError> {
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    // Reachable before anything is touched.
    client::call(&to, &Request::Types)?;
    let save = Request::MigrateSave {
        uuid: uuid.to_owned(),
        keep_source,
        to: Some(to.clone()),
    };
    let (reply, state) = match client::call_with_payload(&from, &save, &[]) {
        Ok(r) => r,
        // The source refused: nothing changed.
        Err(e @ ClientError::Daemon(_)) => return Err(e),
        // The source may have handed it over without the state reaching us.
        Err(e) if !keep_source => return Err(settle_after(e, uuid, &from, &to)),
        Err(e) => return Err(e),
    };
    let Reply::Saved(saved) = reply else {
        return Err(unexpected("migrate_save"));
    };
    let inst = &saved.instance;
    let define = inst.defined && !keep_source;
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
    Ok(Migrated {
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
    })
}

/// Who serves an instance once a cut-short migration is settled ([`recover`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServedBy {
    /// The destination has it; the source's leftover was removed.
    Destination,
    /// The destination does not have it; the source serves it again.
    Source,
}

/// What [`recover`] did (`umdev migrate --recover --json` prints it).
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct Recovered {
    /// The instance (canonical UUID).
    pub uuid: String,
    /// Who serves it now.
    pub served_by: ServedBy,
    /// Its socket on the source, if the source serves it again.
    pub socket: Option<PathBuf>,
}

/// Settle a migration of `uuid` from `from` to `to` that was cut short (see "Interrupted"):
/// the source's leftover is removed if the destination runs or defines the instance,
/// served again otherwise.
pub fn recover(from: &Path, to: &Path, uuid: &str) -> Result<Recovered, ClientError> {
    // Reachable before anything is touched.
    client::call(to, &Request::Types)?;
    let (served_by, reply) = settle(uuid, from, to)?;
    let socket = match &reply {
        Some(Reply::Started(s)) => Some(s.instance.socket.clone()),
        _ => None,
    };
    Ok(Recovered {
        uuid: uuid.to_ascii_lowercase(),
        served_by,
        socket,
    })
}

/// Create on the daemon on `to` the destination instance of `uuid`, running on the daemon on
/// `from` (same UUID, type and parameters, no state), for the VMM that holds it to migrate
/// into (it drives RESUMING there); returns the destination's reply.
pub fn prepare(from: &Path, to: &Path, uuid: &str) -> Result<StartedReply, ClientError> {
    // Reachable before anything is touched.
    client::call(to, &Request::Types)?;
    let Reply::Instances(list) = client::call(from, &Request::List { defined: false })? else {
        return Err(unexpected("list"));
    };
    let wanted = uuid.to_ascii_lowercase();
    let Some(inst) = list.instances.iter().find(|i| i.uuid == wanted) else {
        return Err(ClientError::Daemon(
            ControlError::new(
                ErrorKind::NoSuchInstance,
                format!("no running instance {} on {}", uuid, from.display()),
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
    match client::call(to, &create).map_err(|e| at_destination(to, e))? {
        Reply::Started(started) => Ok(started),
        _ => Err(unexpected("create")),
    }
}
