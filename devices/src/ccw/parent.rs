//! [`CcwParent`]: ccw block devices carved out of a directory of images.
//!
//! # Types and the budget
//!
//! The parent owns a directory and a byte budget for it (its one [`Resource`],
//! `"storage"`, in MiB; default 1 GiB) and offers types by capacity (default `ccw-16m` and
//! `ccw-64m`). Each instance gets an image file in the directory: by default
//! `<uuid>.img`, created (sparse) with the type's capacity, or opened and grown to it if it
//! exists — so an instance defined again after a restart finds its data. What is left of
//! the budget is computed from the live instances (the sum of their types' capacities),
//! never counted by hand: an instance is in the parent's table from [`Parent::create`]
//! until its device is dropped (after the image is flushed), and the parent refuses one
//! that does not fit ([`InstanceError::Exhausted`]).
//!
//! Removing an instance keeps its image: deleting guest data is the admin's decision. The
//! budget bounds what live instances may use, not what lies in the directory.
//!
//! # Parameters
//!
//! - `image=<name>`: use the existing image `<name>` in the directory (grown to the type's
//!   capacity if it is shorter; a longer image is used up to the capacity). Checked, each
//!   refusal an [`InstanceError::BadParam`] that says why: a plain file name (no `/`, no
//!   `..`, not starting with `.`, at most 255 bytes, no NUL); the file exists; it is a
//!   regular file and not a symbolic link (opened with `O_NOFOLLOW`, so a link swapped in
//!   after the check cannot lead outside the directory either); no other live instance of
//!   this parent uses it.
//!
//! Any other key is refused.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource};
use umdev::pci::PciAdapter;

use super::format::BLOCK_SIZE;
use super::{image, program, Ccw, CcwError};

/// Name of the budget resource.
pub const RESOURCE_STORAGE: &str = "storage";
/// The parameter that picks an existing image.
pub const PARAM_IMAGE: &str = "image";
/// The largest capacity: its size in bytes fits a file offset (`i64`).
const MAX_CAPACITY_MIB: u64 = (i64::MAX as u64) >> 20;

/// One instance type of a [`CcwParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CcwType {
    /// Type name (`"ccw-16m"`).
    pub name: String,
    /// Capacity of an instance's image, MiB (taken from the budget).
    pub capacity_mib: u64,
}

impl CcwType {
    /// A type.
    pub fn new(name: &str, capacity_mib: u64) -> CcwType {
        CcwType {
            name: name.to_owned(),
            capacity_mib,
        }
    }
}

/// How to build a [`CcwParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CcwParentConfig {
    /// The image directory (created if missing).
    pub dir: PathBuf,
    /// The directory's budget for live instances, MiB.
    pub budget_mib: u64,
    /// The types offered.
    pub types: Vec<CcwType>,
}

impl CcwParentConfig {
    /// Images in `dir`, a 1 GiB budget, types `ccw-16m` and `ccw-64m`.
    pub fn new(dir: impl Into<PathBuf>) -> CcwParentConfig {
        CcwParentConfig {
            dir: dir.into(),
            budget_mib: 1024,
            types: vec![CcwType::new("ccw-16m", 16), CcwType::new("ccw-64m", 64)],
        }
    }
}

/// Why a [`CcwParentConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum CcwParentError {
    /// The budget is 0.
    #[error("the storage budget is 0 MiB")]
    EmptyBudget,
    /// No types.
    #[error("a ccw parent needs at least one type")]
    NoTypes,
    /// Two types with one name.
    #[error("type {0:?} is declared twice")]
    DuplicateType(String),
    /// A type that cannot be built.
    #[error("type {name:?}: {why}")]
    BadType {
        /// The type.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// The directory cannot be created or is not a directory.
    #[error("image directory {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// One live instance, as [`CcwParent::instances`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CcwInstanceInfo {
    /// Its UUID.
    pub uuid: String,
    /// Its type.
    pub type_name: String,
    /// Its image's file name in the directory.
    pub image: String,
    /// Its capacity, MiB.
    pub capacity_mib: u64,
}

#[derive(Default)]
struct Table {
    /// Live instances by UUID.
    instances: BTreeMap<String, CcwInstanceInfo>,
}

impl Table {
    fn user_of(&self, image: &str) -> Option<&str> {
        self.instances
            .values()
            .find(|i| i.image == image)
            .map(|i| i.uuid.as_str())
    }
}

struct Inner {
    config: CcwParentConfig,
    table: Mutex<Table>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What an instance's [`Ccw`] borrowed from its parent: its image and its share of the
/// budget, given back when the device is dropped.
pub(crate) struct ImageLease {
    parent: Weak<Inner>,
    uuid: String,
}

impl Drop for ImageLease {
    fn drop(&mut self) {
        if let Some(inner) = self.parent.upgrade() {
            lock(&inner.table).instances.remove(&self.uuid);
            tracing::debug!(uuid = %self.uuid, "ccw parent: instance released its image");
        }
    }
}

/// ccw instances on a directory of images (see the module doc). Cheap to clone; clones are
/// the same parent.
#[derive(Clone)]
pub struct CcwParent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CcwParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CcwParent")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Check an image file name (see the module doc; the NVMe parent's images follow the same
/// rules).
pub(crate) fn check_image_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty image name".into());
    }
    if name.len() > 255 {
        return Err("image name longer than 255 bytes".into());
    }
    if name.contains('/') || name.contains('\0') {
        return Err(
            "an image is named by its file name in the image directory, \
                    without '/'"
                .into(),
        );
    }
    if name.starts_with('.') || name.contains("..") {
        return Err("an image name may not start with '.' or contain '..'".into());
    }
    Ok(())
}

/// Open image `name` (checked by [`check_image_name`]) in `dir` for an instance: an
/// existing regular file (or a new one when `create`), never through a symbolic link.
pub(crate) fn open_image_in(dir: &Path, name: &str, create: bool) -> Result<File, InstanceError> {
    let path = dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        // No link is followed; opening a special file does not block (it is refused
        // below); O_NONBLOCK changes nothing for a regular file's pread/pwrite.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("no image {name:?} in {}", dir.display()),
            ))
        }
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("image {name:?} is a symbolic link"),
            ))
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EISDIR | libc::ENXIO)) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("image {name:?} is not a regular file"),
            ))
        }
        Err(source) => {
            return Err(InstanceError::Io {
                what: format!("opening image {}", path.display()),
                source,
            })
        }
    };
    let meta = file.metadata().map_err(|source| InstanceError::Io {
        what: format!("reading image {}", path.display()),
        source,
    })?;
    if !meta.is_file() {
        return Err(bad_param(
            PARAM_IMAGE,
            format!("image {name:?} is not a regular file"),
        ));
    }
    Ok(file)
}

pub(crate) fn bad_param(name: &str, why: impl Into<String>) -> InstanceError {
    InstanceError::BadParam {
        name: name.to_owned(),
        why: why.into(),
    }
}

impl CcwParent {
    /// A parent with `config` (checked: a non-empty budget, unique type names, capacities
    /// of at least 1 MiB that fit the budget; the directory is created if missing).
    pub fn new(config: CcwParentConfig) -> Result<CcwParent, CcwParentError> {
        if config.budget_mib == 0 {
            return Err(CcwParentError::EmptyBudget);
        }
        if config.types.is_empty() {
            return Err(CcwParentError::NoTypes);
        }
        for (i, t) in config.types.iter().enumerate() {
            let bad = |why: &str| CcwParentError::BadType {
                name: t.name.clone(),
                why: why.to_owned(),
            };
            if config.types[..i].iter().any(|o| o.name == t.name) {
                return Err(CcwParentError::DuplicateType(t.name.clone()));
            }
            if t.name.is_empty() {
                return Err(bad("empty name"));
            }
            if t.capacity_mib == 0 {
                return Err(bad("the capacity is 0 MiB"));
            }
            if t.capacity_mib > config.budget_mib {
                return Err(bad("the capacity is larger than the budget"));
            }
            if t.capacity_mib > MAX_CAPACITY_MIB {
                return Err(bad("the capacity is too large for a file"));
            }
        }
        let dir_err = |source| CcwParentError::Dir {
            path: config.dir.clone(),
            source,
        };
        std::fs::create_dir_all(&config.dir).map_err(dir_err)?;
        if !std::fs::metadata(&config.dir).map_err(dir_err)?.is_dir() {
            return Err(dir_err(io::Error::from_raw_os_error(libc::ENOTDIR)));
        }
        Ok(CcwParent {
            inner: Arc::new(Inner {
                config,
                table: Mutex::default(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CcwParentConfig {
        &self.inner.config
    }

    /// MiB of the budget held by live instances.
    pub fn budget_used_mib(&self) -> u64 {
        lock(&self.inner.table)
            .instances
            .values()
            .map(|i| i.capacity_mib)
            .sum()
    }

    /// The live instances, in UUID order.
    pub fn instances(&self) -> Vec<CcwInstanceInfo> {
        lock(&self.inner.table)
            .instances
            .values()
            .cloned()
            .collect()
    }

    /// The path of an image of this parent.
    pub fn image_path(&self, name: &str) -> PathBuf {
        self.inner.config.dir.join(name)
    }

    fn find_type(&self, name: &str) -> Result<&CcwType, InstanceError> {
        self.inner
            .config
            .types
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| InstanceError::UnknownType(name.to_owned()))
    }

    /// Open image `name` for an instance (see [`open_image_in`]).
    fn open_image(&self, name: &str, create: bool) -> Result<File, InstanceError> {
        open_image_in(&self.inner.config.dir, name, create)
    }

    /// The storage budget, the one resource this parent shares.
    fn storage(&self) -> Resource {
        Resource {
            name: RESOURCE_STORAGE.to_owned(),
            unit: "MiB".to_owned(),
            total: self.inner.config.budget_mib,
        }
    }

    /// Build instance `req` as a [`Ccw`] (what [`Parent::create`] serves through a
    /// [`PciAdapter`]): its share of the budget and its image are taken.
    pub fn create_ccw(&self, req: CreateRequest<'_>) -> Result<Ccw, InstanceError> {
        let ty = self.find_type(req.type_name)?;
        self.check_params(req.type_name, req.params)?;
        let (name, create) = match req.params.get(PARAM_IMAGE) {
            Some(name) => (name.clone(), false),
            None => {
                let name = format!("{}.img", req.uuid);
                check_image_name(&name).map_err(|why| bad_param("uuid", why))?;
                (name, true)
            }
        };
        let mut table = lock(&self.inner.table);
        if table.instances.contains_key(req.uuid) {
            return Err(InstanceError::UuidInUse(req.uuid.to_owned()));
        }
        let used: u64 = table.instances.values().map(|i| i.capacity_mib).sum();
        self.storage().check_room(&ty.name, used, ty.capacity_mib)?;
        if let Some(user) = table.user_of(&name) {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("image {name:?} is used by instance {user}"),
            ));
        }
        let file = self.open_image(&name, create)?;
        let blocks = (ty.capacity_mib << 20) / BLOCK_SIZE;
        let path = self.image_path(&name);
        let blocks = image::settle_capacity(&file, &path, Some(blocks)).map_err(|e| {
            let what = e.to_string();
            let source = match e {
                CcwError::Open { source, .. } | CcwError::Size { source, .. } => source,
                other => io::Error::from_raw_os_error(other.errno()),
            };
            InstanceError::Io { what, source }
        })?;
        table.instances.insert(
            req.uuid.to_owned(),
            CcwInstanceInfo {
                uuid: req.uuid.to_owned(),
                type_name: ty.name.clone(),
                image: name.clone(),
                capacity_mib: ty.capacity_mib,
            },
        );
        drop(table);
        tracing::info!(
            uuid = req.uuid,
            ty = %ty.name,
            image = %path.display(),
            blocks,
            "ccw parent: instance created"
        );
        Ok(
            Ccw::with_image(file, blocks, program::DEFAULT_MAX_CCWS).with_lease(ImageLease {
                parent: Arc::downgrade(&self.inner),
                uuid: req.uuid.to_owned(),
            }),
        )
    }
}

impl Parent for CcwParent {
    fn name(&self) -> &str {
        "ccw"
    }

    fn resources(&self) -> Vec<Resource> {
        vec![self.storage()]
    }

    fn types(&self) -> Vec<InstanceType> {
        self.inner
            .config
            .types
            .iter()
            .map(|t| InstanceType {
                name: t.name.clone(),
                description: format!(
                    "channel-program block device with a {} MiB image",
                    t.capacity_mib
                ),
                device_api: "vfio-pci".to_owned(),
                needs: vec![(RESOURCE_STORAGE.to_owned(), t.capacity_mib)],
            })
            .collect()
    }

    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        for (k, v) in params {
            if k != PARAM_IMAGE {
                return Err(bad_param(
                    k,
                    format!("unknown parameter (ccw instances take only {PARAM_IMAGE}=<name>)"),
                ));
            }
            check_image_name(v).map_err(|why| bad_param(k, why))?;
        }
        Ok(())
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        let ccw = self.create_ccw(req)?;
        Ok(Box::new(
            PciAdapter::new(ccw).map_err(InstanceError::Device)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_check_image_name_refuses_paths_and_dots() {
        for bad in [
            "",
            "..",
            ".",
            "../x",
            "a/b",
            "/etc/passwd",
            ".hidden",
            "a..b",
            "x\0y",
        ] {
            assert!(check_image_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_image_name(&"x".repeat(256)).is_err());
        for good in ["disk.img", "a-b_c.raw", "x"] {
            assert!(check_image_name(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn test_ccw_parent_config_checks() {
        let dir = tempfile::tempdir().unwrap();
        let with = |types: Vec<CcwType>, budget_mib| {
            CcwParent::new(CcwParentConfig {
                dir: dir.path().join("images"),
                budget_mib,
                types,
            })
            .map(|_| ())
        };
        assert!(matches!(with(vec![], 64), Err(CcwParentError::NoTypes)));
        let t = CcwType::new("t", 16);
        assert!(matches!(
            with(vec![t.clone()], 0),
            Err(CcwParentError::EmptyBudget)
        ));
        assert!(matches!(
            with(vec![t.clone(), t.clone()], 64),
            Err(CcwParentError::DuplicateType(_))
        ));
        for bad in [
            CcwType::new("t", 0),
            CcwType::new("t", 65),
            CcwType::new("", 1),
        ] {
            assert!(
                matches!(
                    with(vec![bad.clone()], 64),
                    Err(CcwParentError::BadType { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(with(vec![t.clone()], 64).is_ok());
        assert!(
            dir.path().join("images").is_dir(),
            "the directory is created"
        );
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let not_dir = CcwParent::new(CcwParentConfig {
            dir: file,
            budget_mib: 64,
            types: vec![t],
        });
        assert!(matches!(not_dir, Err(CcwParentError::Dir { .. })));
    }
}
