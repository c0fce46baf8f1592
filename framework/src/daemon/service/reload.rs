//! SIGHUP: read the definitions directory again and take what changed in it.
//!
//! # What a reload does (and does not)
//! - A definition file that is new, changed or gone since the daemon last read or wrote it
//!   replaces, updates or drops the definition in memory, as if the change had been made by
//!   `define` / `undefine`. The broken files reported are the ones found now.
//! - A definition that is new, or newly marked autostart, and is not running is started
//!   (unless `umdev migrate` handed it over: `migrating_to`). A start that fails is logged
//!   and reported by `list --defined`, as at startup.
//! - **Nothing running is stopped or changed.** An instance whose file is gone keeps
//!   running, transient from then on; one whose file changed keeps its type and parameters
//!   until it is next started.
//! - A UUID with a control request under way is left as it is and logged (reload again).
//!   So is one that a request changed while the directory was being read: the request's
//!   outcome, written to the file already, stands.
//! - A directory that cannot be read changes nothing.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::{chain, lock, Definition, Service};

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadReport {
    /// UUIDs defined by a new file.
    pub added: Vec<String>,
    /// UUIDs whose file changed.
    pub changed: Vec<String>,
    /// UUIDs whose file is gone.
    pub removed: Vec<String>,
    /// UUIDs left as they were: a request on them was under way.
    pub busy: Vec<String>,
    /// Instances started (new or newly autostart definitions).
    pub started: usize,
    /// Starts that failed.
    pub failed: usize,
    /// Broken files now.
    pub broken: usize,
}

impl Service {
    /// Read the definitions directory again ([module docs](self)). `None` if it could not
    /// be read (logged; nothing changed).
    pub fn reload(&self) -> Option<ReloadReport> {
        // The snapshot before the files: a request that changes a definition writes its file
        // first, then memory, under its claim of the UUID.
        let before = lock(&self.defs).defined.clone();
        let loaded = match self.store.load() {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %chain(&e), "reload: cannot read the definitions; nothing changed");
                return None;
            }
        };
        let mut report = ReloadReport::default();
        let uuids: BTreeSet<&String> = before.keys().chain(loaded.definitions.keys()).collect();
        let mut to_start = Vec::new();
        for uuid in uuids {
            let (old, new) = (before.get(uuid), loaded.definitions.get(uuid));
            if old == new {
                continue;
            }
            let Ok(claim) = self.claim(uuid) else {
                report.busy.push(uuid.clone());
                continue;
            };
            {
                let mut defs = lock(&self.defs);
                if defs.defined.get(uuid) != old {
                    report.busy.push(uuid.clone());
                    continue;
                }
                match new {
                    Some(d) => defs.defined.insert(uuid.clone(), d.clone()),
                    None => {
                        defs.start_errors.remove(uuid);
                        defs.defined.remove(uuid)
                    }
                };
            }
            let list = match (old, new) {
                (None, _) => &mut report.added,
                (_, None) => &mut report.removed,
                _ => &mut report.changed,
            };
            list.push(uuid.clone());
            let newly_auto = new.is_some_and(|d| d.autostart && d.migrating_to.is_none())
                && !old.is_some_and(|d| d.autostart);
            if let (true, Some(def)) = (newly_auto, new) {
                to_start.push((claim, def.clone()));
            }
        }
        report.broken = loaded.broken.len();
        for b in &loaded.broken {
            warn!(file = %b.path.display(), error = %b.error, "reload: malformed definition file skipped");
        }
        lock(&self.defs).broken = loaded.broken;
        for (_claim, def) in to_start {
            self.start_reloaded(&def, &mut report);
        }
        info!(
            added = ?report.added,
            changed = ?report.changed,
            removed = ?report.removed,
            busy = ?report.busy,
            started = report.started,
            failed = report.failed,
            broken = report.broken,
            "definitions reloaded (running instances are left as they are)"
        );
        Some(report)
    }

    /// Start a definition the reload found new or newly autostart, its UUID claimed.
    fn start_reloaded(&self, def: &Definition, report: &mut ReloadReport) {
        if self.registry.instance(&def.uuid).is_ok() || lock(&self.outgoing).contains_key(&def.uuid)
        {
            return;
        }
        match self.start_definition(def) {
            Ok(info) => {
                report.started += 1;
                info!(uuid = %def.uuid, socket = %info.socket.display(), "reload: autostart: started");
            }
            Err(e) => {
                report.failed += 1;
                let why = chain(&e);
                warn!(uuid = %def.uuid, error = %why, "reload: autostart failed");
                lock(&self.defs).start_errors.insert(def.uuid.clone(), why);
            }
        }
    }
}
