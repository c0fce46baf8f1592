//! The render engine: one thread that executes the ring commands of every GPU attached to
//! it, one command per unit, choosing whose command runs next with a weighted fair
//! scheduler (stride scheduling, `sched.rs`). A [`GpuParent`](super::parent::GpuParent) has
//! one engine for all its instances, the way gvt-g time-slices the vGPUs of one physical
//! GPU; a standalone [`Gpu`](super::Gpu) has an engine of its own (an engine of one).
//!
//! # Who does what
//!
//! Each GPU (a *lane* of the engine) keeps a fetcher thread of its own (`worker.rs`): woken
//! by the doorbell, it reads the published bytes of its ring (DMA reads, which for fd-less
//! memory are server→client DMA_READs that wait for the client) and hands them to the
//! engine as one `Work` item. The engine thread executes that work one command per *unit*
//! (`execute.rs`): pins, pixel copies, framebuffer writes and the command's completion (a
//! lane's unit that is due at once may run on its fetcher instead: "Who executes").
//! **The engine never waits for a client**: a unit does no remote DMA, so its duration is
//! bounded by the work it describes. A client that never answers its instance's DMA_READ
//! stalls that instance's fetcher (until the remote DMA timeout, or a cancellation), never
//! the engine: its lane simply has no work queued, and the other lanes are served.
//!
//! A lane holds at most one work item (one fetch's worth of commands): the fetcher fetches
//! `[RING_HEAD, RING_TAIL)` only when the engine has finished the previous item, and the
//! engine rings the fetcher's doorbell when it has. So a lane's memory is bounded by its
//! ring size, and `RING_HEAD` is exact whenever the fetcher reads it, as with a device of
//! its own.
//!
//! # Scheduling
//!
//! The engine runs the ready lane with the smallest stride pass, executes one unit (the
//! engine thread: a quantum of a few, see "Quantum"), charges the lane the unit's cost (`execute.rs`: a base cost plus the pixels written) multiplied
//! by its stride, and puts it back in the ready set if it has work left. `sched.rs` states
//! the invariants: work shares proportional to the weights among backlogged lanes (within
//! one unit), and an idle lane that becomes ready while `n` others have work runs after at
//! most `n` of their units (the one executing included), whatever they have queued.
//! Per-lane counters ([`EngineStats`]) make both observable: executed commands and work,
//! and the largest number of other lanes' units executed between the moment the lane
//! became ready and the start of its next unit.
//!
//! # Who executes
//!
//! The engine thread executes the lanes' backlog, but it runs flat out while any lane has
//! work, so on a busy host (more CPU-bound threads than CPUs) it is never *woken*: when it
//! loses its CPU it waits for another thread's time slice to end (ms), and a short slice of
//! its own does not change that (measured). An idle instance's command that arrives then
//! would wait that long although the scheduler picks it within a few units. The fetcher
//! that hands the command over, though, has just been woken by the doorbell, with a short
//! slice (see "Priority"), so it has a CPU. **If the lane it submits to is at the front of
//! the ready set** (its pass is the smallest ready pass, `StrideScheduler::at_front`: the
//! scheduler picks it next, or after others tied at the same pass), `submit` executes that
//! one unit on the fetcher's thread at once (`StrideScheduler::take`, then the same step
//! the engine runs: gate, charge, counters, completion) and leaves the rest of the work to
//! the engine. **If other lanes' units are ahead of it** (typically one unit each: the lane
//! was charged for its last unit and the engine thread, waiting for a CPU, has not run the
//! others' units that come before its next one), the fetcher first runs those, one at a
//! time and each the scheduler's own pick (`step`), at most [`HELP_LIMIT`] of them, and then
//! its lane's unit; past the limit it leaves everything to the engine thread. While it runs
//! a unit ahead of its own, its lane is out of the ready set (pass kept), so no other thread
//! picks the lane's unit meanwhile. So:
//!
//! - The scheduler still decides: every unit a fetcher runs is the one the engine would
//!   have run next, charged like any other, so shares are unchanged (a lane that submits a
//!   unit per doorbell moves its pass past the others' and then waits for the engine like
//!   any backlogged lane). A fetcher runs others' units only on its way to its own, at most
//!   [`HELP_LIMIT`]: it does not become a second engine ([`EngineStats::helped_units`],
//!   [`EngineStats::fetcher_units`] count both).
//! - At most one unit of a lane executes at a time (the lane is `Running`, out of the ready
//!   set, and its gate marks it), and a lane's units run in ring order. Units of
//!   *different* lanes may overlap: the engine thread's and a fetcher's (the engine is
//!   a time-sliced resource, not a lock between lanes; units touch only their own lane's
//!   state). A unit does no remote DMA and DMA_MAP takes only memory whose faults a client
//!   cannot stall (SECURITY.md), so running another lane's unit cannot block the fetcher
//!   on that lane's client.
//! - Quiesce, reset and stop see a fetcher's unit as an engine unit: it takes the lane's
//!   gate with `try_execute` (a paused lane is parked, its work kept), and it ends before
//!   the fetcher's `drain` returns, inside the fetcher's own `Gate::enter` section (so a
//!   pause of the helping lane waits for the other lane's unit too: one unit, bounded).
//!
//! For a lane that wakes at the front of the ready set the wake-up delay (`sched.rs`,
//! `EngineStats::max_wakeup_delay`) is then zero units, whatever the engine thread does;
//! behind others, the units it waits for run on its own thread.
//!
//! # Quantum
//!
//! The engine thread executes up to [`QUANTUM_UNITS`] units, or [`QUANTUM_WORK`] work
//! units, of the lane it picked per scheduling step and charges them together; a fetcher
//! executes one unit per step. The reason is the state lock: the engine thread takes it
//! once per step, and a CPU-bound thread that takes a lock for every 1 µs unit holds it a
//! good part of the time, so it is often preempted while holding it — by the very fetcher
//! a doorbell woke on its CPU, which then sleeps on the lock until the engine thread gets
//! a CPU again (ms on a busy host). Measured (`umdev bench instances --busy-threads 2`,
//! the prober's fetcher timing its own lock wait): before the quantum, 7–8 % of an idle
//! instance's FENCEs under load waited 0.3–16 ms for the lock, and they were the p90; with
//! it, about 1 %. The scheduler's bounds hold with a quantum in place of a unit: shares
//! within one quantum's charge, and a lane that wakes behind others waits for at most one
//! quantum of each on the engine thread (and none when its fetcher runs its unit). A
//! pause or stop ends a quantum at the next unit (`Gate::halted`).
//!
//! # Quiescing one lane
//!
//! A lane's `Gate` (`worker.rs`) is shared by its fetcher and the engine. The engine takes
//! it with `Gate::try_execute`, which never blocks: a lane that is paused (reset, soon
//! migration STOP) or stopped is *parked* (taken out of the ready set, its work kept) and
//! the engine goes on with the others; `RenderEngine::kick` puts it back when the pause
//! ends.
//! `Gate::pause` waits until neither the fetcher nor the engine is inside a unit of the
//! lane, so `Worker::quiesce` keeps its guarantee (nothing of the lane's work shows while
//! the guard lives) with the engine shared. The engine waits for a paused lane never.
//!
//! # Locks
//!
//! Order: the engine's state lock, then a lane's gate lock (`try_execute` and the release
//! of the execute guard run under the state lock; nothing takes the state lock while
//! holding a gate lock). Nobody holds the state lock while executing a unit; the unit takes
//! the lane's own locks (`state.rs`), which nobody holds across a wait for a client.
//!
//! # Priority
//!
//! The engine thread is throughput work: it runs as long as any lane has work queued,
//! while the threads around it (each instance's connection thread answering the doorbell
//! write, its fetcher, the thread that signals the fence interrupt) are latency paths that
//! run for microseconds and sleep. On a machine with fewer cores than busy threads, an
//! engine at the same priority as those threads delays their wake-ups by a time slice, so
//! an idle instance's FENCE waits on CPU contention although the scheduler above would run
//! it next. An engine built with a nice value ([`RenderEngine::with_nice`]) sets it on its
//! own thread (`setpriority(PRIO_PROCESS, tid)`: on Linux that is one thread, not the
//! process) before it executes anything; the spawner waits for that, so once a lane is
//! registered the engine runs at its priority. A nice value below the thread's inherited
//! one needs `CAP_SYS_NICE`: without it the engine logs a warning and runs at the inherited
//! value. [`RenderEngine::thread_id`] names the thread (to check its priority in
//! `/proc/self/task/<tid>/stat`).
//!
//! **The fetchers ask for a short time slice.** A lowered engine priority starves the
//! engine on a busy host (`GpuParentConfig::engine_nice`); what makes an idle instance's
//! FENCE late there is a wake-up: measured with `umdev bench instances` (thread
//! schedstat), the idle instance's fetcher, woken by the doorbell, waited ~1.4 ms on a
//! run queue per wake-up (28 µs unloaded) while the engine and the flooders kept both
//! CPUs busy, about one time slice of whatever ran there. Each fetcher thread therefore
//! asks the kernel for a slice of [`DEFAULT_FETCHER_SLICE`]
//! (`umdev::server::set_thread_slice`: SCHED_OTHER with `sched_runtime`, its nice value
//! kept; Linux ≥ 6.12's EEVDF takes it as the task's slice and lets a waking task with a
//! shorter slice preempt, older kernels ignore it). The thread's share of CPU time is
//! unchanged (that is its weight, i.e. its nice value), only its latency: a fetcher runs
//! for microseconds and sleeps. No privilege is needed. [`RenderEngine::set_fetcher_slice`]
//! changes it (or turns it off) for fetchers that start afterwards. The connection thread
//! that receives the doorbell write is the other wake-up on this path; it can ask for the
//! same slice (`umdev::server::ServerConfig::thread_slice`, on by default since a gain was
//! measured there too).
//!
//! # Panics
//!
//! A unit that panics is caught (`catch_unwind`): it is logged, that lane's work item is
//! dropped, and the engine goes on serving every lane. The lane's locks tolerate poisoning
//! (`gtt::lock`).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use umdev::dma::DmaHandle;

use super::execute::{self, Work, UNIT_BASE_COST};
use super::gtt::lock;
use super::sched::StrideScheduler;
use super::state::Shared;
use super::worker::Gate;

/// The time slice each fetcher thread asks for (see the module doc, "Priority"): the
/// framework's [`umdev::server::DEFAULT_THREAD_SLICE`], which the server's connection
/// threads ask for too.
pub const DEFAULT_FETCHER_SLICE: std::time::Duration = umdev::server::DEFAULT_THREAD_SLICE;

/// The most scheduling steps for other lanes (a unit each) a fetcher takes before its own
/// lane's first unit (module doc, "Who executes"); past it the rest is left to the engine
/// thread. A lane that
/// wakes after one small unit of its own is behind at most one unit of each lane of the
/// same weight (a few of a heavier one), so the limit is far above what a wake-up needs and
/// keeps a fetcher from becoming a second engine.
pub const HELP_LIMIT: u64 = 32;

/// The most units the engine thread executes of one lane per scheduling step (module doc,
/// "Quantum").
pub const QUANTUM_UNITS: u64 = 16;
/// The most work the engine thread executes of one lane per scheduling step, in work units
/// (`execute.rs`): the quantum ends after the unit that reaches it. 16 fills of 64×64.
pub const QUANTUM_WORK: u64 = 16 * (64 * 64 + UNIT_BASE_COST);

/// A lane's id on its engine (never reused).
pub(super) type LaneId = u64;

/// What the engine needs of a lane to execute its work.
pub(super) struct LaneCtx {
    /// The GPU's state.
    pub shared: Arc<Shared>,
    /// The DMA handle of the attach the lane belongs to.
    pub dma: DmaHandle,
    /// The pause/stop gate shared with the fetcher.
    pub gate: Arc<Gate>,
    /// The fetcher's doorbell: rung when the lane's work item is finished.
    pub doorbell: Sender<()>,
    /// True from the moment the fetcher hands a work item over until the engine has
    /// finished (or dropped) it; the fetcher fetches only while it is false. The engine
    /// clears it before it rings the doorbell, so the fetcher never misses the end.
    pub busy: AtomicBool,
}

impl LaneCtx {
    fn ring_fetcher(&self) {
        match self.doorbell.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
        }
    }
}

/// Where a lane stands in the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    /// No work.
    Idle,
    /// Has work, in the scheduler's ready set.
    Ready,
    /// One of its units is executing.
    Running,
    /// Has work, but its gate is closed (paused or stopped): out of the ready set until
    /// [`RenderEngine::kick`].
    Parked,
}

struct Lane {
    ctx: Arc<LaneCtx>,
    work: Option<Work>,
    run: Run,
    /// Engine unit count when the lane last became ready.
    ready_at: Option<u64>,
}

struct State {
    lanes: BTreeMap<LaneId, Lane>,
    sched: StrideScheduler,
    next_id: LaneId,
    /// Units executed by the engine (all lanes).
    units: u64,
    stop: bool,
    /// Holds on the engine thread ([`RenderEngine::hold_thread`]): while any is held, the
    /// thread starts no unit.
    thread_holds: u32,
}

struct Inner {
    state: Mutex<State>,
    /// Signalled when a lane becomes ready, and at stop.
    wake: Condvar,
}

/// Executed work of one GPU on its engine, since the GPU was created (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Units executed: commands (failed ones included) and ring faults.
    pub commands: u64,
    /// Work units charged for them (`UNIT_BASE_COST` each, plus pixels written).
    pub work: u64,
    /// Times the GPU's lane became ready (work arrived while it had none, or a pause with
    /// work queued ended).
    pub wakeups: u64,
    /// The most units of *other* lanes the engine executed between a wake-up and the start
    /// of the lane's next unit: the scheduler's wake-up latency, in units.
    pub max_wakeup_delay: u64,
    /// Units executed on the lane's own fetcher thread, at once, because the lane was at
    /// the front of the ready set when its work arrived (module doc, "Who executes"); the
    /// rest ran on the engine thread.
    pub fetcher_units: u64,
    /// Units of *other* lanes the lane's fetcher executed, in the scheduler's order, while
    /// its own lane waited behind them (module doc, "Who executes").
    pub helped_units: u64,
}

/// The counters behind [`EngineStats`], kept in the GPU's shared state so that they
/// survive re-attaches (a new lane per attach).
#[derive(Debug, Default)]
pub(super) struct EngineCounters {
    commands: AtomicU64,
    work: AtomicU64,
    wakeups: AtomicU64,
    max_wakeup_delay: AtomicU64,
    fetcher_units: AtomicU64,
    helped_units: AtomicU64,
}

impl EngineCounters {
    pub(super) fn snapshot(&self) -> EngineStats {
        EngineStats {
            commands: self.commands.load(Ordering::Relaxed),
            work: self.work.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            max_wakeup_delay: self.max_wakeup_delay.load(Ordering::Relaxed),
            fetcher_units: self.fetcher_units.load(Ordering::Relaxed),
            helped_units: self.helped_units.load(Ordering::Relaxed),
        }
    }
}

/// A render engine shared by GPUs (see the module doc). Dropping the last reference stops
/// and joins its thread; every GPU holds one while it is attached.
pub struct RenderEngine {
    inner: Arc<Inner>,
    name: String,
    /// The nice value the thread sets on itself (`None`: the inherited one).
    nice: Option<i32>,
    /// The thread's kernel id once it runs (0 before).
    tid: AtomicI32,
    /// The slice fetchers ask for, ns (0: none).
    fetcher_slice_ns: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for RenderEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderEngine")
            .field("name", &self.name)
            .field("nice", &self.nice)
            .finish_non_exhaustive()
    }
}

impl RenderEngine {
    /// A new engine; its thread (`<name>-engine`: keep `name` within 8 bytes for the
    /// whole name to fit Linux's 15-byte thread names) starts when the first GPU attaches.
    pub fn new(name: &str) -> Arc<RenderEngine> {
        RenderEngine::with_nice(name, None)
    }

    /// A new engine whose thread runs at nice value `nice` (`None`: the nice value it
    /// inherits from the thread that starts it). See the module doc, "Priority".
    pub fn with_nice(name: &str, nice: Option<i32>) -> Arc<RenderEngine> {
        Arc::new(RenderEngine {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    lanes: BTreeMap::new(),
                    sched: StrideScheduler::new(),
                    next_id: 1,
                    units: 0,
                    stop: false,
                    thread_holds: 0,
                }),
                wake: Condvar::new(),
            }),
            name: name.to_owned(),
            nice,
            tid: AtomicI32::new(0),
            fetcher_slice_ns: AtomicU64::new(DEFAULT_FETCHER_SLICE.as_nanos() as u64),
            thread: Mutex::new(None),
        })
    }

    /// The nice value the engine thread is built to run at (`None`: inherited).
    pub fn nice(&self) -> Option<i32> {
        self.nice
    }

    /// The time slice the fetcher threads of GPUs that attach from now on ask for (`None`:
    /// they keep the kernel's default). See the module doc, "Priority".
    pub fn set_fetcher_slice(&self, slice: Option<std::time::Duration>) {
        let ns = slice.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        self.fetcher_slice_ns.store(ns, Ordering::Relaxed);
    }

    /// The time slice fetcher threads ask for when they start (`None`: none).
    pub fn fetcher_slice(&self) -> Option<std::time::Duration> {
        Some(self.fetcher_slice_ns.load(Ordering::Relaxed))
            .filter(|&ns| ns > 0)
            .map(std::time::Duration::from_nanos)
    }

    /// The engine thread's kernel thread id, once it has started (the first attach).
    pub fn thread_id(&self) -> Option<i32> {
        Some(self.tid.load(Ordering::Acquire)).filter(|&t| t > 0)
    }

    /// Units executed so far, all lanes together.
    pub fn units(&self) -> u64 {
        lock(&self.inner.state).units
    }

    /// Lanes (attached GPUs) currently on the engine.
    pub fn lanes(&self) -> usize {
        lock(&self.inner.state).lanes.len()
    }

    /// Keep the engine thread from starting units until the hold is dropped: the stand-in,
    /// in tests, for an engine thread that gets no CPU on a busy host. The fetchers still
    /// execute what "Who executes" (module doc) gives them.
    #[cfg(feature = "testing")]
    pub fn hold_thread(self: &Arc<Self>) -> EngineThreadHold {
        lock(&self.inner.state).thread_holds += 1;
        EngineThreadHold {
            inner: self.inner.clone(),
        }
    }

    /// Add a lane with `weight`; starts the engine thread if it is not running.
    pub(super) fn register(&self, ctx: Arc<LaneCtx>, weight: u32) -> std::io::Result<LaneId> {
        {
            let mut thread = lock(&self.thread);
            if thread.is_none() {
                let inner = self.inner.clone();
                let (nice, name) = (self.nice, self.name.clone());
                let (started_tx, started) = crossbeam_channel::bounded(1);
                let handle = std::thread::Builder::new()
                    .name(format!("{}-engine", self.name))
                    .spawn(move || {
                        let tid = set_own_nice(&name, nice);
                        // The spawner waits for this; it cannot have gone.
                        let _ = started_tx.send(tid);
                        run(&inner)
                    })?;
                // Priority first: no unit runs before the thread has its nice value (and
                // the thread sends before it can block, so this cannot hang).
                let tid = started.recv().unwrap_or(0);
                self.tid.store(tid, Ordering::Release);
                *thread = Some(handle);
            }
        }
        let mut st = lock(&self.inner.state);
        let id = st.next_id;
        st.next_id += 1;
        st.sched.add(id, weight);
        st.lanes.insert(
            id,
            Lane {
                ctx,
                work: None,
                run: Run::Idle,
                ready_at: None,
            },
        );
        Ok(id)
    }

    /// Remove a lane. Its gate must be stopped and quiet (no unit executing): the engine
    /// then has it parked or idle and will not touch it again.
    pub(super) fn unregister(&self, id: LaneId) {
        let mut st = lock(&self.inner.state);
        st.sched.remove(id);
        st.lanes.remove(&id);
    }

    /// The fetcher hands over a work item (the lane has none: see `LaneCtx::busy`). The
    /// calling fetcher then executes, in the scheduler's order, the units of other lanes
    /// that are ahead of this one (at most [`HELP_LIMIT`]) and this lane's first unit,
    /// instead of waiting for the engine thread, which may be inside another lane's unit or
    /// waiting for a CPU: the scheduler chose every unit and charges it as if the engine
    /// had run it; only the thread differs. See the module doc, "Who executes".
    pub(super) fn submit(&self, id: LaneId, work: Work) {
        let mut st = lock(&self.inner.state);
        let State {
            lanes,
            sched,
            units,
            ..
        } = &mut *st;
        let Some(lane) = lanes.get_mut(&id) else {
            return;
        };
        if lane.work.is_some() {
            tracing::error!(lane = id, "gpu engine: work submitted over unfinished work");
        }
        lane.ctx.busy.store(true, Ordering::SeqCst);
        lane.work = Some(work);
        if lane.run != Run::Idle {
            return;
        }
        make_ready(lane, sched, id, *units);
        let counters = lane.ctx.clone();
        // Steps taken for others (a picked lane may turn out parked: a step, no unit).
        let mut steps = 0;
        loop {
            if st.stop {
                self.inner.wake.notify_one();
                return;
            }
            // Still ours to run: the engine thread may have picked the lane meanwhile.
            if st.lanes.get(&id).map(|l| l.run) != Some(Run::Ready) {
                if st.sched.ready_len() > 0 {
                    self.inner.wake.notify_one();
                }
                return;
            }
            if st.sched.at_front(id) {
                break;
            }
            if steps == HELP_LIMIT {
                self.inner.wake.notify_one();
                return;
            }
            // A unit the scheduler picks before this lane's: run it here. Meanwhile the
            // lane is out of the ready set (its pass kept), so that no other thread picks
            // its unit while this one, which has a CPU, is about to run it.
            st.sched.unready(id);
            let (next, done) = step(&self.inner, st, Quantum::Unit);
            st = next;
            if st.lanes.get(&id).map(|l| l.run) == Some(Run::Ready) {
                st.sched.ready(id);
            }
            match done {
                Step::NoWork => continue,
                Step::Skipped => {}
                Step::Ran(_) => {
                    counters
                        .shared
                        .engine
                        .helped_units
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            steps += 1;
        }
        let (st, _) = step_lane(&self.inner, st, Some(id), Quantum::Unit);
        // The lane may have work left, and the engine thread may have found the ready set
        // empty while this thread held the lane.
        if st.sched.ready_len() > 0 {
            self.inner.wake.notify_one();
        }
    }

    /// The lane's gate has reopened: serve it again if it has work.
    pub(super) fn kick(&self, id: LaneId) {
        let mut st = lock(&self.inner.state);
        let State {
            lanes,
            sched,
            units,
            ..
        } = &mut *st;
        let Some(lane) = lanes.get_mut(&id) else {
            return;
        };
        if lane.run == Run::Parked {
            if lane.work.is_some() {
                make_ready(lane, sched, id, *units);
                self.inner.wake.notify_one();
            } else {
                lane.run = Run::Idle;
            }
        }
    }

    /// Drop the lane's work item (reset: work fetched before it must not run). The caller
    /// has the lane quiesced, so no unit of it is executing.
    pub(super) fn discard(&self, id: LaneId) {
        let mut st = lock(&self.inner.state);
        let State { lanes, sched, .. } = &mut *st;
        let Some(lane) = lanes.get_mut(&id) else {
            return;
        };
        lane.work = None;
        lane.ctx.busy.store(false, Ordering::SeqCst);
        if lane.run == Run::Ready {
            sched.unready(id);
            lane.run = Run::Idle;
        }
    }
}

/// While held ([`RenderEngine::hold_thread`]), the engine thread starts no unit.
#[cfg(feature = "testing")]
#[must_use = "the engine thread runs again as soon as the hold is dropped"]
pub struct EngineThreadHold {
    inner: Arc<Inner>,
}

#[cfg(feature = "testing")]
impl Drop for EngineThreadHold {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.thread_holds = st.thread_holds.saturating_sub(1);
        drop(st);
        self.inner.wake.notify_all();
    }
}

fn make_ready(lane: &mut Lane, sched: &mut StrideScheduler, id: LaneId, units: u64) {
    lane.run = Run::Ready;
    lane.ready_at = Some(units);
    lane.ctx
        .shared
        .engine
        .wakeups
        .fetch_add(1, Ordering::Relaxed);
    sched.ready(id);
}

impl Drop for RenderEngine {
    fn drop(&mut self) {
        lock(&self.inner.state).stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            if t.join().is_err() {
                tracing::error!(engine = %self.name, "gpu engine thread panicked");
            }
        }
    }
}

/// The calling thread's kernel id, after setting its nice value to `nice` if there is one
/// (a failure is logged: the thread runs at the inherited value).
fn set_own_nice(engine: &str, nice: Option<i32>) -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    if let Some(nice) = nice {
        let who = libc::id_t::try_from(tid).unwrap_or(0);
        // SAFETY: setpriority on this thread (PRIO_PROCESS with a thread id is that thread
        // alone on Linux); it touches no memory of ours.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, who, nice) } != 0 {
            tracing::warn!(
                engine,
                nice,
                error = %std::io::Error::last_os_error(),
                "gpu engine: cannot set the engine thread's nice value; it runs at the \
                 inherited one"
            );
        } else {
            tracing::debug!(engine, nice, tid, "gpu engine: thread priority set");
        }
    }
    tid
}

/// How much of the picked lane's work one scheduling step executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Quantum {
    /// One unit: a fetcher's (its own lane's first unit, or a unit ahead of it).
    Unit,
    /// The engine thread's quantum: units of the lane until [`QUANTUM_UNITS`] units or
    /// [`QUANTUM_WORK`] work units (module doc, "Quantum").
    Engine,
}

impl Quantum {
    /// After `units` units that cost `cost`: may the step run another unit of the lane?
    fn more(self, units: u64, cost: u64) -> bool {
        match self {
            Quantum::Unit => false,
            Quantum::Engine => units < QUANTUM_UNITS && cost < QUANTUM_WORK,
        }
    }
}

/// What one scheduling step ([`step`]) did.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// No lane is ready (the state lock was held throughout: wait on `wake` with it).
    NoWork,
    /// The picked lane had nothing to run, or was parked.
    Skipped,
    /// One unit of this lane was executed.
    Ran(LaneId),
}

/// One scheduling step: pick the ready lane with the smallest pass and execute one unit of
/// it without the state lock (the lane is `Running`, out of the ready set, so no other step
/// picks it meanwhile). Whoever calls it — the engine thread or a helping fetcher — the
/// scheduler chooses the lane, so shares and the wake-up bound do not depend on the thread.
fn step<'a>(
    inner: &'a Inner,
    st: MutexGuard<'a, State>,
    quantum: Quantum,
) -> (MutexGuard<'a, State>, Step) {
    step_lane(inner, st, None, quantum)
}

/// [`step`], or with `only` the unit of that lane, which the caller has checked is at the
/// front of the ready set (`StrideScheduler::at_front`).
fn step_lane<'a>(
    inner: &'a Inner,
    mut st: MutexGuard<'a, State>,
    only: Option<LaneId>,
    quantum: Quantum,
) -> (MutexGuard<'a, State>, Step) {
    let picked = match only {
        Some(id) => st.sched.take(id).then_some(id),
        None => st.sched.pick(),
    };
    let Some(id) = picked else {
        return (st, Step::NoWork);
    };
    let units = st.units;
    let Some(lane) = st.lanes.get_mut(&id) else {
        return (st, Step::Skipped);
    };
    let Some(mut work) = lane.work.take() else {
        lane.run = Run::Idle;
        return (st, Step::Skipped);
    };
    let ctx = lane.ctx.clone();
    let Some(exec) = ctx.gate.try_execute() else {
        // Paused or stopped: keep the work, leave the lane out until `kick`.
        lane.work = Some(work);
        lane.run = Run::Parked;
        return (st, Step::Skipped);
    };
    lane.run = Run::Running;
    if let Some(at) = lane.ready_at.take() {
        ctx.shared
            .engine
            .max_wakeup_delay
            .fetch_max(units - at, Ordering::Relaxed);
    }
    drop(st);

    // Units of this lane until its quantum is used (see `Quantum`), the work is done, or
    // a pause or stop asks the lane to halt.
    let (mut cost, mut executed, mut panicked) = (0u64, 0u64, false);
    let done = loop {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            execute::run_unit(&ctx.shared, &ctx.dma, &mut work)
        }));
        let (unit_cost, unit_executed, done) = match outcome {
            Ok(o) => (o.cost, o.executed, o.done),
            Err(_) => {
                tracing::error!(
                    lane = id,
                    "gpu engine: a command panicked; the GPU executes nothing more until it \
                     is reset or re-attached"
                );
                panicked = true;
                (UNIT_BASE_COST, true, true)
            }
        };
        cost = cost.saturating_add(unit_cost);
        if unit_executed {
            executed += 1;
            let counters = &ctx.shared.engine;
            counters.commands.fetch_add(1, Ordering::Relaxed);
            counters.work.fetch_add(unit_cost, Ordering::Relaxed);
            if only.is_some() {
                counters.fetcher_units.fetch_add(1, Ordering::Relaxed);
            }
        }
        if done || !quantum.more(executed, cost) || ctx.gate.halted() {
            break done;
        }
    };

    let mut st = lock(&inner.state);
    st.units += executed;
    let State { lanes, sched, .. } = &mut *st;
    sched.charge(id, cost);
    let mut ring = false;
    if let Some(lane) = lanes.get_mut(&id) {
        if !done {
            lane.work = Some(work);
            lane.run = Run::Ready;
            sched.ready(id);
        } else {
            lane.run = Run::Idle;
            // After a panic `busy` stays set: the fetcher hands over nothing more (the
            // command would panic again) until a reset discards the lane's work.
            if !panicked {
                ctx.busy.store(false, Ordering::SeqCst);
                ring = true;
            }
        }
    }
    // Under the state lock, after the work is back: a pause that waited for this unit
    // finds the lane's work where `discard` can drop it.
    drop(exec);
    if ring {
        // Not under the state lock: the woken fetcher (a short slice) may preempt this
        // thread at once, and would then wait for the lock this thread holds while every
        // other fetcher's submit waits too — for as long as this thread waits for a CPU
        // again (ms on a busy host; measured with `umdev bench instances --busy-threads`).
        drop(st);
        ctx.ring_fetcher();
        st = lock(&inner.state);
    }
    (st, Step::Ran(id))
}

/// The engine thread: scheduling steps while a lane is ready.
fn run(inner: &Inner) {
    let mut st = lock(&inner.state);
    loop {
        if st.stop {
            break;
        }
        if st.thread_holds > 0 {
            st = inner.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        let (next, done) = step(inner, st, Quantum::Engine);
        st = next;
        if done == Step::NoWork {
            st = inner.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
    tracing::debug!("gpu engine stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_quantum_is_one_unit_for_fetchers_and_ends_at_the_unit_or_work_limit() {
        assert!(!Quantum::Unit.more(1, UNIT_BASE_COST));
        assert!(Quantum::Engine.more(1, UNIT_BASE_COST));
        assert!(Quantum::Engine.more(QUANTUM_UNITS - 1, QUANTUM_WORK - 1));
        assert!(!Quantum::Engine.more(QUANTUM_UNITS, UNIT_BASE_COST * QUANTUM_UNITS));
        // The unit that reaches the work limit is the last, however few units ran.
        assert!(!Quantum::Engine.more(1, QUANTUM_WORK));
    }

    #[test]
    fn test_fetcher_slice_defaults_to_the_framework_s_and_can_be_turned_off() {
        let engine = RenderEngine::new("t");
        assert_eq!(engine.fetcher_slice(), Some(DEFAULT_FETCHER_SLICE));
        assert_eq!(DEFAULT_FETCHER_SLICE, umdev::server::DEFAULT_THREAD_SLICE);
        engine.set_fetcher_slice(None);
        assert_eq!(engine.fetcher_slice(), None);
    }
}
