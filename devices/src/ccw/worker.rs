//! The worker thread that runs channel programs, and the state it shares with the
//! connection thread.
//!
//! The START doorbell (connection thread) only queues a [`Job`] on a crossbeam channel; the
//! worker reads the operation block, validates the whole program, pins its pages, runs the
//! I/O, unpins, stores the status block and interrupts. The connection thread synchronises
//! with it through [`Flight`] (what phase the current program is in, and which pages it
//! pins), so that DMA unmap, reset and disconnect can abort it and wait until it holds no
//! pins.
//!
//! **Stopping for migration** ([`Flight::stopping`], set by the device's `Migrate::stop`,
//! `migration.rs`): the worker finishes the program it is executing (pinned, image I/O
//! under way) but starts nothing, and hands back to the device, as a [`Task`] in
//! [`Flight::set_aside`], whatever has not happened yet:
//!
//! - a job it receives, or a program still validating (nothing of a program happens before
//!   its pages are pinned: it only read guest memory) — `Task::Start`, run again from the
//!   operation block after RUNNING; a guest read the server cancels for the stop ends the
//!   validation at once instead of being retried;
//! - the completion of a program that ran (status block, registers, interrupt) —
//!   `Task::Deliver`, delivered after RUNNING; also when storing the status block was a
//!   server→client DMA_WRITE the server cancelled for the stop.
//!
//! A completion the worker started to deliver before it saw the stop is delivered whole
//! (the interrupt included) before the program's phase goes back to `Idle`, which is what
//! the stop waits for. So the guest sees each program complete exactly once: before STOP,
//! or after RUNNING (on the destination, if the device migrated).

use std::cell::Cell;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use umdev::dma::{DmaError, DmaHandle};
use umdev::irq::Interrupts;

use super::format::{opb_flags, OperationBlock, BLOCK_SIZE, OPB_ALIGN, OPB_SIZE};
use super::io::{execute, unit_check_sense, Completion, SenseData};
use super::pins::{range_intersects, PinFailure, PinnedPages, ProgramPages};
use super::program::{parse, GuestRead, ParseLimits};
use super::regs::{IRQ_DONE, IRQ_STATUS_LOST};
use super::status::{Fault, StatusBlock, STATUS_BLOCK_SIZE};

/// How long reset/unmap/disconnect wait for the worker before giving up (and logging).
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(3);

/// One job for the worker.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// What to do.
    pub task: Task,
    /// The reset epoch the job was submitted in.
    pub epoch: u64,
}

/// What a job asks of the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// Run the operation block at this guest address (a START).
    Start {
        /// Guest address of the operation block.
        opb_addr: u64,
    },
    /// Deliver the completion of a program that ran before a migration stop.
    Deliver(Captured),
}

/// The completion of a program that ran but was not delivered because the device was
/// stopping: what the status block says, and where it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Captured {
    /// Where to store the status block (`None`: no usable status block; the completion
    /// sets `IRQ_STATUS_LOST`).
    pub status_addr: Option<u64>,
    /// How the program ended.
    pub done: Completion,
}

/// The phase of the program the worker is running.
#[derive(Debug, Default)]
pub enum Phase {
    /// No program running.
    #[default]
    Idle,
    /// Reading and validating (no pins held).
    Validating,
    /// The pages (sorted, deduplicated pfns) are pinned or about to be.
    Pinned(Vec<u64>),
    /// Pins released; storing status.
    Finishing,
}

/// Synchronisation state between the worker and the connection thread.
#[derive(Debug, Default)]
pub struct Flight {
    /// Current phase.
    pub phase: Phase,
    /// Reset epoch; a job or finished program from an older epoch is discarded silently.
    pub epoch: u64,
    /// Stop the current program as soon as possible (status: [`Fault::Aborted`]).
    pub abort: bool,
    /// Ranges unmapped while the program was validating.
    pub unmapped: Vec<(u64, u64)>,
    /// The device is stopping or stopped for migration: start nothing, deliver nothing
    /// (see the module doc).
    pub stopping: bool,
    /// What the worker set aside because of `stopping`; the device takes it.
    pub set_aside: Option<Task>,
}

/// State shared by the device (connection thread) and its worker.
#[derive(Debug, Default)]
pub struct Shared {
    /// STATUS.BUSY.
    pub busy: AtomicBool,
    /// IRQ_STATUS.
    pub irq_status: AtomicU32,
    /// LAST_STATUS.
    pub last_status: AtomicU32,
    /// COMPLETED.
    pub completed: AtomicU32,
    /// Page entries currently pinned by this device.
    pub pins_held: Arc<AtomicU64>,
    /// Sense bytes of the last unit check.
    pub sense: Mutex<SenseData>,
    /// Phase of the running program.
    pub flight: Mutex<Flight>,
    /// Signalled on every phase change.
    pub flight_cv: Condvar,
}

impl Shared {
    /// Lock the flight state (a poisoned lock is recovered: the state stays consistent
    /// because every update is a single assignment).
    pub fn flight(&self) -> MutexGuard<'_, Flight> {
        self.flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sense(&self) -> MutexGuard<'_, SenseData> {
        self.sense.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_phase(&self, phase: Phase) {
        self.flight().phase = phase;
        self.flight_cv.notify_all();
    }

    /// Wait (bounded) until `done(&flight)` holds. Returns false on timeout.
    pub fn wait_until(&self, mut done: impl FnMut(&Flight) -> bool) -> bool {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        let mut f = self.flight();
        while !done(&f) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            f = match self.flight_cv.wait_timeout(f, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// DMA unmap of `[iova, iova+size)`: abort the running program if it pins pages in
    /// the range and wait until it released them; remember the range if it is still
    /// validating so it never pins there.
    pub fn unmap(&self, iova: u64, size: u64) {
        {
            let mut f = self.flight();
            match &f.phase {
                Phase::Idle | Phase::Finishing => return,
                Phase::Validating => {
                    f.unmapped.push((iova, size));
                    return;
                }
                Phase::Pinned(pfns) => {
                    if !range_intersects(pfns, iova, size) {
                        return;
                    }
                    f.abort = true;
                }
            }
        }
        self.flight_cv.notify_all();
        let released = self.wait_until(|f| !matches!(f.phase, Phase::Pinned(_)));
        if !released {
            tracing::warn!(iova, size, "ccw: program did not release its pins in time");
        }
    }

    /// Reset / disconnect: discard the running program (no status, no interrupt), wait for
    /// the worker to go idle, and drop queued jobs.
    pub fn cancel_all(&self, queue: Option<&Receiver<Job>>) {
        {
            let mut f = self.flight();
            f.epoch = f.epoch.wrapping_add(1);
            f.abort = true;
            f.set_aside = None;
        }
        self.flight_cv.notify_all();
        if !self.wait_until(|f| matches!(f.phase, Phase::Idle)) {
            tracing::warn!("ccw: worker did not stop in time");
        }
        if let Some(rx) = queue {
            while rx.try_recv().is_ok() {}
        }
        self.busy.store(false, Ordering::SeqCst);
    }

    /// The current reset epoch.
    pub fn epoch(&self) -> u64 {
        self.flight().epoch
    }
}

/// How long a cancelled guest read is retried while its job is still current (a
/// cancellation lasts for one DEVICE_RESET or DMA_UNMAP, normally microseconds).
const CANCELLED_RETRY_LIMIT: Duration = Duration::from_secs(5);

/// Everything the worker needs.
pub struct Worker {
    /// Shared state.
    pub shared: Arc<Shared>,
    /// DMA.
    pub dma: DmaHandle,
    /// Interrupts.
    pub irq: Interrupts,
    /// The image.
    pub image: Arc<File>,
    /// Capacity in bytes.
    pub capacity: u64,
    /// CCW limit.
    pub max_ccws: usize,
}

/// Guest reads of the program walk; remembers whether a read was refused because Bus Master
/// Enable is clear, so that the walk's "unreadable" fault can be reported as what it is.
struct DmaReader<'a> {
    worker: &'a Worker,
    epoch: u64,
    bus_master_off: Cell<bool>,
}

impl GuestRead for DmaReader<'_> {
    fn read_guest(&self, addr: u64, buf: &mut [u8]) -> bool {
        match self.worker.read(self.epoch, addr, buf) {
            Ok(()) => true,
            Err(DmaError::BusMasterDisabled { .. }) => {
                self.bus_master_off.set(true);
                false
            }
            Err(_) => false,
        }
    }
}

/// The fault for a failed guest read: [`Fault::BusMasterOff`] if Bus Master Enable is clear,
/// `otherwise` for any other DMA error.
fn read_fault(e: &DmaError, otherwise: Fault) -> Fault {
    match e {
        DmaError::BusMasterDisabled { .. } => Fault::BusMasterOff,
        _ => otherwise,
    }
}

/// Outcome of one job before status is stored.
struct Ending {
    done: Completion,
    /// Where to store the status block (None: unknown or unusable).
    status_addr: Option<u64>,
    /// The program got past validation (its pages were registered for pinning): it did,
    /// or tried to do, something. A program that did not can be run again from scratch.
    executed: bool,
}

fn fail(fault: Fault, ccw_addr: u64, residual: u16) -> Completion {
    Completion {
        fault,
        ccw_addr,
        residual,
        transferred: 0,
        image_offset: 0,
    }
}

impl Worker {
    /// Run jobs until the channel closes.
    pub fn run(self, rx: Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.run_job(job);
        }
        tracing::debug!("ccw: worker exits");
    }

    fn run_job(&self, job: Job) {
        {
            let mut f = self.shared.flight();
            if f.epoch != job.epoch {
                return;
            }
            if f.stopping {
                f.set_aside = Some(job.task);
                drop(f);
                self.shared.flight_cv.notify_all();
                return;
            }
            f.phase = match job.task {
                Task::Start { .. } => Phase::Validating,
                Task::Deliver(_) => Phase::Finishing,
            };
            f.abort = false;
            f.unmapped.clear();
        }
        let ending = match job.task {
            Task::Start { opb_addr } => {
                let ending = self.program(job.epoch, opb_addr);
                {
                    let mut f = self.shared.flight();
                    if !ending.executed && f.stopping && f.epoch == job.epoch {
                        // Nothing happened yet: run it again after RUNNING.
                        f.set_aside = Some(job.task);
                        f.phase = Phase::Idle;
                        drop(f);
                        self.shared.flight_cv.notify_all();
                        return;
                    }
                }
                let done = ending.done;
                if matches!(done.fault, Fault::OutOfRange | Fault::ImageIo) {
                    *self.shared.sense() = unit_check_sense(done.fault, done.image_offset);
                }
                ending
            }
            Task::Deliver(c) => Ending {
                done: c.done,
                status_addr: c.status_addr,
                executed: true,
            },
        };
        self.finish(job.epoch, ending);
    }

    /// While stopping: keep the completion for the device instead of delivering it.
    /// Returns false if not stopping (or the job is stale: then it is dropped).
    fn capture(&self, epoch: u64, ending: &Ending) -> bool {
        let mut f = self.shared.flight();
        if !f.stopping {
            return false;
        }
        if f.epoch == epoch {
            f.set_aside = Some(Task::Deliver(Captured {
                status_addr: ending.status_addr,
                done: ending.done,
            }));
        }
        f.phase = Phase::Idle;
        drop(f);
        self.shared.flight_cv.notify_all();
        true
    }

    /// A guest read for the job of `epoch`. A read the server cancelled (it waits for the
    /// client during DEVICE_RESET, or the range is being unmapped) is not the guest's
    /// fault: retry until it goes through, fails for real (after an unmap: not mapped), or
    /// the job is discarded by a reset (then its ending is dropped in `finish`).
    fn read(&self, epoch: u64, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let deadline = Instant::now() + CANCELLED_RETRY_LIMIT;
        loop {
            match self.dma.read(addr, buf) {
                Err(e)
                    if e.is_cancelled()
                        && self.shared.epoch() == epoch
                        && !self.shared.flight().stopping
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => return r,
            }
        }
    }

    /// Read the operation block, validate, pin, run, unpin.
    fn program(&self, epoch: u64, opb_addr: u64) -> Ending {
        let lost = |fault| Ending {
            done: fail(fault, 0, 0),
            status_addr: None,
            executed: false,
        };
        if opb_addr & (OPB_ALIGN - 1) != 0 {
            return lost(Fault::OpBlockUnaligned);
        }
        let mut raw = [0u8; OPB_SIZE];
        if let Err(e) = self.read(epoch, opb_addr, &mut raw) {
            return lost(read_fault(&e, Fault::OpBlockUnreadable));
        }
        let opb = OperationBlock::from_bytes(&raw);
        let mut probe = [0u8; STATUS_BLOCK_SIZE];
        if let Err(e) = self.read(epoch, opb.status, &mut probe) {
            return lost(read_fault(&e, Fault::StatusBlockInvalid));
        }
        let status_addr = Some(opb.status);
        let ending = |done| Ending {
            done,
            status_addr,
            executed: false,
        };
        if opb.flags & opb_flags::RESERVED != 0 || opb.reserved != 0 {
            return ending(fail(Fault::OpBlockReserved, opb.program, 0));
        }
        let Some(start) = opb.block.checked_mul(BLOCK_SIZE) else {
            return ending(fail(Fault::OutOfRange, opb.program, 0));
        };
        let limits = ParseLimits {
            max_ccws: self.max_ccws,
            start_offset: start,
            capacity: self.capacity,
        };
        let reader = DmaReader {
            worker: self,
            epoch,
            bus_master_off: Cell::new(false),
        };
        let program = match parse(&reader, opb.program, &limits) {
            Ok(p) => p,
            Err(e) => {
                let fault = if reader.bus_master_off.get() {
                    Fault::BusMasterOff
                } else {
                    e.fault
                };
                let mut done = fail(fault, e.ccw_addr, e.residual);
                done.image_offset = start;
                return ending(done);
            }
        };
        let pages = ProgramPages::collect(&program);

        // Register the pages before pinning so that an unmap racing with us either sees
        // them (and waits) or was recorded while we validated (and we stop here).
        {
            let mut f = self.shared.flight();
            let pfns = pages.sorted_pfns();
            let hit = f
                .unmapped
                .iter()
                .any(|&(iova, size)| range_intersects(&pfns, iova, size));
            if f.abort || hit || f.stopping {
                // Stopping: not executed, so set aside by `run_job`.
                let first = program.steps.first().map_or(opb.program, |s| s.ccw_addr);
                return ending(fail(Fault::Aborted, first, 0));
            }
            f.phase = Phase::Pinned(pfns);
        }
        let ending = |done| Ending {
            done,
            status_addr,
            executed: true,
        };
        let pinned = match PinnedPages::pin(&self.dma, pages, &self.shared.pins_held) {
            Ok(p) => p,
            Err((pages, failure)) => {
                self.shared.set_phase(Phase::Finishing);
                let (fault, ccw_addr, residual) = pin_fault(&program, &pages, &failure);
                tracing::warn!(error = %failure.error, ?fault, ccw_addr, "ccw: pin failed");
                return ending(fail(fault, ccw_addr, residual));
            }
        };
        let aborted = || self.shared.flight().abort;
        let mut done = {
            let mut sense = self.shared.sense();
            execute(&program, &pinned, &self.image, &mut sense, &aborted)
        };
        pinned.release();
        self.shared.set_phase(Phase::Finishing);

        if done.fault == Fault::None && opb.flags & opb_flags::FLUSH != 0 {
            if let Err(e) = self.image.sync_data() {
                tracing::warn!(error = %e, "ccw: image flush failed");
                done.fault = Fault::ImageIo;
            }
        }
        ending(done)
    }

    /// Store status, update registers, interrupt — unless the program was discarded by a
    /// reset or disconnect, or the device is stopping (then the completion is captured for
    /// the device, see the module doc). The phase goes back to `Idle` only after the
    /// interrupt, so a stop that waits for `Idle` never sees an interrupt after it.
    fn finish(&self, epoch: u64, ending: Ending) {
        let done = ending.done;
        if self.shared.epoch() != epoch {
            self.shared.set_phase(Phase::Idle);
            return;
        }
        if self.capture(epoch, &ending) {
            return;
        }
        let (dstat, cstat) = done.fault.status();
        let seq = self.shared.completed.load(Ordering::SeqCst).wrapping_add(1);
        let block = StatusBlock {
            device_status: dstat,
            channel_status: cstat,
            residual: done.residual,
            fault: done.fault.code(),
            ccw_addr: done.ccw_addr,
            transferred: done.transferred,
            sequence: seq,
        };
        let stored = match ending.status_addr {
            Some(addr) => match self.dma.write(addr, &block.to_bytes()) {
                Ok(()) => true,
                Err(e) if e.is_cancelled() && self.capture(epoch, &ending) => {
                    // The server cancelled a DMA_WRITE to the client for a migration stop:
                    // delivered (written again, whole) after RUNNING.
                    return;
                }
                Err(e) => {
                    tracing::warn!(addr, error = %e, "ccw: cannot store status block");
                    false
                }
            },
            None => false,
        };
        if done.fault != Fault::None {
            tracing::warn!(fault = ?done.fault, ccw = done.ccw_addr, "ccw: program ended with error");
        }
        let fire = {
            let f = self.shared.flight();
            let current = f.epoch == epoch;
            if current {
                let last =
                    u32::from(dstat) | u32::from(cstat) << 8 | u32::from(done.fault.code()) << 16;
                self.shared.last_status.store(last, Ordering::SeqCst);
                self.shared.completed.store(seq, Ordering::SeqCst);
                let bits = if stored {
                    IRQ_DONE
                } else {
                    IRQ_DONE | IRQ_STATUS_LOST
                };
                self.shared.irq_status.fetch_or(bits, Ordering::SeqCst);
                self.shared.busy.store(false, Ordering::SeqCst);
            }
            current
        };
        if fire {
            self.irq.trigger(0);
        }
        self.shared.set_phase(Phase::Idle);
    }
}

/// Classify a pin failure: which fault, and which CCW.
fn pin_fault(
    program: &super::program::Program,
    pages: &ProgramPages,
    failure: &PinFailure,
) -> (Fault, u64, u16) {
    let (fault, iova) = classify_dma_error(&failure.error);
    let step = iova
        .and_then(|a| pages.step_of(failure.dir, a / umdev::dma::PAGE_SIZE))
        .or_else(|| {
            // Unknown page: blame the first step of the failing direction.
            pages
                .extents
                .iter()
                .position(|e| e.iter().any(|ep| ep.dir == failure.dir))
        });
    match step.and_then(|s| program.steps.get(s)) {
        Some(s) => (fault, s.ccw_addr, s.count),
        None => (fault, 0, 0),
    }
}

/// Map a DMA error to a fault and, if known, the failing IOVA.
fn classify_dma_error(e: &DmaError) -> (Fault, Option<u64>) {
    match e {
        DmaError::NotMapped { iova } | DmaError::FdLess { iova } => {
            (Fault::DataAddressInvalid, Some(*iova))
        }
        DmaError::Permission { iova, .. } => (Fault::DataProtection, Some(*iova)),
        DmaError::Overflow { .. } => (Fault::DataAddressInvalid, None),
        DmaError::BusMasterDisabled { iova } => (Fault::BusMasterOff, Some(*iova)),
        _ => (Fault::PinFailed, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_unmap_while_validating_records_range_without_waiting() {
        let s = Shared::default();
        s.flight().phase = Phase::Validating;
        s.unmap(0x1000, 0x2000);
        let f = s.flight();
        assert_eq!(f.unmapped, vec![(0x1000, 0x2000)]);
        assert!(!f.abort);
    }

    #[test]
    fn test_unmap_of_other_range_does_not_abort() {
        let s = Shared::default();
        s.flight().phase = Phase::Pinned(vec![5, 6]);
        s.unmap(0x10_0000, 0x1000);
        assert!(!s.flight().abort);
    }

    #[test]
    fn test_unmap_of_pinned_range_aborts_and_waits_for_release() {
        let s = Arc::new(Shared::default());
        s.flight().phase = Phase::Pinned(vec![5, 6]);
        let s2 = s.clone();
        let worker = std::thread::spawn(move || {
            // The "worker": notice the abort, release, move on.
            assert!(s2.wait_until(|f| f.abort));
            s2.set_phase(Phase::Finishing);
        });
        s.unmap(6 * 4096, 4096);
        assert!(matches!(s.flight().phase, Phase::Finishing));
        worker.join().unwrap();
    }

    #[test]
    fn test_cancel_all_bumps_epoch_and_clears_busy() {
        let s = Shared::default();
        s.busy.store(true, Ordering::SeqCst);
        let e = s.epoch();
        let (tx, rx) = crossbeam_channel::bounded(1);
        tx.send(Job {
            task: Task::Start { opb_addr: 0 },
            epoch: e,
        })
        .unwrap();
        s.cancel_all(Some(&rx));
        assert_eq!(s.epoch(), e + 1);
        assert!(!s.busy.load(Ordering::SeqCst));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn test_classify_dma_error_maps_permission_and_limit() {
        let e = DmaError::Permission {
            iova: 0x5000,
            need: umdev::dma::Prot::WRITE,
            have: umdev::dma::Prot::READ,
        };
        assert_eq!(
            classify_dma_error(&e),
            (Fault::DataProtection, Some(0x5000))
        );
        let e = DmaError::LimitExceeded {
            locked: 1,
            more: 2,
            limit: 2,
        };
        assert_eq!(classify_dma_error(&e), (Fault::PinFailed, None));
        let e = DmaError::BusMasterDisabled { iova: 0x7000 };
        assert_eq!(classify_dma_error(&e), (Fault::BusMasterOff, Some(0x7000)));
    }
}
