//! A GPU's own half of command execution: the fetcher thread, woken by the doorbell (a
//! `RING_TAIL` write), reads the published commands from the ring and hands them to the
//! render engine (`engine.rs`), which executes them one command per unit (`execute.rs`).
//! The connection thread never draws, and never waits for the client.
//!
//! # Units of work and quiescing
//!
//! The GPU's work is done in *units*: one ring fetch (the DMA reads of `[head, tail)`, by
//! the fetcher), or one command (decode, execute — pins, DMA, framebuffer writes — and its
//! completion: `RING_HEAD`, `FENCE_VALUE`, `IRQ_STATUS`, the error registers, the
//! interrupt; or the `RING_FAULT` of a failed fetch; by the engine). A unit is never cut in
//! half: its register effects are committed under the register lock together with the
//! ring-generation check, so a command either completes as a whole or leaves no trace in
//! the registers. The fetcher fetches only when the engine has finished what it fetched
//! before, so the fetch starts at an exact `RING_HEAD`, as it did when one thread did both.
//!
//! [`Worker::quiesce`] asks both the fetcher and the engine to stop at the next unit
//! boundary *of this GPU* and waits until they have; the [`Quiesced`] guard it returns lets
//! them go on when dropped. **Invariant: while a `Quiesced` guard lives, no unit of this
//! GPU runs: no register change, no interrupt, no framebuffer byte written, no DMA access
//! (no pin, no `dma.read`/`write`, so no DMA_READ/DMA_WRITE on the wire).** Everything
//! done before is complete when `quiesce` returns. The engine meanwhile serves the other
//! GPUs on it: it parks this GPU's lane instead of waiting ([`Gate::try_execute`]). This is
//! what DEVICE_RESET needs (no completion of old work may show after the reset reply; the
//! reset also drops the work the engine holds for this GPU, [`Quiesced::discard_work`])
//! and what live migration's STOP needs (no DMA, no interrupt, no state change after
//! STOP is acknowledged; the commands not yet executed stay published in the ring,
//! `RING_HEAD` says where to resume): a stopped GPU keeps an owned [`Hold`] from STOP
//! until RUNNING (`migration/`). A long ring stops at the next command boundary, it does
//! not run to its end.
//!
//! Why waiting is safe: `quiesce` runs on the server's connection thread, which holds the
//! device lock but none of the locks in [`Shared`] (the caller must not hold them either),
//! and neither the fetcher nor the engine ever takes the device lock. An engine unit never
//! waits for a client (`execute.rs`), so the wait for it is short. The one thing the
//! fetcher can wait for is the client: a DMA read of fd-less memory is a server→client
//! DMA_READ whose reply must come in over the socket. The connection thread does not hold
//! the socket's read side while it calls the device (`umdev::server` channel:
//! leader/follower reading), so the waiting fetcher reads and routes its own reply (or the
//! twin-socket reader does). A client that never answers is bounded by the server's remote
//! DMA timeout (`remote_dma_timeout`, per DMA_READ piece): the read fails, the unit ends,
//! the fetcher stops. A client that cannot answer because it waits for our reply (QEMU
//! serves server requests in a main-loop bottom half, which does not run while it waits for
//! the DEVICE_RESET reply) does not stall the reset: the server cancels outstanding
//! requests for the duration of DEVICE_RESET (`protocol-docs/server-dma.md`), the fetch
//! fails with a cancellation, which the fetcher does not report as a guest error, and the
//! unit ends at once. Pin calls, pixel copies and fd-backed DMA do not wait for anyone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use umdev::dma::DmaHandle;

use super::engine::{LaneCtx, LaneId, RenderEngine};
use super::execute::{Batch, Work};
use super::gtt::lock;
use super::ring;
use super::state::Shared;

/// How often a long `quiesce` wait is logged (it does not give up: the wait is bounded by
/// the remote DMA timeout, see the module doc).
const QUIESCE_LOG_INTERVAL: Duration = Duration::from_secs(2);

/// Handle to the GPU's fetcher thread and its lane on the render engine; dropping it stops
/// and joins the fetcher and takes the lane off the engine.
pub struct Worker {
    doorbell: Sender<()>,
    gate: Arc<Gate>,
    engine: Arc<RenderEngine>,
    lane: LaneId,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Put the GPU on `engine` with `weight` and start its fetcher.
    pub fn spawn(
        shared: Arc<Shared>,
        dma: DmaHandle,
        engine: &Arc<RenderEngine>,
        weight: u32,
    ) -> std::io::Result<Worker> {
        // One pending doorbell is enough: the fetcher always reads the latest tail.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let gate = Arc::new(Gate::default());
        let ctx = Arc::new(LaneCtx {
            shared,
            dma,
            gate: gate.clone(),
            doorbell: tx.clone(),
            busy: AtomicBool::new(false),
        });
        let lane = engine.register(ctx.clone(), weight)?;
        let fetcher = Fetcher {
            ctx,
            engine: engine.clone(),
            lane,
        };
        let thread = match std::thread::Builder::new()
            .name("umdev-gpu-fetch".into())
            .spawn(move || fetcher.run(rx))
        {
            Ok(t) => t,
            Err(e) => {
                gate.stop();
                engine.unregister(lane);
                return Err(e);
            }
        };
        Ok(Worker {
            doorbell: tx,
            gate,
            engine: engine.clone(),
            lane,
            thread: Some(thread),
        })
    }

    /// Ring the doorbell (never blocks).
    pub fn doorbell(&self) {
        match self.doorbell.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) => {}
            Err(TrySendError::Disconnected(())) => {
                tracing::warn!("gpu: fetcher thread is gone")
            }
        }
    }

    /// Stop the GPU's work at the next unit boundary and wait until it has stopped (see the
    /// module doc for what is then left alone, and why the wait ends). Nested calls are
    /// allowed; the work goes on when the last guard is dropped. The caller must not hold a
    /// lock of [`Shared`].
    pub fn quiesce(&self) -> Quiesced<'_> {
        self.gate.pause();
        Quiesced { worker: self }
    }

    /// [`Worker::quiesce`] with an owned guard: the same wait and the same guarantee, but
    /// the [`Hold`] does not borrow the worker, so a device can keep its work stopped
    /// across calls (migration: from STOP until RUNNING). The caller must not hold a lock
    /// of [`Shared`].
    pub fn hold(&self) -> Hold {
        self.gate.pause();
        Hold {
            gate: self.gate.clone(),
            engine: self.engine.clone(),
            lane: self.lane,
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.gate.stop();
        // Wake the fetcher if it waits for a doorbell: it finds the gate stopped and exits.
        self.doorbell();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("gpu: fetcher thread panicked");
            }
        }
        // The engine starts no unit of a stopped lane; wait for one in progress.
        self.gate.pause();
        self.engine.unregister(self.lane);
    }
}

/// Proof that the GPU's work is quiescent; dropping it lets the work go on.
#[must_use = "the work resumes as soon as the guard is dropped"]
pub struct Quiesced<'a> {
    worker: &'a Worker,
}

impl Quiesced<'_> {
    /// Drop the work the engine holds for this GPU (fetched, not executed yet). A reset
    /// does this: work fetched before it must not run after it. (The ring generation
    /// would make the engine drop it anyway; this frees it now.)
    pub fn discard_work(&self) {
        self.worker.engine.discard(self.worker.lane);
    }
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.worker.gate.resume();
        self.worker.engine.kick(self.worker.lane);
    }
}

/// Proof that the GPU's work is quiescent, owned (see [`Worker::hold`]); dropping it lets
/// the work go on. A hold that outlives its worker is harmless: the worker's gate is
/// stopped for good and its lane is gone, so dropping the hold releases nothing.
#[must_use = "the work resumes as soon as the hold is dropped"]
pub struct Hold {
    gate: Arc<Gate>,
    engine: Arc<RenderEngine>,
    lane: LaneId,
}

impl Hold {
    /// As [`Quiesced::discard_work`].
    pub fn discard_work(&self) {
        self.engine.discard(self.lane);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.gate.resume();
        self.engine.kick(self.lane);
    }
}

/// Where the GPU's two executors stand, shared with the connection thread.
#[derive(Debug, Default)]
struct GateState {
    /// Live [`Quiesced`] guards.
    holds: u32,
    /// The fetcher is inside a unit of work ([`Gate::enter`] .. [`Busy`] dropped).
    fetching: bool,
    /// The engine is inside a unit of this GPU ([`Gate::try_execute`] .. dropped).
    executing: bool,
    /// The fetcher must exit, the engine must not start another unit.
    stop: bool,
}

/// The pause/stop gate between the connection thread, the fetcher and the engine.
#[derive(Debug, Default)]
pub(super) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    /// `holds > 0 || stop`, readable without the lock at every unit boundary.
    halt: AtomicBool,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        lock(&self.state)
    }

    fn wait<'a>(&self, g: MutexGuard<'a, GateState>) -> MutexGuard<'a, GateState> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// True if the fetcher must leave at this boundary (and the engine end its quantum).
    pub(super) fn halted(&self) -> bool {
        self.halt.load(Ordering::Acquire)
    }

    /// Fetcher: wait while paused, then mark busy. `None` once stopped.
    fn enter(&self) -> Option<Busy<'_>> {
        let mut g = self.lock();
        while g.holds > 0 && !g.stop {
            g = self.wait(g);
        }
        if g.stop {
            return None;
        }
        g.fetching = true;
        Some(Busy {
            gate: self,
            engine: false,
        })
    }

    /// Engine: start a unit unless paused or stopped. Never blocks on a pause.
    pub(super) fn try_execute(&self) -> Option<Busy<'_>> {
        let mut g = self.lock();
        if g.holds > 0 || g.stop {
            return None;
        }
        g.executing = true;
        Some(Busy {
            gate: self,
            engine: true,
        })
    }

    /// Connection thread: ask for a halt and wait until neither the fetcher nor the engine
    /// is inside a unit.
    fn pause(&self) {
        let mut g = self.lock();
        g.holds += 1;
        self.halt.store(true, Ordering::Release);
        let start = Instant::now();
        while g.fetching || g.executing {
            let (next, timeout) = self
                .changed
                .wait_timeout(g, QUIESCE_LOG_INTERVAL)
                .unwrap_or_else(|e| e.into_inner());
            g = next;
            if timeout.timed_out() && (g.fetching || g.executing) {
                tracing::warn!(
                    waited = ?start.elapsed(),
                    fetching = g.fetching,
                    executing = g.executing,
                    "gpu: still waiting for a unit of work to finish"
                );
            }
        }
    }

    /// Drop one pause hold.
    fn resume(&self) {
        let mut g = self.lock();
        g.holds = g.holds.saturating_sub(1);
        if g.holds == 0 && !g.stop {
            self.halt.store(false, Ordering::Release);
        }
        drop(g);
        self.changed.notify_all();
    }

    /// Make the fetcher exit at its next boundary (or right away if it waits) and the
    /// engine start no more units.
    pub(super) fn stop(&self) {
        self.lock().stop = true;
        self.halt.store(true, Ordering::Release);
        self.changed.notify_all();
    }
}

/// A unit of work is in progress; dropping (also when unwinding from a panic) marks it
/// finished, so a `quiesce` never waits for a dead thread.
pub(super) struct Busy<'a> {
    gate: &'a Gate,
    engine: bool,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut g = self.gate.lock();
        if self.engine {
            g.executing = false;
        } else {
            g.fetching = false;
        }
        // Only `pause` waits for the end of a unit, and it holds the gate (`holds > 0`)
        // while it does: no wake-up call (a syscall, under the engine's state lock) for
        // every other unit.
        let waited = g.holds > 0;
        drop(g);
        if waited {
            self.gate.changed.notify_all();
        }
    }
}

/// How `drain` ended.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    /// Nothing to fetch: nothing published, the ring is off, or the engine still holds
    /// the previous fetch (it rings the doorbell when it has finished it).
    Idle,
    /// Stopped at a unit boundary because the gate halted.
    Halted,
}

/// The fetcher thread's state.
struct Fetcher {
    ctx: Arc<LaneCtx>,
    engine: Arc<RenderEngine>,
    lane: LaneId,
}

impl Fetcher {
    fn run(self, rx: Receiver<()>) {
        // A latency path: a short slice, so that a doorbell on a busy host does not wait a
        // CPU-bound thread's slice (engine.rs, "Priority").
        if let Some(slice) = self.engine.fetcher_slice() {
            if let Err(e) = umdev::server::set_thread_slice(slice) {
                tracing::debug!(error = %e, ?slice, "gpu: the fetcher's time slice was refused");
            }
        }
        'doorbells: while rx.recv().is_ok() {
            loop {
                let Some(busy) = self.ctx.gate.enter() else {
                    break 'doorbells;
                };
                let drained = self.drain();
                drop(busy);
                if drained == Drained::Idle {
                    break;
                }
                // Halted: wait in `enter` until resumed (or stopped), then go on from
                // RING_HEAD without needing another doorbell.
            }
        }
        tracing::debug!("gpu: fetcher stopped");
    }

    /// Fetch the published commands `[head, tail)` and hand them to the engine, unless it
    /// still holds an earlier fetch; one unit per fetch, checking the gate between units.
    fn drain(&self) -> Drained {
        loop {
            if self.ctx.gate.halted() {
                return Drained::Halted;
            }
            if self.ctx.busy.load(Ordering::SeqCst) {
                return Drained::Idle;
            }
            let (ring, gen) = {
                let regs = lock(&self.ctx.shared.regs);
                if regs.idle() {
                    self.ctx.shared.idle.notify_all();
                    return Drained::Idle;
                }
                (regs.ring, regs.ring_gen)
            };
            let mut dwords = Vec::new();
            let work = match ring::fetch(&self.ctx.dma, &ring, &mut dwords) {
                Ok(()) => Work::Batch(Batch {
                    gen,
                    start: ring.head,
                    mask: ring.size - 1,
                    dwords,
                    pos: 0,
                }),
                Err(e) if e.is_cancelled() => {
                    // The server cut the fetch short (a reset is quiescing us, or the ring
                    // is being unmapped): not the guest's fault, so no RING_FAULT and no
                    // interrupt. Stop if halted; otherwise fetch again, which fails for
                    // real once the ring is gone.
                    if self.ctx.gate.halted() {
                        return Drained::Halted;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, base = ring.base, "gpu: ring fetch failed");
                    Work::Fault {
                        gen,
                        at: ring.head,
                        tail: ring.tail,
                    }
                }
            };
            // Executes the first unit at once if the scheduler picks this lane next
            // (engine.rs, "Who executes").
            self.engine.submit(self.lane, work);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_gate_quiesce_waits_for_unit_and_holds_worker_until_resumed() {
        let gate = Arc::new(Gate::default());
        let busy = gate.enter().expect("not stopped");
        let g2 = gate.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let pauser = std::thread::spawn(move || {
            g2.pause();
            tx.send(()).unwrap();
            g2
        });
        // The worker is told to halt at its next boundary, and the pause waits for the
        // unit in progress.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gate.halted() {
            assert!(Instant::now() < deadline, "pause never started");
            std::thread::yield_now();
        }
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        drop(busy);
        rx.recv_timeout(Duration::from_secs(5))
            .expect("pause returned");
        let g2 = pauser.join().unwrap();
        // While paused the worker cannot start a unit.
        let g3 = gate.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let worker = std::thread::spawn(move || {
            let entered = g3.enter().is_some();
            tx.send(entered).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        g2.resume();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
        worker.join().unwrap();
        assert!(!gate.halted());
    }

    #[test]
    fn test_gate_nested_pauses_resume_after_last() {
        let gate = Gate::default();
        gate.pause();
        gate.pause();
        gate.resume();
        assert!(gate.halted(), "one hold left");
        gate.resume();
        assert!(!gate.halted());
        assert!(gate.enter().is_some());
    }

    #[test]
    fn test_gate_stop_releases_paused_worker() {
        let gate = Arc::new(Gate::default());
        gate.pause();
        let g2 = gate.clone();
        let worker = std::thread::spawn(move || g2.enter().is_none());
        std::thread::sleep(Duration::from_millis(10));
        gate.stop();
        assert!(worker.join().unwrap(), "a stopped gate lets nobody in");
        gate.resume();
        assert!(gate.halted(), "stop is final");
    }
}
