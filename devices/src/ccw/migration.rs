//! Live migration of the ccw device ([`umdev::migration::Migrate`]).
//!
//! **What migrates**: the registers (OPB address, `IRQ_STATUS`, `LAST_STATUS`, `COMPLETED`,
//! the START_DROPPED status bit), the sense bytes, and the program in flight, if any
//! ([`InFlightV1`]). Not state: the pins (a program never holds pins across STOP), the
//! capacity and CCW limit (configuration: checked, not copied), and **the image**.
//!
//! **The image is shared storage.** The destination opens the same image file (the same
//! path on a shared file system, or the same block of shared storage): the data a program
//! wrote is in the image, not in the state. STOP flushes the image (`fdatasync`), so what
//! the source wrote is on stable storage before the destination can read it; the source
//! writes nothing after STOP. The state records the capacity in blocks, and a destination
//! whose image has another capacity refuses it (a different image, most likely); a
//! destination that opened another image of the same size cannot be told apart, which is
//! the operator's contract.
//!
//! **STOP and the program in flight** (the worker's side is in `worker.rs`): STOP waits
//! for a program whose pages are pinned to finish its I/O, and takes back whatever has not
//! happened yet — a START not started (or still validating: nothing of it happened), or
//! the completion of a program that ran (status block, registers, interrupt). That is
//! held while stopped, saved with the state, and at RUNNING run or delivered by whichever
//! device runs: the destination after a migration, the source after an aborted one. A
//! completion the worker was delivering when STOP came is delivered before STOP returns.
//! So the guest sees each program complete exactly once, before STOP or after RUNNING,
//! and no interrupt, DMA or register change happens between the two. While stopped, a
//! START is held the same way.
//!
//! **Load** checks everything before it changes anything; a refused state leaves the
//! device reset, as the trait asks. The format is versioned: [`STATE_FORMAT`] version
//! [`STATE_VERSION`] ([`CcwStateV1`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use umdev::migration::{decode_state, encode_state, Migrate, MigrationError};
use umdev::pci::PciDevice;

use super::format::SENSE_SIZE;
use super::io::Completion;
use super::regs::IRQ_ALL;
use super::status::Fault;
use super::worker::{Captured, Job, Phase, Task};
use super::Ccw;

/// Name of the ccw device's state format.
pub const STATE_FORMAT: &str = "umdev-ccw";
/// Version of the state format this build writes.
pub const STATE_VERSION: u32 = 1;
/// Oldest state version this build reads.
pub const STATE_VERSION_MIN: u32 = 1;

/// How often a long wait of STOP for the running program is logged.
/// The largest encoded [`CcwStateV1`]: a fixed set of registers, no sequence (the
/// unit test checks the state with every field at its largest against it).
pub const MAX_STATE_SIZE: u64 = 512;

const STOP_LOG_INTERVAL: Duration = Duration::from_secs(2);
/// How long STOP waits for the running program (its image I/O) before it fails.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The device state, version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CcwStateV1 {
    /// Capacity of the source's image in 512-byte blocks (the destination's must match).
    pub capacity_blocks: u64,
    /// `OPB_ADDR`.
    pub opb_addr: u64,
    /// `STATUS.START_DROPPED`.
    pub start_dropped: bool,
    /// `IRQ_STATUS`.
    pub irq_status: u32,
    /// `LAST_STATUS`.
    pub last_status: u32,
    /// `COMPLETED`.
    pub completed: u32,
    /// The sense bytes.
    pub sense: [u8; SENSE_SIZE],
    /// The program in flight (`STATUS.BUSY` is set while there is one).
    pub in_flight: Option<InFlightV1>,
}

/// A program in flight at STOP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InFlightV1 {
    /// Accepted by START, nothing done yet: run it from its operation block.
    Start {
        /// Guest address of the operation block.
        opb_addr: u64,
    },
    /// Ran: store this status block, update the registers, interrupt.
    Deliver {
        /// Where the status block goes (`None`: it cannot be stored; `IRQ_STATUS_LOST`).
        status_addr: Option<u64>,
        /// Fault code ([`Fault::code`]).
        fault: u16,
        /// Last or failing CCW.
        ccw_addr: u64,
        /// Its residual count.
        residual: u16,
        /// Bytes transferred.
        transferred: u64,
    },
}

impl InFlightV1 {
    fn from_task(task: Task) -> InFlightV1 {
        match task {
            Task::Start { opb_addr } => InFlightV1::Start { opb_addr },
            Task::Deliver(c) => InFlightV1::Deliver {
                status_addr: c.status_addr,
                fault: c.done.fault.code(),
                ccw_addr: c.done.ccw_addr,
                residual: c.done.residual,
                transferred: c.done.transferred,
            },
        }
    }

    fn to_task(&self) -> Result<Task, MigrationError> {
        Ok(match *self {
            InFlightV1::Start { opb_addr } => Task::Start { opb_addr },
            InFlightV1::Deliver {
                status_addr,
                fault,
                ccw_addr,
                residual,
                transferred,
            } => {
                let fault = Fault::from_code(fault).ok_or_else(|| MigrationError::Malformed {
                    format: STATE_FORMAT.to_owned(),
                    why: format!("unknown fault code {fault} in the program in flight"),
                })?;
                Task::Deliver(Captured {
                    status_addr,
                    done: Completion {
                        fault,
                        ccw_addr,
                        residual,
                        transferred,
                        image_offset: 0,
                    },
                })
            }
        })
    }
}

impl Ccw {
    /// Hand the held program to the worker (busy stays set). Without a worker it stays
    /// held until attach.
    pub(super) fn submit_held(&mut self) {
        let Some(tx) = &self.tx else {
            return;
        };
        let Some(task) = self.held.take() else {
            return;
        };
        let job = Job {
            task,
            epoch: self.shared.epoch(),
        };
        if let Err(e) = tx.try_send(job) {
            // The queue holds at most the one job of the program in flight, and that is
            // this one: not reachable. Keep it rather than lose a completion.
            tracing::error!("ccw: cannot queue the held program");
            self.held = Some(e.into_inner().task);
        }
    }

    fn check_state(&self, s: &CcwStateV1) -> Result<Option<Task>, MigrationError> {
        if s.capacity_blocks != self.capacity_blocks {
            return Err(MigrationError::Incompatible(format!(
                "the state is of a {}-block image, this device's image has {} blocks \
                 (the destination must open the source's image)",
                s.capacity_blocks, self.capacity_blocks
            )));
        }
        if s.irq_status & !IRQ_ALL != 0 {
            return Err(MigrationError::Malformed {
                format: STATE_FORMAT.to_owned(),
                why: format!("undefined IRQ_STATUS bits {:#x}", s.irq_status),
            });
        }
        s.in_flight.as_ref().map(InFlightV1::to_task).transpose()
    }
}

impl Migrate for Ccw {
    /// The registers only (the image is the backing file's, not state): a few hundred
    /// bytes.
    fn max_state_size(&self) -> u64 {
        MAX_STATE_SIZE
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        self.shared.flight().stopping = true;
        self.shared.flight_cv.notify_all();
        let start = Instant::now();
        let mut logged = start;
        let mut f = self.shared.flight();
        loop {
            if matches!(f.phase, Phase::Idle) {
                if let Some(task) = f.set_aside.take() {
                    self.held = Some(task);
                    break;
                }
                if let Some(job) = self.rx.as_ref().and_then(|rx| rx.try_recv().ok()) {
                    if job.epoch == f.epoch {
                        self.held = Some(job.task);
                    }
                    break;
                }
                // Not busy: nothing in flight. Busy with nothing found: the worker has
                // the job in hand and will set it aside.
                if !self.shared.busy.load(Ordering::SeqCst) || self.held.is_some() {
                    break;
                }
            }
            let now = Instant::now();
            if now - start > STOP_TIMEOUT {
                return Err(MigrationError::Device(format!(
                    "ccw: the running program did not finish within {STOP_TIMEOUT:?}"
                )));
            }
            if now - logged > STOP_LOG_INTERVAL {
                tracing::warn!(waited = ?(now - start), "ccw: STOP still waits for the program");
                logged = now;
            }
            f = match self.shared.flight_cv.wait_timeout(f, STOP_LOG_INTERVAL) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        drop(f);
        // What the source wrote must be on the shared image before the destination reads.
        self.flush()
            .map_err(|e| MigrationError::Device(format!("ccw: flushing the image: {e}")))?;
        tracing::debug!(held = ?self.held, "ccw: stopped for migration");
        Ok(())
    }

    fn resume(&mut self) -> Result<(), MigrationError> {
        self.stopped = false;
        self.shared.flight().stopping = false;
        if self.held.is_some() {
            self.shared.busy.store(true, Ordering::SeqCst);
            self.submit_held();
        }
        tracing::debug!("ccw: running after migration stop");
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        self.stop()?;
        let s = &self.shared;
        let state = CcwStateV1 {
            capacity_blocks: self.capacity_blocks,
            opb_addr: self.opb_addr,
            start_dropped: self.start_dropped,
            irq_status: s.irq_status.load(Ordering::SeqCst),
            last_status: s.last_status.load(Ordering::SeqCst),
            completed: s.completed.load(Ordering::SeqCst),
            sense: *s.sense.lock().unwrap_or_else(|p| p.into_inner()),
            in_flight: self.held.map(InFlightV1::from_task),
        };
        tracing::info!(in_flight = ?state.in_flight, "ccw: state saved");
        encode_state(STATE_FORMAT, STATE_VERSION, &state)
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), MigrationError> {
        self.stop()?;
        let checked =
            decode_state::<CcwStateV1>(STATE_FORMAT, STATE_VERSION_MIN, STATE_VERSION, bytes)
                .and_then(|(_, s)| self.check_state(&s).map(|task| (s, task)));
        let (state, task) = match checked {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "ccw: migration state refused; the device is reset");
                PciDevice::reset(self);
                return Err(e);
            }
        };
        let s = &self.shared;
        self.opb_addr = state.opb_addr;
        self.start_dropped = state.start_dropped;
        s.irq_status.store(state.irq_status, Ordering::SeqCst);
        s.last_status.store(state.last_status, Ordering::SeqCst);
        s.completed.store(state.completed, Ordering::SeqCst);
        *s.sense.lock().unwrap_or_else(|p| p.into_inner()) = state.sense;
        self.held = task;
        s.busy.store(task.is_some(), Ordering::SeqCst);
        tracing::info!(in_flight = ?state.in_flight, "ccw: state loaded");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_in_flight_round_trips_and_unknown_fault_is_refused() {
        let task = Task::Deliver(Captured {
            status_addr: Some(0x1000),
            done: Completion {
                fault: Fault::DataProtection,
                ccw_addr: 0x2000,
                residual: 7,
                transferred: 4096,
                image_offset: 0,
            },
        });
        assert_eq!(InFlightV1::from_task(task).to_task().unwrap(), task);
        let start = Task::Start { opb_addr: 0x40 };
        assert_eq!(InFlightV1::from_task(start).to_task().unwrap(), start);
        let bad = InFlightV1::Deliver {
            status_addr: None,
            fault: Fault::ALL.len() as u16,
            ccw_addr: 0,
            residual: 0,
            transferred: 0,
        };
        assert!(matches!(
            bad.to_task(),
            Err(MigrationError::Malformed { .. })
        ));
    }

    #[test]
    fn test_ccw_state_at_its_largest_fits_max_state_size() {
        let state = CcwStateV1 {
            capacity_blocks: u64::MAX,
            opb_addr: u64::MAX,
            start_dropped: true,
            irq_status: u32::MAX,
            last_status: u32::MAX,
            completed: u32::MAX,
            sense: [0xff; SENSE_SIZE],
            in_flight: Some(InFlightV1::Deliver {
                status_addr: Some(u64::MAX),
                fault: u16::MAX,
                ccw_addr: u64::MAX,
                residual: u16::MAX,
                transferred: u64::MAX,
            }),
        };
        let bytes = encode_state(STATE_FORMAT, u32::MAX, &state).unwrap();
        assert!(
            bytes.len() as u64 <= MAX_STATE_SIZE,
            "{} bytes",
            bytes.len()
        );
    }
}
