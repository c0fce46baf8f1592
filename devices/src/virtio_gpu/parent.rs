//! [`VirtioGpuParent`]: virtio-gpu instances whose resource memory comes from one budget the
//! parent shares among them, the way [`crate::gpu::GpuParent`]'s instances share its
//! framebuffer pool.
//!
//! # Types and the pool
//!
//! The parent has a pool of `pool_mib` MiB of resource memory (default 512) — its one
//! [`Resource`], `"resource-memory"` — and offers types by resource memory and resolution
//! (default `vgpu-720p:64:1280x720` and `vgpu-1080p:128:1920x1080`). An instance of a type
//! takes its type's `memory_mib` from the pool when it is created and gives it back when its
//! device is dropped; that amount is the instance's own budget
//! ([`VirtioGpuConfig::memory_budget`]): a guest that asks for more gets
//! `ERR_OUT_OF_MEMORY`, so the live instances together never hold more host memory for
//! resources than the pool. What is left is computed from the live instances (the sum of
//! their types' shares), never counted by hand, and the parent refuses an instance that does
//! not fit ([`InstanceError::Exhausted`]) whatever the registry above it believes.
//!
//! **Why a pool of its own and not the GPU parent's.** The issue asks for resource memory
//! "from the GPU parent's pool". The GPU parent's pool is the sum of its instances'
//! framebuffer memfds, each a BAR offered to the client, and its accounting is a private
//! table of those instances keyed by UUID; sharing it would mean a second kind of entry
//! (no memfd, no engine handle) in that table and one parent object behind two parent names,
//! or a budget object both parents lock, for a pool an admin can as well size per family.
//! So the virtio-gpu parent has a pool of its own with the same semantics (a budget in MiB,
//! shares taken at create and returned at drop, availability derived from live instances),
//! sized by `umdev daemon --virtio-gpu-pool-mib`. Its copies (TRANSFER_TO_HOST_2D) run on
//! each instance's own queue thread, not on the GPU parent's shared engine, so the engine's
//! isolation rules do not apply to them.
//!
//! # Parameters
//!
//! None: every instance of a type is the same. Unknown keys are refused
//! ([`InstanceError::BadParam`]).
//!
//! # Migration
//!
//! An instance is a [`VirtioGpu`] behind [`VirtioPci`], which migrates
//! ([`super::migration`]): the registry saves and loads it, and `umdev migrate` moves it
//! to a daemon whose parent offers the same type (the resolution is compared, and the
//! destination's share must hold the resources; another type refuses the stream and takes
//! nothing from the pool).
//!
//! # The display
//!
//! [`VirtioGpuParent::handle`] gives the display of a live instance (its screenshot, mode,
//! resource memory in use); [`Parent::screenshot`] (`umdev screenshot`, `umdev view`) is
//! its scanout as PNG: the picture copied under the device's state lock, encoded after it.

use std::sync::Arc;

use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Parent, Resource, Screenshot};
use umdev::virtio::VirtioPci;

use super::edid::EDID_MAX_DIM;
use super::{VirtioGpu, VirtioGpuConfig, VirtioGpuHandle};
pub(crate) use crate::parent_common::Lease;
use crate::parent_common::{
    self, impl_type_list_error, Instances, OfferedType, Share, TypeListError,
};

/// Name of the pool resource.
pub const RESOURCE_MEMORY: &str = "resource-memory";

/// The largest type share, MiB (64 GiB): keeps `memory_mib << 20` far from overflow.
pub const MAX_TYPE_MIB: u64 = 64 << 10;

/// One instance type of a [`VirtioGpuParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtioGpuType {
    /// Type name (`"vgpu-1080p"`).
    pub name: String,
    /// Host memory its resources may take, MiB, taken from the pool.
    pub memory_mib: u64,
    /// Width of its (one) scanout's display mode.
    pub width: u32,
    /// Height of its scanout's display mode.
    pub height: u32,
}

impl VirtioGpuType {
    /// A type.
    pub fn new(name: &str, memory_mib: u64, width: u32, height: u32) -> VirtioGpuType {
        VirtioGpuType {
            name: name.to_owned(),
            memory_mib,
            width,
            height,
        }
    }
}

impl OfferedType for VirtioGpuType {
    fn type_name(&self) -> &str {
        &self.name
    }

    fn need_mib(&self) -> u64 {
        self.memory_mib
    }

    fn description(&self) -> String {
        format!(
            "virtio-gpu (stock virtio_gpu driver), {}x{}, {} MiB of resource memory",
            self.width, self.height, self.memory_mib
        )
    }
}

impl std::str::FromStr for VirtioGpuType {
    type Err = String;

    /// `NAME:MIB:WIDTHxHEIGHT` (`vgpu-1080p:128:1920x1080`); ranges are checked by
    /// [`VirtioGpuParent::new`].
    fn from_str(s: &str) -> Result<VirtioGpuType, String> {
        let form = || {
            format!(
                "{s:?}: a virtio-gpu type is NAME:MIB:WIDTHxHEIGHT (e.g. vgpu-1080p:128:1920x1080)"
            )
        };
        let parts: Vec<&str> = s.split(':').collect();
        let [name, mib, res] = parts.as_slice() else {
            return Err(form());
        };
        let (w, h) = res.split_once('x').ok_or_else(form)?;
        let num = |v: &str| v.parse::<u32>().map_err(|e| format!("{s:?}: {v:?}: {e}"));
        let mib = mib
            .parse::<u64>()
            .map_err(|e| format!("{s:?}: {mib:?} is not a number of MiB: {e}"))?;
        Ok(VirtioGpuType::new(name, mib, num(w)?, num(h)?))
    }
}

/// How to build a [`VirtioGpuParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtioGpuParentConfig {
    /// The resource memory pool, MiB.
    pub pool_mib: u64,
    /// The types offered.
    pub types: Vec<VirtioGpuType>,
}

impl Default for VirtioGpuParentConfig {
    /// A 512 MiB pool; `vgpu-720p` (64 MiB, 1280×720) and `vgpu-1080p` (128 MiB, 1920×1080).
    fn default() -> Self {
        VirtioGpuParentConfig {
            pool_mib: 512,
            types: vec![
                VirtioGpuType::new("vgpu-720p", 64, 1280, 720),
                VirtioGpuType::new("vgpu-1080p", 128, 1920, 1080),
            ],
        }
    }
}

/// Why a [`VirtioGpuParentConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum VirtioGpuParentError {
    /// The pool is empty.
    #[error("the resource memory pool is 0 MiB")]
    EmptyPool,
    /// No types.
    #[error("a virtio-gpu parent needs at least one type")]
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
}

impl_type_list_error!(VirtioGpuParentError);

struct Entry {
    memory_mib: u64,
    handle: VirtioGpuHandle,
}

impl Share for Entry {
    fn share_mib(&self) -> u64 {
        self.memory_mib
    }
}

struct Inner {
    config: VirtioGpuParentConfig,
    /// Live instances by UUID: from `create` until the device drops its [`Lease`] (its
    /// entry, and so its share of the pool).
    instances: Arc<Instances<Entry>>,
}

/// virtio-gpu instances sharing a resource memory pool (see the module doc). Cheap to
/// clone; clones are the same parent.
#[derive(Clone)]
pub struct VirtioGpuParent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for VirtioGpuParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioGpuParent")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl VirtioGpuParent {
    /// A parent with `config` (checked: a non-empty pool, unique non-empty type names,
    /// shares of 1..=[`MAX_TYPE_MIB`] MiB that fit the pool and hold one full-screen
    /// XRGB resource, sides of 1..=[`EDID_MAX_DIM`]).
    pub fn new(config: VirtioGpuParentConfig) -> Result<VirtioGpuParent, VirtioGpuParentError> {
        if config.pool_mib == 0 {
            return Err(VirtioGpuParentError::EmptyPool);
        }
        VirtioGpuParentError::check_types(&config.types, |t| {
            if !(1..=MAX_TYPE_MIB).contains(&t.memory_mib) {
                return Err("the resource memory must be 1 to 65536 MiB".into());
            }
            if t.memory_mib > config.pool_mib {
                return Err("the resource memory is larger than the pool".into());
            }
            if !(1..=EDID_MAX_DIM).contains(&t.width) || !(1..=EDID_MAX_DIM).contains(&t.height) {
                return Err(format!("each side of the resolution is 1..={EDID_MAX_DIM}"));
            }
            let frame = u64::from(t.width) * u64::from(t.height) * 4;
            if frame > t.memory_mib << 20 {
                return Err(
                    "the resource memory does not hold one full-screen frame (width × height × 4)"
                        .into(),
                );
            }
            Ok(())
        })?;
        Ok(VirtioGpuParent {
            inner: Arc::new(Inner {
                config,
                instances: Instances::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &VirtioGpuParentConfig {
        &self.inner.config
    }

    /// MiB of the pool held by live instances.
    pub fn pool_used_mib(&self) -> u64 {
        self.inner.instances.used_mib()
    }

    /// The display of live instance `uuid`.
    pub fn handle(&self, uuid: &str) -> Option<VirtioGpuHandle> {
        self.inner
            .instances
            .lock()
            .get(uuid)
            .map(|e| e.handle.clone())
    }

    fn pool(&self) -> Resource {
        parent_common::mib_resource(RESOURCE_MEMORY, self.inner.config.pool_mib)
    }

    /// Build instance `req` as a [`VirtioGpu`] (what [`Parent::create`] serves through
    /// [`VirtioPci`] and [`PciAdapter`](umdev::pci::PciAdapter)): its type's share of the
    /// pool is taken and is its resource memory budget.
    pub fn create_gpu(&self, req: CreateRequest<'_>) -> Result<VirtioGpu, InstanceError> {
        let ty = parent_common::find_type(&self.inner.config.types, req.type_name)?;
        self.check_params(req.type_name, req.params)?;
        let mut instances = self.inner.instances.lock();
        parent_common::admit(&instances, &self.pool(), req.uuid, ty)?;
        let config = VirtioGpuConfig {
            scanouts: vec![(ty.width, ty.height)],
            memory_budget: ty.memory_mib << 20, // ≤ MAX_TYPE_MIB: no overflow
            ..VirtioGpuConfig::default()
        };
        let gpu = VirtioGpu::new(config).map_err(|e| InstanceError::BadParam {
            name: "type".to_owned(),
            why: e.to_string(),
        })?;
        instances.insert(
            req.uuid.to_owned(),
            Entry {
                memory_mib: ty.memory_mib,
                handle: gpu.handle(),
            },
        );
        tracing::info!(
            uuid = req.uuid,
            ty = %ty.name,
            memory_mib = ty.memory_mib,
            "virtio-gpu parent: instance created"
        );
        Ok(gpu.with_lease(Instances::lease(
            &self.inner.instances,
            req.uuid,
            "virtio-gpu parent: instance released its share",
        )))
    }
}

impl Parent for VirtioGpuParent {
    fn name(&self) -> &str {
        "virtio-gpu"
    }

    fn resources(&self) -> Vec<Resource> {
        vec![self.pool()]
    }

    fn types(&self) -> Vec<InstanceType> {
        parent_common::pci_types(&self.inner.config.types, RESOURCE_MEMORY)
    }

    fn screenshot(&self, uuid: &str, scanout: u32) -> Option<Result<Screenshot, InstanceError>> {
        let Some(handle) = self.handle(uuid) else {
            return Some(Err(InstanceError::NoSuchInstance(uuid.to_owned())));
        };
        Some(
            handle
                .screenshot_png(scanout)
                .map_err(|why| InstanceError::NothingShown {
                    uuid: uuid.to_owned(),
                    scanout,
                    why: why.to_string(),
                }),
        )
    }

    fn resize(
        &self,
        uuid: &str,
        scanout: u32,
        width: u32,
        height: u32,
    ) -> Option<Result<(), InstanceError>> {
        let Some(handle) = self.handle(uuid) else {
            return Some(Err(InstanceError::NoSuchInstance(uuid.to_owned())));
        };
        Some(
            handle
                .resize(scanout as usize, width, height)
                .map_err(|why| InstanceError::DisplayRefused {
                    uuid: uuid.to_owned(),
                    scanout,
                    why: why.to_string(),
                }),
        )
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        let gpu = self.create_gpu(req)?;
        let pci = VirtioPci::new(gpu).map_err(|e| {
            InstanceError::Device(umdev::device::DeviceError::InvalidArgument(e.to_string()))
        })?;
        parent_common::pci_device(pci)
    }
}
