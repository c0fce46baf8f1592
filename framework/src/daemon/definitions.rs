//! Definitions: the instances the daemon keeps across restarts, one JSON file per instance
//! in `<state-dir>/definitions/<uuid>.json` (what mdevctl keeps in `/etc/mdevctl.d`).
//!
//! ```json
//! {
//!   "version": 1,
//!   "uuid": "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11",
//!   "parent": "gpu",
//!   "type": "gpu-4m",
//!   "params": {},
//!   "autostart": true
//! }
//! ```
//!
//! A definition whose instance `umdev migrate` handed over to another daemon, not yet
//! settled, also has `"migrating_to": "<that daemon's control socket>"`: it is not started
//! (autostart included) until the migration is finished or aborted.
//!
//! # Invariants
//! - **A file is whole or absent.** A definition is written to a temporary file in the same
//!   directory (`.<uuid>.json.tmp`, mode 0600), fsynced, renamed over `<uuid>.json`, and the
//!   directory is fsynced: after a crash at any point the file holds the old definition or
//!   the new one, never a mix, and a definition reported written survives a power loss. A
//!   deletion is fsynced the same way.
//! - **Reading never trusts the file.** [`Store::load`] reads every `*.json` file (at most
//!   [`MAX_FILE`] bytes, a regular file opened without following a link) and sorts it into
//!   the definitions or the broken files, with the reason: not `<uuid>.json`, not JSON of
//!   this shape (unknown fields included), a version this daemon does not read, a UUID field
//!   that is not the file's. One broken file never stops the others from loading.
//! - Names starting with `.` (temporary files) and names not ending in `.json` are not
//!   definitions and are skipped.
//!
//! Whether the parent and type of a definition exist is not this module's business: that
//! is checked when the instance starts.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::instance::Params;
use serde::{Deserialize, Serialize};

use super::protocol::BrokenRow;

/// The version of the file format this daemon writes and reads.
pub const DEFINITION_VERSION: u32 = 1;
/// The largest definition file read.
pub const MAX_FILE: u64 = 64 * 1024;

/// One instance's definition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    /// [`DEFINITION_VERSION`].
    pub version: u32,
    /// The UUID, canonical form; the file is `<uuid>.json`.
    pub uuid: String,
    /// The parent's name.
    pub parent: String,
    /// The type's name within the parent.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The parent's parameters.
    #[serde(default)]
    pub params: Params,
    /// Start it when the daemon starts.
    #[serde(default)]
    pub autostart: bool,
    /// Handed over by `umdev migrate` to the daemon of this control socket, not yet
    /// confirmed: never started (autostart included) until the migration is settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrating_to: Option<PathBuf>,
}

impl Definition {
    /// `<parent>/<type>`, the way the registry addresses the type.
    pub fn type_spec(&self) -> String {
        format!("{}/{}", self.parent, self.type_name)
    }
}

/// Why the store could not write or delete a definition.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}", path.display())]
pub struct StoreError {
    /// What was being done.
    pub what: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: io::Error,
}

/// What [`Store::load`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The definitions, by UUID.
    pub definitions: BTreeMap<String, Definition>,
    /// The files that are not definitions this daemon can read.
    pub broken: Vec<BrokenRow>,
}

/// The definitions directory.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
}

/// The canonical form of `s` if it is a UUID.
pub fn canonical_uuid(s: &str) -> Option<String> {
    uuid::Uuid::parse_str(s)
        .ok()
        .map(|u| u.hyphenated().to_string())
}

impl Store {
    /// The store in `dir`, created (mode 0700) if missing.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Store, StoreError> {
        let dir = dir.into();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| StoreError {
                what: "creating the definitions directory",
                path: dir.clone(),
                source,
            })?;
        Ok(Store { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `uuid`'s definition.
    pub fn path_of(&self, uuid: &str) -> PathBuf {
        self.dir.join(format!("{uuid}.json"))
    }

    /// Read every definition file (see the module doc for what makes a file broken).
    pub fn load(&self) -> Result<Loaded, StoreError> {
        let entries = fs::read_dir(&self.dir).map_err(|source| StoreError {
            what: "reading the definitions directory",
            path: self.dir.clone(),
            source,
        })?;
        let mut loaded = Loaded::default();
        let mut names: Vec<String> = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| StoreError {
                what: "reading the definitions directory",
                path: self.dir.clone(),
                source,
            })?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                loaded.broken.push(BrokenRow {
                    path: entry.path(),
                    uuid: None,
                    error: "the file name is not UTF-8 (a definition is <uuid>.json)".into(),
                });
                continue;
            };
            if name.starts_with('.') || !name.ends_with(".json") {
                tracing::debug!(file = name, "not a definition, skipped");
                continue;
            }
            names.push(name.to_owned());
        }
        names.sort();
        for name in names {
            let path = self.dir.join(&name);
            let stem = &name[..name.len() - ".json".len()];
            let uuid = canonical_uuid(stem);
            match self.read_one(&path, stem, uuid.as_deref()) {
                Ok(def) => {
                    loaded.definitions.insert(def.uuid.clone(), def);
                }
                Err(error) => loaded.broken.push(BrokenRow { path, uuid, error }),
            }
        }
        Ok(loaded)
    }

    /// Read and check one file; the error says what is wrong with it.
    fn read_one(&self, path: &Path, stem: &str, uuid: Option<&str>) -> Result<Definition, String> {
        let Some(uuid) = uuid else {
            return Err(format!(
                "the file name is not <uuid>.json ({stem:?} is not a UUID)"
            ));
        };
        if uuid != stem {
            return Err(format!(
                "the file name is not the UUID's canonical form ({uuid}.json)"
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => "it is a symbolic link".to_owned(),
                _ => format!("cannot open it: {e}"),
            })?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot read it: {e}"))?;
        if !meta.is_file() {
            return Err("it is not a regular file".into());
        }
        let mut text = Vec::new();
        file.take(MAX_FILE + 1)
            .read_to_end(&mut text)
            .map_err(|e| format!("cannot read it: {e}"))?;
        if text.len() as u64 > MAX_FILE {
            return Err(format!("it is larger than {MAX_FILE} bytes"));
        }
        // The version first, so that a newer file gets the right complaint.
        let value: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| format!("not JSON: {e}"))?;
        match value.get("version").map(serde_json::Value::as_u64) {
            Some(Some(v)) if v == u64::from(DEFINITION_VERSION) => {}
            Some(Some(v)) => {
                return Err(format!(
                    "definition version {v}: this daemon reads version {DEFINITION_VERSION}"
                ))
            }
            _ => return Err("no \"version\" number".into()),
        }
        let def: Definition =
            serde_json::from_value(value).map_err(|e| format!("not a definition: {e}"))?;
        if def.uuid != uuid {
            return Err(format!(
                "its \"uuid\" {:?} is not the file's ({uuid})",
                def.uuid
            ));
        }
        if def.parent.is_empty() || def.type_name.is_empty() {
            return Err("empty \"parent\" or \"type\"".into());
        }
        Ok(def)
    }

    /// Write `def` atomically (see the module doc); returns its path.
    pub fn write(&self, def: &Definition) -> Result<PathBuf, StoreError> {
        let path = self.path_of(&def.uuid);
        let tmp = self.dir.join(format!(".{}.json.tmp", def.uuid));
        let err = |what, source| StoreError {
            what,
            path: path.clone(),
            source,
        };
        // Plain data with string keys: serializing cannot fail.
        let mut text = serde_json::to_vec_pretty(def)
            .map_err(|e| err("encoding the definition", io::Error::other(e)))?;
        text.push(b'\n');
        let result = (|| {
            // A temporary file left by a crash is replaced.
            match fs::remove_file(&tmp) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(err("removing a stale temporary file for", e))
                }
                _ => {}
            }
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
                .map_err(|e| err("creating a temporary file for", e))?;
            file.write_all(&text)
                .map_err(|e| err("writing the definition", e))?;
            file.sync_all()
                .map_err(|e| err("syncing the definition", e))?;
            fs::rename(&tmp, &path).map_err(|e| err("renaming the definition into", e))?;
            self.sync_dir()
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.map(|()| path)
    }

    /// Delete the file at `path` (a definition of this store, or a broken file in it).
    pub fn delete(&self, path: &Path) -> Result<(), StoreError> {
        fs::remove_file(path).map_err(|source| StoreError {
            what: "deleting",
            path: path.to_path_buf(),
            source,
        })?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<(), StoreError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| StoreError {
                what: "syncing the definitions directory",
                path: self.dir.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U1: &str = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
    const U2: &str = "0b1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a22";

    fn def(uuid: &str) -> Definition {
        Definition {
            version: DEFINITION_VERSION,
            uuid: uuid.into(),
            parent: "gpu".into(),
            type_name: "gpu-4m".into(),
            params: Params::from([("k".to_string(), "v".to_string())]),
            autostart: true,
            migrating_to: None,
        }
    }

    #[test]
    fn test_store_write_load_delete_round_trip_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("defs")).unwrap();
        // A temporary file a crash left behind is replaced, not a problem.
        fs::write(store.dir().join(format!(".{U1}.json.tmp")), b"half").unwrap();
        let path = store.write(&def(U1)).unwrap();
        assert_eq!(path, store.path_of(U1));
        let mut changed = def(U1);
        changed.autostart = false;
        store.write(&changed).unwrap();
        store.write(&def(U2)).unwrap();
        let loaded = store.load().unwrap();
        assert!(loaded.broken.is_empty(), "{:?}", loaded.broken);
        assert_eq!(loaded.definitions.len(), 2);
        assert_eq!(loaded.definitions[U1], changed);
        let names: Vec<String> = fs::read_dir(store.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        store.delete(&path).unwrap();
        assert_eq!(store.load().unwrap().definitions.len(), 1);
    }

    #[test]
    fn test_store_load_reports_each_broken_file_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.write(&def(U1)).unwrap();
        let put = |name: &str, text: &str| fs::write(dir.path().join(name), text).unwrap();
        put(&format!("{U2}.json"), "{ not json");
        put("not-a-uuid.json", &serde_json::to_string(&def(U1)).unwrap());
        put(
            "11111111-2222-4333-8444-555555555555.json",
            &serde_json::to_string(&def(U1)).unwrap(),
        );
        put(
            "21111111-2222-4333-8444-555555555555.json",
            r#"{"version":2,"uuid":"21111111-2222-4333-8444-555555555555"}"#,
        );
        put(
            "31111111-2222-4333-8444-555555555555.json",
            r#"{"version":1,"uuid":"31111111-2222-4333-8444-555555555555","parent":"gpu","type":"t","colour":"red"}"#,
        );
        put("README", "not a definition");
        std::os::unix::fs::symlink(
            store.path_of(U1),
            dir.path().join("41111111-2222-4333-8444-555555555555.json"),
        )
        .unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.definitions.keys().collect::<Vec<_>>(), [U1]);
        let why = |stem: &str| {
            loaded
                .broken
                .iter()
                .find(|b| b.path.file_name().unwrap() == format!("{stem}.json").as_str())
                .unwrap_or_else(|| panic!("{stem} not reported: {:?}", loaded.broken))
                .error
                .clone()
        };
        assert!(why(U2).contains("not JSON"), "{}", why(U2));
        assert!(why("not-a-uuid").contains("not a UUID"));
        assert!(why("11111111-2222-4333-8444-555555555555").contains("is not the file's"));
        assert!(why("21111111-2222-4333-8444-555555555555").contains("version 2"));
        assert!(why("31111111-2222-4333-8444-555555555555").contains("colour"));
        assert!(why("41111111-2222-4333-8444-555555555555").contains("symbolic link"));
        assert_eq!(loaded.broken.len(), 6);
        let broken_u2 = loaded.broken.iter().find(|b| b.error.contains("not JSON"));
        assert_eq!(broken_u2.unwrap().uuid.as_deref(), Some(U2));
    }
}
