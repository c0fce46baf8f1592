//! `umdev migrate UUID --to DST`: move a running instance, with its device state, from the
//! daemon of `--control` (the source) to the daemon whose control socket is `DST`. The steps,
//! and how a migration cut short is settled, are the library's
//! ([`umdev::daemon::client::migrate`]); here are the command line and what it prints.

use std::io::Write;
use std::path::{Path, PathBuf};

use umdev::daemon::client::migrate::{self, Migrated, Recovered, ServedBy};
use umdev::daemon::client::ClientError;
use umdev::daemon::paths;
use umdev::daemon::protocol::Reply;

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

/// Do what `args` asks; returns what to print.
fn migrate(args: &MigrateArgs) -> Result<String, ClientError> {
    let from = args
        .common
        .control
        .clone()
        .unwrap_or_else(paths::default_control);
    let json = args.common.json;
    if args.prepare {
        let started = migrate::prepare(&from, &args.to, &args.uuid)?;
        return Ok(match json {
            true => render::json(&Reply::Started(started)),
            false => render::prepared(&started),
        });
    }
    if args.recover {
        let r = migrate::recover(&from, &args.to, &args.uuid)?;
        return Ok(match json {
            true => format!("{:#}\n", serde_json::json!({ "recovered": r })),
            false => recovered(&r, &args.to),
        });
    }
    let report = migrate::migrate(&from, &args.to, &args.uuid, args.keep_source)?;
    Ok(match json {
        true => format!(
            "{:#}\n",
            serde_json::json!({ "migrated": serde_json::to_value(&report).unwrap_or_default() })
        ),
        false => human(&report),
    })
}

fn recovered(r: &Recovered, to: &Path) -> String {
    let uuid = &r.uuid;
    match r.served_by {
        ServedBy::Destination => format!(
            "settled {uuid}: the destination ({}) has it; the source's leftover was removed\n",
            to.display()
        ),
        ServedBy::Source => format!(
            "settled {uuid}: the destination does not have it; the source serves it again{}\n",
            r.socket
                .as_ref()
                .map(|s| format!(" on {}", s.display()))
                .unwrap_or_default()
        ),
    }
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
