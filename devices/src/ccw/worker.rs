//! The worker thread that runs channel programs, and the state it shares with the
//! connection thread.
//!
//! The START doorbell (connection thread) only queues a [`Job`] on a crossbeam channel; the
//! worker reads the operation block, validates the whole program, pins its pages, runs the
//! I/O, unpins, stores the status block and interrupts. The connection thread synchronises
//! with it through [`Flight`] (what phase the current program is in, and which pages it
//! pins), so that DMA unmap, reset and disconnect can abort it and wait until it holds no
//! pins.

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

/// One submitted operation block.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// Guest address of the operation block.
    pub opb_addr: u64,
    /// The reset epoch the job was submitted in.
    pub epoch: u64,
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
            f.phase = Phase::Validating;
            f.abort = false;
            f.unmapped.clear();
        }
        let ending = self.program(job.epoch, job.opb_addr);
        self.finish(job, ending);
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
        let ending = |done| Ending { done, status_addr };
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
            if f.abort || hit {
                let first = program.steps.first().map_or(opb.program, |s| s.ccw_addr);
                return ending(fail(Fault::Aborted, first, 0));
            }
            f.phase = Phase::Pinned(pfns);
        }
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
    /// reset or disconnect.
    fn finish(&self, job: Job, ending: Ending) {
        let done = ending.done;
        if matches!(done.fault, Fault::OutOfRange | Fault::ImageIo) {
            *self.shared.sense() = unit_check_sense(done.fault, done.image_offset);
        }
        if self.shared.epoch() != job.epoch {
            self.shared.set_phase(Phase::Idle);
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
            let mut f = self.shared.flight();
            let current = f.epoch == job.epoch;
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
            f.phase = Phase::Idle;
            current
        };
        self.shared.flight_cv.notify_all();
        if fire {
            self.irq.trigger(0);
        }
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
            opb_addr: 0,
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
