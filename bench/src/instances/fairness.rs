//! The fairness part of `bench instances`: GPU instances of one [`GpuParent`] (in a
//! [`Registry`], as the daemon serves them) flood the shared render engine with FILLs
//! while an idle instance of the same parent measures its FENCE round trip.
//!
//! # A set
//!
//! Each flooder is an instance with an embedded VMM and a thread of its own that keeps its
//! 1 MiB ring three quarters full of FILLs of the flooder's own size (polling `RING_HEAD`
//! every millisecond and publishing a quarter ring whenever a quarter is free). Fills of
//! different sizes make the command count differ from the work, so a scheduler that
//! counted commands would fail the share check. The prober is a `gpu-4m` instance that
//! submits one FENCE at a time ([`FenceProber`]), with a random pause of 1–5 ms between
//! samples.
//!
//! The run alternates *blocks*: unloaded (every flooder's ring off, so the engine holds
//! nothing of theirs) and loaded (every flooder's ring on and refilled; the block starts
//! once each flooder has executed a command since its ring came back), in the order
//! unloaded, loaded in even rounds and loaded, unloaded in odd rounds, so that drift on a
//! shared machine hits both alike. A block takes `samples` FENCE samples.
//!
//! # What is reported
//!
//! - **Shares**: the engine's per-instance counters ([`GpuHandle::engine_stats`]) are read
//!   at the start and end of every loaded block; the work executed for each flooder inside
//!   the loaded blocks, divided by all of it, against its weight divided by the sum of the
//!   weights. Relative error `|share - expected| / expected`; Jain's index over
//!   `work_i / weight_i` (1.0: perfectly proportional). A flooder whose ring was found empty
//!   inside a loaded block (`dry_polls`) was not backlogged there; the count is reported.
//! - **FENCE latency**: from the prober's doorbell write (`RING_TAIL`) to its fence
//!   interrupt (MSI eventfd, waited for with `poll`); median and p90 unloaded and loaded,
//!   and their ratios (same run).

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umdev::instance::{Params, Registry, RegistryConfig};
use umdev::testing::{DeviceAccess, GuestMemory, Vmm};
use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::driver::{Driver, GuestRam};
use umdev_devices::gpu::regs::{REG_RING_CTRL, REG_RING_HEAD, REG_RING_TAIL, RING_SIZE_MAX};
use umdev_devices::gpu::{EngineStats, GpuHandle, GpuParent, GpuParentConfig};
use umdev_devices::testing::Bar0;

use super::clients::{ClientError, FenceProber, RAM_BASE};
use super::schedstat::{self, Counters};
use crate::rng::SeededRng;
use crate::stats::{summarize, Summary};
use crate::BenchError;

/// A flooder's ring (the largest the GPU takes).
const FLOOD_RING: u32 = RING_SIZE_MAX;
/// A flooder's mode.
const FLOOD_W: u32 = 256;
const FLOOD_H: u32 = 256;
/// How long a flooder sleeps when its ring has no free quarter.
const FLOOD_POLL: Duration = Duration::from_millis(1);
/// Longest wait for the flooders to start or stop; turns a hang into an error.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// FENCE samples thrown away before the first block (first-use costs).
const WARMUP_SAMPLES: usize = 5;

/// Flooder control states.
const PAUSE: u8 = 0;
const FLOOD: u8 = 1;
const EXIT: u8 = 2;

/// One flooding instance of a set.
#[derive(Clone, Debug)]
pub struct FloodSpec {
    /// Its type (`gpu-4m`, `gpu-16m`).
    pub type_name: &'static str,
    /// Width and height of its fills.
    pub fill: (u32, u32),
}

/// A set of flooders.
#[derive(Clone, Debug)]
pub struct SetSpec {
    /// Its name in the report.
    pub name: &'static str,
    /// The flooders.
    pub flooders: Vec<FloodSpec>,
}

/// The two sets measured: four `gpu-4m` (equal weights), and two `gpu-4m` with two
/// `gpu-16m` (weights 1 and 4); fills of four sizes in each.
pub fn default_sets() -> Vec<SetSpec> {
    let f = |type_name, w, h| FloodSpec {
        type_name,
        fill: (w, h),
    };
    vec![
        SetSpec {
            name: "equal",
            flooders: vec![
                f("gpu-4m", 64, 64),
                f("gpu-4m", 32, 32),
                f("gpu-4m", 128, 8),
                f("gpu-4m", 16, 16),
            ],
        },
        SetSpec {
            name: "mixed",
            flooders: vec![
                f("gpu-4m", 64, 64),
                f("gpu-4m", 32, 32),
                f("gpu-16m", 64, 64),
                f("gpu-16m", 32, 32),
            ],
        },
    ]
}

/// How long a set runs.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct FairPlan {
    /// Rounds of (unloaded, loaded) blocks.
    pub rounds: usize,
    /// FENCE samples per block.
    pub samples_per_block: usize,
    /// Seed of the pauses between samples.
    pub seed: u64,
    /// The nice value the fairness parent's engine thread is built with
    /// ([`GpuParentConfig::engine_nice`]; `None`: the process's).
    pub engine_nice: Option<i32>,
    /// Busy threads of the busy-host runs (0: every set runs on the machine as it is,
    /// once; more: every set runs once so and once more beside this many spinning threads
    /// at the process's priority, [`BusyLoad`]).
    pub busy_threads: usize,
    /// The time slice the instances' fetcher threads ask for, µs (0: none;
    /// [`RenderEngine::set_fetcher_slice`](umdev_devices::gpu::engine::RenderEngine)).
    pub fetcher_slice_us: u64,
    /// The time slice the instances' connection threads ask for, µs (0: none;
    /// `ServerConfig::thread_slice`).
    pub conn_slice_us: u64,
}

/// Background load for a busy-host run: `n` threads of this process that spin at its
/// priority (nice value and policy inherited) until dropped, the stand-in for a host
/// whose CPUs run guests. They share nothing with the engine but the CPUs.
pub struct BusyLoad {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl BusyLoad {
    /// Start `n` spinning threads.
    pub fn start(n: usize) -> std::io::Result<BusyLoad> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut load = BusyLoad {
            stop: stop.clone(),
            threads: Vec::new(),
        };
        for _ in 0..n {
            let stop = stop.clone();
            load.threads
                .push(
                    std::thread::Builder::new()
                        .name("busy".into())
                        .spawn(move || {
                            let mut x = 0u64;
                            while !stop.load(Ordering::Relaxed) {
                                for _ in 0..10_000 {
                                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                                }
                            }
                        })?,
                );
        }
        Ok(load)
    }
}

impl Drop for BusyLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The nice value of thread `tid` of this process (field 19 of `/proc/self/task/<tid>/stat`).
pub fn thread_nice(tid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    parse_stat_nice(&stat)
}

/// The nice value in the text of a `stat` file: the command name is in parentheses and may
/// hold anything, so fields are counted from the last `)` (field 3, the state, follows it).
pub fn parse_stat_nice(stat: &str) -> Option<i32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19 - 3)?.parse().ok()
}

/// One flooder's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FlooderResult {
    /// Its type.
    pub type_name: String,
    /// Its weight on the engine.
    pub weight: u32,
    /// Its fill size, `WxH`.
    pub fill: String,
    /// Commands executed for it inside the loaded blocks.
    pub commands: u64,
    /// Work units executed for it inside the loaded blocks.
    pub work: u64,
    /// `work / Σ work`.
    pub share: f64,
    /// `weight / Σ weight`.
    pub expected_share: f64,
    /// `|share - expected| / expected`.
    pub rel_error: f64,
    /// Polls that found its ring empty inside a loaded block (0: backlogged throughout).
    pub dry_polls: u64,
}

/// The prober's FENCE latency.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FenceResult {
    /// Every unloaded sample, µs.
    pub unloaded_us: Vec<f64>,
    /// Every loaded sample, µs.
    pub loaded_us: Vec<f64>,
    /// Summary of `unloaded_us`.
    pub unloaded: Summary,
    /// Summary of `loaded_us`.
    pub loaded: Summary,
    /// The doorbell write's round trip (REGION_WRITE of `RING_TAIL` to its reply) of every
    /// unloaded sample, µs: the wire and the instance's connection thread, no engine.
    pub doorbell_unloaded_us: Vec<f64>,
    /// The same, loaded.
    pub doorbell_loaded_us: Vec<f64>,
    /// Summary of `doorbell_unloaded_us`.
    pub doorbell_unloaded: Summary,
    /// Summary of `doorbell_loaded_us`.
    pub doorbell_loaded: Summary,
    /// Loaded median / unloaded median.
    pub ratio_median: f64,
    /// Loaded p90 / unloaded p90.
    pub ratio_p90: f64,
    /// The most units of other instances the engine ran between the prober's wake-up and
    /// its FENCE ([`EngineStats::max_wakeup_delay`]).
    pub max_wakeup_delay_units: u64,
    /// The prober's units (warm-up included), and how many of them its own fetcher
    /// executed at once ([`EngineStats::fetcher_units`]; the rest ran on the engine thread
    /// or on another fetcher that was helping).
    pub prober_units: u64,
    /// See `prober_units`.
    pub prober_fetcher_units: u64,
    /// Units of the flooders the prober's fetcher executed ahead of its own
    /// ([`EngineStats::helped_units`]).
    pub prober_helped_units: u64,
}

/// The threads whose CPU waits a set reports, by role.
pub const THREAD_GROUPS: [&str; 7] = [
    "engine",
    "prober's fetcher",
    "prober's connection",
    "prober (bench thread)",
    "flooders' fetchers",
    "flooder clients",
    "busy threads",
];

/// CPU use and run-queue waits of one thread group, inside the unloaded and the loaded
/// blocks ([`schedstat`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SchedRow {
    /// One of [`THREAD_GROUPS`].
    pub group: &'static str,
    /// Mean run-queue wait per time on a CPU, unloaded blocks, µs.
    pub unloaded_wait_us: f64,
    /// The same, loaded blocks.
    pub loaded_wait_us: f64,
    /// CPUs the group used inside the unloaded blocks (run time / wall time).
    pub unloaded_cpus: f64,
    /// The same, loaded blocks.
    pub loaded_cpus: f64,
}

/// Which group a thread is in, given the prober's threads (`None`: not reported).
struct Roles {
    engine: i32,
    fetcher: i32,
    conn: i32,
    bench: i32,
}

impl Roles {
    fn group(&self, tid: i32, name: &str) -> Option<usize> {
        Some(match name {
            _ if tid == self.engine => 0,
            _ if tid == self.fetcher => 1,
            _ if tid == self.conn => 2,
            _ if tid == self.bench => 3,
            "umdev-gpu-fetch" => 4,
            "flooder" => 5,
            "busy" => 6,
            _ => return None,
        })
    }
}

/// Sums per group over blocks of one kind.
#[derive(Default)]
struct SchedSums {
    groups: [Counters; 7],
    wall: Duration,
}

impl SchedSums {
    fn add(
        &mut self,
        roles: &Roles,
        a: &std::collections::BTreeMap<i32, (String, Counters)>,
        b: &std::collections::BTreeMap<i32, (String, Counters)>,
        wall: Duration,
    ) {
        for (g, sum) in self.groups.iter_mut().enumerate() {
            sum.add(schedstat::delta(a, b, |tid, name| {
                roles.group(tid, name) == Some(g)
            }));
        }
        self.wall += wall;
    }
}

/// The result of one set.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FairnessSet {
    /// The set's name.
    pub name: String,
    /// Its flooders.
    pub flooders: Vec<FlooderResult>,
    /// Total time inside loaded blocks, s.
    pub window_s: f64,
    /// Engine units (all instances) inside loaded blocks.
    pub engine_units: u64,
    /// The largest `rel_error`.
    pub worst_rel_error: f64,
    /// Jain's fairness index over `work / weight`.
    pub jain: f64,
    /// The prober.
    pub fence: FenceResult,
    /// The engine thread's nice value, read from `/proc` while the set ran.
    pub engine_thread_nice: i32,
    /// Spinning threads beside the set ([`BusyLoad`]; 0: none).
    pub busy_threads: usize,
    /// CPU use and run-queue waits per thread group.
    pub sched: Vec<SchedRow>,
}

/// Jain's fairness index of `x`: `(Σx)² / (n·Σx²)`, 1 when all are equal, `1/n` when one
/// gets everything; NaN for no values or all zero.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if x.is_empty() || sq == 0.0 {
        return f64::NAN;
    }
    sum * sum / (x.len() as f64 * sq)
}

/// Shares of `work` against `weights`: `(share, expected, rel_error)` per entry.
pub fn shares(work: &[u64], weights: &[u32]) -> Vec<(f64, f64, f64)> {
    let total: f64 = work.iter().map(|&w| w as f64).sum();
    let total_w: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    work.iter()
        .zip(weights)
        .map(|(&got, &w)| {
            let share = if total > 0.0 { got as f64 / total } else { 0.0 };
            let expected = f64::from(w) / total_w;
            (share, expected, (share - expected).abs() / expected)
        })
        .collect()
}

/// A flooder: its instance, its thread and the thread's controls.
struct Flooder {
    spec: FloodSpec,
    weight: u32,
    gpu: GpuHandle,
    ctl: Arc<AtomicU8>,
    applied: Arc<AtomicU8>,
    dry: Arc<AtomicU64>,
    error: Arc<Mutex<Option<ClientError>>>,
    thread: Option<JoinHandle<()>>,
}

/// FILLs of `w`×`h` at moving places, in changing colours, a quarter ring's worth.
fn flood_batch(w: u32, h: u32) -> Vec<u8> {
    let n = (FLOOD_RING as usize / 4) / 24;
    let cmds: Vec<Command> = (0..n as u32)
        .map(|k| Command::FillRect {
            x: (k * 13) % (FLOOD_W - w + 1),
            y: (k * 7) % (FLOOD_H - h + 1),
            w,
            h,
            color: 0x0010_0000 | k,
        })
        .collect();
    Command::encode_bytes(&cmds)
}

/// What a flooder thread runs (see the module doc).
struct FloodLoop {
    drv: Driver<Bar0<Vmm>>,
    ram: GuestMemory,
    batch: Vec<u8>,
    ctl: Arc<AtomicU8>,
    applied: Arc<AtomicU8>,
    dry: Arc<AtomicU64>,
}

impl FloodLoop {
    fn run(mut self) -> Result<(), ClientError> {
        let err = |what: &str, e: std::io::Error| format!("flooder {what}: {e}");
        let ring = FLOOD_RING;
        let mut flooding = false;
        let mut tail: u32 = 0;
        // Something was published since the ring came on: an empty ring means it ran dry.
        let mut published = false;
        loop {
            let want = self.ctl.load(Ordering::Acquire);
            match want {
                EXIT => {
                    let _ = self.drv.write(REG_RING_CTRL, 0);
                    self.applied.store(EXIT, Ordering::Release);
                    return Ok(());
                }
                PAUSE if flooding => {
                    self.drv
                        .write(REG_RING_CTRL, 0)
                        .map_err(|e| err("ring off", e))?;
                    flooding = false;
                }
                FLOOD if !flooding => {
                    self.drv
                        .setup_ring(RAM_BASE, ring)
                        .map_err(|e| err("ring on", e))?;
                    tail = 0;
                    published = false;
                    flooding = true;
                }
                _ => {}
            }
            self.applied.store(want, Ordering::Release);
            if !flooding {
                std::thread::sleep(FLOOD_POLL);
                continue;
            }
            let head = self
                .drv
                .read(REG_RING_HEAD)
                .map_err(|e| err("RING_HEAD", e))?;
            let used = tail.wrapping_sub(head) & (ring - 1);
            if used == 0 && published {
                self.dry.fetch_add(1, Ordering::Relaxed);
            }
            let free = (ring - 4 - used) as usize;
            if free < self.batch.len() {
                std::thread::sleep(FLOOD_POLL);
                continue;
            }
            let at = tail as usize;
            let first = self.batch.len().min(ring as usize - at);
            let ram = &mut self.ram;
            GuestRam::write(ram, RAM_BASE + at as u64, &self.batch[..first])
                .map_err(|e| err("ring write", e))?;
            if first < self.batch.len() {
                GuestRam::write(ram, RAM_BASE, &self.batch[first..])
                    .map_err(|e| err("ring write", e))?;
            }
            tail = ((at + self.batch.len()) % ring as usize) as u32;
            published = true;
            self.drv
                .write(REG_RING_TAIL, tail)
                .map_err(|e| err("RING_TAIL", e))?;
        }
    }
}

fn connect_flooder(socket: &Path, spec: &FloodSpec) -> Result<FloodLoop, ClientError> {
    let vmm = Vmm::connect(socket).map_err(|e| format!("connect: {e}"))?;
    let mut vmm = vmm
        .with_ram(RAM_BASE, FLOOD_RING as usize)
        .map_err(|e| format!("DMA_MAP: {e}"))?;
    vmm.enable_device().map_err(|e| format!("enable: {e}"))?;
    let ram = vmm.ram().clone();
    let mut drv = Driver::probe(Bar0(vmm)).map_err(|e| format!("probe: {e}"))?;
    drv.set_mode(FLOOD_W, FLOOD_H, FLOOD_W * 4)
        .map_err(|e| format!("mode: {e}"))?;
    Ok(FloodLoop {
        drv,
        ram,
        batch: flood_batch(spec.fill.0, spec.fill.1),
        ctl: Arc::new(AtomicU8::new(PAUSE)),
        applied: Arc::new(AtomicU8::new(PAUSE)),
        dry: Arc::new(AtomicU64::new(0)),
    })
}

impl Flooder {
    fn set(&self, state: u8) {
        self.ctl.store(state, Ordering::Release);
    }

    fn failed(&self) -> Option<ClientError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Wait until `done()`, failing with `what` (and any flooder's error) after
/// [`CONTROL_TIMEOUT`].
fn wait(flooders: &[Flooder], what: &str, done: impl Fn() -> bool) -> Result<(), BenchError> {
    let deadline = Instant::now() + CONTROL_TIMEOUT;
    loop {
        if let Some(e) = flooders.iter().find_map(Flooder::failed) {
            return Err(BenchError::Workload(e.into()));
        }
        if done() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(BenchError::Workload(
                format!("fairness: timed out waiting for {what}").into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Counters at one moment.
struct Snapshot {
    at: Instant,
    stats: Vec<EngineStats>,
    dry: Vec<u64>,
    units: u64,
}

fn snapshot(flooders: &[Flooder], parent: &GpuParent) -> Snapshot {
    Snapshot {
        at: Instant::now(),
        stats: flooders.iter().map(|f| f.gpu.engine_stats()).collect(),
        dry: flooders
            .iter()
            .map(|f| f.dry.load(Ordering::Relaxed))
            .collect(),
        units: parent.engine().units(),
    }
}

/// Totals over the loaded blocks.
#[derive(Default)]
struct Totals {
    commands: Vec<u64>,
    work: Vec<u64>,
    dry: Vec<u64>,
    window: Duration,
    units: u64,
}

impl Totals {
    fn add(&mut self, a: &Snapshot, b: &Snapshot) {
        let n = a.stats.len();
        self.commands.resize(n, 0);
        self.work.resize(n, 0);
        self.dry.resize(n, 0);
        for i in 0..n {
            self.commands[i] += b.stats[i].commands - a.stats[i].commands;
            self.work[i] += b.stats[i].work - a.stats[i].work;
            self.dry[i] += b.dry[i] - a.dry[i];
        }
        self.window += b.at - a.at;
        self.units += b.units - a.units;
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Take `n` FENCE samples with random pauses of 1–5 ms: fence latencies to `out`,
/// doorbell round trips to `doorbells`.
fn fence_block(
    prober: &mut FenceProber,
    n: usize,
    rng: &mut SeededRng,
    out: &mut Vec<f64>,
    doorbells: &mut Vec<f64>,
) -> Result<(), BenchError> {
    for _ in 0..n {
        let (doorbell, fence) = prober
            .sample()
            .map_err(|e| BenchError::Workload(format!("prober: {e}").into()))?;
        out.push(us(fence));
        doorbells.push(us(doorbell));
        std::thread::sleep(Duration::from_micros(rng.range_inclusive(1000, 5000)));
    }
    Ok(())
}

/// Measure one set (see the module doc), beside `busy` spinning threads that run for the
/// whole set (0: none).
pub fn run_set(spec: &SetSpec, plan: &FairPlan, busy: usize) -> Result<FairnessSet, BenchError> {
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-fair-")
        .tempdir()?;
    let parent = GpuParent::new(GpuParentConfig {
        engine_nice: plan.engine_nice,
        ..GpuParentConfig::default()
    })
    .map_err(|e| BenchError::Workload(Box::new(e)))?;
    let mut config = RegistryConfig::new(dir.path().join("sockets"));
    config.server.thread_slice =
        Some(Duration::from_micros(plan.conn_slice_us)).filter(|d| !d.is_zero());
    let registry = Registry::new(config)?;
    registry.add_parent(Arc::new(parent.clone()))?;
    // Before any instance attaches: fetchers take their slice when they start.
    parent.engine().set_fetcher_slice(
        Some(Duration::from_micros(plan.fetcher_slice_us)).filter(|d| !d.is_zero()),
    );
    let weight_of = |t: &str| {
        parent
            .config()
            .types
            .iter()
            .find(|ty| ty.name == t)
            .map(|ty| ty.weight)
            .ok_or_else(|| BenchError::Options(format!("no GPU type {t}")))
    };

    let mut flooders: Vec<Flooder> = Vec::new();
    let result = (|| -> Result<FairnessSet, BenchError> {
        for f in &spec.flooders {
            let info = registry.create(f.type_name, None, &Params::new())?;
            let fl =
                connect_flooder(&info.socket, f).map_err(|e| BenchError::Workload(e.into()))?;
            let gpu = parent
                .handle(&info.uuid)
                .ok_or_else(|| BenchError::Workload("flooder has no GPU handle".into()))?;
            let error = Arc::new(Mutex::new(None));
            let (ctl, applied, dry) = (fl.ctl.clone(), fl.applied.clone(), fl.dry.clone());
            let err_slot = error.clone();
            let thread = std::thread::Builder::new()
                .name("flooder".into())
                .spawn(move || {
                    if let Err(e) = fl.run() {
                        *err_slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                })?;
            flooders.push(Flooder {
                spec: f.clone(),
                weight: weight_of(f.type_name)?,
                gpu,
                ctl,
                applied,
                dry,
                error,
                thread: Some(thread),
            });
        }
        // The engine thread runs since the first flooder attached, at its nice value.
        let engine_thread_nice = parent
            .engine()
            .thread_id()
            .and_then(thread_nice)
            .ok_or_else(|| BenchError::Workload("the engine thread is not running".into()))?;
        let probe = registry.create("gpu-4m", None, &Params::new())?;
        let mut prober = FenceProber::connect(&probe.socket)
            .map_err(|e| BenchError::Workload(format!("prober: {e}").into()))?;
        let prober_gpu = parent
            .handle(&probe.uuid)
            .ok_or_else(|| BenchError::Workload("prober has no GPU handle".into()))?;
        // The prober's instance is the newest: its fetcher and connection threads are the
        // newest of their names (thread ids grow).
        let newest = |name: &str| {
            schedstat::threads()
                .into_iter()
                .filter(|(_, (n, _))| n == name)
                .map(|(tid, _)| tid)
                .max()
                .unwrap_or(-1)
        };
        let roles = Roles {
            engine: parent.engine().thread_id().unwrap_or(-1),
            fetcher: newest("umdev-gpu-fetch"),
            conn: newest("umdev-conn"),
            // SAFETY: gettid has no arguments and cannot fail.
            bench: unsafe { libc::gettid() },
        };
        let (mut sched_unloaded, mut sched_loaded) = (SchedSums::default(), SchedSums::default());

        // Both kinds of block see the load: it starts before the warm-up.
        let _load = BusyLoad::start(busy)?;
        let mut rng = SeededRng::new(plan.seed);
        let mut fence = FenceResult::default();
        let (mut warm, mut warm_doorbells) = (Vec::new(), Vec::new());
        fence_block(
            &mut prober,
            WARMUP_SAMPLES,
            &mut rng,
            &mut warm,
            &mut warm_doorbells,
        )?;
        let mut totals = Totals::default();
        for round in 0..plan.rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for loaded in order {
                if !loaded {
                    flooders.iter().for_each(|f| f.set(PAUSE));
                    wait(&flooders, "the flooders to stop", || {
                        flooders
                            .iter()
                            .all(|f| f.applied.load(Ordering::Acquire) == PAUSE)
                    })?;
                    let (t, a) = (Instant::now(), schedstat::threads());
                    fence_block(
                        &mut prober,
                        plan.samples_per_block,
                        &mut rng,
                        &mut fence.unloaded_us,
                        &mut fence.doorbell_unloaded_us,
                    )?;
                    sched_unloaded.add(&roles, &a, &schedstat::threads(), t.elapsed());
                    continue;
                }
                let before: Vec<u64> = flooders
                    .iter()
                    .map(|f| f.gpu.engine_stats().commands)
                    .collect();
                flooders.iter().for_each(|f| f.set(FLOOD));
                wait(&flooders, "every flooder to run", || {
                    flooders
                        .iter()
                        .zip(&before)
                        .all(|(f, &b)| f.gpu.engine_stats().commands > b)
                })?;
                let a = snapshot(&flooders, &parent);
                let threads_a = schedstat::threads();
                fence_block(
                    &mut prober,
                    plan.samples_per_block,
                    &mut rng,
                    &mut fence.loaded_us,
                    &mut fence.doorbell_loaded_us,
                )?;
                let b = snapshot(&flooders, &parent);
                sched_loaded.add(&roles, &threads_a, &schedstat::threads(), b.at - a.at);
                totals.add(&a, &b);
            }
        }
        flooders.iter().for_each(|f| f.set(PAUSE));
        if let Some(e) = flooders.iter().find_map(Flooder::failed) {
            return Err(BenchError::Workload(e.into()));
        }
        fence.unloaded = summarize(&fence.unloaded_us);
        fence.loaded = summarize(&fence.loaded_us);
        fence.doorbell_unloaded = summarize(&fence.doorbell_unloaded_us);
        fence.doorbell_loaded = summarize(&fence.doorbell_loaded_us);
        fence.ratio_median = fence.loaded.median / fence.unloaded.median;
        fence.ratio_p90 = fence.loaded.p90 / fence.unloaded.p90;
        let prober_stats = prober_gpu.engine_stats();
        fence.max_wakeup_delay_units = prober_stats.max_wakeup_delay;
        fence.prober_units = prober_stats.commands;
        fence.prober_fetcher_units = prober_stats.fetcher_units;
        fence.prober_helped_units = prober_stats.helped_units;

        let weights: Vec<u32> = flooders.iter().map(|f| f.weight).collect();
        let shares = shares(&totals.work, &weights);
        let normalized: Vec<f64> = totals
            .work
            .iter()
            .zip(&weights)
            .map(|(&w, &wt)| w as f64 / f64::from(wt))
            .collect();
        let results: Vec<FlooderResult> = flooders
            .iter()
            .enumerate()
            .map(|(i, f)| FlooderResult {
                type_name: f.spec.type_name.to_owned(),
                weight: f.weight,
                fill: format!("{}x{}", f.spec.fill.0, f.spec.fill.1),
                commands: totals.commands[i],
                work: totals.work[i],
                share: shares[i].0,
                expected_share: shares[i].1,
                rel_error: shares[i].2,
                dry_polls: totals.dry[i],
            })
            .collect();
        Ok(FairnessSet {
            name: spec.name.to_owned(),
            worst_rel_error: results.iter().map(|r| r.rel_error).fold(0.0, f64::max),
            jain: jain(&normalized),
            flooders: results,
            window_s: totals.window.as_secs_f64(),
            engine_units: totals.units,
            fence,
            engine_thread_nice,
            busy_threads: busy,
            sched: THREAD_GROUPS
                .iter()
                .enumerate()
                .map(|(g, &group)| SchedRow {
                    group,
                    unloaded_wait_us: sched_unloaded.groups[g].wait_per_run_us(),
                    loaded_wait_us: sched_loaded.groups[g].wait_per_run_us(),
                    unloaded_cpus: sched_unloaded.groups[g].run_ns as f64
                        / sched_unloaded.wall.as_nanos().max(1) as f64,
                    loaded_cpus: sched_loaded.groups[g].run_ns as f64
                        / sched_loaded.wall.as_nanos().max(1) as f64,
                })
                .collect(),
        })
    })();
    for f in &flooders {
        f.set(EXIT);
    }
    for f in &mut flooders {
        if let Some(t) = f.thread.take() {
            let _ = t.join();
        }
    }
    drop(registry);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_stat_nice_counts_fields_after_the_last_paren() {
        // A command name with spaces and parentheses; nice (field 19) is 19, priority 39.
        let stat = "4242 (a) b (c) S 1 4242 4242 0 -1 4194368 97 0 0 0 3 1 0 0 39 19 1 0 \
                    12345 1000 100";
        assert_eq!(parse_stat_nice(stat), Some(19));
        assert_eq!(parse_stat_nice("4242 (x) S 1"), None);
        assert_eq!(parse_stat_nice("no paren"), None);
        let tid = i32::try_from(std::process::id()).unwrap();
        assert!(thread_nice(tid).is_some_and(|n| (-20..=19).contains(&n)));
    }

    #[test]
    fn test_jain_is_one_for_equal_and_one_over_n_for_one_taker() {
        assert!((jain(&[3.0, 3.0, 3.0, 3.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[5.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!(jain(&[]).is_nan());
        let j = jain(&[1.0, 1.1, 0.9, 1.0]);
        assert!(j > 0.99 && j < 1.0, "{j}");
    }

    #[test]
    fn test_shares_compare_work_fraction_with_weight_fraction() {
        let s = shares(&[100, 100, 440, 360], &[1, 1, 4, 4]);
        assert_eq!(s[0].1, 0.1);
        assert_eq!(s[2].0, 0.44);
        assert!((s[2].2 - 0.1).abs() < 1e-12, "{s:?}");
        assert!((s[3].2 - 0.1).abs() < 1e-12, "{s:?}");
        assert!(s[0].2.abs() < 1e-12);
    }

    #[test]
    fn test_flood_batch_is_a_quarter_ring_of_fills_that_fit_the_mode() {
        for (w, h) in [(16, 16), (128, 8), (64, 64)] {
            let b = flood_batch(w, h);
            assert_eq!(b.len() % 24, 0);
            assert!(b.len() <= FLOOD_RING as usize / 4);
            assert_ne!(b.len() % FLOOD_RING as usize, 0);
            let dwords: Vec<u32> = b
                .chunks_exact(4)
                .map(|d| u32::from_le_bytes([d[0], d[1], d[2], d[3]]))
                .collect();
            let mut pos = 0;
            while pos < dwords.len() {
                let (cmd, len) = Command::decode(&dwords[pos..]).unwrap();
                assert!(
                    matches!(cmd, Command::FillRect { x, y, w: cw, h: ch, .. }
                        if (cw, ch) == (w, h) && x + cw <= FLOOD_W && y + ch <= FLOOD_H),
                    "{cmd:?}"
                );
                pos += len;
            }
        }
    }
}
