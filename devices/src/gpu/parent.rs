//! [`GpuParent`]: GPU instances that share one framebuffer pool and one render engine, the
//! way gvt-g's vGPUs share one physical GPU's graphics memory and render engine.
//!
//! # Types and the pool
//!
//! The parent has a framebuffer pool of `pool_mib` MiB (default 64) — its one
//! [`Resource`], `"framebuffer"` — and offers types that carve it (default `gpu-4m`: 4 MiB,
//! weight 1; `gpu-16m`: 16 MiB, weight 4). An instance's BAR2 is its share of the pool:
//! `fb_mib` MiB, so a 64 MiB pool holds sixteen `gpu-4m`, four `gpu-16m`, or any mix that
//! fits. What is left is computed from the live instances (the sum of their types' shares),
//! never counted by hand: an instance is in the parent's table from [`Parent::create`] until
//! its device is dropped (its lease goes back then, after its work has stopped), and the
//! parent refuses an instance that does not fit ([`InstanceError::Exhausted`]), whatever
//! the registry above it believes. There is no fragmentation to account for: shares are
//! amounts, not address ranges (see below), so a fit is `used + need ≤ pool`.
//!
//! **Why each instance's framebuffer is its own memfd, not a slice of one.** BAR2 is offered
//! to the client for mmap: the client receives the memory's file descriptor (SCM_RIGHTS)
//! and maps it at the region's file offset ([`umdev::device::RegionMmap::file_offset`]).
//! A file descriptor grants the whole file: a client given one memfd holding every
//! instance's framebuffer could mmap any offset of it, that is, read and write the
//! framebuffers of other VMs. Offsets restrict nothing; only separate files do. So the pool
//! is the budget, and each instance's share is a memfd of its own, sized to its type
//! (memfd pages are allocated on first touch, so an untouched share costs no memory).
//!
//! # The shared render engine
//!
//! Every instance's commands are executed by the parent's [`RenderEngine`] (`engine.rs`),
//! scheduled by stride scheduling (`sched.rs`) with the instance's type weight: among
//! instances that all have work queued, executed work (pixels written plus a base cost per
//! command) is shared in proportion to the weights, so a `gpu-16m` gets four times the
//! share of a `gpu-4m`; an instance that was idle and submits a FENCE while the others
//! flood the engine is served after at most one command of each other instance. Per
//! instance counters ([`GpuParent::instances`], [`EngineStats`]) expose executed commands
//! and work, and the largest wake-up delay seen in units.
//!
//! **The engine's CPU priority.** Its thread is throughput work, busy as long as any
//! instance floods; each instance's connection, fetcher and interrupt threads are latency
//! paths that run briefly and sleep. With the engine at their priority, on a machine with
//! fewer cores than busy threads (2 cores shared with other builds), an idle instance's
//! FENCE waited for a CPU, not for the engine: `umdev bench instances` measured its p90 at
//! 7–17× the unloaded latency although the scheduler started it within 2–4 engine units,
//! and mostly at 1.0–1.2× with the engine thread at nice 19 (`docs/benchmarks.md`; on a
//! quiet machine both stay below 1×). [`GpuParentConfig::engine_nice`] lets the engine thread
//! set itself to such a value when it starts ([`LOW_PRIORITY_ENGINE_NICE`], 19). It is not
//! the default: nice only weighs CPU time among runnable threads, so an engine at nice 19
//! runs at full speed on an otherwise idle CPU but gets ~1.5 % of a CPU against each busy
//! nice-0 thread — on a host whose vCPU threads keep the CPUs busy, every instance's
//! rendering would crawl (seen: a test's flood that takes 1 s took over 60 s with four
//! busy-looping nice-0 threads on 2 cores). By default the engine keeps the process's
//! nice value (throughput under load over the idle instance's latency); an admin who keeps
//! CPUs free for the daemon can choose 19 (`umdev daemon --gpu-engine-nice 19`). Either way
//! the shares among instances are the stride scheduler's.
//!
//! What an instance shares: the engine's time and the pool's capacity. What it does not:
//! its registers, GTT, pins, framebuffer memory, DMA space, interrupts and socket are its
//! own; its ring is fetched by a thread of its own (so a client that never answers a
//! DMA_READ stalls its own instance, never the engine); reset, DMA unmap, disconnect and Bus
//! Master gating act on that instance alone (`worker.rs`, `mod.rs`).
//!
//! # Parameters
//!
//! None: every instance of a type is the same. Unknown keys are refused
//! ([`InstanceError::BadParam`]).

use std::sync::Arc;

use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Parent, Resource};

use super::engine::{EngineStats, RenderEngine};
use super::handle::GpuHandle;
use super::sched::MAX_WEIGHT;
use super::{Gpu, GpuConfig};
pub(crate) use crate::parent_common::Lease;
use crate::parent_common::{
    self, impl_type_list_error, Instances, OfferedType, Share, TypeListError,
};

/// Name of the pool resource.
pub const RESOURCE_FRAMEBUFFER: &str = "framebuffer";

/// One instance type of a [`GpuParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuType {
    /// Type name (`"gpu-4m"`).
    pub name: String,
    /// Framebuffer (BAR2) size in MiB: a power of two, taken from the pool.
    pub fb_mib: u64,
    /// Scheduling weight on the shared engine, `1..=65536`.
    pub weight: u32,
}

impl GpuType {
    /// A type.
    pub fn new(name: &str, fb_mib: u64, weight: u32) -> GpuType {
        GpuType {
            name: name.to_owned(),
            fb_mib,
            weight,
        }
    }
}

impl OfferedType for GpuType {
    fn type_name(&self) -> &str {
        &self.name
    }

    fn need_mib(&self) -> u64 {
        self.fb_mib
    }

    fn description(&self) -> String {
        format!(
            "GPU with a {} MiB framebuffer, weight {} on the shared render engine",
            self.fb_mib, self.weight
        )
    }
}

/// The lowest priority, for [`GpuParentConfig::engine_nice`] when the idle instances'
/// latency matters more than the engine's share of a busy host's CPUs (see the module doc;
/// not the default).
pub const LOW_PRIORITY_ENGINE_NICE: i32 = 19;

/// The engine's nice value as an admin writes it (`umdev daemon --gpu-engine-nice`): a
/// number in `-20..=19`, or `inherit` for the process's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineNice {
    /// Keep the process's nice value.
    Inherit,
    /// This nice value.
    Value(i32),
}

impl EngineNice {
    /// As [`GpuParentConfig::engine_nice`].
    pub fn nice(self) -> Option<i32> {
        match self {
            EngineNice::Inherit => None,
            EngineNice::Value(n) => Some(n),
        }
    }
}

impl std::str::FromStr for EngineNice {
    type Err = String;

    fn from_str(s: &str) -> Result<EngineNice, String> {
        if s == "inherit" {
            return Ok(EngineNice::Inherit);
        }
        match s.parse::<i32>() {
            Ok(n) if (-20..=19).contains(&n) => Ok(EngineNice::Value(n)),
            _ => Err(format!(
                "{s:?} is not a nice value (-20..=19) or \"inherit\""
            )),
        }
    }
}

impl std::fmt::Display for EngineNice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineNice::Inherit => f.write_str("inherit"),
            EngineNice::Value(n) => write!(f, "{n}"),
        }
    }
}

/// How to build a [`GpuParent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuParentConfig {
    /// The framebuffer pool in MiB.
    pub pool_mib: u64,
    /// The types offered.
    pub types: Vec<GpuType>,
    /// The nice value (`-20..=19`) the shared engine thread sets on itself when it
    /// starts; `None` (the default): it keeps the nice value of the process; see
    /// [`LOW_PRIORITY_ENGINE_NICE`]. A value below the process's needs `CAP_SYS_NICE` (without
    /// it the engine logs a warning and keeps the process's).
    pub engine_nice: Option<i32>,
}

impl Default for GpuParentConfig {
    /// A 64 MiB pool; `gpu-4m` (weight 1) and `gpu-16m` (weight 4); the engine at the
    /// process's nice value.
    fn default() -> Self {
        GpuParentConfig {
            pool_mib: 64,
            types: vec![GpuType::new("gpu-4m", 4, 1), GpuType::new("gpu-16m", 16, 4)],
            engine_nice: None,
        }
    }
}

/// Why a [`GpuParentConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum GpuParentError {
    /// The pool is empty.
    #[error("the framebuffer pool is 0 MiB")]
    EmptyPool,
    /// No types.
    #[error("a GPU parent needs at least one type")]
    NoTypes,
    /// Two types with one name.
    #[error("type {0:?} is declared twice")]
    DuplicateType(String),
    /// An engine nice value outside `-20..=19`.
    #[error("engine nice value {0} is outside -20..=19")]
    BadEngineNice(i32),
    /// A type that cannot be built.
    #[error("type {name:?}: {why}")]
    BadType {
        /// The type.
        name: String,
        /// What is wrong with it.
        why: String,
    },
}

impl_type_list_error!(GpuParentError);

/// One live instance, as [`GpuParent::instances`] reports it.
#[derive(Clone, Debug)]
pub struct GpuInstanceInfo {
    /// Its UUID.
    pub uuid: String,
    /// Its type.
    pub type_name: String,
    /// Its share of the pool, MiB.
    pub fb_mib: u64,
    /// Its weight on the engine.
    pub weight: u32,
    /// What the engine executed for it.
    pub stats: EngineStats,
}

struct Entry {
    type_name: String,
    fb_mib: u64,
    weight: u32,
    handle: GpuHandle,
}

impl Share for Entry {
    fn share_mib(&self) -> u64 {
        self.fb_mib
    }
}

struct Inner {
    config: GpuParentConfig,
    engine: Arc<RenderEngine>,
    /// Live instances by UUID: from `create` until the device drops its [`Lease`] (its
    /// entry, and so its share of the pool).
    instances: Arc<Instances<Entry>>,
}

/// GPU instances sharing a framebuffer pool and a render engine (see the module doc).
/// Cheap to clone; clones are the same parent.
#[derive(Clone)]
pub struct GpuParent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for GpuParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuParent")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl GpuParent {
    /// A parent with `config` (checked: a non-empty pool, unique type names, power-of-two
    /// framebuffers of 1 MiB .. 2 GiB that fit the pool, weights `1..=65536`, an engine
    /// nice value in `-20..=19`). The engine thread starts with the first instance that
    /// attaches.
    pub fn new(config: GpuParentConfig) -> Result<GpuParent, GpuParentError> {
        if config.pool_mib == 0 {
            return Err(GpuParentError::EmptyPool);
        }
        if let Some(nice) = config.engine_nice.filter(|n| !(-20..=19).contains(n)) {
            return Err(GpuParentError::BadEngineNice(nice));
        }
        GpuParentError::check_types(&config.types, |t| {
            if !t.fb_mib.is_power_of_two() || t.fb_mib > 2048 {
                return Err("the framebuffer must be a power of two from 1 to 2048 MiB".into());
            }
            if t.fb_mib > config.pool_mib {
                return Err("the framebuffer is larger than the pool".into());
            }
            if !(1..=MAX_WEIGHT).contains(&t.weight) {
                return Err("the weight must be 1..=65536".into());
            }
            Ok(())
        })?;
        Ok(GpuParent {
            inner: Arc::new(Inner {
                engine: RenderEngine::with_nice("gpu-pool", config.engine_nice),
                config,
                instances: Instances::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GpuParentConfig {
        &self.inner.config
    }

    /// The shared render engine.
    pub fn engine(&self) -> &Arc<RenderEngine> {
        &self.inner.engine
    }

    /// MiB of the pool held by live instances.
    pub fn pool_used_mib(&self) -> u64 {
        self.inner.instances.used_mib()
    }

    /// The live instances (UUID order), with what the engine executed for each.
    pub fn instances(&self) -> Vec<GpuInstanceInfo> {
        self.inner
            .instances
            .lock()
            .iter()
            .map(|(uuid, e)| GpuInstanceInfo {
                uuid: uuid.clone(),
                type_name: e.type_name.clone(),
                fb_mib: e.fb_mib,
                weight: e.weight,
                stats: e.handle.engine_stats(),
            })
            .collect()
    }

    /// An observer of instance `uuid` (framebuffer, mode, pins, engine counters).
    pub fn handle(&self, uuid: &str) -> Option<GpuHandle> {
        self.inner
            .instances
            .lock()
            .get(uuid)
            .map(|e| e.handle.clone())
    }

    /// The framebuffer pool, the one resource this parent shares.
    fn framebuffer_pool(&self) -> Resource {
        parent_common::mib_resource(RESOURCE_FRAMEBUFFER, self.inner.config.pool_mib)
    }

    /// Build instance `req` as a [`Gpu`] (what [`Parent::create`] serves through a
    /// [`PciAdapter`](umdev::pci::PciAdapter)): its share of the pool is taken, its
    /// commands go to the shared engine with its type's weight.
    pub fn create_gpu(&self, req: CreateRequest<'_>) -> Result<Gpu, InstanceError> {
        let ty = parent_common::find_type(&self.inner.config.types, req.type_name)?;
        self.check_params(req.type_name, req.params)?;
        let mut instances = self.inner.instances.lock();
        parent_common::admit(&instances, &self.framebuffer_pool(), req.uuid, ty)?;
        let config = GpuConfig {
            fb_size: ty.fb_mib << 20,
        };
        let gpu =
            Gpu::on_engine(config, self.inner.engine.clone(), ty.weight).map_err(|source| {
                InstanceError::Io {
                    what: format!("creating the {} MiB framebuffer", ty.fb_mib),
                    source,
                }
            })?;
        instances.insert(
            req.uuid.to_owned(),
            Entry {
                type_name: ty.name.clone(),
                fb_mib: ty.fb_mib,
                weight: ty.weight,
                handle: gpu.handle(),
            },
        );
        tracing::info!(
            uuid = req.uuid,
            ty = %ty.name,
            fb_mib = ty.fb_mib,
            "gpu parent: instance created"
        );
        Ok(gpu.with_lease(Instances::lease(
            &self.inner.instances,
            req.uuid,
            "gpu parent: instance released its share",
        )))
    }
}

impl Parent for GpuParent {
    fn name(&self) -> &str {
        "gpu"
    }

    fn resources(&self) -> Vec<Resource> {
        vec![self.framebuffer_pool()]
    }

    fn types(&self) -> Vec<InstanceType> {
        parent_common::pci_types(&self.inner.config.types, RESOURCE_FRAMEBUFFER)
    }

    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        parent_common::pci_device(self.create_gpu(req)?)
    }
}

#[cfg(test)]
mod tests {
    use umdev::instance::Params;

    use super::*;

    fn req<'a>(uuid: &'a str, ty: &'a str, params: &'a Params) -> CreateRequest<'a> {
        CreateRequest {
            uuid,
            type_name: ty,
            params,
        }
    }

    #[test]
    fn test_gpu_parent_pool_exhausted_names_resource_and_frees_on_drop() {
        let parent = GpuParent::new(GpuParentConfig::default()).unwrap();
        let p = Params::new();
        let a = parent.create_gpu(req("a", "gpu-16m", &p)).unwrap();
        let b = parent.create_gpu(req("b", "gpu-16m", &p)).unwrap();
        let c = parent.create_gpu(req("c", "gpu-16m", &p)).unwrap();
        let _d: Vec<Gpu> = ["d1", "d2", "d3"]
            .iter()
            .map(|u| parent.create_gpu(req(u, "gpu-4m", &p)).unwrap())
            .collect();
        assert_eq!(parent.pool_used_mib(), 60);
        let e = parent.create_gpu(req("e", "gpu-16m", &p)).err().unwrap();
        match e {
            InstanceError::Exhausted {
                resource,
                needed,
                left,
                ..
            } => assert_eq!((resource.as_str(), needed, left), ("framebuffer", 16, 4)),
            other => panic!("{other:?}"),
        }
        let f = parent.create_gpu(req("f", "gpu-4m", &p)).unwrap();
        assert!(parent.create_gpu(req("g", "gpu-4m", &p)).is_err());
        drop((a, f));
        assert_eq!(parent.pool_used_mib(), 44);
        let a2 = parent.create_gpu(req("a", "gpu-16m", &p)).unwrap();
        assert_eq!(a2.framebuffer().len(), 16 << 20);
        assert_eq!(parent.instances().len(), 6);
        drop((b, c));
    }

    #[test]
    fn test_gpu_parent_uuid_in_use_unknown_type_and_params_rejected() {
        let parent = GpuParent::new(GpuParentConfig::default()).unwrap();
        let p = Params::new();
        let _a = parent.create_gpu(req("a", "gpu-4m", &p)).unwrap();
        assert!(matches!(
            parent.create_gpu(req("a", "gpu-4m", &p)).err(),
            Some(InstanceError::UuidInUse(_))
        ));
        assert!(matches!(
            parent.create_gpu(req("b", "gpu-8m", &p)).err(),
            Some(InstanceError::UnknownType(_))
        ));
        let mut bad = Params::new();
        bad.insert("weight".into(), "100".into());
        assert!(matches!(
            parent.create_gpu(req("b", "gpu-4m", &bad)).err(),
            Some(InstanceError::BadParam { .. })
        ));
        assert_eq!(parent.pool_used_mib(), 4, "refused creates take nothing");
    }

    #[test]
    fn test_gpu_parent_config_checks() {
        let with = |types: Vec<GpuType>, pool_mib| {
            GpuParent::new(GpuParentConfig {
                pool_mib,
                types,
                ..GpuParentConfig::default()
            })
            .map(|_| ())
        };
        assert!(matches!(with(vec![], 64), Err(GpuParentError::NoTypes)));
        let t = GpuType::new("t", 4, 1);
        assert!(matches!(
            with(vec![t.clone()], 0),
            Err(GpuParentError::EmptyPool)
        ));
        assert!(matches!(
            with(vec![t.clone(), t.clone()], 64),
            Err(GpuParentError::DuplicateType(_))
        ));
        for bad in [
            GpuType::new("t", 3, 1),
            GpuType::new("t", 128, 1),
            GpuType::new("t", 4, 0),
            GpuType::new("t", 4, MAX_WEIGHT + 1),
            GpuType::new("", 4, 1),
        ] {
            assert!(
                matches!(
                    with(vec![bad.clone()], 64),
                    Err(GpuParentError::BadType { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(with(vec![t], 64).is_ok());
    }

    #[test]
    fn test_engine_nice_parses_range_and_inherit_and_round_trips() {
        for (text, want) in [
            ("inherit", EngineNice::Inherit),
            ("19", EngineNice::Value(19)),
            ("-20", EngineNice::Value(-20)),
            ("0", EngineNice::Value(0)),
        ] {
            let got: EngineNice = text.parse().unwrap();
            assert_eq!(got, want);
            assert_eq!(got.to_string(), text);
        }
        for bad in ["20", "-21", "", "low", "19.0", "Inherit"] {
            let e = bad.parse::<EngineNice>().unwrap_err();
            assert!(e.contains("is not a nice value"), "{bad}: {e}");
        }
        assert_eq!(EngineNice::Inherit.nice(), None);
        assert_eq!(EngineNice::Value(5).nice(), Some(5));
        assert_eq!(GpuParentConfig::default().engine_nice, None);
    }

    #[test]
    fn test_gpu_parent_types_declare_needs_and_descriptions() {
        let parent = GpuParent::new(GpuParentConfig::default()).unwrap();
        let types = parent.types();
        assert_eq!(types.len(), 2);
        assert_eq!(types[1].needs, vec![("framebuffer".to_owned(), 16)]);
        assert_eq!(types[0].device_api, "vfio-pci");
        assert_eq!(parent.resources()[0].total, 64);
    }
}
