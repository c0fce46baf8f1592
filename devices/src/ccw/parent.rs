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

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource};

use super::format::BLOCK_SIZE;
use super::{image, program, Ccw, CcwError};
pub(crate) use crate::parent_common::Lease as ImageLease;
use crate::parent_common::{
    self, impl_type_list_error, Instances, OfferedType, Share, TypeListError,
};

/// Name of the budget resource.
pub const RESOURCE_STORAGE: &str = "storage";
/// The parameter that picks an existing image.
pub const PARAM_IMAGE: &str = parent_common::PARAM_IMAGE;
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

impl OfferedType for CcwType {
    fn type_name(&self) -> &str {
        &self.name
    }

    fn need_mib(&self) -> u64 {
        self.capacity_mib
    }

    fn description(&self) -> String {
        format!(
            "channel-program block device with a {} MiB image",
            self.capacity_mib
        )
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

impl_type_list_error!(CcwParentError);

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

impl Share for CcwInstanceInfo {
    fn share_mib(&self) -> u64 {
        self.capacity_mib
    }
}

struct Inner {
    config: CcwParentConfig,
    /// Live instances by UUID: from `create` until the device drops its [`ImageLease`] (its
    /// image and its share of the budget), after the image is flushed.
    table: Arc<Instances<CcwInstanceInfo>>,
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

impl CcwParent {
    /// A parent with `config` (checked: a non-empty budget, unique type names, capacities
    /// of at least 1 MiB that fit the budget; the directory is created if missing).
    pub fn new(config: CcwParentConfig) -> Result<CcwParent, CcwParentError> {
        if config.budget_mib == 0 {
            return Err(CcwParentError::EmptyBudget);
        }
        CcwParentError::check_types(&config.types, |t| {
            if t.capacity_mib == 0 {
                return Err("the capacity is 0 MiB".into());
            }
            if t.capacity_mib > config.budget_mib {
                return Err("the capacity is larger than the budget".into());
            }
            if t.capacity_mib > MAX_CAPACITY_MIB {
                return Err("the capacity is too large for a file".into());
            }
            Ok(())
        })?;
        parent_common::ensure_dir(&config.dir).map_err(|source| CcwParentError::Dir {
            path: config.dir.clone(),
            source,
        })?;
        Ok(CcwParent {
            inner: Arc::new(Inner {
                config,
                table: Instances::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CcwParentConfig {
        &self.inner.config
    }

    /// MiB of the budget held by live instances.
    pub fn budget_used_mib(&self) -> u64 {
        self.inner.table.used_mib()
    }

    /// The live instances, in UUID order.
    pub fn instances(&self) -> Vec<CcwInstanceInfo> {
        self.inner.table.lock().values().cloned().collect()
    }

    /// The path of an image of this parent.
    pub fn image_path(&self, name: &str) -> PathBuf {
        self.inner.config.dir.join(name)
    }

    /// Open image `name` for an instance (see [`parent_common::open_image_in`]).
    fn open_image(&self, name: &str, create: bool) -> Result<File, InstanceError> {
        parent_common::open_image_in(&self.inner.config.dir, name, create)
    }

    /// The storage budget, the one resource this parent shares.
    fn storage(&self) -> Resource {
        parent_common::mib_resource(RESOURCE_STORAGE, self.inner.config.budget_mib)
    }

    /// Build instance `req` as a [`Ccw`] (what [`Parent::create`] serves through a
    /// [`PciAdapter`](umdev::pci::PciAdapter)): its share of the budget and its image are
    /// taken.
    pub fn create_ccw(&self, req: CreateRequest<'_>) -> Result<Ccw, InstanceError> {
        let ty = parent_common::find_type(&self.inner.config.types, req.type_name)?;
        self.check_params(req.type_name, req.params)?;
        let (name, create) = parent_common::image_of(req.uuid, req.params)?;
        let mut table = self.inner.table.lock();
        parent_common::admit(&table, &self.storage(), req.uuid, ty)?;
        parent_common::check_image_unused(
            &name,
            table.values().map(|i| (i.uuid.as_str(), i.image.as_str())),
        )?;
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
        table.insert(
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
            Ccw::with_image(file, blocks, program::DEFAULT_MAX_CCWS).with_lease(Instances::lease(
                &self.inner.table,
                req.uuid,
                "ccw parent: instance released its image",
            )),
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
        parent_common::pci_types(&self.inner.config.types, RESOURCE_STORAGE)
    }

    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        parent_common::check_image_params("ccw", params)
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        parent_common::pci_device(self.create_ccw(req)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
