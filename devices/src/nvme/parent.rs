//! [`NvmeParent`]: NVMe controllers carved out of a directory of images.
//!
//! # Types and the budget
//!
//! The parent owns a directory and a byte budget for it (its one [`Resource`],
//! `"storage"`, in MiB; default 4 GiB) and offers types by namespace capacity and number of
//! I/O queue pairs (default `nvme-256m` with 2 queue pairs and `nvme-1g` with 4). Each
//! instance gets an image file in the directory: by default `<uuid>.img`, created (sparse)
//! with the type's capacity, or opened and grown to it if it exists — so an instance
//! defined again after a restart finds its data. What is left of the budget is computed
//! from the live instances (the sum of their types' capacities), never counted by hand: an
//! instance is in the parent's table from [`Parent::create`] until its controller is
//! dropped (after its threads end and the image is flushed), and the parent refuses one
//! that does not fit ([`InstanceError::Exhausted`]).
//!
//! Removing an instance keeps its image: deleting guest data is the admin's decision. The
//! budget bounds what live instances may use, not what lies in the directory.
//!
//! # Parameters
//!
//! - `image=<name>`: use the existing image `<name>` in the directory, with the ccw
//!   parent's rules (`devices/src/ccw/parent.rs`): a plain file name (no `/`, no `..`, not
//!   starting with `.`, at most 255 bytes, no NUL); the file exists; it is a regular file
//!   and not a symbolic link (opened with `O_NOFOLLOW`); no other live instance of this
//!   parent uses it. A shorter image is grown to the type's capacity; a longer one is used
//!   up to the capacity. Each refusal is an [`InstanceError::BadParam`] that says why.
//!
//! Any other key is refused.
//!
//! The controller's serial number is the instance's UUID without its dashes (its first 20
//! characters), so a guest tells two instances apart.

use std::path::PathBuf;
use std::sync::Arc;

use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource};

use super::{ImageError, Nvme, NvmeConfig, MAX_IO_QUEUES};
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

/// One instance type of an [`NvmeParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeType {
    /// Type name (`"nvme-1g"`).
    pub name: String,
    /// Capacity of an instance's namespace (its image), MiB (taken from the budget).
    pub capacity_mib: u64,
    /// I/O queue pairs the controller offers (1..=[`MAX_IO_QUEUES`]).
    pub io_queues: u16,
}

impl NvmeType {
    /// A type.
    pub fn new(name: &str, capacity_mib: u64, io_queues: u16) -> NvmeType {
        NvmeType {
            name: name.to_owned(),
            capacity_mib,
            io_queues,
        }
    }
}

impl OfferedType for NvmeType {
    fn type_name(&self) -> &str {
        &self.name
    }

    fn need_mib(&self) -> u64 {
        self.capacity_mib
    }

    fn description(&self) -> String {
        format!(
            "NVMe controller, {} MiB namespace, {} I/O queue pairs",
            self.capacity_mib, self.io_queues
        )
    }
}

/// How to build an [`NvmeParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeParentConfig {
    /// The image directory (created if missing).
    pub dir: PathBuf,
    /// The directory's budget for live instances, MiB.
    pub budget_mib: u64,
    /// The types offered.
    pub types: Vec<NvmeType>,
    /// The instances' [`NvmeConfig::shadow_poll`] (default [`super::SHADOW_POLL`]; zero when
    /// the daemon runs with `--poll off`).
    pub shadow_poll: std::time::Duration,
}

impl NvmeParentConfig {
    /// Images in `dir`, a 4 GiB budget, types `nvme-256m` (2 I/O queue pairs) and
    /// `nvme-1g` (4).
    pub fn new(dir: impl Into<PathBuf>) -> NvmeParentConfig {
        NvmeParentConfig {
            dir: dir.into(),
            budget_mib: 4096,
            types: vec![
                NvmeType::new("nvme-256m", 256, 2),
                NvmeType::new("nvme-1g", 1024, 4),
            ],
            shadow_poll: super::SHADOW_POLL,
        }
    }
}

/// Why an [`NvmeParentConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum NvmeParentError {
    /// The budget is 0.
    #[error("the storage budget is 0 MiB")]
    EmptyBudget,
    /// No types.
    #[error("an nvme parent needs at least one type")]
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
        source: std::io::Error,
    },
}

impl_type_list_error!(NvmeParentError);

/// One live instance, as [`NvmeParent::instances`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeInstanceInfo {
    /// Its UUID.
    pub uuid: String,
    /// Its type.
    pub type_name: String,
    /// Its image's file name in the directory.
    pub image: String,
    /// Its capacity, MiB.
    pub capacity_mib: u64,
}

impl Share for NvmeInstanceInfo {
    fn share_mib(&self) -> u64 {
        self.capacity_mib
    }
}

struct Inner {
    config: NvmeParentConfig,
    /// Live instances by UUID: from `create` until the controller drops its [`ImageLease`]
    /// (its image and its share of the budget), after its threads end and the image is
    /// flushed.
    table: Arc<Instances<NvmeInstanceInfo>>,
}

/// NVMe instances on a directory of images (see the module doc). Cheap to clone; clones
/// are the same parent.
#[derive(Clone)]
pub struct NvmeParent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NvmeParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeParent")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// The serial number of instance `uuid`: its letters and digits, at most 20.
fn serial_of(uuid: &str) -> String {
    let s: String = uuid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(20)
        .collect::<String>()
        .to_ascii_uppercase();
    if s.is_empty() {
        "UMDEV".to_owned()
    } else {
        s
    }
}

impl NvmeParent {
    /// A parent with `config` (checked: a non-empty budget, unique type names, capacities
    /// of at least 1 MiB that fit the budget, 1..=[`MAX_IO_QUEUES`] I/O queue pairs; the
    /// directory is created if missing).
    pub fn new(config: NvmeParentConfig) -> Result<NvmeParent, NvmeParentError> {
        if config.budget_mib == 0 {
            return Err(NvmeParentError::EmptyBudget);
        }
        NvmeParentError::check_types(&config.types, |t| {
            if t.capacity_mib == 0 {
                return Err("the capacity is 0 MiB".into());
            }
            if t.capacity_mib > config.budget_mib {
                return Err("the capacity is larger than the budget".into());
            }
            if t.capacity_mib > MAX_CAPACITY_MIB {
                return Err("the capacity is too large for a file".into());
            }
            if !(1..=MAX_IO_QUEUES).contains(&t.io_queues) {
                return Err(format!(
                    "{} I/O queue pairs (1 to {MAX_IO_QUEUES})",
                    t.io_queues
                ));
            }
            Ok(())
        })?;
        parent_common::ensure_dir(&config.dir).map_err(|source| NvmeParentError::Dir {
            path: config.dir.clone(),
            source,
        })?;
        Ok(NvmeParent {
            inner: Arc::new(Inner {
                config,
                table: Instances::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &NvmeParentConfig {
        &self.inner.config
    }

    /// MiB of the budget held by live instances.
    pub fn budget_used_mib(&self) -> u64 {
        self.inner.table.used_mib()
    }

    /// The live instances, in UUID order.
    pub fn instances(&self) -> Vec<NvmeInstanceInfo> {
        self.inner.table.lock().values().cloned().collect()
    }

    /// The path of an image of this parent.
    pub fn image_path(&self, name: &str) -> PathBuf {
        self.inner.config.dir.join(name)
    }

    /// The storage budget, the one resource this parent shares.
    fn storage(&self) -> Resource {
        parent_common::mib_resource(RESOURCE_STORAGE, self.inner.config.budget_mib)
    }

    /// Build instance `req` as an [`Nvme`] controller (what [`Parent::create`] serves
    /// through a [`PciAdapter`](umdev::pci::PciAdapter)): its share of the budget and its
    /// image are taken.
    pub fn create_nvme(&self, req: CreateRequest<'_>) -> Result<Nvme, InstanceError> {
        let ty = parent_common::find_type(&self.inner.config.types, req.type_name)?;
        self.check_params(req.type_name, req.params)?;
        let (name, create) = parent_common::image_of(req.uuid, req.params)?;
        let mut table = self.inner.table.lock();
        parent_common::admit(&table, &self.storage(), req.uuid, ty)?;
        parent_common::check_image_unused(
            &name,
            table.values().map(|i| (i.uuid.as_str(), i.image.as_str())),
        )?;
        let file = parent_common::open_image_in(&self.inner.config.dir, &name, create)?;
        let path = self.image_path(&name);
        let mut config = NvmeConfig::new(&path).with_size(ty.capacity_mib << 20);
        config.max_io_queues = ty.io_queues;
        config.serial = serial_of(req.uuid);
        config.shadow_poll = self.inner.config.shadow_poll;
        let nvme = Nvme::from_file(config, file).map_err(|e| {
            let what = e.to_string();
            let source = match e {
                ImageError::Open { source, .. }
                | ImageError::Size { source, .. }
                | ImageError::Direct { source, .. } => source,
                ImageError::Empty { .. } | ImageError::TooLarge { .. } => {
                    std::io::Error::from_raw_os_error(libc::EINVAL)
                }
            };
            InstanceError::Io { what, source }
        })?;
        table.insert(
            req.uuid.to_owned(),
            NvmeInstanceInfo {
                uuid: req.uuid.to_owned(),
                type_name: ty.name.clone(),
                image: name,
                capacity_mib: ty.capacity_mib,
            },
        );
        drop(table);
        tracing::info!(
            uuid = req.uuid,
            ty = %ty.name,
            image = %path.display(),
            io_queues = ty.io_queues,
            "nvme parent: instance created"
        );
        Ok(nvme.with_lease(Instances::lease(
            &self.inner.table,
            req.uuid,
            "nvme parent: instance released its image",
        )))
    }
}

impl Parent for NvmeParent {
    fn name(&self) -> &str {
        "nvme"
    }

    fn resources(&self) -> Vec<Resource> {
        vec![self.storage()]
    }

    fn types(&self) -> Vec<InstanceType> {
        parent_common::pci_types(&self.inner.config.types, RESOURCE_STORAGE)
    }

    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        parent_common::check_image_params("nvme", params)
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        parent_common::pci_device(self.create_nvme(req)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_serial_of_uuid_is_alphanumeric_at_most_20() {
        assert_eq!(
            serial_of("00000000-0000-4000-8000-00000000000a"),
            "00000000000040008000"
        );
        assert_eq!(serial_of("ab"), "AB");
        assert_eq!(serial_of("--"), "UMDEV");
    }

    #[test]
    fn test_nvme_parent_config_checks() {
        let dir = tempfile::tempdir().unwrap();
        let with = |types: Vec<NvmeType>, budget_mib| {
            NvmeParent::new(NvmeParentConfig {
                dir: dir.path().join("images"),
                budget_mib,
                types,
                shadow_poll: super::super::SHADOW_POLL,
            })
            .map(|_| ())
        };
        assert!(matches!(with(vec![], 64), Err(NvmeParentError::NoTypes)));
        let t = NvmeType::new("t", 16, 2);
        assert!(matches!(
            with(vec![t.clone()], 0),
            Err(NvmeParentError::EmptyBudget)
        ));
        assert!(matches!(
            with(vec![t.clone(), t.clone()], 64),
            Err(NvmeParentError::DuplicateType(_))
        ));
        for bad in [
            NvmeType::new("t", 0, 1),
            NvmeType::new("t", 65, 1),
            NvmeType::new("", 1, 1),
            NvmeType::new("t", 1, 0),
            NvmeType::new("t", 1, MAX_IO_QUEUES + 1),
        ] {
            assert!(
                matches!(
                    with(vec![bad.clone()], 64),
                    Err(NvmeParentError::BadType { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(with(vec![t.clone()], 64).is_ok());
        assert!(dir.path().join("images").is_dir());
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let not_dir = NvmeParent::new(NvmeParentConfig {
            dir: file,
            budget_mib: 64,
            types: vec![t],
            shadow_poll: super::super::SHADOW_POLL,
        });
        assert!(matches!(not_dir, Err(NvmeParentError::Dir { .. })));
    }
}
