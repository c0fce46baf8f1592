//! One scale point of `bench instances`: N instances in one [`Registry`] with the daemon's
//! parents (a [`GpuParent`] and a [`CcwParent`]), as `umdev daemon` builds them, minus the
//! control socket.
//!
//! 1. The registry and parents are set up; the process is sampled (`/proc/self/status`
//!    VmRSS, RssAnon, RssFile, RssShmem and Threads; `/proc/self/smaps_rollup` Rss,
//!    Anonymous and Pss_Shmem; entries of `/proc/self/fd`).
//! 2. N instances are created one after the other with [`Registry::create`] (what
//!    `umdev create` and `umdev start` run in the daemon: the parent builds the device,
//!    the registry gives it a DMA space and starts its server on its socket); each call
//!    is timed.
//! 3. After a settling pause (the new threads have run), the process is sampled again:
//!    the difference divided by N is the cost of one idle instance.
//! 4. One embedded VMM per instance connects and sets its device up; with all N connected
//!    at once (checked: every instance reports its client attached), the clients, one
//!    thread each, are released together (a gate all their threads wait on), and each
//!    draws through its own instance ([`super::clients`]) and verifies what it gets back.
//!    The wall time runs from the release to the last client's end.
//! 5. The clients disconnect and every instance is removed (timed).
//!
//! Run in a process of its own (see `super`), the samples of step 1 and 3 see nothing but
//! the registry's instances: no heap or thread stacks freed by an earlier point are
//! reused, which would hide part of the cost.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use umdev::instance::{Params, Registry, RegistryConfig};
use umdev_devices::ccw::{CcwParent, CcwParentConfig};
use umdev_devices::gpu::{GpuParent, GpuParentConfig};

use super::clients::{self, CcwClient, ClientError, GpuClient};
use crate::stats::{summarize, Summary};
use crate::BenchError;

/// How long the process settles after the last create before it is sampled.
pub const SETTLE: Duration = Duration::from_millis(300);
/// How long the removal waits for the servers to see their clients gone.
const DETACH_TIMEOUT: Duration = Duration::from_secs(20);

/// What `/proc/self` says of the process at one moment (sizes in KiB).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProcSample {
    /// VmRSS: resident memory (RssAnon + RssFile + RssShmem).
    pub rss_kib: u64,
    /// RssAnon: heap, thread stacks, anonymous mappings.
    pub anon_kib: u64,
    /// RssFile: resident pages of mapped files.
    pub file_kib: u64,
    /// RssShmem: resident shared memory (memfd pages mapped by the process).
    pub shmem_kib: u64,
    /// Threads.
    pub threads: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// `Rss` of `/proc/self/smaps_rollup`: the page tables walked now (exact, where VmRSS
    /// comes from per-CPU counters that may lag by a few dozen pages per CPU).
    pub smaps_rss_kib: u64,
    /// `Anonymous` of `/proc/self/smaps_rollup`.
    pub smaps_anon_kib: u64,
    /// `Pss_Shmem` of `/proc/self/smaps_rollup` (shared memory, each page divided among
    /// the mappings of it).
    pub smaps_shmem_kib: u64,
}

impl ProcSample {
    /// Sample this process now.
    pub fn now() -> ProcSample {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let mut s = parse_status(&status);
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        (s.smaps_rss_kib, s.smaps_anon_kib, s.smaps_shmem_kib) = parse_rollup(&rollup);
        s.fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        s
    }

    /// `(self - before) / n` per field, signed (memory can be given back).
    pub fn per_instance(&self, before: &ProcSample, n: usize) -> PerInstance {
        let d = |a: u64, b: u64| (a as f64 - b as f64) / n.max(1) as f64;
        PerInstance {
            rss_kib: d(self.rss_kib, before.rss_kib),
            anon_kib: d(self.anon_kib, before.anon_kib),
            file_kib: d(self.file_kib, before.file_kib),
            shmem_kib: d(self.shmem_kib, before.shmem_kib),
            threads: d(self.threads, before.threads),
            fds: d(self.fds, before.fds),
            smaps_rss_kib: d(self.smaps_rss_kib, before.smaps_rss_kib),
            smaps_anon_kib: d(self.smaps_anon_kib, before.smaps_anon_kib),
            smaps_shmem_kib: d(self.smaps_shmem_kib, before.smaps_shmem_kib),
        }
    }
}

/// `key: value kB` lines as `(key, value)`; other lines are skipped.
fn kib_fields(text: &str) -> impl Iterator<Item = (&str, u64)> {
    text.lines().filter_map(|line| {
        let (key, value) = line.split_once(':')?;
        let v = value.split_whitespace().next()?.parse::<u64>().ok()?;
        Some((key, v))
    })
}

/// `(Rss, Anonymous, Pss_Shmem)` of `/proc/<pid>/smaps_rollup`, KiB.
pub fn parse_rollup(text: &str) -> (u64, u64, u64) {
    let mut out = (0, 0, 0);
    for (key, v) in kib_fields(text) {
        match key {
            "Rss" => out.0 = v,
            "Anonymous" => out.1 = v,
            "Pss_Shmem" => out.2 = v,
            _ => {}
        }
    }
    out
}

/// The fields of `/proc/<pid>/status` a [`ProcSample`] keeps (fds and smaps are not in
/// it).
pub fn parse_status(text: &str) -> ProcSample {
    let mut s = ProcSample::default();
    for (key, v) in kib_fields(text) {
        match key {
            "VmRSS" => s.rss_kib = v,
            "RssAnon" => s.anon_kib = v,
            "RssFile" => s.file_kib = v,
            "RssShmem" => s.shmem_kib = v,
            "Threads" => s.threads = v,
            _ => {}
        }
    }
    s
}

/// The difference of two [`ProcSample`]s per instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PerInstance {
    /// VmRSS, KiB.
    pub rss_kib: f64,
    /// RssAnon, KiB.
    pub anon_kib: f64,
    /// RssFile, KiB.
    pub file_kib: f64,
    /// RssShmem, KiB.
    pub shmem_kib: f64,
    /// Threads.
    pub threads: f64,
    /// File descriptors.
    pub fds: f64,
    /// smaps_rollup Rss, KiB.
    pub smaps_rss_kib: f64,
    /// smaps_rollup Anonymous, KiB.
    pub smaps_anon_kib: f64,
    /// smaps_rollup Pss_Shmem, KiB.
    pub smaps_shmem_kib: f64,
}

/// Which parent a type belongs to, and what one instance takes of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeKind {
    /// A GPU type with its framebuffer share, MiB.
    Gpu {
        /// Framebuffer MiB.
        fb_mib: u64,
    },
    /// A ccw type with its image capacity, MiB.
    Ccw {
        /// Capacity MiB.
        capacity_mib: u64,
    },
}

/// The kind of a type the daemon's parents offer by default.
pub fn type_kind(name: &str) -> Result<TypeKind, BenchError> {
    if let Some(t) = GpuParentConfig::default()
        .types
        .iter()
        .find(|t| t.name == name)
    {
        return Ok(TypeKind::Gpu { fb_mib: t.fb_mib });
    }
    if let Some(t) = CcwParentConfig::new("")
        .types
        .iter()
        .find(|t| t.name == name)
    {
        return Ok(TypeKind::Ccw {
            capacity_mib: t.capacity_mib,
        });
    }
    Err(BenchError::Options(format!(
        "unknown instance type {name:?} (the daemon's default types: gpu-4m, gpu-16m, \
         ccw-16m, ccw-64m)"
    )))
}

/// The type of each of `n` instances: `types` round robin.
pub fn plan(n: usize, types: &[String]) -> Vec<String> {
    (0..n).map(|i| types[i % types.len()].clone()).collect()
}

/// How many instances of each type a plan has.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TypeCount {
    /// Type name.
    pub type_name: String,
    /// Instances of it.
    pub count: usize,
}

/// How long the CPU of idle connected instances is measured
/// ([`ScalePoint::connected_idle_cpu_pct`]).
pub const IDLE_CPU_WINDOW: Duration = Duration::from_secs(1);

/// Result of one scale point.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ScalePoint {
    /// Instances asked for.
    pub instances: usize,
    /// Instances of each type.
    pub mix: Vec<TypeCount>,
    /// The GPU parent's framebuffer pool for this point, MiB.
    pub gpu_pool_mib: u64,
    /// The ccw parent's storage budget for this point, MiB.
    pub ccw_budget_mib: u64,
    /// `process` (a process of its own) or `in-process`.
    pub isolation: String,
    /// Instances created.
    pub created: usize,
    /// Every create+start ([`Registry::create`]), ms, in creation order.
    pub create_samples_ms: Vec<f64>,
    /// Their median and spread.
    pub create_ms: Summary,
    /// The process before the first create.
    pub before: ProcSample,
    /// The process with every instance created and idle (no client).
    pub idle: ProcSample,
    /// `(idle - before) / instances`.
    pub idle_per_instance: PerInstance,
    /// The process with every client connected, after they drew (the clients and their
    /// guest RAM live in this process too).
    pub serving: ProcSample,
    /// CPU of the whole process over [`IDLE_CPU_WINDOW`] right after every client finished
    /// (all still connected, none sending), % of one core: what idle connections cost,
    /// the connection threads' polling after their last message included.
    #[serde(default)]
    pub connected_idle_cpu_pct: f64,
    /// Time to connect and set up all clients, one after the other, s.
    pub connect_s: f64,
    /// Instances that reported their client attached when the clients were released.
    pub attached_at_release: usize,
    /// From releasing every client at once to the last one's end, s.
    pub serve_wall_s: f64,
    /// Each client's own draw-and-verify time, ms.
    pub serve_client_ms: Summary,
    /// Instances whose output was verified.
    pub verified: usize,
    /// What went wrong, per failed instance (`#index type: message`).
    pub failures: Vec<String>,
    /// Every removal after the clients left, ms.
    pub remove_ms: Summary,
    /// Why the point could not be measured.
    pub error: Option<String>,
}

impl ScalePoint {
    /// A point that could not be measured.
    pub fn failed(instances: usize, isolation: &str, error: String) -> ScalePoint {
        ScalePoint {
            instances,
            isolation: isolation.to_owned(),
            error: Some(error),
            ..ScalePoint::default()
        }
    }
}

/// The daemon's registry and parents, in a temporary directory. Field order is drop order:
/// the registry stops every server before the parents and the directory go.
struct Daemonish {
    registry: Registry,
    ccw: CcwParent,
    _gpu: GpuParent,
    _dir: tempfile::TempDir,
}

fn daemonish(
    gpu_pool_mib: u64,
    ccw_budget_mib: u64,
    max: usize,
    poll: umdev::server::PollMode,
) -> Result<Daemonish, BenchError> {
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-instances-")
        .tempdir()?;
    let gpu = GpuParent::new(GpuParentConfig {
        pool_mib: gpu_pool_mib,
        ..GpuParentConfig::default()
    })
    .map_err(|e| BenchError::Workload(Box::new(e)))?;
    let mut ccw_config = CcwParentConfig::new(dir.path().join("ccw-images"));
    ccw_config.budget_mib = ccw_budget_mib;
    let ccw = CcwParent::new(ccw_config).map_err(|e| BenchError::Workload(Box::new(e)))?;
    let mut config = RegistryConfig::new(dir.path().join("sockets"));
    config.max_instances = config.max_instances.max(max);
    config.server.poll = poll;
    let registry = Registry::new(config)?;
    registry.add_parent(Arc::new(gpu.clone()))?;
    registry.add_parent(Arc::new(ccw.clone()))?;
    Ok(Daemonish {
        registry,
        ccw,
        _gpu: gpu,
        _dir: dir,
    })
}

/// A created instance.
struct Created {
    index: usize,
    type_name: String,
    kind: TypeKind,
    uuid: String,
    socket: PathBuf,
}

/// A connected client and what it will do.
enum Client {
    Gpu(GpuClient),
    Ccw {
        client: CcwClient,
        block: u64,
        image: PathBuf,
    },
}

impl Client {
    fn connect(c: &Created, ccw: &CcwParent) -> Result<Client, ClientError> {
        match c.kind {
            TypeKind::Gpu { .. } => Ok(Client::Gpu(GpuClient::connect(&c.socket)?)),
            TypeKind::Ccw { capacity_mib } => {
                let image = ccw
                    .instances()
                    .into_iter()
                    .find(|i| i.uuid == c.uuid)
                    .map(|i| ccw.image_path(&i.image))
                    .ok_or_else(|| format!("ccw parent has no instance {}", c.uuid))?;
                let blocks = (capacity_mib << 20) / umdev_devices::ccw::driver::BLOCK_SIZE;
                let block = (c.index as u64 * 8) % blocks.saturating_sub(8).max(1);
                Ok(Client::Ccw {
                    client: CcwClient::connect(&c.socket)?,
                    block,
                    image,
                })
            }
        }
    }

    fn work(&mut self, index: usize) -> Result<(), ClientError> {
        match self {
            Client::Gpu(g) => g.draw_and_verify(clients::colour(index)),
            Client::Ccw {
                client,
                block,
                image,
            } => client.write_and_verify(&clients::ccw_pattern(index), *block, image),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Measure one scale point: `n` instances of `types` round robin (see the module doc).
pub fn run_point(
    n: usize,
    types: &[String],
    isolation: &str,
    poll: umdev::server::PollMode,
) -> Result<ScalePoint, BenchError> {
    if n == 0 || types.is_empty() {
        return Err(BenchError::Options(
            "a scale point needs at least one instance and one type".into(),
        ));
    }
    let names = plan(n, types);
    let kinds: Vec<TypeKind> = names
        .iter()
        .map(|t| type_kind(t))
        .collect::<Result<_, _>>()?;
    let mut mix: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &names {
        *mix.entry(t.as_str()).or_default() += 1;
    }
    // Room for every instance, never less than the daemon's defaults.
    let (gpu_need, ccw_need) = kinds.iter().fold((0, 0), |(g, c), k| match k {
        TypeKind::Gpu { fb_mib } => (g + fb_mib, c),
        TypeKind::Ccw { capacity_mib } => (g, c + capacity_mib),
    });
    let gpu_pool_mib = gpu_need.max(GpuParentConfig::default().pool_mib);
    let ccw_budget_mib = ccw_need.max(CcwParentConfig::new("").budget_mib);
    let d = daemonish(gpu_pool_mib, ccw_budget_mib, n, poll)?;
    let mut point = ScalePoint {
        instances: n,
        mix: mix
            .into_iter()
            .map(|(t, count)| TypeCount {
                type_name: t.to_owned(),
                count,
            })
            .collect(),
        gpu_pool_mib,
        ccw_budget_mib,
        isolation: isolation.to_owned(),
        ..ScalePoint::default()
    };

    point.before = ProcSample::now();
    let mut created = Vec::with_capacity(n);
    for (index, (type_name, kind)) in names.iter().zip(&kinds).enumerate() {
        let t = Instant::now();
        let info = d.registry.create(type_name, None, &Params::new())?;
        point.create_samples_ms.push(ms(t.elapsed()));
        created.push(Created {
            index,
            type_name: type_name.clone(),
            kind: *kind,
            uuid: info.uuid,
            socket: info.socket,
        });
    }
    point.created = created.len();
    point.create_ms = summarize(&point.create_samples_ms);
    std::thread::sleep(SETTLE);
    point.idle = ProcSample::now();
    point.idle_per_instance = point.idle.per_instance(&point.before, n);

    // Every client connected (one after the other), then all released at once.
    let started = Instant::now();
    let mut connected: Vec<(usize, Client)> = Vec::with_capacity(n);
    for c in &created {
        match Client::connect(c, &d.ccw) {
            Ok(client) => connected.push((c.index, client)),
            Err(e) => point
                .failures
                .push(format!("#{} {}: {e}", c.index, c.type_name)),
        }
    }
    point.connect_s = started.elapsed().as_secs_f64();
    point.attached_at_release = d
        .registry
        .instances()
        .iter()
        .filter(|i| i.client_attached)
        .count();
    // The start gate: held for writing while the threads are spawned, each thread waits
    // for a read lock, so all start when it is dropped (and a thread that could not be
    // spawned leaves nobody waiting).
    let gate = Arc::new(RwLock::new(()));
    let hold = gate.write().unwrap_or_else(|p| p.into_inner());
    let mut threads = Vec::with_capacity(connected.len());
    for (index, mut client) in connected {
        let gate = gate.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("client-{index}"))
            .spawn(move || {
                drop(gate.read().unwrap_or_else(|p| p.into_inner()));
                let t = Instant::now();
                let r = client.work(index);
                (index, r, t.elapsed(), client)
            });
        match spawned {
            Ok(h) => threads.push(h),
            Err(e) => point.failures.push(format!(
                "#{index} {}: spawning its client thread: {e}",
                created[index].type_name
            )),
        }
    }
    // The clock starts before the release: once released, the clients may keep this
    // thread off the CPU for a while.
    let released = Instant::now();
    drop(hold);
    let mut client_ms = Vec::with_capacity(threads.len());
    let mut clients = Vec::with_capacity(threads.len());
    for h in threads {
        match h.join() {
            Ok((index, r, took, client)) => {
                client_ms.push(ms(took));
                match r {
                    Ok(()) => point.verified += 1,
                    Err(e) => point
                        .failures
                        .push(format!("#{index} {}: {e}", created[index].type_name)),
                }
                clients.push(client);
            }
            Err(_) => point.failures.push("a client thread panicked".into()),
        }
    }
    point.serve_wall_s = released.elapsed().as_secs_f64();
    point.serve_client_ms = summarize(&client_ms);
    point.serving = ProcSample::now();
    let (cpu0, w0) = (crate::cputime::process(), Instant::now());
    std::thread::sleep(IDLE_CPU_WINDOW);
    let used = crate::cputime::process().saturating_sub(cpu0);
    point.connected_idle_cpu_pct = 100.0 * used.as_secs_f64() / w0.elapsed().as_secs_f64();
    drop(clients);

    // Removal once every server has seen its client go.
    let deadline = Instant::now() + DETACH_TIMEOUT;
    while d.registry.instances().iter().any(|i| i.client_attached) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut remove_ms = Vec::with_capacity(n);
    for c in &created {
        let t = Instant::now();
        d.registry.remove(&c.uuid, false)?;
        remove_ms.push(ms(t.elapsed()));
    }
    point.remove_ms = summarize(&remove_ms);
    Ok(point)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_status_reads_rss_fields_and_threads() {
        let text = "Name:\tumdev\nVmRSS:\t   12345 kB\nRssAnon:\t    8000 kB\n\
                    RssFile:\t    4000 kB\nRssShmem:\t     345 kB\nThreads:\t7\n";
        let s = parse_status(text);
        assert_eq!(
            (s.rss_kib, s.anon_kib, s.file_kib, s.shmem_kib, s.threads),
            (12345, 8000, 4000, 345, 7)
        );
        let rollup = "55df5e216000-7ffd70cf9000 ---p 00000000 00:00 0   [rollup]\n\
                      Rss:                1784 kB\nPss:                 224 kB\n\
                      Pss_Shmem:            12 kB\nAnonymous:           112 kB\n";
        assert_eq!(parse_rollup(rollup), (1784, 112, 12));
        let now = ProcSample::now();
        assert!(now.smaps_rss_kib > 0 && now.smaps_anon_kib > 0, "{now:?}");
        assert!(
            now.rss_kib > 0 && now.threads >= 1 && now.fds >= 3,
            "{now:?}"
        );
    }

    #[test]
    fn test_per_instance_divides_signed_differences() {
        let before = ProcSample {
            rss_kib: 1000,
            threads: 2,
            ..ProcSample::default()
        };
        let after = ProcSample {
            rss_kib: 1400,
            threads: 10,
            shmem_kib: 0,
            ..ProcSample::default()
        };
        let p = after.per_instance(&before, 4);
        assert_eq!((p.rss_kib, p.threads), (100.0, 2.0));
        assert_eq!(before.per_instance(&after, 4).rss_kib, -100.0);
    }

    #[test]
    fn test_plan_is_round_robin_and_kinds_are_the_daemons_types() {
        let types = vec!["gpu-4m".to_owned(), "ccw-16m".to_owned()];
        assert_eq!(plan(3, &types), ["gpu-4m", "ccw-16m", "gpu-4m"]);
        assert_eq!(type_kind("gpu-16m").unwrap(), TypeKind::Gpu { fb_mib: 16 });
        assert_eq!(
            type_kind("ccw-64m").unwrap(),
            TypeKind::Ccw { capacity_mib: 64 }
        );
        assert!(type_kind("gpu-8m").is_err());
    }
}
