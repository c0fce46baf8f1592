//! The worker thread: woken by the doorbell (a `RING_TAIL` write), it fetches the published
//! commands from the ring and executes them in order, so the connection thread never draws.
//!
//! # Units of work and quiescing
//!
//! The worker works in *units*: one ring fetch (the DMA reads of `[head, tail)`, or the
//! `RING_FAULT` it records), or one command (decode, execute — pins, DMA, framebuffer
//! writes — and its completion: `RING_HEAD`, `FENCE_VALUE`, `IRQ_STATUS`, the error
//! registers, the interrupt). A unit is never cut in half: its register effects are
//! committed under the register lock together with the ring-generation check, so a command
//! either completes as a whole or leaves no trace in the registers.
//!
//! [`Worker::quiesce`] asks the worker to stop at the next unit boundary and waits until it
//! has; the [`Quiesced`] guard it returns lets the worker go on when dropped. **Invariant:
//! while a `Quiesced` guard lives, the worker changes no register, raises no interrupt,
//! writes no framebuffer byte, and makes no DMA access (no pin, no `dma.read`/`write`, so
//! no DMA_READ/DMA_WRITE on the wire).** Everything it did before is complete when
//! `quiesce` returns. This is what DEVICE_RESET needs (no completion of old work may
//! show after the reset reply) and what live migration's STOP will need (no DMA, no
//! interrupt, no state change after STOP is acknowledged; the commands not yet executed
//! stay published in the ring, `RING_HEAD` says where to resume). A long ring stops at the
//! next command boundary, it does not run to its end; commands the worker had fetched but
//! not started are fetched again after the pause, from `RING_HEAD`.
//!
//! Why waiting is safe: `quiesce` runs on the server's connection thread, which holds the
//! device lock but none of the locks in [`Shared`] (the caller must not hold them either),
//! and the worker never takes the device lock. The one thing the worker can wait for is
//! the client: a DMA read of fd-less memory is a server→client DMA_READ whose reply must
//! come in over the socket. The connection thread does not hold the socket's read side
//! while it calls the device (`umdev::server` channel: leader/follower reading), so the
//! waiting worker reads and routes its own reply (or the twin-socket reader does). A client
//! that never answers is bounded by the server's remote DMA timeout (`remote_dma_timeout`,
//! per DMA_READ piece): the read fails, the unit ends, the worker stops. A client that
//! cannot answer because it waits for our reply (QEMU serves server requests in a
//! main-loop bottom half, which does not run while it waits for the DEVICE_RESET reply)
//! does not stall the reset: the server cancels outstanding requests for the duration of
//! DEVICE_RESET (`protocol-docs/server-dma.md`), the fetch fails with a cancellation,
//! which the worker does not report as a guest error, and the unit ends at once. Pin
//! calls, pixel copies and fd-backed DMA do not wait for anyone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use umdev::dma::DmaHandle;

use super::commands::{Command, DecodeError};
use super::error::{GpuError, ERR_RING_FAULT};
use super::gtt::lock;
use super::regs::IRQ_FENCE;
use super::render;
use super::ring;
use super::state::Shared;

/// How often a long `quiesce` wait is logged (it does not give up: the wait is bounded by
/// the remote DMA timeout, see the module doc).
const QUIESCE_LOG_INTERVAL: Duration = Duration::from_secs(2);

/// Handle to the worker thread; dropping it stops and joins the thread.
pub struct Worker {
    doorbell: Option<Sender<()>>,
    gate: Arc<Gate>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Start the worker.
    pub fn spawn(shared: Arc<Shared>, dma: DmaHandle) -> std::io::Result<Worker> {
        // One pending doorbell is enough: the worker always reads the latest tail.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let gate = Arc::new(Gate::default());
        let ctx = Ctx {
            shared,
            dma,
            gate: gate.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("umdev-gpu-worker".into())
            .spawn(move || ctx.run(rx))?;
        Ok(Worker {
            doorbell: Some(tx),
            gate,
            thread: Some(thread),
        })
    }

    /// Ring the doorbell (never blocks).
    pub fn doorbell(&self) {
        if let Some(tx) = &self.doorbell {
            match tx.try_send(()) {
                Ok(()) | Err(TrySendError::Full(())) => {}
                Err(TrySendError::Disconnected(())) => {
                    tracing::warn!("gpu: worker thread is gone")
                }
            }
        }
    }

    /// Stop the worker at the next unit boundary and wait until it has stopped (see the
    /// module doc for what it then leaves alone, and why the wait ends). Nested calls are
    /// allowed; the worker goes on when the last guard is dropped. The caller must not
    /// hold a lock of [`Shared`].
    pub fn quiesce(&self) -> Quiesced<'_> {
        self.gate.pause();
        Quiesced { gate: &self.gate }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.gate.stop();
        self.doorbell = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("gpu: worker thread panicked");
            }
        }
    }
}

/// Proof that the worker is quiescent; dropping it lets the worker go on.
#[must_use = "the worker resumes as soon as the guard is dropped"]
pub struct Quiesced<'a> {
    gate: &'a Gate,
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.gate.resume();
    }
}

/// Where the worker stands, shared with the connection thread.
#[derive(Debug, Default)]
struct GateState {
    /// Live [`Quiesced`] guards.
    holds: u32,
    /// The worker is inside a unit of work ([`Gate::enter`] .. [`Busy`] dropped).
    busy: bool,
    /// The worker must exit.
    stop: bool,
}

/// The pause/stop gate between the connection thread and the worker.
#[derive(Debug, Default)]
struct Gate {
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

    /// True if the worker must leave at this boundary.
    fn halted(&self) -> bool {
        self.halt.load(Ordering::Acquire)
    }

    /// Worker: wait while paused, then mark busy. `None` once stopped.
    fn enter(&self) -> Option<Busy<'_>> {
        let mut g = self.lock();
        while g.holds > 0 && !g.stop {
            g = self.wait(g);
        }
        if g.stop {
            return None;
        }
        g.busy = true;
        Some(Busy { gate: self })
    }

    /// Connection thread: ask for a halt and wait until the worker is outside a unit.
    fn pause(&self) {
        let mut g = self.lock();
        g.holds += 1;
        self.halt.store(true, Ordering::Release);
        let start = Instant::now();
        while g.busy {
            let (next, timeout) = self
                .changed
                .wait_timeout(g, QUIESCE_LOG_INTERVAL)
                .unwrap_or_else(|e| e.into_inner());
            g = next;
            if timeout.timed_out() && g.busy {
                tracing::warn!(
                    waited = ?start.elapsed(),
                    "gpu: still waiting for the worker to finish its unit of work"
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

    /// Make the worker exit at its next boundary (or right away if it waits).
    fn stop(&self) {
        self.lock().stop = true;
        self.halt.store(true, Ordering::Release);
        self.changed.notify_all();
    }
}

/// The worker is inside a unit of work; dropping (also when unwinding from a panic) marks
/// it outside, so a `quiesce` never waits for a dead thread.
struct Busy<'a> {
    gate: &'a Gate,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.gate.lock().busy = false;
        self.gate.changed.notify_all();
    }
}

/// How `drain` ended.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    /// Nothing published is left (or the ring is off).
    Idle,
    /// Stopped at a unit boundary because the gate halted.
    Halted,
}

/// What a successfully executed command asks the completion step to do.
#[derive(Debug, PartialEq, Eq)]
enum Effect {
    None,
    /// FENCE: store the value, set `IRQ_FENCE`.
    Fence(u32),
}

struct Ctx {
    shared: Arc<Shared>,
    dma: DmaHandle,
    gate: Arc<Gate>,
}

impl Ctx {
    fn run(self, rx: Receiver<()>) {
        'doorbells: while rx.recv().is_ok() {
            loop {
                let Some(busy) = self.gate.enter() else {
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
        tracing::debug!("gpu: worker stopped");
    }

    /// Execute published commands until head == tail (or the ring is reconfigured), one
    /// unit at a time, checking the gate between units.
    fn drain(&self) -> Drained {
        let mut dwords = Vec::new();
        loop {
            if self.gate.halted() {
                return Drained::Halted;
            }
            let (ring, gen) = {
                let regs = lock(&self.shared.regs);
                if regs.idle() {
                    self.shared.idle.notify_all();
                    return Drained::Idle;
                }
                (regs.ring, regs.ring_gen)
            };
            if let Err(e) = ring::fetch(&self.dma, &ring, &mut dwords) {
                if e.is_cancelled() {
                    // The server cut the fetch short (a reset is quiescing us, or the ring is
                    // being unmapped): not the guest's fault, so no RING_FAULT and no
                    // interrupt. Stop if halted; otherwise fetch again, which fails for
                    // real once the ring is gone.
                    if self.gate.halted() {
                        return Drained::Halted;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                tracing::warn!(error = %e, base = ring.base, "gpu: ring fetch failed");
                let raise = {
                    let mut regs = lock(&self.shared.regs);
                    if regs.ring_gen != gen {
                        continue;
                    }
                    regs.ring.head = ring.tail;
                    regs.record_error(ERR_RING_FAULT, ring.head)
                };
                self.shared.idle.notify_all();
                if raise {
                    self.shared.raise();
                }
                continue;
            }
            let mask = ring.size as usize - 1;
            let mut pos = 0usize;
            while pos < dwords.len() {
                if self.gate.halted() {
                    return Drained::Halted;
                }
                if lock(&self.shared.regs).ring_gen != gen {
                    break;
                }
                let cmd_off = ((ring.head as usize + pos * 4) & mask) as u32;
                let (advance, result) = match Command::decode(&dwords[pos..]) {
                    Ok((cmd, len)) => {
                        tracing::trace!(?cmd, offset = cmd_off, "gpu: command");
                        (len, self.execute(cmd))
                    }
                    Err(DecodeError { error, skip }) => {
                        (skip.unwrap_or(dwords.len() - pos), Err(error))
                    }
                };
                pos += advance;
                // Completion: every register effect of the command, under one lock and
                // only if the ring is still the one the command came from.
                let raise = {
                    let mut regs = lock(&self.shared.regs);
                    if regs.ring_gen != gen {
                        break;
                    }
                    regs.ring.head = ((ring.head as usize + pos * 4) & mask) as u32;
                    match result {
                        Ok(Effect::None) => false,
                        Ok(Effect::Fence(value)) => {
                            regs.fence = value;
                            regs.set_irq(IRQ_FENCE)
                        }
                        Err(e) => {
                            tracing::warn!(
                                error = e.report(),
                                offset = cmd_off,
                                "gpu: command failed"
                            );
                            regs.record_error(e.code(), cmd_off)
                        }
                    }
                };
                self.shared.idle.notify_all();
                if raise {
                    self.shared.raise();
                }
            }
        }
    }

    /// Execute one command (its framebuffer and DMA work); register effects are returned
    /// for the completion step.
    fn execute(&self, cmd: Command) -> Result<Effect, GpuError> {
        let mode = lock(&self.shared.regs).mode;
        let fb = &self.shared.fb;
        match cmd {
            Command::Nop => return Ok(Effect::None),
            Command::Fence { value } => return Ok(Effect::Fence(value)),
            _ if !mode.enabled => return Err(GpuError::ModeDisabled),
            Command::FillRect { x, y, w, h, color } => {
                render::fill_rect(fb, &mode, (x, y, w, h), color)?
            }
            Command::CopyRect {
                src_x,
                src_y,
                dst_x,
                dst_y,
                w,
                h,
            } => render::copy_rect(fb, &mode, (src_x, src_y), (dst_x, dst_y), (w, h))?,
            Command::Blit {
                gtt_index,
                stride,
                w,
                h,
                dst_x,
                dst_y,
            } => {
                render::check_rect(&mode, dst_x, dst_y, w, h)?;
                let pages = render::surface_pages(stride, w, h)?;
                if pages > 0 {
                    let src = self
                        .shared
                        .gtt
                        .acquire(&self.dma, gtt_index, pages, false)?;
                    render::blit(fb, &mode, &src, stride, (w, h), (dst_x, dst_y))?;
                }
            }
            Command::Readback {
                src_x,
                src_y,
                w,
                h,
                gtt_index,
                stride,
            } => {
                render::check_rect(&mode, src_x, src_y, w, h)?;
                let pages = render::surface_pages(stride, w, h)?;
                if pages > 0 {
                    let dst = self.shared.gtt.acquire(&self.dma, gtt_index, pages, true)?;
                    render::readback(fb, &mode, (src_x, src_y), (w, h), &dst, stride)?;
                }
            }
        }
        Ok(Effect::None)
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
